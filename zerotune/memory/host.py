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

The rest of the churn (weight gradients, activations, backward's temporaries) is served by
a CPU allocator that keeps recently freed buffers of 1 MiB and more within a byte budget,
``host_cache_bytes`` ([Note: host buffer cache] in csrc/aio/host_cache.cpp): an engine on a
CPU device with offload installs it (``keep_freed_buffers``) and takes it out again when
closed. Measured on gpt2-medium, both tiers on NVMe, 8-bit moments, 2 cores: 128 MiB took
minor faults from ~550K to ~300K a step and the step from ~6.1 to ~5.2-5.3 s, peak RSS
1.51-1.57 GiB against 1.67-1.76 without it; glibc's own heap reaching the same faults
(a 32 MiB threshold, no trimming) cost 2.2-2.4 GiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
from collections.abc import Callable

import torch

__all__ = [
    "free_lazily",
    "host_cache_report",
    "host_cache_used",
    "keep_freed_buffers",
    "prefer_mmap_for_large_buffers",
    "release_free_memory",
]

CACHE_MIN_BYTES = 1 << 20  # the buffers the cache serves: those glibc would mmap
_cache_budgets: dict[int, int] = {}  # owner token -> budget; the largest applies
_tokens = itertools.count()

_M_MMAP_THRESHOLD = -3
_MADV_FREE = 8  # linux/mman.h
_PAGE = mmap.PAGESIZE
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


def free_lazily(t: torch.Tensor) -> None:
    """Let the kernel take back the whole pages of ``t``'s memory should it need them
    (``MADV_FREE``): until it does, they stay mapped and writing them costs no page fault;
    once it has, they read as zeros. For a buffer kept for reuse whose contents no longer
    matter (memory/pool.py ``BufferPool.release``). Does nothing where not supported."""
    lib = _glibc()
    if not lib or t.device.type != "cpu":
        return
    start = t.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    last = (start + t.numel() * t.element_size()) // _PAGE * _PAGE
    if last > first:
        lib.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_FREE)


def prefer_mmap_for_large_buffers(threshold: int = 1 << 20) -> None:
    """Allocate buffers of ``threshold`` bytes and more with mmap (a fixed threshold also
    turns off glibc's adaptive one)."""
    lib = _glibc()
    if lib:
        lib.mallopt(_M_MMAP_THRESHOLD, threshold)


def _aio_op():
    from .aio import load_aio_op

    return load_aio_op()


def host_cache_used(config, device: str) -> bool:
    """Whether an engine on a ``device`` of this type ("cpu", "cuda", ...) with ``config``
    keeps freed tensors for reuse: a CPU device, some offload, a budget."""
    return device == "cpu" and config.offloads and config.host_cache_bytes > 0


def keep_freed_buffers(budget: int) -> Callable[[], None] | None:
    """Serve CPU tensors of 1 MiB and more from a cache that keeps freed ones for reuse, up
    to ``budget`` bytes (the largest budget of the owners alive applies). Returns the
    owner's release function (once the last owner releases, the kept buffers go back to the
    system and the previous allocator returns), or None when nothing was installed: a zero
    budget, the aio op not built, or another CPU allocator of higher priority in place."""
    if budget <= 0:
        return None
    op = _aio_op()
    if op is None:
        return None
    token = next(_tokens)
    _cache_budgets[token] = budget
    if not op.host_cache_enable(max(_cache_budgets.values()), CACHE_MIN_BYTES):
        del _cache_budgets[token]
        return None

    def release() -> None:
        if _cache_budgets.pop(token, None) is None:
            return  # released before
        if _cache_budgets:
            op.host_cache_enable(max(_cache_budgets.values()), CACHE_MIN_BYTES)
        else:
            op.host_cache_disable()

    return release


def host_cache_report() -> dict[str, int]:
    """The host buffer cache now: budget, kept and peak kept bytes, hits and misses
    (all zero when it is not installed)."""
    op = _aio_op()
    if op is None:
        return {"budget": 0, "kept": 0, "peak_kept": 0, "hits": 0, "misses": 0}
    installed, budget, kept, peak, _live, hits, misses = op.host_cache_stats()
    return {
        "budget": budget if installed else 0,
        "kept": kept,
        "peak_kept": peak,
        "hits": hits,
        "misses": misses,
    }
