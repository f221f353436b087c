"""A unit's gradients: reduced from its parameters into its gradient shard, accumulated there
over micro-batches, copied to the host, held in memory for an overlapped update.

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import dist as zdist
from ..memory.pool import BufferPool

if TYPE_CHECKING:
    from .unit import Unit

__all__ = ["GradAccumulator"]


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
