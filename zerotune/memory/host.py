"""Host-allocator settings that keep RSS honest (glibc only; elsewhere they do nothing).

glibc keeps freed memory for reuse: after a buffer is freed RSS does not fall, and with its
adaptive mmap threshold (up to 32 MiB) gradients and activations of a few MiB come from a
heap that fragments across steps. With CPU or NVMe offload, where host memory is the budget
being planned, zerotune serves buffers of 1 MiB and more with mmap, which gives them back to
the system when freed; zero-init also trims the heap after building each unit.
(benchmarks/estimate_accuracy.py: with glibc's default the peak RSS of a CPU-offload run
came out 17% above the estimate, with the threshold within 1.2%.)

The cost is page faults: each such buffer is faulted and zeroed by the kernel again on its
first touch. The biggest ones, gathered parameters, are therefore not allocated per gather
but reused (``GatherCache``, memory/pool.py). Measured on gpt2-medium with both tiers on
NVMe (2 cores): peak RSS 2.38 GiB with the 1 MiB threshold against 2.88 GiB with glibc's
default, forward 1.76 s against 1.35 s a step, backward the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["prefer_mmap_for_large_buffers", "release_free_memory"]

_M_MMAP_THRESHOLD = -3
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _libc = False
    return _libc


def release_free_memory() -> None:
    """Return freed heap memory to the system."""
    lib = _glibc()
    if lib:
        lib.malloc_trim(0)


def prefer_mmap_for_large_buffers(threshold: int = 1 << 20) -> None:
    """Allocate buffers of ``threshold`` bytes and more with mmap (a fixed threshold also
    turns off glibc's adaptive one)."""
    lib = _glibc()
    if lib:
        lib.mallopt(_M_MMAP_THRESHOLD, threshold)
