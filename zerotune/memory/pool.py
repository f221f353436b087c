"""A pool of flat buffers reused for the whole run (ZeRO-R's constant-size buffers).

Reduce and staging buffers are taken from here and given back, so after the first step the
engine allocates nothing new for them: memory neither fragments nor grows with the number of
steps. Buffers are keyed by (numel, dtype); units of the same shape share them.

Gathered parameters cannot share one buffer: autograd keeps views of them from forward to
backward, so each unit keeps its own flat tensor and only empties and refills its storage (see
[Note: flat layout] in sharding/unit.py). Their bytes are counted in ``gathered``. On the CPU
the memory that refills a storage comes from ``GatherCache``: reused buffers lent to the
unit's storage ([Note: lending storage] in csrc/aio/aio.cpp), instead of fresh memory that
the kernel page-faults and zeroes on every gather.
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch

from .host import free_lazily

__all__ = [
    "WRITES_IN_FLIGHT",
    "WRITE_BYTES_IN_FLIGHT",
    "BufferPool",
    "ByteCounter",
    "GatherCache",
    "WriteQueue",
    "buffers_writing",
]

WRITES_IN_FLIGHT = 2  # NVMe writes the engine's queue keeps in flight
WRITE_BYTES_IN_FLIGHT = 128 * 2**20  # ... and the bytes they may hold beyond the newest


def buffers_writing(
    nbytes: int, limit: int = WRITES_IN_FLIGHT, limit_bytes: int = WRITE_BYTES_IN_FLIGHT
) -> int:
    """Buffers of ``nbytes`` alive at once when each goes to NVMe through a ``WriteQueue``
    of ``limit`` and ``limit_bytes``: the writes it keeps in flight plus one filling."""
    in_flight = 1
    while in_flight < limit and (in_flight + 1) * nbytes <= limit_bytes:
        in_flight += 1
    return in_flight + 1


class WriteQueue:
    """NVMe writes in flight: adding one finishes the oldest (waits for it and gives its
    buffer back) while more than ``limit`` are in flight or, beyond the newest, they hold
    more than ``limit_bytes``. This bounds the buffers writes keep alive (``buffers_writing``)."""

    def __init__(self, limit: int = WRITES_IN_FLIGHT, limit_bytes: int = WRITE_BYTES_IN_FLIGHT):
        self.limit = limit
        self.limit_bytes = limit_bytes
        self._entries: deque = deque()
        self._bytes = 0

    def add(self, owner: list, handle, buf, give_back) -> None:
        entry = [handle, buf, give_back, False]
        owner.append(entry)
        while self._entries and self._entries[0][3]:  # finished by their unit meanwhile
            self._entries.popleft()
        self._entries.append(entry)
        self._bytes += buf.numel() * buf.element_size()
        while len(self._entries) > 1 and (
            len(self._entries) > self.limit or self._bytes > self.limit_bytes
        ):
            self.finish(self._entries.popleft())

    def finish(self, entry) -> None:
        handle, buf, give_back, done = entry
        if done:
            return
        entry[3] = True
        entry[1] = None  # the queue may hold the entry a while longer: not its buffer
        self._bytes -= buf.numel() * buf.element_size()
        handle.wait()
        if give_back is not None:
            give_back(buf)


class ByteCounter:
    """Bytes held now and at most, for one kind of memory."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        self.now -= n


