"""Native (C++) ops, built on first use and cached; see [Note: op cache] in build.py."""

from zerotune.ops.build import (
    OPS,
    OpStatus,
    build_all,
    cache_root,
    cpu_simd_level,
    load_op,
    op_status,
)

__all__ = ["OPS", "OpStatus", "build_all", "cache_root", "cpu_simd_level", "load_op", "op_status"]
