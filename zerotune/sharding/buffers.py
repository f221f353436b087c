"""The engine's working buffers: their sizes as functions of the unit plans and the config.

[Note: working buffers]
Besides the model states (plan.py ``resident_bytes``), the engine allocates working memory:
- gathered parameters: the flat buffer of each sharded unit in use, with the units it
  depends on, plus the units gathered ahead within ``prefetch_budget`` (stage 3);
- the gather cache (memory/pool.py ``GatherCache``): emptied gather buffers kept for reuse
  on a CPU device, up to ``gather_cache_bytes``;
- the reduce pool (memory/pool.py ``BufferPool``): fp32 gradients and their reduced shards,
  gradient shards on their way to or from NVMe (read ``grad_read_numel`` elements at a
  time), updated parameter shards on their way to NVMe, persistent units' refreshed shards.
  Buffers are keyed by (elements, dtype); ``pool_buffers`` says how many of each size can
  be in use at once, ``pool_keep_sizes`` which sizes the pool keeps once released;
- gradient shards kept in memory for a clipped overlapped step (``grads_kept_for_update``);
- on an accelerator, gradients on their way to the host (``host_copy_buffers``);
- NVMe staging slots (memory/swap.py ``StagingPool``; ``staging_slots``).
The engine calls these functions to size what it allocates and ``zerotune estimate`` calls
them to plan (``working_buffers``), so the two cannot drift apart; tests/test_sizing.py
builds engines and checks the plan against what they allocated.
"""

from __future__ import annotations

import torch

from ..config import ZeroConfig
from ..memory.host import host_cache_used
from ..memory.pool import buffers_writing
from ..memory.tiers import grad_read_numel, master_in_param_file
from .plan import SwapPlan, UnitPlan

__all__ = [
    "PoolKey",
    "gather_cache_bytes",
    "gathers_into_cache",
    "grads_kept_for_update",
    "host_cache_bytes",
    "pool_buffers",
    "pool_keep_sizes",
    "prefetch_budget",
    "recurring_sizes",
    "staging_resident",
    "staging_slots",
    "working_buffers",
]

_F32 = 4

# A pool buffer: (elements, bytes per element, tier: "device" or "host").
PoolKey = tuple[int, int, str]


def prefetch_budget(config: ZeroConfig) -> int:
    """Bytes of units gathered ahead of use (see [Note: prefetching units] in hooks.py): stage 3
    only; stages 1-2 keep every unit gathered."""
    return config.prefetch_bytes if config.stage == 3 else 0


def recurring_sizes(sizes: list[int]) -> set[int]:
    """The sizes that at least two entries share."""
    counts: dict[int, int] = {}
    for n in sizes:
        counts[n] = counts.get(n, 0) + 1
    return {n for n, c in counts.items() if c >= 2}


def gathers_into_cache(
    *, persistent: bool, numel: int, lends_storage: bool, mapped: bool, cache: bool
) -> bool:
    """Whether a unit's gathers take their storage from the gather cache: a sharded unit
    whose flat buffer's storage exists only while gathered, not mapped from the parameter
    file, with a cache (a CPU device with the aio op)."""
    return cache and not persistent and numel > 0 and lends_storage and not mapped


def gather_cache_bytes(gathered_sizes: list[int], prefetch_bytes: int) -> int:
    """How many bytes of emptied gather buffers the engine keeps for reuse (host memory;
    memory/pool.py GatherCache), given the gathered sizes of the units whose storage is
    filled on each gather: the prefetch budget, or two of the largest size shared by at
    least two units (the blocks of a transformer: one being released while the next is
    gathered), whichever is larger, and never more than all those units together. A size
    only one unit has (an embedding) is not kept for its own sake: its buffer would stay
    resident through the whole step for one reuse. ``prefetch_bytes``: ``prefetch_budget``."""
    recurring = max(recurring_sizes(gathered_sizes), default=0)
    return min(max(prefetch_bytes, 2 * recurring), sum(gathered_sizes))