class GatherCache:
    """Host buffers for gathered parameters, lent to the units' storages and reused.

    A buffer given back is kept for the next gather of the same size while the kept bytes
    stay within ``keep_bytes`` (set by the engine from the unit sizes and the prefetch
    budget); beyond that it is freed. Buffers are 4 KiB aligned, so NVMe reads can land in
    a lent storage directly.
    """

    def __init__(self, lend) -> None:
        self._lend = lend  # the aio op's lend_storage(dst, src, nbytes)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.keep_bytes = 0
        self.kept_bytes = 0
        self.peak_kept_bytes = 0
        self.allocations = 0  # buffers made (not reused) since the cache was created

    @classmethod
    def create(cls, device: torch.device) -> GatherCache | None:
        """A cache for CPU parameters when the C++ aio op is built, else None (storages are
        then refilled with ``resize_``)."""
        if device.type != "cpu":
            return None  # accelerator allocators cache freed blocks themselves
        from .aio import load_aio_op

        op = load_aio_op()
        return cls(op.lend_storage) if op is not None else None

    def lend(self, flat: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Point ``flat``'s (empty) storage at a buffer of ``nbytes``; returns the buffer,
        to be given back once the storage is emptied again."""
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.kept_bytes -= nbytes
        else:
            from .aio import aligned_empty

            buf = aligned_empty(nbytes, torch.uint8)
            self.allocations += 1
        self._lend(flat, buf, nbytes)
        return buf

    def lend_unmanaged(self, flat: torch.Tensor, mapped: torch.Tensor) -> None:
        """Point ``flat``'s storage at a buffer the cache does not keep (a file mapping from
        ``SwapFile.map``, a private copy of one); emptying the storage drops it."""
        self._lend(flat, mapped, mapped.numel())

    def give_back(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        if self.kept_bytes + n <= self.keep_bytes:
            self._free[n].append(buf)
            self.kept_bytes += n
            self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)


class BufferPool:
    def __init__(self, device: torch.device | str = "cpu", pin: bool = False):
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu" and torch.cuda.is_available()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.gathered = ByteCounter()  # gathered parameter storage held by the units
        self.gather_cache = GatherCache.create(self.device)
        self.writes = WriteQueue()  # NVMe writes of gradient and parameter shards in flight
        self.held_grads = ByteCounter()  # gradient shards kept for an overlapped update
        self.allocations = 0  # buffers created since the pool was made
        self.allocated_bytes = 0  # bytes owned by the pool (free or lent out)
        # Sizes (in bytes) of the buffers kept for reuse once released (None: all of them,
        # for the run); a buffer of another size is dropped. With offload the engine keeps
        # only the sizes several units share (the blocks), so that a size one unit uses
        # once a step (an embedding's gradient) does not stay resident through the whole
        # step (see sharding/buffers.py pool_keep_sizes). A kept size keeps every buffer
        # made of it: as many as were in use at once, which the next step needs again
        # (a clipped overlapped step holds its kept gradient shards until the next
        # forward); a new buffer would cost a page fault and a zeroed page per 4 KiB.
        self.keep_sizes: set[int] | None = None
        self.free_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        # Per (numel, dtype): buffers in use now and at most at once (what the estimate
        # plans, sharding/buffers.py pool_buffers).
        self.in_use: dict[tuple[int, torch.dtype], int] = defaultdict(int)
        self.most_in_use: dict[tuple[int, torch.dtype], int] = defaultdict(int)

    def keep_only(self, sizes: set[int] | None) -> None:
        """Set ``keep_sizes`` and drop the free buffers of other sizes (those released
        before, while building the units, when every size was kept)."""
        self.keep_sizes = sizes
        if sizes is None:
            return
        for (numel, dtype), free in self._free.items():
            nbytes = numel * dtype.itemsize
            if nbytes not in sizes:
                self.free_bytes -= nbytes * len(free)
                self.allocated_bytes -= nbytes * len(free)
                free.clear()

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of exactly ``numel`` elements; its contents are undefined."""
        free = self._free[(numel, dtype)]
        reused = bool(free)
        if reused:
            buf = free.pop()
            self.free_bytes -= buf.numel() * buf.element_size()
        elif self.device.type == "cpu":
            # 4 KiB aligned (pinned with an accelerator): these buffers also carry NVMe
            # reads and writes.
            from .aio import aligned_empty

            buf = aligned_empty(numel, dtype, pin=self.pin)
        else:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
        if not reused:
            self.allocations += 1
            self.allocated_bytes += buf.numel() * buf.element_size()
        self.in_use_bytes += buf.numel() * buf.element_size()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        key = (numel, dtype)
        self.in_use[key] += 1
        self.most_in_use[key] = max(self.most_in_use[key], self.in_use[key])
        return buf

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        self.in_use_bytes -= nbytes
        self.in_use[(buf.numel(), buf.dtype)] -= 1
        free = self._free[(buf.numel(), buf.dtype)]
        if self.keep_sizes is not None:
            if nbytes not in self.keep_sizes:
                self.allocated_bytes -= nbytes  # dropped: its memory goes back
                return
            if not self.pin:
                # Kept, but the kernel may take its pages back under memory pressure.
                free_lazily(buf)
        self.free_bytes += nbytes
        free.append(buf)
