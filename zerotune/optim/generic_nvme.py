"""A generic optimizer's state on NVMe (``ZeroOptimizer`` with ``offload_optimizer: nvme``).

[Note: a generic optimizer's state on NVMe]
The inner optimizer makes its state lazily, so its layout is learned before training from a
*probe*: the class built on a small stand-in (``flat``: a vector of 8 elements per group;
``whole``: a zero tensor of each distinct parameter shape per group) and stepped once. Every
state tensor the probe shows gets a region of its own in this rank's ``gstate.swap``
(O_DIRECT, 4 KiB-aligned, private, in the engine's swap folder, removed with it): per unit
and key for ``flat`` (a tensor of the shard's length: a segment's state is a slice of it),
per owned parameter and key for ``whole`` (the probe's shape and dtype). Scalars (step
counts) stay in memory. State made at construction (Adagrad's accumulator) is replayed
from the probe, for ``flat`` as one value per element.
A step streams chunk after chunk: for ``flat``, pieces of each unit's shard sized so that
three (read ahead, updated, written back) fit ``staging_bytes`` (fp32 master, gradient and
the per-element state of each element); for ``whole``, each unit whole (its parameters must
be). A chunk's fp32 master (from the optim file, or the parameter file with fp32 compute),
gradient and state are read into host buffers (the next chunk's reads are issued before this
one is updated), the inner optimizer steps with only this chunk's tensors holding a gradient
(the others are skipped, so indices into the groups stay as they are), and the new master and
state are written back while the next chunk is updated. Every chunk of a segment starts
from the scalars the segment had before the step (``begin_step``). So the inner ``step()``
runs once per chunk: an optimizer that keeps state in its parameter groups (a step counter in
the group) is refused here, which the probe finds out. The Adam regions the engine's optim
file keeps for ZeroAdamW stay unused (the master's is used).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field

import torch

from ..memory.aio import SwapFile, aligned_empty
from ..memory.swap import round_up

__all__ = ["NvmeGenericState", "probe_layout"]

_PROBE = 8  # elements of the flat probe
_F32 = 4
_CHUNK_ALIGN = 4096  # chunks start at multiples of this many elements: aligned offsets


@dataclass
class _Region:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Probe:
    """What the inner optimizer keeps for one parameter (see [Note: a generic optimizer's
    state on NVMe]): its tensors' dtypes and shapes, and what it makes at construction."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    eager: dict[str, object] = field(default_factory=dict)  # key -> tensor or scalar


def probe_layout(cls, kwargs: dict, hyper: dict, shape: tuple[int, ...], flat: bool) -> Probe:
    """Build ``cls`` over a zero tensor of ``shape`` with one group of ``hyper`` and step it
    once with a zero gradient; raises ValueError for what this tier cannot hold."""
    p = torch.zeros(shape)
    opt = cls([{**hyper, "params": [p]}], **kwargs)
    eager = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(p, {}).items()}
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    p.grad = torch.zeros_like(p)
    opt.step()
    after = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    name = cls.__name__
    if before.keys() != after.keys() or any(not _same(before[k], after[k]) for k in before):
        changed = sorted(k for k in after if k not in before or not _same(before[k], after[k]))
        raise ValueError(
            f"{name} keeps state in its parameter groups ({', '.join(changed)}): with "
            "offload_optimizer: nvme its step runs once per unit; use offload_optimizer: cpu"
        )
    out = Probe()
    for k, v in opt.state[p].items():
        if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 1:
            if flat and tuple(v.shape) != shape:
                raise ValueError(
                    f"{name} keeps {k} of shape {tuple(v.shape)} for a parameter slice of "
                    f"{shape[0]} elements: it is not per element; use layout='whole'"
                )
            out.tensors[k] = (v.dtype, tuple(v.shape))
    for k, v in eager.items():
        if torch.is_tensor(v) and k in out.tensors:
            if flat and not bool((v == v.reshape(-1)[0]).all()):
                raise ValueError(f"{name} starts {k} with values that differ by element")
        out.eager[k] = v
    return out


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and bool(torch.equal(a, b))
    return a == b


