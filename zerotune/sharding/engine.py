"""The ZeRO engine: owns the units, their hooks, the buffer pool and the prefetcher.

``shard(model, config)`` cuts the model into units (see [Note: unit policy] in plan.py),
moves every parameter into its unit's flat shard (see [Note: flat layout] in unit.py), and
installs the hooks of [Note: pins and hooks] in hooks.py, which move each unit through
[Note: unit life cycle] in unit.py. The model keeps working as before: the same
``nn.Parameter`` objects, ``model.parameters()``, forward and ``loss.backward()``.
Stages: 3 shards parameters, gradients and optimizer state; 2 keeps parameters gathered;
1 also keeps whole gradients until the optimizer step.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import dist as zdist
from ..config import ZeroConfig, load_config
from ..memory.host import (
    host_cache_report,
    host_cache_used,
    keep_freed_buffers,
    prefer_mmap_for_large_buffers,
    release_free_memory,
)
from ..memory.pool import BufferPool
from ..memory.tiers import (
    DeviceParams,
    HostParams,
    MemoryGrads,
    NvmeGrads,
    NvmeParams,
    placement,
)
from ..optim.scaling import DynamicLossScaler
from .buffers import gather_cache_bytes, gathers_into_cache, pool_keep_sizes, prefetch_budget
from .compiled import CompiledUnits
from .copies import CopiedAsSource, guard_resize
from .external import ExternalParams, ShardedParameterError
from .grads import GradReducer
from .hooks import Prefetcher, in_backward, install_hooks, unit_built
from .plan import (
    UnitPlan,
    assign_params,
    plan_swap,
    refuse_embeddings_it_would_break,
    refuse_parameter_dtypes,
    size_unit,
    unit_deps,
)
from .state_dict import check_modifier, units_of, write_gathered
from .tiling import apply_tiling, merge_tiles, tiled_weights
from .unit import Unit, UnitState

__all__ = ["ShardedParameterError", "ZeroEngine", "shard"]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())


def shard(
    model: nn.Module, config: ZeroConfig | dict | str | None = None, group=None
) -> ZeroEngine:
    """Shard ``model`` in place across the ranks of ``group`` and return its engine."""
    return ZeroEngine(model, load_config(config), group=group)


def _unit_modules(root: nn.Module, other_units: set[int]) -> list[nn.Module]:
    """The modules of the unit rooted at ``root``, children before parents, without the
    subtrees of other units."""
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) not in other_units:
                visit(child)
        order.append(m)

    visit(root)
    return order


class ZeroEngine(CopiedAsSource, nn.Module):
    """Wraps a model whose parameters are sharded; calling it calls the model."""

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        group=None,
        *,
        device: torch.device | str | None = None,
        prepare_unit=None,
    ):
        """``prepare_unit(name, modules, params)`` (used by zero-init and streaming loads) runs
        just before each unit is built, with the unit's modules in post-order; it either makes
        the parameters real (returns None) or returns ``fill(unit, master_slice)`` that writes
        this rank's slice of the unit from elsewhere."""
        super().__init__()
        if isinstance(model, ZeroEngine) or getattr(model, "_zerotune_engine", None) is not None:
            raise ValueError("this model is already sharded by zerotune")
        self.module, self.config, self.group = model, config, group
        self.rank, self.world = zdist.get_rank(group), zdist.get_world_size(group)
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = torch.device(device)
        if self.device.type != "cpu" and self.device.index is None:
            # "cuda" and "cuda:0" compare unequal: name the index, so that device checks hold.
            dm = getattr(torch, self.device.type)
            self.device = torch.device(self.device.type, dm.current_device())
        self._prepare_unit = prepare_unit
        # Large linears become tiles before units are formed (see [Note: tiling]); the map
        # lets optimizer groups built from the untiled model find the tiles.
        itemsize = torch.finfo(config.torch_dtype).bits // 8
        refuse_embeddings_it_would_break(model, config, self.world)
        refuse_parameter_dtypes(model)
        self.tiled_from = apply_tiling(model, config.tile_linear_bytes, itemsize)
        if "cpu" in (config.offload_param, config.offload_optimizer):
            # Host memory holds the offloaded state: keep its RSS honest (memory/host.py;
            # NVMe offload does the same when it opens its swap files).
            prefer_mmap_for_large_buffers()
        self._release_host_cache = None
        if host_cache_used(config, self.device.type):
            # Freed tensors of 1 MiB and more are kept for reuse within a budget (memory/host.py)
            self._release_host_cache = keep_freed_buffers(config.host_cache_bytes)
            if self._release_host_cache is not None:
                weakref.finalize(self, self._release_host_cache)
        self.pool = BufferPool(self.device)
        # Buffers that meet the host (NVMe I/O, gradients for an offloaded optimizer): the
        # same pool on a CPU device, else pinned, kept for the run (pinning is slow).
        self.host_pool = self.pool if self.device.type == "cpu" else BufferPool("cpu", pin=True)
        self.prefetcher = Prefetcher(prefetch_budget(config))
        self.scaler = None
        if config.torch_dtype == torch.float16:
            c = config
            self.scaler = DynamicLossScaler(c.loss_scale_init, c.loss_scale_window,
                                            c.loss_scale_min, c.loss_scale_rule,
                                            c.loss_scale_hysteresis,
                                            c.loss_scale_consecutive_hysteresis)  # fmt: skip
        self.swap = self.staging = None
        self._grads_on_disk = False
        self._lowp_buffers: dict[int, torch.Tensor] = {}
        self.units = self._build_units(model)
        if self.pool.gather_cache is not None:
            self.pool.gather_cache.keep_bytes = gather_cache_bytes(
                [
                    u.gathered_bytes
                    for u in self.units
                    if gathers_into_cache(
                        persistent=u.persistent,
                        numel=u.numel,
                        lends_storage=u.params.lends_storage(u),
                        mapped=u.params.mapped,
                        cache=True,
                    )
                ],
                self.prefetcher.budget,
            )
        trainable = [(u.padded_numel, u.shard_numel) for u in self.units if u.trainable and u.numel]
        self.pool.keep_only(pool_keep_sizes(trainable, config, self.world, self.device.type))
        self.optimizer = None  # attach_optimizer
        # Gradients into their shards: no_sync, unused parameters, overlap (grads.py).
        self.reducer = GradReducer(
            self.units, config, self.world, group, self.device, self.host_pool
        )
        # The optimizer's step goes on updating units in the next forward (see [Note:
        # carrying the step into the next forward] in optim/zero_adam.py).
        self._carrying = False
        self._final_callback_queued = False
        self._outer_task = -1  # autograd's graph task of the backward pass running
        self._handles = install_hooks(self)
        self.external = ExternalParams(self)
        self.compiled: CompiledUnits | None = None  # see compile()
        self.activations = None  # see [Note: activation checkpoint offload] in activations.py
        if config.offload_activations != "none":
            from .activations import CheckpointOffload

            self.activations = CheckpointOffload(self)
        object.__setattr__(model, "_zerotune_engine", self)
        guard_resize(model, self)  # [Note: resizing a sharded model's embeddings] in copies.py
        if self.world > 1 and config.stage == 3:
            # transformers' generate then runs forwards on every rank until all are done.
            model._is_fsdp_managed_module = True
        n = sum(u.numel for u in self.units)
        log.info(
            "zerotune: stage %d, %d units, %.2fM parameters, world size %d, dtype %s",
            config.stage,
            len(self.units),
            n / 1e6,
            self.world,
            config.dtype,
        )

    # ---------------------------------------------------------------------- construction
    def _build_units(self, model: nn.Module) -> list[Unit]:
        # The sizes come from plan.py, which `zerotune estimate` uses too: one set of rules.
        specs, per_unit, owned = assign_params(model, self.config.unit_modules)
        deps = unit_deps(specs, owned)
        plans = [
            size_unit(
                i,
                name,
                [(pname, p.numel(), p.requires_grad) for pname, p in per_unit[i]],
                self.config,
                self.world,
                tuple(deps[i]),
            )
            for i, (name, _) in enumerate(specs)
        ]
        self._open_swap(plans)
        unit_module_ids = {id(m) for _, m in specs[1:]}
        # A model that never trains (a reference, a teacher) keeps no fp32 master.
        frozen = not any(p.requires_grad for params in per_unit for _, p in params)
        units: list[Unit] = []
        for i, (name, module) in enumerate(specs):
            fill = None
            if self._prepare_unit is not None:
                fill = self._prepare_unit(name, _unit_modules(module, unit_module_ids), per_unit[i])
            unit = Unit(
                i,
                name,
                module,
                per_unit[i],
                dtype=self.config.torch_dtype,
                grad_dtype=self.config.torch_grad_dtype,
                device=self.device,
                persistent=plans[i].persistent,
                pool=self.pool,
                host_pool=self.host_pool,
                group=self.group,
                fill=fill,
            )
            if frozen:
                unit.drop_master()  # before placing: no master to copy to a tier
            self._place(unit)  # to its tiers now: the next unit's construction needs the room
            unit_built(i + 1, len(specs))
            units.append(unit)
        # Dependencies: tied weights found at wrap time (external.py: those found running).
        for unit, unit_deps_ in zip(units, deps):
            for j in unit_deps_:
                unit.add_dep(units[j])
            for dep in unit.deps:
                log.info("zerotune: unit %s uses parameters of unit %s", unit.name, dep.name)
        return units

    def _open_swap(self, plans: list[UnitPlan]) -> None:
        """Create this rank's swap files and staging pool, as plan_swap lays them out."""
        swap_plan = plan_swap(plans, self.config, self.world)
        if swap_plan is None:
            return
        from ..memory.swap import StagingPool, SwapSpace

        self._grads_on_disk = swap_plan.grads_on_disk
        self._optim_layout = swap_plan.layout
        # Parameter and gradient files: buffered I/O; the optimizer file: O_DIRECT staging.
        self.swap = SwapSpace(
            self.config.nvme_path,
            swap_plan.sizes,
            self.config,
            self.group,
            direct={"param": False, "grad": False, "optim": True},
        )
        self.staging = StagingPool(self.config.staging_bytes, swap_plan.slot_bytes)

    def _place(self, unit: Unit) -> None:
        """Move a freshly built unit's shards to their tiers (see [Note: memory tiers])."""
        cfg = self.config
        host = torch.device("cpu")
        where = placement(
            cfg,
            persistent=unit.persistent,
            numel=unit.numel,
            trainable=unit.trainable,
            itemsize=torch.finfo(unit.dtype).bits // 8,
            grads_on_disk=self._grads_on_disk,
            device_type=self.device.type,
        )
        on_host = self.device.type != "cpu"  # else host and device are one memory
        unit.keep_on_host(params=where.params == "host" and on_host, master=where.master == "host")
        if where.params == "nvme":
            extent = self.swap.extent("param", unit.index)
            mapped = (
                cfg.map_param_file
                and unit.world == 1
                and self.device.type == "cpu"
                and not extent.file.direct
                and self.pool.gather_cache is not None
                and extent.offset % mmap.ALLOCATIONGRANULARITY == 0  # 4 KiB extents, 64 KiB pages
            )
            params = NvmeParams(extent, mapped)
        elif where.params == "host" and on_host:
            params = HostParams()
        else:
            params = DeviceParams()
        if where.grads == "nvme":
            grads = NvmeGrads(self.swap.extent("grad", unit.index))
        else:  # in memory; see [Note: gradients left in the parameters]
            home = host if where.grads == "host" else self.device
            kept = self.device.type == "cpu" and self.world == 1 and unit.grad_dtype == unit.dtype
            grads = MemoryGrads(home, kept)
        unit.place(where, params, grads)
        if where.master in ("nvme", "param_file"):
            from ..optim.state_store import write_initial_state

            write_initial_state(unit, self.swap, self.staging, self._optim_layout)

    @property
    def optim_layout(self):
        """How the optimizer's state is laid out in the NVMe optim file (OptimLayout), or
        None without NVMe optimizer offload."""
        return getattr(self, "_optim_layout", None)

    def make_optimizer_store(self, units: list[Unit]):
        """Where the optimizer keeps master weights and moments (see optim/state_store.py)."""
        from ..optim.state_store import NvmeStore, ResidentStore

        if self.config.offload_optimizer == "nvme":
            return NvmeStore(
                self.swap, self.staging, self._optim_layout, self.config.map_param_file
            )
        return ResidentStore(units, self.config.optim_state_bits)

    def grad_chunks(self, unit: Unit):
        """(start, stop, gradient values) over this rank's gradient shard of ``unit``."""
        return unit.grads.chunks(unit)

    def lowp_target(self, unit: Unit) -> torch.Tensor | None:
        """The compute-dtype shard the optimizer refreshes (None: it is the master itself,
        in memory or, with fp32 compute and both tiers on NVMe, in the parameter file). A
        host buffer stands in for a shard on NVMe, or on the device when the optimizer runs
        on the host (``lowp_done`` moves it)."""
        if unit.placement.master_in_param_file:
            return None
        if unit.shard is not None and unit.master is unit.shard:
            return None
        # The update runs where the master is (on the host when it streams from NVMe).
        update_device = torch.device("cpu") if unit.master is None else unit.master.device
        if not unit.params.staged_for(unit, update_device):
            return unit.shard
        buf = self._lowp_buffers.get(unit.index)
        if buf is None:
            buf = self._lowp_buffers[unit.index] = self.host_pool.acquire(
                unit.shard_numel, unit.dtype
            )
        return buf

    def lowp_done(self, unit: Unit, target: torch.Tensor | None) -> None:
        if target is None or self._lowp_buffers.get(unit.index) is not target:
            return
        self._lowp_buffers.pop(unit.index)
        unit.store_shard(target, give_back=self.host_pool.release)

    def close(self) -> None:
        """Finish pending I/O and remove this rank's swap files (also done at exit)."""
        self.settle_optimizer(overwrite=True)  # a carry that failed has said so already
        for u in self.units:
            u.wait_writes()
        if self.activations is not None:
            self.activations.close()
        if self.swap is not None:
            self.swap.close()
        if self._release_host_cache is not None:
            self._release_host_cache()

    # ------------------------------------------------------------------------ the model
    def forward(self, *args, **kwargs):
        if self._final_callback_queued and not in_backward():
            # The last backward raised before its end (its final callback never ran).
            self._reset_backward_state()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the fp16 loss scale when there is one."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward()

    def checkpoint(self, function, *args, use_reentrant: bool = False, **kwargs):
        """``torch.utils.checkpoint.checkpoint`` whose saved inputs follow ``offload_activations``
        (Hugging Face layers need not call it: their own checkpointing is picked up)."""
        if self.activations is None:
            return checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
        return self.activations.checkpoint(
            checkpoint, function, *args, use_reentrant=use_reentrant, **kwargs
        )

    def compile(self, **kwargs) -> None:
        """Compiles each unit's forward ([Note: compiled units]); ``disable=True`` undoes it."""
        if self.compiled is not None:
            self.compiled.remove()
        self.compiled = None if kwargs.get("disable") else CompiledUnits(self.units, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full gradients locally, without communication;
        the first backward outside reduces them together with its own."""
        with self.reducer.no_sync():
            yield

    @contextlib.contextmanager
    def gathered(self, what=None, modifier_rank: int | None = None) -> Iterator[None]:
        """Gather parameters (of ``what``: units, modules, parameters, or an iterable of
        them; all by default) for reading or writing outside forward; every rank enters. On
        leaving, units that nothing else holds are released. Changes made to gathered
        parameters reach the shards only with ``modifier_rank=r``: when the block ends without
        an exception, rank r's values go into every rank's masters and compute copies (see
        [Note: writes inside gathered()] in state_dict.py; refused in one line at entry inside
        forward or backward, or between an overlapped backward and its ``step()``)."""
        check_modifier(self, modifier_rank)
        chosen = units_of(self, what)
        for unit in chosen:
            self._pin(unit)
        try:
            yield
            write_gathered(self, chosen, modifier_rank)  # none without a modifier rank
        finally:
            for unit in chosen:
                unit.unpin()

    def register_external(self, owner, user, pin: bool = False) -> None:
        """Gather ``owner`` whenever ``user`` runs (forward and backward).

        Public form: ``register_external("emb.weight", module)`` (a parameter's qualified
        name, or the parameter): the unit owning the parameter is gathered with the unit that
        ``module`` belongs to. Automatic detection covers the usual cases (see
        sharding/external.py); this is for what it cannot see.
        """
        if isinstance(owner, str):
            params = dict(self.module.named_parameters(remove_duplicate=False))
            if owner not in params:
                raise ValueError(f"the model has no parameter named {owner!r}")
            owner = params[owner]
        if isinstance(owner, nn.Parameter):
            owner = units_of(self, owner)[0]
        if isinstance(user, nn.Module):
            user = self._unit_of_module(user)
        if owner is user or owner in user.deps:
            return
        user.add_dep(owner)
        if pin:
            self._pin(owner)

    def _unit_of_module(self, module: nn.Module) -> Unit:
        for unit in self.units[1:]:
            if any(m is module for m in unit.module.modules()):
                return unit
        if any(m is module for m in self.module.modules()):
            return self.units[0]
        raise ValueError("this module is not part of the sharded model")

    def reshard(self, prepare_model, prepare_unit) -> None:
        """Shard the model again by the same config after ``prepare_model()`` changed shapes
        ([Note: resizing a sharded model's embeddings] in copies.py); ``prepare_unit`` as for
        the constructor. The old units stay readable (``unit_state``) until it returns."""
        if self.optimizer is not None:
            raise RuntimeError("reshard: the engine has an optimizer already")
        units, swap, activations = self.units, self.swap, self.activations
        release = self._release_host_cache
        self.remove_hooks()
        prepare_model()
        model, config, group, device = self.module, self.config, self.group, self.device
        object.__delattr__(model, "_zerotune_engine")
        ZeroEngine.__init__(self, model, config, group, device=device, prepare_unit=prepare_unit)
        for unit in units:
            unit.wait_writes()
        for old in (activations, swap):
            if old is not None:
                old.close()
        if release is not None:
            release()

    def remove_hooks(self) -> None:
        """Take every hook and class swap off the model (the parameters stay sharded)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.external.remove()
        self.compile(disable=True)
        if self.activations is not None:
            self.activations.remove()

    # ------------------------------------------------- the optimizer's side of the step
    # See [Note: the step interface] in optim/sharded.py.
    def attach_optimizer(self, optimizer) -> None:
        """``optimizer`` updates this engine's shards (one optimizer per engine)."""
        if self.optimizer is not None:
            raise ValueError("this engine already has an optimizer")
        self.optimizer = optimizer

    def detach_optimizer(self) -> None:
        """Hand the shards over to the next optimizer (a second Trainer given the same
        model): the current one finishes the updates it carried into this forward and gives
        up its state (see ``ShardedOptimizer.detach``); the weights stay as trained."""
        old = self.optimizer
        if old is None:
            return
        if self.reducer.overlapping:
            raise RuntimeError("an overlapped step is open: call step() before replacing it")
        self.settle_optimizer()
        self._carrying = False
        old.detach()
        self.optimizer = None

    def carry_into_forward(self, carrying: bool) -> None:
        """Whether the optimizer's last step goes on in the next forward: the engine then
        pumps it between layers and settles a unit's update before gathering the unit."""
        self._carrying = carrying

    # ------------------------------------------------------------------ unit life cycle
    # See [Note: pins and hooks] in hooks.py and [Note: unit life cycle] in unit.py.
    def settle_optimizer(self, unit: Unit | None = None, overwrite: bool = False) -> None:
        """Finish the optimizer updates the last step carried into this forward: ``unit``'s,
        or all of them (see [Note: carrying the step into the next forward] in
        optim/zero_adam.py)."""
        if self._carrying:
            self.optimizer.settle(unit, overwrite=overwrite)

    def units_kept_gathered(self) -> list[Unit]:
        """The units gathered now or for good (persistent): not gathered again before use."""
        return [u for u in self.units if u.persistent or u.state is not UnitState.SHARDED]

    def _pin(self, unit: Unit, lookup: torch.Tensor | None = None) -> None:
        """Pin and gather ``unit``; ``lookup``: the indices an embedding unit is about to
        look up, whose rows may come from the carried step's preview (see [Note: looked-up
        rows before their update] in optim/zero_adam.py) instead of its whole update."""
        unit.pin()
        self._make_room(unit)
        if unit.update_pending:
            opt = self.optimizer
            alone = unit.pins == 1 and unit.state is UnitState.SHARDED
            if lookup is not None and alone and opt.can_preview(unit):
                unit.gather_for_preview()
                opt.preview_rows(unit, lookup, unit.slots[0].param)
                return
            self.settle_optimizer(unit)
            if unit.previewed and unit.state is not UnitState.SHARDED:
                unit.reread()  # gathered for a lookup: only its rows were new
        unit.gather()

    def _unpin_with_deps(self, unit: Unit) -> None:
        for held in (unit, *unit.deps):
            held.unpin()

    def _make_room(self, unit: Unit) -> None:
        limit = self.config.max_live_bytes
        if limit <= 0 or unit.persistent or unit.state is not UnitState.SHARDED:
            return
        live = sum(
            u.gathered_bytes
            for u in self.units
            if not u.persistent and u.state is not UnitState.SHARDED
        )
        if live + unit.gathered_bytes <= limit:
            return
        # Drop units gathered ahead that nobody holds yet, newest prediction first.
        for other in reversed(self.units):
            if other.pins == 0 and not other.persistent and other.state is not UnitState.SHARDED:
                other.release()
                live -= other.gathered_bytes
                if live + unit.gathered_bytes <= limit:
                    return

    def _use(self, kind: str, unit: Unit) -> None:
        for nxt in self.prefetcher.on_use(kind, unit):
            if nxt.update_pending:
                if self.world == 1:
                    self.optimizer.promote(nxt)  # gathered once updated, when it is needed
                    continue
                # Every rank issues the same gathers, whatever its disk: update, then gather.
                self.settle_optimizer(nxt)
            nxt.gather(async_op=True)

    def pre_forward(self, unit: Unit, args: tuple = ()) -> None:
        if unit.index == 0:
            self.prefetcher.start_pass("forward")
        self.reducer.pre_forward(unit)
        if self._carrying:
            self.optimizer.pump()  # the last step's updates, between this forward's layers
        self._use("forward", unit)
        unit.begin_forward(in_backward())  # recomputed inside a backward: not counted
        lookup = None
        if unit.update_pending and args and isinstance(args[0], torch.Tensor):
            lookup = args[0]  # an embedding's indices (see can_preview)
        self._pin(unit, lookup)
        for dep in unit.deps:
            self._pin(dep)

    def post_forward(self, unit: Unit) -> None:
        unit.end_forward()
        self._unpin_with_deps(unit)
        if unit.index == 0:
            self._release_unheld()

    def forward_in_backward_done(self, unit: Unit) -> None:
        """A forward re-run inside backward (activation checkpointing) just finished."""
        if unit.holds_backward_pins:
            self._unpin_with_deps(unit)
        else:
            unit.begin_backward()  # the forward pins become the backward pins

    def begin_backward(self) -> bool:
        """Called by every pre-backward hook: True for the first of a backward pass (the
        pass is checked and marked begun; the caller queues ``post_backward_final``)."""
        if self._final_callback_queued:
            return False
        self.check_backward()
        self.prefetcher.start_pass("backward")  # the first hook's unit may be any unit
        self._final_callback_queued = True
        self._outer_task = torch._C._current_graph_task_id()
        return True

    def check_backward(self) -> None:
        """A backward pass starts (its first hook): refuse what it cannot do right, and
        finish the last step's updates before any gradient is written."""
        self.settle_optimizer()
        if self.optimizer is not None:
            self.optimizer.before_backward()
        if torch.is_grad_enabled() and self.config.stage == 3:
            # Autograd records this backward (create_graph=True); the next backward through
            # that graph reads weights its units let go of at the end of this one.
            if self.world > 1 or self.config.offload_param != "none":
                raise RuntimeError(
                    "zerotune: a backward with create_graph=True (a gradient penalty, a "
                    "double backward) cannot run at stage 3 when parameters are released "
                    "between uses (world size > 1 or offload_param); use stage 2"
                )
        self.reducer.check_overlapped_backward()

    def pre_backward(self, unit: Unit) -> None:
        if unit.holds_backward_pins:
            return
        self.reducer.pump_overlapped_step()
        if unit.weightless_backward and not unit.deps:
            # Nothing to gather: an embedding's backward needs no weight, only the shape
            # its gradient is stored under.
            unit.keep_shapes()
            return
        unit.begin_backward()
        self._use("backward", unit)
        self._pin(unit)
        for dep in unit.deps:
            self._pin(dep)

    def post_backward(self, unit: Unit) -> None:
        """Every trainable parameter of ``unit`` has its gradient (``Unit.count_grad_ready``):
        reduce them into its gradient shard (``GradReducer.reduce``), let go of the unit,
        and hand its final shard to an overlapped step."""
        # A unit run in several reentrant checkpoints (a cell in a loop) completes its
        # gradients in each one's inner backward: final only once the outer one ends.
        task = torch._C._current_graph_task_id()
        more = unit.pass_state.forward_calls > 1 and task != self._outer_task
        final = self.reducer.reduce(unit, more_to_come=more)
        unit.grads_done()
        # Released first, when nothing else holds it: an update writing the parameter file
        # under a gathered unit that maps it would make it copy its weights (keep_private).
        self._end_backward_if_done(unit)
        if final and not more:
            self.reducer.launch(unit)  # its gradient shard is final: update it now

    def inputs_backward_done(self, unit: Unit) -> None:
        """The gradients of every input of ``unit``'s forward calls exist. Units owning
        frozen parameters wait for this as well as for their trainable gradients before
        they let go of their weights: a tied head (nothing of its own trains) releases
        the embedding's whole matrix here instead of holding it to the end of backward."""
        unit.inputs_done()
        self._end_backward_if_done(unit)

    def _end_backward_if_done(self, unit: Unit) -> None:
        """Let go of ``unit``'s backward pins once its backward is complete."""
        if unit.backward_complete and unit.end_backward():
            self._unpin_with_deps(unit)

    def post_backward_final(self) -> None:
        """End of a backward pass: reduce what is pending, release everything."""
        try:
            self.reducer.end_backward()
        finally:
            self._reset_backward_state()  # also after an error: the next pass starts clean

    def _reset_backward_state(self) -> None:
        """Counters and pins of a backward pass back to their start; every unit released."""
        self._final_callback_queued = False
        self.reducer.end_pass()
        for unit in self.units:
            unit.end_pass()

    def _release_unheld(self) -> None:
        for unit in self.units:
            if unit.pins == 0:
                unit.release()

    # ------------------------------------------------------------------------- training
    def finalize_grads(self) -> None:
        """Make every gradient shard final before clipping or the optimizer step."""
        self.reducer.finalize()

    def after_step(self) -> None:
        for unit in self.units:
            unit.refresh()
        if self.device.type == "cpu" and self.config.offloads:
            # With offload host memory is the budget: give back what the step freed, so
            # fragments do not pile up (memory/host.py). Without offload glibc keeps it, as
            # in plain PyTorch (a trim makes every step fault its memory in again).
            release_free_memory()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.grads_zeroed()  # before the gradients of an open step go
        for unit in self.units:
            unit.accumulator.zero()

    # ---------------------------------------------------------------------- shard state
    def unit_state(self, unit: Unit, master_only: bool = False) -> dict[str, torch.Tensor]:
        """This rank's flat slices of ``unit`` (``shard_numel`` elements each, padding at the
        tail zero): ``master`` (fp32 weights), and once an optimizer exists (unless
        ``master_only``) ``exp_avg``, ``exp_avg_sq`` (8-bit: ``exp_avg.q8``, ``exp_avg.absmax``,
        ``exp_avg_sq.q8``, ``exp_avg_sq.absmax``; see optim/quant8.py). The tensors are the
        live ones: checkpoints read them, and ``load_unit_state`` writes them."""
        optimizer = getattr(self, "optimizer", None)
        self.settle_optimizer()
        if optimizer is not None and optimizer.owns(unit):
            return optimizer.read_unit(unit, master_only)
        return {"master": unit.params.read(unit).float() if unit.master is None else unit.master}

    @torch.no_grad()
    def load_unit_state(self, unit: Unit, state: dict[str, torch.Tensor]) -> None:
        """Overwrite this rank's slices of ``unit`` (keys as in ``unit_state``) and bring the
        compute-dtype copy (and, for gathered units, the whole buffer) up to date. Every rank
        must call it for every unit: gathered units all-gather."""
        self.settle_optimizer(overwrite=True)
        optimizer = getattr(self, "optimizer", None)
        with_optimizer = optimizer is not None and optimizer.owns(unit)
        # fp32 moments are accepted for 8-bit units too (they are quantized).
        allowed = optimizer.state_numels(unit) if with_optimizer else {"master": unit.shard_numel}
        for key, value in state.items():
            if key not in allowed:
                raise KeyError(f"unit {unit.name} has no state {key!r}")
            if value.numel() != allowed[key]:
                raise ValueError(
                    f"unit {unit.name}: {key} has {value.numel()} elements, expected {allowed[key]}"
                )
        if with_optimizer:
            optimizer.write_unit(unit, state)
        elif "master" in state and unit.master is not None:
            unit.master.copy_(state["master"].reshape(-1))
        if "master" in state:
            unit.params.put(unit, state["master"].reshape(-1).to(unit.dtype))
        unit.reload()

    # ------------------------------------------------------------------------ reporting
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: params (compute-dtype shards, or whole buffers for
        gathered units), master (fp32 master copies when the compute dtype is not fp32),
        grads (gradient shards), optimizer (Adam moments, once an optimizer exists), pool
        (reduce buffers), gathered_now / gathered_peak (gathered parameters of sharded units),
        gather_cache (most bytes of emptied gather buffers kept for reuse), host_cache (most
        bytes of freed tensors kept for reuse, ``host_cache_bytes``), padding_elements."""
        report = {"params": 0, "master": 0, "grads": 0, "optimizer": 0, "padding_elements": 0}
        for unit in self.units:
            for k, v in unit.memory_bytes().items():
                report[k] += v
        if self.config.stage == 1:
            # Whole gradients wait in param.grad from backward to the optimizer step.
            report["full_grads"] = sum(
                s.numel * s.param.element_size() for u in self.units for s in u.slots if s.trainable
            )
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            report["optimizer"] = optimizer.state_bytes()
        report["pool"] = self.pool.allocated_bytes
        if self.host_pool is not self.pool:
            report["host_pool"] = self.host_pool.allocated_bytes  # pinned, on the host
        report["staging"] = self.staging.allocated if self.staging is not None else 0
        report["nvme"] = self.swap.total_bytes if self.swap is not None else 0
        report["grads_held_peak"] = self.host_pool.held_grads.peak
        report["gathered_now"] = self.pool.gathered.now
        report["gathered_peak"] = self.pool.gathered.peak
        cache = self.pool.gather_cache
        report["gather_cache"] = cache.peak_kept_bytes if cache is not None else 0
        # Freed tensors kept for reuse (memory/host.py), process-wide: at most the budget.
        report["host_cache"] = host_cache_report()["peak_kept"] if self._release_host_cache else 0
        if self.activations is not None:
            report.update(self.activations.memory_report())
        return report

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, as CPU tensors (gathers unit by unit; every rank must call)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            with self.gathered([unit]):
                for s in unit.slots:
                    out[s.name] = s.param.detach().to("cpu", copy=True)
        return merge_tiles(out, tiled_weights(self.module))  # the untiled names and shapes
