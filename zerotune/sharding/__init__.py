"""The ZeRO core: units, hooks, prefetch and the engine."""

from .engine import ZeroEngine, shard
from .external import ShardedParameterError
from .plan import select_unit_modules
from .unit import Unit, UnitState

__all__ = [
    "ShardedParameterError",
    "ZeroEngine",
    "Unit",
    "UnitState",
    "select_unit_modules",
    "shard",
]