class _Loaded:
    """One unit's buffers during the step: its master, gradient and state, and the reads
    still in flight."""

    def __init__(self, unit, c0: int = 0, c1: int | None = None) -> None:
        self.unit = unit
        self.c0, self.c1 = c0, unit.shard_numel if c1 is None else c1
        self.master: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.state: dict[tuple, torch.Tensor] = {}  # region key -> host tensor
        self.handles: list = []

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []


class NvmeGenericState:
    """The inner optimizer's tensors in ``gstate.swap``, scalars in memory; see [Note: a
    generic optimizer's state on NVMe]."""

    def __init__(self, opt, hyper: list[dict], kwargs: dict) -> None:
        engine = opt.engine
        self.opt, self.engine = opt, engine
        self.layout = engine.optim_layout
        cls = opt.optimizer_class
        self.probes: dict[tuple[int, tuple[int, ...]], Probe] = {}  # (group, shape)
        self.regions: dict[tuple, _Region] = {}
        at = 0

        def region(key, dtype, shape) -> None:
            nonlocal at
            self.regions[key] = _Region(at, dtype, shape)
            at += round_up(self.regions[key].numel * dtype.itemsize)

        if opt.layout == "flat":
            for gi, h in enumerate(hyper):
                self.probes[gi, (_PROBE,)] = probe_layout(cls, kwargs, h, (_PROBE,), flat=True)
            for index, segs in opt._unit_segments.items():
                unit = segs[0].unit
                keys: dict[str, torch.dtype] = {}
                for seg in segs:
                    for k, (dtype, _) in self.probes[seg.group, (_PROBE,)].tensors.items():
                        keys.setdefault(k, dtype)
                for k, dtype in keys.items():
                    region(("u", index, k), dtype, (unit.shard_numel,))
        else:
            for _, slot, key in opt._whole:
                gi = opt.group_of_key(key)
                probe = self.probes.get((gi, tuple(slot.shape)))
                if probe is None:
                    probe = probe_layout(cls, kwargs, hyper[gi], tuple(slot.shape), flat=False)
                    self.probes[gi, tuple(slot.shape)] = probe
                for k, (dtype, shape) in probe.tensors.items():
                    region(("p", slot.name, k), dtype, shape)
        self.scalars: dict[int, dict[str, object]] = {}  # id(inner key) -> scalar state
        self.present: set[int] = set()  # id(inner key) whose state exists
        # During a step (see begin_step): what held before it, and what the chunks made.
        self._before: tuple[set[int], dict[int, dict]] | None = None
        # Flat layout: chunks such that three (read ahead, updated, written back) fit in
        # staging_bytes: fp32 master and gradient and the per-element state of each element.
        per_element = 2 * _F32 + max(
            (sum(d.itemsize for d, _ in p.tensors.values()) for p in self.probes.values()),
            default=0,
        )
        chunk = engine.config.staging_bytes // (3 * per_element)
        self.chunk = max(_CHUNK_ALIGN, chunk // _CHUNK_ALIGN * _CHUNK_ALIGN)
        self.file = None
        self.nbytes = at
        if at:
            swap = engine.swap
            free = shutil.disk_usage(swap.dir).free
            if at > free:
                from ..config import ConfigError

                raise ConfigError(
                    f"nvme_path {swap.root} has {free:,} bytes free; {cls.__name__}'s state "
                    f"needs {at:,} more on this rank"
                )
            self.file = SwapFile(
                swap.dir / "gstate.swap",
                at,
                threads=engine.config.aio_threads,
                block_bytes=engine.config.aio_block_bytes,
                queue_depth=engine.config.aio_queue_depth,
                direct=True,
            )
            swap.files["gstate"] = self.file  # closed and removed with the swap space
            swap.total_bytes += self.file.size

    # ------------------------------------------------------------------------- I/O
    def probe_key(self, group: int, shape) -> tuple[int, tuple[int, ...]]:
        """Which probe describes a flat segment (``shape`` None) or a whole parameter."""
        return (group, (_PROBE,) if shape is None else tuple(shape))

    def _master_location(self, unit) -> tuple[object, int, bool]:
        """(file, offset, buffered) of the unit's fp32 master shard."""
        if unit.placement.master_in_param_file:
            p = unit.params.extent
            return p.file, p.offset, True
        optim = self.engine.swap.extent("optim", unit.index)
        return optim.file, optim.offset, False

    def chunks(self, unit) -> list[tuple[int, int]]:
        """The pieces of ``unit``'s shard a step streams: chunks of ``chunk`` elements (flat
        layout), or the whole shard (whole parameters)."""
        n = unit.shard_numel
        if self.opt.layout != "flat":
            return [(0, n)]
        return [(c0, min(c0 + self.chunk, n)) for c0 in range(0, n, self.chunk)]

    def start(
        self,
        unit,
        c0: int = 0,
        c1: int | None = None,
        with_grad: bool = True,
        with_state: bool = True,
    ) -> _Loaded:
        """Issue the reads of elements ``[c0, c1)`` of ``unit``'s master, gradient and
        per-element state (or its whole parameters' state)."""
        loaded = _Loaded(unit, c0, c1)
        c1 = loaded.c1
        n = c1 - c0
        file, offset, buffered = self._master_location(unit)
        for h in unit.param_file_writes:
            h.wait()
        loaded.master = aligned_empty(n, torch.float32)
        loaded.handles.append(file.read(loaded.master, offset + c0 * _F32))
        for key, r in self._regions_of(unit) if with_state else ():
            if key[0] == "u":  # a shard-long region: this chunk of it
                buf = aligned_empty(n, r.dtype)
                loaded.handles.append(self.file.read(buf, r.offset + c0 * r.dtype.itemsize))
                loaded.state[key] = buf
            else:
                buf = aligned_empty(r.numel, r.dtype)
                loaded.handles.append(self.file.read(buf, r.offset))
                loaded.state[key] = buf.view(r.shape)
        if with_grad and not unit.grad_is_zero:
            loaded.grad = self._grad(unit, c0, c1, loaded)
        return loaded

    def _grad(self, unit, c0: int, c1: int, loaded: _Loaded) -> torch.Tensor:
        """The chunk's gradient: a view of the shard in memory, or read from its file."""
        grad = unit.grads.view(unit, c0, c1)
        if grad is not None:
            return grad
        unit.wait_writes()  # spilled gradients must be on disk first
        buf = aligned_empty(c1 - c0, torch.float32)
        loaded.handles.append(unit.grads.read(unit, c0, c1, buf))
        return buf

    def _regions_of(self, unit):
        if self.opt.layout == "flat":
            for k in self._flat_keys(unit):
                yield ("u", unit.index, k), self.regions["u", unit.index, k]
            return
        for u, slot, _ in self.opt._whole:
            if u is unit:
                for key, r in self.regions.items():
                    if key[0] == "p" and key[1] == slot.name:
                        yield key, r

    def _flat_keys(self, unit) -> list[str]:
        return [k for (kind, i, k) in self.regions if kind == "u" and i == unit.index]

    def finish(self, loaded: _Loaded, master_changed: bool = True) -> list:
        """Write the unit's master (when changed) and state back; returns the handles."""
        unit, c0 = loaded.unit, loaded.c0
        handles = []
        if master_changed:
            file, offset, buffered = self._master_location(unit)
            if buffered:
                unit.keep_private()  # a gather mapping that file must not see the change
            h = file.write(loaded.master, offset + c0 * _F32)
            handles.append(h)
            if buffered:
                unit.param_file_writes.append(h)  # a gather waits for it
        for key, buf in loaded.state.items():
            r = self.regions[key]
            at = r.offset + (c0 * r.dtype.itemsize if key[0] == "u" else 0)
            handles.append(self.file.write(buf.reshape(-1), at))
        return handles

    # ------------------------------------------------------------------------ state
    def begin_step(self) -> None:
        """A step starts: every chunk of a segment starts from the state (presence and
        scalars) the segment had before it; ``collect`` updates those as chunks finish."""
        self._before = (set(self.present), {k: dict(v) for k, v in self.scalars.items()})

    def end_step(self) -> None:
        self._before = None

    @property
    def in_step(self) -> bool:
        return self._before is not None

    def install(self, loaded: _Loaded, targets) -> None:
        """Put the state of ``targets`` ((inner key, probe key, region prefix, slice or None))
        into the inner optimizer: views of the loaded buffers, scalars, or what the class
        makes at construction for a key without state yet."""
        inner = self.opt.inner
        present, scalars = self._before or (self.present, self.scalars)
        for key, probe_key, prefix, span in targets:
            if id(key) in present:
                st = dict(scalars.get(id(key), {}))
                for rk, buf in loaded.state.items():
                    if rk[:-1] == prefix:
                        st[rk[-1]] = buf[span] if span is not None else buf
                inner.state[key] = st
            else:
                inner.state.pop(key, None)
                probe = self.probes[probe_key]
                if probe.eager:
                    inner.state[key] = self._eager(probe, key, span)

    def _eager(self, probe: Probe, key, span) -> dict:
        st = {}
        for k, v in probe.eager.items():
            if torch.is_tensor(v) and k in probe.tensors:
                if span is not None:  # one value per element (checked by the probe)
                    first = v.reshape(-1)[0].item()
                    v = torch.full((span.stop - span.start,), first, dtype=v.dtype)
                st[k] = v.clone()
            else:
                st[k] = v.clone() if torch.is_tensor(v) else v
        return st

    def collect(self, loaded: _Loaded, targets) -> None:
        """Take the state of ``targets`` back out of the inner optimizer into the buffers
        (the optimizer may have replaced a tensor rather than updated it) and memory."""
        inner = self.opt.inner
        for key, _, prefix, span in targets:
            st = inner.state.pop(key, None)
            if not st:
                continue
            scalars = {}
            for k, v in st.items():
                rk = (*prefix, k)
                if rk in loaded.state:
                    dst = loaded.state[rk][span] if span is not None else loaded.state[rk]
                    if dst.data_ptr() != v.data_ptr():
                        dst.copy_(v)
                elif torch.is_tensor(v) and v.numel() > 1:
                    raise RuntimeError(
                        f"{self.opt.optimizer_class.__name__} made state {k} that its probe did "
                        "not show; it cannot be kept on NVMe"
                    )
                else:
                    scalars[k] = v.clone() if torch.is_tensor(v) else v
            self.scalars[id(key)] = scalars
            self.present.add(id(key))

    def flat_keys(self, unit, segments) -> dict[str, torch.dtype]:
        """Per-element state keys of ``unit`` (flat layout) once any segment has state."""
        if not any(id(seg.key) in self.present for seg in segments):
            return {}
        return {
            k: r.dtype
            for (kind, i, k), r in self.regions.items()
            if kind == "u" and i == unit.index
        }

    def read_region(self, rk) -> torch.Tensor:
        r = self.regions[rk]
        buf = aligned_empty(r.numel, r.dtype)
        self.file.read(buf, r.offset).wait()
        return buf.view(r.shape).clone()

    def write_region(self, rk, value: torch.Tensor) -> None:
        r = self.regions.get(rk)
        if r is None:
            raise ValueError(f"state {rk[-1]} has no place on NVMe (not in the probe)")
        buf = aligned_empty(r.numel, r.dtype)
        buf.copy_(value.reshape(-1))
        self.file.write(buf, r.offset).wait()

    def state_of(self, key, prefix) -> dict:
        """The state of a whole parameter's inner key: its tensors read from the file, its
        scalars (checkpoints)."""
        if id(key) not in self.present:
            return {}
        st = dict(self.scalars.get(id(key), {}))
        for rk in self.regions:
            if rk[:-1] == prefix:
                st[rk[-1]] = self.read_region(rk)
        return st

    def put_state(self, key, prefix, span, st: dict) -> None:
        """One inner key's state (checkpoint loading): its whole-parameter tensors to the
        file (a flat segment's per-element state arrives with ``write_region``), scalars
        to memory."""
        scalars = {}
        for k, v in st.items():
            rk = (*prefix, k)
            if rk in self.regions:
                if span is None:
                    self.write_region(rk, v)
            elif torch.is_tensor(v) and v.numel() > 1:
                raise ValueError(f"state {k} has no place on NVMe (not in the probe)")
            else:
                scalars[k] = v
        self.scalars[id(key)] = scalars
        self.present.add(id(key))

    def forget(self, key) -> None:
        self.present.discard(id(key))
        self.scalars.pop(id(key), None)

    def read_master(self, unit) -> torch.Tensor:
        loaded = self.start(unit, with_grad=False, with_state=False)
        loaded.wait()
        return loaded.master

    def write_master(self, unit, master: torch.Tensor) -> None:
        loaded = _Loaded(unit)
        loaded.master = aligned_empty(unit.shard_numel, torch.float32)
        loaded.master.copy_(master.reshape(-1))
        for h in self.finish(loaded):
            h.wait()
