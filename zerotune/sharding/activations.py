"""Offloaded activation checkpoints (``ZeroConfig.offload_activations``).

[Note: activation checkpoint offload]
What moves. With activation checkpointing a block keeps only its tensor inputs from forward
to backward and recomputes the rest. Both kinds of ``torch.utils.checkpoint`` save those
inputs through autograd's saved tensors, under the ``saved_tensors_hooks`` active *around*
the checkpoint call: reentrant checkpointing with ``ctx.save_for_backward`` in
``CheckpointFunction.forward`` (whose body runs under ``no_grad``, so it saves nothing else);
non-reentrant checkpointing in ``_CheckpointFrame.save_inputs``, before it pushes its own
hooks, which take every tensor saved inside the block (the innermost hooks win). Hooks pushed
around exactly the checkpoint call therefore see exactly the block inputs, in both modes.

Where the hooks go. HF layers checkpoint through ``self._gradient_checkpointing_func``, an
attribute that ``gradient_checkpointing_enable()`` sets on every layer instance. At each
training forward the engine wraps that attribute on the instances that hold one (so a later
``gradient_checkpointing_enable()`` is picked up) and ``remove_hooks`` puts the originals back:
nothing global is patched. Pushing the hooks from the units' forward hooks instead would
break models that checkpoint ``module.__call__``: the hooks would then run inside the
checkpoint and take over every save of the block. Other models call
``engine.checkpoint(function, *args)``.

[Note: checkpoint records and their swap file]
``pack`` returns a ``_Saved`` record that autograd keeps until it frees the graph
(after backward, or when the outputs are dropped without one) and unpacks in backward. A
record frees its swap extent or host copy when it is collected, so nothing outlives its graph
and the swap file is reused step after step. A tensor saved by several blocks (a shared
mask) is moved once: while the same tensor object (same version) has a live record, later
saves get that record.

Swap file: ``activations*.swap`` in this rank's swap folder (the engine's, or one made the
same way: 0700, files 0600, removed at ``close()``). Extents are 4 KiB-aligned, from a
first-fit free list. Its size is not known before the first forward: a full file gets another
segment (at least the size of the ones before, after a free-space check), and at the next
forward with no live record the segments are merged into one file of their total size.

[Note: checkpoint tiers]
* nvme: the tensor is copied into a 4 KiB-aligned host buffer (pinned, by the side stream, on
  an accelerator; the write starts once that copy is done) and written to the swap file
  asynchronously. At most ``WRITES_IN_FLIGHT`` writes are in flight (a new one first waits
  for the oldest), so the checkpoint bytes held in memory during forward are bounded by that,
  not by the number of blocks; the end of a training forward waits for the last writes and
  drops the staging buffers, so between forward and backward no checkpoint is left there.
* cpu with an accelerator: a ``non_blocking`` copy into pinned host memory on a side stream;
  the caching allocator keeps the source until the copy is done (``record_stream``).
* cpu with a host compute device: nothing to move (logged once); the records only count bytes.
A copy keeps the tensor's strides (a non-reentrant recompute of a block given a transposed
input must take the paths the forward took, or torch's checkpoint refuses its saved tensors). A
tensor with gaps or overlaps between its elements (a slice, an expanded mask) stays where it is,
as in the no-op tier; a record that holds its tensor checks at unpack that it was not changed in
place since (the check autograd skips when saved-tensor hooks are set).
Backward: unpacking a record starts bringing back the ``PREFETCH`` records saved before it,
nearest first (a file read into a fresh aligned buffer, then a host-to-device copy on the side
stream), so the transfer for block k-1 overlaps block k's recompute and backward; the end of
a training forward starts the newest. The accelerator paths use the device-agnostic
stream API; on a CUDA GPU they give the same bits as keeping the checkpoints
(tests/test_gpu.py).
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import shutil
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import dist as zdist
from ..config import ConfigError
from ..memory.pool import ByteCounter
from .hooks import in_backward

if TYPE_CHECKING:
    from .engine import ZeroEngine

__all__ = ["CheckpointOffload"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

WRITES_IN_FLIGHT = 2  # NVMe writes of checkpoints in flight (each holds one host copy)
PREFETCH = 2  # checkpoints brought back ahead of their backward
_ALIGN = 4096
_MARK = "_zerotune_offload_wrapper"


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of its storage without gaps or overlaps (a
    contiguous layout, its dimensions maybe permuted): a copy can then keep its strides."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Saved:
    """One saved checkpoint tensor, wherever it lives now (see the Note)."""

    __slots__ = (
        "__weakref__",
        "dtype",
        "event",
        "extent",
        "host",
        "nbytes",
        "offload",
        "on_device",
        "read",
        "restored",
        "seq",
        "shape",
        "stride",
        "tensor",
        "version",
        "write",
    )

    def __init__(self, offload: CheckpointOffload, seq: int, t: torch.Tensor):
        self.offload = offload
        self.seq = seq
        self.shape = t.shape
        self.stride = t.stride()
        self.version = t._version
        self.dtype = t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.on_device = True  # counted in device_bytes (still on it, or its copy in flight)
        self.tensor: torch.Tensor | None = None  # still on the compute device (no-op tier)
        self.host: torch.Tensor | None = None  # host copy (cpu tier, or nvme staging)
        self.event = None  # device-to-host copy done (accelerator)
        self.extent: tuple[Any, int] | None = None  # (swap file, offset)
        self.write = None  # pending write: (handle, staging buffer)
        self.read = None  # pending read: (handle, buffer)
        self.restored: torch.Tensor | None = None  # back on the compute device

    def __del__(self) -> None:
        self.offload.free(self)

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """The bytes of ``flat`` (uint8, ``nbytes`` long) as this tensor: same dtype, shape and
        strides (the recompute of a non-reentrant checkpoint must take the same paths)."""
        return flat.view(self.dtype).as_strided(self.shape, self.stride)


@dataclass
class _Segment:
    """One swap file of the activation swap space."""

    file: Any  # memory.aio.SwapFile
    free: list[tuple[int, int]]  # (offset, length), sorted by offset
    used: int = 0  # bytes in extents handed out


class _SwapExtents:
    """4 KiB-aligned extents in one or more swap-file segments of this rank's folder."""

    def __init__(self, folder, config):
        self.folder = folder
        self.config = config
        self.segments: list[_Segment] = []
        self._names = itertools.count()

    @property
    def file_bytes(self) -> int:
        return sum(seg.file.size for seg in self.segments)

    @property
    def used_bytes(self) -> int:
        return sum(seg.used for seg in self.segments)

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """(swap file, offset) of a new extent of ``nbytes`` (first fit; grows when full)."""
        length = _round_up(max(nbytes, 1))
        fitting = [s for s in self.segments if any(size >= length for _, size in s.free)]
        # A full space gets a segment at least as large as all before: the total stays
        # within twice the most ever live.
        seg = fitting[0] if fitting else self._grow(max(length, self.file_bytes, 1 << 20))
        i = next(i for i, (_, size) in enumerate(seg.free) if size >= length)
        offset, size = seg.free[i]
        if size == length:
            seg.free.pop(i)
        else:
            seg.free[i] = (offset + length, size - length)
        seg.used += length
        return seg.file, offset

    def free(self, file, offset: int, nbytes: int) -> None:
        length = _round_up(max(nbytes, 1))
        for seg in self.segments:
            if seg.file is file:
                free = seg.free
                i = bisect.bisect(free, (offset, 0))
                free.insert(i, (offset, length))
                # Merge with the following and the preceding free extents.
                if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
                    free[i] = (offset, length + free.pop(i + 1)[1])
                if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                    free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])
                seg.used -= length
                return

    def merge(self) -> None:
        """Replace several segments by one file of their total size (nothing may be live)."""
        if len(self.segments) < 2 or self.used_bytes:
            return
        total = self.file_bytes
        self.close()
        self._grow(total)

    def _grow(self, nbytes: int) -> _Segment:
        from ..memory.aio import SwapFile

        nbytes = _round_up(nbytes)
        free = shutil.disk_usage(self.folder).free
        if nbytes > free:
            raise OSError(
                errno.ENOSPC,
                f"nvme_path has {free / 2**20:.1f} MiB free; offloaded activation checkpoints "
                f"need {nbytes / 2**20:.1f} MiB more (offload_activations='nvme')",
                str(self.folder),
            )
        n = next(self._names)
        path = self.folder / ("activations.swap" if n == 0 else f"activations-{n}.swap")
        cfg = self.config
        f = SwapFile(
            path,
            nbytes,
            threads=cfg.aio_threads,
            block_bytes=cfg.aio_block_bytes,
            queue_depth=cfg.aio_queue_depth,
            direct=True,
        )
        seg = _Segment(f, [(0, f.size)])
        self.segments.append(seg)
        log.debug("zerotune: activation swap segment %s, %d bytes", path, f.size)
        return seg

    def close(self) -> None:
        for seg in self.segments:
            seg.file.close()
            seg.file.path.unlink(missing_ok=True)
        self.segments = []


