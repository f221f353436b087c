"""``torch.compile`` for a sharded model: the units' own forwards compiled, the hooks eager.

[Note: compiled units]
``torch.compile(model)`` would trace into the engine's hooks, whose gathers, file reads and
storage swaps are not graph operations (a graph that captured a released parameter fails on
its shape). ``engine.compile(**kwargs)`` compiles instead the ``forward`` of every unit
whose module holds no other unit (the blocks, the embeddings, the head).
``nn.Module.__call__`` still runs the pre-forward hook (gather), then the compiled forward,
then the post-forward hook (release; hooks on the outputs), and autograd runs the compiled
backward between the engine's pre- and post-backward hooks as it runs an eager one. The
parameters are inputs of the graph (dynamo does not specialise on a module's parameters), so
the graph reads whatever storage the gather put under them. What is compiled is the class's
``forward``, bound to each instance: the blocks of a class share its compiled graphs instead
of spending one recompilation each. Units that hold other units (the root) stay eager and
call the compiled ones. Modes with CUDA graphs (``reduce-overhead``, ``max-autotune``) are
refused: a CUDA graph replays the addresses it recorded, and a gathered parameter's memory
is given back and taken again every step. ``remove()`` (the engine's ``remove_hooks``) puts
the eager forwards back. Dropout inside a compiled graph draws other random numbers than
eager dropout, as for any compiled model.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from .unit import Unit

__all__ = ["CompiledUnits", "compile_problem", "leaf_units"]


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

        if mode not in list_mode_options():
            return f"torch.compile has no mode {mode!r}; choose one of " + ", ".join(
                ["default", *(m for m in list_mode_options() if m != "default")]
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
        compiled: dict[Callable, Callable] = {}
        for unit in leaf_units(units):
            module = unit.module
            if "forward" in module.__dict__:
                continue  # an instance's own forward: not ours to replace
            function = type(module).forward
            if function not in compiled:
                compiled[function] = torch.compile(function, **compile_kwargs)
            module.forward = types.MethodType(compiled[function], module)
            self.modules.append(module)

    def remove(self) -> None:
        for module in self.modules:
            del module.forward
        self.modules.clear()
