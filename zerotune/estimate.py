"""The memory plan: bytes per GPU, per host and on NVMe for every stage and offload tier.

``estimate(model, world_size=8, gpu_memory="80GB", ...)`` (or ``zerotune estimate``) returns a
``MemoryPlan``: one ``Option`` per valid (stage, offload_param, offload_optimizer), what each
holds per rank on the compute device, the host and NVMe, whether it fits the machine, and
the weakest option that fits (stage 1 before 2 before 3; no offload before cpu before nvme).

[Note: estimate sources]
Model states come from the engine's own size rules (sharding/plan.py: units, padding,
persistence, swap extents, staging slots, placement per tier), so ``estimate`` and
``ZeroEngine.memory_report()`` agree byte for byte (tests/test_estimate.py checks it on real
engines at world sizes 1 and 3). Working buffers (gathered units and prefetch, the gather
cache, the reduce pool, staging, gradient shards kept for an overlapped step, copies to the
host) come from the functions the engine sizes them with (sharding/buffers.py, [Note: working
buffers]; tests/test_sizing.py checks them on real engines); parameter gradients waiting for
their reduction and NVMe read buffers are upper bounds. Activations come from a formula
([Note: activation memory] in activation_memory.py): they depend on the model's code, so they
are the least exact part. A run without an accelerator (``device="cpu"``: ``zerotune estimate
--device cpu``, and finetune's check before loading on such a machine) has one memory for
both: what a GPU would hold (activations by the CPU kernels' rules, gathered units, working
buffers) is counted on the host line with the host tier.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field
from typing import Any

from .activation_memory import ModelShape, activation_bytes, model_shape
from .config import ConfigError, ZeroConfig, parse_bytes
from .estimate_table import checkpointing_flag, format_bytes, format_plan, job_flags
from .sharding.buffers import host_cache_bytes, staging_resident, staging_slots, working_buffers
from .sharding.engine import ZeroEngine
from .sharding.plan import SwapPlan, UnitPlan, plan_swap, plan_units, resident_bytes, size_unit

_MAX_PARAMS = 10**13  # ten trillion: far beyond any model, and a plan in ~15 s

__all__ = [
    "MemoryPlan",
    "ModelShape",
    "Option",
    "activation_bytes",
    "check_estimate",
    "engine_bytes",
    "estimate",
    "model_shape",
    "preflight",
]

log = logging.getLogger(__name__)

TIERS = ("device", "host", "nvme")
ROWS = ("params", "grads", "optimizer", "activations", "buffers", "staging")
_OFFLOADS = ("none", "cpu", "nvme")
_LEVEL = {"none": 0, "cpu": 1, "nvme": 2}


# ------------------------------------------------------------------- engine-side bytes
def engine_bytes(
    units: list[UnitPlan],
    config: ZeroConfig,
    world: int,
    rank: int = 0,
    *,
    with_optimizer: bool = True,
    swap: SwapPlan | None = None,
    device: str = "cuda",
) -> dict[str, dict[str, int]]:
    """What ``ZeroEngine.memory_report()`` says for rank ``rank`` once an optimizer exists
    and a step ran, by kind and tier: ``params``, ``master``, ``grads``, ``full_grads``,
    ``optimizer`` (Adam moments), ``staging`` (NVMe staging slots in use), ``nvme`` (swap
    files), plus ``padding_elements`` (``{"count": n}``)."""
    if swap is None:
        swap = plan_swap(units, config, world)
    out: dict[str, dict[str, int]] = {}
    for u in units:
        for kind, tiers in resident_bytes(u, config, rank, swap, with_optimizer, device).items():
            for tier, n in tiers.items():
                out.setdefault(kind, {}).setdefault(tier, 0)
                out[kind][tier] += n
    if swap is not None:
        out["nvme"] = {"nvme": swap.total_bytes}
        if "optim" in swap.sizes and with_optimizer:
            out["staging"] = {"host": staging_slots(units, swap, rank) * swap.slot_bytes}
    out["padding_elements"] = {"count": sum(u.padded - u.numel for u in units)}
    return out


# --------------------------------------------------------------------------- the plan
@dataclass
class Option:
    """One configuration: its bytes per rank by row and tier, and whether it fits."""

    stage: int
    offload_param: str
    offload_optimizer: str
    rows: dict[str, dict[str, int]]  # row -> tier -> bytes per rank
    detail: dict[str, dict[str, int]]  # engine kinds (memory_report names) and buffers
    ranks_per_node: int
    fits: bool | None = None
    why_not: list[str] = field(default_factory=list)
    error: str | None = None  # the config itself is refused (e.g. staging too small)
    optim_state_bits: int = 32  # Adam moments in fp32 or 8-bit

    @property
    def name(self) -> str:
        return (
            f"stage {self.stage}, offload param={self.offload_param}, "
            f"optimizer={self.offload_optimizer}"
        )

    def per_rank(self, tier: str) -> int:
        return sum(r.get(tier, 0) for r in self.rows.values())

    @property
    def per_gpu(self) -> int:
        return self.per_rank("device")

    @property
    def per_host(self) -> int:
        return self.per_rank("host") * self.ranks_per_node

    @property
    def nvme_per_host(self) -> int:
        return self.per_rank("nvme") * self.ranks_per_node

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state per rank, all tiers (the ZeRO paper's
        model states)."""
        return sum(sum(self.rows[r].values()) for r in ("params", "grads", "optimizer"))

    @property
    def expressible(self) -> bool:
        """Whether ``zerotune finetune --offload`` can say it (one tier for both, or stage 1-2,
        where ``--offload`` moves the optimizer only); otherwise it takes a config file."""
        return self.stage < 3 or self.offload_param == self.offload_optimizer

    def config(self, nvme_path: str | None = None) -> dict[str, Any]:
        """The ``ZeroConfig`` keys of this option."""
        out: dict[str, Any] = {
            "stage": self.stage,
            "offload_param": self.offload_param,
            "offload_optimizer": self.offload_optimizer,
        }
        if "nvme" in (self.offload_param, self.offload_optimizer):
            out["nvme_path"] = nvme_path or "/path/on/nvme"
        if self.optim_state_bits != 32:
            out["optim_state_bits"] = self.optim_state_bits
        return out

    def flags(self, nvme_path: str | None = None, config_file: bool = False) -> str:
        """The ``zerotune finetune`` options for this configuration (``--offload X`` offloads
        the optimizer and, at stage 3, the parameters; other mixes, or ``config_file``, go
        in a config file whose keys ``config()`` gives)."""
        parts = [f"--stage {self.stage}"]
        if self.expressible and not config_file:
            parts.append(f"--offload {self.offload_optimizer}")
        else:
            parts.append("--config zerotune.yaml")
        if "nvme" in (self.offload_param, self.offload_optimizer):
            parts.append(f"--nvme-path {shlex.quote(nvme_path or '/path/on/nvme')}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "offload_param": self.offload_param,
            "offload_optimizer": self.offload_optimizer,
            "per_gpu": {r: self.rows[r].get("device", 0) for r in ROWS} | {"total": self.per_gpu},
            "per_host": {r: self.rows[r].get("host", 0) * self.ranks_per_node for r in ROWS}
            | {"total": self.per_host},
            "nvme_per_host": self.nvme_per_host,
            "model_states_per_rank": self.model_states,
            "detail_per_rank": self.detail,
            "fits": self.fits,
            "why_not": self.why_not,
            "error": self.error,
        }