class CheckpointOffload:
    """Moves activation checkpoints off the compute device; see [Note: activation checkpoint
    offload]. Made by ``ZeroEngine`` when ``offload_activations`` is not ``none``."""

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.mode = engine.config.offload_activations
        self.device = engine.device
        self.accelerated = self.device.type != "cpu"
        self._lock = threading.RLock()  # records may die on an autograd device thread
        self._seq = itertools.count()
        self._live: dict[int, weakref.ref] = {}  # seq -> record, in save order
        self._by_tensor: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._writes: deque = deque()  # records whose NVMe write is pending, oldest first
        self._staging: dict[int, list[torch.Tensor]] = {}  # free CPU staging buffers by size
        self._calls = 0  # checkpointed calls in the current forward
        self._wrapped: dict[int, tuple[nn.Module, Any]] = {}  # id(module) -> (module, original)
        self.device_bytes = ByteCounter()  # checkpoint bytes held on the compute device
        self.offloaded_bytes = ByteCounter()  # checkpoint bytes held off it (host or file)
        self.restored_bytes = ByteCounter()  # bytes brought back for backward, not yet freed
        self.saved = 0  # tensors saved (after dedup), for reports
        self.moves = self.mode == "nvme" or (self.mode == "cpu" and self.accelerated)
        if not self.moves:
            log.info(
                "zerotune: offload_activations='cpu' moves nothing here: the compute device "
                "is the host, so activation checkpoints already live in host memory (their "
                "bytes are still counted in memory_report)"
            )
        if self.accelerated:
            dm = torch.get_device_module(self.device.type)
            self._dm = dm
            self._stream = dm.Stream(device=self.device)
        self.space = None
        self._own_space = False
        self.extents: _SwapExtents | None = None
        if self.mode == "nvme":
            space = engine.swap
            if space is None:
                from ..memory.swap import SwapSpace

                space = SwapSpace(engine.config.nvme_path, {}, engine.config, engine.group)
                self._own_space = True
            self.space = space
            self.extents = _SwapExtents(space.dir, engine.config)
        model = engine.module
        self._candidates = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward),
            model.register_forward_hook(self._post_forward, always_call=True),
        ]

    # ------------------------------------------------------------------ wrapping checkpoints
    @torch.compiler.disable  # dynamo does not trace the hooks: a compiled block runs it eagerly
    def checkpoint(self, checkpoint_fn, function, *args, **kwargs):
        """Run ``checkpoint_fn(function, *args, **kwargs)`` with its saved inputs offloaded."""
        self._calls += 1
        if not torch.is_grad_enabled() or in_backward():
            return checkpoint_fn(function, *args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint_fn(function, *args, **kwargs)

    def _wrap_layers(self) -> None:
        for module in self._candidates:
            fn = module.__dict__.get("_gradient_checkpointing_func")
            if fn is None or getattr(fn, _MARK, False):
                continue

            def wrapper(function, *args, _original=fn, **kwargs):
                return self.checkpoint(_original, function, *args, **kwargs)

            setattr(wrapper, _MARK, True)
            self._wrapped[id(module)] = (module, fn)
            module._gradient_checkpointing_func = wrapper

    def _pre_forward(self, module, args) -> None:
        if in_backward():
            return
        self._wrap_layers()
        self._calls = 0
        if self.extents is not None:
            with self._lock:
                if not self._live:
                    self.extents.merge()

    def _post_forward(self, module, args, output) -> None:
        if in_backward() or not torch.is_grad_enabled() or not module.training:
            return
        # Always called: ``output`` is None when the forward raised. Its error is the one to
        # see, and no backward follows (nothing to bring back).
        raised = output is None
        if self._calls == 0 and not raised:
            # transformers 5.2x renamed the method; the old name warns there.
            name = "activation_checkpointing_enable"
            if not hasattr(module, name):
                name = "gradient_checkpointing_enable"
            raise ConfigError(
                f"offload_activations={self.mode!r} needs activation checkpointing, but this "
                f"training forward checkpointed no block: call model.{name}() (Hugging Face "
                "models) or run blocks through engine.checkpoint(block, *inputs)"
            )
        # Between forward and backward no checkpoint stays on the device: the last writes
        # finish (the device has the loss to compute meanwhile), and the newest comes back.
        while self._writes:
            self._finish_write(self._writes[0])
        self._staging.clear()  # made again next forward; backward needs the room
        if not raised:
            with torch.no_grad():
                self._prefetch_before(None)

    def remove(self) -> None:
        """Take the hooks off and put the original checkpoint functions back."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, fn in self._wrapped.values():
            if getattr(module.__dict__.get("_gradient_checkpointing_func"), _MARK, False):
                module._gradient_checkpointing_func = fn
        self._wrapped.clear()

    # -------------------------------------------------------------------- pack and unpack
    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device.type != self.device.type:
            return t  # parameters have their own tiers; other devices have nothing to free
        if self.mode == "nvme":
            # Room first: a new write waits for the oldest beyond WRITES_IN_FLIGHT.
            while self._writes and (
                len(self._writes) >= WRITES_IN_FLIGHT or self._writes[0].write[0].done()
            ):
                self._finish_write(self._writes[0])
        with self._lock:
            known = self._by_tensor.get(id(t))
            if known is not None:
                tensor_ref, version, record_ref = known
                record = record_ref()
                if tensor_ref() is t and version == t._version and record is not None:
                    return record
            record = _Saved(self, next(self._seq), t)
            self._live[record.seq] = weakref.ref(record)
            self._by_tensor[id(t)] = (weakref.ref(t), t._version, weakref.ref(record))
            self.saved += 1
            self.device_bytes.add(record.nbytes)
        if not self.moves or not _dense(t):
            # Kept where it is (as without offload): nothing to move, or a tensor with gaps
            # or overlaps between its elements (an expanded mask, a slice), whose copy could
            # not have its strides.
            record.tensor = t
            return record
        with torch.no_grad():  # the copies are data moves, not part of the graph
            if self.mode == "cpu":
                self._copy_to_host(record, t)
            else:
                self._write(record, t)
        return record

    def _unpack(self, record):
        if not isinstance(record, _Saved):
            return record
        if record.tensor is not None:
            if record.tensor._version != record.version:
                # What autograd checks itself when no saved-tensor hooks are set.
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: [{record.tensor.type()} "
                    f"{list(record.shape)}] is at version {record.tensor._version}; expected "
                    f"version {record.version} instead (a block input saved by activation "
                    "checkpointing, offload_activations)"
                )
            return record.tensor
        with torch.no_grad():
            if record.restored is None:
                self._restore(record)
            self._prefetch_before(record.seq)
        return self._ready(record)

    # --------------------------------------------------------------------------- moving
    def _host_empty(self, nbytes: int) -> torch.Tensor:
        """An aligned host buffer of ``nbytes`` bytes (pinned when an accelerator copies)."""
        from ..memory.aio import aligned_empty

        if self.accelerated:
            buf = torch.empty(_round_up(nbytes), dtype=torch.uint8, pin_memory=True)
            if buf.data_ptr() % _ALIGN == 0:
                return buf[:nbytes]
        return aligned_empty(nbytes, torch.uint8)

    def _copy_to_host(self, record: _Saved, t: torch.Tensor) -> None:
        """Start the device-to-host copy of ``t`` into ``record.host`` (side stream)."""
        host = self._host_empty(record.nbytes)
        view = record.shaped(host)
        self._stream.wait_stream(self._dm.current_stream(self.device))
        with self._dm.stream(self._stream):
            view.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # its memory is kept until the copy is done
            record.event = self._stream.record_event()
        record.host = host
        with self._lock:
            self.offloaded_bytes.add(record.nbytes)
        self._reap_copies()

    def _reap_copies(self) -> None:
        """Count device-to-host copies that have finished as off the device."""
        with self._lock:
            for ref in list(self._live.values()):
                record = ref()
                if (
                    record is not None
                    and record.on_device
                    and record.restored is None
                    and record.event is not None
                    and record.event.query()
                ):
                    record.event = None
                    self._off_device(record)

    def _off_device(self, record: _Saved) -> None:
        with self._lock:
            if record.on_device:
                record.on_device = False
                self.device_bytes.sub(record.nbytes)

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A free staging buffer of ``nbytes`` rounded up to 4 KiB, whole: buffers are kept
        by that size, and a later tensor of the same size class may be a few bytes larger."""
        size = _round_up(nbytes)
        free = self._staging.get(size)
        if free:
            return free.pop()
        return self._host_empty(size)

    def _write(self, record: _Saved, t: torch.Tensor) -> None:
        """Copy ``t`` to a host staging buffer and start writing it to the swap file."""
        with self._lock:
            try:
                record.extent = self.extents.alloc(record.nbytes)
            except BaseException:
                # No room (the forward fails): the record holds nothing to bring back, and
                # may outlive the forward in its traceback; no later save or prefetch sees it.
                self._live.pop(record.seq, None)
                self._by_tensor.pop(id(t), None)
                raise
            self.offloaded_bytes.add(record.nbytes)
        whole = self._staging_buffer(record.nbytes)
        buf = whole[: record.nbytes]
        view = record.shaped(buf)
        if self.accelerated:
            self._stream.wait_stream(self._dm.current_stream(self.device))
            with self._dm.stream(self._stream):
                view.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            self._stream.synchronize()  # the file write reads the host buffer
            self._off_device(record)  # on the host now; the write needs no device memory
        else:
            view.copy_(t)
        file, offset = record.extent
        record.write = (file.write(buf, offset), whole)
        self._writes.append(record)

    def _finish_write(self, record: _Saved) -> None:
        handle, whole = record.write
        handle.wait()
        record.write = None
        self._writes.remove(record)
        if not self.accelerated:  # pinned buffers go back to torch's caching host allocator
            self._staging.setdefault(whole.numel(), []).append(whole)
        self._off_device(record)  # on the CPU the staging copy was compute-device memory

    def _restore(self, record: _Saved) -> None:
        """Start bringing ``record`` back to the compute device (``record.restored``)."""
        self._off_device(record)  # a device-to-host copy still in flight ends before this one
        if record.write is not None:
            self._finish_write(record)  # read after write
        if record.extent is not None:
            from ..memory.aio import aligned_empty

            if self.accelerated:
                buf = self._host_empty(record.nbytes)
            else:
                buf = aligned_empty(record.nbytes, torch.uint8)
            file, offset = record.extent
            record.read = (file.read(buf, offset), buf)
            host = buf
        else:
            host = record.host
        if self.accelerated:
            if record.read is not None:
                record.read[0].wait()
                record.read = None
            dev = torch.empty_strided(
                record.shape, record.stride, dtype=record.dtype, device=self.device
            )
            # dev's memory may still be read by earlier work of the current stream.
            self._stream.wait_stream(self._dm.current_stream(self.device))
            with self._dm.stream(self._stream):
                dev.copy_(record.shaped(host), non_blocking=True)
                dev.record_stream(self._stream)  # freed unread: kept until the copy is done
                record.event = self._stream.record_event()
            record.restored = dev
        else:
            record.restored = record.shaped(host)
        with self._lock:
            self.restored_bytes.add(record.nbytes)

    def _ready(self, record: _Saved) -> torch.Tensor:
        """``record.restored``, once its transfer is done, usable on the current stream."""
        if record.read is not None:
            record.read[0].wait()
            record.read = None
        if self.accelerated and record.event is not None:
            current = self._dm.current_stream(self.device)
            current.wait_event(record.event)
            record.restored.record_stream(current)
            record.event = None
        return record.restored

    def _prefetch_before(self, seq: int | None) -> None:
        """Start restoring the ``PREFETCH`` live records saved just before ``seq``, nearest
        first (None: only the newest, at the end of forward)."""
        with self._lock:
            if seq is None:
                keys = list(self._live)[-1:]
            else:
                keys = [k for k in self._live if k < seq][-PREFETCH:]
            chosen = [self._live[k]() for k in reversed(keys)]
        for record in chosen:
            if record is not None and record.tensor is None and record.restored is None:
                self._restore(record)

    def free(self, record: _Saved) -> None:
        """A record died (autograd freed its graph): give back what it held."""
        # A record with a pending write is held by self._writes, so it cannot die before.
        with self._lock:
            self._live.pop(record.seq, None)
            if record.read is not None:
                record.read[0].wait()
            if record.on_device:
                self.device_bytes.sub(record.nbytes)
            if record.host is not None or record.extent is not None:
                self.offloaded_bytes.sub(record.nbytes)
            if record.extent is not None and self.extents is not None:
                file, offset = record.extent
                self.extents.free(file, offset, record.nbytes)
            if record.restored is not None:
                self.restored_bytes.sub(record.nbytes)
            for key, (_, _, ref) in list(self._by_tensor.items()):
                if ref() is None or ref() is record:
                    del self._by_tensor[key]

    # ------------------------------------------------------------------------- reporting
    def memory_report(self) -> dict[str, int]:
        """Checkpoint bytes: on the compute device (now, peak), offloaded (now, peak),
        restored for backward (peak), and the activation swap file's size."""
        if self.accelerated:
            self._reap_copies()
        return {
            "checkpoints_device": self.device_bytes.now,
            "checkpoints_device_peak": self.device_bytes.peak,
            "checkpoints_offloaded": self.offloaded_bytes.now,
            "checkpoints_offloaded_peak": self.offloaded_bytes.peak,
            "checkpoints_restored_peak": self.restored_bytes.peak,
            "checkpoints_file": self.extents.file_bytes if self.extents is not None else 0,
        }

    def reset_peaks(self) -> None:
        """Start the peaks over from the bytes held now."""
        for c in (self.device_bytes, self.offloaded_bytes, self.restored_bytes):
            c.peak = c.now

    def close(self) -> None:
        """Finish pending writes and remove the activation swap files."""
        while self._writes:
            self._finish_write(self._writes[0])
        if self.extents is not None:
            self.extents.close()
        if self._own_space and self.space is not None:
            self.space.close()
