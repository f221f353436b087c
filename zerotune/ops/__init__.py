"""Native (C++) ops, built on first use and cached; see [Note: op cache] in build.py."""

from zerotune.ops.build import (
    OPS,
    OpStatus,
    adam_prefetch,
    build_all,
    cache_root,
    cpu_model,
    cpu_simd_level,
    load_op,
    op_status,
)

__all__ = [
    "OPS",
    "OpStatus",
    "adam_prefetch",
    "build_all",
    "cache_root",
    "cpu_model",
    "cpu_simd_level",
    "load_op",
    "op_status",
]
