"""zerotune: ZeRO-3 / ZeRO-Infinity full fine-tuning on torch.distributed.

Bare PyTorch use::

    engine = zerotune.shard(model, zerotune.ZeroConfig(stage=3))
    optimizer = zerotune.ZeroAdamW(engine, lr=1e-4)
    loss = engine(**batch).loss
    loss.backward()
    optimizer.clip_grad_norm_(1.0)
    optimizer.step()
"""

from .checkpoint import (
    CheckpointError,
    ExportError,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_hf,
)
from .config import ConfigError, ZeroConfig, load_config
from .estimate import MemoryPlan, check_estimate
from .estimate import estimate as estimate_memory
from .init import copy_sharded, from_pretrained, load_weights, zero_init
from .optim import CPUAdam, StepInfo, ZeroAdamW, ZeroOptimizer
from .sharding import ShardedParameterError, ZeroEngine, shard

__version__ = "0.1.0"

# The Trainer classes import transformers; they load on first use (``zerotune.ZeroTrainer``).
_HF_EXPORTS = ("ZeroTrainer", "ZeroTrainingArguments")


def __getattr__(name: str):
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'zerotune' has no attribute {name!r}")


__all__ = [
    "CPUAdam",
    "CheckpointError",
    "ConfigError",
    "ExportError",
    "MemoryPlan",
    "ShardedParameterError",
    "StepInfo",
    "ZeroAdamW",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroOptimizer",
    "ZeroTrainer",
    "ZeroTrainingArguments",
    "check_estimate",
    "copy_sharded",
    "estimate_memory",
    "export_hf",
    "from_pretrained",
    "load_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "save_hf",
    "shard",
    "zero_init",
]
