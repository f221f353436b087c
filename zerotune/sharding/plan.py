"""The unit plan: which parameters each unit owns, its sizes, and what each rank holds.

[Note: unit plan]
These are the size rules of the engine written as pure functions of the model's structure
and the config, so that ``zerotune estimate`` and the engine cannot disagree:

* ownership: units are ``[root] + select_unit_modules(model)``; non-root units claim their
  parameters first, in module order (a tied weight belongs to the first module that holds
  it); the root unit takes what is left. A unit that holds a parameter another unit owns
  depends on that unit (it gathers it with its own).
* sizes: ``padded = ceil(numel / world) * world`` elements, ``shard = padded / world`` per rank.
* persistence: every unit at stages 1-2; at stage 3 a unit whose gathered bytes
  (``padded * itemsize``) are at most ``persistence_threshold``.
* swap files (NVMe): per unit, a param extent (compute-dtype shard) for non-persistent units
  with ``offload_param="nvme"``; an optim extent of three 4 KiB-rounded fp32 regions (master,
  exp_avg, exp_avg_sq; two when fp32 compute keeps the master in the param extent) for
  trainable units with ``offload_optimizer="nvme"`` (with 8-bit moments, chunk records of
  about 6 bytes per element, 2 when the param extent holds the master: ``OptimLayout`` in
  optim/state_store.py); gradient extents (in the gradient dtype)
  when the gradient shards exceed ``grad_host_bytes``. Staging slots hold one chunk of each
  streamed kind (see [Note: optimizer state stores] in optim/state_store.py).
* optimizer state per unit: two fp32 moments, or with ``optim_state_bits=8`` for units of
  at least 4096 elements two uint8 moments and their absmax values (``quant8.state_bytes``).
* resident bytes per rank (``resident_bytes``): what ``Unit.memory_bytes`` and the
  optimizer's store report, and on which tier (device, host, nvme) ``ZeroEngine._place``
  puts it.

[Note: unit policy]
A unit is a module whose parameters are sharded, gathered and released together. The default
policy follows Hugging Face: every instance of a class named in ``_no_split_modules`` (the
transformer blocks), every ``nn.Embedding``, and the output head. Models without
``_no_split_modules`` use their direct children that hold parameters. Whatever no unit claims
belongs to the root unit (the model itself). Units never nest: the outermost match wins,
except for modules marked ``_zerotune_own_unit`` (the tiles of a tiled linear, see
[Note: tiling] in tiling.py), which are units wherever they are. The policy reads
attributes only; it does not import transformers.

Everything here works on meta-device models: only shapes and ``requires_grad`` are read. The
working buffers (gathered units, the reduce pool, staging) are sized in buffers.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ConfigError, ZeroConfig
from ..memory.tiers import master_in_param_file, placement
from ..optim.quant8 import quantized, state_bytes
from ..optim.state_store import OptimLayout
from .tiling import tiled_copy

__all__ = [
    "ROOT",
    "SlotPlan",
    "SwapPlan",
    "UnitSpec",
    "UnitPlan",
    "assign_params",
    "plan_swap",
    "plan_units",
    "resident_bytes",
    "select_unit_modules",
    "size_unit",
    "unit_deps",
]

ROOT = "<root>"
_F32 = 4

UnitSpec = Iterable[str] | Callable[[str, nn.Module], bool] | None


def _default_matcher(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except (AttributeError, NotImplementedError):
            head = None
    if block_names:

        def match(name: str, module: nn.Module) -> bool:
            return (
                type(module).__name__ in block_names
                or isinstance(module, nn.Embedding)
                or (head is not None and module is head)
            )

        return match

    # No block classes declared: the children that hold parameters, looking through
    # containers whose forward is never called (ModuleList, ModuleDict).
    chosen: set[int] = set()
    stack = list(model.children())
    while stack:
        child = stack.pop()
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            stack.extend(child.children())
        elif any(True for _ in child.parameters()):
            chosen.add(id(child))
    return lambda name, module: id(module) in chosen


def select_unit_modules(model: nn.Module, spec: UnitSpec = None) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs that become units, in module order.

    ``spec`` is a list of class names, a predicate ``(name, module) -> bool``, or None for the
    default policy. The root module itself is never returned (it is the root unit).
    """
    if spec is None:
        match = _default_matcher(model)
    elif callable(spec):
        match = spec
    else:
        names = set(spec)
        known = {type(m).__name__ for m in model.modules()}
        unknown = sorted(names - known)
        if unknown:
            raise ValueError(
                f"unit_modules names classes that are not in the model: {unknown}; "
                f"the model has {sorted(known)}"
            )
        match = lambda name, module: type(module).__name__ in names  # noqa: E731

    selected: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module, inside: bool) -> None:
        for child_name, child in module.named_children():
            qualified = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in seen:
                continue
            if getattr(child, "_zerotune_own_unit", False):
                seen.add(id(child))  # a tile (tiling.py): its own unit, even inside another
                selected.append((qualified, child))
            elif not inside and match(qualified, child):
                seen.add(id(child))
                selected.append((qualified, child))
                visit(qualified, child, True)  # only tiles nest
            else:
                visit(qualified, child, inside)

    visit("", model, False)
    return selected


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class SlotPlan:
    """One parameter inside its unit's flat buffer."""

    name: str
    offset: int
    numel: int
    trainable: bool


