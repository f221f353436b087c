"""Any ``torch.optim.Optimizer`` over the engine's shards.

[Note: any torch optimizer over the shards]
``ZeroOptimizer(engine, cls, params, **kwargs)`` builds ``cls`` (the *inner* optimizer) over
tensors that stand for this rank's part of the model, and at ``step()`` points them at the
fp32 master shard (``.data``) and the gradient shard (``.grad``) before calling the inner
``step()`` once. The inner optimizer keeps its own state, created lazily as it likes
(shapes, dtypes, scalars), in ``inner.state``. Two layouts:
- ``flat``, for optimizers whose update of an element reads only that element's gradient
  and state (SGD, Adam(W), Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop
  from ``torch.optim``): each segment (this rank's part of one parameter, see [Note:
  segments] in zero_adam.py) is a 1-D view of the master shard. Nothing crosses ranks; the
  state is partitioned by element, like ZeroAdamW's. A state tensor of a segment's shape
  is per element; anything else must be a scalar (a step count), the same on every rank.
- ``whole``, for everything else (Adafactor's factored statistics, update clipping by RMS,
  8-bit blockwise states, a user's class we know nothing of): each trainable parameter is
  updated whole, with its shape, by one *owner* rank (parameters dealt to the ranks by size,
  the largest first, each to the least loaded). At world size 1 the owner's tensors are views
  of the master shard, as in ``flat``. At world size > 1 each unit's master and gradient
  shards are all-gathered, the owner copies out its parameters, the inner optimizer steps,
  and a reduce-scatter (sum: every rank but the owner gives zeros, so it is exact) brings the
  new values back to the shards. The state is partitioned by parameter; between steps a
  rank holds only its owned parameters' state.
``layout="auto"`` picks ``flat`` for the classes above and ``whole`` otherwise; ``whole`` is
right for any optimizer, ``flat`` is cheaper where it is right.
Hyper-parameters live in this optimizer's ``param_groups`` (schedulers and the Trainer set
them there) and are copied to the inner groups before each step (and back after it, for
optimizers that keep counters in their groups). Gradient clipping and the fp16 loss scale
multiply the gradient shard before the step; a parameter without a gradient this step gets
``.grad = None`` (the inner optimizer skips it, as torch does). Checkpoints hold per-element
state as flat tensors of the shard (``state.<key>``, re-sliced at another world size like the
master) and the rest per parameter, written by the rank that owns it (the owner, or the rank
holding the parameter's first element), with an index in the rank file's metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import torch

from .. import dist as zdist
from .sharded import ShardedOptimizer, StepInfo

__all__ = ["ELEMENTWISE", "ZeroOptimizer"]

ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_PY_SCALARS = (bool, int, float)


class _StateKeys(Mapping):
    """The keys ``write_unit`` takes for a unit: ``master`` and any ``state.<key>``, each of
    the shard's length (the inner optimizer's keys are known only once it has stepped)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel

    def __getitem__(self, key: str) -> int:
        if key == "master" or key.startswith("state."):
            return self.numel
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return key == "master" or (isinstance(key, str) and key.startswith("state."))

    def __iter__(self):
        return iter(["master"])

    def __len__(self) -> int:
        return 1


