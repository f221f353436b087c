"""Saving a sharded checkpoint: every rank writes its own slices.

[Note: saving a checkpoint]
Three phases, each ended by a collective that also carries every rank's success, so one
rank's failure (a full disk) makes every rank raise instead of hanging in the next phase:
1. rank 0 prepares ``root/.writing-<name>/``, a hidden folder that loading never looks at
   (a hidden folder of that name left by a killed save is removed first);
2. every rank writes ``rank-R-of-W.safetensors``: for each unit its fp32 master slice and the
   two Adam moments (see ``engine.unit_state``; 8-bit moments as codes and absmax values,
   see [Note: 8-bit moments in checkpoints] in quantized.py), its torch RNG state as a
   tensor and the Python and numpy RNG states as JSON metadata; a temporary name, fsync,
   rename. The collective gathers each file's size and sha256 to rank 0;
3. rank 0 writes persistent buffers, config.json (+ generation config, tokenizer files), the
   manifest (see [Note: checkpoint layout] in manifest.py), then ``COMPLETE``; renames the
   folder to ``root/<name>`` (an older checkpoint of that name is swapped out in one atomic
   ``renameat2`` exchange, then removed), writes the root's ``latest`` pointer, and finally
   drops checkpoints beyond ``keep_last``.
A process killed anywhere leaves the previous checkpoint complete and pointed at, also when
the new one has its name (saving to a fixed ``name``, or the same step twice). The
compute-dtype (bf16/fp16) copy is not saved: it is the master rounded to nearest even, both
at construction and after every optimizer step, so loading recomputes it exactly.
Gradients are not saved: save between optimizer steps.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from .. import dist as zdist
from ..sharding.tiling import tiled_weights
from .files import (
    TensorFileWriter,
    TensorSpec,
    atomic_write_bytes,
    cannot_create,
    exchange_paths,
    fsync_dir,
    sha256_file,
    st_dtype,
)
from .hub_layout import has_hub_layout
from .manifest import (
    BUFFERS,
    FORMAT,
    LATEST,
    MANIFEST,
    MARKER,
    VERSION,
    CheckpointError,
    find_checkpoints,
    looks_like_checkpoint,
    param_ranges,
    rank_file_name,
)
from .state import model_files, persistent_buffers, rng_state

__all__ = ["agree_on_failure", "save_checkpoint"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())


def agree_on_failure(engine, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed; all raise together (see [Note: saving a
    checkpoint])."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=engine.device)
    zdist.all_reduce_sum(flag, engine.group)
    if error is not None:
        raise _one_line(error, what)
    if flag.item():
        raise CheckpointError(f"{what} failed on another rank (its error says why)")


def _one_line(error: BaseException, what: str) -> BaseException:
    """An operating system error of a save (a full disk, a lost permission) as one
    CheckpointError naming what failed; other errors as they are."""
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""
        why = error.strerror or str(error)
        return CheckpointError(f"{what} failed: {why}{where}")
    return error


def _all_reduce_max(t: torch.Tensor, group) -> None:
    if zdist.get_world_size(group) > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)


def _jsonable(obj, what: str):
    if obj is None:
        return None
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON-serializable ({exc}); zerotune checkpoints hold no pickle"
        ) from None


def _all_slots(engine):
    return [(u, s) for u in engine.units for s in u.slots]


def _param_steps(engine, optimizer) -> torch.Tensor:
    """Each parameter's Adam step count (-1: not optimized), the same on every rank."""
    slots = _all_slots(engine)
    base, i = {}, 0
    for u in engine.units:
        base[u.index] = i
        i += len(u.slots)
    local = [-1] * len(slots)
    if optimizer is not None:
        for key, unit, start, end in optimizer.segments():
            lo, hi = unit.shard_start + start, unit.shard_start + end
            step = optimizer.step_count(key)
            for k, s in enumerate(unit.slots):
                if s.offset < hi and s.offset + s.numel > lo:
                    j = base[unit.index] + k
                    local[j] = max(local[j], step)
    steps = torch.tensor(local, dtype=torch.int64, device=engine.device)
    _all_reduce_max(steps, engine.group)
    return steps.cpu()


