"""``torch.compile`` for a sharded model: the units' own forwards compiled, the hooks eager.

[Note: compiled units]
``torch.compile(model)`` would trace into the engine's hooks, whose gathers, file reads and
storage swaps are not graph operations (a graph that captured a released parameter fails on
its shape). ``engine.compile(**kwargs)`` compiles instead the ``forward`` of every unit
whose module holds no other unit, the blocks (with ``tile_linear_bytes``, the tiles: a block
holding tiles stays eager, as does the root). Units that are torch's own layers (embedding,
head) stay eager too: one operator gains nothing from a graph, and dynamo files every
torch.nn forward under one shared frame whose recompilation limit they would use up.
``nn.Module.__call__`` still runs the pre-forward hook (gather), the compiled forward, the
post-forward hook; autograd runs the compiled backward between the pre- and post-backward
hooks as it runs an eager one. The parameters are graph inputs (dynamo checks their shapes,
not their storage): a graph reads whatever storage the gather put under them. The class's
``forward`` is compiled once and bound to each instance, so the blocks of a class share its
graphs. A call handed a KV cache (generation; training with ``use_cache=True``, with a
warning) runs the eager forward: the cache would make dynamo compile each layer apart, and
past the limit it would run the rest eagerly for good, training included. So does a block
whose checkpoint is offloaded (``offload_activations``): dynamo does not trace the offload's
saved-tensor hooks. CUDA-graph modes (``reduce-overhead``, ``max-autotune``) are refused: a
CUDA graph replays the addresses it recorded, and a gathered parameter's memory is given
back and taken again every step. ``remove()`` (the engine's ``remove_hooks``) puts the eager
forwards back. Compiled dropout draws other random numbers than eager dropout.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from .. import dist as zdist
from .unit import Unit

__all__ = ["CompiledUnits", "compile_problem", "leaf_units"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())


@functools.cache
def _cache_class() -> type | None:
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return None
    return Cache


def carries_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a forward call is handed a transformers KV cache."""
    cache = _cache_class()
    return cache is not None and any(isinstance(v, cache) for v in (*args, *kwargs.values()))


def compile_problem(mode: str | None, backend: str | Callable | None) -> str | None:
    """Why ``torch.compile(mode=mode, backend=backend)`` cannot compile units, or None."""
    if mode in ("reduce-overhead", "max-autotune") or backend == "cudagraphs":
        what = f"mode {mode!r}" if backend != "cudagraphs" else "backend 'cudagraphs'"
        return (
            f"torch.compile {what} records CUDA graphs, which replay the parameter addresses "
            "they saw, and zerotune gathers parameters into new memory each step; use the "
            "inductor backend with mode 'default' or 'max-autotune-no-cudagraphs'"
        )
    if mode is not None:
        from torch._inductor import list_mode_options

        modes = list_mode_options()
        if mode not in modes:
            return f"torch.compile has no mode {mode!r}; choose one of " + ", ".join(
                ["default", *(m for m in modes if m != "default")]
            )
    if isinstance(backend, str) and backend not in torch.compiler.list_backends(exclude_tags=()):
        usable = [b for b in torch.compiler.list_backends() if b != "cudagraphs"]
        return f"torch.compile has no backend {backend!r} here; choose one of " + ", ".join(usable)
    return None


def leaf_units(units: list[Unit]) -> list[Unit]:
    """The units whose module contains no other unit's module."""
    owned = {id(u.module) for u in units}
    return [
        u for u in units if not any(id(m) in owned for m in u.module.modules() if m is not u.module)
    ]


class CompiledUnits:
    """The compiled forwards installed on the leaf units' modules."""

    def __init__(self, units: list[Unit], **compile_kwargs) -> None:
        problem = compile_problem(compile_kwargs.get("mode"), compile_kwargs.get("backend"))
        if problem is not None:
            raise ValueError(problem)
        self.modules: list[nn.Module] = []
        self.warned = False  # about a cache handed to a training forward
        forwards: dict[Callable, Callable] = {}
        for unit in leaf_units(units):
            module = unit.module
            if "forward" in module.__dict__:
                continue  # an instance's own forward: not ours to replace
            function = type(module).forward
            if function.__module__.startswith("torch."):
                continue  # torch's own layers (an embedding, a head): one operator each
            if function not in forwards:
                compiled = torch.compile(function, **compile_kwargs)
                forwards[function] = self._dispatching(function, compiled)
            module.forward = types.MethodType(forwards[function], module)
            self.modules.append(module)

    def _dispatching(self, eager: Callable, compiled: Callable) -> Callable:
        """A forward that runs the compiled graph, or the eager function for a call that
        carries a KV cache."""

        def forward(module, *args, **kwargs):
            if not carries_cache(args, kwargs):
                return compiled(module, *args, **kwargs)
            if torch.is_grad_enabled() and not self.warned:
                self.warned = True
                log.warning(
                    "zerotune: compiled units run eagerly when given a KV cache; this training "
                    "forward has one (use_cache=True): set model.config.use_cache = False"
                )
            return eager(module, *args, **kwargs)

        return forward

    def remove(self) -> None:
        for module in self.modules:
            del module.forward
        self.modules.clear()
