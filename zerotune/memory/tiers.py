"""Where a unit's shards live, and how they move: the tier layer.

[Note: memory tiers]
Every unit has three homes, chosen once by ``placement`` when the engine places it (and by
``zerotune estimate`` through the same function, so the plan and the engine agree):
- its compute-dtype parameter shard: device memory, host memory (``offload_param: cpu`` on an
  accelerator) or an extent of the parameter file (``nvme``);
- its fp32 master: the parameter shard itself (fp32 compute, same memory), a tensor of its own
  on the device or the host, an extent of the optim file, or, with fp32 compute and both tiers
  on NVMe, the parameter extent (the same numbers: ``"param_file"``);
- its gradient shard: device or host memory, or an extent of the gradient file.
The engine turns the parameter and gradient homes into tier objects, and the unit asks them
instead of asking where its shard is:
- ``params.fetch(unit, async_op)`` fills the unit's flat buffer: pointing at the shard (one
  rank, same memory), a copy in and an all-gather (memory), or a read (or a mapping) of the
  extent and an all-gather. It returns None once the buffer is filled, else a pending fetch
  whose ``wait()`` completes it.
- ``params.store`` / ``params.put`` bring a new compute-dtype shard home after a step or a
  checkpoint load (a copy, or an asynchronous / blocking write).
- ``grads.add`` adds a reduced fp32 gradient shard (copied, or added to what earlier
  micro-batches left; on NVMe read, added and written back, or held in memory for an
  overlapped update); ``grads.add_params`` takes the parameters' own gradients at world size
  1, where the shard is the whole flat gradient; ``grads.view`` / ``grads.read`` /
  ``grads.chunks`` hand a range of it to the optimizer.
Per-pass facts (whether the shard holds a gradient yet, a held shard, writes in flight) stay
with the unit; a tier holds only where the bytes are.

[Note: gradients left in the parameters]
At world size 1 a unit's shard is all of its parameters, so on a CPU (the optimizer in
memory or on NVMe) a gradient shard in memory, in the gradients' own dtype, needs no reduce
and no copy: the parameters' ``.grad`` tensors are the shard (``in_params``). Autograd
accumulates micro-batches into them, as it does for a plain model (``no_sync`` too),
``add_params`` only marks the shard as holding a gradient, and ``zero_grad`` drops them.
Readers take it through ``ranges`` and ``view``: one range per parameter, each a view of
that parameter's gradient (zeros for a parameter without one), so ZeroAdamW and the norm
read the gradients where they are. A reader that needs one tensor across parameters (a
generic optimizer's flat layout, the NVMe step's chunks, an 8-bit moment block spanning two
parameters, ``unit.grad_shard``) gets the flat shard: ``buffer`` allocates it, moves the
gradients in and drops theirs, and from then on the unit accumulates into it as any
``MemoryGrads`` does. So a reader never sees two copies of a gradient, and the cost of a
flat shard is paid only where a flat shard is read. On an accelerator the copy into the
flat shard is one cheap device copy, and the flat shard keeps the device's Adam at a few
kernel launches per unit rather than per parameter: it stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dist as zdist
from .aio import aligned_empty
from .pinned import pinned_empty

__all__ = [
    "GRAD_CHUNK",
    "DeviceParams",
    "HostParams",
    "MemoryGrads",
    "NvmeGrads",
    "NvmeParams",
    "Placement",
    "grad_read_numel",
    "master_in_param_file",
    "placement",
]

GRAD_CHUNK = 1 << 22  # elements per read of a gradient shard on NVMe by ``NvmeGrads.chunks``
_F32 = 4


def grad_read_numel(shard_numel: int) -> int:
    """Elements of the host buffer ``NvmeGrads.chunks`` reads a gradient shard of
    ``shard_numel`` elements through (``GRAD_CHUNK`` at a time)."""
    return min(GRAD_CHUNK, shard_numel)


def master_in_param_file(param_on_disk: bool, itemsize: int) -> bool:
    """Whether a unit's fp32 master lives in its parameter extent rather than in its optim
    extent: with fp32 compute and the shard on NVMe the two are the same numbers."""
    return param_on_disk and itemsize == _F32


@dataclass(frozen=True)
class Placement:
    """The homes of one unit's shards (see [Note: memory tiers]). ``params`` and ``grads``
    are ``"device"``, ``"host"`` or ``"nvme"``; ``master`` also ``"param_file"``. On a CPU
    device, ``"device"`` and ``"host"`` name the same memory. ``separate_master``: the
    master is a tensor of its own in memory (not the parameter shard)."""

    params: str
    master: str
    grads: str
    separate_master: bool

    @property
    def master_in_param_file(self) -> bool:
        return self.master == "param_file"


def placement(
    config,
    *,
    persistent: bool,
    numel: int,
    trainable: bool,
    itemsize: int,
    grads_on_disk: bool,
    device_type: str,
) -> Placement:
    """Where a unit's shards live under ``config``. ``grads_on_disk``: the swap plan puts
    gradient shards in a file (they exceed ``grad_host_bytes``)."""
    param_on_disk = config.offload_param == "nvme" and not persistent and numel > 0
    if param_on_disk:
        params = "nvme"
    elif config.offload_param == "cpu" and not persistent:
        params = "host"
    else:
        params = "device"
    lowp = itemsize != _F32
    if config.offload_optimizer == "nvme" and trainable:
        master = "param_file" if master_in_param_file(param_on_disk, itemsize) else "nvme"
        separate = False
    else:
        on_host = config.offload_optimizer == "cpu" or (not lowp and params == "host")
        master = "host" if on_host else "device"
        # fp32: the master is the parameter shard when both are in the same memory.
        same_memory = master == params or device_type == "cpu"
        separate = lowp or params == "nvme" or not same_memory
    if grads_on_disk and trainable:
        grads = "nvme"
    elif config.offload_optimizer != "none" or master == "host":
        grads = "host"  # the optimizer reads them there
    else:
        grads = "device"
    return Placement(params, master, grads, separate)


# ------------------------------------------------------------------------ parameter tiers
class _Gather:
    """An all-gather in flight; ``send`` (a pool buffer, or None) goes back once done."""

    def __init__(self, work, send, pool) -> None:
        self.work, self.send, self.pool = work, send, pool

    def wait(self, unit) -> None:
        self.work.wait()
        if self.send is not None:
            self.pool.release(self.send)


def _all_gather(unit, send: torch.Tensor, staged: bool, async_op: bool):
    unit.note_gather()
    work = zdist.all_gather_into(unit.flat, send, group=unit.group, async_op=async_op)
    if work is None:
        if staged:
            unit.pool.release(send)  # later work on this stream follows the collective
        return None
    return _Gather(work, send if staged else None, unit.pool)


class DeviceParams:
    """The shard in the compute device's memory. At world size 1 it is the whole flat buffer:
    a fetch only points the parameters at it."""

    kind = "device"
    mapped = False  # gathers map the parameter file (NvmeParams only)

    def fetch(self, unit, async_op: bool):
        if unit.world == 1:
            return None
        unit.alloc_storage()
        return _all_gather(unit, unit.shard, False, async_op)

    def lends_storage(self, unit) -> bool:
        """Whether the flat buffer's storage exists only while gathered."""
        return unit.world > 1

    def staged_for(self, unit, device: torch.device) -> bool:
        """Whether an update running on ``device`` writes the new shard into a buffer that
        ``store`` brings home (rather than into the shard itself)."""
        return unit.shard.device != device

    def store(self, unit, values: torch.Tensor, give_back=None) -> None:
        unit.shard.copy_(values)  # host to device, blocking: the buffer can go back now
        if give_back is not None:
            give_back(values)

    def put(self, unit, values: torch.Tensor) -> None:
        if unit.shard is not unit.master:
            unit.shard.copy_(values)

    def read(self, unit) -> torch.Tensor:
        """This rank's shard (the live tensor)."""
        return unit.shard


