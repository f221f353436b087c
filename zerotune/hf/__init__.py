"""Hugging Face integration: model presets (ZeroTrainer and loading arrive with later issues)."""

from .presets import list_presets, model_config

__all__ = ["list_presets", "model_config"]
