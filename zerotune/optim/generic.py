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
``layout="auto"`` picks ``flat`` for the classes above (and subclasses that keep their
``step``: one that overrides it may read a whole parameter, its norm or shape) and ``whole``
otherwise; ``whole`` is right for any optimizer, ``flat`` is cheaper where it is right.
Optimizers whose ``step`` needs a closure (LBFGS) and SparseAdam are refused.
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

import contextlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping

import torch

from .. import dist as zdist
from .generic_nvme import NvmeGenericState, bnb_manager, private_manager
from .overlap import OverlappedStep
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
        name = optimizer_class.__name__
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"{name}.step needs a closure (it evaluates the loss again within a step): "
                "ZeroOptimizer steps once per backward, without one"
            )
        if issubclass(optimizer_class, torch.optim.SparseAdam):
            raise ValueError(f"{name} needs sparse gradients; the shards' are dense (use Adam)")
        if layout == "auto":
            layout = "flat" if _elementwise(optimizer_class) else "whole"
        if layout not in ("flat", "whole"):
            raise ValueError(f"layout must be 'auto', 'flat' or 'whole', not {layout!r}")
        config = engine.config
        if config.optim_state_bits != 32:
            raise ValueError(
                f"optim_state_bits: {config.optim_state_bits} is ZeroAdamW's 8-bit Adam; {name} "
                "keeps the state it makes (use its own 8-bit variant, e.g. bitsandbytes')"
            )
        groups = self._build_segments(engine, params)
        self.optimizer_class = optimizer_class
        self.layout = layout
        self._counts: dict[object, int] = {}  # segment key -> its parameter's step count
        self._overrides_mapped = False  # see _map_bitsandbytes_overrides
        self._overrides: dict[int, dict] = {}  # id(model parameter) -> its settings
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}  # unit -> state.* being loaded
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        # Built once on stand-ins: checks the arguments and fills each group's defaults. A
        # whole parameter's stand-in has its number of dimensions (Muon takes only matrices).
        ndim = {id(s.param): len(s.shape) for u in engine.units for s in u.slots}

        def stand_in(group: dict) -> torch.Tensor:
            dims = [ndim[id(p)] for p in group["params"] if id(p) in ndim]
            return torch.zeros((1,) * dims[0] if layout == "whole" and dims else 1)

        probe = optimizer_class(
            [{**h, "params": [stand_in(g)]} for h, g in zip(hyper, groups)], **kwargs
        )
        full_hyper = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
        defaults = dict(probe.defaults)
        del probe

        # Tensors the inner optimizer updates, per group.
        inner_params: list[list[torch.Tensor]] = [[] for _ in groups]
        self.whole_params: list[tuple[object, object, torch.Tensor]] = []  # (unit, slot, key) owned
        self._units: list[object] = []  # units with parameters in the groups (whole layout)
        world = engine.world
        on_nvme = config.offload_optimizer == "nvme"  # no master in memory: placeholders
        self._key_group: dict[int, int] = {}  # id(inner key) -> group index
        if layout == "flat":
            for segs in self.unit_segments.values():
                for seg in segs:
                    master = seg.unit.master
                    seg.key = torch.zeros(0) if on_nvme else master[seg.start : seg.end].detach()
                    self._key_group[id(seg.key)] = seg.group
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
                if world == 1 and not on_nvme:
                    key = _param_view(unit.master, slot).detach()
                else:
                    device = unit.master.device if unit.master is not None else "cpu"
                    key = torch.zeros(slot.shape, dtype=torch.float32, device=device)
                self.whole_params.append((unit, slot, key))
                self._key_group[id(key)] = group_of[id(slot.param)]
                inner_params[group_of[id(slot.param)]].append(key)
            for segs in self.unit_segments.values():
                for seg in segs:
                    seg.key = object()  # its step count's key (the parameter is owned)
                    self._counts[seg.key] = 0
        self.inner: torch.optim.Optimizer | None = None
        if any(inner_params):
            self.inner = optimizer_class(
                [{**h, "params": ps} for h, ps in zip(full_hyper, inner_params)], **kwargs
            )
            if world > 1 or on_nvme:
                for _, _, key in self.whole_params:
                    key.data = _empty_like(key)  # filled at each step
        # This optimizer's own groups hold the hyper-parameters schedulers change.
        super().__init__([{**h, "params": ps} for h, ps in zip(full_hyper, inner_params)], defaults)
        self._sync_hyper(to_inner=True)
        self.state = self.inner.state if self.inner is not None else self.state
        # bitsandbytes' process-wide manager, read for overrides (_bitsandbytes_overrides)
        self._shared_mng = bnb_manager(self.inner)
        self._full_hyper, self._kwargs = full_hyper, kwargs
        # See [Note: a generic optimizer's state on NVMe] in generic_nvme.py.
        self._nvme: NvmeGenericState | None = None
        if on_nvme:
            self._nvme = NvmeGenericState(self, full_hyper, kwargs, self._bitsandbytes_overrides())
        self.store = self._nvme  # the pipeline an overlapped step streams through
        if on_nvme and self.inner is not None:
            self.inner.state.clear()  # made at construction: the probe replays it per unit
        engine.attach_optimizer(self)

    def detach(self) -> None:
        """The state goes with this optimizer; on NVMe its swap file is removed."""
        super().detach()
        if self._nvme is not None:
            self._nvme.close()

    # ------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None) -> StepInfo:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self._check_attached()
        self._map_bitsandbytes_overrides()  # the inner settings (and NVMe layout) fixed
        overlap, self._overlap = self._overlap, None
        self.settle()  # the step before's, should nothing have needed it since
        try:
            # The units updated during backward or queued (clipping) already.
            launched = self._end_overlap(overlap) if overlap is not None else {}
            return self._step_rest(launched)
        finally:
            if self._nvme is not None and self._carry is None:
                self._nvme.end_step()  # else when the carried updates are done
            self.norm_sq = None
            self.pending_grad_norm = None

    def _carry_done(self) -> None:
        self._nvme.end_step()

    def _overlap_aborted(self) -> None:
        self._nvme.end_step()

    def _step_rest(self, launched) -> StepInfo:
        """``step()`` after the overlapped updates: the units not launched during backward."""
        self._prepare()
        info = self._step_info()
        if not self._overflow:
            live = [u for u in self._live_units() if u.index not in launched]
            for unit in live:
                self.count_step(unit)
            if self._nvme is not None:
                self._step_streaming(live)
            elif self.layout == "flat" or self.engine.world == 1:
                for unit in live:
                    self._point(unit, unit.master, unit.grad_shard, 0)
                self._inner_step()
                if self.layout == "flat":
                    self._check_per_element()
            else:
                self._step_by_owners()
            if self._nvme is None:
                for unit in live:
                    self._refresh_lowp(unit, unit.master)
            self._fill_tracked_norm(info)
            self.engine.after_step()
        self._end_step()
        return info

    @property
    def can_overlap(self) -> bool:
        """Whether ``overlapped()`` can update units during backward: with the state on
        NVMe (where the step waits on the disk), per-element state or one rank (no
        collective inside an update, whose timing differs by rank)."""
        return self._nvme is not None and (self.layout == "flat" or self.engine.world == 1)

    @contextlib.contextmanager
    def overlapped(self, track_norm: bool = False, carry: bool = True, clipping: bool = False):
        """As ``ZeroAdamW.overlapped``: run the last backward of a step inside, and each unit
        is updated (its chunks streamed through NVMe) as soon as its gradient is final, while
        backward goes on; then call ``step()``. Not with fp16 or stage 1, nor inside
        ``no_sync()``; ``track_norm``: the global gradient norm is summed from the chunks the
        updates read (``pending_grad_norm``, filled by ``step()``). ``carry``: the updates
        still queued at ``step()`` go on during the next forward. ``clipping``: the updates
        wait for ``step()``, so ``clip_grad_norm_`` may come between, and are carried (see
        [Note: a clipped overlapped step] in zero_adam.py)."""
        if not self.can_overlap:
            raise RuntimeError(
                "overlapped(): ZeroOptimizer updates during backward only with its state on "
                "NVMe and a per-element (flat) layout or one rank"
            )
        self._map_bitsandbytes_overrides()  # the inner settings (and NVMe layout) fixed
        self.settle()
        self._start_overlap(track_norm, clipping)
        self._nvme.begin_step()
        with self._overlapping(OverlappedStep(self, carry=carry, clipping=clipping)):
            yield

    def _check_per_element(self) -> None:
        """Flat layout: every state tensor of a segment is per element or a scalar (else
        each rank would keep its own, different, numbers for one parameter)."""
        for segs in self.unit_segments.values():
            for seg in segs:
                for k, v in self.inner.state.get(seg.key, {}).items():
                    if torch.is_tensor(v) and v.numel() > 1 and not _per_element(v, seg):
                        raise ValueError(
                            f"{self.optimizer_class.__name__} keeps {k} of shape "
                            f"{tuple(v.shape)} for a parameter slice of {seg.end - seg.start} "
                            "elements: it is not per element; use layout='whole'"
                        )

    def _refresh_lowp(self, unit, master: torch.Tensor, c0: int = 0) -> None:
        """Give the engine the compute-dtype copy of the updated master elements ``[c0, c0 +
        len(master))`` (see [Note: the step interface]); it takes the copy with the last
        chunk. Nothing to do when the master is the parameters."""
        target = self.engine.lowp_target(unit)
        if target is not None:
            c1 = c0 + master.numel()
            target[c0:c1].copy_(master)
            if c1 == unit.shard_numel:
                self.engine.lowp_done(unit, target)

    def _grad_view(self, unit, start: int, end: int, grad=None) -> torch.Tensor:
        """The gradient of shard elements ``[start, end)`` (of ``grad``, default the unit's
        gradient shard), fp32, scaled by the clip / loss scale factor."""
        g = (unit.grad_shard if grad is None else grad)[start:end]
        if g.dtype != torch.float32:
            g = g.float()
        factor = self._update_factor()
        if factor != 1.0:
            g.mul_(factor)
        return g

    def _inner_step(self) -> None:
        if self.inner is None:
            return
        self._map_bitsandbytes_overrides()
        carried = self._frozen_groups is not None
        self._sync_hyper(to_inner=True)
        try:
            self.inner.step()
        finally:
            for group in self.inner.param_groups:
                for p in group["params"]:
                    p.grad = None
        if not carried:  # a carried update's groups are frozen copies: nothing to give back
            self._sync_hyper(to_inner=False)

    def _step_by_owners(self) -> None:
        """Whole layout at world size > 1 (see [Note: any torch optimizer over the shards])."""
        units = [u for u in self._units if not u.accumulator.is_zero]
        for unit in units:
            self._point(unit, unit.master, unit.grad_shard, 0, owners=True)
        self._inner_step()
        for unit in units:
            self._scatter_owned(unit, unit.master)
        for _, _, key in self.whole_params:
            key.data = _empty_like(key)

    def _step_streaming(self, live) -> None:
        """Optimizer state on NVMe: chunk after chunk (flat) or unit after unit (whole)
        through the store's pipeline (see [Note: a generic optimizer's state on NVMe] in
        generic_nvme.py)."""
        nv = self._nvme
        owners = self.layout == "whole" and self.engine.world > 1
        units = [u for u in self._units if not u.accumulator.is_zero] if owners else live
        if not nv.in_step:  # overlapped() began it before backward
            nv.begin_step()
        items = [(u, c0, c1) for u in units for c0, c1 in nv.chunks(u)]
        if items:
            nv.run(items, self.update_chunk)

    def update_chunk(self, unit, c0: int, c1: int, master, state: dict, grad) -> None:
        """Update shard elements ``[c0, c1)`` of ``unit`` from NVMe: the inner step over the
        chunk's tensors (``master``, ``grad`` and the ``state`` regions, in a staging
        slot), the new compute-dtype values to the engine; the pipeline writes back."""
        nv = self._nvme
        owners = self.layout == "whole" and self.engine.world > 1
        targets = self._point(unit, master, grad, c0, owners)
        nv.install(state, targets)
        self._inner_step()
        nv.collect(state, targets)
        if owners:
            self._scatter_owned(unit, master)
        for key, *_ in targets:
            key.data = _empty_like(key)
        self._refresh_lowp(unit, master, c0)

    def _point(self, unit, master, grad, c0: int, owners: bool = False) -> list[tuple]:
        """Point the inner tensors of ``unit``'s shard elements ``[c0, c0 + len(master))`` at
        ``master`` and ``grad`` (those elements', or None: no gradient); with ``owners``
        (whole layout, world size > 1) at copies of the whole parameters this rank owns,
        gathered from every rank. Returns the ``targets`` whose state NvmeGenericState
        installs when the state is on NVMe."""
        nv, c1 = self._nvme, c0 + master.numel()
        if self.norm_sq is not None and grad is not None and not owners:
            self.add_sum_of_squares(self.norm_sq, unit, c0, c1, grad)
        targets = []
        if self.layout == "flat":
            for seg in self.unit_segments[unit.index]:
                a, b = max(seg.start, c0) - c0, min(seg.end, c1) - c0
                if a >= b:
                    continue
                seg.key.data = master[a:b]
                ok = seg.counted and grad is not None
                seg.key.grad = self._grad_view(unit, a, b, grad) if ok else None
                if nv is not None:
                    probe = nv.probe_key(seg.group)
                    targets.append((seg.key, probe, ("u", unit.index), slice(a, b)))
            return targets
        if owners:
            master, grad = self._gather_unit(unit, master, grad)
        # Whether each parameter got a gradient, as count_step read it: a carried update
        # runs after zero_grad. An owner's parameter may lie in other ranks' shards alone,
        # but owners never carry: their update runs in step().
        counted = {id(s.slot) for s in self.unit_segments.get(unit.index, ()) if s.counted}
        for u, slot, key in self.whole_params:
            if u is not unit:
                continue
            a, b = slot.offset, slot.offset + slot.numel
            if owners:
                key.data = master[a:b].view(slot.shape).to(key.device, copy=True)
            else:
                key.data = master[a:b].view(slot.shape)
            got = slot.got_grad if owners else id(slot) in counted
            if got and grad is not None:
                if owners:
                    key.grad = grad[a:b].view(slot.shape).to(key.device, copy=True)
                    factor = self._update_factor()
                    if factor != 1.0:
                        key.grad.mul_(factor)
                else:
                    key.grad = self._grad_view(unit, a, b, grad).view(slot.shape)
            if nv is not None:
                targets.append((key, nv.whole_probe[slot.name], ("p", slot.name), None))
        return targets

    def _gather_unit(self, unit, master, grad) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit's whole fp32 master and gradient, all-gathered from every rank's shard."""
        engine = self.engine
        device = engine.device
        full_m = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
        zdist.all_gather_into(full_m, master.to(device, torch.float32), engine.group)
        full_g = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
        zdist.all_gather_into(full_g, grad.to(device, torch.float32), engine.group)
        return full_m, full_g

    def _scatter_owned(self, unit, master: torch.Tensor) -> None:
        """This rank's part of the owners' new values into ``master`` (an exact sum: every
        rank but a parameter's owner gives zeros)."""
        device = self.engine.device
        mine = {id(slot.param): key for u, slot, key in self.whole_params if u is unit}
        contrib = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
        for slot in unit.slots:
            key = mine.get(id(slot.param))
            if key is not None:
                contrib[slot.offset : slot.offset + slot.numel].copy_(key.data.reshape(-1))
        out = torch.empty(unit.shard_numel, dtype=torch.float32, device=device)
        zdist.reduce_scatter_sum(out, contrib, self.engine.group)
        # Only the optimized parameters: frozen ones (and the padding) keep their values.
        for seg in self.unit_segments.get(unit.index, []):
            master[seg.start : seg.end].copy_(out[seg.start : seg.end])

    def group_of_key(self, key) -> int:
        return self._key_group[id(key)]

    def override_config(self, param, config: dict) -> None:
        """Per-parameter settings for a bitsandbytes inner optimizer (as its manager's
        ``override_config``), e.g. ``{"optim_bits": 32}`` for an embedding; before the
        first step (and, with the state on NVMe, before a checkpoint is loaded)."""
        if self._overrides_mapped:
            raise RuntimeError(
                "override_config after the first step (or overlapped backward): the inner "
                "optimizer's settings are fixed by then"
            )
        self._overrides[id(param)] = dict(config)
        self._fit_nvme_layout(self._bitsandbytes_overrides())

    def _bitsandbytes_overrides(self) -> dict[int, dict]:
        """id(model parameter) -> the settings registered for it: in bitsandbytes'
        process-wide manager (its ``register_module_override`` and ``override_config``) and
        with this optimizer's ``override_config``. Empty for other optimizers."""
        shared = self._shared_mng
        if shared is None:
            return {}
        by_param = dict(shared.pid2config)
        for module, attr, config in shared.module_weight_config_triple:
            p = module._parameters.get(attr)  # not getattr: a sharded weight is released
            if p is not None:
                by_param[id(p)] = config
        by_param.update(self._overrides)
        return by_param

    def _map_bitsandbytes_overrides(self) -> None:
        """bitsandbytes' optimizers look per-parameter settings (``optim_bits`` for an
        embedding, ...) up in a process-wide manager by (group, index) of the optimizer that
        registered them: give the inner optimizer a manager of its own, holding the
        overrides registered for the model's parameters at the indices of the tensors
        standing for them. With the state on NVMe, its layout must have been made for the
        same settings (``_fit_nvme_layout``)."""
        if self._overrides_mapped:
            return
        self._overrides_mapped = True
        if self._shared_mng is None:  # no inner optimizer, or not a bitsandbytes one
            return
        by_param = self._bitsandbytes_overrides()
        self._fit_nvme_layout(by_param)
        model = self.param_of_keys()
        index2config = {}
        for gi, group in enumerate(self.inner.param_groups):
            for pi, key in enumerate(group["params"]):
                config = by_param.get(id(model[id(key)]))
                if config:
                    index2config[gi, pi] = config
        private_manager(self.inner, index2config)

    def _fit_nvme_layout(self, overrides: dict[int, dict]) -> None:
        """Make the NVMe state's layout (probed per parameter settings) the one
        ``overrides`` call for: laid out again while no state exists; after that, a change
        is refused (the state on disk has the old layout)."""
        nv = self._nvme
        if nv is None or nv.made_for(overrides):
            return
        if nv.present:
            raise RuntimeError(
                f"{self.optimizer_class.__name__}: per-parameter settings (bitsandbytes' "
                "overrides, e.g. optim_bits) changed after its state on NVMe was made; set "
                "them before the first step and before loading a checkpoint"
            )
        nv.close()
        self._nvme = self.store = NvmeGenericState(self, self._full_hyper, self._kwargs, overrides)

    def _sync_hyper(self, to_inner: bool) -> None:
        if self.inner is None:
            return
        groups = self._update_groups() if to_inner else self.param_groups
        for mine, theirs in zip(groups, self.inner.param_groups):
            src, dst = (mine, theirs) if to_inner else (theirs, mine)
            for k, v in src.items():
                if k != "params":
                    dst[k] = v

    def param_of_keys(self) -> dict[int, torch.nn.Parameter]:
        """id of each tensor the inner optimizer updates -> the model parameter it is part of."""
        if self.layout == "flat":
            return {id(s.key): s.slot.param for segs in self.unit_segments.values() for s in segs}
        return {id(key): slot.param for _, slot, key in self.whole_params}

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
        if self._nvme is not None:
            return self._nvme.flat_keys(unit, self.unit_segments.get(unit.index, []))
        for seg in self.unit_segments.get(unit.index, []):
            for k, v in self.inner.state.get(seg.key, {}).items():
                if _per_element(v, seg):
                    out.setdefault(k, v.dtype)
        return out

    def read_unit(self, unit, master_only: bool = False) -> dict[str, torch.Tensor]:
        if master_only:
            nvme = self._nvme
            return {"master": nvme.read_master(unit) if nvme is not None else unit.master}
        if self._nvme is not None:
            out = {"master": self._nvme.read_master(unit)}
            for k in self._elementwise_keys(unit):
                out[f"state.{k}"] = self._nvme.read_region(("u", unit.index, k))
            return out
        out = {"master": unit.master}
        for k, dtype in self._elementwise_keys(unit).items():
            flat = torch.zeros(unit.shard_numel, dtype=dtype)
            for seg in self.unit_segments[unit.index]:
                v = self.inner.state.get(seg.key, {}).get(k)
                if v is not None:
                    flat[seg.start : seg.end].copy_(v)
            out[f"state.{k}"] = flat
        return out

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        if "master" in state and self._nvme is not None:
            self._nvme.write_master(unit, state["master"])
        elif "master" in state:
            unit.master.copy_(state["master"].reshape(-1))
        given = {k[len("state.") :]: v for k, v in state.items() if k.startswith("state.")}
        if given:
            self._loaded[unit.index] = given  # installed by load_state

    def state_bytes(self) -> int:
        if self.inner is None or self._nvme is not None:
            return 0  # on NVMe: the swap space's bytes
        return sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )

    # ------------------------------------------------------------------- checkpoints
    def _owned_states(self):
        """(parameter name, state, per-element keys) for each parameter whose state this
        rank writes to checkpoints: ``state`` holds what is not per element (per-element
        state goes with the unit's flat tensors, ``read_unit``)."""
        if self.inner is None:
            return
        nv = self._nvme
        if self.layout == "flat":
            for segs in self.unit_segments.values():
                for seg in segs:
                    if seg.start + seg.unit.shard_start != seg.slot.offset:
                        continue  # another rank holds the parameter's first element
                    if nv is not None:
                        if id(seg.key) not in nv.present:
                            continue
                        flat = list(nv.flat_keys(seg.unit, [seg]))
                        yield seg.slot.name, nv.scalars.get(id(seg.key), {}), flat
                        continue
                    st = self.inner.state.get(seg.key)
                    if st:
                        flat = [k for k, v in st.items() if _per_element(v, seg)]
                        rest = {k: v for k, v in st.items() if k not in flat}
                        yield seg.slot.name, rest, flat
            return
        for _, slot, key in self.whole_params:
            if nv is not None:
                st = nv.state_of(key, ("p", slot.name))
            else:
                st = self.inner.state.get(key)
            if st:
                yield slot.name, st, []

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What this rank's checkpoint file holds besides the units' flat tensors: tensors
        named ``opt.<parameter>.<key>`` and an index (for the file's metadata)."""
        self.settle()  # the scalars of updates carried into this forward
        tensors: dict[str, torch.Tensor] = {}
        index: dict[str, dict] = {}
        for name, st, flat in self._owned_states():
            entry: dict[str, object] = dict.fromkeys(flat, "flat")
            for k, v in st.items():
                if torch.is_tensor(v):
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
        self.settle(overwrite=True)
        loaded, self._loaded = self._loaded, {}
        if self.inner is None:
            return
        nv = self._nvme
        self.inner.state.clear()
        if nv is not None:
            for unit_index, flats in loaded.items():
                for k, flat in flats.items():
                    nv.write_region(("u", unit_index, k), flat)
        targets = []
        if self.layout == "flat":
            for segs in self.unit_segments.values():
                for seg in segs:
                    targets.append((seg.slot.name, seg.key, seg))
        else:
            targets = [(slot.name, key, None) for _, slot, key in self.whole_params]
        for name, key, seg in targets:
            found = index.get(name)
            if found is None:  # no state yet for this parameter: the optimizer makes it
                if nv is not None:
                    nv.forget(key)
                continue
            rank, entry = found
            st = {}
            for k, kind in entry.items():
                if kind == "flat":
                    flat = loaded.get(seg.unit.index, {}).get(k)
                    if flat is None:
                        raise ValueError(f"the checkpoint lacks state.{k} of {name}")
                    if nv is None:
                        st[k] = flat[seg.start : seg.end].to(key.device, copy=True)
                elif kind == "tensor":
                    st[k] = read(rank, f"opt.{name}.{k}").to(key.device)
                else:
                    _, typ, value = kind
                    st[k] = (
                        None if typ == "None" else {"bool": bool, "int": int}.get(typ, float)(value)
                    )
            if nv is None:
                self.inner.state[key] = st
            elif seg is not None:
                nv.put_state(key, ("u", seg.unit.index), slice(seg.start, seg.end), st)
            else:
                nv.put_state(key, ("p", name), None, st)

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


def _elementwise(cls: type) -> bool:
    """Whether ``cls`` updates each element from that element alone: one of ELEMENTWISE, or
    a subclass that steps with its base's ``step`` (one overriding it may read a whole
    parameter, e.g. a trust ratio of norms, or its shape)."""
    mine = inspect.unwrap(cls.step)  # torch wraps ``step`` (hooks, no_grad) per class
    return any(issubclass(cls, base) and mine is inspect.unwrap(base.step) for base in ELEMENTWISE)


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