@dataclass(frozen=True)
class UnitPlan:
    """A unit's sizes at one world size (elements unless named ``*_bytes``)."""

    index: int
    name: str
    numel: int
    padded: int  # numel rounded up to a multiple of the world size
    shard: int  # elements per rank
    persistent: bool  # stays gathered for the whole run
    trainable: bool  # any parameter requires grad
    itemsize: int  # bytes per element of the compute dtype
    slots: tuple[SlotPlan, ...] = ()
    deps: tuple[int, ...] = ()  # indices of units whose parameters this unit uses

    @property
    def gathered_bytes(self) -> int:
        return self.padded * self.itemsize

    def has_optimizer_state(self, rank: int) -> bool:
        """Whether rank ``rank``'s shard holds any trainable element (the optimizer keeps
        moments only for those; a shard of pure padding has none)."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        return any(s.trainable and s.offset < hi and s.offset + s.numel > lo for s in self.slots)


@dataclass
class SwapPlan:
    """One rank's swap files: ``sizes[kind][unit index]`` = bytes before 4 KiB rounding."""

    sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    grads_on_disk: bool = False
    chunk: int = 0  # elements per optimizer chunk (units with fp32 moments)
    slot_bytes: int = 0  # bytes per staging slot
    layout: OptimLayout | None = None  # chunks, slots and scratch of the optimizer stream

    def file_bytes(self, kind: str) -> int:
        """Bytes of ``kind``'s swap file (extents rounded up to 4 KiB, placed as
        ``extent_align`` says)."""
        from ..memory.swap import extent_align, extent_layout

        sizes = self.sizes.get(kind)
        return extent_layout(sizes, extent_align(kind))[1] if sizes else 0

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes(k) for k in self.sizes)


def assign_params(
    model: nn.Module, unit_modules=None
) -> tuple[list[tuple[str, nn.Module]], list[list[tuple[str, nn.Parameter]]], dict[int, int]]:
    """``(specs, per_unit, owned)``: the units' (name, module), root first; each unit's
    (qualified name, parameter) list in flat-buffer order; ``id(param) -> unit index``."""
    specs = [(ROOT, model)] + select_unit_modules(model, unit_modules)
    owned: dict[int, int] = {}
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in specs]
    unit_ids = {id(m) for _, m in specs[1:]}
    # A parameter is named as model.named_parameters() names it (its first name), whichever
    # unit owns it: BERT's head bias is `cls.predictions.bias`, also `...decoder.bias`.
    first: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), pname)
    # Non-root units first, in module order, so a tied weight belongs to the first module
    # that holds it (the input embedding, not the head). A unit nested in another (a tile)
    # owns its own parameters.
    for i, (_, module) in list(enumerate(specs))[1:]:
        for _, p in _named_params_outside(module, unit_ids):
            if id(p) not in owned:
                owned[id(p)] = i
                per_unit[i].append((first[id(p)], p))
    for pname, p in model.named_parameters():
        if id(p) not in owned:
            owned[id(p)] = 0
            per_unit[0].append((pname, p))
    return specs, per_unit, owned


def _named_params_outside(module: nn.Module, unit_ids: set[int], prefix: str = ""):
    """``module.named_parameters()`` without the subtrees of nested units (same order)."""
    for n, p in module._parameters.items():
        if p is not None:
            yield f"{prefix}{n}", p
    for n, child in module._modules.items():
        if child is not None and id(child) not in unit_ids:
            yield from _named_params_outside(child, unit_ids, f"{prefix}{n}.")


