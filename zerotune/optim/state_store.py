"""Where the optimizer's per-unit state lives during a step: memory, or NVMe in chunks.

[Note: optimizer state stores]
The optimizer asks a store for (master, exp_avg, exp_avg_sq, grad) of a chunk of a unit's
shard, updates it in place and gives it back. ``ResidentStore`` (no offload, or cpu) hands
out views of tensors held in memory: one chunk per unit, nothing to move. ``NvmeStore``
keeps each unit's fp32 master, exp_avg and exp_avg_sq in the rank's optim swap file, three
4 KiB-aligned regions per unit, and streams the step through a pipeline: while one chunk is
updated by the C++ Adam, the next ones are read and the last ones written back. Chunks are
bounded so that ``OptimLayout.slots`` chunk sets (up to eight; three with 8-bit moments)
fit in ``staging_bytes``, whatever the size of the largest unit;
in an overlapped step the spare slots read ahead of backward (see [Note: reading ahead of
backward]).

With fp32 compute and the parameters on NVMe too, the unit's parameter extent already
holds the fp32 shard, which is the master: the optim extent then has two regions (the
moments), and the step reads and writes the master chunk in the parameter file. That file
is buffered (the gathers of forward and backward read it through the page cache), so the
master read is a copy from the page cache instead of a disk read, and the new parameters
need no second write: per parameter and step the optimizer moves 8 bytes each way through
O_DIRECT plus 4 each way through the page cache, against 12 + 12 + 4 with the master in
the optim extent. With fp32
moments the master is not even copied: the update runs on the page-cache pages themselves
(see [Note: the master updated in the page cache]). Otherwise (8-bit moments,
``map_param_file: false``, or where that note says) the master chunk is read into staging
and written back, and a gather of the unit waits for that write (``Unit.param_file_writes``).

[Note: the master updated in the page cache]
With fp32 moments the master is not copied through staging: the chunk's range of the
parameter file is mapped shared and writable (rounded out to 2 MiB boundaries, so that huge
pages map whole; only the chunk's own pages are filled and written) and the C++ Adam updates
the master there, in place, while the moments come and go through staging with O_DIRECT.
The kernel writes the dirty pages back when it likes, as after a ``pwrite``. Before the
update the unit gives up a copy-on-write gather still mapping those pages
(``Unit.keep_private``) and waits for earlier writes of its parameter extent. The result is
bit-identical to the copying path: the same kernel on the same values.
The mapping is filled in one call, ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14), one fault
per page-cache folio (2 MiB, see [Note: huge page-cache pages] in memory/swap.py) instead of
a trap per 4 KiB page on first write; a disk error reading a page comes back from it as an
exception instead of SIGBUS. Pages the page cache gave up (host memory short) would be read
by that call synchronously, so they are asked for (``SwapFile.will_need``) when the chunk's
moments are read, and come in alongside. A kernel without the call (EINVAL), or a filesystem
that refuses shared mappings, gets the copying path for the chunks started from then on,
logged once; ``map_param_file: false`` chooses it from the start. Unlike the copy, an update
that fails halfway leaves the segments before it updated in the file while their moments are
not written; a failed step is not one to go on from either way.

[Note: 8-bit moments in the state stores]
With 8-bit moments (see [Note: 8-bit optimizer states] in quant8.py) a quantized unit's
moments are codes and absmax values. ``ResidentStore`` then works in chunks of
``_Q8_CHUNK`` elements.
On NVMe a quantized unit's extent is a sequence of chunk records, one per chunk of
``OptimLayout.q8_chunk`` elements, each 4 KiB-aligned and moved in one read and one write:
``[master fp32 | exp_avg absmax | exp_avg_sq absmax | exp_avg codes | exp_avg_sq codes]``,
about 6 bytes per element instead of 12. When the parameter file holds the master (fp32
compute, parameters on NVMe) the record has no master: ``[absmax | absmax | codes | codes]``,
about 2 bytes per element through O_DIRECT, and the master chunk moves through the page
cache as it does for fp32 moments. In staging the master then takes its own 4 KiB-rounded
region ahead of the record, so the record's read and write start on an aligned address.
The stores hand the optimizer a chunk's moments as they are (``Q8Moments`` views of the
codes and absmax values); on the CPU the C++ op updates them in one pass per block of 256
(see [Note: fused 8-bit step] in csrc/adam/cpu_adam.cpp). Elsewhere (CUDA, or no C++ op)
the optimizer dequantizes the chunk into a scratch buffer it reuses within a step
(``Scratch``, 8 bytes per element of a chunk, let go at the end of the step), updates and
quantizes it back; ``OptimLayout.scratch_bytes`` keeps room for that buffer within
``staging_bytes``. The estimate assumes the one-pass op and does not count it.
"""

