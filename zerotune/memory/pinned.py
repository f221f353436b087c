"""Page-locked host tensors of their own size, for the long-lived host shards of an
accelerator run (see [Note: exact-size pinned memory]).

[Note: exact-size pinned memory]
torch's pinned allocator (``pin_memory=True``, ``Tensor.pin_memory()``) serves a request
from a block rounded up to the next power of two and keeps freed blocks for reuse: a
129 MiB shard locks 256 MiB. That suits short-lived transfer buffers, which come back every
step in the same sizes, and it is what the host pool and activation records keep using.
The shards that live as long as the engine (the compute-dtype and fp32 master shards kept
on the host, the gradient shards of an offloaded optimizer) would lose up to half of the
host memory they lock to the rounding. ``pinned_empty`` instead maps anonymous pages of
the tensor's size (rounded to whole pages), registers them with the driver
(``cudaHostRegister``; copies from and to them are then asynchronous like those of torch's
pinned blocks) and unregisters them from a finalizer on their storage, which keeps the
mapping until then, as torch's own checkpoint stager does for the buffers it pins. The
storage begins at the mapping's first byte: ``Tensor.is_pinned`` asks the driver about the
storage's first byte, not the tensor's. The pages are the mapping's own (two registrations
never share a page, which the driver would refuse). A registration that fails anyway (no
RAM or locked-memory limit left) raises, as torch's pinned allocator does when it cannot
pin, after reading the driver's last error, which torch's next kernel launch would
otherwise report as its own.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from .swap import round_up

__all__ = ["pinned_copy", "pinned_empty"]

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _register(ptr: int, nbytes: int) -> int:
    """cudaHostRegister; its error code (0: registered)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _forget_error() -> None:
    """Read the driver's last error (a failed registration), so that torch's next kernel
    launch does not report it in place of its own: a launch's check reads and clears it."""
    if torch.cuda.is_available():
        try:
            torch.empty(1, device="cuda").zero_()
        except RuntimeError:
            pass


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D host tensor whose memory is page-locked and takes its own size,
    rounded to whole pages (see [Note: exact-size pinned memory]). An empty one locks
    nothing: it has no memory to copy from (its ``data_ptr()`` is 0, which the driver
    refuses)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = round_up(numel * dtype.itemsize, mmap.PAGESIZE)
    pages = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, private to this process
    t = torch.frombuffer(pages, dtype=dtype, count=numel)  # its storage starts at the pages
    ptr = t.data_ptr()
    error = _register(ptr, nbytes)
    if error:
        _forget_error()
        raise RuntimeError(
            f"cannot pin {nbytes:,} bytes of host memory for a host shard (cudaHostRegister "
            f"error {error}): free RAM or the locked-memory limit (ulimit -l) is too small "
            "for the offloaded state; `zerotune estimate` gives its size"
        )
    # The finalizer holds the mapping: unregistered before it is unmapped. Not at
    # interpreter exit: the CUDA context may be gone by then.
    weakref.finalize(t.untyped_storage(), _release, ptr, pages).atexit = False
    return t


def _release(ptr: int, pages: mmap.mmap) -> None:
    """Unregister ``ptr``; ``pages``, an argument of the finalizer, is mapped until then."""
    _unregister(ptr)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of ``t``, of its own size and shape."""
    out = pinned_empty(t.numel(), t.dtype)
    out.copy_(t.reshape(-1))
    return out.view(t.shape)
