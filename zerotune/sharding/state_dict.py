"""``state_dict()`` and ``load_state_dict()`` of a sharded model, the writes of
``engine.gathered(modifier_rank=...)``, and ``fill_shard``: this rank's slice of a unit
written from whole weights (streaming loads use it too).

[Note: state dicts of a sharded model]
At stage 3 a released parameter is empty, and a value written into a parameter reaches a
copy the next step overwrites (the weights are the units' fp32 masters, on their tiers).
Torch's state-dict hooks on every module make both calls work as on the plain model, like
FSDP's FULL_STATE_DICT; every rank calls them (they gather). The hooks of the outermost
module of a call (the model, or its root under a wrapper such as the engine) do the work:
* ``state_dict()``: torch builds the dict, then the entries of parameters their unit
  releases become CPU copies, one unit gathered at a time in unit order (tied names share a
  copy, as torch's share storage), and tiles merge into their untiled weights. Entries of
  units gathered for good (stages 1-2, persistent units) stay torch's views, and with
  ``keep_vars=True`` all stay the parameters (the objects are wanted). Copies that would not
  fit in available host memory (on any rank) are refused before any gather: a model larger
  than memory is written streamed (``save_hf``, ``save_checkpoint``).
* ``load_state_dict()``: each module's pre-hook takes the values of its sharded parameters
  (a tiled layer's untiled weight, block by block), checks their shapes, and leaves torch a
  no-op copy (the parameter's own data), so that key matching, ``strict`` and the result are
  torch's own. At the end the values go through ``fill_shard`` and ``load_unit_state``, as in
  ``load_weights``: masters and compute copies on every tier, optimizer state untouched, a
  unit's parameters not given keeping their values.

[Note: writes inside gathered()]
An in-place write to a gathered parameter (``p.clamp_()``, a re-init) reaches the gathered
buffer, the shard itself only in fp32 at world size 1 without offload: elsewhere the release
at stage 3, or the next step (compute copies from the fp32 masters), undoes it.
``engine.gathered(what, modifier_rank=r)`` writes it back, as DeepSpeed's
``GatheredParameters(params, modifier_rank=r)`` does: when the block ends without an
exception, every rank takes each gathered unit in turn:
* rank r's values of its parameters are broadcast: the ranks' writes may differ (a re-init
  seeded per rank), and rank r's are the ones kept;
* they go into this rank's fp32 master slice through ``fill_shard``, as loads do. In
  bf16/fp16 an element whose value is still its master rounded (one nobody wrote) keeps its
  fp32 master: a block over the whole model rounds only what was written;
* a unit whose master changed on some rank (one all-reduce) goes through
  ``load_unit_state`` (masters and compute copies on every tier, gathered buffers again,
  optimizer state untouched); otherwise the other ranks copy rank r's values into their
  gathered parameters, so that their own writes go too.
Refused where a load is (``refuse_now``): at entry, before anything is gathered, and before
the first write. After an exception nothing is written back: the edits stay only where a
write without ``modifier_rank`` stays. Cost: a broadcast of each unit and a read of its
master; writes only where something changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch
from torch import nn

from .. import dist as zdist
from .tiling import TileBlock, TiledLinear, TiledWeight, merge_tiles, read_block, tiled_weights
from .unit import Unit

__all__ = [
    "WeightSources",
    "check_modifier",
    "fill_shard",
    "refuse_now",
    "state_dict_hooks",
    "units_of",
    "write_gathered",
]

Read = Callable[[int, int, torch.Tensor], None]  # (start, stop, out): flattened elements


@dataclass
class WeightSources:
    """Where each parameter's values are read from: ``readers`` maps id(parameter) to
    ``read(start, stop, out)`` over its flattened elements, ``blocks`` id(tile) to (its
    block, columns of the untiled weight) (tiling.py), ``used`` the source keys read, and
    ``converted`` what builds converted parameters (``release()`` after each unit; or
    None)."""

    readers: dict[int, Read] = field(default_factory=dict)
    blocks: dict[int, tuple[TileBlock, int]] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    converted: object = None


def fill_shard(sources: WeightSources, unit, master: torch.Tensor) -> None:
    """This rank's slice of ``unit``'s parameters, read from their sources into ``master``;
    a parameter without a source keeps what ``master`` holds."""
    lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
    for slot in unit.slots:
        a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        read = sources.readers.get(id(slot.param))
        if a < b and read is not None:
            out = master[a - lo : b - lo]
            tile = sources.blocks.get(id(slot.param))
            if tile is None:
                read(a - slot.offset, b - slot.offset, out)
            else:
                block, cols = tile
                read_block(read, cols, block, a - slot.offset, b - slot.offset, out)
    if sources.converted is not None:
        sources.converted.release()


def _reader(value: torch.Tensor) -> Read:
    flat = value.detach().reshape(-1)

    def read(start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(flat[start:stop])

    return read


@dataclass
class _Load:
    """One ``load_state_dict`` call: the module it started at, its missing-keys list (the
    one torch hands every hook of the call), and the values taken."""

    opener: nn.Module
    missing: list
    sources: WeightSources = field(default_factory=WeightSources)
    units: set = field(default_factory=set)
    # The no-op entries a tiled layer puts in for its tiles: their keys are not missing.
    stand_ins: dict[int, torch.Tensor] = field(default_factory=dict)


class _StateDictHooks:
    """See [Note: state dicts of a sharded model]."""

    def __init__(self, engine):
        self.engine = engine
        self.owner = {id(s.param): (u, s) for u in engine.units for s in u.slots}
        self.calls: list[tuple[nn.Module, str, bool]] = []  # state_dict calls open, outer first
        self.load: _Load | None = None

    # ---------------------------------------------------------------------- state_dict
    def pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix == "" or module is self.engine.module:
            # A new call (nested ones have a prefix; the model's own is the outermost, under
            # a wrapper too): nothing is open, not even what a call that raised left.
            self.calls.clear()
        self.calls.append((module, prefix, keep_vars))

    def post_save(self, module: nn.Module, sd: dict, prefix: str) -> None:
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i][0] is module and self.calls[i][1] == prefix:
                keep_vars = self.calls[i][2]
                del self.calls[i:]
                if not self.calls and not keep_vars:
                    self.whole(module, sd, prefix)
                return

    def whole(self, module: nn.Module, sd: dict, prefix: str) -> None:
        """Replace the released parameters' entries of ``module``'s subtree in ``sd`` by
        whole CPU copies; merge tiles."""
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            owned = self.owner.get(id(p))
            if owned is not None and not owned[0].persistent and prefix + name in sd:
                keys.setdefault(id(p), []).append(prefix + name)
        units = sorted({self.owner[pid][0] for pid in keys}, key=lambda u: u.index)
        if units:
            refuse_now(self.engine, "state_dict()")
        self._check_room(sum(self.owner[pid][1].numel for pid in keys), units)
        for unit in units:
            with self.engine.gathered([unit]):
                for s in unit.slots:
                    names = keys.get(id(s.param), ())
                    if names:
                        whole = s.param.detach().to("cpu", copy=True)
                        for k in names:
                            sd[k] = whole.detach()  # tied names: one storage, as torch's
        tiled = [
            TiledWeight(
                prefix + tw.name,
                tw.shape,
                tuple(TileBlock(prefix + t.name, t.rows, t.cols) for t in tw.tiles),
            )
            for tw in tiled_weights(module)
        ]
        tiled = [tw for tw in tiled if all(t.name in sd for t in tw.tiles)]
        if tiled:
            merged = merge_tiles(dict(sd), tiled)
            order = list(merged)
            for tw in tiled:  # before the layer's bias, where the untiled layer has it
                bias = tw.name[: -len("weight")] + "bias"
                if bias in merged:
                    order.remove(tw.name)
                    order.insert(order.index(bias), tw.name)
            sd.clear()  # in place: torch's post-hooks may not return a new dict
            sd.update((k, merged[k]) for k in order)

    def _check_room(self, numel: int, units: list) -> None:
        if not units:
            return
        need = numel * units[0].dtype.itemsize * zdist.ranks_on_this_host()  # all copy at once
        short = torch.tensor(
            [float(need > psutil.virtual_memory().available)], device=self.engine.device
        )
        zdist.all_reduce_max(short, self.engine.group)
        if short.item():
            raise RuntimeError(
                f"state_dict() of a model sharded at stage 3 copies every parameter into host "
                f"memory ({need / 2**30:.1f} GiB for this host's ranks), more than is "
                "available on a host: write it "
                "streamed with zerotune.save_hf or save_checkpoint, or read parts inside "
                "engine.gathered()"
            )

    # ----------------------------------------------------------------- load_state_dict
    def pre_load(self, module, sd, prefix, metadata, strict, missing, unexpected, errors):
        call = self.load
        if call is None or call.missing is not missing:
            refuse_now(self.engine, "load_state_dict()", metadata)
            call = self.load = _Load(module, missing)
        try:
            if isinstance(module, TiledLinear):
                self._take_untiled(call, module, sd, prefix)
            for name, param in module._parameters.items():
                key = prefix + name
                owned = self.owner.get(id(param))
                if owned is None or key not in sd or id(sd[key]) in call.stand_ins:
                    continue
                value = sd[key]
                if not torch.overrides.is_tensor_like(value):
                    continue  # torch says so
                _check_shape(key, value.shape, owned[1].shape)
                call.sources.readers[id(param)] = _reader(value)
                call.sources.blocks.pop(id(param), None)
                call.units.add(owned[0])
                sd[key] = param.detach()  # torch's copy_ of it changes nothing
        except BaseException:
            self.load = None  # nothing was written
            raise

    def _take_untiled(self, call: _Load, module: TiledLinear, sd, prefix: str) -> None:
        """A tiled layer's untiled ``weight`` (torch would call it unexpected: the layer
        has no such parameter) read into each tile, by block."""
        key = prefix + "weight"
        value = sd.get(key)
        if value is None or not torch.overrides.is_tensor_like(value):
            return
        _check_shape(key, value.shape, module.weight_shape)
        del sd[key]
        read, cols = _reader(value), module.weight_shape[1]
        for k, (tile, rows, cols_) in enumerate(module.blocks()):
            param = tile._parameters["weight"]
            name = f"{prefix}tiles.{k}.weight"
            call.sources.readers[id(param)] = read
            call.sources.blocks[id(param)] = (TileBlock(name, rows, cols_), cols)
            call.units.add(self.owner[id(param)][0])
            stand_in = param.detach()
            call.stand_ins[id(stand_in)] = stand_in
            sd[name] = stand_in

    def post_load(self, module: nn.Module, incompatible) -> None:
        call, missing = self.load, incompatible.missing_keys
        if call is None or call.opener is not module or call.missing is not missing:
            return
        self.load = None
        engine = self.engine
        for unit in sorted(call.units, key=lambda u: u.index):
            if all(id(s.param) in call.sources.readers for s in unit.slots):
                master = torch.zeros(unit.shard_numel, dtype=torch.float32)
            else:  # the parameters not given keep their values
                master = engine.unit_state(unit, master_only=True)["master"]
                master = master.to("cpu", torch.float32, copy=True)
            fill_shard(call.sources, unit, master)
            engine.load_unit_state(unit, {"master": master})


def refuse_now(engine, what: str, metadata: dict | None = None) -> None:
    """What cannot be done now, in one line: a forward or backward runs, or an
    overlapped step is open (some units are updated, the others wait for step());
    for a load, replacing the parameters."""
    from .hooks import in_backward

    why = None
    if in_backward() or engine.external.active:
        why = "inside a forward or backward of the model"
    elif engine.reducer.overlapping or (
        engine.optimizer is not None and engine.optimizer.step_open
    ):
        why = "between an overlapped backward and its step(): call step() first"
    elif metadata is not None and metadata.get("assign_to_params_buffers"):
        why = "with assign=True (it would replace the sharded parameters): use assign=False"
    elif metadata is not None and torch.__future__.get_swap_module_params_on_conversion():
        why = "with torch.__future__.set_swap_module_params_on_conversion(True)"
    if why is not None:
        raise RuntimeError(f"{what} of a model sharded by zerotune, {why}")


def _check_shape(key: str, given: torch.Size, expected) -> None:
    if tuple(given) != tuple(expected) and not (len(expected) == 0 and tuple(given) == (1,)):
        raise RuntimeError(
            f"load_state_dict(): size mismatch for {key}: {list(given)} given, "
            f"{list(expected)} in the model sharded by zerotune (nothing was loaded)"
        )


def state_dict_hooks(engine) -> list:
    """Hook every module of ``engine``'s model (see [Note: state dicts of a sharded
    model]); returns the handles. The hooks are functions bound to their module: a deep
    copy of the model shares them, and they ignore its modules."""
    hooks = _StateDictHooks(engine)
    handles = []
    for module in engine.module.modules():

        def pre_save(m, prefix, keep_vars, owner=module):
            if m is owner:
                hooks.pre_save(m, prefix, keep_vars)

        def post_save(m, sd, prefix, metadata, owner=module):
            if m is owner:
                hooks.post_save(m, sd, prefix)

        def pre_load(m, *args, owner=module):
            if m is owner:
                hooks.pre_load(m, *args)

        def post_load(m, incompatible, owner=module):
            if m is owner:
                hooks.post_load(m, incompatible)

        handles.append(module.register_state_dict_pre_hook(pre_save))
        handles.append(module.register_state_dict_post_hook(post_save))
        handles.append(module.register_load_state_dict_pre_hook(pre_load))
        handles.append(module.register_load_state_dict_post_hook(post_load))
    return handles


# ------------------------------------------------------------------ gathered() and writes
def units_of(engine, what) -> list:
    """The units ``engine.gathered(what)`` gathers: all of them for None, else each unit,
    module (the units owning its parameters) and parameter given, alone or in an iterable;
    in unit order, each once."""
    if what is None:
        return list(engine.units)
    owner: dict = {}  # id(parameter) -> unit, built when a module or parameter is given
    found = {}
    for item in [what] if isinstance(what, (Unit, nn.Module, torch.Tensor)) else what:
        if isinstance(item, Unit):
            found[id(item)] = item
            continue
        if not isinstance(item, (nn.Module, torch.Tensor)):
            raise TypeError(f"units, modules or parameters, not {type(item).__name__}")
        owner = owner or {id(s.param): u for u in engine.units for s in u.slots}
        params = list(item.parameters()) if isinstance(item, nn.Module) else [item]
        for p in params:
            if id(p) in owner:
                found[id(owner[id(p)])] = owner[id(p)]
            elif isinstance(item, nn.Module):
                raise ValueError("this module is not part of the sharded model")
            else:  # a parameter read through its module outside gathered() is a copy
                raise ValueError(
                    "this parameter is not part of the sharded model (read through its module "
                    "outside gathered(), a sharded parameter is a copy: pass the module)"
                )
    return sorted(found.values(), key=lambda u: u.index)


def check_modifier(engine, modifier_rank) -> None:
    """Refuse, in one line, a write-back that cannot be done (before anything is gathered
    or written); none is asked for without a modifier rank."""
    if modifier_rank is None:
        return
    what = f"engine.gathered(modifier_rank={modifier_rank!r})"
    if type(modifier_rank) is not int or not 0 <= modifier_rank < engine.world:
        raise ValueError(f"{what}: a rank of the engine's group, 0 to {engine.world - 1}")
    refuse_now(engine, what)


@torch.no_grad()
def write_gathered(engine, units: list, modifier_rank: int) -> None:
    """The values of ``units``' gathered parameters on rank ``modifier_rank`` into every
    rank's shards (see [Note: writes inside gathered()]); every rank calls it. Nothing
    without a modifier rank."""
    if modifier_rank is None:
        return
    check_modifier(engine, modifier_rank)
    mine = engine.rank == modifier_rank
    for unit in units:
        if unit.numel == 0:
            continue  # no parameters (a tied head: its weight is the embedding's)
        whole = torch.empty(unit.padded_numel, dtype=unit.dtype, device=engine.device)
        if mine:
            whole[unit.numel :].zero_()
            for s in unit.slots:
                whole[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        zdist.broadcast(whole, modifier_rank, engine.group)
        views = {id(s.param): whole[s.offset : s.offset + s.numel] for s in unit.slots}
        master = engine.unit_state(unit, master_only=True)["master"]
        master = master.to("cpu", torch.float32, copy=True)
        new = master.clone()
        fill_shard(WeightSources({k: _reader(v) for k, v in views.items()}), unit, new)
        if unit.dtype != torch.float32:  # values left as gathered keep their fp32 master
            new = torch.where(new.to(unit.dtype) == master.to(unit.dtype), master, new)
        changed = torch.tensor([float(not torch.equal(new, master))], device=engine.device)
        if zdist.all_reduce_max(changed, engine.group).item():
            engine.load_unit_state(unit, {"master": new})
        elif not mine:  # this rank's own edits, if any, go
            for s in unit.slots:
                s.param.copy_(views[id(s.param)].view(s.shape))
