"""Hugging Face integration: ZeroTrainer, ZeroTrainingArguments, ``zero()`` for any Trainer
subclass (TRL's), data preparation, presets, and the fine-tuning job that ``zerotune
finetune`` runs (``prepare_job`` then ``run_job``; a refusal is a ``JobError``).

``ZeroTrainer``, ``ZeroTrainingArguments``, ``zero`` and ``build_engine`` load on first use:
they import ``transformers.Trainer``, which takes seconds, and the data and config helpers do
not need it.
"""

from .configs import list_zero_presets, read_zero_config_file
from .presets import list_presets, model_config

_LAZY = {
    "ZeroTrainer": "trainer",
    "build_engine": "trainer",
    "ZeroTrainingArguments": "args",
    "zero": "subclasses",
    "gather_for_generation": "generation",
    "JobError": "job",
    "prepare_job": "prepare",
    "run_job": "finetune",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'zerotune.hf' has no attribute {name!r}")


__all__ = [
    "JobError",
    "ZeroTrainer",
    "ZeroTrainingArguments",
    "build_engine",
    "gather_for_generation",
    "list_presets",
    "list_zero_presets",
    "model_config",
    "prepare_job",
    "read_zero_config_file",
    "run_job",
    "zero",
]
