"""Forward and backward hooks that gather, release and reduce units, the prefetcher that
gathers the next units ahead of use, and the listener that hears of each unit built
(``report_units``: ``zerotune finetune``'s progress bar over a large model's construction).

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

[Note: prefetching units]
The first forward (and the first backward) of a run records the order in which units are
used. Later passes follow that order: when a unit is used, the units after it are gathered
asynchronously while its compute runs, as long as the bytes gathered ahead stay within
``prefetch_bytes``. If a pass uses a unit other than the one the recorded order expects (the
model took another path), the order is re-recorded from that point on, and nothing waits
on a prediction: every unit is still gathered on demand when it is needed. All ranks see the
same sequence of uses, so they issue the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable

from .copies import COPIED
from .grads import is_reentrant_checkpoint
from .state_dict import state_dict_hooks
from .unit import Unit, UnitState

if TYPE_CHECKING:
    from .engine import ZeroEngine

__all__ = [
    "Prefetcher",
    "in_backward",
    "install_hooks",
    "report_units",
    "tensors_in",
    "unit_built",
]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts (HF ModelOutput is a dict) and
    dataclass instances (a user's output records)."""
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
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name, None) for f in dataclasses.fields(item))
    return found


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


def install_hooks(engine: ZeroEngine) -> list:
    """Register the hooks of every unit, and the model's state-dict hooks ([Note: state
    dicts of a sharded model] in state_dict.py); returns the handles (to remove them)."""
    handles = state_dict_hooks(engine)
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
        if module is not unit.module:  # a deep copy shares this function (copies.py)
            raise RuntimeError(COPIED)
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
                hooked = []  # the nodes the hooks below run before
                inputs: list[torch.Tensor] | None = None  # this call's tensor arguments
                for t in outputs:
                    if t.requires_grad:
                        t.register_hook(_pre_backward_hook(engine, unit))
                        hooked.append(t.grad_fn)
                        # An output that is a view (nn.Linear on a 3-D input returns
                        # addmm(...).view(...)) modified in place later (ReLU(inplace=True),
                        # h += r) gets a new history, and its old node, which holds the hook
                        # above, leaves the graph. Its base's node stays (under the
                        # CopySlices of the in-place op): hook the base too, unless the base
                        # is not this unit's (a view of an input).
                        base = t._base if t._is_view() else None
                        if base is not None and base.requires_grad and base.grad_fn is not None:
                            if inputs is None:
                                inputs = tensors_in((args, kwargs))
                            if all(base is not x for x in inputs):
                                base.register_hook(_pre_backward_hook(engine, unit))
                                hooked.append(base.grad_fn)
                if hooked and unit.waits_for_inputs:
                    if inputs is None:
                        inputs = tensors_in((args, kwargs))
                    _wait_for_input_grads(engine, unit, inputs)
                reducer = engine.reducer
                if reducer.finds_unused:
                    reducer.note_outputs(unit, hooked)
                    if any(is_reentrant_checkpoint(t.grad_fn) for t in outputs):
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
            _gather_contested(engine)
        engine.pre_backward(unit)
        return None

    return hook


def _gather_contested(engine: ZeroEngine) -> None:
    """With ``find_unused_parameters`` the ranks agree, before any gather of this backward,
    on the units it reaches; those some ranks reach and others do not are gathered here on
    every rank and held to the end of the pass (see [Note: outputs the loss ignores] in
    grads.py). The ranks' backward hooks then run in different orders, so this pass
    gathers nothing ahead (the prefetcher's gathers must pair across the ranks)."""
    reducer = engine.reducer
    if not reducer.finds_unused or not (reducer.syncing or engine.config.stage == 3):
        return
    contested = reducer.agree_on_reached()
    if contested:
        engine.prefetcher.pause("backward")
        engine.prefetcher.pause("forward")  # checkpoints recomputed in it: alike too
    for unit in contested:
        engine.pre_backward(unit)
        for held in (unit, *unit.deps):
            held.pin()  # not let go after its backward on the ranks that run it: alike


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


class Prefetcher:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.orders: dict[str, list[Unit]] = {"forward": [], "backward": []}
        self.recorded: dict[str, bool] = {"forward": False, "backward": False}
        self._pos = {"forward": 0, "backward": 0}
        self._paused = {"forward": False, "backward": False}  # until the next pass
        self.rerecords = 0  # how often a pass left the recorded order

    def start_pass(self, kind: str) -> None:
        if not self.recorded[kind] and self.orders[kind]:
            self.recorded[kind] = True  # the previous pass finished recording
        if not self.recorded[kind]:
            self.orders[kind] = []
        self._pos[kind] = 0
        self._paused[kind] = False

    def pause(self, kind: str) -> None:
        """The rest of this pass neither records nor gathers ahead."""
        self._paused[kind] = True

    def on_use(self, kind: str, unit: Unit) -> list[Unit]:
        """Note that ``unit`` is used now; return the units to gather ahead of their use."""
        if self._paused[kind]:
            return []
        order, pos = self.orders[kind], self._pos[kind]
        if not self.recorded[kind]:
            order.append(unit)
            self._pos[kind] = pos + 1
            return []
        if pos >= len(order) or order[pos] is not unit:
            # Another path than recorded: keep what matched, record the rest anew.
            del order[pos:]
            order.append(unit)
            self.recorded[kind] = False
            self.rerecords += 1
            self._pos[kind] = pos + 1
            return []
        self._pos[kind] = pos + 1
        if self.budget <= 0:
            return []
        ahead, spent = [], 0
        for nxt in order[pos + 1 :]:
            if nxt.persistent or nxt is unit:
                continue
            spent += nxt.gathered_bytes
            if spent > self.budget:
                break
            if nxt.state is UnitState.SHARDED:
                ahead.append(nxt)
        return ahead


_BUILD_LISTENER: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "units_built", default=None
)


@contextlib.contextmanager
def report_units(listener: Callable[[int, int], None]) -> Iterator[None]:
    """Engines built inside call ``listener(units placed, units in all)`` after each unit is
    on its tiers."""
    token = _BUILD_LISTENER.set(listener)
    try:
        yield
    finally:
        _BUILD_LISTENER.reset(token)


def unit_built(done: int, total: int) -> None:
    listener = _BUILD_LISTENER.get()
    if listener is not None:
        listener(done, total)
