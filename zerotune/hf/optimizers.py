"""The optimizers ZeroTrainer hands the Trainer: ZeroAdamW or a ZeroOptimizer over the
engine's shards, marked as prepared and reporting skipped fp16 steps; one given through
``optimizers=`` rebuilt over the shards; and the model's-parameter view of the groups that
``get_optimizer_group`` returns. See [Note: how ZeroTrainer plugs into Trainer] in
hf/trainer.py.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from torch import nn

from ..optim import ZeroAdamW, ZeroOptimizer

__all__ = [
    "ModelGroup",
    "ModelParams",
    "TrainerAdamW",
    "TrainerOptimizer",
    "driven_by_trainer",
    "embeddings_in_32_bits",
    "rebuild_over_shards",
]


class _DrivenByTrainer:
    """An optimizer over the shards as the Trainer drives it. Marked as prepared so
    accelerate does not wrap it (see [Note: how ZeroTrainer plugs into Trainer] in
    hf/trainer.py); ``step_was_skipped`` is what ``accelerator.optimizer_step_was_skipped``
    reads to hold the scheduler back on fp16 overflow."""

    _is_accelerate_prepared = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_info = None

    def step(self, closure=None):
        self.last_info = super().step(closure)
        return self.last_info

    @property
    def step_was_skipped(self) -> bool:
        return self.last_info is not None and self.last_info.skipped


class TrainerAdamW(_DrivenByTrainer, ZeroAdamW):
    """ZeroAdamW as the Trainer drives it."""


class TrainerOptimizer(_DrivenByTrainer, ZeroOptimizer):
    """ZeroOptimizer as the Trainer drives it."""


def driven_by_trainer(optimizer) -> None:
    """Give an optimizer built over the engine (``optimizers=``) what the Trainer's own get
    (``_DrivenByTrainer``): the same object, its class swapped for a subclass."""
    cls = type(optimizer)
    if not isinstance(optimizer, _DrivenByTrainer):
        optimizer.__class__ = type(cls.__name__, (_DrivenByTrainer, cls), {})
        optimizer.last_info = None


def rebuild_over_shards(engine, optimizer, scheduler) -> ZeroOptimizer:
    """The same optimizer class over ``engine``'s shards, from an optimizer built over the
    model's parameters: its groups (hyper-parameters, and parameters matched by identity)."""
    cls = type(optimizer)
    if isinstance(optimizer, (ZeroAdamW, ZeroOptimizer)):
        raise ValueError(
            "the optimizer given to ZeroTrainer runs over another engine; pass "
            "optimizer_cls_and_kwargs=(cls, kwargs) and let ZeroTrainer build it"
        )
    how = "pass optimizer_cls_and_kwargs=(cls, kwargs) instead"
    if any(len(st) for st in optimizer.state.values()):
        raise ValueError(
            f"the {cls.__name__} given to ZeroTrainer has stepped already (its state would be "
            f"lost when it is rebuilt over the shards); {how}"
        )
    params = {id(s.param) for u in engine.units for s in u.slots}
    params.update(engine.tiled_from)  # a weight the engine cut into tiles stands for them
    groups = []
    for g in optimizer.param_groups:
        if any(id(p) not in params for p in g["params"]):
            raise ValueError(
                f"the {cls.__name__} given to ZeroTrainer holds tensors that are not the "
                f"model's parameters, so it cannot be rebuilt over the shards; {how}"
            )
        groups.append(dict(g))
    engine.detach_optimizer()  # the optimizer of the model's trainer before, if any
    try:
        rebuilt = TrainerOptimizer(engine, cls, groups)
    except TypeError as exc:
        raise ValueError(
            f"the {cls.__name__} given to ZeroTrainer cannot be rebuilt over the shards from "
            f"its parameter groups ({exc}); {how}"
        ) from None
    extra = getattr(optimizer, "args", None)  # bitsandbytes keeps some settings there
    if extra is not None and rebuilt.inner is not None:
        rebuilt.inner.args = extra
    if scheduler is not None:
        scheduler.optimizer = rebuilt  # it reads the groups of the optimizer it steps
        _mark_steps(rebuilt)
    return rebuilt


class ModelParams(list):
    """Parameters of one optimizer group; ``in`` compares by identity (a released stage-3
    parameter is empty, and ``==`` between tensors compares values)."""

    def __contains__(self, item) -> bool:
        return any(p is item for p in self)


class ModelGroup(MutableMapping):
    """One optimizer group seen with the model's parameters in ``params``; every other key
    reads and writes the optimizer's group."""

    def __init__(self, group: dict, params: ModelParams):
        self._group, self._params = group, params

    def __getitem__(self, key):
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key, value) -> None:
        if key == "params":
            raise TypeError("the parameters of a ZeroTrainer optimizer group are fixed")
        self._group[key] = value

    def __delitem__(self, key) -> None:
        del self._group[key]

    def __iter__(self):
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


def _mark_steps(optimizer) -> None:
    """Do to ``optimizer`` what a torch LR scheduler does to the one it is built with: its
    ``step`` records that it ran, which the scheduler's ``step`` checks (and warns about
    otherwise)."""
    step = optimizer.step

    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def embeddings_in_32_bits(engine, optimizer: ZeroOptimizer) -> None:
    """As the plain Trainer does for bitsandbytes' 8-bit optimizers: embeddings keep 32-bit
    state. Set on this optimizer alone: an override in bitsandbytes' process-wide manager
    would make every later bitsandbytes optimizer read these (sharded) weights."""
    for module in engine.module.modules():
        if isinstance(module, nn.Embedding):
            weight = module._parameters.get("weight")
            if weight is not None:
                optimizer.override_config(weight, {"optim_bits": 32})
