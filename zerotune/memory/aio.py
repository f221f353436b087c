"""Asynchronous reads and writes between CPU tensors and swap files (the NVMe tier).

[Note: swap file I/O]
A ``SwapFile`` is one preallocated file, created with mode 0o600 and opened with O_DIRECT
when the filesystem accepts it (``SwapFile.direct`` says whether it did): O_DIRECT moves
data between the disk and the tensor's memory without the page cache, so swapping does
not also fill the host RAM it is meant to save. ``write`` and ``read`` return at once with
an ``IOHandle``; the transfer runs on a pool of worker threads, cut into blocks of
``block_bytes`` of which up to ``min(threads, queue_depth)`` are in flight at once (see
[Note: aio requests] in csrc/aio/aio.cpp). ``IOHandle.wait()`` releases the GIL.

Rules, the same for every backend and mode (so code tested on tmpfs behaves the same on
an NVMe disk):
- ``offset`` and the tensor's ``data_ptr()`` are multiples of ``ALIGN`` (4096); use
  ``aligned_empty`` for buffers. Tensors are contiguous CPU tensors of any dtype.
- Any ``nbytes`` works. A request takes ``round_up(nbytes, ALIGN)`` bytes of the file,
  which must lie inside ``size``. Reads fill exactly the tensor's bytes; after a write
  the file bytes between ``offset + nbytes`` and the next 4096 boundary are unspecified
  (zeros with O_DIRECT, left as they were without it).
- Misuse (bad alignment, out of bounds, closed file) raises ``ValueError`` at once;
  I/O failures raise ``AioError`` (an ``OSError`` with ``errno``, ``filename`` and
  ``offset``) from ``wait()``. A read that meets the end of the file (a truncated or
  corrupt swap file) is ``EIO`` with "unexpected end of file".
- The tensor must stay untouched until its handle is done; the file keeps a reference
  to it until then, so dropping a handle without waiting is safe. ``close()`` waits for
  every request.

Backends: "cpp-threads" (csrc/aio, pread/pwrite in C++ threads) or, when the op cannot
be built, "python-threads": a ``ThreadPoolExecutor`` doing ``os.preadv``/``os.pwrite``
with buffered I/O (never O_DIRECT), same API, same errors.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, TracebackType

import torch

from zerotune.ops import load_op

__all__ = ["ALIGN", "AioError", "IOHandle", "SwapFile", "aligned_empty", "backend"]

logger = logging.getLogger(__name__)

ALIGN = 4096

# (errno, file offset, length, bytes got before EOF or -1): how both backends report a failure.
_ErrorRecord = tuple[int, int, int, int]

_fallback_logged = False
_fallback_lock = threading.Lock()


class AioError(OSError):
    """An asynchronous read or write failed; ``offset`` is the file offset where it failed."""

    offset: int


def aligned_empty(
    numel: int, dtype: torch.dtype, pin: bool = False, align: int = ALIGN
) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor whose ``data_ptr()`` is a multiple of ``align`` and
    whose storage extends at least to the next multiple of ``align`` bytes past its start;
    with ``pin``, in pinned memory (for copies to and from an accelerator)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    padded = max(_round_up(numel * dtype.itemsize, align), align)
    if pin:
        # The pinned allocator rounds blocks up to powers of two: ask for the exact size
        # first, and over-allocate only when the block it gives is not aligned.
        raw = torch.empty(padded, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % align == 0:
            return raw.view(dtype)[:numel]
    raw = torch.empty(padded + align, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % align
    return raw[start : start + padded].view(dtype)[:numel]


def backend() -> str:
    """The implementation ``SwapFile`` uses: "cpp-threads" or "python-threads" (fallback).

    Builds the C++ op on first call."""
    return "python-threads" if load_aio_op() is None else "cpp-threads"


class IOHandle:
    """One pending read or write; ``wait()`` it before touching the tensor."""

    __slots__ = ("_error", "_impl", "_nbytes", "_offset", "_op", "_path", "_tensor")

    def __init__(
        self,
        impl,  # the backend's request (see below), or None: nothing to do
        tensor: torch.Tensor,
        path: Path,
        op: str,
        offset: int,
        nbytes: int,
    ) -> None:
        self._impl = impl
        self._tensor: torch.Tensor | None = tensor  # kept alive until the request is done
        self._path = path
        self._op = op
        self._offset = offset
        self._nbytes = nbytes
        self._error: _ErrorRecord | None = None

    def wait(self) -> None:
        """Block until the request is done (without holding the GIL).

        Raises ``AioError`` (an ``OSError``) naming the file and the offset on failure;
        every later call raises it again."""
        impl = self._impl
        if impl is not None:
            error = impl.wait()  # safe to call from several threads at once
            self._error = error
            self._impl = None
            self._tensor = None
        if self._error is not None:
            raise self._exception(self._error)

    def done(self) -> bool:
        """Whether the request has finished (successfully or not); never blocks."""
        impl = self._impl
        return impl is None or impl.done()

    def _exception(self, record: _ErrorRecord) -> AioError:
        code, offset, length, got = record
        where = f"{self._op} of {length} bytes at offset {offset}"
        if (offset, length) != (self._offset, self._nbytes):
            where += f", part of a {self._nbytes}-byte {self._op} at offset {self._offset}"
        if got >= 0:
            reason = f"unexpected end of file ({where}: got {got} bytes)"
        else:
            reason = f"{os.strerror(code)} ({where})"
        err = AioError(code, reason, str(self._path))
        err.offset = offset
        return err


class SwapFile:
    """A preallocated file for asynchronous tensor reads and writes; see [Note: swap file I/O].

    Args:
        path: the file to create (mode 0o600; its folder must exist). An existing file is
            truncated. Removing the file is the caller's job.
        size_bytes: bytes to preallocate, rounded up to a multiple of ``ALIGN`` (``size``).
        threads: worker threads; each keeps one block in flight.
        block_bytes: requests are cut into blocks of this many bytes (a multiple of ``ALIGN``).
        queue_depth: the most blocks in flight at once (together with ``threads``).
        direct: use O_DIRECT when the filesystem allows it (``self.direct`` says if it did).
    """

    def __init__(
        self,
        path: str | Path,
        size_bytes: int,
        *,
        threads: int = 4,
        block_bytes: int = 1 << 20,
        queue_depth: int = 16,
        direct: bool = True,
    ) -> None:
        self.path = Path(path)
        _check_int("size_bytes", size_bytes, 0)
        _check_int("threads", threads, 1)
        _check_int("queue_depth", queue_depth, 1)
        _check_int("block_bytes", block_bytes, ALIGN)
        if block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a multiple of {ALIGN}, got {block_bytes}")
        self.size = _round_up(size_bytes, ALIGN)
        self.block_bytes = block_bytes
        self._closed = True  # until the engine exists, so that close() has nothing to do
        self._pending: list[IOHandle] = []
        self._pending_lock = threading.Lock()
        self._prune_at = 64
        self._window: int | None = None  # bytes one readahead advice reads (will_need)
        op = load_aio_op()
        self._fd = _create(self.path, self.size)
        try:
            self.direct = False
            if direct and op is not None:
                self._fd, self.direct = _reopen_direct(self.path, self._fd)
            if op is not None:
                self._engine: _CppEngine | _PyEngine = _CppEngine(
                    op, self._fd, self.direct, threads, block_bytes, queue_depth
                )
            else:
                self._engine = _PyEngine(self._fd, threads, block_bytes, queue_depth)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise
        self._closed = False
        logger.debug("swap file %s: %d bytes, %s, %s", self.path, self.size, backend(), self.mode)

    @property
    def mode(self) -> str:
        """How the file is really opened: "O_DIRECT" or "buffered"."""
        return "O_DIRECT" if self.direct else "buffered"

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, tensor: torch.Tensor, offset: int, urgent: bool = False) -> IOHandle:
        """Start writing ``tensor``'s bytes at file ``offset``; returns at once.
        ``urgent``: as for ``read``."""
        return self._submit(True, tensor, offset, urgent)

    def read(self, tensor: torch.Tensor, offset: int, urgent: bool = False) -> IOHandle:
        """Start filling ``tensor`` with the file's bytes from ``offset``; returns at once.
        ``urgent``: the caller is about to wait for it, so it goes ahead of every queued
        request not started yet, a write of the same bytes included (see [Note: aio
        requests] in csrc/aio/aio.cpp); the Python fallback does it on the calling thread
        before returning."""
        return self._submit(False, tensor, offset, urgent)

    def map(self, offset: int, nbytes: int) -> torch.Tensor:
        """The file's bytes ``[offset, offset + nbytes)`` as a uint8 tensor over a private
        (copy-on-write) mapping: reads are served from the page cache without a copy, writes
        into the tensor never reach the file, and the mapping goes when the last tensor
        using it does. Buffered files only (O_DIRECT writes bypass the pages a mapping
        shows). The whole range is asked of the page cache at once (``will_need``). A
        region past the file's end is refused here; a disk error while a page is read
        through the mapping ends the process with SIGBUS (there is no call to raise from),
        unlike ``read``."""
        self._check_mappable(offset, nbytes)
        end = os.fstat(self._fd).st_size
        if offset + nbytes > end:
            raise OSError(
                errno.EIO,
                f"{self.path}: cannot map {nbytes} bytes at offset {offset}, the file ends at "
                f"{end} (truncated?)",
            )
        view = mmap.mmap(
            self._fd,
            nbytes,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )
        self.will_need(offset, nbytes)
        return torch.frombuffer(view, dtype=torch.uint8)

    def _check_mappable(self, offset: int, nbytes: int) -> None:
        if self._closed:
            raise ValueError(f"map of a closed swap file {self.path}")
        if self.direct:
            raise ValueError(f"map of {self.path}: the file is opened with O_DIRECT")
        if offset < 0 or offset % mmap.ALLOCATIONGRANULARITY or nbytes <= 0:
            raise ValueError(f"map of {self.path}: bad region ({offset}, {nbytes})")

    def will_need(self, offset: int, nbytes: int) -> None:
        """Start reading the file's bytes ``[offset, offset + nbytes)`` into the page cache
        without waiting for them: a later mapping or buffered read finds them there or on
        their way. Buffered files only; cached pages cost a lookup. One advice reads at most
        the device's readahead window (``readahead_bytes``), so a range takes one per window.
        A filesystem that refuses the advice gets none: the reads then happen on use."""
        if self._closed or self.direct:
            raise ValueError(f"will_need on {self.path}: closed, or opened with O_DIRECT")
        if self._window is None:
            self._window = readahead_bytes(self._fd)
        try:
            for at in range(offset, offset + nbytes, self._window):
                n = min(self._window, offset + nbytes - at)
                os.posix_fadvise(self._fd, at, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # advice only

    def map_shared(self, offset: int, nbytes: int) -> mmap.mmap:
        """The file's bytes ``[offset, offset + nbytes)`` as a shared, writable mapping:
        writes into it change the file's page-cache pages, that is the file (as a ``write``
        would, without the copy). Buffered files only; ``offset`` page-aligned. The caller
        closes it. A disk error while a page is read through it ends the process with
        SIGBUS, as for ``map``."""
        self._check_mappable(offset, nbytes)
        if offset + nbytes > self.size:
            raise ValueError(f"map of {self.path}: ({offset}, {nbytes}) is past its end")
        return mmap.mmap(
            self._fd,
            nbytes,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )

    def close(self) -> None:
        """Wait for every request, stop the workers and close the file (it stays on disk)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.close()
        finally:
            self._pending.clear()
            os.close(self._fd)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.mode
        return f"SwapFile({str(self.path)!r}, size={self.size}, {state})"

    def _submit(
        self, write: bool, tensor: torch.Tensor, offset: int, urgent: bool = False
    ) -> IOHandle:
        op = "write" if write else "read"
        if self._closed:
            raise ValueError(f"{op} on a closed swap file {self.path}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{op} of {self.path}: the tensor must be a contiguous CPU tensor")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"{op}: offset must be an int, got {type(offset).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        if offset < 0 or offset % ALIGN:
            raise ValueError(
                f"{op} of {self.path} at offset {offset}: offsets must be non-negative "
                f"multiples of {ALIGN}"
            )
        if nbytes and tensor.data_ptr() % ALIGN:
            raise ValueError(
                f"{op} of {self.path} at offset {offset}: the tensor's data_ptr() is not "
                f"{ALIGN}-aligned; allocate it with zerotune.memory.aio.aligned_empty"
            )
        if offset + _round_up(nbytes, ALIGN) > self.size:
            raise ValueError(
                f"{op} of {nbytes} bytes at offset {offset} is past the end of {self.path} "
                f"({self.size} bytes; a request takes its size rounded up to {ALIGN})"
            )
        impl = self._engine.submit(write, tensor, offset, nbytes, urgent) if nbytes else None
        handle = IOHandle(impl, tensor, self.path, op, offset, nbytes)
        if impl is not None:
            self._remember(handle)
        return handle

    def _remember(self, handle: IOHandle) -> None:
        # Keeps each tensor alive until its request is done, even if its handle is dropped.
        with self._pending_lock:
            self._pending.append(handle)
            if len(self._pending) >= self._prune_at:
                self._pending = [h for h in self._pending if not h.done()]
                self._prune_at = max(64, 2 * len(self._pending))