def grads_kept_for_update(shards: list[tuple[int, int]], budget: int) -> set[int]:
    """For a clipped overlapped step (see [Note: a clipped overlapped step] in
    optim/zero_adam.py): of ``(unit index, gradient shard bytes bound for NVMe)`` in update
    order, the units whose final shards stay in memory, the first ones within ``budget``
    (``grad_host_bytes``). A shard in memory anyway is given as 0 bytes."""
    keep = set()
    for index, nbytes in shards:
        if nbytes > budget:
            break
        budget -= nbytes
        keep.add(index)
    return keep


def pool_keep_sizes(
    trainable: list[tuple[int, int]], config: ZeroConfig, world: int, device_type: str
) -> set[int] | None:
    """The buffer sizes (bytes) the engine's reduce/copy pool keeps once released
    (memory/pool.py BufferPool.keep_sizes), given the (padded, shard) element counts of the
    trainable units; None: every size. With CPU or NVMe offload on a CPU device, where host
    memory is the budget, only the fp32 gradient sizes (and at world size > 1 the fp32
    shard sizes; with a low-precision gradient dtype their rounded sizes too) that several
    units share: the blocks of a transformer reuse their buffers step after step (as many
    as were in use at once: the NVMe writes in flight, the one filling, and the gradient
    shards a clipped overlapped step keeps), while a size only one unit has (an
    embedding's gradient) is given back after use rather than held through the whole step."""
    if device_type != "cpu" or config.offload_param == config.offload_optimizer == "none":
        return None
    kept = recurring_sizes([padded * _F32 for padded, _ in trainable])
    if world > 1:
        kept |= recurring_sizes([shard * _F32 for _, shard in trainable])
    g = config.torch_grad_dtype.itemsize
    if g != _F32:  # the sums rounded for a low-precision gradient file (NvmeGrads.add)
        rounded = [(padded if world == 1 else shard) * g for padded, shard in trainable]
        kept |= recurring_sizes(rounded)
    return kept


def host_cache_bytes(
    units: list[UnitPlan], config: ZeroConfig, device: str, act_total: int
) -> dict[str, dict[str, int]]:
    """Freed tensors kept for reuse on a CPU device with offload (memory/host.py), held for
    the run: at most the budget, and at most what a step frees and asks for again (one
    unit's fp32 gradients and the activations, ``act_total`` bytes)."""
    if not host_cache_used(config, device):
        return {}
    freed = max((u.numel for u in units), default=0) * 4 + act_total
    return {"host_cache": {"host": min(config.host_cache_bytes, freed)}}


def staging_slots(units: list[UnitPlan], swap: SwapPlan, rank: int) -> int:
    """Staging slots the NVMe step fills (memory/swap.py StagingPool): up to
    ``layout.slots`` (reads ahead, the update, writes), at most one per chunk streamed."""
    chunks = sum(
        len(swap.layout.chunks(u.numel, u.shard))
        for u in units
        if u.index in swap.sizes.get("optim", {}) and u.has_optimizer_state(rank)
    )
    return min(swap.layout.slots, max(chunks, 1))


def staging_resident(units: list[UnitPlan], swap: SwapPlan, rank: int) -> int:
    """Host bytes the staging slots really occupy: slots are made with ``aligned_empty``
    (not pinned), so only the pages a transfer writes become resident: per slot, one chunk
    of each streamed kind of the largest unit. (8-bit moments are updated in one pass per
    block of 256 by the C++ op: no fp32 moments of a whole chunk.)"""
    live = [u for u in units if u.index in swap.sizes.get("optim", {})]
    live = [u for u in live if u.has_optimizer_state(rank)]
    if not live:
        return 0
    layout = swap.layout
    chunks = sum(len(layout.chunks(u.numel, u.shard)) for u in live)
    params = swap.sizes.get("param", {})
    per_slot = max(
        layout.touched_bytes(
            u.numel,
            u.shard,
            not master_in_param_file(u.index in params, u.itemsize),
        )
        for u in live
    )
    return min(layout.slots, chunks) * min(per_slot, swap.slot_bytes)