def unit_deps(specs: list[tuple[str, nn.Module]], owned: dict[int, int]) -> list[list[int]]:
    """For each unit, the units owning parameters that its modules hold (tied weights),
    walking each unit's modules down to nested units."""
    unit_module_ids = {id(m) for _, m in specs[1:]}
    out: list[list[int]] = []
    for i, (_, module) in enumerate(specs):
        deps: list[int] = []
        stack = [module]
        while stack:
            m = stack.pop()
            for p in m._parameters.values():
                if p is not None and owned[id(p)] != i and owned[id(p)] not in deps:
                    deps.append(owned[id(p)])
            stack.extend(c for c in m.children() if id(c) not in unit_module_ids)
        out.append(deps)
    return out


def size_unit(
    index: int,
    name: str,
    params: list[tuple[str, int, bool]],
    config: ZeroConfig,
    world: int,
    deps: tuple[int, ...] = (),
) -> UnitPlan:
    """The plan of one unit from its ``(name, numel, trainable)`` parameters in order."""
    slots, offset = [], 0
    for pname, numel, trainable in params:
        slots.append(SlotPlan(pname, offset, numel, trainable))
        offset += numel
    itemsize = _itemsize(config.torch_dtype)
    padded = math.ceil(offset / world) * world
    persistent = config.stage < 3 or padded * itemsize <= config.persistence_threshold
    return UnitPlan(
        index=index,
        name=name,
        numel=offset,
        padded=padded,
        shard=padded // world,
        persistent=persistent,
        trainable=any(s.trainable for s in slots),
        itemsize=itemsize,
        slots=tuple(slots),
        deps=tuple(deps),
    )


def plan_units(model: nn.Module, config: ZeroConfig, world: int) -> list[UnitPlan]:
    """The units ``ZeroEngine`` builds for ``model`` at ``world`` ranks (a meta model works).
    With ``tile_linear_bytes`` the units are those of the tiled model, as the engine tiles
    it (see [Note: tiling] in tiling.py); ``model`` itself is left as it is."""
    model = tiled_copy(model, config.tile_linear_bytes, _itemsize(config.torch_dtype))
    specs, per_unit, owned = assign_params(model, config.unit_modules)
    deps = unit_deps(specs, owned)
    return [
        size_unit(
            i,
            name,
            [(pname, p.numel(), p.requires_grad) for pname, p in per_unit[i]],
            config,
            world,
            tuple(deps[i]),
        )
        for i, (name, _) in enumerate(specs)
    ]


def plan_swap(units: list[UnitPlan], config: ZeroConfig, world: int) -> SwapPlan | None:
    """One rank's swap files and staging slots, or None without NVMe offload. Raises
    ``ConfigError``/``ValueError`` when ``staging_bytes`` cannot hold the pipeline."""
    if "nvme" not in (config.offload_param, config.offload_optimizer):
        return None
    from ..config import ConfigError

    itemsize = _itemsize(config.torch_dtype)
    plan = SwapPlan(sizes={"param": {}, "grad": {}, "optim": {}})
    grads_on_disk = False
    grad_itemsize = _itemsize(config.torch_grad_dtype)
    if config.offload_optimizer == "nvme":
        grad_bytes = sum(u.shard * grad_itemsize for u in units if u.trainable)
        grads_on_disk = grad_bytes > config.grad_host_bytes
    layout = OptimLayout.plan(config.staging_bytes, grads_on_disk, config.optim_state_bits)
    for u in units:
        param_on_disk = config.offload_param == "nvme" and not u.persistent and u.numel > 0
        if param_on_disk:
            plan.sizes["param"][u.index] = u.shard * itemsize
        if config.offload_optimizer == "nvme" and u.trainable:
            # With fp32 compute the parameter extent holds the master (state_store.py).
            shared = master_in_param_file(param_on_disk, itemsize)
            plan.sizes["optim"][u.index] = layout.extent_bytes(u.numel, u.shard, not shared)
    plan.grads_on_disk = grads_on_disk
    if grads_on_disk:
        plan.sizes["grad"] = {u.index: u.shard * grad_itemsize for u in units if u.trainable}
    plan.sizes = {k: v for k, v in plan.sizes.items() if v}
    plan.layout = layout
    plan.chunk = layout.chunk
    plan.slot_bytes = layout.slot_bytes
    if 3 * plan.slot_bytes + layout.scratch_bytes > config.staging_bytes:
        raise ConfigError(
            f"staging_bytes={config.staging_bytes:,} is too small: the NVMe pipeline keeps "
            f"three buffers of {plan.slot_bytes:,} bytes in flight; raise staging_bytes"
        )
    return plan


