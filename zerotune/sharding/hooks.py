"""Forward and backward hooks that gather, release and reduce units.

[Note: pins and hooks]
Every unit has a pin count: it stays gathered while pinned and is released when the count
falls to zero (persistent units never release).

* pre-forward(U): pin U and the units whose parameters U uses (its dependencies: tied or
  external parameters), gather them, and let the prefetcher gather the next units.
* post-forward(U): unpin. With grad enabled, a hook goes on every output tensor so that the
  first gradient reaching U's outputs runs pre-backward(U).
* pre-backward(U): pin U and its dependencies again and gather them (once per backward).
* post-backward(U): when every trainable parameter U owns has its gradient accumulated
  (``register_post_accumulate_grad_hook``), the gradient is reduce-scattered into U's gradient
  shard and U (and what it pinned) is unpinned. A parameter used by two units has one
  gradient accumulator, so it is reduced once, after all its uses.
* A unit owning frozen parameters unpins only once the gradients of every input of its
  forward calls exist too (tensor hooks on those inputs): a frozen weight's backward node
  (a frozen LayerNorm before trainable linears) may run after the trainable gradients are
  complete. A unit owning no trainable parameter (a tied output head) waits for that alone,
  so a tied head lets go of the embedding's weight right after its own backward instead of
  at the end of the pass. An input that needs no gradient (or is a leaf) keeps the unit
  pinned to the end of the pass.
* An ``nn.Embedding`` unit is not gathered for its own backward (it reads indices, not the
  weight); its parameter keeps its shape over one shared element meanwhile
  (``Unit.keep_shapes``): autograd stores a gradient only into a parameter of the
  gradient's shape.
* final callback (end of the backward pass): reduces whatever gradients are still pending
  (parameters that got no gradient this pass), releases every unit and resets the pins.

Activation checkpointing re-runs forward inside backward. A forward that runs during backward
turns its pin into U's backward pin instead of releasing, so the recomputed graph keeps its
parameters until U's gradients are reduced.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable

if TYPE_CHECKING:
    from .engine import ZeroEngine
    from .unit import Unit

__all__ = ["in_backward", "install_hooks", "params_reached", "tensors_in"]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts (HF ModelOutput is a dict)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def params_reached(outputs: list[torch.Tensor]) -> tuple[set[int], bool]:
    """``(ids, hidden)``: the ``id`` of every leaf tensor (parameter) a backward from
    ``outputs`` would give a gradient, found by walking their autograd graph; ``hidden``:
    the walk met a reentrant activation checkpoint, whose parameters only its recomputation
    in backward shows."""
    reached: set[int] = set()
    hidden = False
    seen: set = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # AccumulateGrad
        if leaf is not None:
            reached.add(id(leaf))
        elif _is_reentrant_checkpoint(fn):
            hidden = True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return reached, hidden


def _is_reentrant_checkpoint(fn) -> bool:
    """Whether autograd node ``fn`` is a reentrant activation checkpoint's (its forward ran
    without a graph; backward recomputes it)."""
    return type(fn).__name__ == "CheckpointFunctionBackward"


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


def install_hooks(engine: ZeroEngine) -> list:
    """Register the hooks of every unit; returns the handles (to remove them)."""
    handles = []
    for unit in engine.units:
        handles.append(unit.module.register_forward_pre_hook(_pre_forward_hook(engine, unit)))
        handles.append(
            unit.module.register_forward_hook(
                _post_forward_hook(engine, unit), always_call=True, with_kwargs=True
            )
        )
        if engine.config.stage >= 2:
            for slot in unit.slots:
                if slot.trainable:
                    handles.append(
                        slot.param.register_post_accumulate_grad_hook(
                            _grad_ready_hook(engine, unit)
                        )
                    )
    return handles


def _pre_forward_hook(engine: ZeroEngine, unit: Unit):
    def hook(module, args):
        engine.external.active.append(unit)
        engine.pre_forward(unit, args)

    return hook


def _post_forward_hook(engine: ZeroEngine, unit: Unit):
    def hook(module, args, kwargs, output):
        active = engine.external.active
        if active and active[-1] is unit:
            active.pop()
        outputs = tensors_in(output)
        engine.external.on_output(unit, outputs)
        if in_backward():
            engine.forward_in_backward_done(unit)
            return None
        try:
            if torch.is_grad_enabled():
                hooked = False
                for t in outputs:
                    if t.requires_grad:
                        t.register_hook(_pre_backward_hook(engine, unit))
                        hooked = True
                if hooked and unit.waits_for_inputs:
                    _wait_for_input_grads(engine, unit, tensors_in((args, kwargs)))
                reducer = engine.reducer
                if reducer.finds_unused:
                    if any(_is_reentrant_checkpoint(t.grad_fn) for t in outputs):
                        reducer.hide_from_graph(unit)  # its body ran in one
                    if unit.index == 0 and reducer.syncing:
                        reducer.agree_on_unused(outputs)
        finally:
            engine.post_forward(unit)  # the pins of this forward go, whatever happened
        return None

    return hook


def _wait_for_input_grads(engine: ZeroEngine, unit: Unit, inputs: list[torch.Tensor]) -> None:
    """Call ``engine.inputs_backward_done(unit)`` once the gradient of every input of every
    forward call of ``unit`` this pass exists (units owning frozen parameters). A call
    without an input that needs a gradient, or with a leaf one (a hook on a leaf outlives
    the pass), keeps one wait open: the unit then ends with the backward pass."""
    waiting = [t for t in inputs if t.requires_grad]
    if not waiting or any(t.grad_fn is None for t in waiting):
        unit.expect_input_grads(1)  # never met this pass
        return
    unit.expect_input_grads(len(waiting))

    def hook(grad):
        if unit.input_grad_arrived():
            engine.inputs_backward_done(unit)
        return None

    for t in waiting:
        t.register_hook(hook)


def _pre_backward_hook(engine: ZeroEngine, unit: Unit):
    def hook(grad):
        if engine.begin_backward():  # the first hook of a backward pass
            Variable._execution_engine.queue_callback(engine.post_backward_final)
        engine.pre_backward(unit)
        return None

    return hook


def _grad_ready_hook(engine: ZeroEngine, unit: Unit):
    # Weak references: torch keeps this hook in C++ (the parameter's autograd metadata),
    # where Python's cycle collector cannot see it; strong ones would keep the engine, its
    # model and its memory alive for good once the user drops them.
    engine_ref, unit_ref = weakref.ref(engine), weakref.ref(unit)

    def hook(param):
        engine, unit = engine_ref(), unit_ref()
        if engine is None or unit is None:
            return
        if unit.count_grad_ready():
            engine.post_backward(unit)
        else:
            engine.reducer.pump_overlapped_step()

    return hook
