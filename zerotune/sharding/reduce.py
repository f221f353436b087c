"""The engine's gradient reduction over a backward pass: which units are reduced when, and
where their final gradient shards go.

Each unit's own gradients (reduce, accumulate, copy to the host, hold) are its
GradAccumulator (see [Note: gradient accumulation] in grads.py). The GradReducer decides,
for the whole model: whether this backward reduces at all (``no_sync()``), which units wait
for the end of backward (``find_unused_parameters``, see [Note: find unused parameters]),
which units are left at the end and agreed on by the ranks (``end_backward``, see [Note:
parameters without a gradient] in optim/zero_adam.py), and which final shards an overlapped
optimizer step takes as backward finishes them (see [Note: overlapped step] in
optim/zero_adam.py). The engine owns it (``engine.reducer``) and keeps the pins: its
``post_backward`` reduces a unit here, releases it, then hands it to the overlapped step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from .. import dist as zdist
from ..config import ZeroConfig
from ..memory.pool import BufferPool
from .buffers import grads_kept_for_update
from .hooks import params_reached

if TYPE_CHECKING:
    from ..optim.overlap import OverlappedStep
    from .unit import Unit

__all__ = ["GradReducer"]


def _fingerprint(h: int, unit: Unit) -> int:
    """``h`` extended by ``unit``: a fingerprint of a sequence of units, in order, that the
    ranks compare (``GradReducer._agree``)."""
    return (h * 1_000_003 + unit.index + 1) % (1 << 61)


class GradReducer:
    """Reduces the gradients of ``units`` over the ranks of ``group`` during and at the end
    of each backward pass."""

    def __init__(
        self,
        units: list[Unit],
        config: ZeroConfig,
        world: int,
        group,
        device: torch.device,
        host_pool: BufferPool,
    ) -> None:
        self.units: list[Unit] = units
        self.config: ZeroConfig = config
        self.world: int = world
        self.group = group
        self.device: torch.device = device
        self.host_pool: BufferPool = host_pool  # counts the gradient shards held in memory
        self._sync: bool = True  # False inside no_sync()
        self._overlap: OverlappedStep | None = None  # the optimizer's, during its backward
        # The unit whose gradients are on their way to the host (finished after the next).
        self._copying: Unit | None = None
        # A fingerprint of the units reduced during this backward, in order (world size >
        # 1): the ranks compare it at the end (see _pending_units).
        self._reduced_during_backward: int = 0
        # find_unused_parameters (see agree_on_unused): units reduced at the end of this
        # backward, and the units of the forward being walked that ran inside a reentrant
        # activation checkpoint (hidden from the walk).
        self.finds_unused: bool = config.find_unused_parameters and config.stage >= 2 and world > 1
        self._deferred: set[int] = set()
        self._hidden_units: set[int] = set()
        # The order of the units this forward all-gathered, fingerprinted (stage 3): the
        # ranks compare it with the marks, as a rank that ran other units than another
        # pairs its gathers with different units (parameters mixed, when sizes agree).
        self._gathered_in_forward: int = 0
        if self.finds_unused:
            for unit in units:
                unit.report_gathers_to(self._note_gather)
        dm = getattr(torch, device.type, None)
        if device.type != "cpu" and hasattr(dm, "Stream"):
            copy_stream = dm.Stream(device=device)
            for unit in units:
                unit.accumulator.use_copy_stream(copy_stream)

    # ------------------------------------------------------------------------- no_sync
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full gradients locally, without communication;
        the first backward outside reduces them together with its own."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def syncing(self) -> bool:
        """Whether this backward reduces gradients (False inside ``no_sync()``)."""
        return self._sync

    # -------------------------------------------------------------- the overlapped step
    @property
    def overlapping(self) -> bool:
        """Whether an overlapped optimizer step takes units as backward finishes them."""
        return self._overlap is not None

    def begin_overlapped_step(self, step: OverlappedStep) -> None:
        """Until ``end_overlapped_step``, backward hands each unit whose gradient shard is
        final to ``step.launch(unit)``, and lets it ``pump()`` between layers (see [Note:
        overlapped step] in optim/zero_adam.py)."""
        if self._overlap is not None:
            raise RuntimeError("overlapped(): call step() before the next overlapped backward")
        self._overlap = step

    def end_overlapped_step(self) -> None:
        self._overlap = None

    def pump_overlapped_step(self) -> None:
        """A chance, between two layers of backward, to move the overlapped step along."""
        if self._overlap is not None:
            self._overlap.pump()

    def check_overlapped_backward(self) -> None:
        """A backward pass starts: an overlapped step refuses a second one before its step."""
        if self._overlap is not None:
            self._overlap.check_second_backward()

    def grads_kept_for_update(self, units: list[Unit]) -> set[int]:
        """The indices of ``units`` (in update order) whose final gradient shards stay in
        memory for a clipped overlapped step (``buffers.grads_kept_for_update``)."""
        shards = [
            (u.index, u.shard_numel * u.grad_dtype.itemsize if u.grads.on_disk else 0)
            for u in units
        ]
        return grads_kept_for_update(shards, self.config.grad_host_bytes)

    # ---------------------------------------------------------------------- the forward
    def pre_forward(self, unit: Unit) -> None:
        """``unit``'s forward starts: the first unit's begins a new walk for
        ``find_unused_parameters``; a unit running without gradients is hidden from it."""
        if unit.index == 0:
            self._hidden_units.clear()
            self._gathered_in_forward = 0
        if self.finds_unused and not torch.is_grad_enabled():
            self._hidden_units.add(unit.index)  # inside a reentrant checkpoint, or no_grad

    def hide_from_graph(self, unit: Unit) -> None:
        """``unit``'s body ran where the autograd graph does not show it (a reentrant
        checkpoint): finding unused parameters cannot tell what it reached."""
        self._hidden_units.add(unit.index)

    def agree_on_unused(self, outputs: list[torch.Tensor]) -> None:
        """End of a synchronized training forward with ``find_unused_parameters``: the units
        that some rank will not give all their gradients are reduced at the end of the
        backward through these outputs.

        [Note: find unused parameters]
        A unit is reduced as soon as all its parameters have their gradients; if that
        happens on one rank and never on another (a branch the data chooses), the first
        rank's reduce-scatter pairs with whatever collective the other issues next. So each
        rank walks the autograd graph from the model's outputs (``params_reached``) and
        marks each unit with a trainable parameter the graph does not reach; one all-reduce
        (MAX) of the marks tells every rank the same set. The set belongs to this forward's
        graph: a hook on its outputs adds it to the backward pass that reaches them (before
        any unit of that graph is done), so a forward without a backward, or two graphs
        taken backward one after the other, defer what their own forwards found. Deferred
        units are reduced at the end of that backward with the other pending ones, in unit
        order on every rank (``_pending_units``; a rank that got none of their gradients
        adds zeros); their gradients wait in full meanwhile (``GradAccumulator.unreduced``, as under
        ``no_sync()``). Forwards under ``no_sync()`` reduce nothing and are not walked.

        A reentrant activation checkpoint hides the parameters it runs until backward
        recomputes it: a unit that ran inside one (with gradients off; or whose outputs
        come straight from one, as Hugging Face layers checkpoint their own body) and of
        which the walk reached nothing counts as complete. Limits: every rank must run
        the same number of synchronized training forwards (each is a collective); the walk
        sees what the outputs depend on, so a parameter they depend on that still gets no
        gradient (the loss ignores that output on some rank), or a unit partly used inside
        a reentrant checkpoint, is not found; and at stage 3 the gathers are collectives
        too, so every rank must run the same units (as DeepSpeed and FSDP ask). Where they
        do not and their gathers still pair up (units of one size: experts routed by the
        data), the same all-reduce compares a fingerprint of the units each rank gathered
        in this forward, in order, and every rank raises instead of training on the mixed
        parameters."""
        reached, hidden = params_reached(outputs)
        marks = []
        for unit in self.units:
            trainable = [s for s in unit.slots if s.trainable] if unit.trainable else []
            got = sum(1 for s in trainable if id(s.param) in reached)
            complete = got == len(trainable) or (
                hidden and got == 0 and unit.index in self._hidden_units
            )
            marks.append(0 if complete else 1)
        same, merged = self._agree(self._gathered_in_forward, marks)
        if not same:
            raise RuntimeError(
                "zerotune: the ranks gathered different units in this forward (a unit one "
                "rank ran and another did not): at stage 3 every rank must run the same "
                "units, or their gathers pair up wrongly; this forward's outputs are wrong"
            )
        deferred = {u.index for u, m in zip(self.units, merged) if m}
        if not deferred:
            return
        pending = self._deferred  # a hook must not keep the reducer (its units) alive

        def defer(grad):
            pending.update(deferred)

        for t in outputs:
            if t.requires_grad:
                t.register_hook(defer)

    def _agree(self, fingerprint: int, flags: list[int]) -> tuple[bool, list[int]]:
        """One all-reduce (MAX) over the ranks: whether they all hold the same
        ``fingerprint``, and each of ``flags`` OR'ed."""
        t = torch.tensor([fingerprint, -fingerprint, *flags], dtype=torch.int64, device=self.device)
        merged = zdist.all_reduce_max(t, self.group).tolist()
        return merged[0] == -merged[1], merged[2:]

    def _note_gather(self, unit: Unit) -> None:
        self._gathered_in_forward = _fingerprint(self._gathered_in_forward, unit)

    # --------------------------------------------------------------------- the backward
    def reduce(self, unit: Unit) -> bool:
        """Every trainable parameter of ``unit`` has its gradient (``Unit.count_grad_ready``):
        reduce them into its gradient shard. False when the unit waits for the end of
        backward instead (its gradients kept in full meanwhile)."""
        if self._sync and unit.index in self._deferred:
            # Not complete on every rank: kept here and reduced at the end of backward,
            # with the ranks that never complete it (see [Note: find unused parameters]).
            unit.accumulator.reduce(sync=False)
            return False
        unit.accumulator.reduce(sync=self._sync, hold=self._hold_grads(unit))
        if self._sync and self.world > 1:
            self._reduced_during_backward = _fingerprint(self._reduced_during_backward, unit)
        if unit.accumulator.copying_to_host:
            # Its gradients are on their way to the host: finish the previous unit's now
            # (its copies ran while this unit's backward did), this one's after the next.
            if self._copying is not None and self._copying is not unit:
                self._copying.accumulator.finish_host_copy()
            self._copying = unit
        return True

    def launch(self, unit: Unit) -> None:
        """``unit`` is reduced and released: an overlapped step updates it now (its gradient
        shard is final)."""
        if self._overlap is not None and self._sync:
            unit.accumulator.finish_host_copy()
            self._overlap.launch(unit)

    def _hold_grads(self, unit: Unit) -> bool:
        """Whether ``unit``'s final gradient shard skips its NVMe file: in an overlapped
        step its update follows soon, and writing and reading it back is only a cost. One
        shard is held at a time (more would add their buffers to the backward peak); a
        unit of one parameter is held anyway: its gradient is the parameter's own tensor,
        which a write would keep alive until written."""
        if self._overlap is None or not self._sync or not unit.grads.on_disk:
            return False
        if self._overlap.clipping:
            return True  # until the step has read its share of the norm (launch)
        # One shard at a time (a unit's update follows its backward closely), and an
        # embedding's own .grad (no extra buffer).
        held = self.host_pool.held_grads.now
        return held == 0 or (self.world == 1 and unit.one_parameter)

    def end_backward(self) -> None:
        """End of a backward pass: reduce what is pending (``end_pass`` follows, also after
        an error)."""
        if self.config.stage >= 2:
            deferred = self._deferred if self._sync else set()

            def pending(u: Unit) -> bool:
                return u.accumulator.has_pending() or (
                    u.index in deferred and u.accumulator.unreduced is not None
                )

            for unit in self._pending_units(pending, self._sync):
                unit.accumulator.reduce(sync=self._sync)
        self._finish_host_copies()

    def end_pass(self) -> None:
        """The counters of a backward pass back to their start."""
        self._reduced_during_backward = 0
        self._deferred.clear()

    def _pending_units(self, pending: Callable[[Unit], bool], sync: bool) -> list[Unit]:
        """The units ``pending`` picks (gradients not reduced yet), in order. At world size
        > 1 reducing them is a collective: every rank then reduces the units any rank
        picked (a unit without gradients on this rank adds zeros), so that the ranks'
        collectives pair up, and each parameter counts as having got a gradient when it
        got one on any rank (see [Note: parameters without a gradient])."""
        for unit in self.units:
            if not unit.trainable and unit.accumulator.has_pending():
                unit.accumulator.reduce()  # frozen when the engine was built: dropped, here only
        picked = [1 if u.trainable and pending(u) else 0 for u in self.units]
        if self.world == 1 or not sync:
            return [u for u, p in zip(self.units, picked) if p]
        slots = [s for u in self.units for s in u.slots]
        got = [int(s.got_grad or (s.trainable and s.param.grad is not None)) for s in slots]
        h, self._reduced_during_backward = self._reduced_during_backward, 0
        same, merged = self._agree(h, picked + got)
        if not same:
            # Their reduce-scatters paired different units: the gradients are mixed.
            raise RuntimeError(
                "zerotune: the ranks reduced the gradients of different units during this "
                "backward: a unit got gradients for all its parameters on some ranks but not "
                "on others (a branch the data chooses). At world size > 1, in each backward, "
                "a unit must get gradients for all its parameters on every rank or miss at "
                "least one on every rank, unless the config sets find_unused_parameters: "
                "true (ZeroTrainer: --ddp_find_unused_parameters true); the gradients of "
                "this step are wrong, so resume from the last checkpoint"
            )
        flags = iter(merged[len(picked) :])
        for u in self.units:
            u.accumulator.agree_got_grads([bool(next(flags)) for _ in u.slots])
        return [u for u, p in zip(self.units, merged) if p]

    def _finish_host_copies(self) -> None:
        self._copying = None
        for unit in self.units:
            unit.accumulator.finish_host_copy()

    def finalize(self) -> None:
        """Make every gradient shard final before clipping or the optimizer step."""
        self._finish_host_copies()
        for unit in self.units:
            unit.wait_writes()
        pending = self._pending_units(
            lambda u: u.accumulator.has_pending() or u.accumulator.unreduced is not None, sync=True
        )
        for unit in pending:
            unit.accumulator.reduce(sync=True)
        # Stage 1 reduces here, after backward: those copies to the host finish now too.
        self._finish_host_copies()