from __future__ import annotations

import errno
import logging
import mmap
from dataclasses import dataclass

import torch

from ..memory.aio import aligned_empty
from ..memory.swap import ALIGN, HUGE, round_up
from .pipeline import IDLE, Entry, Feed, StepPipeline, UpdateThread, gate_writes
from .quant8 import MOMENTS, Q8Moments, blocks, quantized, require_bitsandbytes

__all__ = [
    "IDLE",
    "Feed",
    "NvmeStore",
    "OptimLayout",
    "ResidentStore",
    "StepPipeline",
    "chunk_elements",
    "record_bytes",
    "write_initial_state",
]

_F32 = 4
_MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module names it from 3.13 on)
log = logging.getLogger(__name__)
_Q8_CHUNK = 1 << 20  # elements per chunk of a quantized unit held in memory
_MIN_CHUNK = ALIGN // _F32  # chunks are multiples of this: fp32 offsets stay 4 KiB-aligned
MAX_SLOTS = 8  # staging slots of the fp32 step pipeline, at most


def _fp32_element_bytes(grad_on_disk: bool) -> int:
    """Staging bytes per element of a chunk of fp32 state: master, two moments, and the
    gradient when it is read from disk."""
    return 3 * _F32 + (_F32 if grad_on_disk else 0)


def chunk_elements(staging_bytes: int, grad_on_disk: bool, slots: int) -> int:
    """Elements per chunk of fp32 optimizer state when ``slots`` chunk sets fill
    ``staging_bytes``."""
    n = staging_bytes // (slots * _fp32_element_bytes(grad_on_disk))
    n -= n % _MIN_CHUNK
    if n <= 0:
        raise ValueError(f"staging_bytes={staging_bytes:,} is too small to stream optimizer state")
    return n


def fp32_slots(staging_bytes: int, grad_on_disk: bool) -> int:
    """How many staging slots the fp32 step pipeline cuts ``staging_bytes`` into:
    ``MAX_SLOTS`` (reads of the units backward finishes next start early in the spare
    ones, see [Note: reading ahead of backward] in pipeline.py) unless that leaves chunks
    under a page, and never fewer than three (read, update, write)."""
    for slots in range(MAX_SLOTS, 3, -1):
        if staging_bytes // (slots * _fp32_element_bytes(grad_on_disk)) >= _MIN_CHUNK:
            return slots
    return 3


def record_bytes(n: int, with_master: bool = True) -> int:
    """Bytes of one NVMe chunk record of ``n`` elements of a quantized unit (before 4 KiB
    rounding): fp32 master (unless the parameter file holds it), two absmax arrays, two
    code arrays."""
    return (_F32 * n if with_master else 0) + 2 * _F32 * blocks(n) + 2 * n


def _record_start(n: int, with_master: bool) -> int:
    """Where the record starts in its staging buffer: at 0, or (master in the parameter
    file) after the master's own 4 KiB-rounded region, so that the record's O_DIRECT
    transfer starts on an aligned address."""
    return 0 if with_master else round_up(_F32 * n)


def record_buffer_bytes(n: int, with_master: bool = True) -> int:
    """Staging bytes a chunk record of ``n`` elements takes in the step (see
    ``_record_start``)."""
    return _record_start(n, with_master) + round_up(record_bytes(n, with_master))


