"""A generic optimizer's state on NVMe (``ZeroOptimizer`` with ``offload_optimizer: nvme``).

[Note: a generic optimizer's state on NVMe]
The inner optimizer makes its state lazily, so its layout is learned before training from a
*probe*: the class built on a small stand-in (``flat``: a vector of 8 elements per group;
``whole``: a zero tensor of each distinct parameter shape and settings per group, the
settings being bitsandbytes' per-parameter overrides, e.g. an embedding's 32-bit state, held
in a manager of the probe's own) and stepped once. Every
state tensor the probe shows gets a region of its own in this rank's ``gstate.swap``
(O_DIRECT, 4 KiB-aligned, private, in the engine's swap folder, removed with it): per unit
and key for ``flat`` (a tensor of the shard's length: a segment's state is a slice of it),
per owned parameter and key for ``whole`` (the probe's shape and dtype). Scalars (step
counts) stay in memory. State made at construction (Adagrad's accumulator) is replayed
from the probe, for ``flat`` as one value per element.
A step streams through the NVMe store's pipeline (``NvmeStore.pipeline``, as ZeroAdamW's:
staging slots, reads ahead, writes behind, in order; an overlapped step launches units as
backward finishes them and reads ahead of their launch). A chunk is, for ``flat``, a piece
of a unit's shard that fits a staging slot with its fp32 master, gradient and per-element
state (starting at a page boundary in every region); for ``whole``, the unit (its
parameters must be whole), in a buffer of its own when larger than a slot, three at most.
The slot holds the chunk's master (from the optim file, or updated in place in the
parameter file's pages with fp32 compute) and its state regions; the inner optimizer steps
with only this chunk's tensors holding a gradient (the others are skipped, so indices into
the groups stay as they are), and the pipeline writes master and state back. Every chunk
of a segment starts from the scalars the segment had before the step (``begin_step``). So
the inner ``step()`` runs once per chunk: an optimizer that keeps state in its parameter
groups (a step counter in the group) is refused here, which the probe finds out. An
overlapped step carries its updates into the next forward as ZeroAdamW's does, with the
hyper-parameters frozen at ``step()``; the step's bracket (``begin_step`` / ``end_step``)
closes when the last carried update is made. The Adam regions the engine's optim file
keeps for ZeroAdamW stay unused (the master's is used).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field

import torch

from ..memory.aio import SwapFile, aligned_empty
from ..memory.swap import round_up
from .state_store import NvmeStore

__all__ = ["NvmeGenericState", "bnb_manager", "private_manager", "probe_layout"]

_PROBE = 8  # elements of the flat probe
_F32 = 4
_PAGE = 4096  # O_DIRECT offsets and lengths are multiples of this many bytes


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


def bnb_manager(opt):
    """The per-parameter settings manager of a bitsandbytes optimizer ``opt``; None for other
    optimizers (and for None)."""
    mng = getattr(opt, "mng", None)
    return mng if hasattr(mng, "module_weight_config_triple") else None


def private_manager(opt, index2config: dict) -> None:
    """Give the bitsandbytes optimizer ``opt`` a settings manager of its own, holding
    ``index2config`` ((group, index) -> per-parameter settings), instead of bitsandbytes'
    process-wide one, where every optimizer of the process leaves its entries (by index, and
    by id() of parameters that may be gone, whose ids new tensors reuse). Nothing for other
    optimizers."""
    shared = bnb_manager(opt)
    if shared is None:
        return
    own = object.__new__(type(shared))
    own.initialize()
    own.index2config.update({k: dict(v) for k, v in index2config.items()})
    opt.mng = own


def probe_layout(
    cls, kwargs: dict, hyper: dict, shape: tuple[int, ...], flat: bool, config: dict | None = None
) -> Probe:
    """Build ``cls`` over a zero tensor of ``shape`` with one group of ``hyper`` (and, for a
    bitsandbytes optimizer, the parameter's own settings ``config``) and step it once with
    a zero gradient; raises ValueError for what this tier cannot hold."""
    p = torch.zeros(shape)
    opt = cls([{**hyper, "params": [p]}], **kwargs)
    private_manager(opt, {(0, 0): config} if config else {})
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


def _items(config: dict | None) -> tuple:
    """Per-parameter settings as a key: their items, sorted."""
    return tuple(sorted((config or {}).items()))


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and bool(torch.equal(a, b))
    return a == b


class NvmeGenericState(NvmeStore):
    """The inner optimizer's tensors in ``gstate.swap``, scalars in memory, streamed through
    the NVMe store's pipeline; see [Note: a generic optimizer's state on NVMe]."""

    previews = False

    def __init__(self, opt, hyper: list[dict], kwargs: dict, overrides: dict[int, dict]) -> None:
        """``overrides``: id(model parameter) -> its own settings (bitsandbytes'), which the
        probe of a whole parameter is made with."""
        engine = opt.engine
        in_place = engine.config.map_param_file
        super().__init__(engine.swap, engine.staging, engine.optim_layout, in_place)
        self.opt, self.engine = opt, engine
        cls = opt.optimizer_class
        # (group, shape, the parameter's own settings as sorted items) -> its probe
        self.probes: dict[tuple, Probe] = {}
        self.whole_probe: dict[str, tuple] = {}  # whole parameter's name -> its probe's key
        self.regions: dict[tuple, _Region] = {}
        at = 0

        def region(key, dtype, shape) -> None:
            nonlocal at
            self.regions[key] = _Region(at, dtype, shape)
            at += round_up(self.regions[key].numel * dtype.itemsize)

        if opt.layout == "flat":
            for gi, h in enumerate(hyper):
                self.probes[self.probe_key(gi)] = probe_layout(cls, kwargs, h, (_PROBE,), flat=True)
            for index, segs in opt.unit_segments.items():
                unit = segs[0].unit
                keys: dict[str, torch.dtype] = {}
                for seg in segs:
                    for k, (dtype, _) in self.probes[self.probe_key(seg.group)].tensors.items():
                        keys.setdefault(k, dtype)
                for k, dtype in keys.items():
                    region(("u", index, k), dtype, (unit.shard_numel,))
        else:
            for _, slot, key in opt.whole_params:
                gi = opt.group_of_key(key)
                config = overrides.get(id(slot.param))
                pk = (gi, tuple(slot.shape), _items(config))
                if pk not in self.probes:
                    self.probes[pk] = probe_layout(
                        cls, kwargs, hyper[gi], tuple(slot.shape), flat=False, config=config
                    )
                self.whole_probe[slot.name] = pk
                for k, (dtype, shape) in self.probes[pk].tensors.items():
                    region(("p", slot.name, k), dtype, shape)
        self.scalars: dict[int, dict[str, object]] = {}  # id(inner key) -> scalar state
        self.present: set[int] = set()  # id(inner key) whose state exists
        # During a step (see begin_step): what held before it, and what the chunks made.
        self._before: tuple[set[int], dict[int, dict]] | None = None
        # Flat layout: chunks that fit a staging slot with their fp32 master and gradient
        # and the per-element state of each element.
        per_element = 2 * _F32 + max(
            (sum(d.itemsize for d, _ in p.tensors.values()) for p in self.probes.values()),
            default=0,
        )
        # Chunks start at multiples of ``align`` elements: page-aligned in every region.
        smallest = min(
            (d.itemsize for p in self.probes.values() for d, _ in p.tensors.values()),
            default=_F32,
        )
        align = _PAGE // min(smallest, _F32)
        chunk = self.staging.slot // per_element // align * align
        self.chunk = max(align, chunk)  # beyond a slot: a buffer of its own (acquire)
        self.file = None
        self.nbytes = at
        if at:
            swap = self.swap
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

    def close(self) -> None:
        """Close and remove this state's swap file (the optimizer was replaced)."""
        if self.file is None:
            return
        self.file.close()
        self.swap.files.pop("gstate", None)
        self.swap.total_bytes -= self.file.size
        self.file.path.unlink(missing_ok=True)
        self.file = None

    # ------------------------------------------------------------------------- I/O
    def probe_key(self, group: int) -> tuple:
        """Which probe describes a flat segment of ``group``."""
        return (group, (_PROBE,), ())

    def made_for(self, overrides: dict[int, dict]) -> bool:
        """Whether the whole parameters' probes were made with these settings."""
        return all(
            _items(overrides.get(id(slot.param))) == self.whole_probe[slot.name][2]
            for _, slot, _ in self.opt.whole_params
        )

    def _master_location(self, unit) -> tuple[object, int]:
        """(file, offset) of the unit's fp32 master shard."""
        if unit.placement.master_in_param_file:
            p = unit.params.extent
            return p.file, p.offset
        optim = self.swap.extent("optim", unit.index)
        return optim.file, optim.offset

    def chunks(self, unit) -> list[tuple[int, int]]:
        """The pieces of ``unit``'s shard a step streams: chunks of ``chunk`` elements (flat
        layout), or the whole shard (whole parameters)."""
        n = unit.shard_numel
        if self.opt.layout != "flat":
            return [(0, n)]
        return [(c0, min(c0 + self.chunk, n)) for c0 in range(0, n, self.chunk)]

    @property
    def slots(self) -> int:
        # A whole unit may exceed a staging slot: three at most (read ahead, updated,
        # written back), as ZeroAdamW's smallest pipeline.
        return self.layout.slots if self.opt.layout == "flat" else 3

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A staging slot, or for a whole unit larger than one a buffer of its own."""
        if nbytes > self.staging.slot:
            return aligned_empty(round_up(nbytes), torch.uint8)
        return self.staging.acquire(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.staging.slot:
            self.staging.release(buf)

    def _state_sizes(self, unit, c0: int, c1: int):
        """(region key, region, bytes moved) of the chunk's state, in slot order."""
        for key, r in self._regions_of(unit):
            n = (c1 - c0) if key[0] == "u" else r.numel  # a shard-long region: the chunk's
            yield key, r, n * r.dtype.itemsize

    def _state_bytes(self, unit, c0: int, c1: int) -> int:
        sizes = sum(round_up(nb) for _, _, nb in self._state_sizes(unit, c0, c1))
        return round_up((c1 - c0) * _F32) + sizes

    def _pieces(self, unit, c0: int, c1: int, buf: torch.Tensor, in_place: bool = False) -> list:
        """(part of ``buf``, file, offset) of the chunk's master (first; none when updated in
        place) and of each state region. The master takes the first bytes of ``buf``; a
        master in the parameter file (buffered I/O) moves exactly its bytes."""
        n = c1 - c0
        out = []
        at = round_up(n * _F32)
        if not in_place:
            file, offset = self._master_location(unit)
            size = n * _F32 if unit.placement.master_in_param_file else at
            out.append((buf[:size], file, offset + c0 * _F32))
        for key, r, nb in self._state_sizes(unit, c0, c1):
            offset = r.offset + (c0 * r.dtype.itemsize if key[0] == "u" else 0)
            out.append((buf[at : at + round_up(nb)], self.file, offset))
            at += round_up(nb)
        return out

    def views(self, entry):
        """The chunk's fp32 master and its state (region key -> tensor) in its slot."""
        unit, c0, c1 = entry.item
        buf, n = entry.buf, c1 - c0
        master = buf[: n * _F32].view(torch.float32)
        state, at = {}, round_up(n * _F32)
        for key, r, nb in self._state_sizes(unit, c0, c1):
            part = buf[at : at + nb].view(r.dtype)
            state[key] = part if key[0] == "u" else part.view(r.shape)
            at += round_up(nb)
        return master, state

    def _regions_of(self, unit):
        if self.opt.layout == "flat":
            for k in self._flat_keys(unit):
                yield ("u", unit.index, k), self.regions["u", unit.index, k]
            return
        for u, slot, _ in self.opt.whole_params:
            if u is unit:
                for key, r in self.regions.items():
                    if key[0] == "p" and key[1] == slot.name:
                        yield key, r

    def _flat_keys(self, unit) -> list[str]:
        return [k for (kind, i, k) in self.regions if kind == "u" and i == unit.index]

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

    def install(self, loaded: dict, targets) -> None:
        """Put the state of ``targets`` ((inner key, probe key, region prefix, slice or None))
        into the inner optimizer: views of ``loaded`` (a chunk's region key -> tensor),
        scalars, or what the class makes at construction for a key without state yet."""
        inner = self.opt.inner
        present, scalars = self._before or (self.present, self.scalars)
        for key, probe_key, prefix, span in targets:
            if id(key) in present:
                # Copies: the inner step may count in place (``step += 1``), and every
                # chunk of a segment starts from the scalars it had before the step.
                st = {
                    k: v.clone() if torch.is_tensor(v) else v
                    for k, v in scalars.get(id(key), {}).items()
                }
                for rk, buf in loaded.items():
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

    def collect(self, loaded: dict, targets) -> None:
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
                if rk in loaded:
                    dst = loaded[rk][span] if span is not None else loaded[rk]
                    if dst.dtype != v.dtype or dst.shape != v.shape:
                        raise RuntimeError(
                            f"{self.opt.optimizer_class.__name__} made state {k} as "
                            f"{v.dtype} {tuple(v.shape)} where its probe showed {dst.dtype} "
                            f"{tuple(dst.shape)}; it cannot be kept on NVMe"
                        )
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
        file, offset = self._master_location(unit)
        for h in unit.param_file_writes:
            h.wait()
        master = aligned_empty(unit.shard_numel, torch.float32)
        file.read(master, offset).wait()
        return master

    def write_master(self, unit, master: torch.Tensor) -> None:
        file, offset = self._master_location(unit)
        buf = aligned_empty(unit.shard_numel, torch.float32)
        buf.copy_(master.reshape(-1))
        if unit.placement.master_in_param_file:
            unit.keep_private()  # a gather mapping that file must not see the change
        file.write(buf, offset).wait()
