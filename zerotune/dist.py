"""Thin helpers over torch.distributed. World size 1 needs no process group."""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "is_initialized",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "shutdown",
    "leave",
    "all_gather_into",
    "reduce_scatter_avg",
    "all_reduce_sum",
    "broadcast",
    "ranks_on_this_host",
    "barrier",
    "RankFilter",
]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def init_from_env(backend: str | None = None) -> bool:
    """Initialize the default process group when launched by torchrun (WORLD_SIZE set).

    Returns True when a process group exists afterwards. NCCL is chosen when CUDA is
    available, gloo otherwise.
    """
    if is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "MASTER_ADDR" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


def shutdown() -> None:
    """Destroy the default process group, if any. A process that exits with a gloo group
    still alive can abort in the group's C++ teardown ("terminate called without an active
    exception", exit -6) while its peers go away; every process that ends with one should
    call this first, on error paths too."""
    if is_initialized():
        gc.collect()  # engines let go of (reference cycles) hold on to the group's resources
        dist.destroy_process_group()


def leave(code: int = 0) -> NoReturn:
    """End this rank now, with ``code``, without interpreter finalization.

    [Note: leaving a gloo rank]
    A process that ends with gloo work objects still alive (a process group never
    destroyed, or destroyed while Python objects still hold work or tensors of it) can
    abort in interpreter finalization: gloo's worker threads release tensors that need
    the GIL while the interpreter is being torn down, and the process dies with
    "terminate called without an active exception" (exit -6) after finishing its work.
    ``shutdown`` first (collect cycles, destroy the group while everything is alive),
    then flush what Python buffers (stdio, logging) and ``os._exit``: finalization, the
    moment of the abort, never runs. Everything the rank wrote must be closed by then
    (atexit handlers do not run); the finetune command's ranks end this way."""
    shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, async_op=False):
    """Gather equal shards of every rank, rank-major, into ``output``."""
    if get_world_size(group) == 1:
        output.copy_(shard)
        return None
    return dist.all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_avg(output: torch.Tensor, full: torch.Tensor, group=None, async_op=False):
    """Reduce ``full`` over ranks and keep this rank's slice of the mean in ``output``."""
    world = get_world_size(group)
    if world == 1:
        output.copy_(full)
        return None
    # Sum then divide: gloo has no AVG, and dividing once keeps fp32 results identical
    # between backends.
    work = dist.reduce_scatter_single(
        output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )
    if async_op:
        return _Then(work, lambda: output.div_(world))
    output.div_(world)
    return None


def reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """Reduce ``full`` over ranks and keep this rank's slice of the sum in ``output``."""
    if get_world_size(group) == 1:
        output.copy_(full)
        return
    dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` as rank ``src`` of ``group`` holds it, on every rank of the group."""
    if get_world_size(group) > 1:
        root = src if group is None else dist.get_global_rank(group, src)
        dist.broadcast(tensor, root, group=group)
    return tensor


def ranks_on_this_host() -> int:
    """The processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE; 1 alone):
    what they each hold at once, the host holds that many times."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def barrier(group=None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group=group)


class _Then:
    """A collective handle that runs a small finishing step after waiting."""

    def __init__(self, work, then):
        self._work, self._then = work, then

    def wait(self) -> None:
        self._work.wait()
        self._then()


class RankFilter(logging.Filter):
    """Let records through on rank 0 only (or on every rank when ZEROTUNE_LOG_ALL_RANKS=1)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return get_rank() == 0 or os.environ.get("ZEROTUNE_LOG_ALL_RANKS") == "1"
