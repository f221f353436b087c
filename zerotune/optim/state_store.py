"""Where the optimizer's per-unit state lives during a step: memory, or NVMe in chunks.

[Note: optimizer state stores]
The optimizer asks a store for (master, exp_avg, exp_avg_sq, grad) of a chunk of a unit's
shard, updates it in place and gives it back. ``ResidentStore`` (no offload, or cpu) hands
out views of tensors held in memory: one chunk per unit, nothing to move. ``NvmeStore``
keeps each unit's fp32 master, exp_avg and exp_avg_sq in the rank's optim swap file, three
4 KiB-aligned regions per unit, and streams the step through a pipeline: while chunk k is
updated by the C++ Adam, chunk k+1 is read and chunk k-1 written back. Chunks are bounded so
that three chunk sets fit in ``staging_bytes``, whatever the size of the largest unit.
"""

from __future__ import annotations

from collections import deque

import torch

from ..memory.swap import ALIGN, round_up

__all__ = ["NvmeStore", "ResidentStore", "chunk_elements", "write_initial_state"]

_F32 = 4


def chunk_elements(staging_bytes: int, grad_on_disk: bool) -> int:
    per_element = 3 * _F32 + (_F32 if grad_on_disk else 0)
    n = staging_bytes // (3 * per_element)  # three chunk sets in flight
    n -= n % (ALIGN // _F32)
    if n <= 0:
        raise ValueError(f"staging_bytes={staging_bytes:,} is too small to stream optimizer state")
    return n


class ResidentStore:
    def __init__(self, units):
        self.moments = {
            u.index: (torch.zeros_like(u.master), torch.zeros_like(u.master)) for u in units
        }

    def chunks(self, unit):
        return [(0, unit.shard_numel)]

    def run(self, items, update) -> None:
        for unit, c0, c1 in items:
            m, v = self.moments[unit.index]
            update(unit, c0, c1, unit.master[c0:c1], m[c0:c1], v[c0:c1], unit.grad_shard[c0:c1])

    def read_unit(self, unit) -> dict[str, torch.Tensor]:
        m, v = self.moments[unit.index]
        return {"master": unit.master, "exp_avg": m, "exp_avg_sq": v}

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        live = self.read_unit(unit)
        for key, value in state.items():
            live[key].copy_(value.reshape(-1))

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() * 2 for m, _ in self.moments.values())


def _optim_offsets(swap, unit, c0: int) -> list[int]:
    """File offsets of element ``c0`` in the unit's master, exp_avg and exp_avg_sq regions."""
    base = swap.extent("optim", unit.index).offset
    region = round_up(unit.shard_numel * _F32)
    return [base + k * region + c0 * _F32 for k in range(3)]


def write_initial_state(unit, swap, staging) -> None:
    """At construction: the unit's fp32 master and zero moments go to the optim swap file;
    the unit keeps no fp32 master in memory from then on."""
    f = swap.files["optim"]
    step = chunk_elements(staging.limit, False)
    for c0 in range(0, unit.shard_numel, step):
        c1 = min(c0 + step, unit.shard_numel)
        nbytes = round_up((c1 - c0) * _F32)
        held = staging.acquire(nbytes)
        buf = held[:nbytes]
        f32 = buf.view(torch.float32)
        f32.zero_()
        f32[: c1 - c0].copy_(unit.master[c0:c1])
        master_off, m_off, v_off = _optim_offsets(swap, unit, c0)
        f.write(buf, master_off).wait()
        f32.zero_()
        f.write(buf, m_off).wait()
        f.write(buf, v_off).wait()
        staging.release(held)
    unit.master = None


class NvmeStore:
    def __init__(self, swap, staging, chunk: int):
        self.swap, self.staging, self.chunk = swap, staging, chunk
        self.bytes_read = 0
        self.bytes_written = 0

    def _offsets(self, unit, c0: int) -> list[int]:
        return _optim_offsets(self.swap, unit, c0)

    def chunks(self, unit):
        n = unit.shard_numel
        return [(c0, min(c0 + self.chunk, n)) for c0 in range(0, n, self.chunk)]

    def _file(self):
        return self.swap.files["optim"]

    # ----------------------------------------------------------------------- the step
    def _start(self, item):
        unit, c0, c1 = item
        nbytes = round_up((c1 - c0) * _F32)
        grad_disk = unit.grad_extent is not None
        buf = self.staging.acquire(nbytes * (4 if grad_disk else 3))  # may be larger
        handles = [
            self._file().read(buf[k * nbytes : (k + 1) * nbytes], off)
            for k, off in enumerate(self._offsets(unit, c0))
        ]
        if grad_disk:
            g = unit.grad_extent
            dst = buf[3 * nbytes : 3 * nbytes + (c1 - c0) * _F32]
            handles.append(g.file.read(dst, g.offset + c0 * _F32))
        return item, buf, nbytes, handles

    def run(self, items, update) -> None:
        writes: deque = deque()
        upcoming = self._start(items[0]) if items else None
        for k in range(len(items)):
            current, upcoming = (
                upcoming,
                (self._start(items[k + 1]) if k + 1 < len(items) else None),
            )
            (unit, c0, c1), buf, nbytes, handles = current
            for h in handles:
                h.wait()
            n = c1 - c0
            self.bytes_read += 3 * nbytes + (n * _F32 if len(handles) == 4 else 0)
            f32 = buf.view(torch.float32)
            stride = nbytes // _F32
            master, m, v = (f32[k * stride : k * stride + n] for k in range(3))
            grad = f32[3 * stride : 3 * stride + n] if len(handles) == 4 else unit.grad_shard[c0:c1]
            update(unit, c0, c1, master, m, v, grad)
            offs = self._offsets(unit, c0)
            hs = [self._file().write(buf[j * nbytes : (j + 1) * nbytes], offs[j]) for j in range(3)]
            self.bytes_written += 3 * nbytes
            writes.append((hs, buf))
            while len(writes) > 1:
                self._finish(writes.popleft())
        while writes:
            self._finish(writes.popleft())

    def _finish(self, entry) -> None:
        handles, buf = entry
        for h in handles:
            h.wait()
        self.staging.release(buf)

    # ------------------------------------------------------------------ whole-unit I/O
    def read_unit(self, unit) -> dict[str, torch.Tensor]:
        n = unit.shard_numel
        out = {k: torch.empty(n, dtype=torch.float32) for k in ("master", "exp_avg", "exp_avg_sq")}
        for c0, c1 in self.chunks(unit):
            nbytes = round_up((c1 - c0) * _F32)
            held = self.staging.acquire(nbytes)
            buf = held[:nbytes]
            for key, off in zip(out, self._offsets(unit, c0)):
                self._file().read(buf, off).wait()
                out[key][c0:c1].copy_(buf.view(torch.float32)[: c1 - c0])
            self.staging.release(held)
        return out

    def write_unit(self, unit, state: dict[str, torch.Tensor]) -> None:
        keys = ("master", "exp_avg", "exp_avg_sq")
        for c0, c1 in self.chunks(unit):
            nbytes = round_up((c1 - c0) * _F32)
            held = self.staging.acquire(nbytes)
            buf = held[:nbytes]
            f32 = buf.view(torch.float32)
            for key, off in zip(keys, self._offsets(unit, c0)):
                if key not in state:
                    continue
                f32.zero_()
                f32[: c1 - c0].copy_(state[key].reshape(-1)[c0:c1])
                self._file().write(buf, off).wait()
            self.staging.release(held)

    def nbytes(self) -> int:
        return 0  # nothing resident: see the swap space and staging in the memory report
