"""Sharded checkpoints: every rank saves its own slices; loading re-slices for any world size.

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
the new one has its name (saving to a fixed ``name``, or the same step twice: the old one
used to be removed first). The
compute-dtype (bf16/fp16) copy is not saved: it is the master rounded to nearest even, both
at construction and after every optimizer step, so loading recomputes it exactly.
Gradients are not saved: save between optimizer steps.

[Note: loading at another world size]
Each rank builds, for each unit, its new slice ``[shard_start, shard_start + shard_numel)`` of
the unit's flat buffer from the parameters that overlap it: the part of a parameter in the new
slice is an element range of that parameter, and the manifest says which old rank file holds
which element range of it (``ranges``). The rank reads only those ranges, for the master
weights and both moments, then hands the slice to ``engine.load_unit_state``. Parameters are
matched by name, so the unit layout may differ too (another stage or ``unit_modules``).
Optimizer step counts are saved per parameter and given back per new segment. RNG states are
restored per rank when the world size is unchanged.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import dist as zdist
from ..optim.generic import checkpoint_index
from ..sharding.tiling import tiled_weights
from .files import (
    TensorFileReader,
    TensorFileWriter,
    TensorSpec,
    atomic_write_bytes,
    cannot_create,
    exchange_paths,
    fsync_dir,
    read_metadata,
    sha256_file,
    st_dtype,
)
from .manifest import (
    BUFFERS,
    FORMAT,
    LATEST,
    MANIFEST,
    MARKER,
    VERSION,
    CheckpointError,
    check_files,
    find_checkpoints,
    looks_like_checkpoint,
    param_ranges,
    rank_file_name,
    read_manifest,
    resolve_checkpoint,
)
from .quantized import exact_moments, read_dequantized, saved_quantized

__all__ = ["CheckpointInfo", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class CheckpointInfo:
    """What ``load_checkpoint`` loaded."""

    path: Path  # the checkpoint folder
    step: int
    world_size: int  # the world size it was saved at
    extra: dict | None  # the ``extra`` given to save_checkpoint


# ------------------------------------------------------------------------------- helpers
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


def _segments(optimizer):
    """(state key, unit, start, end) for every segment of a ZeroAdamW."""
    return optimizer.segments()


def _jsonable(obj, what: str):
    if obj is None:
        return None
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON-serializable ({exc}); zerotune checkpoints hold no pickle"
        ) from None


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state_dict would hold (non-persistent ones are rebuilt by the model)."""
    out, seen = [], set()
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def model_files(module: nn.Module) -> dict[str, bytes]:
    """config.json (and generation_config.json) of an HF model, as save_pretrained writes them."""
    out: dict[str, bytes] = {}
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string())
        data["architectures"] = [type(module).__name__]
        out["config.json"] = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    gen = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if gen is not None and hasattr(gen, "to_json_string") and callable(can_generate):
        if can_generate():
            out["generation_config.json"] = gen.to_json_string().encode()
    return out


def _rng_state() -> tuple[dict[str, torch.Tensor], str]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state.cpu()
    version, internal, gauss = random.getstate()
    states: dict = {"python": [version, list(internal), gauss]}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return tensors, json.dumps(states)


def _set_rng_state(reader: TensorFileReader, metadata: dict[str, str]) -> None:
    t = torch.empty(reader.entries["rng.torch"].nbytes, dtype=torch.uint8)
    reader.read("rng.torch", 0, t.numel(), t)
    torch.set_rng_state(t)
    if torch.cuda.is_available():
        cuda = sorted(k for k in reader.entries if k.startswith("rng.cuda."))
        for i, key in enumerate(cuda[: torch.cuda.device_count()]):
            t = torch.empty(reader.entries[key].nbytes, dtype=torch.uint8)
            reader.read(key, 0, t.numel(), t)
            torch.cuda.set_rng_state(t, i)
    states = json.loads(metadata.get("rng", "{}"))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


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
        for key, unit, start, end in _segments(optimizer):
            lo, hi = unit.shard_start + start, unit.shard_start + end
            step = optimizer.step_count(key)
            for k, s in enumerate(unit.slots):
                if s.offset < hi and s.offset + s.numel > lo:
                    j = base[unit.index] + k
                    local[j] = max(local[j], step)
    steps = torch.tensor(local, dtype=torch.int64, device=engine.device)
    _all_reduce_max(steps, engine.group)
    return steps.cpu()


