"""External parameters: a unit's forward using parameters that another unit owns.

[Note: external parameters]
Tied weights shared by two units' modules are found at wrap time (engine.py). Others only
show while forward runs: a parent calling ``F.linear(x, self.embed.weight)``, or a module
returning one of its parameters for another to use. Two mechanisms catch them:

* Parameter access. Every module that holds parameters (and each unit's root) gets, for its
  own instance only, a subclass of its class whose ``__getattr__`` reports parameter reads
  (``nn.Module`` serves parameters through ``__getattr__``). A read inside the forward of
  unit U of a parameter that another, non-persistent unit owns registers that unit as U's
  dependency: it is gathered now, and from then on with U, in forward and backward. Logged
  once. Its ``zero_grad`` also clears the shards of the units under it.
* Output inspection. A unit whose forward returns (a view of) its own gathered parameters is
  registered as a dependency of the enclosing unit, which keeps it gathered.

Outside any forward or backward, reading a parameter that is not gathered never hands out
the empty tensor it holds. At world size 1 nothing has to come from another rank: the read
gathers the owner unit from whichever tier holds it, and returns a copy of the value (an
inference tensor: writing to it in place raises, as writes could not reach the shards). At
world size > 1 it raises ``ShardedParameterError`` with what to do instead
(``engine.gathered()``, entered by every rank): an attribute read that all-gathers would hang
when one rank reads and the others do not. ``remove()`` restores the original classes.
Reads traced by ``torch.compile`` (a compiled unit, [Note: compiled units]) are not watched: a
compiled unit's own parameters and its dependencies known at wrap time are gathered by its
hooks; one of another unit that only shows inside a compiled forward needs
``register_external``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import dist as zdist
from .unit import Unit, UnitState

if TYPE_CHECKING:
    from .engine import ZeroEngine

__all__ = ["ExternalParams", "ShardedParameterError"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

_SUBCLASSES: dict[type, type] = {}


class ShardedParameterError(RuntimeError):
    """A sharded parameter was read where it is not gathered."""


def _watching_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        base_getattr = cls.__getattr__

        def __getattr__(self, name):
            value = base_getattr(self, name)
            if isinstance(value, nn.Parameter):
                watcher = self.__dict__.get("_zerotune_watcher")
                if watcher is not None and not torch.compiler.is_compiling():
                    return watcher.on_access(self, name, value)
            return value

        base_zero_grad = cls.zero_grad

        def zero_grad(self, set_to_none: bool = True):
            # nn.Module.zero_grad clears param.grad only; gradients already reduced into
            # the units' shards would survive it and reach the next step().
            base_zero_grad(self, set_to_none)
            watcher = self.__dict__.get("_zerotune_watcher")
            if watcher is not None:
                watcher.zero_grads_of(self)

        methods = {"__getattr__": __getattr__, "zero_grad": zero_grad}
        base_count = getattr(cls, "num_parameters", None)
        if callable(base_count):  # transformers' models: count the full sizes, not the empty

            def num_parameters(self, only_trainable=False, exclude_embeddings=False):
                watcher = self.__dict__.get("_zerotune_watcher")
                if watcher is None:
                    return base_count(self, only_trainable, exclude_embeddings)
                return watcher.count(self, only_trainable, exclude_embeddings)

            methods["num_parameters"] = num_parameters
        methods.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
        sub = type(cls.__name__, (cls,), methods)
        _SUBCLASSES[cls] = sub
    return sub


class ExternalParams:
    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.owner: dict[int, Unit] = {id(s.param): u for u in engine.units for s in u.slots}
        self.names: dict[int, str] = {id(s.param): s.name for u in engine.units for s in u.slots}
        self.numel: dict[int, int] = {id(s.param): s.numel for u in engine.units for s in u.slots}
        self.active: list[Unit] = []  # units whose forward is running, innermost last
        self.registered: list[tuple[str, str, str]] = []  # (parameter, owner unit, user unit)
        self._swapped: list[tuple[nn.Module, type]] = []
        unit_modules = {id(engine.module)} | {id(u.module) for u in engine.units}
        for module in engine.module.modules():
            if id(module) in unit_modules or any(
                p is not None for p in module._parameters.values()
            ):
                self._swapped.append((module, type(module)))
                module.__class__ = _watching_class(type(module))
                module.__dict__["_zerotune_watcher"] = self

    def __deepcopy__(self, memo) -> None:
        return None  # a copied module watches nothing ([Note: copies of a sharded model])

    def count(self, module: nn.Module, only_trainable: bool, exclude_embeddings: bool) -> int:
        """transformers' ``num_parameters`` of ``module``, each parameter at its full size (a
        released one is empty); embeddings left out by the same rule (``nn.Embedding``
        weights by name)."""
        skip = set()
        if exclude_embeddings:
            skip = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, nn.Embedding)}
        return sum(
            self.numel.get(id(p), p.numel())
            for name, p in module.named_parameters()
            if name not in skip and (p.requires_grad or not only_trainable)
        )

    def remove(self) -> None:
        for module, cls in self._swapped:
            module.__class__ = cls
            module.__dict__.pop("_zerotune_watcher", None)
        self._swapped.clear()

    def zero_grads_of(self, module: nn.Module) -> None:
        """``module.zero_grad()``: forget the gradients the units it holds have accumulated
        in their shards too (as ``optimizer.zero_grad()`` does), all of a unit or none."""
        params = {id(p) for p in module.parameters()}
        held = []
        for unit in self.engine.units:
            mine = [id(s.param) in params for s in unit.slots]
            if any(mine) and not all(mine) and not unit.accumulator.is_zero:
                raise RuntimeError(
                    f"zero_grad() on {type(module).__name__} clears part of unit {unit.name}, "
                    "whose gradients are reduced into one shard; call zero_grad() on the "
                    "model or optimizer.zero_grad()"
                )
            held.append(all(mine))
        if all(held):  # the whole model: as optimizer.zero_grad(), what a clip read goes too
            self.engine.zero_grad()
            return
        for unit, whole in zip(self.engine.units, held):
            if whole and unit.slots:
                unit.accumulator.zero()

    # ----------------------------------------------------------------------------- events
    def on_access(
        self, module: nn.Module, name: str, param: nn.Parameter
    ) -> nn.Parameter | torch.Tensor:
        """What reading ``module.<name>`` gives: the parameter itself, or outside forward at
        world size 1, a read-only copy of its value when its unit is not gathered."""
        owner = self.owner.get(id(param))
        if owner is None or owner.persistent:
            return param
        if self.active:
            user = self.active[-1]
            if owner is not user and owner not in user.deps:
                self._register(owner, user, self.names[id(param)])
            owner.wait()
            return param
        if owner.state is UnitState.GATHERED:
            return param
        if self.engine.world == 1:
            with self.engine.gathered([owner]), torch.inference_mode():
                return param.detach().clone()
        raise ShardedParameterError(
            f"parameter {self.names[id(param)]!r} is sharded by zerotune (stage 3) over "
            f"{self.engine.world} ranks and not gathered outside forward/backward; read it "
            "inside `with engine.gathered():` (every rank enters), or get every weight with "
            "engine.full_state_dict()"
        )

    def on_output(self, unit: Unit, output_tensors: list[torch.Tensor]) -> None:
        """After ``unit``'s forward: does it hand out its own parameters?"""
        if unit.persistent or len(self.active) < 1 or unit.state is not UnitState.GATHERED:
            return
        storage = unit.flat.untyped_storage().data_ptr()
        enclosing = self.active[-1]
        for t in output_tensors:
            if t.untyped_storage().data_ptr() == storage and unit not in enclosing.deps:
                self._register(unit, enclosing, f"an output of {unit.name}")
                return

    def _register(self, owner: Unit, user: Unit, what: str) -> None:
        if not self.engine.config.auto_external_params:
            raise ShardedParameterError(
                f"{what} (unit {owner.name}) is used in the forward of unit {user.name}; "
                "auto_external_params is off: register it with engine.register_external()"
            )
        self.engine.register_external(owner, user, pin=True)
        self.registered.append((what, owner.name, user.name))
        log.info(
            "zerotune: %s (unit %s) is used in the forward of unit %s: registered as an "
            "external parameter, gathered with %s from now on",
            what,
            owner.name,
            user.name,
            user.name,
        )
