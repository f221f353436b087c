"""Zero-init: build a model whose parameters are never whole in one process.

[Note: zero-init]
The model is built on the meta device (no memory). The engine then builds its units one at a
time; just before unit U is built, ``_Materializer`` gives U's parameters real storage,
runs the model's own initialization on U's modules (HF ``_init_weights``, otherwise
``reset_parameters``), with the random generator seeded from (seed, U's name), so every rank
and every world size gets the same values. The unit takes its slice and drops the rest
before the next unit is materialized: peak memory is the shards plus one whole unit.
Parameters that U's modules hold but another unit owns (a tied head, the tiles of a tiled
linear) are hidden from U's initialization, so each tensor is initialized once, by its
owner. A tile is initialized as the model initializes the layer it came from (see
``init_tile`` in sharding/tiling.py).
Buffers created on the meta device are given storage and initialized with their unit (HF
rotary embeddings recompute ``inv_freq`` in ``_init_weights``). Each module is initialized
by the ``_init_weights`` of its nearest enclosing transformers model, as transformers
dispatches a composite model's towers. A module's init may fill a child's weight that
another unit owns (Whisper's encoder writes sinusoids into its position table): frozen
floating-point weights of other units (up to 64 MiB a unit) are lent NaN-filled copies
during the init, and what it writes there is put into the owners' shards at the end, so
the enclosing module's init wins, as in transformers. Trainable ones stay hidden.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import zlib
from collections.abc import Callable

import torch
from torch import nn

from ..config import ZeroConfig, load_config
from ..memory.host import release_free_memory
from ..sharding.engine import ZeroEngine
from ..sharding.tiling import LinearTile, TiledLinear, init_tile

__all__ = [
    "InitFunctions",
    "build_from_config",
    "build_on_meta",
    "copy_sharded",
    "default_device",
    "hidden",
    "materialize_buffers",
    "realize_placeholders",
    "zero_init",
]

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unit_seed(seed: int, unit_name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(unit_name.encode())) % 2**63


def build_on_meta(model_or_config) -> nn.Module:
    """The model of a transformers config (or a factory) built on the meta device: its
    structure and shapes, no storage."""
    if isinstance(model_or_config, nn.Module):
        raise ValueError(
            "zero_init needs a config or a factory, not a built model (it would already be whole "
            "in memory); use zerotune.shard(model) for a model you already built"
        )
    with torch.device("meta"):
        if callable(model_or_config) and not hasattr(model_or_config, "to_dict"):
            return model_or_config()
        return build_from_config(model_or_config)


def build_from_config(config, auto_class=None) -> nn.Module:
    """The model of a transformers config: ``auto_class``'s, else the class the config names
    in ``architectures`` (a checkpoint's own: T5, Whisper, a vision-language model), else
    ``AutoModelForCausalLM``'s."""
    import transformers

    if auto_class is None:
        for name in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
                return cls(config)
        auto_class = transformers.AutoModelForCausalLM
    return auto_class.from_config(config)


def _reset(module: nn.Module) -> None:
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        fn()


class InitFunctions:
    """Each module's init: the ``_init_weights`` of the nearest enclosing transformers model
    (a composite model's vision tower has its own, as transformers dispatches it), else
    ``reset_parameters``. ``init_for(module)`` looks the model up again for a module made
    after it was built (the engine's tiles)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.by_id = self._walk()

    def _walk(self) -> dict[int, Callable[[nn.Module], None]]:
        from transformers import PreTrainedModel

        by_name: dict[str, Callable[[nn.Module], None]] = {}
        out: dict[int, Callable[[nn.Module], None]] = {}
        for name, m in self.model.named_modules():
            fn = by_name.get(name.rpartition(".")[0], _reset) if name else _reset
            if isinstance(m, PreTrainedModel) or (m is self.model and hasattr(m, "config")):
                fn = getattr(m, "_init_weights", fn)
            by_name[name] = out.setdefault(id(m), fn)
        return out

    def __call__(self, module: nn.Module) -> Callable[[nn.Module], None]:
        if id(module) not in self.by_id:
            self.by_id = self._walk()
        return self.by_id[id(module)]


@contextlib.contextmanager
def hidden(params: list[nn.Parameter], device: torch.device):
    """Point ``params`` at empty tensors for a while, marked initialized for transformers'
    init functions, so that an init function leaves them alone (HF's ``_init_weights``
    otherwise indexes an embedding's padding row, which an empty tensor does not have)."""
    params = list({id(p): p for p in params}.values())  # each once (tied weights)
    saved = [(p.data, p.__dict__.get("_is_hf_initialized", _UNSET)) for p in params]
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=device)
        p._is_hf_initialized = True
    try:
        yield
    finally:
        for p, (data, flag) in zip(params, saved):
            p.data = data
            if flag is _UNSET:
                del p._is_hf_initialized
            else:
                p._is_hf_initialized = flag


_UNSET = object()
LENT_BYTES = 64 << 20  # at most this much of other units' frozen weights lent to one init


class _Materializer:
    """``prepare_unit`` for zero-init: real storage and the model's own init, per unit."""

    def __init__(self, model: nn.Module, seed: int, device: torch.device):
        self.model, self.seed, self.device = model, seed, device
        self.init_for = InitFunctions(model)
        self.is_hf = hasattr(model, "_init_weights") and hasattr(model, "config")
        # Frozen weights of other units that a unit's init wrote (a parent's init filling a
        # child's table): (parameter, values, written mask), put into the owners at the end.
        self.written: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def __call__(self, unit_name: str, modules: list[nn.Module], params) -> None:
        release_free_memory()  # what the previous unit left behind goes back to the system
        own = {id(p) for _, p in params}
        for _, p in params:
            p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        with_buffers = materialize_buffers(modules, self.device)
        if not self.is_hf:
            for m in with_buffers:
                if not callable(getattr(m, "reset_parameters", None)):
                    raise ValueError(
                        f"{type(m).__name__} has buffers built on the meta device and no "
                        "reset_parameters() to compute them; build it whole and use "
                        "zerotune.shard()"
                    )
        # Hidden too: parameters of units nested in this one (tiles), reachable through
        # init code that walks a module's parameters. Frozen floating-point ones are lent a
        # NaN-filled copy instead: what this unit's init writes there is kept (see
        # [Note: zero-init]).
        foreign = {id(p): p for m in modules for p in m.parameters() if id(p) not in own}
        lent, hide, room = [], [], LENT_BYTES
        for p in foreign.values():
            nbytes = p.numel() * p.element_size()
            if not p.requires_grad and p.is_floating_point() and nbytes <= room:
                lent.append(p)
                room -= nbytes
            else:
                hide.append(p)
        saved = [(p, p.data) for p in lent]
        for p in lent:
            p.data = torch.full(p.shape, float("nan"), dtype=p.dtype, device=self.device)
        try:
            with torch.random.fork_rng(devices=[]), hidden(hide, self.device), torch.no_grad():
                torch.manual_seed(_unit_seed(self.seed, unit_name))
                for m in modules:
                    fn = self.init_for(m)
                    if isinstance(m, (LinearTile, TiledLinear)):
                        init_tile(self.model, m, fn, self.is_hf)
                    else:
                        fn(m)
        finally:
            for p, data in saved:
                written = ~torch.isnan(p.data)
                if written.any():
                    self.written.append((p, p.data, written))
                p.data = data
        return None

    def apply_written(self, engine: ZeroEngine) -> None:
        """Put what units' inits wrote into frozen weights of other units into their owners'
        shards (the init of the enclosing module runs after its children's, as in
        transformers)."""
        for param, values, written in self.written:
            for unit in engine.units:
                slot = next((s for s in unit.slots if s.param is param), None)
                if slot is None:
                    continue
                master = engine.unit_state(unit, master_only=True)["master"].clone()
                lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if a < b:
                    flat, mask = values.reshape(-1).float(), written.reshape(-1)
                    part = master[a - lo : b - lo]
                    keep = mask[a - slot.offset : b - slot.offset]
                    part[keep] = flat[a - slot.offset : b - slot.offset][keep]
                engine.load_unit_state(unit, {"master": master})
        self.written.clear()


def realize_placeholders(
    model: nn.Module, device: torch.device, shape_of=None
) -> dict[int, nn.Parameter]:
    """Swap every meta parameter for a parameter on ``device`` whose data is a zero-stride
    placeholder of the right shape (one element of memory); with ``shape_of``, every
    parameter, for one of the shape it gives (a sharded model shaped anew). Tied parameters
    stay tied. Done before any reference to the parameters is taken: the engine keeps these
    objects for good. Returns each new parameter's id -> the parameter it replaced."""
    swapped: dict[int, nn.Parameter] = {}
    replaced: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is None or (shape_of is None and not p.is_meta):
                continue
            if id(p) not in swapped:
                shape = p.shape if shape_of is None else shape_of(p)
                placeholder = torch.empty(1, dtype=p.dtype, device=device).expand(shape)
                swapped[id(p)] = nn.Parameter(placeholder, requires_grad=p.requires_grad)
                replaced[id(swapped[id(p)])] = p
            m._parameters[name] = swapped[id(p)]
    return replaced


def materialize_buffers(modules: list[nn.Module], device: torch.device) -> list[nn.Module]:
    """Give the meta buffers of ``modules`` (uninitialized) storage; returns the modules that
    had some."""
    touched = []
    for m in modules:
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                m._buffers[name] = torch.empty_like(buf, device=device)
                if m not in touched:
                    touched.append(m)
    return touched


def zero_init(
    model_or_config,
    config: ZeroConfig | dict | str | None = None,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    group=None,
) -> ZeroEngine:
    """Build and shard a model without ever holding it whole.

    ``model_or_config``: a transformers config (see ``build_from_config``) or a
    zero-argument factory returning an ``nn.Module``. The same seed gives the same model at
    any world size. See [Note: zero-init].
    """
    model = build_on_meta(model_or_config)
    device = torch.device(device) if device is not None else default_device()
    realize_placeholders(model, device)
    materializer = _Materializer(model, seed, device)
    engine = ZeroEngine(model, load_config(config), group, device=device, prepare_unit=materializer)
    materializer.apply_written(engine)
    leftover = [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise ValueError(f"buffers left on the meta device after zero-init: {leftover[:5]}")
    return engine


def copy_sharded(
    source: ZeroEngine,
    config: ZeroConfig | dict | str | None = None,
    *,
    device: torch.device | str | None = None,
    frozen: bool = False,
) -> ZeroEngine:
    """A second sharded model with ``source``'s current weights, never whole in memory (see
    [Note: copies of a sharded model] in sharding/copies.py): a transformers model of the
    same class and config, sharded by ``config`` (default: the source's) into the same
    units, each rank's slices copied from the source's. ``frozen``: for reading only (no
    gradients, no fp32 master). Every rank of the source's group must call it."""
    from transformers import PreTrainedModel

    module = source.module
    if not isinstance(module, PreTrainedModel):
        raise TypeError(
            "copy_sharded rebuilds transformers models from their class and config; for "
            f"{type(module).__name__}, shard a new instance and copy with load_unit_state"
        )
    model = build_on_meta(lambda: type(module)(copy.deepcopy(module.config)))
    trainable = {n: p.requires_grad and not frozen for n, p in module.named_parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(trainable.get(name, not frozen))
    device = torch.device(device) if device is not None else source.device
    realize_placeholders(model, device)
    config = source.config if config is None else load_config(config)
    return ZeroEngine(
        model, config, source.group, device=device, prepare_unit=_CopyFrom(source, model, device)
    )


class _CopyFrom:
    """``prepare_unit`` for ``copy_sharded``: buffers from the source's modules of the same
    name, each rank's slices from the source's unit of the same name and layout."""

    def __init__(self, source: ZeroEngine, model: nn.Module, device: torch.device) -> None:
        self.source, self.device = source, device
        self.names = {id(m): name for name, m in model.named_modules()}
        self.source_modules = dict(source.module.named_modules())
        self.units = {u.name: u for u in source.units}

    def __call__(self, unit_name: str, modules: list[nn.Module], params):
        for m in materialize_buffers(modules, self.device):
            original = self.source_modules[self.names[id(m)]]
            for name, buf in m._buffers.items():
                if buf is not None:
                    buf.copy_(original._buffers[name])
        return self.fill

    def fill(self, unit, master: torch.Tensor) -> None:
        original = self.units.get(unit.name)
        if original is None or original.layout() != unit.layout():
            raise ValueError(
                f"copy_sharded: unit {unit.name} is not sharded like the source's (another "
                "zero configuration?); copy with the source's own"
            )
        master.copy_(self.source.unit_state(original, master_only=True)["master"])