class HostParams(DeviceParams):
    """The shard in (pinned) host memory of an accelerator run: copied in on each gather."""

    kind = "host"

    def fetch(self, unit, async_op: bool):
        # The copy is ordered before the collective and the forward on this stream; the
        # host shard changes only in the optimizer step, after backward's gradient copies
        # to the host have synchronized with everything before them.
        unit.alloc_storage()
        if unit.world == 1:
            unit.flat.copy_(unit.shard, non_blocking=True)
            return None
        send = unit.pool.acquire(unit.shard_numel, unit.dtype)
        send.copy_(unit.shard, non_blocking=True)
        return _all_gather(unit, send, True, async_op)

    def lends_storage(self, unit) -> bool:
        return True


class _Read:
    """A read of the shard from its extent in flight, into ``tmp`` (then all-gathered, a copy
    at world size 1) or straight into the flat buffer (``tmp`` None)."""

    def __init__(self, handle, tmp) -> None:
        self.handle, self.tmp = handle, tmp

    def wait(self, unit) -> None:
        self.handle.wait()
        tmp, self.tmp = self.tmp, None
        if tmp is not None:
            if tmp.device != unit.device and unit.world > 1:
                tmp = tmp.to(unit.device)  # collectives run on the device
            unit.note_gather()
            zdist.all_gather_into(unit.flat, tmp, group=unit.group)