def save_checkpoint(
    engine,
    directory: str | Path,
    *,
    step: int | None = None,
    optimizer=None,
    include_optimizer: bool = True,
    scheduler=None,
    tokenizer=None,
    extra_files: Iterable[str | Path] = (),
    extra: dict | None = None,
    keep_last: int | None = None,
    name: str | None = None,
) -> Path:
    """Save a sharded checkpoint into ``directory/<name>`` (default ``step-<step>``) and point
    ``directory/latest`` at it; every rank must call. See [Note: saving a checkpoint].

    step: the training step (default: the optimizer's largest step count).
    optimizer: a ZeroAdamW (default ``engine.optimizer``); its moments, step counts and
        hyper-parameters are saved unless ``include_optimizer=False``.
    scheduler: an LR scheduler whose ``state_dict()`` is JSON (torch's are).
    tokenizer: saved with ``save_pretrained`` into the checkpoint (exported with the model);
        ``extra_files``: more files to copy in (tokenizer files of the original model, say).
    extra: a JSON-serializable dict returned by ``load_checkpoint`` (data position, ...).
    keep_last: keep only this many complete checkpoints under ``directory``; interrupted
        saves older than this one are removed as well.
    Returns the checkpoint folder.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be at least 1")
    if optimizer is None and include_optimizer:
        optimizer = getattr(engine, "optimizer", None)
    if not include_optimizer:
        optimizer = None
    root = Path(directory)
    steps = _param_steps(engine, optimizer)
    if step is None:
        step = max(int(steps.max()) if steps.numel() else 0, 0)
    name = name or f"step-{step:08d}"
    folder = root / name
    # Written under a hidden name and moved into place once complete: a checkpoint of the
    # same name already there stays whole until then (see [Note: saving a checkpoint]).
    staged = root / (_STAGED + name)
    scheduler_state = _jsonable(scheduler.state_dict(), "scheduler state") if scheduler else None
    extra = _jsonable(extra, "extra")
    extra_files = [Path(p) for p in extra_files]

    error = None
    if engine.rank == 0:
        try:
            _prepare_folder(root, staged)
        except Exception as exc:  # noqa: BLE001 - re-raised by agree_on_failure on every rank
            error = exc
    agree_on_failure(engine, error, f"preparing {folder}")

    # Phase 2: every rank's file; the sum-reduce carries (ok, size, sha256 as 4 int64).
    table = torch.zeros(engine.world, 6, dtype=torch.int64, device=engine.device)
    error = None
    try:
        digest, size = _write_rank_file(engine, staged, optimizer)
        words = np.frombuffer(bytes.fromhex(digest), dtype=np.int64).tolist()
        table[engine.rank] = torch.tensor([1, size, *words], dtype=torch.int64)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective
        error = exc
    zdist.all_reduce_sum(table, engine.group)
    table = table.cpu()
    failed = [r for r in range(engine.world) if table[r, 0] != 1]
    if failed and engine.rank == 0:
        shutil.rmtree(staged, ignore_errors=True)  # every rank is done writing into it
    if error is not None:
        raise _one_line(error, f"writing {folder}")
    if failed:
        raise CheckpointError(f"writing {folder} failed on rank(s) {failed} (their errors say why)")

    error = None
    if engine.rank == 0:
        moving = False  # once the folder is being renamed into place, nothing is removed
        try:
            files = {}
            for r in range(engine.world):
                sha = np.asarray(table[r, 2:].tolist(), dtype=np.int64).tobytes().hex()
                files[rank_file_name(r, engine.world)] = {
                    "sha256": sha,
                    "bytes": int(table[r, 1]),
                    "kind": "rank",
                }
            files.update(_write_side_files(engine, staged, tokenizer, extra_files))
            manifest = _build_manifest(
                engine, step, steps, files, optimizer, scheduler_state, extra
            )
            text = json.dumps(manifest, indent=1).encode()
            digest = atomic_write_bytes(staged / MANIFEST, text)
            marker = {"manifest_sha256": digest, "step": step, "format": FORMAT}
            atomic_write_bytes(staged / MARKER, json.dumps(marker).encode())
            moving = True
            _move_into_place(staged, folder)
            atomic_write_bytes(root / LATEST, (name + "\n").encode())
            if keep_last is not None:
                _rotate(root, keep_last, folder)
        except Exception as exc:  # noqa: BLE001 - re-raised by agree_on_failure on every rank
            error = exc
            if moving:
                _settle_failed_move(folder)
            shutil.rmtree(staged, ignore_errors=True)  # a failed save leaves no folder behind
    agree_on_failure(engine, error, f"finishing {folder}")
    log.info("zerotune: saved checkpoint %s (step %d, world size %d)", folder, step, engine.world)
    return folder


def _prepare_folder(root: Path, folder: Path) -> None:
    if looks_like_checkpoint(root):
        raise CheckpointError(
            f"{root} is a checkpoint folder; save into its parent (checkpoints go in "
            "subfolders of one root, next to a 'latest' pointer)"
        )
    reason = cannot_create(root)  # a file in its place or above it, no permission
    if reason is not None:
        raise CheckpointError(f"cannot save a checkpoint into {root}: {reason}")
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):
        stale.unlink(missing_ok=True)  # a pointer update cut short by a kill
    if folder.exists():
        _remove_checkpoint(folder)
    folder.mkdir()
    fsync_dir(root)


_TRASH = ".removing-"  # a checkpoint being removed (hidden: find_checkpoints skips it)
_STAGED = ".writing-"  # a checkpoint being written (hidden until complete)


def _move_into_place(staged: Path, folder: Path) -> None:
    """Give the complete checkpoint ``staged`` its name. An older checkpoint of that name
    is swapped out in one atomic step where the filesystem can (renameat2), else renamed
    away just before; then removed."""
    if not folder.exists():
        staged.rename(folder)
    elif exchange_paths(staged, folder):
        _remove_checkpoint(staged)  # now the old one
    else:
        trash = folder.with_name(_TRASH + folder.name)
        shutil.rmtree(trash, ignore_errors=True)
        folder.rename(trash)
        staged.rename(folder)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(folder.parent)


def _settle_failed_move(folder: Path) -> None:
    """``_move_into_place`` failed: an older checkpoint of the name that was renamed away
    gets its name back (the new one, still staged, is then removed)."""
    trash = folder.with_name(_TRASH + folder.name)
    if not folder.exists() and trash.is_dir():
        try:
            trash.rename(folder)
        except OSError:
            pass


def _remove_checkpoint(folder: Path) -> None:
    # The marker goes first: a removal cut short leaves an incomplete folder, never a
    # "complete" one with files missing. Then the folder is renamed to a hidden name and
    # removed: a removal cut short after its manifest and rank files were gone would
    # otherwise leave a folder that no longer looks like a checkpoint and is never removed
    # (the next rotation removes leftover hidden ones).
    (folder / MARKER).unlink(missing_ok=True)
    fsync_dir(folder)
    trash = folder.with_name(_TRASH + folder.name)
    try:
        folder.rename(trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def _rotate(root: Path, keep_last: int, current: Path) -> None:
    for left in [*root.glob(_TRASH + "*"), *root.glob(_STAGED + "*")]:
        shutil.rmtree(left, ignore_errors=True)  # removals and saves cut short by a kill
    found = find_checkpoints(root)
    names = [p for p, _ in found]
    at = names.index(current) if current in names else len(found)
    complete = [p for p, ok in found if ok]
    for p in complete[:-keep_last]:
        if p != current:
            _remove_checkpoint(p)
    for p, ok in found[:at]:
        if not ok and p.exists():
            _remove_checkpoint(p)  # an interrupted save, older than this one


def _write_rank_file(engine, folder: Path, optimizer) -> tuple[str, int]:
    # Unit state is fetched one unit at a time while writing (with NVMe offload it is read
    # from the swap file), so the header is planned from the units alone.
    with_moments = set()
    if optimizer is not None:
        with_moments = {unit.index for _, unit, _, _ in optimizer.segments()}
    specs: list[TensorSpec] = []
    units = [u for u in engine.units if u.shard_numel > 0]
    layouts = {}  # per unit: (key, dtype, elements), fp32 or 8-bit moments (see quantized.py)
    for unit in units:
        layouts[unit.index] = (
            optimizer.state_specs(unit)
            if unit.index in with_moments
            else [("master", torch.float32, unit.shard_numel)]
        )
        for key, dtype, n in layouts[unit.index]:
            specs.append(TensorSpec(f"u{unit.index}.{key}", dtype, (n,)))
    rng_tensors, rng_json = rng_state()
    for key, t in rng_tensors.items():
        specs.append(TensorSpec(key, t.dtype, tuple(t.shape)))
    metadata = {
        "format": FORMAT,
        "rank": engine.rank,
        "world_size": engine.world,
        "rng": rng_json,
    }
    # A generic optimizer's state kept per parameter (see [Note: any torch optimizer over
    # the shards] in optim/generic.py): tensors, and their index in the metadata.
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer is not None and hasattr(optimizer, "extra_state"):
        opt_tensors, opt_index = optimizer.extra_state()
        metadata["optimizer"] = json.dumps(opt_index)
        for key, t in opt_tensors.items():
            specs.append(TensorSpec(key, t.dtype, tuple(t.shape)))
    writer = TensorFileWriter(folder / rank_file_name(engine.rank, engine.world), specs, metadata)
    try:
        for unit in units:
            state = engine.unit_state(unit)
            for key, _, _ in layouts[unit.index]:
                writer.append(state[key])
            del state
        for t in rng_tensors.values():
            writer.append(t)
        for t in opt_tensors.values():
            writer.append(t)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _write_side_files(engine, folder: Path, tokenizer, extra_files: list[Path]) -> dict:
    files: dict[str, dict] = {}
    buffers = persistent_buffers(engine.module)
    if buffers:
        specs = [TensorSpec(n, b.dtype, tuple(b.shape)) for n, b in buffers]
        writer = TensorFileWriter(folder / BUFFERS, specs, {"format": FORMAT})
        try:
            for _, b in buffers:
                writer.append(b)
            sha, size = writer.commit()
        except BaseException:
            writer.abort()
            raise
        files[BUFFERS] = {"sha256": sha, "bytes": size, "kind": "buffers"}
    for fname, data in model_files(engine.module).items():
        sha = atomic_write_bytes(folder / fname, data)
        files[fname] = {"sha256": sha, "bytes": len(data), "kind": "model"}
    if tokenizer is not None:
        before = {p.name for p in folder.iterdir()}
        tokenizer.save_pretrained(str(folder))
        for p in sorted(folder.iterdir()):
            if p.name not in before and p.is_file():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
                sha, size = sha256_file(p), p.stat().st_size
                files[p.name] = {"sha256": sha, "bytes": size, "kind": "tokenizer"}
    for src in extra_files:
        if not src.is_file():
            raise CheckpointError(f"{src}: extra file not found")
        data = src.read_bytes()
        sha = atomic_write_bytes(folder / src.name, data)
        files[src.name] = {"sha256": sha, "bytes": len(data), "kind": "extra"}
    fsync_dir(folder)
    return files


def _build_manifest(engine, step, steps, files, optimizer, scheduler_state, extra) -> dict:
    import zerotune

    aliases: dict[int, list[str]] = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    params = []
    for i, (unit, s) in enumerate(_all_slots(engine)):
        params.append(
            {
                "name": s.name,
                "aliases": [n for n in aliases.get(id(s.param), []) if n != s.name],
                "shape": list(s.shape),
                "dtype": st_dtype(engine.config.torch_dtype),
                "unit": unit.index,
                "offset": s.offset,
                "numel": s.numel,
                "trainable": s.trainable,
                "step": int(steps[i]),
                "ranges": param_ranges(s.offset, s.numel, unit.shard_numel),
            }
        )
    units = [
        {
            "index": u.index,
            "name": u.name,
            "numel": u.numel,
            "padded_numel": u.padded_numel,
            "shard_numel": u.shard_numel,
        }
        for u in engine.units
    ]
    opt = None
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        opt = {"class": type(optimizer).__name__, "groups": _jsonable(groups, "optimizer groups")}
        inner = getattr(optimizer, "optimizer_class", None)
        if inner is not None:  # a ZeroOptimizer: the class it runs, and how
            opt["inner"] = f"{inner.__module__}.{inner.__qualname__}"
            opt["layout"] = optimizer.layout
    return {
        "format": FORMAT,
        "version": VERSION,
        "zerotune_version": zerotune.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": step,
        "world_size": engine.world,
        "stage": engine.config.stage,
        "dtype": engine.config.dtype,
        "master_dtype": "F32",
        "config": engine.config.to_dict(),
        "model": type(engine.module).__name__,
        "units": units,
        "params": params,
        "buffers": [n for n, _ in persistent_buffers(engine.module)],
        "tiled": [tw.to_json() for tw in tiled_weights(engine.module)],
        "hub_layout": has_hub_layout(engine.module),
        "optimizer": opt,
        "scheduler": scheduler_state,
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "extra": extra,
        "files": files,
    }