# ---------------------------------------------------------------------------------- save
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
        with_moments = {unit.index for _, unit, _, _ in _segments(optimizer)}
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
    rng_tensors, rng_json = _rng_state()
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
        "optimizer": opt,
        "scheduler": scheduler_state,
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "extra": extra,
        "files": files,
    }


# ---------------------------------------------------------------------------------- load
def open_checkpoint(path: str | Path, verify: bool = False) -> tuple[Path, dict]:
    """Resolve ``path`` (see resolve_checkpoint), read and check its manifest and files; with
    ``verify`` also every checksum. Returns (folder, manifest)."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    check_files(folder, manifest)
    if verify:
        for fname, meta in sorted(manifest["files"].items()):
            if sha256_file(folder / fname) != meta["sha256"]:
                raise _checksum_error(folder / fname)
    return folder, manifest


def _checksum_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: checksum mismatch: the file is corrupt or was changed after the save"
    )


def _verify_distributed(engine, folder: Path, manifest: dict) -> None:
    """Each file's sha256 is checked by one rank; every rank raises for the first bad file."""
    names = sorted(manifest["files"])
    bad = torch.zeros(max(len(names), 1), dtype=torch.int64, device=engine.device)
    for i, fname in enumerate(names):
        if i % engine.world == engine.rank:
            if sha256_file(folder / fname) != manifest["files"][fname]["sha256"]:
                bad[i] = 1
    zdist.all_reduce_sum(bad, engine.group)
    for i, fname in enumerate(names):
        if bad[i]:
            raise _checksum_error(folder / fname)


def _check_tiling(engine, manifest: dict, folder: Path) -> None:
    """Tiles are saved as parameters of their own: the tiling must be the same."""
    saved = manifest.get("tiled") or []
    mine = [tw.to_json() for tw in tiled_weights(engine.module)]
    if saved != mine:
        was = manifest.get("config", {}).get("tile_linear_bytes", 0)
        raise CheckpointError(
            f"{folder / MANIFEST}: the checkpoint's tiled linear layers differ from this "
            f"model's ({len(saved)} saved with tile_linear_bytes={was}, {len(mine)} here with "
            f"tile_linear_bytes={engine.config.tile_linear_bytes}): resume with the same "
            "tile_linear_bytes, or export the checkpoint (zerotune export) and load that folder"
        )


