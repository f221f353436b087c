"""Loading a sharded checkpoint at any world size: each rank re-slices what it needs.

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

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import dist as zdist
from ..optim.generic import checkpoint_index
from ..sharding.tiling import tiled_weights
from .files import TensorFileReader, read_metadata, sha256_file
from .manifest import (
    BUFFERS,
    MANIFEST,
    CheckpointError,
    check_files,
    rank_file_name,
    read_manifest,
    resolve_checkpoint,
)
from .quantized import exact_moments, read_dequantized, saved_quantized
from .state import persistent_buffers, set_rng_state

__all__ = ["CheckpointInfo", "RankFiles", "load_checkpoint", "open_checkpoint"]

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
        with_moments = {unit.index for _, unit, _, _ in optimizer.segments()}
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
            set_rng_state(reader, read_metadata(reader.path))
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
    for key, unit, start, end in optimizer.segments():
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
