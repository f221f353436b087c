"""Gradients: a unit's reduced from its parameters into its gradient shard, accumulated there
over micro-batches, copied to the host, held in memory for an overlapped update
(``GradAccumulator``); the whole model's over a backward pass (``GradReducer``).

[Note: gradient accumulation]
Backward leaves each parameter's gradient in ``param.grad``; once a unit's are complete the
engine calls ``reduce``. At world size > 1 they are flattened into one fp32 buffer (``take``)
and reduce-scattered (averaged) into this rank's slice; at world size 1 they are added into
the shard directly, parameter by parameter, or stay where they are as the shard ([Note:
gradients left in the parameters] in memory/tiers.py). Either way the result is added into
the gradient shard wherever its tier keeps it: the first gradient since ``zero`` overwrites
the stale contents (``is_zero``), later ones add. Under ``no_sync()`` the whole
flat gradient is summed locally (``unreduced``) and reduced with the next synchronized
backward. On an accelerator at world size 1 with the shard on the host, the copies run on a
side stream (``finish_host_copy`` adds them in later). An overlapped update takes the final
shard from memory (``held``) instead of a round trip through the gradient file.

Each unit's own gradients (reduce, accumulate, copy to the host, hold) are its
GradAccumulator (above). The GradReducer decides,
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

if TYPE_CHECKING:
    from ..optim.overlap import OverlappedStep
    from .unit import Unit

__all__ = ["GradAccumulator", "GradReducer", "is_reentrant_checkpoint", "params_reached"]

# The forwards with gradients whose outputs' nodes are kept for the next backward (see
# [Note: outputs the loss ignores]): more without a backward drop the older ones' nodes.
_FORWARDS_NOTED = 4


class GradAccumulator:
    """The gradient side of ``unit`` (see [Note: gradient accumulation])."""

    def __init__(self, unit: Unit) -> None:
        self.unit: Unit = unit
        self.is_zero: bool = True  # the gradient shard holds no gradient yet (contents stale)
        self.unreduced: torch.Tensor | None = None  # full-size grads kept under no_sync()
        # The final gradient shard kept in memory for an overlapped update instead of a
        # round trip through the gradient file (see [Note: overlapped step] in zero_adam.py).
        self.held: torch.Tensor | None = None
        self._held_pooled: bool = True  # it came from host_pool (else: a parameter's .grad)
        # Zeroed while an update still reads the gradients left in the parameters (see
        # [Note: gradients left in the parameters]): drop_held drops them once it is done.
        self._params_stale: bool = False
        # Gradients on their way to the host: (buffer, event, straight into the shard)
        # until finish_host_copy.
        self._host_copy = None
        self.copy_stream = None  # the side stream of those copies (use_copy_stream)

    def use_copy_stream(self, stream) -> None:
        """Copy gradients to the host on ``stream`` (a side stream of the device)."""
        self.copy_stream = stream

    def agree_got_grads(self, flags: list[bool]) -> None:
        """Whether each of the unit's parameters got a gradient this step, as the ranks
        agreed (a parameter counts for every rank's step once one rank got its gradient)."""
        for s, flag in zip(self.unit.slots, flags, strict=True):
            s.got_grad = flag

    def has_pending(self) -> bool:
        """Whether a parameter holds a gradient not reduced yet (gradients left in the
        parameters as their shard count once reduced: ``got_grad``)."""
        if self._params_stale:
            return False  # last step's, read by an update still pending
        kept = self.unit.grads.keeps_params()
        return any(
            s.param.grad is not None and not (kept and s.trainable and s.got_grad)
            for s in self.unit.slots
        )

    def reduce(self, sync: bool = True, hold: bool = False) -> None:
        """Move the parameters' gradients into this rank's gradient shard (averaged over ranks).

        With ``sync=False`` (inside ``no_sync()``) the full gradient is accumulated locally and
        reduced together with the next synchronized backward. With ``hold`` a gradient shard
        bound for NVMe stays in memory (``held``) for an update that follows at once.
        """
        unit = self.unit
        if not unit.trainable:
            for s in unit.slots:
                s.param.grad = None
            return
        for s in unit.slots:
            if s.trainable and s.param.grad is not None:
                s.got_grad = True
        if unit.world == 1 and self.unreduced is None and (sync or unit.grads.keeps_params()):
            self._add_into_shard_directly(hold)
            return
        flat = self.take(unit.pool)
        if not sync:
            if self.unreduced is None:
                self.unreduced = flat.clone()
            else:
                self.unreduced.add_(flat)
            unit.pool.release(flat)
            return
        if self.unreduced is not None:
            flat.add_(self.unreduced)
            self.unreduced = None
        out = unit.pool.acquire(unit.shard_numel, torch.float32)
        zdist.reduce_scatter_avg(out, flat, group=unit.group)
        unit.pool.release(flat)
        unit.grads.add(unit, out, unit.pool, hold)

    def take(self, pool: BufferPool) -> torch.Tensor:
        """Every parameter's gradient in its region of an fp32 buffer from ``pool`` (zeros
        where there is none and in the padding); the parameters' gradients are dropped."""
        unit = self.unit
        flat = pool.acquire(unit.padded_numel, torch.float32)
        for s in unit.slots:
            g = s.param.grad
            region = flat[s.offset : s.offset + s.numel]
            region.copy_(g.reshape(-1)) if g is not None and s.trainable else region.zero_()
            s.param.grad = None
        flat[unit.numel :].zero_()
        return flat

    def whole(self) -> torch.Tensor | None:
        """The gradient of a ``one_parameter`` unit, taken as the flat gradient itself when
        it is a contiguous fp32 host tensor: no copy, and no second buffer of the largest
        size at the end of backward."""
        if not self.unit.one_parameter:
            return None
        s = self.unit.slots[0]
        g = s.param.grad
        if (
            not s.trainable
            or g is None
            or g.dtype != torch.float32
            or g.device.type != "cpu"
            or not g.is_contiguous()
        ):
            return None
        s.param.grad = None
        return g.view(-1)

    def add_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Accumulate ``src`` into the shard ``dst``: the first gradient overwrites it."""
        if self.is_zero:
            dst.copy_(src)
            self.is_zero = False
        else:
            dst.add_(src)

    def mark_added(self) -> None:
        """The shard now holds a gradient (added by its tier)."""
        self.is_zero = False

    def _add_into_shard_directly(self, hold: bool = False) -> None:
        # World 1: the shard is the whole flat buffer; no collective and no staging copy on
        # the device. Gradients bound for the host (NVMe, or an optimizer on the host) are
        # copied parameter by parameter into a (pinned) host buffer.
        unit = self.unit
        if unit.device.type != "cpu" and (unit.grads.on_disk or unit.grads.device != unit.device):
            self._gradients_to_host()
            return
        unit.grads.add_params(unit, hold)

    def _gradients_to_host(self) -> None:
        """World size 1 on an accelerator, gradients bound for the host: every parameter's
        gradient is queued for a copy into one pinned buffer in the compute dtype (half
        the bytes of fp32 with bf16), on the side stream ``copy_stream`` so that backward
        goes on meanwhile; ``finish_host_copy`` (the engine calls it once the next unit's
        copies are queued, and at the end of backward) waits for them, and the host
        converts and adds them into the fp32 gradient shard (or its NVMe extent). An fp32
        shard in memory needs no host work: the device converts the gradients into one
        fp32 buffer, copied straight into the (pinned) shard; a later micro-batch brings
        the shard over, adds on the device and copies the sum back (ZeRO-Offload's
        accumulation: PCIe bytes instead of host arithmetic)."""
        self.finish_host_copy()
        unit = self.unit
        dm = getattr(torch, unit.device.type)
        current = dm.current_stream(unit.device)
        stream = self.copy_stream or current
        if not unit.grads.on_disk and unit.grad_dtype == torch.float32:
            flat = self.take(unit.pool)
            shard = unit.grads.buffer(unit)
            held = [flat]  # back to the pool once the copies are done
            if not self.is_zero:
                held.append(unit.pool.acquire(unit.padded_numel, torch.float32))
            stream.wait_stream(current)
            with dm.stream(stream):
                if self.is_zero:
                    shard.copy_(flat, non_blocking=True)
                else:
                    total = held[1]
                    total.copy_(shard, non_blocking=True)
                    total.add_(flat)
                    shard.copy_(total, non_blocking=True)
                event = stream.record_event()
            self._host_copy = (held, event, True)
            return
        staged = unit.host_pool.acquire(unit.padded_numel, unit.dtype)
        stream.wait_stream(current)  # the gradients are computed
        with dm.stream(stream):
            for s in unit.slots:
                g = s.param.grad
                region = staged[s.offset : s.offset + s.numel]
                if g is not None and s.trainable:
                    region.copy_(g.reshape(-1), non_blocking=True)
                    # Its memory is not handed out again before the copy is done.
                    g.record_stream(stream)
                else:
                    region.zero_()
                s.param.grad = None
            event = stream.record_event()
        staged[unit.numel :].zero_()
        self._host_copy = (staged, event, False)

    @property
    def copying_to_host(self) -> bool:
        """Whether gradients are on their way to the host (``_gradients_to_host``)."""
        return self._host_copy is not None

    def finish_host_copy(self) -> None:
        """Wait for the gradients on their way to the host and add them in."""
        if self._host_copy is None:
            return
        unit = self.unit
        staged, event, direct = self._host_copy
        self._host_copy = None
        event.synchronize()
        if direct:
            for buf in staged:  # the device buffers the shard was copied from and to
                unit.pool.release(buf)
            self.is_zero = False
            return
        if staged.dtype == torch.float32 or not unit.grads.on_disk:
            unit.grads.add(unit, staged, unit.host_pool)
            return
        flat = unit.host_pool.acquire(unit.padded_numel, torch.float32)
        flat.copy_(staged)
        unit.host_pool.release(staged)
        unit.grads.add(unit, flat, unit.host_pool)

    def hold(self, values: torch.Tensor, pooled: bool) -> None:
        """Keep the final gradient shard in memory for an overlapped update (``pooled``: a
        host_pool buffer, else a parameter's own gradient)."""
        self.held = values
        self._held_pooled = pooled
        self.unit.host_pool.held_grads.add(values.numel() * values.element_size())

    def spill_held(self) -> None:
        """Write the held gradient shard to its file after all (the update that was to read
        it from memory comes later); the buffer goes back once written."""
        held, self.held = self.held, None
        if held is None:
            return
        unit = self.unit
        unit.host_pool.held_grads.sub(held.numel() * held.element_size())
        if not self._held_pooled:
            # A parameter's own gradient: the file takes only aligned buffers.
            staged = unit.host_pool.acquire(held.numel(), held.dtype)
            staged.copy_(held)
            held = staged
        unit.grads.write(unit, held, unit.host_pool.release)

    def drop_held(self) -> None:
        """Give back the gradient shard held for an overlapped update (once it is done), and
        the parameters' gradients zeroed while it was pending."""
        held, self.held = self.held, None
        if held is not None:
            self.unit.host_pool.held_grads.sub(held.numel() * held.element_size())
            if self._held_pooled:
                self.unit.host_pool.release(held)
        if self._params_stale:
            self._params_stale = False
            for s in self.unit.slots:
                s.param.grad = None

    def zero(self) -> None:
        """Forget the accumulated gradient (``zero_grad``): the next one overwrites it."""
        self.finish_host_copy()  # its buffer goes back only once the copy is done
        pending = self.unit.update_pending
        if not pending:  # else the update drops it once done
            self.drop_held()
        self.is_zero = True
        self.unreduced = None
        self._params_stale = pending and self.unit.grads.keeps_params()
        for s in self.unit.slots:
            if not self._params_stale:
                s.param.grad = None
            s.got_grad = False


def params_reached(outputs: list[torch.Tensor]) -> tuple[set[int], bool]:
    """``(ids, hidden)``: the ``id`` of every leaf tensor (parameter) a backward from
    ``outputs`` would give a gradient, found by walking their autograd graph; ``hidden``:
    the walk met a reentrant activation checkpoint, whose parameters only its recomputation
    in backward shows."""
    reached: set[int] = set()
    hidden = False
    seen: set = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # AccumulateGrad
        if leaf is not None:
            reached.add(id(leaf))
        elif is_reentrant_checkpoint(fn):
            hidden = True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return reached, hidden


def is_reentrant_checkpoint(fn) -> bool:
    """Whether autograd node ``fn`` is a reentrant activation checkpoint's (its forward ran
    without a graph; backward recomputes it)."""
    return type(fn).__name__ == "CheckpointFunctionBackward"


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
        # The autograd nodes of each unit's outputs in this forward (stage 3): a backward
        # runs a unit's pre-backward hook (its gather) when it executes one of them.
        self._output_nodes: dict[int, list] = {}
        self._forwards_noted: int = 0  # forwards with gradients since the last backward
        self._walking: bool = True  # the latest forward runs with gradients
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
            # A forward without gradients (an evaluation, reference log-probs between a
            # training forward and its backward) leaves the last walk's sets as they are.
            self._walking = torch.is_grad_enabled()
            if self._walking:
                self._hidden_units.clear()
                self._forwards_noted += 1
                if self._forwards_noted > _FORWARDS_NOTED:  # forwards never taken backward
                    self._output_nodes.clear()
                    self._forwards_noted = 1
            self._gathered_in_forward = 0
        if self.finds_unused and self._walking and not torch.is_grad_enabled():
            self._hidden_units.add(unit.index)  # inside a reentrant checkpoint

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
        sees what the outputs depend on, not what the loss reads: an output the loss
        ignores on some rank is found as backward starts ([Note: outputs the loss
        ignores]); a unit partly used inside a reentrant checkpoint is not found; and at
        stage 3 the gathers are collectives too, so every rank must run the same units (as
        DeepSpeed and FSDP ask). Where they do not and their gathers still pair up (units
        of one size: experts routed by the data), the same all-reduce compares a
        fingerprint of the units each rank gathered in this forward, in order, and every
        rank raises instead of training on the mixed parameters."""
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

    def note_outputs(self, unit: Unit, nodes: list) -> None:
        """The autograd nodes whose backward runs ``unit``'s pre-backward hook (stage 3 with
        ``find_unused_parameters``; see ``agree_on_reached``)."""
        if self.finds_unused and self.config.stage == 3:
            found = [n for n in nodes if n is not None]  # None: an output that is a leaf
            self._output_nodes.setdefault(unit.index, []).extend(found)

    def agree_on_reached(self) -> list[Unit]:
        """The first hook of a backward with ``find_unused_parameters`` (synchronized, or any
        at stage 3): the units some rank will not give all their gradients join the
        deferred ones, and the units (stage 3) this backward gathers on some ranks and not
        on others are returned, for the caller to gather on every rank now.

        [Note: outputs the loss ignores]
        The walk after forward ([Note: find unused parameters]) sees what the outputs
        depend on, not what the loss reads: an output computed on every rank but ignored
        by one rank's loss (a second head, an auxiliary term) gives its unit gradients on
        the other ranks only, and at stage 3 only they gather it for backward. So as a
        backward starts (its first hook), each rank asks autograd which nodes it will run
        (``torch._C._will_engine_execute_node``, as torch's FSDP does): a unit is complete
        when every trainable parameter's gradient accumulator will run, and reached when
        one of those or of its outputs' nodes will. One all-reduce (MAX) of the marks per
        backward (synchronized ones; at stage 3 every one, as its gathers are collectives
        even under ``no_sync()``): incomplete units and units reached on some ranks only
        are deferred; the latter are also gathered on every rank there, in unit order, and
        held to the end of the pass, so their pre-backward hooks gather nothing; that pass
        prefetches nothing, recomputed checkpoints included (the hooks' order differs
        between the ranks). Their gradients are reduced at the end with zeros from the
        ranks that got none, as DDP averages them. A unit run in a reentrant checkpoint
        with nothing reached counts as complete. The output nodes of the forwards with
        gradients since the last backward are kept (at most ``_FORWARDS_NOTED``); forwards
        without gradients leave them, and the walk's sets, alone. Every rank's loss must
        reach some unit: a backward that runs no hook of the model joins no all-reduce,
        and the ranks hang."""
        from torch.autograd.graph import get_gradient_edge

        def runs(node) -> bool:
            try:
                return bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:  # torch.autograd.grad: leaves are not asked about
                return True

        marks = []
        for unit in self.units:
            trainable = [s for s in unit.slots if s.trainable] if unit.trainable else []
            got = sum(1 for s in trainable if runs(get_gradient_edge(s.param).node))
            hidden = got == 0 and unit.index in self._hidden_units
            complete = got == len(trainable) or hidden
            reached = got > 0 or any(runs(n) for n in self._output_nodes.get(unit.index, ()))
            marks += [0 if complete else 1, int(reached), 1 - int(reached)]
        merged = zdist.all_reduce_max(
            torch.tensor(marks, dtype=torch.int64, device=self.device), self.group
        ).tolist()
        contested = []
        for i, unit in enumerate(self.units):
            incomplete, some, not_all = merged[3 * i : 3 * i + 3]
            # Reached on some ranks only: reduced at the end, also where a rank counts it
            # complete (a unit hidden in a reentrant checkpoint that it did not reach).
            if (incomplete or (some and not_all)) and self._sync:
                self._deferred.add(unit.index)
            gathers = not (unit.weightless_backward and not unit.deps)
            if some and not_all and gathers and self.config.stage == 3:
                contested.append(unit)
        return contested

    def _agree(self, fingerprint: int, flags: list[int]) -> tuple[bool, list[int]]:
        """One all-reduce (MAX) over the ranks: whether they all hold the same
        ``fingerprint``, and each of ``flags`` OR'ed."""
        t = torch.tensor([fingerprint, -fingerprint, *flags], dtype=torch.int64, device=self.device)
        merged = zdist.all_reduce_max(t, self.group).tolist()
        return merged[0] == -merged[1], merged[2:]

    def _note_gather(self, unit: Unit) -> None:
        self._gathered_in_forward = _fingerprint(self._gathered_in_forward, unit)

    # --------------------------------------------------------------------- the backward
    def reduce(self, unit: Unit, more_to_come: bool = False) -> bool:
        """Every trainable parameter of ``unit`` has its gradient (``Unit.count_grad_ready``):
        reduce them into its gradient shard. False when the unit waits for the end of
        backward instead (its gradients kept in full meanwhile). ``more_to_come``: this
        backward may still add to them (not held for an overlapped update)."""
        if self._sync and unit.index in self._deferred:
            # Not complete on every rank: kept here and reduced at the end of backward,
            # with the ranks that never complete it (see [Note: find unused parameters]).
            unit.accumulator.reduce(sync=False)
            return False
        unit.accumulator.reduce(sync=self._sync, hold=not more_to_come and self._hold_grads(unit))
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
        self._output_nodes.clear()  # they would keep a forward's graph to the next forward
        self._forwards_noted = 0

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
