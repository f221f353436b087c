"""Hugging Face integration: ZeroTrainer, ZeroTrainingArguments, data preparation, presets."""

from .args import ZeroTrainingArguments, list_zero_presets
from .presets import list_presets, model_config
from .trainer import ZeroTrainer, build_engine

__all__ = [
    "ZeroTrainer",
    "ZeroTrainingArguments",
    "build_engine",
    "list_presets",
    "list_zero_presets",
    "model_config",
]
