"""``zero(cls)``: ZeroTrainer's behaviour for any ``Trainer`` subclass (TRL's trainers) and
ZeroTrainingArguments' fields for any ``TrainingArguments`` subclass.

[Note: any Trainer subclass]
ZeroTrainer changes the Trainer only through methods the Trainer calls on itself
(engine-building ``__init__``, ``_wrap_model``, ``create_optimizer``, the accelerator's
``backward``, checkpoint saving and loading), each ending in ``super()``. A subclass such
as TRL's ``SFTTrainer`` prepares data and the model in its own ``__init__`` and computes
its loss in ``compute_loss``, then hands over to ``Trainer``. ``zero(cls)`` builds the
class ``(ZeroTrainer, cls)``: its method order is ZeroTrainer, then ``cls``, then
``Trainer``, so the model is sharded before ``cls.__init__`` sees it (it gets the sharded
HF model, as with the plain Trainer), and every override of ``cls`` still runs, between
ZeroTrainer's and the Trainer's. Its arguments must be both: ``zero(SFTConfig)`` is the
dataclass ``(SFTConfig, ZeroTrainingArguments)``, with the fields of both, so that ``cls``
finds its own fields and ZeroTrainer its own. In that order a field's default is the
config's own (TRL's ``bf16``, ``learning_rate``, ``remove_unused_columns``), not the one
``TrainingArguments`` sets, and ZeroTrainingArguments' checks run inside the config's own
``__post_init__``, after it has filled in what it derives. The models a subclass keeps beside the
trained one (TRL's reference model and distilling teacher) are sharded as they are
assigned: see [Note: models beside the trained one] in hf/companions.py.
"""

from __future__ import annotations

from transformers import Trainer

from .args import ZeroTrainingArguments
from .trainer import ZeroTrainer

__all__ = ["zero"]

_ZERO_CLASSES: dict[type, type] = {}  # the class zero() made for each class given


def zero(cls: type) -> type:
    """ZeroTrainer's behaviour for a ``Trainer`` subclass, or ZeroTrainingArguments' fields
    for a ``TrainingArguments`` subclass (e.g. TRL's ``SFTTrainer`` and ``SFTConfig``); see
    [Note: any Trainer subclass]. The class made is the same on every call."""
    from dataclasses import dataclass

    from transformers import TrainingArguments

    made = _ZERO_CLASSES.get(cls)
    if made is not None or issubclass(cls, (ZeroTrainer, ZeroTrainingArguments)):
        return made or cls
    if issubclass(cls, Trainer):
        bases = (ZeroTrainer, cls)
    elif issubclass(cls, TrainingArguments):
        bases = (cls, ZeroTrainingArguments)  # cls's defaults over TrainingArguments' own
    else:
        raise TypeError(
            f"zero() takes a transformers Trainer or TrainingArguments subclass, not {cls!r}"
        )
    made = type(f"Zero{cls.__name__}", bases, {"__module__": __name__})
    if issubclass(cls, TrainingArguments):
        made = dataclass(made)
    _ZERO_CLASSES[cls] = made
    return made
