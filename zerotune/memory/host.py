"""Giving freed heap memory back to the system (glibc only; elsewhere a no-op).

glibc keeps freed memory for reuse, so after zero-init has built and freed each unit's
temporary full-size copy, RSS would stay at its high-water mark; zero-init trims the heap
after each unit.

Earlier versions also forced glibc's mmap threshold down to 1 MiB whenever NVMe offload was
on, so that every freed buffer left RSS at once. It made every activation and temporary of
1 MiB or more a fresh mapping, page-faulted and zeroed by the kernel on first touch: plain
PyTorch training of gpt2-medium ran 1.5x slower under it (8.7 s against 5.9 s a step). The
big buffers that setting was for (gathered parameters) are now reused through
``GatherCache`` (memory/pool.py), and glibc's adaptive threshold is left alone.
``prefer_mmap_for_large_buffers`` remains for measurements that compare RSS with what
was allocated (tests, benchmarks/estimate_accuracy.py): under it RSS follows allocations.
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
    turns off glibc's adaptive one). Slow for training (see above); for measurements."""
    lib = _glibc()
    if lib:
        lib.mallopt(_M_MMAP_THRESHOLD, threshold)