# ---------------------------------------------------------------------------------------------
# Backends: each submit() returns an object with wait() -> _ErrorRecord | None and done().


class _CppEngine:
    def __init__(self, op: ModuleType, fd, direct, threads, block_bytes, queue_depth) -> None:
        self._engine = op.Engine(fd, direct, threads, block_bytes, queue_depth)

    def submit(self, write: bool, tensor: torch.Tensor, offset: int, nbytes: int, urgent: bool):
        # The op's Handle has the same wait()/done() as _PyRequest.
        return self._engine.submit(write, tensor, offset, nbytes, urgent)

    def close(self) -> None:
        self._engine.close()


class _PyRequest:
    __slots__ = ("futures",)

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def wait(self) -> _ErrorRecord | None:
        # Like the C++ op: every block runs, the failure at the lowest offset is reported.
        errors = [e for e in (f.result() for f in self.futures) if e is not None]
        return min(errors, key=lambda e: e[1]) if errors else None

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class _PyEngine:
    """The fallback: os.preadv/os.pwrite (which release the GIL) on a thread pool."""

    def __init__(self, fd: int, threads: int, block_bytes: int, queue_depth: int) -> None:
        self._fd = fd
        self._block = block_bytes
        self._pool = ThreadPoolExecutor(
            max_workers=min(threads, queue_depth), thread_name_prefix="zerotune-aio"
        )

    def submit(
        self, write: bool, tensor: torch.Tensor, offset: int, nbytes: int, urgent: bool
    ) -> _PyRequest:
        buf = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
        req = _PyRequest()
        for pos in range(0, nbytes, self._block):
            part = buf[pos : pos + self._block]
            if urgent:  # the executor's queue has no front: transfer it on this thread
                done: Future = Future()
                done.set_result(self._transfer(write, part, offset + pos))
                req.futures.append(done)
            else:
                req.futures.append(self._pool.submit(self._transfer, write, part, offset + pos))
        return req

    def _transfer(self, write: bool, part: memoryview, offset: int) -> _ErrorRecord | None:
        done, length = 0, len(part)
        try:
            while done < length:
                if write:
                    n = os.pwrite(self._fd, part[done:], offset + done)
                else:
                    n = os.preadv(self._fd, [part[done:]], offset + done)
                if n == 0 and write:  # no progress: treat as a full disk
                    return (errno.ENOSPC, offset, length, -1)
                if n == 0:  # the file ends before the block does
                    return (errno.EIO, offset, length, done)
                done += n
        except OSError as err:
            return (err.errno or errno.EIO, offset, length, -1)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------