@dataclass(frozen=True)
class OptimLayout:
    """How one rank streams optimizer state through staging slots (NVMe): chunk sizes,
    slot and scratch bytes, and the optim swap extent of each unit."""

    bits: int
    grads_on_disk: bool
    chunk: int  # elements per chunk of a unit with fp32 moments
    q8_chunk: int  # elements per chunk of a quantized unit (0 at 32 bits)
    slot_bytes: int  # bytes per staging slot
    scratch_bytes: int  # fp32 moments of the chunk in the update, within staging_bytes
    slots: int  # staging slots the step pipeline uses (reads ahead, update, writes)

    @classmethod
    def plan(cls, staging_bytes: int, grads_on_disk: bool, bits: int = 32) -> OptimLayout:
        """The layout for ``staging_bytes``: at 32 bits ``fp32_slots`` slots, at 8 bits three
        slots and the scratch of one chunk. Raises ValueError when not even the smallest
        chunk fits."""
        kinds = 4 if grads_on_disk else 3
        if bits == 32:
            slots = fp32_slots(staging_bytes, grads_on_disk)
            chunk = chunk_elements(staging_bytes, grads_on_disk, slots)
            return cls(bits, grads_on_disk, chunk, 0, round_up(kinds * chunk * _F32), 0, slots)

        def slot(c: int) -> int:
            grad = round_up(c * _F32) if grads_on_disk else 0
            # A slot also holds a whole chunk of a unit with fp32 moments (>= one page each).
            # The split form (master in the parameter file) is the larger of the two.
            return max(record_buffer_bytes(c, with_master=False) + grad, kinds * ALIGN)

        def need(c: int) -> int:
            return 3 * slot(c) + 2 * c * _F32

        per_element = 3 * (6 + (_F32 if grads_on_disk else 0)) + 2 * _F32
        c = staging_bytes // per_element
        c -= c % _MIN_CHUNK
        while c > 0 and need(c) > staging_bytes:
            c -= _MIN_CHUNK
        if c <= 0:
            raise ValueError(
                f"staging_bytes={staging_bytes:,} is too small to stream 8-bit optimizer state"
            )
        s = slot(c)
        chunk = s // (kinds * _F32)
        chunk -= chunk % _MIN_CHUNK
        return cls(bits, grads_on_disk, chunk, c, s, 2 * c * _F32, 3)

    def quantized(self, unit_numel: int) -> bool:
        return quantized(unit_numel, self.bits)

    def chunks(self, unit_numel: int, shard: int) -> list[tuple[int, int]]:
        """(start, stop) of the chunks of a shard of ``shard`` elements."""
        step = self.q8_chunk if self.quantized(unit_numel) else self.chunk
        return [(c0, min(c0 + step, shard)) for c0 in range(0, shard, step)]

    def extent_bytes(self, unit_numel: int, shard: int, with_master: bool = True) -> int:
        """Bytes of the unit's optim extent: three fp32 regions (two when the master is in
        the parameter file), or the chunk records (with or without the master)."""
        if not self.quantized(unit_numel):
            return (3 if with_master else 2) * round_up(shard * _F32)
        return sum(
            round_up(record_bytes(c1 - c0, with_master))
            for c0, c1 in self.chunks(unit_numel, shard)
        )

    def touched_bytes(self, unit_numel: int, shard: int, with_master: bool = True) -> int:
        """Bytes of a staging slot that the unit's largest chunk fills (``with_master``:
        the master is in the optim extent, not the parameter file)."""
        c0, c1 = self.chunks(unit_numel, shard)[0]
        grad = (c1 - c0) * _F32 if self.grads_on_disk else 0
        if self.quantized(unit_numel):
            return record_buffer_bytes(c1 - c0, with_master) + grad
        return 3 * round_up((c1 - c0) * _F32) + grad


def state_specs(unit, is_q8: bool) -> list[tuple[str, torch.dtype, int]]:
    """(key, dtype, elements) of what ``read_unit`` returns for ``unit``, in order."""
    n = unit.shard_numel
    if not is_q8:
        return [("master", torch.float32, n)] + [(k, torch.float32, n) for k in MOMENTS]
    out = [("master", torch.float32, n)]
    for k in MOMENTS:
        out += [(f"{k}.q8", torch.uint8, n), (f"{k}.absmax", torch.float32, blocks(n))]
    return out


def state_numels(unit, is_q8: bool) -> dict[str, int]:
    """Keys ``write_unit`` accepts for ``unit`` and their element counts: fp32 moments
    always (a quantized unit quantizes them), the quantized ones for a quantized unit."""
    out = {k: n for k, _, n in state_specs(unit, False)}
    if is_q8:
        out.update({k: n for k, _, n in state_specs(unit, True)})
    return out


def _check_moment_keys(state: dict) -> None:
    for k in MOMENTS:
        if k in state and f"{k}.q8" in state:
            raise ValueError(f"give either {k} (fp32) or {k}.q8 with its absmax, not both")
        if (f"{k}.q8" in state) != (f"{k}.absmax" in state):
            raise ValueError(f"{k}.q8 and {k}.absmax go together")