class ZeroOptimizer(ShardedOptimizer):
    """Any ``torch.optim.Optimizer`` class over a model sharded by zerotune.

    ``ZeroOptimizer(engine, torch.optim.Adafactor, params, lr=1e-2)``: ``params`` are the
    model's parameters or parameter groups (None: every trainable parameter); ``kwargs`` go
    to ``optimizer_class``. ``layout``: ``"flat"`` (per-element optimizers), ``"whole"``
    (each parameter updated whole by one rank) or ``"auto"``; see [Note: any torch optimizer
    over the shards]. ``step()`` returns a :class:`StepInfo`.
    """

    def __init__(
        self,
        engine,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable | None = None,
        *,
        layout: str = "auto",
        **kwargs,
    ):
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"ZeroOptimizer needs a torch.optim.Optimizer subclass, not {optimizer_class!r}"
            )
        if layout == "auto":
            layout = "flat" if issubclass(optimizer_class, ELEMENTWISE) else "whole"
        if layout not in ("flat", "whole"):
            raise ValueError(f"layout must be 'auto', 'flat' or 'whole', not {layout!r}")
        config = engine.config
        name = optimizer_class.__name__
        if config.offload_optimizer == "nvme":
            raise ValueError(
                f"{name} with offload_optimizer: nvme: only ZeroAdamW streams its state through "
                "NVMe so far; use offload_optimizer: cpu (host memory) for this optimizer"
            )
        if config.optim_state_bits != 32:
            raise ValueError(
                f"optim_state_bits: {config.optim_state_bits} is ZeroAdamW's 8-bit Adam; {name} "
                "keeps the state it makes (use its own 8-bit variant, e.g. bitsandbytes')"
            )
        groups = self._build_segments(engine, params)
        self.optimizer_class = optimizer_class
        self.layout = layout
        self._counts: dict[object, int] = {}  # segment key -> its parameter's step count
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}  # unit -> state.* being loaded
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        # Built once on stand-ins: checks the arguments and fills each group's defaults.
        probe = optimizer_class([{**h, "params": [torch.zeros(1)]} for h in hyper], **kwargs)
        full_hyper = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
        defaults = dict(probe.defaults)
        del probe

        # Tensors the inner optimizer updates, per group.
        inner_params: list[list[torch.Tensor]] = [[] for _ in groups]
        self._whole: list[tuple[object, object, torch.Tensor]] = []  # (unit, slot, key) owned
        self._units: list[object] = []  # units with parameters in the groups (whole layout)
        world = engine.world
        if layout == "flat":
            for segs in self._unit_segments.values():
                for seg in segs:
                    seg.key = seg.unit.master[seg.start : seg.end].detach()
                    self._counts[seg.key] = 0
                    inner_params[seg.group].append(seg.key)
        else:
            group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
            slots = [
                (u, s)
                for u in engine.units
                for s in u.slots
                if s.trainable and id(s.param) in group_of
            ]
            self._units = list(dict.fromkeys(u for u, _ in slots))
            owners = _deal(slots, world)
            for (unit, slot), owner in zip(slots, owners):
                if owner != engine.rank:
                    continue
                if world == 1:
                    key = _param_view(unit.master, slot).detach()
                else:
                    key = torch.zeros(slot.shape, dtype=torch.float32, device=unit.master.device)
                self._whole.append((unit, slot, key))
                inner_params[group_of[id(slot.param)]].append(key)
            for segs in self._unit_segments.values():
                for seg in segs:
                    seg.key = object()  # its step count's key (the parameter is owned)
                    self._counts[seg.key] = 0
        self.inner: torch.optim.Optimizer | None = None
        if any(inner_params):
            self.inner = optimizer_class(
                [{**h, "params": ps} for h, ps in zip(full_hyper, inner_params)], **kwargs
            )
            if world > 1:
                for _, _, key in self._whole:
                    key.data = _empty_like(key)  # filled at each step
        # This optimizer's own groups hold the hyper-parameters schedulers change.
        super().__init__([{**h, "params": ps} for h, ps in zip(full_hyper, inner_params)], defaults)
        self._sync_hyper(to_inner=True)
        self.state = self.inner.state if self.inner is not None else self.state
        engine.optimizer = self

    # ------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None) -> StepInfo:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self._prepare()
        info = self._step_info()
        if not self._overflow:
            live = self._live_units()
            for unit in live:
                for seg in self._unit_segments[unit.index]:
                    seg.counted = seg.slot.got_grad
                    if seg.counted:
                        self._counts[seg.key] += 1
            if self.layout == "flat" or self.engine.world == 1:
                self._point_at_shards(live)
                self._inner_step()
            else:
                self._step_by_owners()
            for unit in live:
                target = self.engine.lowp_target(unit)
                if target is not None:
                    target.copy_(unit.master)
                    self.engine.lowp_done(unit, target)
            self.engine.after_step()
        self._end_step()
        return info

    def _grad_view(self, unit, start: int, end: int) -> torch.Tensor:
        """The gradient of shard elements ``[start, end)``, fp32, scaled by the clip / loss
        scale factor."""
        g = unit.grad_shard[start:end]
        if g.dtype != torch.float32:
            g = g.float()
        if self._factor != 1.0:
            g.mul_(self._factor)
        return g

    def _point_at_shards(self, live) -> None:
        """Flat layout, or whole at world size 1: the inner tensors are views of the shards."""
        live_ids = {u.index for u in live}
        if self.layout == "flat":
            for segs in self._unit_segments.values():
                for seg in segs:
                    unit = seg.unit
                    seg.key.data = unit.master[seg.start : seg.end]
                    ok = unit.index in live_ids and seg.counted
                    seg.key.grad = self._grad_view(unit, seg.start, seg.end) if ok else None
            return
        for unit, slot, key in self._whole:
            key.data = _param_view(unit.master, slot)
            ok = unit.index in live_ids and slot.got_grad
            if ok:
                a = slot.offset - unit.shard_start
                key.grad = self._grad_view(unit, a, a + slot.numel).view(slot.shape)
            else:
                key.grad = None

    def _inner_step(self) -> None:
        if self.inner is None:
            return
        self._sync_hyper(to_inner=True)
        try:
            self.inner.step()
        finally:
            for group in self.inner.param_groups:
                for p in group["params"]:
                    p.grad = None
        self._sync_hyper(to_inner=False)

    def _step_by_owners(self) -> None:
        """Whole layout at world size > 1 (see [Note: any torch optimizer over the shards])."""
        engine = self.engine
        mine = {id(slot.param): key for _, slot, key in self._whole}
        device = engine.device
        for unit in self._units:
            if unit.grad_is_zero:
                continue
            full_m = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
            zdist.all_gather_into(full_m, unit.master.to(device, torch.float32), engine.group)
            g = unit.grad_shard.to(device, torch.float32)
            full_g = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
            zdist.all_gather_into(full_g, g, engine.group)
            del g
            for slot in unit.slots:
                key = mine.get(id(slot.param))
                if key is None:
                    continue
                span = slice(slot.offset, slot.offset + slot.numel)
                key.data = full_m[span].view(slot.shape).to(key.device, copy=True)
                if slot.got_grad:
                    key.grad = full_g[span].view(slot.shape).to(key.device, copy=True)
                    if self._factor != 1.0:
                        key.grad.mul_(self._factor)
            del full_m, full_g
        self._inner_step()
        for unit in self._units:
            if unit.grad_is_zero:
                continue
            contrib = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
            for slot in unit.slots:
                key = mine.get(id(slot.param))
                if key is not None:
                    contrib[slot.offset : slot.offset + slot.numel].copy_(key.data.reshape(-1))
            out = torch.empty(unit.shard_numel, dtype=torch.float32, device=device)
            zdist.reduce_scatter_sum(out, contrib, engine.group)
            unit.master.copy_(out)
        for _, _, key in self._whole:
            key.data = _empty_like(key)

    def _sync_hyper(self, to_inner: bool) -> None:
        if self.inner is None:
            return
        for mine, theirs in zip(self.param_groups, self.inner.param_groups):
            src, dst = (mine, theirs) if to_inner else (theirs, mine)
            for k, v in src.items():
                if k != "params":
                    dst[k] = v

    def param_of_keys(self) -> dict[int, torch.nn.Parameter]:
        """id of each tensor the inner optimizer updates -> the model parameter it is part of."""
        if self.layout == "flat":
            return {id(s.key): s.slot.param for segs in self._unit_segments.values() for s in segs}
        return {id(key): slot.param for _, slot, key in self._whole}

    # ------------------------------------------------------------------ step interface
    def step_count(self, key) -> int:
        return self._counts[key]

    def set_step_count(self, key, step: int) -> None:
        self._counts[key] = step

    def state_specs(self, unit) -> list[tuple[str, torch.dtype, int]]:
        n = unit.shard_numel
        keys = self._elementwise_keys(unit)
        return [("master", torch.float32, n)] + [(f"state.{k}", d, n) for k, d in keys.items()]

    def state_numels(self, unit) -> Mapping:
        return _StateKeys(unit.shard_numel)

    def _elementwise_keys(self, unit) -> dict[str, torch.dtype]:
        """The per-element state keys of the unit's segments (flat layout) and their dtypes."""
        out: dict[str, torch.dtype] = {}
        if self.layout != "flat" or self.inner is None:
            return out
        for seg in self._unit_segments.get(unit.index, []):
            for k, v in self.inner.state.get(seg.key, {}).items():
                if _per_element(v, seg):
                    out.setdefault(k, v.dtype)
        return out

    def read_unit(self, unit) -> dict[str, torch.Tensor]:
        out = {"master": unit.master}
        for k, dtype in self._elementwise_keys(unit).items():
            flat = torch.zeros(unit.shard_numel, dtype=dtype)
            for seg in self._unit_segments[unit.index]:
                v = self.inner.state.get(seg.key, {}).get(k)
                if v is not None:
                    flat[seg.start : seg.end].copy_(v)
            out[f"state.{k}"] = flat
        return out

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        if "master" in state:
            unit.master.copy_(state["master"].reshape(-1))
        given = {k[len("state.") :]: v for k, v in state.items() if k.startswith("state.")}
        if given:
            self._loaded[unit.index] = given  # installed by load_state

    def state_bytes(self) -> int:
        if self.inner is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )

    # ------------------------------------------------------------------- checkpoints
    def _owned_states(self):
        """(parameter name, state dict, per-element test) for each parameter whose
        non-per-element state this rank writes to checkpoints."""
        if self.inner is None:
            return
        if self.layout == "flat":
            for segs in self._unit_segments.values():
                for seg in segs:
                    if seg.start + seg.unit.shard_start != seg.slot.offset:
                        continue  # another rank holds the parameter's first element
                    st = self.inner.state.get(seg.key)
                    if st:
                        yield seg.slot.name, st, seg
            return
        for _, slot, key in self._whole:
            st = self.inner.state.get(key)
            if st:
                yield slot.name, st, None

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What this rank's checkpoint file holds besides the units' flat tensors: tensors
        named ``opt.<parameter>.<key>`` and an index (for the file's metadata)."""
        tensors: dict[str, torch.Tensor] = {}
        index: dict[str, dict] = {}
        for name, st, seg in self._owned_states():
            entry: dict[str, object] = {}
            for k, v in st.items():
                if seg is not None and _per_element(v, seg):
                    entry[k] = "flat"
                elif torch.is_tensor(v):
                    tensors[f"opt.{name}.{k}"] = v.detach().to("cpu").contiguous()
                    entry[k] = "tensor"
                elif isinstance(v, _PY_SCALARS):
                    entry[k] = ["py", type(v).__name__, v]
                elif v is None:
                    entry[k] = ["py", "None", None]
                else:
                    raise TypeError(
                        f"{self.optimizer_class.__name__} keeps {k}={type(v).__name__} for "
                        f"{name}: zerotune checkpoints hold tensors and numbers only"
                    )
            index[name] = entry
        return tensors, {
            "class": self.optimizer_class.__name__,
            "layout": self.layout,
            "params": index,
        }

    def load_state(self, index: dict[str, tuple[int, dict]], read: Callable) -> None:
        """Install the inner optimizer's state from a checkpoint: ``index`` maps a parameter
        name to (rank file, its entry of ``extra_state``'s index); ``read(rank, name)`` gives
        a whole tensor of that file. Per-element state comes from ``write_unit``."""
        loaded, self._loaded = self._loaded, {}
        if self.inner is None:
            return
        self.inner.state.clear()
        targets = []
        if self.layout == "flat":
            for segs in self._unit_segments.values():
                for seg in segs:
                    targets.append((seg.slot.name, seg.key, seg))
        else:
            targets = [(slot.name, key, None) for _, slot, key in self._whole]
        for name, key, seg in targets:
            found = index.get(name)
            if found is None:
                continue  # no state yet for this parameter: the optimizer makes it
            rank, entry = found
            st = {}
            for k, kind in entry.items():
                if kind == "flat":
                    flat = loaded.get(seg.unit.index, {}).get(k)
                    if flat is None:
                        raise ValueError(f"the checkpoint lacks state.{k} of {name}")
                    st[k] = flat[seg.start : seg.end].to(key.device, copy=True)
                elif kind == "tensor":
                    st[k] = read(rank, f"opt.{name}.{k}").to(key.device)
                else:
                    _, typ, value = kind
                    st[k] = (
                        None if typ == "None" else {"bool": bool, "int": int}.get(typ, float)(value)
                    )
            self.inner.state[key] = st

    def state_dict(self):
        """Refused: the state lives in shards across ranks; see ZeroAdamW.state_dict."""
        raise RuntimeError(
            "ZeroOptimizer.state_dict(): the optimizer state is sharded across ranks; save it "
            "with zerotune.save_checkpoint(engine, folder, optimizer=opt) and resume with "
            "zerotune.load_checkpoint(engine, folder, optimizer=opt)"
        )

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError(
            "ZeroOptimizer.load_state_dict(): resume with zerotune.load_checkpoint(engine, "
            "folder, optimizer=opt) from a folder zerotune.save_checkpoint wrote"
        )


def _per_element(v, seg) -> bool:
    """Whether state value ``v`` of a flat segment holds one value per element."""
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == seg.end - seg.start


def _param_view(master: torch.Tensor, slot) -> torch.Tensor:
    """The parameter's fp32 master, whole and shaped, in a shard that holds all of it."""
    return master[slot.offset : slot.offset + slot.numel].view(slot.shape)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _deal(slots, world: int) -> list[int]:
    """The owner rank of each (unit, slot): the largest parameters first, each to the rank
    with the fewest elements so far (ties: the lowest rank); the same on every rank."""
    load = [0] * world
    owners = [0] * len(slots)
    order = sorted(range(len(slots)), key=lambda i: (-slots[i][1].numel, i))
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += slots[i][1].numel
    return owners


def checkpoint_index(metadata: list[dict[str, str]]) -> dict[str, tuple[int, dict]]:
    """Parameter name -> (rank, entry) from the rank files' ``optimizer`` metadata."""
    out: dict[str, tuple[int, dict]] = {}
    for rank, meta in enumerate(metadata):
        raw = meta.get("optimizer")
        if raw:
            for name, entry in json.loads(raw)["params"].items():
                out.setdefault(name, (rank, entry))
    return out
