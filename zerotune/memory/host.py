"""Host-allocator settings that keep RSS honest (glibc only; elsewhere they do nothing).

glibc keeps freed memory for reuse: after a big buffer is freed, RSS does not fall, and with
its adaptive mmap threshold later big buffers come from a heap that fragments. Offloaded
training frees and re-allocates gathered units and staging buffers all the time, and its
memory bound is checked against RSS, so zerotune (a) serves buffers of 1 MiB and more with
mmap, which returns them to the system when freed, and (b) trims the heap after building
each unit in zero-init.
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
