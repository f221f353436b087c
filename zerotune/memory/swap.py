"""NVMe swap space: one preallocated file per rank and kind, an extent per unit.

[Note: swap space]
``nvme_path/<run id>/rank<r>/<kind>.swap`` for kind in param (compute-dtype shards),
optim (fp32 master, exp_avg, exp_avg_sq) and grad (gradient shards that do not fit the host
budget). Folders are 0700 and files 0600. Every extent starts on a 4 KiB boundary and its
length is rounded up to 4 KiB, so O_DIRECT reads and writes need no bounce. Extents of the
parameter file of 2 MiB or more start on 2 MiB boundaries (``extent_align``), and buffered files are
written in blocks of at least 4 MiB (``BUFFERED_BLOCK``): see [Note: huge page-cache
pages]. Before any file is made, the free space of nvme_path is checked against everything
this rank will write, and a shortfall is refused with the numbers. A run folder records its
owners' pids; one whose owners are all gone (a crashed run) is removed at the next start.
``close()`` (also at exit) removes this rank's files.

All transfers go through a bounded pool of aligned staging buffers (``StagingPool``),
allocated on first use and reused for the whole run.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch

from .. import dist as zdist
from ..config import ConfigError

__all__ = ["Extent", "StagingPool", "SwapSpace", "pid_alive", "round_up"]

log = logging.getLogger(__name__)
ALIGN = 4096
HUGE = 2 << 20  # a PMD-sized page
BUFFERED_BLOCK = 4 << 20  # the least block size of buffered files' requests

# [Note: huge page-cache pages]
# The parameter file is buffered: forward and backward map its pages, and the optimizer
# updates the fp32 master there (see [Note: the master updated in the page cache] in
# optim/state_store.py). The kernel sizes a file's page-cache folios by the writes that
# create them (where the filesystem supports large folios, e.g. ext4 on Linux 6.16 and
# later, XFS): a 1 MiB pwrite makes pages that a mapping maps one 4 KiB page per fault,
# while a write covering an aligned 2 MiB range makes one folio that a fault maps whole
# (one page-table entry at the PMD level): far fewer faults for the same pages
# (benchmarks/RESULTS.md). So each extent of 2 MiB or more in that file starts on a 2 MiB
# boundary (up to 2 MiB of padding before it; smaller ones are packed at 4 KiB), and
# buffered requests are cut into blocks of at least 4 MiB. Where folios stay
# small everything works the same, with one fault per folio instead.


def extent_align(kind: str) -> int:
    """Where extents of ``kind``'s swap file start: 2 MiB boundaries for those of the
    parameter file that size or larger (mapped, see [Note: huge page-cache pages]), 4 KiB
    boundaries otherwise."""
    return HUGE if kind == "param" else ALIGN


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Extent:
    """A unit's region of a swap file."""

    __slots__ = ("file", "offset", "nbytes")

    def __init__(self, file, offset: int, nbytes: int):
        self.file, self.offset, self.nbytes = file, offset, nbytes

    def read(self, buffer: torch.Tensor):
        return self.file.read(buffer[: self.nbytes // buffer.element_size()], self.offset)

    def write(self, buffer: torch.Tensor):
        return self.file.write(buffer[: self.nbytes // buffer.element_size()], self.offset)


class StagingPool:
    """Aligned host buffers for NVMe transfers: equal slots of ``slot_bytes``, at most
    ``limit`` bytes in all, made on first use and reused for the whole run."""

    def __init__(self, limit: int, slot_bytes: int):
        self.limit = limit
        self.slot = round_up(slot_bytes)
        if 3 * self.slot > limit:
            raise ConfigError(
                f"staging_bytes={limit:,} is too small: the NVMe pipeline keeps three buffers "
                f"of {self.slot:,} bytes in flight; raise staging_bytes"
            )
        self.allocated = 0
        self._free: list[torch.Tensor] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 4 KiB-aligned uint8 buffer of ``slot`` bytes (``nbytes`` must fit)."""
        from .aio import aligned_empty

        if nbytes > self.slot:
            raise ValueError(
                f"a staging request of {nbytes:,} bytes exceeds the slot of {self.slot:,}"
            )
        if self._free:
            return self._free.pop()
        if self.allocated + self.slot > self.limit:
            raise RuntimeError(
                f"staging buffers exhausted ({self.allocated:,} of {self.limit:,} bytes in use)"
            )
        self.allocated += self.slot
        return aligned_empty(self.slot, torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        self._free.append(buf)


class SwapSpace:
    """This rank's swap files under ``nvme_path``."""

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        sizes: dict[str, dict[int, int]],
        config,
        group=None,
        direct: dict[str, bool] | None = None,
    ):
        """``sizes[kind][unit_index]`` = bytes of that unit's extent in that kind's file;
        ``direct[kind]``: use O_DIRECT for that file (its buffers must then be aligned)."""
        from .aio import SwapFile
        from .host import prefer_mmap_for_large_buffers

        prefer_mmap_for_large_buffers()  # see memory/host.py
        self.root = Path(nvme_path)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"nvme_path {self.root} is not a folder")
        try:  # made if missing, parents too: only what cannot work is refused
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make nvme_path {self.root}: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK):
            raise ConfigError(f"nvme_path {self.root} is not writable by this user")
        rank = zdist.get_rank(group)
        run_id = _shared_run_id(group)
        _remove_stale_runs(self.root, keep=run_id)
        layout = {k: extent_layout(v, extent_align(k)) for k, v in sizes.items() if v}
        need = sum(total for _, total in layout.values())
        free = shutil.disk_usage(self.root).free
        local = zdist.ranks_on_this_host()
        if need * local > free:
            parts = ", ".join(f"{k} {_size(total)}" for k, (_, total) in layout.items())
            raise ConfigError(
                f"nvme_path {self.root} has {_size(free)} free; this run needs "
                f"{_size(need * local)} of swap files ({local} rank(s) here, each: {parts})"
            )
        self.run_dir = self.root / run_id
        self.dir = self.run_dir / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        # written under another name and renamed, so that another rank's stale-run sweep never
        # reads a half-written owner file
        owner = self.run_dir / f"owner-rank{rank}"
        partial = self.run_dir / f".partial-owner-rank{rank}"
        partial.write_text(f"{socket.gethostname()} {os.getpid()}\n")
        os.replace(partial, owner)
        self.files = {}
        self.extents: dict[tuple[str, int], Extent] = {}
        try:
            for kind, (offsets, total) in layout.items():
                o_direct = (direct or {}).get(kind, True)
                block = config.aio_block_bytes
                f = SwapFile(
                    self.dir / f"{kind}.swap",
                    total,
                    threads=config.aio_threads,
                    block_bytes=block if o_direct else max(block, BUFFERED_BLOCK),
                    queue_depth=config.aio_queue_depth,
                    direct=o_direct,
                )
                self.files[kind] = f
                for index, (offset, nbytes) in offsets.items():
                    self.extents[kind, index] = Extent(f, offset, nbytes)
        except OSError as exc:
            self.close()
            raise ConfigError(f"cannot create swap files in {self.dir}: {exc}") from None
        self.total_bytes = need
        atexit.register(self.close)

    def extent(self, kind: str, index: int) -> Extent:
        return self.extents[kind, index]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}
        if getattr(self, "dir", None) is not None and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
            owner = self.run_dir / f"owner-rank{self.dir.name[4:]}"
            owner.unlink(missing_ok=True)
            try:
                self.run_dir.rmdir()  # the last rank out removes the run folder
            except OSError:
                pass


