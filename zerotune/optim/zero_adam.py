"""Adam(W) over the engine's fp32 master shards.

[Note: segments]
The optimizer sees the model's parameter groups (so HF's decay / no-decay split and LR
schedulers work unchanged), but it updates shards, not parameters. For every unit, the part of
this rank's shard that belongs to one parameter is one *segment*. ``param_groups[i]["params"]``
holds one tensor per segment (a view of the fp32 master shard when that is in memory, an
empty placeholder when it lives on NVMe), so torch's Optimizer machinery (schedulers,
hyper-parameters per group) works as usual; the state per segment is its step count, the
parameter's own (see [Note: parameters without a gradient]). The master weights, moments
and gradients themselves come from a state store (see [Note: optimizer state stores] in
state_store.py), chunk by chunk; the C++ kernel updates master and moments and, for
bf16/fp16, writes the compute-dtype shard in the same pass.

[Note: parameters without a gradient]
torch's AdamW skips a parameter whose ``.grad`` is None at the step: no update, no weight
decay, no step counted (a branch the batch did not take, an expert no token was routed
to). The flat gradient shard cannot tell such a parameter from one whose gradient is zero,
so the engine keeps a flag per parameter (``Slot.got_grad``): set when a gradient of it is
taken into the shard (``GradAccumulator.reduce``, any micro-batch), cleared by ``zero_grad``.
The update skips the segments of parameters without it and counts a step only for the
others (``count_step`` reads the flag once, as the unit is launched; the update follows
that reading, ``Segment.counted``); a unit none of whose parameters got one is skipped
whole (``GradAccumulator.is_zero``). With 8-bit moments a block of 256 that no updated segment
reaches keeps its codes (a round trip through the codes is not exact); a block shared
with an updated parameter is quantized again whole, which moves the skipped part's
moments by the codes' rounding, as padding's. The flags follow the parameters that were
trainable when the engine was built (their gradients have hooks): ZeroAdamW refuses a
model whose ``requires_grad`` changed since. At
world size > 1 a parameter counts as having got a gradient when it did on any rank, as in
one process over the whole batch: a unit whose parameters all got gradients is reduced as
soon as backward is done with it, the same on every rank; the units left at the end of
backward (some parameter without a gradient on some rank) are agreed on in one all-reduce
that also merges the flags (``GradReducer._pending_units``), and every rank reduces them,
in order. What this cannot cover: a unit whose parameters all get gradients on one rank
but not on another in the same backward. The first rank reduces it during backward, the
other at the end, and their collectives no longer pair up (DDP without
``find_unused_parameters`` has the same limit). When the pairs differ in size or kind
(a reduce-scatter against an all-gather at stage 3) the backend fails or hangs; when two
units of one size pair up nothing fails there, so each rank also keeps a fingerprint of
the units it reduced during backward, and the all-reduce at the end compares them: a
difference raises on every rank, before ``step()`` uses the mixed gradients (an
overlapped step has updated the units it launched already: resume from a checkpoint; the
engine itself is reset for the next pass either way). So at world size > 1, in each
backward, a unit must either get gradients for all its parameters on every rank, or miss
at least one of them on every rank (which ones may differ), unless the config sets
``find_unused_parameters`` (see [Note: find unused parameters] in sharding/grads.py).

Gradient clipping and the fp16 loss scale do not rewrite the gradients: they set one factor
that the update applies to each chunk of gradient it reads (``grad * factor``), so gradients
on NVMe are read once for the norm and once for the step.

[Note: overlapped step]
With optimizer state on NVMe the step moves 12 bytes per parameter each way (6 with 8-bit
moments; 8 and 2 through O_DIRECT when the parameter file holds the master) and waits on
the disk while the processor idles. ``with opt.overlapped():`` around
the last backward of a step lets each unit's update start as soon as that unit's gradient
shard is final (the engine's post-backward hook, after the reduce-scatter), while backward
goes on with the units before it. A unit's update is the store's pipeline as a generator
(``pipeline``) that yields whenever the next I/O it needs has not arrived, and the
engine's backward hooks resume it ("pump") between layers, so disk transfers proceed in
the aio threads during backward compute, and the C++ Adam runs on this thread between
layers (with the state in host memory and the model on an accelerator, on a thread of its
own: [Note: host updates off the launching thread]). ``step()`` then finishes what is
still in flight and updates the units whose gradients became final only at the end of
backward. The updates are the same as ``step()``'s (same chunks, same kernel, same step
counts), so results are identical.
The launched units feed one pipeline for the whole backward (``state_store.Feed``): the
next unit's first chunk is read while the last chunk of the one before is updated, and
with NVMe the chunks of the units the last overlapped step launched next are read before
their gradients exist, from the moment ``overlapped()`` is entered (see [Note: reading
ahead of backward] in pipeline.py). A
gradient shard bound for NVMe is not written and read back when its update follows:
the engine keeps it in memory (``GradAccumulator.held``) when no other shard is held, or when
it is a one-parameter unit's (an embedding's) own ``.grad``, and the update reads it
there (``GradReducer._hold_grads`` in sharding/grads.py).
It needs what an early update cannot undo or rescale: no global-norm clipping (the norm needs
every gradient first; see [Note: a clipped overlapped step]), no fp16 loss scaling (an
overflow anywhere must skip every update), stage 2 or 3 (stage 1 keeps whole gradients until
the step) and a synchronized backward.

[Note: a clipped overlapped step]
Global-norm clipping scales every gradient by a factor known only once the last one exists,
and an Adam update cannot be rescaled afterwards. ``overlapped(clipping=True)`` therefore
moves the updates after the norm instead of into backward: as backward finishes a unit,
its share of the norm is summed from its final gradient shard while that is in memory
(``OverlappedStep.launch``), so ``clip_grad_norm_`` reads no gradient back; ``step()`` then
queues every update, in the order the next forward gathers the units, and carries them
into that forward (see [Note: carrying the step into the next forward]), each unit updated
just before its gather. Backward still does what does not depend on the norm: the pipeline
reads ahead the first units' master and moments in every staging slot ([Note: reading
ahead of backward] in pipeline.py), and gradient shards bound for NVMe stay in memory
for the units updated first, within ``grad_host_bytes`` (``grads_kept_for_update`` in
sharding/buffers.py), the others being written as usual (held only until their share of
the norm is summed). The updates are exactly the ones a step after
``clip_grad_norm_`` makes: same chunks, kernel, step counts and factor (frozen with the
carried hyper-parameters, and applied to the rows an embedding lookup previews). ZeroTrainer
uses it by default whenever the optimizer state is on NVMe and ``max_grad_norm`` > 0, for
ZeroAdamW and for a ZeroOptimizer that can overlap (the same base-class machinery).

[Note: carrying the step into the next forward]
The updates still queued when backward ends are those of the units backward finished last:
at stage 3 the first blocks and the input embedding, the units the next forward needs first.
With NVMe they are the disk's backlog from backward; a ``step()`` that waited for all of
it (the "tail") would leave the disk idle through the whole next forward. With
``overlapped(carry=True)`` (the default) ``step()`` returns once the parameters that stay
gathered (persistent units) are updated, and the rest of the pipeline runs on in the next
forward: the engine's pre-forward hooks resume it between layers, a unit about to be
gathered is first moved to the front of the queue and updated (``settle``), and a unit
prefetch would gather early is only moved to the front (at world size 1; with collectives it
is settled and gathered ahead on every rank alike, whatever each rank's own progress).
Everything else that reads or writes a unit's state finishes the whole pipeline first: the
next backward (its first hook), ``step()``, ``overlapped()``, ``clip_grad_norm_``,
``unit_state`` / ``load_unit_state`` (checkpoints, export), ``full_state_dict``, ``close``.
The updates are the ones ``step()`` would have made: the step counts were taken at launch,
and the hyper-parameters are frozen at ``step()``, tensors copied (a scheduler stepping
right after it changes the next step's, as without carrying); the gradients they read stay
where they are until their update is done (``Unit.update_pending``: ``zero_grad`` keeps a
held gradient), and nothing writes a gradient before the next backward, which settles first.
An error in a carried update comes out of the call that resumed it (a forward, a checkpoint)
and from every later one: some units of that step were updated and some not, so it says to
resume from a checkpoint. With ``track_norm`` the gradients the carried updates have not
read yet are summed at ``step()`` (read back from the gradient file where they were
spilled), so the norm is there when ``step()`` returns. With a store in memory only where
its updates run on their own thread (else there is nothing to wait for).

[Note: a backward that raises inside overlapped()]
A backward can raise part way (an out-of-memory error that the Trainer's
``--auto_find_batch_size`` retries with a smaller batch, an interrupt in a notebook). The
step is then given up, so that the caller can zero the gradients and go on
(``OverlappedStep.abort``). With ``clipping=True`` nothing was updated yet: the reads
ahead are given up, the units whose gradients were already final give back the step
counts taken for them, and gradient shards kept in memory for their updates go to their
files. The optimizer is then as it was before the backward, and the gradients hold what
the failed backward added, as torch's ``.grad`` does.
Without clipping those units have been updated. Updates cannot be undone, so those in
flight are finished, the step stays partial, and a warning says how many units were
updated. The engine starts its next forward from a clean pass either way
(``ZeroEngine.forward``). Updates carried into a forward that raises stay queued; the next
forward or ``step()`` makes them. Not given up: a step whose own update pipeline failed,
or that refused a second backward (``OverlappedStep.broken``); ``step()`` then refuses.
ZeroTrainer defers the updates (``clipping=True``) whenever ``--auto_find_batch_size`` is
on, so a retried step starts from the weights the last complete step left.

[Note: host updates off the launching thread]
With the optimizer state in host memory and the model on an accelerator, the thread that
runs the C++ Adam between backward's layers is the one that launches the accelerator's
kernels: while a unit's update runs, the device drains its queue and waits. There, the
store hands the arithmetic of each chunk (the Adam kernel, the compute-dtype copy) to one
thread of its own (``UpdateThread`` in pipeline.py), two chunks at a time, whose kernels
use one core fewer, and the calling thread goes on launching. What reads or changes shared
state stays on the calling thread, in order: before the arithmetic, the hyper-parameters,
step counts, the tracked norm's sum and the host buffer (``begin_chunk``); after it, the
copy to the device and the unit's "updated" mark (``finish``), run when the pipeline is
resumed and finds the chunk done. The C++ kernels release the GIL. The step carries into
the next forward as an NVMe step does, so the updates of the first units overlap that
forward too. The chunks, kernel and arguments are those of the calling thread's path:
results are bit for bit the same (``update_thread`` forces either path; None chooses by
the device). A failing chunk fails the step as on the calling thread, after the chunk
queued behind it is finished.

[Note: one fused step over a device's units]
On an accelerator a chunk-by-chunk step launches, per unit, a step-count fill and one
fused AdamW call per hyper-parameter group, and prepares a view per segment between them:
with the model's work on the device done, the launches, not the kernels, would take the
step's time. With the shards, the moments and the gradients all on the device (no
offload, fp32 moments), ``step()`` prepares every chunk first and then runs one fused call
per group over the segments of all units (``multi_tensor_adam_update_shards``), the
clipping factor as one ``_foreach_mul_`` and the compute-dtype copies as one
``_foreach_copy_``. Each element gets the same arithmetic as chunk by chunk, bit for bit
(tested on the CPU, where torch's fused step runs too). Host or NVMe tiers, 8-bit moments
and the overlapped step go chunk by chunk.

[Note: looked-up rows before their update]
The input embedding is the first unit the next forward gathers and the last whose gradient
is final, so a carried step would make the forward wait for the whole of its update (at
stage 3 with a tied head, 0.8 GB of moments for gpt2-medium) before its first layer. But
the lookup reads only the rows of the batch's tokens. At world size 1, with the fp32
master in the parameter file that the gather maps privately (copy-on-write), the engine
gathers the embedding without waiting and ``preview_rows`` computes those rows' new
values: their master (the mapping, for chunks the update has not reached), gradient (held
in memory) and moments (read from the optim file, whole pages, which nothing writes until
the update reaches them; urgent reads, ahead of the pipeline's queued chunk reads, which
would otherwise make the lookup wait) go through the same Adam kernel
with the same arguments; every element's arithmetic is independent of its position in a
call (the kernel pads its ragged tail through the vector body), so the values are those the
update will write, bit for bit.
They are written into the private mapping only; the lookup reads them and the unit is
released after it. The update then goes on in the background, and the tied head (or
anything else) that gathers the embedding later waits for it as usual. A unit still
gathered from such a lookup when something needs it whole is settled and read again from
the file (``Unit.reread``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .cpu_adam import (
    adam_arguments,
    adam_update,
    adam_update_8bit,
    multi_tensor_adam_update,
    multi_tensor_adam_update_shards,
)
from .overlap import OverlappedStep
from .quant8 import Q8Moments
from .sharded import ShardedOptimizer, StepInfo
from .state_store import ResidentStore, Scratch

__all__ = ["StepInfo", "ZeroAdamW"]


@dataclass(slots=True)
class _ChunkJob:
    """One chunk's update as ``ZeroAdamW._chunk_job`` prepared it."""

    unit: object
    c0: int
    c1: int
    master: torch.Tensor
    moments: object  # (exp_avg, exp_avg_sq), or a Q8Moments
    grad: torch.Tensor
    factor: float  # what the gradient is multiplied by first
    target: torch.Tensor | None  # the compute-dtype shard to refresh
    out: torch.Tensor | None  # its chunk, when the kernel writes it
    segments: list

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(destination, source)`` copies that bring the compute-dtype chunk up to date
        after the kernel: all of it, or (the kernel wrote its segments) the rest of the
        chunk (frozen parameters, parameters without a gradient, padding)."""
        if self.target is None:
            return []
        if self.out is None:
            return [(self.target[self.c0 : self.c1], self.master)]
        pairs, at = [], 0
        for a, b, _ in self.segments + [(self.c1 - self.c0, self.c1 - self.c0, None)]:
            if at < a:
                pairs.append((self.out[at:a], self.master[at:a]))
            at = b
        return pairs


# torch.optim.AdamW's options that change the update, which ZeroAdamW's kernels do not make.
_UNSUPPORTED = ("amsgrad", "maximize")


def _check_hyper(lr, betas, eps, weight_decay, where: str = "") -> None:
    if lr < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(
            f"invalid Adam hyper-parameters{where}: lr={lr} betas={betas} "
            f"weight_decay={weight_decay}"
        )
    if not eps > 0:
        raise ValueError(
            f"invalid Adam hyper-parameters{where}: eps={eps} (it must be > 0: with 0, an "
            "element whose gradient and moments are zero becomes 0/0 = NaN)"
        )


def _check_group(index: int, group: dict) -> None:
    """A parameter group's own hyper-parameters, checked as the defaults are (a group
    setting ``amsgrad`` or ``maximize``, which torch's AdamW reads, is refused: ZeroAdamW
    would step as without them)."""
    for key in _UNSUPPORTED:
        if group.get(key):
            raise ValueError(
                f"parameter group {index} sets {key}=True, which ZeroAdamW does not "
                "implement; use zerotune.ZeroOptimizer(engine, torch.optim.AdamW, groups) "
                "for it"
            )
    where = f" in parameter group {index}"
    _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)


class ZeroAdamW(ShardedOptimizer):
    """AdamW (or Adam with L2, ``adamw_mode=False``) for a model sharded by zerotune.

    ``params`` are the model's parameters or parameter groups, as for ``torch.optim.AdamW``;
    None means every trainable parameter. Use ``clip_grad_norm_`` for global-norm clipping
    across ranks. ``step()`` returns a :class:`StepInfo`.
    """

    def __init__(
        self,
        engine,
        params: Iterable | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ):
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        groups = self._build_segments(engine, params)
        for gi, group in enumerate(groups):
            _check_group(gi, {**defaults, **group})
        live_units = [u for u in engine.units if u.index in self.unit_segments]
        self.store = engine.make_optimizer_store(live_units)
        self._scratch = Scratch()  # fp32 moments of an 8-bit chunk without the C++ op
        # Overlapped steps with the state in host memory: the arithmetic on the store's
        # update thread (True), on the calling thread (False), or None: on the thread when
        # the engine computes on an accelerator ([Note: host updates off the launching thread]).
        self.update_thread: bool | None = None
        torch_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups
        ]
        for segs in self.unit_segments.values():
            for seg in segs:
                master = seg.unit.master
                seg.key = master[seg.start : seg.end] if master is not None else torch.empty(0)
                torch_groups[seg.group]["params"].append(seg.key)
        super().__init__(torch_groups, defaults)
        for segs in self.unit_segments.values():
            for seg in segs:
                self.state[seg.key] = {"step": 0}
        engine.attach_optimizer(self)

    @contextlib.contextmanager
    def overlapped(self, track_norm: bool = False, carry: bool = True, clipping: bool = False):
        """Run the last backward of a step inside: each unit is updated as soon as its
        gradient is final, overlapping the optimizer's I/O with the rest of backward; then
        call ``step()`` as usual (see [Note: overlapped step]). Not with fp16 or stage 1,
        nor inside ``no_sync()``. With ``track_norm`` the global gradient norm is
        summed from the chunks the updates read: ``pending_grad_norm`` is a 0-dim tensor
        that ``step()`` fills (and ``StepInfo.grad_norm``). With ``carry`` (and optimizer
        state on NVMe) the updates still queued at ``step()`` go on during the next forward
        (see [Note: carrying the step into the next forward]). With ``clipping`` the
        updates wait for ``step()``, so ``clip_grad_norm_`` may come between (see [Note: a
        clipped overlapped step]); the norm is tracked."""
        self.settle()
        self._start_overlap(track_norm, clipping)
        carry = carry and (self.store.carries or self.updates_off_thread())
        with self._overlapping(OverlappedStep(self, carry=carry, clipping=clipping)):
            yield

    def state_dict(self):
        """Refused: the state lives in shards across ranks and tiers (memory, NVMe), not in
        ``self.state``; a torch-style dict of it would hold only step counts."""
        raise RuntimeError(
            "ZeroAdamW.state_dict(): the master weights and moments are sharded across ranks "
            "and offload tiers; save them with zerotune.save_checkpoint(engine, folder, "
            "optimizer=opt) and resume with zerotune.load_checkpoint(engine, folder, "
            "optimizer=opt)"
        )

    def load_state_dict(self, state_dict) -> None:
        """Refused, as ``state_dict``: use ``zerotune.load_checkpoint``."""
        raise RuntimeError(
            "ZeroAdamW.load_state_dict(): resume with zerotune.load_checkpoint(engine, folder, "
            "optimizer=opt) from a folder zerotune.save_checkpoint wrote"
        )

    @torch.no_grad()
    def step(self, closure=None) -> StepInfo:
        if closure is not None:
            raise ValueError("ZeroAdamW.step does not take a closure")
        self._check_attached()
        overlap, self._overlap = self._overlap, None
        self.settle()  # the step before's, should nothing have needed it since
        launched = self._end_overlap(overlap) if overlap is not None else {}
        self._prepare()
        info = self._step_info()
        if not self._overflow:
            units = [u for u in self._live_units() if u.index not in launched]
            for unit in units:
                self.count_step(unit)
            items = [(u, c0, c1) for u in units for c0, c1 in self.store.chunks(u)]
            if items and self._on_device(units):
                self._update_on_device(items)
            elif items:
                self.store.run(items, self.update_chunk)
            self._fill_tracked_norm(info)
            self.engine.after_step()
        self._scratch.release()
        self.norm_sq = None
        self.pending_grad_norm = None
        self._end_step()
        return info

    def update_chunk(self, unit, c0, c1, master, moments, grad) -> None:
        """Update elements ``[c0, c1)`` of ``unit``'s shard: ``master``, ``grad`` and the
        moments (a pair of fp32 tensors, or a :class:`Q8Moments`) are that chunk's."""
        math, finish = self.begin_chunk(unit, c0, c1, master, moments, grad)
        math()
        finish()

    def begin_chunk(self, unit, c0, c1, master, moments, grad):
        """``update_chunk`` in three: what reads the optimizer's and the engine's state (now),
        the arithmetic on the chunk's own tensors (``math``, which may run on another
        thread) and what hands the result to the engine (``finish``, after ``math``)."""
        job = self._chunk_job(unit, c0, c1, master, moments, grad)
        return functools.partial(self._math, job), functools.partial(self._finish, job)

    def _chunk_job(self, unit, c0, c1, master, moments, grad) -> _ChunkJob:
        factor = self._update_factor()
        if self.norm_sq is not None:  # summed now: step() may read it before math runs
            if factor != 1.0:
                grad.mul_(factor)
                factor = 1.0
            self.add_sum_of_squares(self.norm_sq, unit, c0, c1, grad)
        target = self.engine.lowp_target(unit)  # compute-dtype shard to refresh, or None
        fused = (
            target is not None and target.dtype != torch.float32 and unit.placement.params != "nvme"
        )
        out = target[c0:c1] if fused else None
        segments = self._segments_in(unit, c0, c1)
        return _ChunkJob(unit, c0, c1, master, moments, grad, factor, target, out, segments)

    def _math(self, job: _ChunkJob) -> None:
        master, grad, moments = job.master, job.grad, job.moments
        segments, out = job.segments, job.out
        if job.factor != 1.0:
            grad.mul_(job.factor)
        if isinstance(moments, Q8Moments):
            # One pass per block with the C++ op (see [Note: fused 8-bit step]), or
            # dequantize, update and quantize the chunk; nothing, when nothing in the chunk
            # got a gradient (its moments stay as they are).
            if segments and not adam_update_8bit(master, grad, moments, segments, out):
                work = moments.dequantize(self._scratch.moments(job.c1 - job.c0, master.device))
                m, v = work["exp_avg"], work["exp_avg_sq"]
                self._adam(master, grad, (m, v), segments, out)
                moments.quantize_reached(work, segments)
        else:
            self._adam(master, grad, moments, segments, out)
        for dst, src in job.copies():
            dst.copy_(src)

    def _finish(self, job: _ChunkJob) -> None:
        if job.c1 == job.unit.shard_numel:
            self.engine.lowp_done(job.unit, job.target)

    def _on_device(self, units) -> bool:
        """Whether ``units``' updates can go in one fused step on their device (see [Note:
        one fused step over a device's units])."""
        store = self.store
        if not isinstance(store, ResidentStore) or any(u.index in store.q8 for u in units):
            return False
        return all(
            u.master is not None
            and u.master.device.type != "cpu"
            and u.placement.params == "device"  # refreshed in place, no host buffer
            and u.placement.grads == "device"
            for u in units
        )

    def _update_on_device(self, items) -> None:
        """[Note: one fused step over a device's units]"""
        jobs = [self._chunk_job(*self.store.chunk_views(*item)) for item in items]
        scaled = [job for job in jobs if job.factor != 1.0]  # the step's one factor
        if scaled:
            torch._foreach_mul_([job.grad for job in scaled], scaled[0].factor)
        multi_tensor_adam_update_shards(
            [(j.master, j.grad, *j.moments, j.segments, j.out) for j in jobs]
        )
        copies = [pair for job in jobs for pair in job.copies()]
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
        for job in jobs:
            self._finish(job)

    def updates_off_thread(self) -> bool:
        """See [Note: host updates off the launching thread]."""
        if not isinstance(self.store, ResidentStore):
            return False
        if self.update_thread is not None:
            return self.update_thread
        owned = [u for u in self.engine.units if u.index in self.unit_segments]
        on_host = all(u.master is not None and u.master.device.type == "cpu" for u in owned)
        return self.engine.device.type != "cpu" and on_host

    def _segments_in(self, unit, c0: int, c1: int) -> list[tuple[int, int, dict]]:
        """(start, stop) relative to ``c0`` and Adam's arguments of each segment of ``unit``
        within ``[c0, c1)`` that this step updates, in order (the fused op needs it)."""
        groups = self._update_groups()
        segments = []
        for seg in self.unit_segments[unit.index]:
            a, b = max(seg.start, c0), min(seg.end, c1)
            if a >= b or not seg.counted:
                continue
            kwargs = adam_arguments(groups[seg.group], self.state[seg.key]["step"])
            segments.append((a - c0, b - c0, kwargs))
        return segments

    @staticmethod
    def _adam(master, grad, moments, segments, out) -> None:
        m, v = moments
        if master.device.type != "cpu":  # torch's fused step, a few launches per shard
            multi_tensor_adam_update(master, grad, m, v, segments, out)
            return
        for a, b, kwargs in segments:  # the C++ kernel
            lowp = out[a:b] if out is not None else None
            adam_update(master[a:b], grad[a:b], m[a:b], v[a:b], out_lowp=lowp, **kwargs)

    def detach(self) -> None:
        """The moments in the engine's optim file start at zero for the next optimizer."""
        super().detach()
        self.store.reset_moments([u for u in self.engine.units if self.owns(u)])

    def can_preview(self, unit) -> bool:
        """Whether a lookup into ``unit`` (an embedding whose update the last step carried
        into this forward) can read its rows' new values from ``preview_rows`` instead of
        waiting for the whole update (see [Note: looked-up rows before their update])."""
        carry = self._carry
        if carry is None or unit.index not in carry.unfinished or self.engine.world != 1:
            return False
        module = unit.module
        return (
            # nn.Embedding's own forward: its first argument is the rows (a subclass, such
            # as OPT's or BART's positional embeddings, may look up others)
            type(module).forward is torch.nn.Embedding.forward
            and len(unit.slots) == 1
            and unit.slots[0].param is module._parameters.get("weight")
            and unit.params.mapped
            and getattr(self.store, "previews", False)
            and unit.placement.master_in_param_file
            and not self.store.is_quantized(unit)
            and (unit.accumulator.held is not None or not unit.grads.on_disk)
        )

    @torch.no_grad()
    def preview_rows(self, unit, ids: torch.Tensor, weight: torch.Tensor) -> None:
        """Write into ``weight`` (``unit``'s gathered embedding matrix, a private mapping of
        the parameter file) the new values of the rows ``ids`` looks up, where the carried
        update has not written them yet; see [Note: looked-up rows before their update]."""
        carry = self._carry
        rows = torch.unique(ids.reshape(-1).to("cpu", torch.int64))
        num, dim = weight.shape
        rows = rows[(rows >= 0) & (rows < num)]
        done = carry.progress.get(unit.index, 0)  # elements whose new values are written
        starts = [r * dim for r in rows.tolist() if r * dim + dim > done]
        ranges = [(max(a, done), a + dim) for a in starts]
        if not ranges:
            return
        segments = self._segments_in(unit, 0, unit.shard_numel)  # one: the weight's
        if not segments:
            return  # no gradient this step: the update leaves the weights as they are
        grad = unit.grads.view(unit, 0, unit.shard_numel)  # in memory (can_preview)
        m, v = self.store.read_moment_ranges(unit, ranges)
        # One kernel call over the rows side by side: each element's arithmetic does not
        # depend on where it sits in the call.
        index = torch.cat([torch.arange(a, b) for a, b in ranges])
        flat = weight.view(-1)
        master = flat[index]
        g = grad[index].float()  # a copy: Adam-L2 adds to the gradient in place
        factor = self._update_factor()  # these rows' gradients are not scaled yet
        if factor != 1.0:
            g.mul_(factor)
        m, v = torch.cat(m), torch.cat(v)
        self._adam(master, g, (m, v), [(0, index.numel(), segments[0][2])], None)
        flat[index] = master

    # ------------------------------------------------------------------ step interface
    def state_specs(self, unit) -> list[tuple[str, torch.dtype, int]]:
        return self.store.state_specs(unit)

    def state_numels(self, unit) -> dict[str, int]:
        return self.store.state_numels(unit)

    def read_unit(self, unit, master_only: bool = False) -> dict[str, torch.Tensor]:
        return self.store.read_unit(unit, master_only)

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        self.store.write_unit(unit, state)

    def state_bytes(self) -> int:
        return self.store.nbytes()