@dataclass
class MemoryPlan:
    """Every option for one model on one machine, and the recommendation."""

    model: str
    parameters: int
    world_size: int
    gpus_per_node: int
    dtype: str
    grad_dtype: str
    limits: dict[str, int | None]  # device / host / nvme capacity (per GPU, per host)
    headroom: float
    activations: dict[str, Any] | None
    options: list[Option]
    nvme_path: str | None = None
    padding_elements: int = 0
    units: int = 0
    optim_state_bits: int = 32
    device: str = "cuda"  # the compute device planned for: "cpu" holds it all in host memory

    @property
    def recommended(self) -> Option | None:
        """The weakest option that fits (the list is ordered weakest first)."""
        return next((o for o in self.options if o.fits), None)

    def option(self, stage: int, offload_param: str = "none", offload_optimizer: str = "none"):
        for o in self.options:
            if (o.stage, o.offload_param, o.offload_optimizer) == (
                stage,
                offload_param,
                offload_optimizer,
            ):
                return o
        raise KeyError((stage, offload_param, offload_optimizer))

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommended
        return {
            "model": self.model,
            "device": "cpu" if self.device == "cpu" else "gpu",
            "parameters": self.parameters,
            "units": self.units,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "dtype": self.dtype,
            "grad_dtype": self.grad_dtype,
            "optim_state_bits": self.optim_state_bits,
            "padding_elements_per_rank": self.padding_elements,
            "limits": self.limits,
            "headroom": self.headroom,
            "activations": self.activations,
            "options": [o.to_dict() for o in self.options],
            "recommended": None
            if rec is None
            else {
                "stage": rec.stage,
                "offload_param": rec.offload_param,
                "offload_optimizer": rec.offload_optimizer,
                "config": self.config_file() or rec.config(self.nvme_path),
                "flags": rec.flags(self.nvme_path, config_file=self.config_file() is not None),
                "command": self.command(),
            },
        }

    def command(self) -> str | None:
        """The ``zerotune finetune`` command line of the recommended option (None when
        nothing fits): its ZeRO tiers and what the plan assumed of the job."""
        rec = self.recommended
        if rec is None:
            return None
        model = "MODEL" if self.model == "a bare parameter count" else shlex.quote(self.model)
        if getattr(self, "random_init", False):
            model += " --init random"  # a preset or a config: no weights to load
        zero = rec.flags(self.nvme_path, config_file=self.config_file() is not None)
        return f"zerotune finetune --model {model} {zero}{job_flags(self)}"

    def config_file(self) -> dict | None:
        """The keys of the config file the recommended command needs (a mix of tiers
        ``--offload`` cannot say, or gradients not in fp32, which no flag sets), or None."""
        rec = self.recommended
        if rec is None or (rec.expressible and self.grad_dtype == "fp32"):
            return None
        keys = rec.config(self.nvme_path)
        if self.grad_dtype != "fp32":
            keys["grad_dtype"] = self.grad_dtype
        return keys

    def format(self) -> str:
        """A table for people."""
        return format_plan(self)