def _size(n: int) -> str:
    """Bytes as a person reads them (GiB, MiB or KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def extent_layout(
    sizes: dict[int, int], align: int = ALIGN
) -> tuple[dict[int, tuple[int, int]], int]:
    offsets, cursor = {}, 0
    for index, nbytes in sizes.items():
        length = round_up(max(nbytes, 1))
        if length >= align:  # smaller extents are packed: a huge page would not help them
            cursor = round_up(cursor, align)
        offsets[index] = (cursor, length)
        cursor += length
    return offsets, cursor


def _shared_run_id(group) -> str:
    run_id = f"zerotune-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    if zdist.get_world_size(group) > 1:
        holder = [run_id]
        torch.distributed.broadcast_object_list(holder, src=0, group=group)
        run_id = holder[0]
    return run_id


def _remove_stale_runs(root: Path, keep: str) -> None:
    """Remove run folders whose every owner process on this host is gone (never ``keep``, this
    run's own folder; an owner file that cannot be read counts as alive)."""
    host = socket.gethostname()
    for run in root.glob("zerotune-*"):
        if run.name == keep:
            continue
        owners = list(run.glob("owner-rank*"))
        alive = False
        for owner in owners:
            try:
                owner_host, pid = owner.read_text().split()
                pid = int(pid)
            except (OSError, ValueError):
                alive = True
                break
            if owner_host != host or pid_alive(pid):
                alive = True
        if owners and not alive:
            log.warning("zerotune: removing stale swap folder %s (its run is gone)", run)
            shutil.rmtree(run, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may still run on this host (another user's counts; a number
    no process can have does too, so that nothing of it is removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