class NvmeParams:
    """The shard in an extent of the parameter file. With ``mapped`` a gather maps the
    file's pages (page cache) as the flat buffer instead of reading them: no copy and no
    buffer of its own, the readahead the mapping starts being the prefetch."""

    kind = "nvme"

    def __init__(self, extent, mapped: bool = False) -> None:
        self.extent, self.mapped = extent, mapped

    def fetch(self, unit, async_op: bool):
        unit.wait_writes()
        e = self.extent
        if self.mapped:
            unit.alloc_storage(e.file.map(e.offset, unit.gathered_bytes))
            return None
        unit.alloc_storage()
        if unit.world == 1 and unit.lends_aligned_storage():
            return _Read(e.file.read(unit.flat, e.offset), None)
        # A fresh aligned buffer, freed right after the gather: a pooled one would keep
        # prefetch-depth copies of the shards resident for good.
        tmp = aligned_empty(unit.shard_numel, unit.dtype)
        return _Read(e.file.read(tmp, e.offset), tmp)

    def lends_storage(self, unit) -> bool:
        return True

    def staged_for(self, unit, device: torch.device) -> bool:
        return True

    def store(self, unit, values: torch.Tensor, give_back=None) -> None:
        """Write ``values`` (an aligned host buffer) asynchronously; ``give_back(values)``
        runs once written. A gather waits for the write."""
        unit.keep_private()
        handle = self.extent.file.write(values, self.extent.offset)
        unit.pool.writes.add(unit.pending_writes, handle, values, give_back)

    def put(self, unit, values: torch.Tensor) -> None:
        staged = unit.host_pool.acquire(unit.shard_numel, unit.dtype)  # aligned for the file
        staged.copy_(values)
        self.store(unit, staged, give_back=unit.host_pool.release)
        unit.wait_writes()

    def read(self, unit) -> torch.Tensor:
        """This rank's shard, read from its extent into a tensor of its own."""
        unit.wait_writes()
        shard = aligned_empty(unit.shard_numel, unit.dtype)
        self.extent.file.read(shard, self.extent.offset).wait()
        return shard