def _options() -> list[tuple[int, str, str]]:
    """Every valid (stage, offload_param, offload_optimizer), weakest first."""
    combos = [(s, "none", o) for s in (1, 2) for o in _OFFLOADS]
    combos += [(3, p, o) for p in _OFFLOADS for o in _OFFLOADS]
    return sorted(
        combos, key=lambda c: (c[0], max(_LEVEL[c[1]], _LEVEL[c[2]]), _LEVEL[c[1]], _LEVEL[c[2]])
    )


def _bare_units(numel: int, config: ZeroConfig, world: int) -> list[UnitPlan]:
    # A bare parameter count: one unit holding everything (padding at most world-1).
    return [size_unit(0, "<params>", [("<params>", numel, True)], config, world)]


def estimate(
    model=None,
    *,
    params: int | float | None = None,
    world_size: int = 1,
    gpus_per_node: int | None = None,
    gpu_memory: int | str | None = "80GB",
    host_memory: int | str | None = None,
    nvme_space: int | str | None = None,
    seq_len: int | None = None,
    micro_batch: int = 1,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    grad_dtype: str = "fp32",
    config: ZeroConfig | dict | None = None,
    device: str = "cuda",
    headroom: float = 0.1,
    nvme_path: str | None = None,
    optim_state_bits: int | None = None,
) -> MemoryPlan:
    """The memory plan of ``model`` (an ``nn.Module``, meta-device or real; a transformers
    config; a preset name or config.json path), or of a bare parameter count ``params``.

    ``gpu_memory`` is per GPU, ``host_memory`` and ``nvme_space`` per host (None: not
    checked). ``config`` holds further engine settings (prefetch_bytes, staging_bytes, ...;
    stage and offload keys are set per option). ``device="cpu"`` estimates a CPU run
    (activation rules of CPU kernels; the compute side, activations, gathered units and
    working buffers included, is counted in host memory; ``gpu_memory`` is not used), as
    ``zerotune finetune``'s check before loading does without a GPU (``preflight``).
    ``headroom`` is the share of every tier left free for what is not counted (see [Note:
    activation memory] in activation_memory.py).
    ``optim_state_bits`` (32 or 8; default: the config's) keeps Adam moments in fp32 or
    8-bit (see optim/quant8.py).
    """
    if (model is None) == (params is None):
        raise ConfigError("give a model or a parameter count (params), not both")
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    gpus_per_node = min(world_size, 8) if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1:
        raise ConfigError(f"gpus_per_node must be at least 1, got {gpus_per_node}")
    if micro_batch < 1 or (seq_len is not None and seq_len < 1):
        raise ConfigError("seq_len and micro_batch must be at least 1")
    if not 0 <= headroom < 1:
        raise ConfigError(f"headroom must be in [0, 1), got {headroom}")
    if device == "cpu":
        gpu_memory = None  # a CPU run has no device memory: its compute side is the host's
    limits = {
        "device": None if gpu_memory is None else parse_bytes(gpu_memory, name="gpu_memory"),
        "host": None if host_memory is None else parse_bytes(host_memory, name="host_memory"),
        "nvme": None if nvme_space is None else parse_bytes(nvme_space, name="nvme_space"),
    }
    ranks_per_node = min(gpus_per_node, world_size)
    base = config if isinstance(config, ZeroConfig) else ZeroConfig.from_dict(dict(config or {}))
    bits = base.optim_state_bits if optim_state_bits is None else optim_state_bits
    # Activations offloaded to NVMe need a folder in every option: a stand-in (not read).
    act_nvme = "/nvme" if base.offload_activations == "nvme" else None
    base = base.replace(
        dtype=dtype,
        grad_dtype=grad_dtype,
        optim_state_bits=bits,
        stage=3,
        offload_param="none",
        offload_optimizer="none",
        nvme_path=act_nvme,
    )

    shape = engine = None
    if params is not None:
        if isinstance(params, bool) or not float(params).is_integer() or params < 1:
            raise ConfigError(f"params must be a positive whole number, got {params!r}")
        if params > _MAX_PARAMS:  # the plan walks the optimizer's chunks one by one
            raise ConfigError(f"params: at most {_MAX_PARAMS:.0e} here, got {params!r}")
        numel, name, module = int(params), "a bare parameter count", None
    else:
        from .hf.models import meta_model

        module, name = meta_model(model)
        # A model zerotune already sharded: its parameters are shards, its units know sizes.
        engine = module if isinstance(module, ZeroEngine) else None
        engine = engine or getattr(module, "_zerotune_engine", None)
        if engine is not None:
            module = engine.module
            numel = sum(u.numel for u in engine.units)
        else:
            numel = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        shape = model_shape(module)

    activations = None
    act = None
    if shape is not None:
        seq = seq_len or min(shape.max_positions or 2048, 2048)
        kwargs = dict(device=device)
        plain = activation_bytes(shape, seq, micro_batch, base.torch_dtype, **kwargs)
        ckpt = activation_bytes(
            shape, seq, micro_batch, base.torch_dtype, checkpointing=True, **kwargs
        )
        act = ckpt if activation_checkpointing else plain
        activations = {
            "seq_len": seq,
            "micro_batch": micro_batch,
            "checkpointing": activation_checkpointing,
            "without_checkpointing": plain["total"],
            "with_checkpointing": ckpt["total"],
            "per_gpu": act["total"],
        }

    options = []
    units_count = padding = 0
    for stage, op, oo in _options():
        cfg = base.replace(
            stage=stage,
            offload_param=op,
            offload_optimizer=oo,
            nvme_path="/nvme" if "nvme" in (op, oo) else act_nvme,
        )
        if module is None:
            units = _bare_units(numel, cfg, world_size)
        elif engine is not None:
            units = _engine_units(engine, cfg, world_size)
        else:
            units = plan_units(module, cfg, world_size)
        units_count = len(units)
        padding = sum(u.padded - u.numel for u in units)
        option = Option(stage, op, oo, {r: {} for r in ROWS}, {}, ranks_per_node)
        option.optim_state_bits = base.optim_state_bits
        try:
            swap = plan_swap(units, cfg, world_size)
        except (ConfigError, ValueError) as exc:
            option.error = str(exc)
            option.fits = False
            option.why_not.append(str(exc))
            options.append(option)
            continue
        option.rows, option.detail = _rows(
            units, cfg, world_size, 0, swap, act, device, known_units=module is not None
        )
        _judge(option, limits, headroom)
        options.append(option)

    return MemoryPlan(
        model=name,
        parameters=numel,
        world_size=world_size,
        gpus_per_node=ranks_per_node,
        dtype=base.dtype,
        grad_dtype=base.grad_dtype,
        limits=limits,
        headroom=headroom,
        activations=activations,
        options=options,
        nvme_path=nvme_path,
        padding_elements=padding,
        units=units_count,
        optim_state_bits=base.optim_state_bits,
        device=device,
    )


