"""Consolidation into an ordinary Hugging Face folder, streamed parameter by parameter.

[Note: streaming export]
``export_hf`` turns a sharded checkpoint (any world size) into what ``save_pretrained``
writes: config.json with ``dtype`` set, generation config and tokenizer files when the
checkpoint has them, ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` when the total exceeds ``max_shard_size``. The output layout
(which tensor goes to which file, at which byte offset) follows from the manifest alone, so
every header is written before any data (see [Note: streaming safetensors] in files.py);
names and tensors follow [Note: the hub layout on export] in hub_layout.py.
Each parameter is then read from the rank files' ranges (see [Note: checkpoint layout]) in
pieces of at most ``CHUNK_ELEMENTS``, converted, and appended to its file: memory stays at
one piece in fp32 plus its converted copy, whatever the model size. A tied weight is one
parameter in the checkpoint and is written once, under its first name (``transformer.wte.
weight`` for GPT-2), which is what transformers expects for tied weights. Everything is
written into a hidden temporary folder next to the output and renamed into place at the end:
a failed or interrupted export leaves no half-written output.

``save_hf`` does the same from a live engine (what a trainer calls at the end): every rank
takes part in gathering the fp32 master weights unit by unit, rank 0 writes. Both paths
export the fp32 master weights, so ``save_hf(engine)`` and ``export_hf(save_checkpoint(engine))``
write identical files.

A tiled weight (see [Note: tiling] in sharding/tiling.py) is saved as tiles but written whole,
under its untiled name and shape, where its first tile is: ``export_hf`` assembles it in bands
of whole rows (at most ``CHUNK_ELEMENTS``, at least one row) from the tiles' ranges;
``save_hf`` keeps the fp32 tiles of one weight on rank 0's host until its last tile (they
are consecutive units) is gathered, so its memory is one untiled weight rather than one unit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from glob import escape as glob_escape
from pathlib import Path

import torch

from .. import dist as zdist
from ..config import ConfigError, parse_bytes
from ..memory.swap import pid_alive
from ..sharding.tiling import TiledWeight, iter_row_bands, tiled_weights
from .files import (
    TensorFileReader,
    TensorFileWriter,
    TensorSpec,
    atomic_write_bytes,
    cannot_create,
    fsync_dir,
)
from .hub_layout import HubLayout, meta_model
from .load import RankFiles, open_checkpoint
from .manifest import BUFFERS
from .save import agree_on_failure
from .state import model_files, persistent_buffers

__all__ = ["CHUNK_ELEMENTS", "ExportError", "export_hf", "save_hf"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

CHUNK_ELEMENTS = 4 * 2**20  # 16 MiB of fp32 per piece
INDEX = "model.safetensors.index.json"
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

Progress = Callable[[int, int], None]  # (bytes just written, total bytes)


class ExportError(ValueError):
    """An export cannot be done as asked; the message says why and what to do."""


def export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _TORCH_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ExportError(f"dtype must be one of bf16, fp16, fp32, got {dtype!r}")


def _shard_limit(max_shard_size: int | str) -> int:
    try:
        limit = parse_bytes(max_shard_size, name="max_shard_size")
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    if limit <= 0:
        raise ExportError("max_shard_size must be positive")
    return limit


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an output that exists and is not an empty folder (unless ``overwrite``), or
    whose folder cannot be made or written (the files are written next to it, then
    renamed)."""
    if output.exists() or output.is_symlink():
        if not output.is_dir():
            raise ExportError(f"{output}: exists and is not a folder")
        if not overwrite and any(output.iterdir()):
            raise ExportError(f"{output}: exists and is not empty (overwrite it with --overwrite)")
    why = cannot_create(Path(os.path.abspath(output)).parent)
    if why is not None:
        raise ExportError(f"{output}: {why}")


