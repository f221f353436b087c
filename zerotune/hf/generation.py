"""Generation from a model sharded at stage 3: the whole model gathered once per ``generate``.

[Note: gathered for generation]
At stage 3 a unit is gathered when its forward starts and released when it ends. Training
wants that: one gather per unit per step. ``generate`` runs one forward per new token, so
the same rule gathers every unit once per token: an all-gather over the ranks, or a read
from the parameter tier in host memory or on NVMe, for every layer and every token. That
is what makes sampling in TRL's GRPO and RLOO crawl.

``gather_for_generation`` gives the model instance attributes ``generate`` and
``generate_batch`` (continuous batching) that run the class's own inside
``engine.gathered()``: every unit is gathered once, the tokens are sampled from gathered
weights, and on return the units are released. ZeroTrainer follows TRL's
``ds3_gather_for_generation`` flag (default True), which asks DeepSpeed for the same. The
whole model must fit in memory, so each call first checks the units still to gather
against 80% of the free memory of the engine's device (or a given budget), against
``max_live_bytes`` when set, and mapped NVMe gathers against the open-file limit. When it
does not fit on some rank, every rank gathers unit by unit and one warning says so. Ranks
agree with one all-reduce, because ``gathered()`` is a collective: one rank alone in it
would wait forever. For the same reason ``generate_batch``, whose ranks do not step
together, is refused at world size > 1 whenever it would run unit by unit: when the model
does not fit, or when gathering is off (``ds3_gather_for_generation=False``).
"""

from __future__ import annotations

import logging
import resource

import torch
from torch import nn

from .. import dist as zdist
from ..estimate import format_bytes
from ..sharding.unit import UnitState

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

FREE_SHARE = 0.8  # of the free device memory the gathered model may take


METHODS = ("generate", "generate_batch")  # transformers' generation entry points


class GatheredGenerate:
    """``model.generate`` (or ``generate_batch``) with the whole model gathered for the call
    (see [Note: gathered for generation]). Held by the model as an attribute, so that a copy
    of the model gets its own."""

    def __init__(self, model: nn.Module, name: str, budget: int | None = None, gather: bool = True):
        self.model = model
        self.name = name
        self.budget = budget
        self.gather = gather  # False: only generate_batch's refusal at world size > 1
        self.warned = False

    def __call__(self, *args, **kwargs):
        model = self.model
        generate = getattr(type(model), self.name)
        engine = getattr(model, "_zerotune_engine", None)
        if engine is None or engine.config.stage != 3:
            return generate(model, *args, **kwargs)
        if self.gather and self._fits(engine):
            with engine.gathered():
                return generate(model, *args, **kwargs)
        if self.name == "generate_batch" and engine.world > 1:
            # Continuous batching does not keep the ranks stepping together (no synced_gpus):
            # unit by unit, their gathers would wait for each other forever.
            why = (
                "which does not fit (see the warning above)"
                if self.gather
                else "which is off (TRL: ds3_gather_for_generation=False)"
            )
            raise RuntimeError(
                f"zerotune: generate_batch at world size > 1 needs the whole model gathered, "
                f"{why}; use generate instead (TRL: use_transformers_paged=False)"
            )
        return generate(model, *args, **kwargs)

    def _fits(self, engine) -> bool:
        """Whether the model may be gathered whole, agreed by every rank (a collective)."""
        # Units whose gather takes memory of its own (not a shard that is the whole buffer).
        units = [u for u in engine.units if not u.persistent and u.params.lends_storage(u)]
        fresh = sum(u.gathered_bytes for u in units if u.state is UnitState.SHARDED)
        whole = sum(u.gathered_bytes for u in units)
        room = self.budget if self.budget is not None else int(FREE_SHARE * free_bytes(engine))
        cap = engine.config.max_live_bytes
        # Each mapped gather holds a file descriptor: keep to half the process's limit.
        mapped = sum(1 for u in units if u.params.mapped)
        maps = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2
        over = [fresh - room, whole - cap if cap > 0 else -1, mapped - maps]
        over = torch.tensor(over, dtype=torch.float64, device=engine.device)
        if engine.world > 1:
            zdist.all_reduce_max(over, group=engine.group)
        over_room, over_cap, over_maps = over.tolist()
        if max(over_room, over_cap, over_maps) <= 0:
            return True
        if not self.warned:
            self.warned = True
            why = (
                f"{format_bytes(int(over_room))} more than the memory it may take on some rank"
                if over_room > 0
                else f"more than max_live_bytes ({format_bytes(cap)})"
                if over_cap > 0
                else "more mapped gathers than half the open-file limit allows"
            )
            log.warning(
                "zerotune: generate gathers each unit once per token: gathering the whole "
                "model (%s) would take %s; expect it to be several times slower",
                format_bytes(fresh),
                why,
            )
        return False


def free_bytes(engine) -> int:
    """Memory free for gathered weights on the engine's device: the CUDA allocator's free and
    cached-unused bytes on a GPU, the host's available memory on the CPU."""
    device = torch.device(engine.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    import psutil

    return psutil.virtual_memory().available


def gather_for_generation(model: nn.Module, enabled: bool = True, budget: int | None = None):
    """Make ``model.generate`` and ``generate_batch`` gather the whole sharded model once per
    call (stage 3; see [Note: gathered for generation]), or with ``enabled=False`` take that
    off again (``generate_batch`` is then refused at world size > 1).

    ``model``: a model sharded by zerotune (``engine.module``). ``budget``: the bytes the
    gathered units may take (default: 80% of the free memory of the engine's device). A
    ZeroTrainer built over the model installs its own (the default budget).
    """
    for name in METHODS:
        if isinstance(model.__dict__.get(name), GatheredGenerate):
            del model.__dict__[name]
    if getattr(model, "_zerotune_engine", None) is None:
        if not enabled:
            return
        raise ValueError("gather_for_generation: the model is not sharded by zerotune")
    names = [n for n in METHODS if callable(getattr(type(model), n, None))]
    if not enabled:  # only the refusal, where nothing of the model's own is in its place
        names = [n for n in names if n == "generate_batch" and n not in model.__dict__]
    for name in names:
        if name in model.__dict__:
            raise ValueError(f"gather_for_generation: the model has its own {name} attribute")
    for name in names:
        model.__dict__[name] = GatheredGenerate(model, name, budget, gather=enabled)