def resident_bytes(
    unit: UnitPlan,
    config: ZeroConfig,
    rank: int = 0,
    swap: SwapPlan | None = None,
    with_optimizer: bool = True,
    device: str = "cuda",
) -> dict[str, dict[str, int]]:
    """``{kind: {tier: bytes}}`` that rank ``rank`` holds in memory for ``unit`` between steps,
    kinds as in ``ZeroEngine.memory_report`` (params, master, grads, optimizer, full_grads)
    and tiers ``device`` (the compute device) or ``host``. Swap-file bytes are in ``swap``.

    The shards are where ``memory.tiers.placement`` puts them, as in ``ZeroEngine._place``;
    Adam moments sit next to the master. On a CPU ``device`` both tiers are the same memory.
    """
    where = placement(
        config,
        persistent=unit.persistent,
        numel=unit.numel,
        trainable=unit.trainable,
        itemsize=unit.itemsize,
        grads_on_disk=swap is not None and swap.grads_on_disk,
        device_type=device,
    )
    master_tier = where.master
    optim_on_disk = master_tier in ("nvme", "param_file")

    out: dict[str, dict[str, int]] = {}

    def add(kind: str, tier: str, nbytes: int) -> None:
        if nbytes:
            out.setdefault(kind, {}).setdefault(tier, 0)
            out[kind][tier] += nbytes

    if where.params != "nvme":
        numel = unit.padded if unit.persistent else unit.shard
        add("params", where.params, numel * unit.itemsize)
    if where.separate_master:
        add("master", master_tier, unit.shard * _F32)
    if unit.trainable and where.grads != "nvme":
        add("grads", where.grads, unit.shard * _itemsize(config.torch_grad_dtype))
    if config.stage == 1:
        # Whole gradients wait in param.grad (compute dtype) from backward to the step.
        add(
            "full_grads",
            "device",
            sum(s.numel for s in unit.slots if s.trainable) * unit.itemsize,
        )
    if with_optimizer and not optim_on_disk and unit.has_optimizer_state(rank):
        if quantized(unit.numel, config.optim_state_bits):
            add("optimizer", master_tier, state_bytes(unit.shard))  # 8-bit, with absmax
        else:
            add("optimizer", master_tier, 2 * unit.shard * _F32)  # exp_avg, exp_avg_sq
    return out


def refuse_parameter_dtypes(model: nn.Module) -> None:
    """Parameters the fp32 master would change, refused in one sentence: float64 ones (the
    model would then compute in another dtype than its inputs) and integer ones."""
    for name, p in model.named_parameters():
        if p.dtype == torch.float64 or not p.is_floating_point():
            raise ConfigError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')}: zerotune keeps "
                "fp32 masters and computes in fp32, bf16 or fp16; cast the model (model.float())"
                " or keep integer values in a buffer"
            )


def refuse_embeddings_it_would_break(model: nn.Module, config: ZeroConfig, world: int) -> None:
    """Embeddings whose contract the sharded engine cannot keep, refused in one sentence:
    sparse gradients (the gradient shards are dense), and ``max_norm``, which rescales the
    rows it looks up in place during forward: that change would land in a gathered,
    offloaded or low-precision copy of the weight and be lost, or differ between ranks."""
    weights_are_the_master = (
        world == 1
        and config.dtype == "fp32"
        and config.offload_param == "none"
        and config.offload_optimizer == "none"
    )
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        kind = type(m).__name__
        if m.sparse:
            raise ConfigError(
                f"{name or 'the model'}: {kind}(sparse=True) makes sparse gradients, which "
                "zerotune's gradient shards cannot hold; build it with sparse=False"
            )
        if m.max_norm is not None and not weights_are_the_master:
            raise ConfigError(
                f"{name or 'the model'}: {kind}(max_norm={m.max_norm}) rescales its weight's "
                "rows in place during forward, and zerotune would lose that change (the "
                "forward sees a gathered, offloaded or low-precision copy, or each rank "
                "rescales other rows); set max_norm=None and renormalize explicitly, or train "
                "in one process, fp32, without offload"
            )