def _match_params(engine, manifest: dict, folder: Path) -> dict[int, list[dict]]:
    """The manifest record of every slot, by unit index; raises if the models differ."""
    records, by_alias = {}, {}
    for rec in manifest["params"]:
        records[rec["name"]] = rec
        for a in rec.get("aliases", ()):
            by_alias[a] = rec["name"]
    names: dict[int, list[str]] = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out: dict[int, list[dict]] = {}
    used, missing, shapes = set(), [], []
    for unit in engine.units:
        out[unit.index] = []
        for s in unit.slots:
            rec = None
            for n in [s.name, *names.get(id(s.param), [])]:
                key = n if n in records else by_alias.get(n)
                if key is not None:
                    rec = records[key]
                    break
            if rec is None:
                missing.append(s.name)
                out[unit.index].append(None)
                continue
            used.add(rec["name"])
            if list(rec["shape"]) != list(s.shape):
                shapes.append(f"{s.name}: {rec['shape']} saved, {list(s.shape)} in the model")
            out[unit.index].append(rec)
    unexpected = [n for n in records if n not in used]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"{len(shapes)} shape(s) differ, e.g. {shapes[:2]}")
        if missing:
            parts.append(f"{len(missing)} model parameter(s) not saved, e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"{len(unexpected)} saved parameter(s) not in the model: {unexpected[:3]}")
        raise CheckpointError(
            f"{folder / MANIFEST}: the checkpoint is of a different model: " + "; ".join(parts)
        )
    return out


class RankFiles:
    """Readers of the old rank files, opened on first use."""

    def __init__(self, folder: Path, world: int):
        self.folder, self.world = folder, world
        self._readers: dict[int, TensorFileReader] = {}

    def __getitem__(self, rank: int) -> TensorFileReader:
        if rank not in self._readers:
            self._readers[rank] = TensorFileReader(self.folder / rank_file_name(rank, self.world))
        return self._readers[rank]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()


def load_checkpoint(
    engine,
    path: str | Path,
    *,
    optimizer=None,
    scheduler=None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint saved at any world size into ``engine`` (every rank must call).

    path: a checkpoint folder, or the folder holding checkpoints (the one ``latest`` names,
        else the newest complete one; see resolve_checkpoint), or its ``latest`` file.
    optimizer: default ``engine.optimizer``; create it before loading to restore its state.
    verify: check every file's sha256 (each file is read by one rank).
    Raises CheckpointError, naming the file, for a missing, corrupt or incomplete checkpoint or
    one of another model. See [Note: loading at another world size].
    """
    folder, manifest = open_checkpoint(path)
    _check_tiling(engine, manifest, folder)
    records = _match_params(engine, manifest, folder)
    if verify:
        _verify_distributed(engine, folder, manifest)
    if optimizer is None:
        optimizer = getattr(engine, "optimizer", None)
    saved_opt = manifest.get("optimizer")
    restore_opt = load_optimizer and optimizer is not None and saved_opt is not None
    if load_optimizer and saved_opt is not None and optimizer is None:
        log.warning(
            "zerotune: %s holds optimizer state but the engine has no optimizer yet; create "
            "the optimizer before load_checkpoint to restore it",
            folder,
        )
    if load_optimizer and saved_opt is None and optimizer is not None:
        log.warning("zerotune: %s has no optimizer state; the optimizer starts fresh", folder)
    if restore_opt and len(saved_opt["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{folder / MANIFEST}: the saved optimizer has {len(saved_opt['groups'])} parameter "
            f"group(s), this one {len(optimizer.param_groups)}"
        )

    generic = getattr(optimizer, "optimizer_class", None) is not None
    if restore_opt:
        inner = (
            f"{optimizer.optimizer_class.__module__}.{optimizer.optimizer_class.__qualname__}"
            if generic
            else None
        )
        if saved_opt.get("inner") != inner:
            raise CheckpointError(
                f"{folder / MANIFEST}: the optimizer state was saved by "
                f"{saved_opt.get('inner') or 'ZeroAdamW'}, this run uses {inner or 'ZeroAdamW'}; "
                "load it with load_optimizer=False to start the optimizer state fresh"
            )
        if generic and saved_opt.get("layout") != optimizer.layout:
            raise CheckpointError(
                f"{folder / MANIFEST}: the optimizer state was saved with layout="
                f"{saved_opt.get('layout')!r}, this ZeroOptimizer has layout={optimizer.layout!r}; "
                "build it with the saved layout, or load with load_optimizer=False"
            )
    with_moments = set()
    if restore_opt:
        with_moments = {unit.index for _, unit, _, _ in _segments(optimizer)}
        saved_bits = manifest["config"].get("optim_state_bits", 32)
        if saved_bits != engine.config.optim_state_bits:
            log.info(
                "zerotune: %s holds %d-bit Adam moments; converting them for this %d-bit run",
                folder,
                saved_bits,
                engine.config.optim_state_bits,
            )
    files = RankFiles(folder, manifest["world_size"])
    try:
        saved_keys = _saved_state_keys(files, manifest["world_size"]) if generic else {}
        for unit in engine.units:
            keys = ["master", *_MOMENTS] if unit.index in with_moments else ["master"]
            dtypes = {}
            if generic:  # a ZeroOptimizer's per-element state (state.<key>)
                old = {rec["unit"] for rec in records[unit.index] if rec is not None}
                dtypes = {k: d for (u, k), d in saved_keys.items() if u in old}
                keys = ["master", *dtypes] if unit.index in with_moments else ["master"]
            exact = {}  # 8-bit moments loaded as saved (see [Note: 8-bit moments in checkpoints])
            if unit.index in with_moments:
                exact = exact_moments(engine, optimizer, unit, manifest, records[unit.index], files)
            # Staged on the host (where the files land); load_unit_state copies to the tier.
            staged = {
                k: torch.zeros(unit.shard_numel, dtype=dtypes.get(k, torch.float32))
                for k in keys
                if not (exact and k in _MOMENTS)
            }
            _read_slice(unit, records[unit.index], files, staged)
            engine.load_unit_state(unit, {**staged, **exact})
        if restore_opt and generic:
            metadata = [read_metadata(files[r].path) for r in range(manifest["world_size"])]
            optimizer.load_state(checkpoint_index(metadata), lambda r, name: files[r].whole(name))
        if load_rng and manifest["world_size"] == engine.world:
            reader = files[engine.rank]
            _set_rng_state(reader, read_metadata(reader.path))
        elif load_rng:
            log.info(
                "zerotune: saved at world size %d, loaded at %d: RNG states are not restored",
                manifest["world_size"],
                engine.world,
            )
    finally:
        files.close()
    _load_buffers(engine, folder, manifest)
    if restore_opt:
        _restore_optimizer(optimizer, saved_opt, records)
    if scheduler is not None:
        if manifest.get("scheduler") is None:
            log.warning("zerotune: %s has no scheduler state; the scheduler starts fresh", folder)
        else:
            scheduler.load_state_dict(manifest["scheduler"])
    if engine.scaler is not None and manifest.get("scaler") is not None:
        engine.scaler.load_state_dict(manifest["scaler"])
    log.info(
        "zerotune: loaded checkpoint %s (step %d, saved at world size %d)",
        folder,
        manifest["step"],
        manifest["world_size"],
    )
    return CheckpointInfo(folder, manifest["step"], manifest["world_size"], manifest.get("extra"))


def _saved_state_keys(files: RankFiles, world: int) -> dict[tuple[int, str], torch.dtype]:
    """(old unit index, ``state.<key>``) -> dtype of a ZeroOptimizer's per-element state in
    the rank files."""
    out = {}
    for r in range(world):
        for name, entry in files[r].entries.items():
            unit, dot, key = name.partition(".")
            if dot and unit[:1] == "u" and unit[1:].isdigit() and key.startswith("state."):
                out[(int(unit[1:]), key)] = entry.dtype
    return out


def _read_slice(unit, records: list[dict], files: RankFiles, staged: dict) -> None:
    """Fill this rank's new slice of ``unit`` from the old rank files (see [Note: loading at
    another world size])."""
    lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
    for s, rec in zip(unit.slots, records):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b:
            continue
        pa, pb = a - s.offset, b - s.offset  # element range of the parameter
        for rank, ps, pe, at in rec["ranges"]:
            x, y = max(pa, ps), min(pb, pe)
            if x >= y:
                continue
            reader = files[rank]
            dest = slice(s.offset + x - lo, s.offset + y - lo)
            for key, out in staged.items():
                name = f"u{rec['unit']}.{key}"
                if key != "master" and saved_quantized(reader, name):
                    read_dequantized(reader, name, at + x - ps, at + y - ps, out[dest])
                    continue
                if key != "master" and name not in reader:
                    continue  # that rank held no optimized parameter of the unit: zeros
                reader.read(name, at + x - ps, at + y - ps, out[dest])


def _restore_optimizer(optimizer, saved: dict, records: dict[int, list[dict]]) -> None:
    for group, hyper in zip(optimizer.param_groups, saved["groups"]):
        for k, v in hyper.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    for key, unit, start, end in _segments(optimizer):
        lo, hi = unit.shard_start + start, unit.shard_start + end
        step = 0
        for s, rec in zip(unit.slots, records[unit.index]):
            if s.offset < hi and s.offset + s.numel > lo:
                step = max(step, int(rec["step"]))
        optimizer.set_step_count(key, step)


def _load_buffers(engine, folder: Path, manifest: dict) -> None:
    buffers = persistent_buffers(engine.module)
    saved = set(manifest.get("buffers") or ())
    if not buffers or not saved:
        return
    reader = TensorFileReader(folder / BUFFERS)
    try:
        for name, buf in buffers:
            if name not in saved or name not in reader:
                log.warning("zerotune: buffer %s is not in %s; it keeps its value", name, folder)
                continue
            e = reader.entries[name]
            if tuple(e.shape) != tuple(buf.shape):
                raise CheckpointError(
                    f"{reader.path}: buffer {name!r} has shape {list(e.shape)}, "
                    f"the model {list(buf.shape)}"
                )
            tmp = torch.empty(buf.numel(), dtype=e.dtype)
            reader.read(name, 0, buf.numel(), tmp)
            with torch.no_grad():
                buf.copy_(tmp.view(buf.shape))
    finally:
        reader.close()