class Scratch:
    """fp32 moments of the quantized chunk being updated without the fused op: one buffer,
    grown to the largest chunk and reused through a step (one chunk is updated at a time;
    memory made and freed per chunk costs page faults and zeroing, about as much again as
    the work); ``release`` lets it go."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def moments(self, n: int, device) -> dict[str, torch.Tensor]:
        buf = self.buf
        if buf is None or buf.numel() < 2 * n or buf.device != torch.device(device):
            self.buf = buf = None  # free the old one first
            self.buf = buf = torch.empty(2 * n, dtype=torch.float32, device=device)
        half = buf.numel() // 2
        return {MOMENTS[0]: buf[:n], MOMENTS[1]: buf[half : half + n]}

    def release(self) -> None:
        self.buf = None


class ResidentStore:
    carries = False  # nothing to wait for: an overlapped step finishes in step()

    def __init__(self, units, bits: int = 32):
        self.thread: UpdateThread | None = None  # where updates run off the calling thread
        self.moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.q8: dict[int, Q8Moments] = {}
        for u in units:
            if quantized(u.numel, bits):
                self.q8[u.index] = Q8Moments.zeros(u.shard_numel, u.master.device)
            else:
                self.moments[u.index] = (torch.zeros_like(u.master), torch.zeros_like(u.master))
        if self.q8:
            require_bitsandbytes()

    def reset_moments(self, units) -> None:
        """Nothing to do: the moments live in this store, which goes with its optimizer."""

    def chunks(self, unit):
        n = unit.shard_numel
        if unit.index not in self.q8:
            return unit.grads.ranges(unit)
        return [(c0, min(c0 + _Q8_CHUNK, n)) for c0 in range(0, n, _Q8_CHUNK)]

    def pipeline(self, feed, update, begin=None):
        """``run`` over a :class:`Feed`, as a generator: it waits for nothing but the
        units' own writes and for more work (``IDLE``). With ``begin`` (``update`` split in
        two, see ``UpdateThread.run``) the arithmetic runs on the store's update thread."""
        feed = Feed.of(feed)
        if begin is not None:
            if self.thread is None:
                self.thread = UpdateThread()
            return self.thread.run(feed, lambda item: begin(*self.chunk_views(*item)))
        return self._pipeline(feed, update)

    def _pipeline(self, feed, update):
        while (item := feed.take()) is not None or not feed.closed:
            if item is None:
                yield IDLE
                continue
            yield from gate_writes(item[0])
            self.run([item], update)

    def run(self, items, update) -> None:
        for item in items:
            update(*self.chunk_views(*item))

    def chunk_views(self, unit, c0: int, c1: int) -> tuple:
        """``(unit, c0, c1, master, moments, grad)`` of a chunk, views into memory."""
        master, grad = unit.master[c0:c1], unit.grads.view(unit, c0, c1)
        q8 = self.q8.get(unit.index)
        if q8 is None:
            m, v = self.moments[unit.index]
            return unit, c0, c1, master, (m[c0:c1], v[c0:c1]), grad
        return unit, c0, c1, master, q8.slice(c0, c1), grad

    def state_specs(self, unit) -> list[tuple[str, torch.dtype, int]]:
        return state_specs(unit, unit.index in self.q8)

    def state_numels(self, unit) -> dict[str, int]:
        return state_numels(unit, unit.index in self.q8)

    def read_unit(self, unit, master_only: bool = False) -> dict[str, torch.Tensor]:
        q8 = self.q8.get(unit.index)
        if master_only:
            return {"master": unit.master}
        if q8 is not None:
            return {"master": unit.master, **q8.as_state()}
        m, v = self.moments[unit.index]
        return {"master": unit.master, "exp_avg": m, "exp_avg_sq": v}

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        _check_moment_keys(state)
        q8 = self.q8.get(unit.index)
        if "master" in state:
            unit.master.copy_(state["master"].reshape(-1))
        if q8 is None:
            m, v = self.moments[unit.index]
            for key, live in (("exp_avg", m), ("exp_avg_sq", v)):
                if key in state:
                    live.copy_(state[key].reshape(-1))
            return
        live = q8.as_state()
        for key, value in state.items():
            if key in live:
                live[key].copy_(value.reshape(-1))
        device = unit.master.device
        given = {k: state[k].reshape(-1).to(device, torch.float32) for k in MOMENTS if k in state}
        q8.quantize(given)

    def nbytes(self) -> int:
        f32 = sum(m.numel() * m.element_size() * 2 for m, _ in self.moments.values())
        return f32 + sum(q.nbytes() for q in self.q8.values())


