"""Page-locked host tensors of their own size, for the long-lived host shards of an
accelerator run (see [Note: exact-size pinned memory]).

[Note: exact-size pinned memory]
torch's pinned allocator (``pin_memory=True``, ``Tensor.pin_memory()``) serves a request
from a block rounded up to the next power of two and keeps freed blocks for reuse: a
130 MB shard locks 256 MiB. That suits short-lived transfer buffers, which come back every
step in the same sizes, and it is what the host pool and activation records keep using.
The shards that live as long as the engine (the compute-dtype and fp32 master shards kept
on the host, the gradient shards of an offloaded optimizer) would lose up to half of the
host memory they lock to the rounding. ``pinned_empty`` instead takes an ordinary
allocation of the tensor's size (rounded to 4 KiB), registers it with the driver
(``cudaHostRegister``; copies from and to it are then asynchronous like those of torch's
pinned blocks) and unregisters it from a finalizer on its storage, before the storage's
memory is freed, as torch's own checkpoint stager does for the buffers it pins. Should
registering fail, the tensor comes from torch's pinned allocator instead (logged once).
"""

from __future__ import annotations

import logging
import weakref

import torch

from .aio import aligned_empty

__all__ = ["pinned_copy", "pinned_empty"]

log = logging.getLogger(__name__)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_fallback_logged = False


def _register(ptr: int, nbytes: int) -> int:
    """cudaHostRegister; its error code (0: registered)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _torch_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D host tensor whose memory is page-locked and takes its own size
    (see [Note: exact-size pinned memory])."""
    global _fallback_logged
    t = aligned_empty(numel, dtype)
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    error = _register(ptr, nbytes) if nbytes else 0
    if error:
        if not _fallback_logged:
            _fallback_logged = True
            log.warning(
                "zerotune: cudaHostRegister of %d bytes failed (error %d); host shards come "
                "from torch's pinned allocator (blocks rounded up to powers of two)",
                nbytes,
                error,
            )
        return _torch_pinned(numel, dtype)
    if nbytes:
        # Not at interpreter exit: the CUDA context may be gone by then.
        weakref.finalize(storage, _unregister, ptr).atexit = False
    return t


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of ``t`` (1-D), of its own size."""
    out = pinned_empty(t.numel(), t.dtype)
    out.copy_(t.reshape(-1))
    return out.view(t.shape)
