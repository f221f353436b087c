"""Strict, typed configuration for the ZeRO engine.

Every size is in bytes (strings such as ``"256MB"`` or ``"1GiB"`` are accepted and converted).
Unknown keys are rejected with the nearest valid name; impossible combinations are explained
before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["ConfigError", "ZeroConfig", "did_you_mean", "first_line", "parse_bytes", "load_config"]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_OFFLOAD = ("none", "cpu", "nvme")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message says what to change."""


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Turn ``1048576``, ``"1MiB"`` or ``"2.5GB"`` into a number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"{name}: a size in bytes must be whole, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}: cannot read {value!r} as a size; write e.g. 268435456, '256MiB' or '1GB'"
            )
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(size):
            raise ConfigError(f"{name}: {value!r} is too large to be a size")
        n = int(size)
    else:
        raise ConfigError(f"{name}: expected a size in bytes, got {type(value).__name__}")
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative ({value!r})")
    return n


def did_you_mean(key: str, valid, cutoff: float = 0.5) -> str:
    """`` (did you mean 'x'?)`` for the name in ``valid`` nearest ``key``, or ""."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for a
    ConfigError's one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class ZeroConfig:
    """How a model is sharded and trained.

    stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
    dtype: the compute dtype of parameters (fp32, bf16, fp16); master weights and Adam
        moments are always fp32.
    grad_dtype: dtype of the accumulated gradient shards (fp32 by default; bf16/fp16 halve
        their memory or their NVMe file and its traffic, as in the ZeRO paper's 2+2+12 bytes
        per parameter). Reductions and accumulation always sum in fp32, then round.
    prefetch_bytes: how many bytes of parameters may be gathered ahead of use (stage 3).
    max_live_bytes: bound on gathered parameter bytes held at once, prefetch included;
        on-demand gathers wait for room (0 = no bound beyond the units in use).
    persistence_threshold: units whose gathered size is at most this many bytes stay
        gathered for the whole run (stage 3), saving collectives on tiny units.
    unit_modules: class names of the modules that become sharding units; ``None`` uses the
        model's ``_no_split_modules`` plus embeddings and the output head.
    loss_scale_init / loss_scale_window / loss_scale_min: fp16's dynamic loss scale: where it
        starts, the good steps before it doubles, its floor.
    loss_scale_rule: torch (halve at each overflow, as the plain Trainer) or deepspeed (a
        DeepSpeed config's rule, with loss_scale_hysteresis and
        loss_scale_consecutive_hysteresis): [Note: two loss-scale rules] in optim/scaling.py.
    auto_external_params: register parameters a unit's forward reads from another unit
        (see sharding/external.py); off, such a read raises instead.
    offload_param: where stage-3 parameter shards live between uses: none (the compute
        device), cpu (host memory), nvme (a swap file under nvme_path).
    offload_optimizer: where fp32 master weights, Adam moments and gradient shards live:
        none, cpu, nvme. The optimizer step then runs the C++ CPU Adam.
    nvme_path: folder for swap files (one per rank and kind, private, removed at exit).
    grad_host_bytes: with offload_optimizer=nvme, gradient shards stay in host memory while
        they fit in this many bytes (then accumulation writes nothing to disk); beyond, they
        go to the swap file too.
    staging_bytes: the pool of host buffers NVMe reads and writes go through (allocated once,
        part of the memory report). The optimizer step streams each unit's state through
        it in chunks: up to eight slots with fp32 moments (in an overlapped step the
        spare ones read ahead of backward), three with 8-bit moments; more bytes make
        larger chunks and read further ahead. 384 MiB by default: with fp32 moments and
        the master updated in place, the master's room in each slot is never touched (256
        of the 384 MiB count in RSS while gradients stay in memory); smaller pools step
        slower (benchmarks/RESULTS.md).
    aio_threads / aio_block_bytes / aio_queue_depth: the asynchronous I/O engine (buffered
        files, the parameter and gradient files, take blocks of at least 4 MiB: see [Note:
        huge page-cache pages] in memory/swap.py).
    host_cache_bytes: with offload on a CPU device, freed tensors of 1 MiB and more are kept
        for reuse up to this many bytes (weight gradients and activations of the next block
        and step reuse them instead of page-faulting fresh memory; 0 turns it off). A
        tensor larger than the budget (a big embedding's gradient) is faulted in afresh
        every step: where memory allows, a budget of a step's churn (the activations kept
        for backward plus the largest gradients) trades peak RSS for those faults. Counted
        in the memory report (``host_cache``) and in ``estimate``.
    map_param_file: with parameters on NVMe, one process, a CPU device: a gather maps the
        parameter file's pages (copy-on-write) instead of copying them into a buffer; and
        wherever that file holds the fp32 master (fp32 compute and moments, both tiers on
        NVMe) the optimizer updates it in the file's pages through a shared mapping instead
        of reading and writing it. Off, gathers and the optimizer read and write the file:
        slower, but a disk error while a gather reads then raises an exception where a
        mapping ends the process with SIGBUS.
    optim_state_bits: 32 keeps Adam's two moments in fp32; 8 keeps them blockwise-quantized
        in 8 bits (bitsandbytes' dynamic code, one fp32 absmax per 256 elements) on whatever
        tier holds the optimizer state. The fp32 master copy is unchanged.
    offload_activations: where activation checkpoints (the saved inputs of checkpointed
        blocks) wait between forward and backward: none (where they were made), cpu (host
        memory), nvme (a swap file under nvme_path). Needs activation checkpointing on.
    tile_linear_bytes: linear layers whose weight is larger than this many bytes are split
        into tiles of at most this size, each its own sharding unit (0 = off).
    find_unused_parameters: at world size > 1 (stages 2 and 3), let a branch the data
        chooses leave some of a unit's parameters without a gradient on some ranks and not
        on others (a task head, an expert, an optional layer). Each training forward then
        walks the autograd graph from the model's outputs and the ranks agree (one small
        all-reduce) on the units not every rank will give all their gradients: those are
        reduced at the end of backward instead of during it, in the same order on every
        rank. Off, such a unit makes the ranks' collectives stop pairing up (see [Note:
        parameters without a gradient] in optim/zero_adam.py).
    """

    stage: int = 3
    dtype: str = "fp32"
    grad_dtype: str = "fp32"
    prefetch_bytes: int = 64 * 2**20
    max_live_bytes: int = 0
    persistence_threshold: int = 0
    unit_modules: list[str] | None = None
    offload_param: str = "none"
    offload_optimizer: str = "none"
    nvme_path: str | None = None
    grad_host_bytes: int = 2**30
    staging_bytes: int = 384 * 2**20
    aio_threads: int = 4
    aio_block_bytes: int = 2**20
    aio_queue_depth: int = 16
    host_cache_bytes: int = 128 * 2**20
    map_param_file: bool = True
    loss_scale_init: float = 2.0**16
    loss_scale_window: int = 1000
    loss_scale_min: float = 1.0
    loss_scale_rule: str = "torch"
    loss_scale_hysteresis: int = 2
    loss_scale_consecutive_hysteresis: bool = False
    auto_external_params: bool = True
    optim_state_bits: int = 32
    offload_activations: str = "none"
    tile_linear_bytes: int = 0
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        if self.stage not in (1, 2, 3):
            raise ConfigError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        for name in ("dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ConfigError(
                    f"{name} must be one of fp32, bf16, fp16, got {value!r}"
                    + did_you_mean(str(value), list(_DTYPES))
                )
        for name in sorted(_BYTE_FIELDS):
            setattr(self, name, parse_bytes(getattr(self, name), name=name))
        for name in ("offload_param", "offload_optimizer", "offload_activations"):
            value = getattr(self, name)
            if value not in _OFFLOAD:
                raise ConfigError(
                    f"{name} must be one of none, cpu, nvme, got {value!r}"
                    + did_you_mean(str(value), list(_OFFLOAD))
                )
        if self.offload_param != "none" and self.stage != 3:
            raise ConfigError(
                f"offload_param={self.offload_param!r} needs stage 3 (stages 1-2 keep every "
                "parameter gathered on the device)"
            )
        if self.optim_state_bits not in (8, 32):
            raise ConfigError(f"optim_state_bits must be 32 or 8, got {self.optim_state_bits!r}")
        if "nvme" in self.offload_tiers and not self.nvme_path:
            raise ConfigError("offload to nvme needs nvme_path (a folder on a fast local disk)")
        if self.aio_threads < 1 or self.aio_queue_depth < 1:
            raise ConfigError("aio_threads and aio_queue_depth must be at least 1")
        if self.aio_block_bytes < 4096 or self.aio_block_bytes % 4096:
            raise ConfigError("aio_block_bytes must be a multiple of 4096")
        if self.nvme_path is not None and "nvme" not in self.offload_tiers:
            raise ConfigError(
                "nvme_path is set but none of offload_param, offload_optimizer, "
                "offload_activations is 'nvme'"
            )
        if self.loss_scale_init <= 0 or self.loss_scale_min <= 0:
            raise ConfigError("loss scales must be positive")
        if self.loss_scale_window < 1:
            raise ConfigError("loss_scale_window must be at least 1")
        if self.loss_scale_rule not in ("torch", "deepspeed"):
            raise ConfigError(
                f"loss_scale_rule must be torch or deepspeed, got {self.loss_scale_rule!r}"
            )
        if self.loss_scale_hysteresis < 1:
            raise ConfigError("loss_scale_hysteresis must be at least 1")

    def _check_types(self) -> None:
        """Each field holds its declared kind: a boolean is no number here (``stage: true``
        is refused, not read as 1), a number no boolean, a name a string. Sizes in bytes
        are read by ``parse_bytes`` (numbers or strings such as ``"64MiB"``)."""
        for f in fields(self):
            value, kind = getattr(self, f.name), _KINDS.get(str(f.type))
            if kind is None or f.name in _BYTE_FIELDS:
                continue
            types, want = kind
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ConfigError(f"{f.name} must be {want}, got {value!r}")
        if self.unit_modules is not None and not all(isinstance(m, str) for m in self.unit_modules):
            raise ConfigError(f"unit_modules must be a list of names, got {self.unit_modules!r}")

    @property
    def offload_tiers(self) -> tuple[str, str, str]:
        """(offload_param, offload_optimizer, offload_activations)."""
        return (self.offload_param, self.offload_optimizer, self.offload_activations)

    @property
    def offloads(self) -> bool:
        """Whether anything (parameters, optimizer state, activations) leaves the device."""
        return any(t != "none" for t in self.offload_tiers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_grad_dtype(self) -> torch.dtype:
        return _DTYPES[self.grad_dtype]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZeroConfig:
        """Build from a mapping, rejecting unknown keys with the nearest valid name."""
        if not isinstance(data, dict):
            raise ConfigError(f"a zerotune config must be a mapping, got {type(data).__name__}")
        valid = [f.name for f in fields(cls)]
        for key in data:
            if key not in valid:
                raise ConfigError(f"unknown config key {key!r}" + did_you_mean(str(key), valid))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ZeroConfig:
        return ZeroConfig.from_dict({**self.to_dict(), **changes})


# The declared kind of each field (``fields().type`` is the annotation's text here): the
# types a value may have, and how to say it.
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "a whole number"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "str | None": ((str, type(None)), "a string or null"),
    "list[str] | None": ((list, type(None)), "a list of names or null"),
}
_BYTE_FIELDS = {
    "prefetch_bytes",
    "max_live_bytes",
    "persistence_threshold",
    "grad_host_bytes",
    "staging_bytes",
    "aio_block_bytes",
    "host_cache_bytes",
    "tile_linear_bytes",
}


def _strict_init(init):
    """``ZeroConfig(stagee=3)`` names the nearest key too, as ``from_dict`` does, instead of
    Python's bare TypeError."""

    @functools.wraps(init)
    def checked(self, *args: Any, **kwargs: Any) -> None:
        valid = [f.name for f in fields(ZeroConfig)]
        for key in kwargs:
            if key not in valid:
                raise ConfigError(f"unknown config key {key!r}" + did_you_mean(str(key), valid))
        init(self, *args, **kwargs)

    return checked


ZeroConfig.__init__ = _strict_init(ZeroConfig.__init__)


def load_config(source: str | Path | dict[str, Any] | ZeroConfig | None) -> ZeroConfig:
    """A ZeroConfig from a YAML/JSON file path, a dict, an existing config, or None (defaults)."""
    if source is None:
        return ZeroConfig()
    if isinstance(source, ZeroConfig):
        return source
    if isinstance(source, dict):
        return ZeroConfig.from_dict(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse error becomes one clear message
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if data is None:
        data = {}
    try:
        return ZeroConfig.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