def _gathered(
    units: list[UnitPlan], config: ZeroConfig, world: int, swap: SwapPlan | None, device: str
) -> dict[str, dict[str, int]]:
    """``gathered`` (units gathered for use plus prefetch), ``nvme_reads`` (host buffers of
    parameter reads from NVMe) and ``gather_cache``. At world size 1 a unit in memory is
    already whole (no copy); one on NVMe, or on the host for an accelerator, is copied into
    a fresh buffer."""
    out: dict[str, dict[str, int]] = {}
    by_index = {u.index: u for u in units}
    param_disk = swap.sizes.get("param", {}) if swap is not None else {}
    host_shards = config.offload_param == "cpu" and device != "cpu"

    def needs_copy(u: UnitPlan) -> bool:
        return (
            not u.persistent and u.numel > 0 and (world > 1 or u.index in param_disk or host_shards)
        )

    sharded = [u for u in units if needs_copy(u)]
    if not sharded:
        return out
    # The unit in use with the units it depends on (a tied head with the embedding: the
    # head lets go of it when its backward is done), and the prefetch window on top.
    in_memory = {u.index for u in sharded}

    def with_deps(u: UnitPlan) -> int:
        return u.gathered_bytes + sum(by_index[d].gathered_bytes for d in u.deps if d in in_memory)

    current = max(with_deps(u) for u in units if u.index in in_memory or u.deps)
    others = sum(u.gathered_bytes for u in sharded) - current
    ahead = min(prefetch_budget(config), max(others, 0))
    gathered = current + ahead
    if config.max_live_bytes > 0:
        gathered = min(gathered, max(config.max_live_bytes, current))
    out["gathered"] = {"device": gathered}
    if param_disk and (world > 1 or device != "cpu"):
        # Reads land in a host buffer of the shard's size, freed once the unit is used
        # (at world size 1 on a CPU they land in the gather buffer itself).
        largest = max(u.shard * u.itemsize for u in sharded)
        out["nvme_reads"] = {"host": largest + ahead // world}
    mapped = world == 1 and config.map_param_file  # NVMe gathers map the file's pages
    cached = [
        u.gathered_bytes
        for u in sharded
        if gathers_into_cache(
            persistent=u.persistent,
            numel=u.numel,
            lends_storage=True,
            mapped=mapped and u.index in param_disk,
            cache=device == "cpu",
        )
    ]
    if cached:
        out["gather_cache"] = {"host": gather_cache_bytes(cached, prefetch_budget(config))}
    return out


def pool_buffers(
    units: list[UnitPlan], config: ZeroConfig, world: int, swap: SwapPlan | None, device: str
) -> tuple[dict[PoolKey, int], dict[PoolKey, set[int]], set[PoolKey]]:
    """The reduce pool's buffers: ``{(elements, itemsize, tier): most in use at once}``; for
    the sizes a gradient reduction (in backward) uses, the units that use them (the other
    sizes serve the optimizer step, after backward); and the sizes only the units' setup
    uses (a shard put into its NVMe extent as the unit is built or a checkpoint loads). On
    a CPU every tier is ``"device"``; on an accelerator, buffers that meet NVMe come from
    the pinned host pool."""
    keys: dict[PoolKey, int] = {}
    users: dict[PoolKey, set[int]] = {}
    in_step: set[PoolKey] = set()
    param_disk = swap.sizes.get("param", {}) if swap is not None else {}
    grads_disk = swap is not None and bool(swap.sizes.get("grad"))

    def need(
        numel: int,
        itemsize: int,
        count: int = 1,
        unit: UnitPlan | None = None,
        tier: str = "device",
        setup: bool = False,
    ) -> None:
        if numel > 0:
            key = (numel, itemsize, "device" if device == "cpu" else tier)
            keys[key] = max(keys.get(key, 0), count)
            if unit is not None:
                users.setdefault(key, set()).add(unit.index)
            if not setup:
                in_step.add(key)

    def same(predicate) -> int:
        return sum(1 for u in units if predicate(u))

    e = units[0].itemsize if units else 4
    # Gradient shards bound for the file go there in the gradient dtype: a low-precision one
    # is rounded into a buffer of its own and the fp32 sum goes back at once.
    g = config.torch_grad_dtype.itemsize if grads_disk else _F32
    for u in units:
        if not u.trainable or u.numel == 0:
            continue
        if world > 1:
            need(u.padded, _F32, unit=u)  # the whole fp32 gradient, reduce-scattered
            queued = buffers_writing(u.shard * g) if grads_disk else 1
            same_shard = same(lambda v, n=u.shard: v.shard == n)
            need(u.shard, _F32, min(queued, same_shard) if g == _F32 else 1, u)
            if g != _F32:
                need(u.shard, g, min(queued, same_shard), u)
            if grads_disk and device != "cpu":
                need(u.shard, _F32, min(queued, same_shard), u, tier="host")  # for the file
        elif grads_disk:
            count = min(buffers_writing(u.padded * g), same(lambda v, n=u.padded: v.padded == n))
            need(u.padded, _F32, count if g == _F32 else 1, u, "host")
            if g != _F32:
                need(u.padded, g, count, u, "host")
        if grads_disk:
            need(grad_read_numel(u.shard), g, tier="host")  # gradients read for the step
    for u in units:
        if u.persistent and world > 1 and u.numel:
            need(u.shard, e)  # refresh: the updated shard, all-gathered
        if u.index in param_disk:
            need(u.shard, e, tier="host", setup=True)  # NvmeParams.put: the first shard
        shared_master = (
            u.index in param_disk
            and u.index in swap.sizes.get("optim", {})
            and master_in_param_file(True, e)
        )
        if u.index in param_disk and not shared_master:
            # Updated shards on their way to NVMe (none when the parameter file holds the
            # fp32 master: the step writes it there itself).
            count = min(buffers_writing(u.shard * e), same(lambda v, n=u.shard: v.shard == n))
            need(u.shard, e, count, tier="host")
    return keys, users, set(keys) - in_step


def _pool(
    units: list[UnitPlan], config: ZeroConfig, world: int, swap: SwapPlan | None, device: str
) -> dict[str, dict[str, int]]:
    """``pool`` (buffers kept for the run, and one-off sizes that may meet the activation
    peak) and ``pool_late`` (one-off sizes in use only at the end of backward or after it)."""
    out: dict[str, dict[str, int]] = {}
    keys, users, setup = pool_buffers(units, config, world, swap, device)
    kept = pool_keep_sizes(
        [(u.padded, u.shard) for u in units if u.trainable and u.numel], config, world, device
    )
    # A setup-only size the pool does not keep is given back before the first step.
    held = {
        key: key[0] * key[1] * count
        for key, count in keys.items()
        if key not in setup or kept is None or key[0] * key[1] in kept
    }
    if kept is None:
        for key, b in held.items():
            out.setdefault("pool", {}).setdefault(key[2], 0)
            out["pool"][key[2]] += b
        return out
    # The pool keeps only these sizes; a one-off size (an embedding's gradient) exists only
    # while in use, so at most the largest adds to the kept ones. A one-off size that only
    # units ahead of the repeated blocks reduce with (a tied input embedding), or only the
    # optimizer step uses, is in use at the end of backward or after it, when the
    # activations are gone ("pool_late", set against them by the estimate); others may meet
    # the activation peak.
    blocks = [u.index for u in units if u.padded * _F32 in kept]
    first_block = min(blocks, default=-1)

    def late(key) -> bool:  # the root unit (index 0) may reduce as backward starts
        return all(0 < i < first_block for i in users.get(key, ()))

    one_off = {key: b for key, b in held.items() if key[0] * key[1] not in kept}
    early = max((b for key, b in one_off.items() if not late(key)), default=0)
    pool = sum(held.values()) - sum(one_off.values()) + early
    if max(one_off.values(), default=0) > early:
        out["pool_late"] = {"device": max(one_off.values()) - early}
    if pool:
        out["pool"] = {"device": pool}
    return out


def _grads_kept(
    units: list[UnitPlan], config: ZeroConfig, swap: SwapPlan | None
) -> dict[str, dict[str, int]]:
    """``grads_kept``: the first units' final gradient shards, kept in memory from their
    backward to their update in the next forward by ZeroTrainer's clipped overlapped step,
    in pool buffers that stay for the next backward (``pool_keep_sizes``)."""
    grads_disk = swap is not None and bool(swap.sizes.get("grad"))
    if not grads_disk or config.stage < 2:
        return {}
    g = config.torch_grad_dtype.itemsize
    trained = [(u.index, u.shard * g) for u in units if u.trainable and u.numel]
    kept = grads_kept_for_update(trained, config.grad_host_bytes)
    nbytes = sum(n for i, n in trained if i in kept)
    return {"grads_kept": {"host": nbytes}} if nbytes else {}


def host_copy_buffers(
    units: list[UnitPlan], config: ZeroConfig, world: int, swap: SwapPlan | None, device: str
) -> dict[str, int]:
    """On an accelerator, gradients on their way to the host, in buffers the pools keep for
    the run, one per size and two units in flight at world size 1 (sharding/unit.py
    ``finish_host_copy``): an fp32 shard in memory through fp32 device buffers (two per unit
    with accumulation: the shard is brought over and added on the device); an NVMe file or
    a low-precision shard through pinned buffers in the compute dtype (the fp32 ones for
    the file are the pool's). Beyond world size 1, this rank's fp32 shard, pinned.
    ``{tier: bytes}``."""
    lowp = config.torch_dtype != torch.float32
    host_shards = config.offload_param == "cpu" and device != "cpu"
    grads_to_host = config.offload_optimizer != "none" or (not lowp and host_shards)
    if device == "cpu" or not grads_to_host:
        return {}
    grads_disk = swap is not None and bool(swap.sizes.get("grad"))
    e = units[0].itemsize if units else 4
    trained = [u for u in units if u.trainable and u.numel]
    direct = not grads_disk and config.torch_grad_dtype == torch.float32
    copies: dict[str, int] = {}
    if world == 1 and direct:
        fp32 = [u.padded * _F32 for u in trained]
        copies["device"] = 2 * (sum(set(fp32)) + max(recurring_sizes(fp32), default=0))
    elif world == 1:
        staged = [u.padded * e for u in trained]
        copies["host"] = sum(set(staged)) + max(recurring_sizes(staged), default=0)
    elif not grads_disk:
        copies["host"] = sum({u.shard * _F32 for u in trained})
    return copies


def _param_grads(units: list[UnitPlan], config: ZeroConfig) -> dict[str, dict[str, int]]:
    """``param_grads``: parameter gradients between backward and their reduction (stages
    2-3; stage 1 keeps them all, see ``full_grads``): one unit at a time, except a parameter
    used by several units (tied embeddings), whose gradient waits for its last use."""
    if config.stage < 2:
        return {}
    by_index = {u.index: u for u in units}
    shared = {d for u in units for d in u.deps}

    def grad_numel(u: UnitPlan) -> int:
        return sum(s.numel for s in u.slots if s.trainable)

    e = units[0].itemsize if units else 4
    waiting = sum(grad_numel(by_index[i]) for i in shared)
    single = max((grad_numel(u) for u in units if u.index not in shared), default=0)
    return {"param_grads": {"device": (waiting + single) * e}} if waiting + single else {}


def working_buffers(
    units: list[UnitPlan],
    config: ZeroConfig,
    world: int,
    swap: SwapPlan | None,
    device: str = "cuda",
    act_total: int = 0,
) -> dict[str, dict[str, int]]:
    """Upper bounds of the engine's working memory during a step, by kind and tier (see
    [Note: working buffers]): ``gathered``, ``nvme_reads``, ``gather_cache``, ``pool``,
    ``pool_late``, ``grads_kept``, ``host_copies``, ``param_grads``, and ``host_cache``
    (freed tensors kept for reuse; ``act_total``: the activations' bytes)."""
    out = host_cache_bytes(units, config, device, act_total)
    out.update(_gathered(units, config, world, swap, device))
    out.update(_pool(units, config, world, swap, device))
    out.update(_grads_kept(units, config, swap))
    copies = host_copy_buffers(units, config, world, swap, device)
    if copies:
        out["host_copies"] = copies
    out.update(_param_grads(units, config))
    return out
