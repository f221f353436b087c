"""Streaming ``from_pretrained`` into shards: each rank reads only the byte ranges it keeps.

[Note: streaming load]
The safetensors format is an 8-byte header length, a JSON header (dtype, shape and byte
offsets of every tensor) and the raw data. ``SafetensorsCheckpoint`` reads the headers of an
HF folder (one file, or several with ``model.safetensors.index.json``). The model is built on
the meta device; when the engine builds a unit, ``fill`` reads, for each parameter, just
the part of it that falls into this rank's slice of the unit's flat buffer, straight into the
fp32 master slice (a tile of a tiled linear reads its block of the untiled weight, row by
row; see [Note: tiling]). The full state dict never exists in any process. A tied weight is one
parameter, owned and read once. Names follow what transformers accepts: with or without the
base model prefix (``transformer.``, ``model.``), and the legacy ``gamma``/``beta`` names of
norm weights.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ZeroConfig, load_config
from ..sharding.engine import ZeroEngine
from ..sharding.state_dict import WeightSources, fill_shard
from ..sharding.tiling import TileBlock, TiledWeight, apply_tiling, tiled_weights
from .construct import (
    InitFunctions,
    build_from_config,
    default_device,
    hidden,
    materialize_buffers,
    realize_placeholders,
)
from .converted import ConvertedCheckpoint

__all__ = [
    "SAFETENSORS_DTYPES",
    "MissingParametersError",
    "ModelLoadError",
    "SafetensorsCheckpoint",
    "from_pretrained",
    "load_weights",
    "read_safetensors_header",
    "resolve_model_folder",
]

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


READ_BYTES = 16 << 20  # the largest piece of a tensor read at once


class ModelLoadError(ValueError):
    """A model folder, id or file cannot be used; the message says what to do instead."""


class MissingParametersError(ModelLoadError):
    """The checkpoint lacks parameters of the model built from its config (a causal LM's
    checkpoint for a sequence classifier: no score head)."""


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the tensor's data in the file
    nbytes: int


class SafetensorsCheckpoint:
    """The tensors of an HF folder's safetensors files, readable by element range."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            hint = " (pickle .bin files are not loaded)" if any(folder.glob("*.bin")) else ""
            raise ModelLoadError(f"no *.safetensors weights in {folder}{hint}")
        self.entries: dict[str, _Entry] = {}
        for path in files:
            self.entries.update(read_safetensors_header(path))
        self._files: dict[Path, object] = {}

    def read(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of tensor ``key`` (flattened) into ``out``, through a
        buffer of at most ``READ_BYTES``."""
        e = self.entries[key]
        itemsize = torch.empty((), dtype=e.dtype).element_size()
        f = self._files.get(e.path)
        if f is None:
            f = self._files[e.path] = open(e.path, "rb")  # noqa: SIM115 - kept for reuse
        per = max(1, READ_BYTES // itemsize)
        buf = bytearray(min(stop - start, per) * itemsize)
        for a in range(start, stop, per):
            b = min(stop, a + per)
            want = (b - a) * itemsize
            f.seek(e.offset + a * itemsize)
            view = memoryview(buf)[:want]
            got = f.readinto(view)
            if got != want:
                raise ModelLoadError(
                    f"{e.path}: short read of {key!r} at byte {e.offset + a * itemsize} "
                    f"({got} of {want} bytes): the file is truncated or corrupt"
                )
            out[a - start : b - start].copy_(torch.frombuffer(view, dtype=e.dtype))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def read_safetensors_header(path: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file: dtype, shape, byte offset and length of each.
    The header is checked as the safetensors library checks it when loading (see
    ``check_safetensors_header``): a file it would refuse is refused here, never read at
    shifted offsets."""
    header, n, data_bytes = parse_safetensors_header(path, ModelLoadError)
    check_safetensors_header(header, data_bytes, path, ModelLoadError)
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {key!r} has unsupported dtype {meta['dtype']}")
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        out[key] = _Entry(path, dtype, tuple(meta["shape"]), 8 + n + begin, end - begin)
    return out


def parse_safetensors_header(path: Path, error: type[Exception]) -> tuple[dict, int, int]:
    """(parsed JSON header, header length, bytes of the data section) of a safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise error(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise error(f"{path}: corrupt safetensors header (length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise error(f"{path}: corrupt safetensors header (not JSON)") from None
    return header, n, size - 8 - n


# Bytes per element of every dtype the safetensors format names.
_ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def check_safetensors_header(header, data_bytes: int, path, error: type[Exception]) -> None:
    """Refuse a header the safetensors library would refuse when loading: a JSON object of
    tensors (and string ``__metadata__``), each with a known dtype, a shape of counts and
    ``data_offsets`` [begin, end] whose length is numel x itemsize; the tensors, sorted by
    offset, laid end to end from 0 and covering the data section exactly. (The library's
    own reader maps the whole file, which a bounded-memory export cannot afford; the fuzz
    test holds this check to the library's verdicts.)"""

    def bad(why: str):
        return error(f"{path}: not a valid safetensors file ({why})")

    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    spans = []
    for key, meta in header.items():
        if key == "__metadata__":
            if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
            ):
                raise bad("__metadata__ must map strings to strings")
            continue
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {key!r} needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
            raise bad(f"tensor {key!r} has an unknown dtype {dtype!r}")
        counts = shape if isinstance(shape, list) else [None]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in counts):
            raise bad(f"tensor {key!r} has a bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"tensor {key!r} has bad data_offsets {offsets!r}")
        if offsets[1] - offsets[0] != math.prod(shape) * _ST_ITEMSIZE[dtype]:
            raise bad(f"tensor {key!r}: its data_offsets do not hold its shape and dtype")
        spans.append((offsets[0], offsets[1], key))
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            raise bad(f"invalid offset for tensor {key!r}")
        at = end
    if at != data_bytes:
        if at > data_bytes:
            raise bad("its tensors run past the end of the file: truncated")
        raise bad(f"the data section holds {data_bytes - at} bytes no tensor describes")


def resolve_model_folder(name_or_path: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, from the local cache (or downloaded when
    the hub is reachable and allowed)."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        hint = ""
        if path.suffix == ".json":  # a config alone has no weights to load
            hint = (
                " (a config.json alone builds a model from random weights: zerotune finetune "
                "--init random, or zerotune.zero_init)"
            )
        raise ModelLoadError(
            f"{path} is a file; give the model folder that holds config.json{hint}"
        )
    name = str(name_or_path)
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id=name,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"],
            local_files_only=offline,
        )
    except Exception as exc:  # noqa: BLE001 - every failure becomes one actionable message
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the hub"
        raise ModelLoadError(
            f"model {name!r} is not a local folder and could not be found in {where} "
            f"({type(exc).__name__}). Give a local folder with config.json and *.safetensors, "
            f"or start from random weights with a preset or config (zerotune.hf.model_config)."
        ) from None
    return Path(folder)


def _candidates(name: str, prefix: str) -> list[str]:
    names = [name]
    if prefix:
        if name.startswith(prefix + "."):
            names.append(name[len(prefix) + 1 :])
        else:
            names.append(f"{prefix}.{name}")
    legacy = []
    for n in names:
        if n.endswith(".weight"):
            legacy.append(n[: -len("weight")] + "gamma")
        elif n.endswith(".bias"):
            legacy.append(n[: -len("bias")] + "beta")
    return names + legacy


def _checkpoint_sources(
    model: nn.Module, ckpt: SafetensorsCheckpoint, shapes: dict[int, tuple] | None = None
) -> WeightSources:
    """Each parameter's source in ``ckpt``: its own name (with or without the base model
    prefix, legacy norm names), else transformers' conversions for the model
    ([Note: converted checkpoints]); raises listing every missing one. ``shapes``:
    id(parameter) -> its shape, for parameters a sharded model holds empty."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    # A tile reads its block of the untiled weight, found under that weight's name.
    tiles: dict[int, tuple[TileBlock, TiledWeight]] = {}
    by_name = dict(model.named_parameters())
    for tw in tiled_weights(model):
        for t in tw.tiles:
            tiles[id(by_name[t.name])] = (t, tw)
    sources = WeightSources()
    missing: dict[int, tuple[str, tuple]] = {}
    mismatched: dict[int, str] = {}
    full_shapes: dict[str, tuple] = {}
    for pid, pnames in names.items():
        if pid in tiles:
            pnames = [tiles[pid][1].name]
        shape = tuple(shapes[pid]) if shapes and pid in shapes else tuple(params[pid].shape)
        if pid in tiles:
            block, tw = tiles[pid]
            shape = tuple(tw.shape)
            sources.blocks[pid] = (block, shape[1])
        full_shapes[pnames[0]] = shape
        found = next((c for n in pnames for c in _candidates(n, prefix) if c in ckpt.entries), None)
        if found is None:
            missing[pid] = (pnames[0], shape)
            continue
        if ckpt.entries[found].shape != shape:
            # Stored in another layout under its own name (Qwen3-VL-MoE's experts, which
            # transformers transposes on load): the conversion table may read it.
            mismatched[pid] = found
            missing[pid] = (pnames[0], shape)
            continue
        sources.readers[pid] = functools.partial(ckpt.read, found)
        sources.used.add(found)
    if missing:
        converted = ConvertedCheckpoint(
            model, ckpt, dict(missing.values()), ModelLoadError, full_shapes
        )
        for pid, (name, _) in list(missing.items()):
            if name in converted.readers:
                sources.readers[pid] = converted.readers[name]
                del missing[pid]
        sources.used |= converted.sources
        sources.converted = converted
    for pid, found in mismatched.items():
        if pid in missing:  # no conversion reads it: the checkpoint is of another model
            raise ModelLoadError(
                f"{ckpt.entries[found].path}: {found!r} has shape {ckpt.entries[found].shape}, "
                f"the model expects {missing[pid][1]} (a different model or config?)"
            )
    if missing:
        raise MissingParametersError(
            f"the checkpoint lacks {len(missing)} parameter(s) of this model, e.g. "
            f"{[name for name, _ in list(missing.values())[:3]]}."
        )
    return sources


class _StreamingLoader:
    """``prepare_unit`` for streaming loads: buffers are initialized, parameters filled."""

    def __init__(self, model: nn.Module, ckpt: SafetensorsCheckpoint, device: torch.device):
        self.model, self.ckpt, self.device = model, ckpt, device
        self.sources = _checkpoint_sources(model, ckpt)
        self.init_for = InitFunctions(model)
        self.is_hf = hasattr(model, "_init_weights")

    def __call__(self, unit_name: str, modules: list[nn.Module], params):
        with_buffers = materialize_buffers(modules, self.device)
        if with_buffers and self.is_hf:
            # Buffers (rotary inv_freq) come from the model's init, never from the weights.
            held = [p for m in with_buffers for p in m.parameters()]
            with hidden(held, self.device), torch.no_grad():
                for m in with_buffers:
                    self.init_for(m)(m)
        return self.fill

    def fill(self, unit, master: torch.Tensor) -> None:
        fill_shard(self.sources, unit, master)


def load_weights(engine: ZeroEngine, folder: str | os.PathLike) -> None:
    """Overwrite the engine's weights (fp32 masters and compute copies) with an HF folder's
    safetensors, each rank reading only its own slices; optimizer state is left as it is.
    Every rank must call it. Raises ModelLoadError when the folder does not hold every
    parameter with the engine's shapes."""
    ckpt = SafetensorsCheckpoint(folder)
    try:
        shapes = {id(s.param): s.shape for u in engine.units for s in u.slots}
        sources = _checkpoint_sources(engine.module, ckpt, shapes)
        for unit in engine.units:
            master = torch.zeros(unit.shard_numel, dtype=torch.float32)
            fill_shard(sources, unit, master)
            engine.load_unit_state(unit, {"master": master})
    finally:
        ckpt.close()


def from_pretrained(
    name_or_path: str | os.PathLike,
    config: ZeroConfig | dict | str | None = None,
    *,
    device: torch.device | str | None = None,
    group=None,
    frozen: bool = False,
    auto_class=None,
    **config_fields,
) -> ZeroEngine:
    """Load an HF model straight into shards (see [Note: streaming load]): the class its
    config names (``architectures``), else a causal LM. ``frozen``: for reading only (no
    gradients, no fp32 master). ``auto_class``: a transformers auto class to build instead
    (``AutoModelForSequenceClassification`` for a reward model); ``config_fields`` override
    the checkpoint config's (``num_labels=1``)."""
    from transformers import AutoConfig

    folder = resolve_model_folder(name_or_path)
    zero_config = load_config(config)
    try:
        hf_config = AutoConfig.from_pretrained(folder, **config_fields)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{folder}/config.json cannot be read: {exc}") from None
    ckpt = SafetensorsCheckpoint(folder)
    with torch.device("meta"):
        model = build_from_config(hf_config, auto_class)
    model.requires_grad_(not frozen)
    device = torch.device(device) if device is not None else default_device()
    realize_placeholders(model, device)
    # Tiles first (the engine would tile later), so that the loader maps each to its block.
    itemsize = torch.finfo(zero_config.torch_dtype).bits // 8
    apply_tiling(model, zero_config.tile_linear_bytes, itemsize)
    try:
        loader = _StreamingLoader(model, ckpt, device)
        engine = ZeroEngine(model, zero_config, group, device=device, prepare_unit=loader)
    finally:
        ckpt.close()
    unused = len(ckpt.entries) - len(loader.sources.used)
    if unused:
        log.info(
            "zerotune: %d tensors in %s are not parameters of the model (ignored)", unused, folder
        )
    return engine