# Helpers


def load_aio_op() -> ModuleType | None:
    global _fallback_logged
    op = load_op("aio")
    if op is None:
        with _fallback_lock:
            if not _fallback_logged:
                _fallback_logged = True
                logger.info(
                    "zerotune aio: the C++ op is unavailable, swap files use Python threads "
                    "with buffered I/O (no O_DIRECT)"
                )
    return op


def readahead_bytes(fd: int) -> int:
    """The most bytes one ``POSIX_FADV_WILLNEED`` reads of the file ``fd`` (Linux caps each
    advice at the larger of its device's readahead window and largest request), or 128 KiB
    (the kernel's default window) where sysfs does not say (no block device, another OS)."""
    dev = os.fstat(fd).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base.resolve().parent / "queue"):  # a disk, a partition
        try:
            kib = [int((queue / f).read_text()) for f in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        if max(kib) > 0:
            return max(kib) << 10
    return 128 << 10


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _create(path: Path, size: int) -> int:
    """Create ``path`` with mode 0o600 and preallocate ``size`` bytes; returns a buffered fd.

    On failure the file is removed again and an OSError naming ``path`` is raised."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)  # FileNotFoundError/PermissionError already name the path
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                code = err.errno or errno.EIO
                hint = " (the disk is full)" if code in (errno.ENOSPC, errno.EDQUOT) else ""
                raise OSError(
                    code,
                    f"cannot preallocate {size} bytes for a swap file{hint}: {os.strerror(code)}",
                    str(path),
                ) from err
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def _reopen_direct(path: Path, fd: int) -> tuple[int, bool]:
    """Swap the buffered ``fd`` for an O_DIRECT one if the filesystem takes it."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return fd, False
    try:
        direct_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | o_direct)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        logger.info("%s: O_DIRECT refused (%s), using buffered I/O", path, err.strerror)
        return fd, False
    try:
        # Some filesystems accept the flag at open and refuse the I/O: probe one page.
        if os.fstat(direct_fd).st_size >= ALIGN:
            with mmap.mmap(-1, ALIGN) as page:  # anonymous mmaps are page-aligned
                os.preadv(direct_fd, [page], 0)
    except OSError as err:
        os.close(direct_fd)
        if err.errno != errno.EINVAL:
            raise OSError(
                err.errno, f"cannot read the new swap file: {err.strerror}", str(path)
            ) from err
        logger.info("%s: O_DIRECT I/O refused (%s), using buffered I/O", path, err.strerror)
        return fd, False
    os.close(fd)
    return direct_fd, True
