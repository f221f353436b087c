"""A sharding unit: a group of parameters stored as one flat, rank-major shard per rank.

[Note: flat layout]
The parameters a unit owns are laid end to end in module order into one flat buffer of
``padded_numel`` elements (``numel`` rounded up to a multiple of the world size). Rank ``r``
keeps the slice ``[r * shard_numel, (r + 1) * shard_numel)``. An all-gather of every rank's slice
lands the whole flat buffer (``flat``), and each parameter's ``.data`` becomes a view of it: the
``nn.Parameter`` objects never change, only what their data points to. Released, a parameter
holds an empty tensor of its dtype, and ``flat`` keeps its tensor object but frees its storage
(resized to 0 bytes). Keeping the same storage object matters: autograd saves views of the
weights in forward (``weight.t()`` for a linear) and reads them in backward, after the unit was
released and gathered again; they must find this unit's data there, not whatever a shared
buffer holds by then. The padding at the tail is zero in parameters, gradients and optimizer
state, so it never changes the math.

Each unit keeps, for its shard: the compute-dtype copy (``shard``), the fp32 master weights
(``master``; the same tensor as ``shard`` when the compute dtype is fp32), and the accumulated
gradient (``grad_shard``). Units that stay gathered (stages 1-2, or small units under the
persistence threshold) keep the whole flat buffer (``full``) and ``shard`` is a view into it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import dist as zdist
from ..memory.aio import aligned_empty
from ..memory.pool import BufferPool

__all__ = ["Slot", "Unit", "UnitState"]


class UnitState(enum.Enum):
    SHARDED = "sharded"  # parameters are empty; only this rank's shard exists
    GATHERING = "gathering"  # an asynchronous all-gather is in flight
    GATHERED = "gathered"  # parameters are views of the whole flat buffer


@dataclass
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    # The parameter got a gradient since the last zero_grad, on any rank (see [Note:
    # parameters without a gradient]).
    got_grad: bool = False
    watched: bool = False  # trainable when the engine was built (see ZeroAdamW's check)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class Unit:
    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
        persistent: bool,
        pool: BufferPool,
        host_pool: BufferPool | None = None,
        group=None,
        fill=None,
    ):
        """``fill(unit, shard)``, when given, writes this rank's slice of the flat buffer
        (from a checkpoint, say) and the parameters' own data is never read. ``pool`` holds
        buffers on ``device``; ``host_pool`` (the same pool on a CPU device, else pinned
        host memory) those that meet the host: NVMe reads and writes, gradient shards
        kept on the host."""
        self.index, self.name, self.module = index, name, module
        self.dtype, self.grad_dtype, self.device = dtype, grad_dtype, device
        self.pool, self.group = pool, group
        self.host_pool = pool if host_pool is None else host_pool
        self.rank, self.world = zdist.get_rank(group), zdist.get_world_size(group)

        self.slots: list[Slot] = []
        offset = 0
        for pname, p in named_params:
            self.slots.append(Slot(pname, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        self.padded_numel = math.ceil(offset / self.world) * self.world
        self.shard_numel = self.padded_numel // self.world
        self.shard_start = self.rank * self.shard_numel
        self.trainable = any(s.trainable for s in self.slots)
        self.persistent = persistent
        self.gathered_bytes = self.padded_numel * (torch.finfo(dtype).bits // 8)

        own = slice(self.shard_start, self.shard_start + self.shard_numel)
        # This rank's slice in fp32 first: it becomes the master weights, so a bf16/fp16
        # compute copy never rounds the master.
        if fill is None:
            # The parameters hold real data: flatten them, keep this rank's slice.
            whole = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
            with torch.no_grad():
                for s in self.slots:
                    whole[s.offset : s.offset + s.numel].copy_(s.param.data.reshape(-1))
            master = whole[own].clone() if self.world > 1 else whole
            del whole
        else:
            # The parameters are placeholders (meta): ``fill`` writes this rank's slice.
            master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            fill(self, master)
        shard = master if dtype == torch.float32 else master.to(dtype)
        if persistent or self.world == 1:
            # The whole flat buffer stays: gathered units keep it, and at world size 1 the
            # shard is the whole buffer.
            flat = shard
            if self.world > 1:
                flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
                zdist.all_gather_into(flat, shard, group=group)
            self.flat = flat
            self.shard = flat[own]
        else:
            # A tensor of padded_numel elements over a storage (re)allocated on each gather.
            self.shard = shard
            self.flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
            self.flat.untyped_storage().resize_(0)
        self.full = self.flat if persistent else None
        self.master = self.shard if dtype == torch.float32 else master
        del master, shard
        # Allocated on the first gradient (see _grad_buffer): building or evaluating a model
        # holds no gradient memory.
        self.grad_shard: torch.Tensor | None = None
        self.grad_device = device  # the host, with optimizer offload
        self.grad_is_zero = True  # grad_shard holds no gradient yet (contents are stale)
        self.unreduced: torch.Tensor | None = None  # full-size grads kept under no_sync()
        self.on_gather = None  # called with the unit as its all-gather is issued (world > 1)

        self.state = UnitState.SHARDED
        self._placeholders = False  # released parameters keep their shapes (keep_shapes)
        self._work = None
        # NVMe tiers (see memory/swap.py): set by the engine when offloading.
        self.param_extent = None  # the compute-dtype shard lives here instead of ``shard``
        # Gathers map param_extent's pages instead of reading them (set by the engine).
        self.map_params = False
        self._mapped = False  # flat's storage is such a mapping now
        self.grad_extent = None  # the gradient shard lives here instead of ``grad_shard``
        # The final gradient shard kept in memory for an overlapped update instead of a
        # round trip through ``grad_extent`` (see [Note: overlapped step] in zero_adam.py).
        self.held_grad: torch.Tensor | None = None
        # An overlapped step's update of this unit is queued or running (it may run on
        # into the next forward): its gradient stays until the update is done.
        self.update_pending = False
        # Gathered for a lookup with only the looked-up rows new (see [Note: looked-up rows
        # before their update] in optim/zero_adam.py); cleared on release.
        self.previewed = False
        self._held_pooled = True  # it came from host_pool (else: a parameter's own .grad)
        self._read = None  # (handle, staging tensor or None) of a parameter read in flight
        self._send = None  # a device copy of a host shard that a gather in flight sends
        # Gradients on their way to the host: (buffer, event, straight into the shard)
        # until finish_host_copy.
        self._host_copy = None
        self.copy_stream = None  # the side stream of those copies (the engine sets it)
        self._lent = None  # the GatherCache buffer behind flat's storage while gathered
        self._pending_writes: list = []  # this unit's entries of pool.writes
        # The optimizer store's writes of the fp32 master into param_extent (the parameter
        # file holds the master with fp32 compute; optim/state_store.py): gathers wait.
        self.param_file_writes: list = []
        if persistent:
            self._point_params(self.full)
            self.state = UnitState.GATHERED
        else:
            self._empty_params()

    # ----------------------------------------------------------------------------- gather

    def gather(self, async_op: bool = False) -> None:
        """Make every parameter a view of the whole flat buffer (all-gather of the shards)."""
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.GATHERING:
            self.wait()
            return
        if self.param_extent is not None:
            self._gather_from_nvme(async_op)
            return
        if self.world == 1 and self.shard.device == self.device:
            # The shard is the whole flat buffer: point at it, nothing to move.
            self._point_params(self.flat)
            self.state = UnitState.GATHERED
            return
        self._alloc_storage()
        send = self.shard
        if send.device != self.device:
            # Offloaded to (pinned) host memory: copy in, then gather on the device. The
            # copy is ordered before the collective and the forward on this stream; the
            # host shard changes only in the optimizer step, after backward's gradient
            # copies to the host have synchronized with everything before them.
            if self.world == 1:
                self.flat.copy_(send, non_blocking=True)
                self._point_params(self.flat)
                self.state = UnitState.GATHERED
                return
            send = self.pool.acquire(self.shard_numel, self.dtype)
            send.copy_(self.shard, non_blocking=True)
        self._note_gather()
        work = zdist.all_gather_into(self.flat, send, group=self.group, async_op=async_op)
        staged = send if send is not self.shard else None
        if work is None:
            if staged is not None:
                self.pool.release(staged)  # later work on this stream follows the collective
            self._point_params(self.flat)
            self.state = UnitState.GATHERED
        else:
            self._work = work
            self._send = staged  # back to the pool once the collective is waited for
            self.state = UnitState.GATHERING

    def _gather_from_nvme(self, async_op: bool) -> None:
        # Read this rank's slice from the swap file: straight into the flat buffer at world
        # size 1 when its storage is a lent (aligned) buffer, else into a read buffer that
        # the all-gather (a copy at world size 1) then sends.
        self.wait_writes()
        if self.map_params:
            # Map the file's pages (page cache) as the flat buffer: no copy, no buffer of
            # our own; the readahead the mapping starts is the prefetch.
            self._alloc_storage(
                self.param_extent.file.map(self.param_extent.offset, self.gathered_bytes)
            )
            self._mapped = True
            self._point_params(self.flat)
            self.state = UnitState.GATHERED
            return
        self._alloc_storage()
        if self.world == 1 and self._lent is not None:
            tmp = None
            handle = self.param_extent.file.read(self.flat, self.param_extent.offset)
        else:
            # A fresh aligned buffer, freed right after the gather: a pooled one would keep
            # prefetch-depth copies of the shards resident for good.
            tmp = aligned_empty(self.shard_numel, self.dtype)
            handle = self.param_extent.file.read(tmp, self.param_extent.offset)
        self._read = (handle, tmp)
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait()

    def _note_gather(self) -> None:
        """An all-gather of this unit is issued (the engine fingerprints their order)."""
        if self.on_gather is not None and self.world > 1:
            self.on_gather(self)

    def wait(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        if self._read is not None:
            handle, tmp = self._read
            self._read = None
            try:
                handle.wait()
            except BaseException:
                # The read failed: back to SHARDED, so that hooks running after the error
                # (release) find a consistent unit.
                self._free_storage()
                self.state = UnitState.SHARDED
                raise
            if tmp is not None:
                if tmp.device != self.device and self.world > 1:
                    tmp = tmp.to(self.device)  # collectives run on the device
                self._note_gather()
                zdist.all_gather_into(self.flat, tmp, group=self.group)  # a copy at world 1
                del tmp
        else:
            self._work.wait()
            self._work = None
            if self._send is not None:
                self.pool.release(self._send)
                self._send = None
        self._point_params(self.flat)
        self.state = UnitState.GATHERED

    def keep_private(self) -> None:
        """The parameter file's bytes of this unit are about to change (the optimizer
        writes the new master or parameters). A gathered unit mapping that file would see
        the change in the pages it has not written (autograd may still read them): it
        gets a copy of its own first. The overlapped step updates a unit after its
        backward, so it is normally released by then."""
        if not self._mapped or self.state is UnitState.SHARDED:
            return
        own = aligned_empty(self.gathered_bytes, torch.uint8)
        own.copy_(self.flat.view(torch.uint8))
        self.pool.gather_cache.lend_unmanaged(self.flat, own)  # the mapping goes
        self._mapped = False

    def reread(self) -> None:
        """Read the gathered buffer again from the parameter file (world size 1): it was
        gathered with some rows computed ahead of an update that has now been written."""
        self.wait_writes()
        if self._mapped:
            self.keep_private()  # a buffer of its own to read into
        self.param_extent.file.read(self.flat, self.param_extent.offset).wait()
        self.previewed = False

    def pending_write_handles(self) -> list:
        """The I/O handles of this unit's NVMe writes still queued (oldest first)."""
        return [entry[0] for entry in self._pending_writes]

    def wait_writes(self) -> None:
        """Finish this unit's NVMe writes in flight and give their buffers back."""
        for entry in self._pending_writes:
            self.pool.writes.finish(entry)
        self._pending_writes.clear()
        for handle in self.param_file_writes:
            handle.wait()
        self.param_file_writes.clear()

    def offload_params(self, extent) -> None:
        """Keep this rank's compute-dtype shard in ``extent`` (NVMe) instead of memory."""
        self.wait_writes()
        staged = self.host_pool.acquire(self.shard_numel, self.dtype)
        staged.copy_(self.shard)
        extent.file.write(staged, extent.offset).wait()
        self.host_pool.release(staged)
        self.param_extent = extent
        if self.world == 1:
            # The flat buffer was the shard; now it is allocated on each gather.
            self.flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
            self.flat.untyped_storage().resize_(0)
        self.shard = None  # with fp32, self.master keeps the tensor

    def store_shard(self, values: torch.Tensor, give_back=None) -> None:
        """After an optimizer step: the new compute-dtype shard, written to NVMe (async;
        ``give_back(values)`` runs once the write is done) or copied into memory."""
        if self.param_extent is None:
            self.shard.copy_(values)
            if give_back is not None:
                give_back(values)
            return
        self.keep_private()
        handle = self.param_extent.file.write(values, self.param_extent.offset)
        self.pool.writes.add(self._pending_writes, handle, values, give_back)

    def keep_shapes(self) -> None:
        """Point each parameter of this released unit at one shared element expanded to its
        shape: autograd stores a gradient only into a parameter of the gradient's shape, and
        an embedding's unit is not gathered for its backward (it reads no weight). Only
        there: elsewhere a node reading a released weight finds an empty tensor and fails
        loudly instead of computing with zeros. ``release`` empties them again."""
        if self.persistent or self.state is not UnitState.SHARDED:
            return
        one = torch.zeros((), dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = one.expand(s.shape)
        self._placeholders = True

    def release(self) -> None:
        """Drop the gathered parameters (no-op for persistent units); placeholders left by
        ``keep_shapes`` go too."""
        self.previewed = False
        if self.persistent:
            return
        if self.state is UnitState.SHARDED:
            if self._placeholders:
                self._empty_params()
            return
        self.wait()
        self._empty_params()
        if self.world > 1 or self.param_extent is not None or self.shard.device != self.device:
            self._free_storage()
        self.state = UnitState.SHARDED

    def refresh(self) -> None:
        """After an optimizer step: bring a persistent unit's full buffer up to date."""
        if not self.persistent or self.world == 1 or self.numel == 0:
            return
        send = self.pool.acquire(self.shard_numel, self.dtype)
        send.copy_(self.shard)
        zdist.all_gather_into(self.full, send, group=self.group)
        self.pool.release(send)

    def _alloc_storage(self, mapped: torch.Tensor | None = None) -> None:
        cache = self.pool.gather_cache
        if mapped is not None:
            cache.lend_unmanaged(self.flat, mapped)
        elif cache is not None:
            self._lent = cache.lend(self.flat, self.gathered_bytes)
        else:
            self.flat.untyped_storage().resize_(self.gathered_bytes)
        self.pool.gathered.add(self.gathered_bytes)

    def _free_storage(self) -> None:
        self._mapped = False
        if self.flat.untyped_storage().nbytes():
            self.flat.untyped_storage().resize_(0)
            self.pool.gathered.sub(self.gathered_bytes)
        if self._lent is not None:
            self.pool.gather_cache.give_back(self._lent)
            self._lent = None

    def _point_params(self, flat: torch.Tensor) -> None:
        for s in self.slots:
            s.param.data = flat[s.offset : s.offset + s.numel].view(s.shape)
        self._placeholders = False

    def _empty_params(self) -> None:
        for s in self.slots:
            s.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self._placeholders = False

    # ------------------------------------------------------------------------------ grads
    def has_pending_grads(self) -> bool:
        return any(s.param.grad is not None for s in self.slots)

    def reduce_grads(self, sync: bool = True, hold: bool = False) -> None:
        """Move the parameters' gradients into this rank's gradient shard (averaged over ranks).

        With ``sync=False`` (inside ``no_sync()``) the full gradient is accumulated locally and
        reduced together with the next synchronized backward. With ``hold`` a gradient shard
        bound for NVMe stays in memory (``held_grad``) for an update that follows at once.
        """
        if not self.trainable:
            for s in self.slots:
                s.param.grad = None
            return
        for s in self.slots:
            if s.trainable and s.param.grad is not None:
                s.got_grad = True
        if self.world == 1 and sync and self.unreduced is None:
            self._add_into_shard_directly(hold)
            return
        flat = self._take_grads(self.pool)
        if not sync:
            if self.unreduced is None:
                self.unreduced = flat.clone()
            else:
                self.unreduced.add_(flat)
            self.pool.release(flat)
            return
        if self.unreduced is not None:
            flat.add_(self.unreduced)
            self.unreduced = None
        out = self.pool.acquire(self.shard_numel, torch.float32)
        zdist.reduce_scatter_avg(out, flat, group=self.group)
        self.pool.release(flat)
        if self.grad_extent is not None:
            self._accumulate_nvme(out, hold)
            return
        self._accumulate(self._grad_buffer(), out)
        self.pool.release(out)

    def _take_grads(self, pool: BufferPool) -> torch.Tensor:
        """Every parameter's gradient in its region of an fp32 buffer from ``pool`` (zeros
        where there is none and in the padding); the parameters' gradients are dropped."""
        flat = pool.acquire(self.padded_numel, torch.float32)
        for s in self.slots:
            g = s.param.grad
            region = flat[s.offset : s.offset + s.numel]
            region.copy_(g.reshape(-1)) if g is not None and s.trainable else region.zero_()
            s.param.grad = None
        flat[self.numel :].zero_()
        return flat

    @property
    def one_parameter(self) -> bool:
        """One parameter fills the flat buffer (an embedding at world size 1)."""
        return len(self.slots) == 1 and self.padded_numel == self.numel

    def _whole_grad(self) -> torch.Tensor | None:
        """The gradient of a ``one_parameter`` unit, taken as the flat gradient itself when
        it is a contiguous fp32 host tensor: no copy, and no second buffer of the largest
        size at the end of backward."""
        if not self.one_parameter:
            return None
        s = self.slots[0]
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

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_extent is not None:
            raise RuntimeError("the gradient shard of this unit is on NVMe")
        if self.grad_shard is None:
            # Pinned when an accelerator copies gradients into it.
            pin = self.grad_device.type == "cpu" and self.device.type != "cpu"
            self.grad_shard = torch.zeros(
                self.shard_numel, dtype=self.grad_dtype, device=self.grad_device, pin_memory=pin
            )
        return self.grad_shard

    def _add_into_shard_directly(self, hold: bool = False) -> None:
        # World 1: the shard is the whole flat buffer; no collective and no staging copy on
        # the device. Gradients bound for the host (NVMe, or an optimizer on the host) are
        # copied parameter by parameter into a (pinned) host buffer.
        if self.device.type != "cpu" and (
            self.grad_extent is not None or self.grad_device != self.device
        ):
            self._gradients_to_host()
            return
        if self.grad_extent is not None:
            whole = self._whole_grad() if hold else None
            if whole is not None:
                self._accumulate_nvme(whole, hold=True, pooled=False)
            else:
                self._accumulate_nvme(self._take_grads(self.host_pool), hold)
            return
        self._grad_buffer()
        first = self.grad_is_zero
        for s in self.slots:
            view = self.grad_shard[s.offset : s.offset + s.numel].view(s.shape)
            g = s.param.grad
            if g is not None and s.trainable:
                view.copy_(g) if first else view.add_(g)
            elif first:
                view.zero_()
            s.param.grad = None
        self.grad_is_zero = False

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
        dm = getattr(torch, self.device.type)
        current = dm.current_stream(self.device)
        stream = self.copy_stream or current
        if self.grad_extent is None and self.grad_dtype == torch.float32:
            flat = self._take_grads(self.pool)
            shard = self._grad_buffer()
            held = [flat]  # back to the pool once the copies are done
            if not self.grad_is_zero:
                held.append(self.pool.acquire(self.padded_numel, torch.float32))
            stream.wait_stream(current)
            with dm.stream(stream):
                if self.grad_is_zero:
                    shard.copy_(flat, non_blocking=True)
                else:
                    total = held[1]
                    total.copy_(shard, non_blocking=True)
                    total.add_(flat)
                    shard.copy_(total, non_blocking=True)
                event = stream.record_event()
            self._host_copy = (held, event, True)
            return
        staged = self.host_pool.acquire(self.padded_numel, self.dtype)
        stream.wait_stream(current)  # the gradients are computed
        with dm.stream(stream):
            for s in self.slots:
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
        staged[self.numel :].zero_()
        self._host_copy = (staged, event, False)

    def finish_host_copy(self) -> None:
        """Wait for this unit's gradients on their way to the host and add them in."""
        if self._host_copy is None:
            return
        staged, event, direct = self._host_copy
        self._host_copy = None
        event.synchronize()
        if direct:
            for buf in staged:  # the device buffers the shard was copied from and to
                self.pool.release(buf)
            self.grad_is_zero = False
            return
        if self.grad_extent is None:
            self._accumulate(self._grad_buffer(), staged)
            self.host_pool.release(staged)
            return
        if staged.dtype == torch.float32:
            self._accumulate_nvme(staged)
            return
        flat = self.host_pool.acquire(self.padded_numel, torch.float32)
        flat.copy_(staged)
        self.host_pool.release(staged)
        self._accumulate_nvme(flat)

    def _accumulate_nvme(
        self, values: torch.Tensor, hold: bool = False, pooled: bool = True
    ) -> None:
        """Add ``values`` (fp32, a pool buffer this call takes over, or with ``hold`` and not
        ``pooled`` a parameter's own gradient) to the gradient shard on NVMe: the first
        micro-batch is written while backward goes on; later ones read, add and write. With
        ``hold`` the sum stays in memory as ``held_grad`` instead of being written."""
        if self.grad_dtype != torch.float32:
            raise RuntimeError("gradient shards on NVMe are fp32")
        if values.device.type != "cpu":
            host = self.host_pool.acquire(values.numel(), torch.float32)
            host.copy_(values)  # device to host, blocking
            self.pool.release(values)
            values = host
        if not self.grad_is_zero:
            self.wait_writes()
            old = self.host_pool.acquire(self.shard_numel, torch.float32)
            self.grad_extent.file.read(old, self.grad_extent.offset).wait()
            values.add_(old)
            self.host_pool.release(old)
        if hold:
            self.held_grad = values  # the overlapped update reads it from memory
            self._held_pooled = pooled
            self.host_pool.held_grads.add(values.numel() * values.element_size())
            self.grad_is_zero = False
            return
        handle = self.grad_extent.file.write(values, self.grad_extent.offset)
        self.pool.writes.add(self._pending_writes, handle, values, self.host_pool.release)
        self.grad_is_zero = False

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device != dst.device:
            # Device to host (optimizer offload): through a pinned buffer, a blocking copy.
            host = self.host_pool.acquire(src.numel(), src.dtype)
            host.copy_(src)
            self._accumulate(dst, host)
            self.host_pool.release(host)
            return
        if self.grad_is_zero:
            dst.copy_(src)
            self.grad_is_zero = False
        else:
            dst.add_(src)

    def drop_held_grad(self) -> None:
        """Give back the gradient shard held for an overlapped update (once it is done)."""
        held, self.held_grad = self.held_grad, None
        if held is not None:
            self.host_pool.held_grads.sub(held.numel() * held.element_size())
            if self._held_pooled:
                self.host_pool.release(held)

    def zero_grad(self) -> None:
        self.finish_host_copy()  # its buffer goes back only once the copy is done
        if not self.update_pending:  # else the update drops it once done
            self.drop_held_grad()
        self.grad_is_zero = True
        self.unreduced = None
        for s in self.slots:
            s.param.grad = None
            s.got_grad = False

    # ------------------------------------------------------------------------- accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the unit, by kind (see memory report in the engine)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = nbytes(self.full) if self.persistent else nbytes(self.shard)
        master = 0 if self.master is self.shard else nbytes(self.master)
        grad_itemsize = torch.finfo(self.grad_dtype).bits // 8
        on_disk = self.grad_extent is not None
        return {
            "params": params,
            "master": master,
            # Steady state: the gradient shard exists from the first backward on.
            "grads": self.shard_numel * grad_itemsize if self.trainable and not on_disk else 0,
            "padding_elements": self.padded_numel - self.numel,
        }
