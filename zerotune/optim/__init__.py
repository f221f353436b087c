"""Optimizers over shards."""

from .cpu_adam import CPUAdam, adam_update
from .generic import ZeroOptimizer
from .scaling import DynamicLossScaler
from .zero_adam import StepInfo, ZeroAdamW

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "StepInfo",
    "ZeroAdamW",
    "ZeroOptimizer",
    "adam_update",
]