# ------------------------------------------------------------------------- gradient tiers
class MemoryGrads:
    """The gradient shard in memory on ``device`` (the host when the optimizer runs there),
    allocated on the first gradient: building or evaluating a model holds none. With
    ``in_params`` it is first the parameters' own gradients (see [Note: gradients left in
    the parameters])."""

    on_disk = False

    def __init__(self, device: torch.device, in_params: bool = False) -> None:
        self.device = torch.device(device)
        self.shard: torch.Tensor | None = None
        self.in_params = in_params

    def keeps_params(self) -> bool:
        """Whether the parameters' ``.grad`` tensors are the shard now (no flat one yet)."""
        return self.in_params and self.shard is None

    def buffer(self, unit) -> torch.Tensor:
        """The flat shard, allocated on first use; gradients left in the parameters move
        into it (and stay there from now on)."""
        if self.shard is None:
            if self.device.type == "cpu" and unit.device.type != "cpu":
                # An accelerator copies gradients into it: pinned, of its own size ([Note:
                # exact-size pinned memory] in memory/pinned.py).
                self.shard = pinned_empty(unit.shard_numel, unit.grad_dtype).zero_()
            else:
                n, dtype = unit.shard_numel, unit.grad_dtype
                self.shard = torch.zeros(n, dtype=dtype, device=self.device)
            if self.in_params:
                self._take_params(unit, self.shard, first=True)
        return self.shard

    def flat(self, unit) -> torch.Tensor | None:
        """The shard as one tensor (None before the first gradient)."""
        if self.keeps_params():
            return None if unit.accumulator.is_zero else self.buffer(unit)
        return self.shard

    def add(self, unit, values: torch.Tensor, pool, hold: bool = False) -> None:
        """Add ``values`` (the unit's reduced shard, fp32) in; it goes back to ``pool``
        (None: not a pool buffer)."""
        dst = self.buffer(unit)
        if values.device != dst.device:
            # Device to host (optimizer offload): through a pinned buffer, a blocking copy.
            host = unit.host_pool.acquire(values.numel(), values.dtype)
            host.copy_(values)
            unit.accumulator.add_into(dst, host)
            unit.host_pool.release(host)
        else:
            unit.accumulator.add_into(dst, values)
        if pool is not None:
            pool.release(values)

    def add_params(self, unit, hold: bool = False) -> None:
        """World size 1, the shard in the gradients' memory: each parameter's gradient is
        added into its region, with no staging buffer (or, with ``in_params``, left where
        autograd put it)."""
        if not self.keeps_params():
            self._take_params(unit, self.buffer(unit), first=unit.accumulator.is_zero)
        unit.accumulator.mark_added()

    @staticmethod
    def _take_params(unit, shard: torch.Tensor, first: bool) -> None:
        """Each parameter's gradient copied (``first``) or added into its region of
        ``shard``, and dropped from the parameter."""
        for s in unit.slots:
            view = shard[s.offset : s.offset + s.numel].view(s.shape)
            g = s.param.grad
            if g is not None and s.trainable:
                view.copy_(g) if first else view.add_(g)
            elif first:
                view.zero_()
            s.param.grad = None

    def ranges(self, unit) -> list[tuple[int, int]]:
        """Ranges covering the shard that ``view`` hands out without a copy."""
        if self.keeps_params():
            return [(s.offset, s.offset + s.numel) for s in unit.slots]
        return [(0, unit.shard_numel)]

    def view(self, unit, c0: int, c1: int) -> torch.Tensor:
        if self.keeps_params():
            for s in unit.slots:
                if s.offset <= c0 and c1 <= s.offset + s.numel:
                    g = s.param.grad if s.trainable else None
                    if g is None:  # no gradient: zeros, as in a flat shard
                        return torch.zeros(c1 - c0, dtype=unit.grad_dtype, device=self.device)
                    return g.reshape(-1)[c0 - s.offset : c1 - s.offset]
        return self.buffer(unit)[c0:c1]  # a range across parameters: the flat shard

    def chunks(self, unit):
        for c0, c1 in self.ranges(unit):
            yield c0, c1, self.view(unit, c0, c1)

    def resident_bytes(self, unit) -> int:
        """Bytes in memory in the steady state (the shard exists from the first backward)."""
        return unit.shard_numel * (torch.finfo(unit.grad_dtype).bits // 8) if unit.trainable else 0


class NvmeGrads:
    """The gradient shard in an extent of the gradient file, in the unit's gradient dtype
    (fp32, or bf16/fp16 at half the bytes on disk and in every transfer). The first
    micro-batch is written while backward goes on; later ones read, add in fp32, round and
    write, as a low-precision shard in memory adds. An overlapped update takes the final
    shard from memory (``unit.accumulator.held``, in the same dtype) instead of a round
    trip."""

    on_disk = True

    def __init__(self, extent) -> None:
        self.extent = extent

    def add(self, unit, values: torch.Tensor, pool, hold: bool = False) -> None:
        """Add ``values`` (fp32; a buffer of ``pool``, or with ``hold`` and ``pool`` None a
        parameter's own gradient) to the shard; with ``hold`` the sum stays in memory as
        ``unit.accumulator.held`` instead of being written."""
        if values.device.type != "cpu":
            host = unit.host_pool.acquire(values.numel(), torch.float32)
            host.copy_(values)  # device to host, blocking
            pool.release(values)
            values, pool = host, unit.host_pool
        if not unit.accumulator.is_zero:
            unit.wait_writes()
            old = unit.host_pool.acquire(unit.shard_numel, unit.grad_dtype)
            self.extent.file.read(old, self.extent.offset).wait()
            values.add_(old)
            unit.host_pool.release(old)
        unit.accumulator.mark_added()
        if unit.grad_dtype != values.dtype:
            rounded = unit.host_pool.acquire(values.numel(), unit.grad_dtype)
            rounded.copy_(values)
            if pool is not None:
                pool.release(values)
            values, pool = rounded, unit.host_pool
        if hold:
            unit.accumulator.hold(values, pooled=pool is not None)
            return
        self.write(unit, values, pool.release)

    def write(self, unit, values: torch.Tensor, give_back) -> None:
        """Start writing the whole shard ``values`` (in the gradient dtype);
        ``give_back(values)`` once written (None: nothing to give back)."""
        if values.dtype != unit.grad_dtype:
            raise TypeError(f"a {unit.grad_dtype} gradient file, given {values.dtype} values")
        handle = self.extent.file.write(values, self.extent.offset)
        unit.pool.writes.add(unit.pending_writes, handle, values, give_back)

    def add_params(self, unit, hold: bool = False) -> None:
        """World size 1: the parameters' gradients in one host buffer (or, held for an
        overlapped update, a lone parameter's own gradient: no copy) added to the shard."""
        whole = unit.accumulator.whole() if hold else None
        if whole is not None:
            self.add(unit, whole, None, hold=True)
        else:
            self.add(unit, unit.accumulator.take(unit.host_pool), unit.host_pool, hold)

    def keeps_params(self) -> bool:
        return False

    def ranges(self, unit) -> list[tuple[int, int]]:
        return [(0, unit.shard_numel)]

    def view(self, unit, c0: int, c1: int) -> torch.Tensor | None:
        """The range in memory (a held shard), or None: ``read`` it."""
        return None if unit.accumulator.held is None else unit.accumulator.held[c0:c1]

    def read(self, unit, c0: int, c1: int, dst: torch.Tensor):
        """Start reading elements ``[c0, c1)`` into ``dst`` (in the gradient dtype); returns
        the I/O handle. The caller has waited for the unit's writes in flight
        (``unit.wait_writes``)."""
        return self.extent.file.read(dst, self.extent.offset + c0 * unit.grad_dtype.itemsize)

    def chunks(self, unit):
        """(start, stop, values) over the shard, read ``GRAD_CHUNK`` elements at a time
        into one host buffer (valid until the next chunk)."""
        if unit.accumulator.held is not None:
            yield 0, unit.shard_numel, unit.accumulator.held
            return
        unit.wait_writes()
        buf = unit.host_pool.acquire(grad_read_numel(unit.shard_numel), unit.grad_dtype)
        try:
            for c0 in range(0, unit.shard_numel, GRAD_CHUNK):
                c1 = min(c0 + GRAD_CHUNK, unit.shard_numel)
                part = buf[: c1 - c0]
                self.read(unit, c0, c1, part).wait()
                yield c0, c1, part
        finally:
            unit.host_pool.release(buf)

    def resident_bytes(self, unit) -> int:
        return 0