def _rows(
    units: list[UnitPlan],
    config: ZeroConfig,
    world: int,
    rank: int,
    swap: SwapPlan | None,
    act: dict[str, int] | None,
    device: str,
    known_units: bool = True,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Peak bytes per rank by row and tier, and the detail they come from.

    Model states, the pool (with the gradient shards a clipped overlapped step keeps) and
    staging are held for the whole run. The other working buffers (gathered units,
    parameter gradients waiting for their reduction, NVMe read buffers) live while
    backward runs through the layers, after the loss's own peak: they add to the peak only
    in so far as they exceed what that peak leaves over (``act["total"] - act["backward"]``).
    On a CPU (``device="cpu"``) every tier but NVMe is one memory, reported as host.
    """
    kinds = engine_bytes(units, config, world, rank, swap=swap, device=device)
    kinds.pop("padding_elements")
    act_total = act["total"] if act is not None else 0
    if known_units:
        work = working_buffers(units, config, world, swap, device, act_total)
    else:
        # Unit sizes unknown (a bare parameter count): prefetch_bytes stands for the units
        # gathered at once (copies exist at stage 3 across ranks, or read from NVMe).
        copies = config.stage == 3 and (world > 1 or config.offload_param == "nvme")
        work = {"gathered": {"device": config.prefetch_bytes}} if copies else {}
        work.update(host_cache_bytes(units, config, device, act_total))
    rows: dict[str, dict[str, int]] = {r: {} for r in ROWS}

    def add(row: str, tier: str, n: int) -> None:
        if n:
            tier = "host" if device == "cpu" and tier == "device" else tier
            rows[row][tier] = rows[row].get(tier, 0) + n

    for kind, row in (
        ("params", "params"),
        ("master", "optimizer"),
        ("optimizer", "optimizer"),
        ("grads", "grads"),
        ("full_grads", "grads"),
    ):
        for tier, n in kinds.get(kind, {}).items():
            add(row, tier, n)
    if swap is not None:
        for k, row in (("param", "params"), ("optim", "optimizer"), ("grad", "grads")):
            add(row, "nvme", swap.file_bytes(k))
        add("staging", "host", staging_resident(units, swap, rank))
    if act is not None:
        add("activations", "device", act["total"])
    slack = act["total"] - act["backward"] if act is not None else 0
    for kind in ("pool", "grads_kept", "host_copies", "host_cache"):
        for tier, n in work.get(kind, {}).items():
            add("buffers", tier, n)
    transient: dict[str, int] = {}
    for kind in ("gathered", "param_grads", "nvme_reads", "gather_cache"):
        for tier, n in work.get(kind, {}).items():
            tier = "host" if device == "cpu" and tier == "device" else tier
            transient[tier] = transient.get(tier, 0) + n
    act_tier = "host" if device == "cpu" else "device"
    for tier, n in transient.items():
        add("buffers", tier, max(0, n - slack) if tier == act_tier else n)
    # Buffers of the end of backward: what the activations left by then makes room.
    end_slack = act["total"] - act["end"] if act is not None else 0
    for tier, n in work.get("pool_late", {}).items():
        tier = "host" if device == "cpu" and tier == "device" else tier
        add("buffers", tier, max(0, n - end_slack) if tier == act_tier else n)
    return rows, {**kinds, **work}


def _judge(option: Option, limits: dict[str, int | None], headroom: float) -> None:
    usable = {k: None if v is None else int(v * (1 - headroom)) for k, v in limits.items()}
    need = {"device": option.per_gpu, "host": option.per_host, "nvme": option.nvme_per_host}
    where = {"device": "per GPU", "host": "per host", "nvme": "NVMe per host"}
    fits = True
    for tier, n in need.items():
        if n == 0:
            continue
        if tier == "nvme" and usable["nvme"] is None:
            continue  # unknown space: the engine checks it at start
        if usable[tier] is not None and n > usable[tier]:
            fits = False
            option.why_not.append(
                f"{where[tier]}: needs {format_bytes(n)}, usable {format_bytes(usable[tier])}"
            )
    option.fits = fits


# --------------------------------------------------------------- checking before a run
def preflight(
    model,
    config: ZeroConfig,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    device: str,
    host_memory: int,
    gpu_memory: int | None = None,
    nvme_space: int | None = None,
) -> str | None:
    """None when the run ``config`` describes fits this machine by the plan, else one
    sentence: what it needs against what there is, and the settings that would fit (a
    micro-batch of 1 with activation checkpointing, another offload tier, or both).
    ``host_memory`` and ``gpu_memory``: what is free now; ``world_size`` ranks on this host."""

    def plan(batch: int, ckpt: bool) -> MemoryPlan:
        return estimate(
            model,
            world_size=world_size,
            gpus_per_node=world_size,
            gpu_memory=gpu_memory,
            host_memory=host_memory,
            nvme_space=nvme_space,
            seq_len=seq_len,
            micro_batch=batch,
            activation_checkpointing=ckpt,
            dtype=config.dtype,
            grad_dtype=config.grad_dtype,
            config=config,
            device=device,
        )

    chosen = (config.stage, config.offload_param, config.offload_optimizer)
    asked = plan(micro_batch, checkpointing)
    option = asked.option(*chosen)
    if option.fits:
        return None
    small = (micro_batch, checkpointing) != (1, True)
    smaller = plan(1, True) if small else asked
    flags = f"--per_device_train_batch_size 1 {checkpointing_flag()}"
    if small and smaller.option(*chosen).fits:
        fix = flags
    elif asked.recommended is not None:
        fix = asked.recommended.flags()
    elif small and smaller.recommended is not None:
        fix = f"{smaller.recommended.flags()} {flags}"
    else:
        fix = None
    what = "; ".join(option.why_not or [option.error or "it does not fit"])
    advice = f"these would fit: {fix}" if fix else "no stage or offload tier fits this machine"
    return (
        f"this run does not fit this machine by the memory plan ({option.name}, micro-batch "
        f"{micro_batch} x {seq_len} tokens: {what}); {advice}"
    )


# ----------------------------------------------------------------- checking at run time
def _engine_units(engine, config: ZeroConfig | None = None, world: int | None = None):
    """The unit plans of an existing engine (its parameters are shards by now, so the sizes
    come from the units' slots), under ``config`` and ``world`` (default: the engine's)."""
    index = {u: i for i, u in enumerate(engine.units)}
    return [
        size_unit(
            u.index,
            u.name,
            [(s.name, s.numel, s.trainable) for s in u.slots],
            config or engine.config,
            world or engine.world,
            tuple(index[d] for d in u.deps),
        )
        for u in engine.units
    ]


def check_estimate(
    engine,
    measured_bytes: dict[str, int],
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    activation_checkpointing: bool = False,
    tolerance: float = 0.15,
    min_bytes: int = 64 * 2**20,
) -> list[str]:
    """Compare measured peaks per tier (``device``, ``host``, ``nvme``; bytes this rank
    added since before the engine was built) with the estimate for ``engine``'s own
    configuration; log both and return a warning per tier that differs by more than
    ``tolerance`` and by more than ``min_bytes`` (a few MiB of allocator and library
    noise on a tiny model is not a planning error). The trainer calls it after the first
    step. Activations are counted when ``seq_len`` is given. On a CPU-only engine device
    and host are one tier (host)."""
    cfg, world, rank = engine.config, engine.world, engine.rank
    units = _engine_units(engine)
    swap = plan_swap(units, cfg, world)
    shape = model_shape(engine.module)
    act = None
    if seq_len and shape is not None:
        act = activation_bytes(
            shape,
            seq_len,
            micro_batch,
            cfg.torch_dtype,
            checkpointing=activation_checkpointing,
            device=engine.device.type,
        )
    device = "cpu" if engine.device.type == "cpu" else "cuda"
    rows, _ = _rows(units, cfg, world, rank, swap, act, device)
    est = {t: sum(r.get(t, 0) for r in rows.values()) for t in TIERS}
    if device == "cpu" and "device" in measured_bytes:
        measured_bytes = dict(measured_bytes)
        measured_bytes["host"] = measured_bytes.get("host", 0) + measured_bytes.pop("device")
    warnings = []
    for tier, measured in measured_bytes.items():
        if tier not in est:
            raise ValueError(f"unknown memory tier {tier!r}; use device, host or nvme")
        expected = est[tier]
        log.info(
            "zerotune: peak %s memory: estimated %s, measured %s",
            tier,
            format_bytes(expected),
            format_bytes(measured),
        )
        if expected == 0 and measured == 0:
            continue
        off = abs(measured - expected) / max(expected, 1)
        if off > tolerance and abs(measured - expected) > min_bytes:
            warnings.append(
                f"peak {tier} memory {format_bytes(measured)} differs from the estimate "
                f"{format_bytes(expected)} "
                f"by {off:.0%} (more than {tolerance:.0%}); plans made with zerotune estimate "
                "may not hold for this run"
            )
    for w in warnings:
        log.warning("zerotune: %s", w)
    return warnings