def _fp32_locations(swap, layout: OptimLayout, unit, c0: int) -> list[tuple[object, int]]:
    """(file, offset) of element ``c0`` of the unit's master, exp_avg and exp_avg_sq."""
    optim = swap.files["optim"]
    base = swap.extent("optim", unit.index).offset
    region = round_up(unit.shard_numel * _F32)
    if unit.placement.master_in_param_file:
        p = unit.params.extent
        return [(p.file, p.offset + c0 * _F32)] + [
            (optim, base + k * region + c0 * _F32) for k in range(2)
        ]
    return [(optim, base + k * region + c0 * _F32) for k in range(3)]


def _record_offset(swap, layout: OptimLayout, unit, c0: int) -> int:
    """File offset of the chunk record starting at element ``c0`` of a quantized unit."""
    stride = round_up(record_bytes(layout.q8_chunk, not unit.placement.master_in_param_file))
    return swap.extent("optim", unit.index).offset + (c0 // layout.q8_chunk) * stride


def _record_views(
    buf: torch.Tensor, n: int, with_master: bool = True
) -> tuple[torch.Tensor, Q8Moments]:
    """The fp32 master and quantized moments inside a staging buffer holding a record of
    ``n`` elements, laid out as ``record_buffer_bytes`` says (see [Note: optimizer state
    stores])."""
    b = blocks(n)
    master = buf[: _F32 * n].view(torch.float32)
    at = _record_start(n, with_master) + (_F32 * n if with_master else 0)
    absmax, q = {}, {}
    for k in MOMENTS:
        absmax[k] = buf[at : at + _F32 * b].view(torch.float32)
        at += _F32 * b
    for k in MOMENTS:
        q[k] = buf[at : at + n]
        at += n
    return master, Q8Moments(q, absmax)


def write_initial_state(unit, swap, staging, layout: OptimLayout) -> None:
    """At construction: the unit's fp32 master (unless the parameter file holds it) and
    zero moments go to the optim swap file; the unit keeps no fp32 master in memory from
    then on."""
    f = swap.files["optim"]
    q8 = layout.quantized(unit.numel)
    with_master = not unit.placement.master_in_param_file
    for c0, c1 in layout.chunks(unit.numel, unit.shard_numel):
        if q8:
            nbytes = round_up(record_bytes(c1 - c0, with_master))
            held = staging.acquire(nbytes)
            buf = held[:nbytes]
            buf.zero_()  # zero absmax: the moments start at zero
            if with_master:
                master, _ = _record_views(buf, c1 - c0)
                master.copy_(unit.master[c0:c1])
            f.write(buf, _record_offset(swap, layout, unit, c0)).wait()
            staging.release(held)
            continue
        nbytes = round_up((c1 - c0) * _F32)
        held = staging.acquire(nbytes)
        buf = held[:nbytes]
        f32 = buf.view(torch.float32)
        locations = _fp32_locations(swap, layout, unit, c0)
        if with_master:
            f32.zero_()
            f32[: c1 - c0].copy_(unit.master[c0:c1])
            file, off = locations[0]
            file.write(buf, off).wait()
        f32.zero_()
        for file, off in locations[1:]:
            file.write(buf, off).wait()
        staging.release(held)
    unit.drop_master()


class NvmeStore:
    carries = True  # an overlapped step's updates may run on into the next forward
    previews = True  # rows of fp32 moments can be read on their own (read_moment_ranges)

    def __init__(self, swap, staging, layout: OptimLayout, in_place: bool = True):
        self.swap, self.staging, self.layout = swap, staging, layout
        self.bytes_read = 0
        self.bytes_written = 0
        # See [Note: the master updated in the page cache].
        self.in_place = in_place
        if layout.bits == 8:
            require_bitsandbytes()

    @property
    def slots(self) -> int:
        """Chunks in staging at once (see [Note: reading ahead of backward] in
        pipeline.py)."""
        return self.layout.slots

    def is_quantized(self, unit) -> bool:
        return self.layout.quantized(unit.numel)

    def chunks(self, unit):
        return self.layout.chunks(unit.numel, unit.shard_numel)

    def _file(self):
        return self.swap.files["optim"]

    def reset_moments(self, units) -> None:
        """Zero moments in the engine's optim file for ``units``, as at construction: the
        file outlives this optimizer, and the next one over the engine starts from it."""
        for unit in units:
            zeros = torch.zeros(unit.shard_numel, dtype=torch.float32)
            self.write_unit(unit, {k: zeros for k in MOMENTS})

    def updates_in_place(self, unit) -> bool:
        """Whether the step updates ``unit``'s master in the parameter file's pages (see
        [Note: the master updated in the page cache])."""
        return self.in_place and not self.is_quantized(unit) and unit.placement.master_in_param_file

    def _pieces(self, unit, c0: int, c1: int, buf: torch.Tensor, in_place: bool = False) -> list:
        """(part of ``buf``, file, offset) for each region of the chunk's optimizer state;
        the state takes the first bytes of ``buf``. A master in the parameter file (buffered
        I/O) moves exactly its bytes: the rest of that page belongs to the next extent's.
        ``in_place``: the master does not move (its region of ``buf`` stays unused)."""
        if self.is_quantized(unit):
            n, with_master = c1 - c0, not unit.placement.master_in_param_file
            start = _record_start(n, with_master)
            record = buf[start : record_buffer_bytes(n, with_master)]
            pieces = [(record, self._file(), _record_offset(self.swap, self.layout, unit, c0))]
            if with_master:
                return pieces
            p = unit.params.extent
            return [(buf[: n * _F32], p.file, p.offset + c0 * _F32), *pieces]
        nbytes = round_up((c1 - c0) * _F32)
        out = []
        for k, (file, off) in enumerate(_fp32_locations(self.swap, self.layout, unit, c0)):
            if in_place and k == 0:
                continue
            size = (c1 - c0) * _F32 if file is not self._file() else nbytes
            out.append((buf[k * nbytes : k * nbytes + size], file, off))
        return out

    # ----------------------------------------------------------------------- the step
    def _state_bytes(self, unit, c0: int, c1: int) -> int:
        """Bytes of a slot the chunk's master and optimizer state take (its gradient, when
        read from its file, comes after them)."""
        n = c1 - c0
        if self.is_quantized(unit):
            return record_buffer_bytes(n, not unit.placement.master_in_param_file)
        return 3 * round_up(n * _F32)

    def acquire(self, nbytes: int) -> torch.Tensor:
        return self.staging.acquire(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        self.staging.release(buf)

    def start(self, item) -> Entry:
        """Acquire a slot and issue the reads of the chunk's master and state (its
        gradient comes with ``attach_grad``, once the unit's gradient is final)."""
        unit, c0, c1 = item
        n = c1 - c0
        state_bytes = self._state_bytes(unit, c0, c1)
        grad_room = n * unit.grad_dtype.itemsize if unit.grads.on_disk else 0
        buf = self.acquire(state_bytes + grad_room)
        in_place = self.updates_in_place(unit)
        if in_place:  # its pages, should the page cache have dropped them
            p = unit.params.extent
            p.file.will_need(p.offset + c0 * _F32, n * _F32)
        pieces = self._pieces(unit, c0, c1, buf, in_place)
        handles = [file.read(part, off) for part, file, off in pieces]
        self.bytes_read += sum(part.numel() for part, _, _ in pieces)
        return Entry(item, buf, state_bytes, pieces, handles, in_place)

    def _populate(self, mapping, at: int, nbytes: int, path, offset: int) -> None:
        """Fill the page tables of ``mapping[at : at + nbytes]`` (a file's bytes from
        ``offset + at``) for writing in one call (see [Note: the master updated in the
        page cache]); a kernel without the call makes this store copy from now on."""
        try:
            mapping.madvise(_MADV_POPULATE_WRITE, at, nbytes)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # the pages could not be read
                where = f"{nbytes} bytes at offset {offset + at}"
                raise OSError(exc.errno, f"{path}: cannot map {where} ({exc.strerror})") from None
            self._copy_from_now_on("no MADV_POPULATE_WRITE on this kernel")

    def _copy_from_now_on(self, why: str) -> None:
        """Chunks started from now on read and write the master through staging."""
        if self.in_place:
            self.in_place = False
            log.info(
                "zerotune: %s; the optimizer copies the fp32 master through staging instead "
                "of updating it in place",
                why,
            )

    def views(self, entry: Entry):
        """The chunk's fp32 master and optimizer state (``update``'s arguments) in its slot:
        two fp32 moments, or a :class:`Q8Moments`."""
        unit, c0, c1 = entry.item
        n, buf = c1 - c0, entry.buf
        if self.is_quantized(unit):
            return _record_views(buf, n, not unit.placement.master_in_param_file)
        f32 = buf.view(torch.float32)
        stride = entry.state_bytes // 3 // _F32
        master, m, v = (f32[j * stride : j * stride + n] for j in range(3))
        return master, (m, v)

    def update_in_place(self, update, unit, c0: int, c1: int, moments, grad) -> None:
        """``update`` with the chunk's master in the parameter file's pages (see [Note: the
        master updated in the page cache])."""
        p = unit.params.extent
        start, nbytes = p.offset + c0 * _F32, (c1 - c0) * _F32
        lo = start // HUGE * HUGE  # other units' bytes around it are mapped, not touched
        hi = min(round_up(start + nbytes, HUGE), p.file.size)
        for handle in unit.param_file_writes:  # an earlier write of these bytes goes first
            handle.wait()
        unit.keep_private()  # a gather mapping these pages must not see them change
        try:
            mapping = p.file.map_shared(lo, hi - lo)
        except OSError as exc:  # a filesystem without shared mappings: copy from now on
            self._copy_from_now_on(f"{p.file.path} cannot be mapped shared ({exc.strerror})")
            master = aligned_empty(c1 - c0, torch.float32)
            p.file.read(master, start).wait()
            update(unit, c0, c1, master, moments, grad)
            p.file.write(master, start).wait()
            return
        try:
            at, n = start - lo, c1 - c0
            page = at // mmap.PAGESIZE * mmap.PAGESIZE
            end = round_up(at + nbytes, mmap.PAGESIZE)
            self._populate(mapping, page, end - page, p.file.path, lo)
            master = torch.frombuffer(mapping, dtype=torch.float32, offset=at, count=n)
            update(unit, c0, c1, master, moments, grad)
            del master
        finally:
            try:
                mapping.close()
            except BufferError:  # a view outlived the update (an exception's frames)
                pass

    def attach_grad(self, entry: Entry) -> None:
        """The chunk's gradient: a view of the shard held in memory, or a read from the
        gradient file into the slot after the state."""
        unit, c0, c1 = entry.item
        entry.grad = unit.grads.view(unit, c0, c1)
        if entry.grad is None:
            nbytes = (c1 - c0) * unit.grad_dtype.itemsize
            dst = entry.buf[entry.state_bytes : entry.state_bytes + nbytes].view(unit.grad_dtype)
            entry.handles.append(unit.grads.read(unit, c0, c1, dst))
            self.bytes_read += nbytes
            entry.grad = dst

    def run(self, items, update) -> None:
        for handle in self.pipeline(items, update):
            handle.wait()

    def pipeline(self, feed, update):
        """``run`` over a :class:`Feed`, as a generator (a :class:`StepPipeline`): before
        waiting for an I/O handle that is not done yet it yields it, so a caller can do
        other work and resume later (see [Note: overlapped step] in zero_adam.py);
        resuming waits for that handle. An open feed with nothing to update yields
        ``IDLE`` once the writes in flight are done."""
        return StepPipeline(self, Feed.of(feed), update).run()

    def abandon(self, held) -> None:
        """Wait for the I/O of each ``(handles, buf)`` and give the buffers back, dropping
        the I/O errors: the data is not used (given up, or a failed pipeline on its way
        out with its own error)."""
        for handles, buf in held:
            for h in handles:
                try:
                    h.wait()
                except OSError:
                    pass
            self.release(buf)

    def finish_write(self, entry) -> None:
        """Wait for a chunk's writes ``(handles, buf)`` and give its slot back."""
        handles, buf = entry
        for h in handles:
            h.wait()
        self.release(buf)

    def read_moment_ranges(self, unit, ranges: list[tuple[int, int]]):
        """exp_avg and exp_avg_sq (fp32 moments) of the shard element ranges ``[a, b)``,
        sorted: lists of tensors, one per range and moment. Whole pages are read, once per
        run of ranges whose pages touch (the optim file is O_DIRECT); the caller makes sure
        nothing writes them meanwhile (see [Note: looked-up rows before their update] in
        zero_adam.py)."""
        _, (optim, m_off), (_, v_off) = _fp32_locations(self.swap, self.layout, unit, 0)[-3:]
        spans: list[list] = []  # [first page byte, end byte, [ranges]]
        for a, b in ranges:
            lo, hi = (a * _F32) // ALIGN * ALIGN, round_up(b * _F32)
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
                spans[-1][2].append((a, b))
            else:
                spans.append([lo, hi, [(a, b)]])
        handles, views = [], ([], [])
        for lo, hi, members in spans:
            for off, out in ((m_off, views[0]), (v_off, views[1])):
                buf = aligned_empty(hi - lo, torch.uint8)
                handles.append(optim.read(buf, off + lo, urgent=True))  # a lookup waits
                f32 = buf.view(torch.float32)
                first = lo // _F32
                out.extend(f32[a - first : b - first] for a, b in members)
            self.bytes_read += 2 * (hi - lo)
        for h in handles:
            h.wait()
        return views

    # ------------------------------------------------------------------ whole-unit I/O
    def state_specs(self, unit) -> list[tuple[str, torch.dtype, int]]:
        return state_specs(unit, self.is_quantized(unit))

    def state_numels(self, unit) -> dict[str, int]:
        return state_numels(unit, self.is_quantized(unit))

    def read_unit(self, unit, master_only: bool = False) -> dict[str, torch.Tensor]:
        """The unit's state; ``master_only``: the fp32 master alone, without reading the
        moments where they lie apart from it (fp32 moments)."""
        n = unit.shard_numel
        if self.is_quantized(unit):
            master = torch.empty(n, dtype=torch.float32)
            q8 = Q8Moments.zeros(n, "cpu")
            with_master = not unit.placement.master_in_param_file
            for c0, c1 in self.chunks(unit):
                held = self.staging.acquire(record_buffer_bytes(c1 - c0, with_master))
                for part, file, off in self._pieces(unit, c0, c1, held):
                    file.read(part, off).wait()
                m, q = _record_views(held, c1 - c0, with_master)
                master[c0:c1].copy_(m)
                q8.slice(c0, c1).copy_(q)
                self.staging.release(held)
            return {"master": master} if master_only else {"master": master, **q8.as_state()}
        keys = ("master",) if master_only else ("master", *MOMENTS)
        out = {k: torch.empty(n, dtype=torch.float32) for k in keys}
        for c0, c1 in self.chunks(unit):
            nbytes = round_up((c1 - c0) * _F32)
            held = self.staging.acquire(nbytes)
            buf = held[:nbytes]
            for key, (file, off) in zip(out, _fp32_locations(self.swap, self.layout, unit, c0)):
                file.read(buf, off).wait()
                out[key][c0:c1].copy_(buf.view(torch.float32)[: c1 - c0])
            self.staging.release(held)
        return out

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        _check_moment_keys(state)
        if self.is_quantized(unit):
            self._write_records(unit, state)
            return
        keys = ("master", *MOMENTS)
        if "master" in state and unit.placement.master_in_param_file:
            unit.keep_private()  # a unit mapping that file must not see the change
        for c0, c1 in self.chunks(unit):
            nbytes = round_up((c1 - c0) * _F32)
            held = self.staging.acquire(nbytes)
            buf = held[:nbytes]
            f32 = buf.view(torch.float32)
            for key, (file, off) in zip(keys, _fp32_locations(self.swap, self.layout, unit, c0)):
                if key not in state:
                    continue
                f32.zero_()
                f32[: c1 - c0].copy_(state[key].reshape(-1)[c0:c1])
                part = buf if file is self._file() else buf[: (c1 - c0) * _F32]
                file.write(part, off).wait()
            self.staging.release(held)

    def _write_records(self, unit, state: dict[str, torch.Tensor]) -> None:
        """Read, patch and write back each chunk record of a quantized unit: fp32 moments
        are quantized per chunk (chunks start on block boundaries, so this equals
        quantizing the whole shard). A master in the parameter file is written only when
        given."""
        flat = {k: v.reshape(-1) for k, v in state.items()}
        with_master = not unit.placement.master_in_param_file
        if "master" in flat and not with_master:
            unit.keep_private()  # a unit mapping that file must not see the change
        for c0, c1 in self.chunks(unit):
            held = self.staging.acquire(record_buffer_bytes(c1 - c0, with_master))
            pieces = self._pieces(unit, c0, c1, held)
            for part, file, off in pieces:
                if file is self._file():  # a master in the parameter file is not kept
                    file.read(part, off).wait()
            master, q8 = _record_views(held, c1 - c0, with_master)
            if "master" in flat:
                master.copy_(flat["master"][c0:c1])
            given = Q8Moments.from_state(flat, partial=True).slice(c0, c1)
            q8.copy_(given)
            q8.quantize({k: flat[k][c0:c1].float() for k in MOMENTS if k in flat})
            for part, file, off in pieces:
                if file is self._file() or "master" in flat:
                    file.write(part, off).wait()
            self.staging.release(held)

    def nbytes(self) -> int:
        return 0  # nothing resident: see the swap space and staging in the memory report
