"""What this process holds: its resident set and peak resident set (host) and the CUDA
allocator's bytes (accelerator). ZeroTrainer measures them around the first step and
compares them with the estimate (``check_estimate``)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["accelerator_allocated", "current_rss", "peak_rss", "reset_peak_rss"]


def current_rss() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5); elsewhere the peak
    keeps what came before, so measured peaks may read high."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def accelerator_allocated(device, peak: bool = False) -> int | None:
    """Bytes the CUDA allocator holds for tensors on ``device`` (its peak with ``peak``;
    None on other devices). The peak counter is reset when ``peak`` is False."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if peak:
        return torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_rss() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