def _remove_orphans(output: Path) -> None:
    """Remove the partial (and replaced) folders that an export to ``output`` killed
    outright (SIGKILL, the OOM killer) left next to it: ``.NAME.partial-PID`` and
    ``.NAME.old-PID`` whose process is gone."""
    for entry in output.parent.glob(f".{glob_escape(output.name)}.*-*"):
        kind, _, pid = entry.name[len(output.name) + 2 :].partition("-")
        if kind in ("partial", "old") and pid.isdigit() and entry.is_dir():
            if not pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)


class HFFolderWriter:
    """Writes the weight files of an HF folder in a temporary folder, tensors in the order of
    ``specs`` (appended in pieces), then ``finish`` renames it to ``output``."""

    def __init__(self, output: str | Path, specs: list[TensorSpec], max_shard_size: int, *,
                 overwrite: bool = False):  # fmt: skip
        self.output = Path(output)
        self.overwrite = overwrite
        check_output(self.output, overwrite)
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        self.names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.shards = shards
        self.total_bytes = sum(s.nbytes for s in specs)
        self.total_numel = sum(s.nbytes // _itemsize(s.dtype) for s in specs)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.output.parent / f".{self.output.name}.partial-{os.getpid()}"
        _remove_orphans(self.output)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        self._writer: TensorFileWriter | None = None
        self._next = 0

    def _open_next(self) -> None:
        if self._writer is not None:
            self._writer.commit()
        i = self._next
        self._writer = TensorFileWriter(self.tmp / self.names[i], self.shards[i], {"format": "pt"})
        self._next += 1

    def append(self, piece: torch.Tensor) -> None:
        while self._writer is None or self._writer.full:
            if self._next == len(self.shards):
                raise ValueError(f"{self.output}: more data than the planned tensors")
            self._open_next()
        self._writer.append(piece)

    def add_file(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.tmp / name, data)

    def finish(self) -> Path:
        while self._next < len(self.shards):
            self._open_next()
        if self._writer is not None:
            self._writer.commit()
            self._writer = None
        if len(self.names) > 1:
            weight_map = {s.name: f for f, shard in zip(self.names, self.shards) for s in shard}
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_numel},
                "weight_map": dict(sorted(weight_map.items())),
            }
            self.add_file(INDEX, (json.dumps(index, indent=2) + "\n").encode())
        fsync_dir(self.tmp)
        trash = None
        if self.output.exists():
            if any(self.output.iterdir()):
                if not self.overwrite:
                    raise ExportError(f"{self.output}: appeared while exporting; not replaced")
                trash = self.output.parent / f".{self.output.name}.old-{os.getpid()}"
                os.rename(self.output, trash)
            else:
                self.output.rmdir()
        os.rename(self.tmp, self.output)
        fsync_dir(self.output.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return self.output

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _config_with_dtype(data: bytes, dtype: torch.dtype) -> bytes:
    config = json.loads(data)
    config["dtype"] = _TORCH_NAMES[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = _TORCH_NAMES[dtype]
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _buffer_dtype(buf_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if buf_dtype.is_floating_point else buf_dtype


def _untiled_entries(params: list[dict], tiled: list[dict]) -> list[tuple]:
    """``(name, shape, TiledWeight or None)`` to write, in the manifest's order: a tiled
    weight once, whole, where its first tile is; every other parameter as saved."""
    weights = [TiledWeight.from_json(t) for t in tiled]
    first = {tw.tiles[0].name: tw for tw in weights}
    members = {t.name for tw in weights for t in tw.tiles}
    out = []
    for p in params:
        if p["name"] in first:
            tw = first[p["name"]]
            out.append((tw.name, tuple(tw.shape), tw))
        elif p["name"] not in members:
            out.append((p["name"], tuple(p["shape"]), None))
    return out


def _specs(layout: HubLayout, entries: list[tuple], dtype: torch.dtype) -> list[TensorSpec]:
    """The weight files' tensors in writing order: a converted group's checkpoint tensors
    where its last member is ([Note: the hub layout on export])."""
    specs = []
    for name, shape, _ in entries:
        if not layout.in_group(name):
            specs.append(TensorSpec(layout.name(name), dtype, shape))
        elif (group := layout.group_at(name)) is not None:
            specs += [TensorSpec(n, dtype, s) for n, s in group.outputs]
    return specs


def _append(writer: HFFolderWriter, tensor: torch.Tensor, progress: Progress | None) -> None:
    """One piece into the files, and the bytes written so far to ``progress``."""
    writer.append(tensor)
    if progress is not None:
        progress(tensor.numel() * tensor.element_size(), writer.total_bytes)


def _whole_tiled(tw: TiledWeight, read) -> torch.Tensor:
    return torch.cat([band.clone() for band in iter_row_bands(tw, read, CHUNK_ELEMENTS)])


def _slot_row(flat, slot, experts: int, dtype, e: int) -> torch.Tensor:
    """Row ``e`` of the parameter ``slot`` of a gathered unit ``flat``, on the host."""
    per = slot.numel // experts
    row = flat[slot.offset + e * per : slot.offset + (e + 1) * per]
    return row.to("cpu", dtype, copy=True).view(1, *slot.shape[1:])


def _write_rows(layout, group, row_of, writer, progress) -> None:
    """A group of stacked experts written expert by expert: ``row_of(e)`` is expert e's row
    of its parameter, shape ``(1, ...)``, in the export dtype."""
    for e in range(len(group.rows)):
        for tensor in layout.convert_row(group, e, row_of(e)).values():
            _append(writer, tensor.contiguous(), progress)


def _hold(layout, name: str, whole: torch.Tensor, held: dict, writer, progress) -> None:
    """Keep a converted group's member; once the last one is in, append the group's tensors."""
    held[name] = whole
    group = layout.group_at(name)
    if group is None:
        return
    members = {n: held.pop(n) for _, n in group.members}
    for tensor in layout.convert(group, members).values():
        _append(writer, tensor.contiguous(), progress)


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    verify: bool = True,
    progress: Progress | None = None,
) -> Path:
    """Write the checkpoint's model as a Hugging Face folder (see [Note: streaming export]).

    checkpoint: a checkpoint folder, the folder holding checkpoints (what ``latest`` names),
        or a Trainer's output folder (its newest complete ``checkpoint-N``).
    dtype: bf16, fp16 or fp32 (from the fp32 master weights); None: the training dtype.
    max_shard_size: split into several files above this size (bytes, or "5GB", "500MiB").
    overwrite: replace an existing non-empty ``output_dir``.
    verify: check the checkpoint's sha256 checksums first (reads it once more).
    """
    # A bad name is refused before anything is read; None: the checkpoint's, once read.
    torch_dtype = None if dtype is None else export_dtype(dtype)
    limit = _shard_limit(max_shard_size)
    output = Path(output_dir)
    check_output(output, overwrite)
    folder, manifest = open_checkpoint(checkpoint, verify=verify)
    if torch_dtype is None:
        torch_dtype = export_dtype(manifest.get("dtype", "fp32"))
    if overwrite and output.exists() and folder.resolve().is_relative_to(output.resolve()):
        raise ExportError(f"{output}: holds the checkpoint being exported; choose another output")
    if "config.json" not in manifest["files"]:
        log.warning(
            "zerotune: %s has no config.json (not a Hugging Face model): exporting the "
            "weights only",
            folder,
        )
    buffers = []
    if manifest.get("buffers"):
        reader = TensorFileReader(folder / BUFFERS)
        buffers = [(n, reader.entries[n]) for n in manifest["buffers"] if n in reader.entries]
        reader.close()
    params = manifest["params"]
    by_name = {p["name"]: p for p in params}
    # Tiled weights (sharding/tiling.py) are written whole, under their own names.
    entries = _untiled_entries(params, manifest.get("tiled") or [])
    # Only a model saved with another checkpoint layout builds its (meta) model here; a
    # checkpoint from before manifests said (no key) builds it to find out.
    model = None
    if manifest.get("hub_layout", True) and "config.json" in manifest["files"]:
        model = meta_model((folder / "config.json").read_bytes())
    layout = HubLayout(model, [e[:2] for e in entries])
    specs = _specs(layout, entries, torch_dtype)
    specs += [
        TensorSpec(layout.name(n), _buffer_dtype(e.dtype, torch_dtype), e.shape) for n, e in buffers
    ]

    piece = min(max((p["numel"] for p in params), default=0), CHUNK_ELEMENTS)
    files = RankFiles(folder, manifest["world_size"])

    def read(name: str, c0: int, c1: int, buf: torch.Tensor) -> None:
        p = by_name[name]  # elements [c0, c1) of the flattened parameter
        for rank, ps, pe, at in p["ranges"]:
            x, y = max(c0, ps), min(c1, pe)
            if x < y:
                key = f"u{p['unit']}.master"
                files[rank].read(key, at + x - ps, at + y - ps, buf[x - c0 : y - c0])

    writer = HFFolderWriter(output, specs, limit, overwrite=overwrite)
    try:
        staging = torch.empty(piece, dtype=torch.float32)
        converted = None if torch_dtype == torch.float32 else torch.empty(piece, dtype=torch_dtype)
        held: dict[str, torch.Tensor] = {}
        for name, shape, tiled in entries:
            group = layout.group_at(name)
            if group is not None and group.rows is not None and tiled is None:
                per = by_name[name]["numel"] // len(group.rows)

                def row_of(e, name=name, shape=shape, per=per):
                    row = torch.empty(per, dtype=torch.float32)
                    read(name, e * per, (e + 1) * per, row)
                    return row.to(torch_dtype).view(1, *shape[1:])

                _write_rows(layout, group, row_of, writer, progress)
                continue
            if layout.in_group(name):
                if tiled is not None:
                    whole = _whole_tiled(tiled, read)
                else:
                    whole = torch.empty(by_name[name]["numel"], dtype=torch.float32)
                    read(name, 0, whole.numel(), whole)
                _hold(layout, name, whole.to(torch_dtype).view(shape), held, writer, progress)
                continue
            if tiled is not None:
                for band in iter_row_bands(tiled, read, CHUNK_ELEMENTS):
                    _append(writer, band.to(torch_dtype), progress)
                continue
            for c0 in range(0, by_name[name]["numel"], CHUNK_ELEMENTS):
                c1 = min(by_name[name]["numel"], c0 + CHUNK_ELEMENTS)
                buf = staging[: c1 - c0]
                read(name, c0, c1, buf)
                out = buf if converted is None else converted[: c1 - c0].copy_(buf)
                _append(writer, out, progress)
        if buffers:
            reader = TensorFileReader(folder / BUFFERS)
            try:
                for name, e in buffers:
                    n = e.nbytes // _itemsize(e.dtype)
                    t = torch.empty(n, dtype=e.dtype)
                    reader.read(name, 0, n, t)
                    writer.append(t.to(_buffer_dtype(e.dtype, torch_dtype)))
            finally:
                reader.close()
        for fname, meta in manifest["files"].items():
            if meta.get("kind") in ("model", "tokenizer", "extra"):
                data = (folder / fname).read_bytes()
                if fname == "config.json":
                    data = _config_with_dtype(data, torch_dtype)
                writer.add_file(fname, data)
        result = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        files.close()
    log.info("zerotune: exported %s to %s (%s)", folder, result, _TORCH_NAMES[torch_dtype])
    return result


def _gather_master(engine, unit) -> torch.Tensor | None:
    """The unit's whole fp32 master buffer on rank 0 (None elsewhere); every rank calls."""
    master = engine.unit_state(unit)["master"]
    if engine.world == 1:
        return master
    # The collective runs where the engine computes (NCCL takes no host tensors): a
    # master offloaded to the host travels through the device.
    master = master.to(engine.device)
    full = None
    if engine.rank == 0:
        full = torch.empty(unit.padded_numel, dtype=torch.float32, device=engine.device)
        parts = list(full.split(unit.shard_numel))
    else:
        parts = None
    torch.distributed.gather(master, parts, group=engine.group, group_dst=0)
    return full


def _read_pending(pending: dict[str, torch.Tensor]):
    def read(name: str, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(pending[name][start:stop])

    return read


def save_hf(
    engine,
    output_dir: str | Path,
    *,
    dtype: str | torch.dtype = "bf16",
    max_shard_size: int | str = "5GB",
    tokenizer=None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path | None:
    """Write the engine's model as a Hugging Face folder: every rank must call (the fp32
    master weights are gathered unit by unit), rank 0 writes. Returns the folder on rank 0,
    None elsewhere. See [Note: streaming export]."""
    torch_dtype = export_dtype(dtype)
    limit = _shard_limit(max_shard_size)
    output = Path(output_dir)
    buffers = persistent_buffers(engine.module)
    # A tiled weight (sharding/tiling.py) is written whole: its tiles wait on rank 0's host
    # until the last one is gathered (they are consecutive units).
    tiled = tiled_weights(engine.module)
    tile_of = {t.name: tw for tw in tiled for t in tw.tiles}
    saved = [{"name": s.name, "shape": s.shape} for u in engine.units for s in u.slots]
    entries = _untiled_entries(saved, [tw.to_json() for tw in tiled])
    layout = HubLayout(engine.module, [e[:2] for e in entries])
    specs = _specs(layout, entries, torch_dtype)
    pending: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    for n, b in buffers:
        specs.append(TensorSpec(layout.name(n), _buffer_dtype(b.dtype, torch_dtype), b.shape))
    writer, error = None, None
    if engine.rank == 0:
        try:
            writer = HFFolderWriter(output, specs, limit, overwrite=overwrite)
        except Exception as exc:  # noqa: BLE001 - re-raised by agree_on_failure on every rank
            error = exc
    agree_on_failure(engine, error, f"preparing {output}")
    for unit in engine.units:
        if unit.shard_numel == 0:
            continue
        flat = _gather_master(engine, unit)
        if writer is None or error is not None:
            continue
        try:
            for s in unit.slots:
                tw = tile_of.get(s.name)
                if tw is not None:
                    pending[s.name] = flat[s.offset : s.offset + s.numel].to("cpu", copy=True)
                    if not all(t.name in pending for t in tw.tiles):
                        continue
                    if layout.in_group(tw.name):
                        whole = _whole_tiled(tw, _read_pending(pending)).to(torch_dtype)
                        _hold(layout, tw.name, whole.view(tw.shape), held, writer, progress)
                    else:
                        for band in iter_row_bands(tw, _read_pending(pending), CHUNK_ELEMENTS):
                            _append(writer, band.to(torch_dtype), progress)
                    for t in tw.tiles:
                        del pending[t.name]
                    continue
                group = layout.group_at(s.name)
                if group is not None and group.rows is not None:
                    rows = functools.partial(_slot_row, flat, s, len(group.rows), torch_dtype)
                    _write_rows(layout, group, rows, writer, progress)
                    continue
                if layout.in_group(s.name):
                    whole = flat[s.offset : s.offset + s.numel].to("cpu", torch_dtype, copy=True)
                    _hold(layout, s.name, whole.view(s.shape), held, writer, progress)
                    continue
                for c0 in range(0, s.numel, CHUNK_ELEMENTS):
                    c1 = min(s.numel, c0 + CHUNK_ELEMENTS)
                    piece = flat[s.offset + c0 : s.offset + c1].to("cpu", torch_dtype)
                    _append(writer, piece, progress)
        except Exception as exc:  # noqa: BLE001 - the other ranks keep gathering; raised below
            error = exc
        del flat
    if writer is not None and error is None:
        try:
            for _, b in buffers:
                writer.append(b.detach().to("cpu", _buffer_dtype(b.dtype, torch_dtype)))
            for fname, data in model_files(engine.module).items():
                if fname == "config.json":
                    data = _config_with_dtype(data, torch_dtype)
                writer.add_file(fname, data)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(writer.tmp))
            writer.finish()
        except Exception as exc:  # noqa: BLE001 - re-raised by agree_on_failure on every rank
            error = exc
    if writer is not None and error is not None:
        writer.abort()
    agree_on_failure(engine, error, f"writing {output}")
    return output if engine.rank == 0 else None
