"""A sharding unit: a group of parameters stored as one flat, rank-major shard per rank.

[Note: flat layout]
The parameters a unit owns are laid end to end in module order into one flat buffer of
``padded_numel`` elements (``numel`` rounded up to a multiple of the world size). Rank ``r``
keeps the slice ``[r * shard_numel, (r + 1) * shard_numel)``. An all-gather of every rank's slice
lands the whole flat buffer (``flat``), and each parameter's ``.data`` becomes a view of it: the
``nn.Parameter`` objects never change, only what their data points to. Released, a parameter
holds an empty tensor of its dtype, and ``flat`` keeps its tensor object but frees its storage
(resized to 0 bytes). Keeping the same storage object matters: autograd saves views of the
weights in forward (``weight.t()`` for a linear) and reads them in backward, after the unit was
released and gathered again; they must find this unit's data there, not whatever a shared
buffer holds by then. The padding at the tail is zero in parameters, gradients and optimizer
state, so it never changes the math.

Each unit keeps, for its shard: the compute-dtype copy (``shard``), the fp32 master weights
(``master``; the same tensor as ``shard`` when the compute dtype is fp32), and the accumulated
gradient (``grad_shard``). Units that stay gathered (stages 1-2, or small units under the
persistence threshold) keep the whole flat buffer (``full``) and ``shard`` is a view into it.

[Note: unit life cycle]
A unit has two states. ``state`` (UnitState) is what its parameters hold: SHARDED,
GATHERING, GATHERED; ``gather`` and ``release`` move it, pins decide when (see [Note: pins
and hooks] in hooks.py). ``training_state`` (TrainingState) is what the unit does in the
current pass; the engine's hooks move it, always through the unit's verbs:

    IDLE -begin_forward-> FORWARD -end_forward-> IDLE
    IDLE -begin_backward-> BACKWARD -end_backward-> POST_BACKWARD -end_pass-> IDLE

``begin_backward`` runs at the unit's pre-backward, or when a forward re-run inside backward
(activation checkpointing) ends: its pins become backward pins, held until ``end_backward``
(a forward re-run while BACKWARD leaves it BACKWARD). ``end_backward`` comes once
``backward_complete``: every trainable gradient accumulated (``count_grad_ready``) and
reduced (``grads_done``), and for a unit that waits for them its inputs' gradients too
(``inputs_done``). An embedding's unit, not gathered for its backward, goes from IDLE to
POST_BACKWARD. ``end_pass`` (the end-of-backward callback, or the next forward after a
backward that failed) resets the pass's counters (``PassState``) and pins and releases the
unit. Each micro-batch runs this cycle once; the optimizer step moves no training state.
Apart from it, ``update_pending`` (``queue_update`` to ``update_done``) marks an overlapped
step's update still to run, possibly into the next forward.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import dist as zdist
from ..memory.aio import aligned_empty
from ..memory.pinned import pinned_copy
from ..memory.pool import BufferPool
from ..memory.tiers import DeviceParams, MemoryGrads, NvmeGrads, NvmeParams, Placement
from .copies import NotPickled
from .grads import GradAccumulator

__all__ = ["PassState", "Slot", "TrainingState", "Unit", "UnitState"]


class UnitState(enum.Enum):
    """What the unit's parameters hold."""

    SHARDED = "sharded"  # parameters are empty; only this rank's shard exists
    GATHERING = "gathering"  # an asynchronous all-gather is in flight
    GATHERED = "gathered"  # parameters are views of the whole flat buffer


class TrainingState(enum.Enum):
    """What the unit is doing in the current pass (see [Note: unit life cycle])."""

    IDLE = "idle"  # no forward or backward of it is running
    FORWARD = "forward"  # its forward runs (pinned by it)
    BACKWARD = "backward"  # its backward runs: it holds its backward pins
    POST_BACKWARD = "post_backward"  # its backward is done for this pass


@dataclass
class PassState:
    """The counters and flags of one backward pass (``reset`` at its end)."""

    grads_ready: int = 0  # trainable parameters whose gradient has accumulated
    input_waits: int = 0  # gradients of forward inputs still to come (waits_for_inputs)
    forward_calls: int = 0  # forwards run outside backward since the last pass ended
    grads_final: bool = False  # its gradient shard is final for this pass
    inputs_final: bool = False  # the gradients of its forward inputs all exist

    def reset(self) -> None:
        self.grads_ready = self.input_waits = self.forward_calls = 0
        self.grads_final = self.inputs_final = False


@dataclass
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    # The parameter got a gradient since the last zero_grad, on any rank (see [Note:
    # parameters without a gradient]).
    got_grad: bool = False
    watched: bool = False  # trainable when the engine was built (see ZeroAdamW's check)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy, pinned when an accelerator exists (fast, asynchronous copies), of its
    own size ([Note: exact-size pinned memory] in memory/pinned.py)."""
    return pinned_copy(t) if torch.cuda.is_available() else t.to("cpu")


class Unit(NotPickled):
    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
        persistent: bool,
        pool: BufferPool,
        host_pool: BufferPool | None = None,
        group=None,
        fill=None,
    ):
        """``fill(unit, shard)``, when given, writes this rank's slice of the flat buffer
        (from a checkpoint, say) and the parameters' own data is never read. ``pool`` holds
        buffers on ``device``; ``host_pool`` (the same pool on a CPU device, else pinned
        host memory) those that meet the host: NVMe reads and writes, gradient shards
        kept on the host."""
        self.index: int = index
        self.name: str = name
        self.module: nn.Module = module
        self.dtype: torch.dtype = dtype
        self.grad_dtype: torch.dtype = grad_dtype
        self.device: torch.device = device
        self.pool: BufferPool = pool
        self.group = group
        self.host_pool: BufferPool = pool if host_pool is None else host_pool
        self.rank: int = zdist.get_rank(group)
        self.world: int = zdist.get_world_size(group)

        self.slots: list[Slot] = []
        offset = 0
        for pname, p in named_params:
            # Watched: its gradient has a hook (stages 2 and 3) when trainable now.
            self.slots.append(Slot(pname, p, offset, p.numel(), p.shape, watched=p.requires_grad))
            offset += p.numel()
        self.numel: int = offset
        self.padded_numel: int = math.ceil(offset / self.world) * self.world
        self.shard_numel: int = self.padded_numel // self.world
        self.shard_start: int = self.rank * self.shard_numel
        self.trainable: bool = any(s.trainable for s in self.slots)
        self.n_trainable: int = sum(1 for s in self.slots if s.trainable)
        self.persistent: bool = persistent
        self.gathered_bytes: int = self.padded_numel * (torch.finfo(dtype).bits // 8)
        # Units whose parameters this unit's modules use (tied or external weights): gathered
        # with it (``add_dep``; see external.py).
        self.deps: list[Unit] = []
        # An embedding's backward reads only the indices and the gradient, never the
        # weight: such a unit is not gathered for backward (see ZeroEngine.pre_backward).
        self.weightless_backward: bool = (
            isinstance(module, nn.Embedding)
            and type(module).forward is nn.Embedding.forward
            and len(self.slots) == 1
        )
        # A unit owning frozen parameters (a tied head owns none that train) is done with
        # its weights only once the gradients of its inputs exist too: a frozen weight's
        # backward node may run after the trainable gradients are complete (see
        # ZeroEngine.inputs_backward_done).
        self.waits_for_inputs: bool = self.n_trainable < len(self.slots) or self.n_trainable == 0

        own = slice(self.shard_start, self.shard_start + self.shard_numel)
        # This rank's slice in fp32 first: it becomes the master weights, so a bf16/fp16
        # compute copy never rounds the master.
        if fill is None:
            # The parameters hold real data: flatten them, keep this rank's slice.
            whole = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
            with torch.no_grad():
                for s in self.slots:
                    whole[s.offset : s.offset + s.numel].copy_(s.param.data.reshape(-1))
            master = whole[own].clone() if self.world > 1 else whole
            del whole
        else:
            # The parameters are placeholders (meta): ``fill`` writes this rank's slice.
            master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            fill(self, master)
        shard = master if dtype == torch.float32 else master.to(dtype)
        if persistent or self.world == 1:
            # The whole flat buffer stays: gathered units keep it, and at world size 1 the
            # shard is the whole buffer.
            flat = shard
            if self.world > 1:
                flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
                zdist.all_gather_into(flat, shard, group=group)
            self.flat: torch.Tensor = flat
            self.shard: torch.Tensor | None = flat[own]
        else:
            # A tensor of padded_numel elements over a storage (re)allocated on each gather.
            self.shard = shard
            self.flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
            self.flat.untyped_storage().resize_(0)
        self.full: torch.Tensor | None = self.flat if persistent else None
        # None once the optimizer's files hold it (drop_master).
        self.master: torch.Tensor | None = self.shard if dtype == torch.float32 else master
        del master, shard
        # Where the shards live (see [Note: memory tiers] in memory/tiers.py): in memory on
        # the device until the engine places the unit.
        self.placement: Placement = Placement("device", "device", "device", dtype != torch.float32)
        self.params: DeviceParams | NvmeParams = DeviceParams()  # or HostParams
        self.grads: MemoryGrads | NvmeGrads = MemoryGrads(device)
        self.accumulator: GradAccumulator = GradAccumulator(self)
        # Called with the unit as its all-gather is issued (world > 1; report_gathers_to).
        self.on_gather = None
        # The life cycle (see [Note: unit life cycle]): what its parameters hold, what it
        # does in this pass, the pins keeping it gathered, this backward's counters.
        self.state: UnitState = UnitState.SHARDED
        self.training_state: TrainingState = TrainingState.IDLE
        self.pins: int = 0
        self.pass_state: PassState = PassState()
        self._placeholders: bool = False  # released parameters keep their shapes (keep_shapes)
        self._fetch = None  # the parameter tier's fetch in flight (GATHERING)
        # An overlapped step's update of this unit is queued or running (it may run on
        # into the next forward): its gradient stays until the update is done.
        self.update_pending: bool = False
        # Gathered for a lookup with only the looked-up rows new (see [Note: looked-up rows
        # before their update] in optim/zero_adam.py); cleared on release.
        self.previewed: bool = False
        self._mapped: bool = False  # flat's storage is a mapping of the parameter file now
        self._lent = None  # the GatherCache buffer behind flat's storage while gathered
        self.pending_writes: list = []  # this unit's entries of pool.writes
        # The optimizer store's writes of the fp32 master into the parameter extent (the
        # parameter file holds the master with fp32 compute; optim/state_store.py):
        # gathers wait.
        self.param_file_writes: list = []
        if persistent:
            self._point_params(self.full)
            self.state = UnitState.GATHERED
        else:
            self._empty_params()

    # ------------------------------------------------------------------------- life cycle
    # See [Note: unit life cycle].
    def begin_forward(self, recomputed: bool = False) -> None:
        """Its forward starts (a forward re-run inside its backward leaves it BACKWARD);
        ``recomputed``: inside a backward (a checkpoint's recompute), not counted."""
        if not recomputed:
            self.pass_state.forward_calls += 1
        if self.training_state is not TrainingState.BACKWARD:
            self.training_state = TrainingState.FORWARD

    def end_forward(self) -> None:
        """Its forward is done (outside backward)."""
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE

    @property
    def holds_backward_pins(self) -> bool:
        """Whether its backward runs (BACKWARD): it holds its backward pins."""
        return self.training_state is TrainingState.BACKWARD

    def begin_backward(self) -> None:
        """Its backward starts: the pins taken now stay until ``end_backward``."""
        self.training_state = TrainingState.BACKWARD

    def count_grad_ready(self) -> bool:
        """One trainable parameter's gradient has accumulated: True when that completes
        the unit's (the count then starts over)."""
        self.pass_state.grads_ready += 1
        if self.pass_state.grads_ready != self.n_trainable:
            return False
        self.pass_state.grads_ready = 0
        return True

    def expect_input_grads(self, n: int) -> None:
        """``n`` more gradients of forward inputs to wait for in this pass."""
        self.pass_state.input_waits += n

    def input_grad_arrived(self) -> bool:
        """One awaited input gradient exists: True when none is left to wait for."""
        self.pass_state.input_waits -= 1
        return self.pass_state.input_waits == 0

    def grads_done(self) -> None:
        """Its gradient shard is final for this pass."""
        self.pass_state.grads_final = True

    def inputs_done(self) -> None:
        """The gradients of its forward inputs all exist."""
        self.pass_state.inputs_final = True

    @property
    def backward_complete(self) -> bool:
        """Whether its gradients (if it has trainable parameters) and, where it waits for
        them, its inputs' gradients are final: it may let go of its weights."""
        grads = self.pass_state.grads_final or self.n_trainable == 0
        return grads and (self.pass_state.inputs_final or not self.waits_for_inputs)

    def end_backward(self) -> bool:
        """Its backward is done for this pass (POST_BACKWARD): whether it held backward
        pins, which the caller lets go."""
        held = self.training_state is TrainingState.BACKWARD
        self.training_state = TrainingState.POST_BACKWARD
        return held

    def end_pass(self) -> None:
        """The backward pass is over (or failed): state, pins and counters start over, and
        the unit is released."""
        self.pass_state.reset()
        self.training_state = TrainingState.IDLE
        self.pins = 0
        self.release()

    def pin(self) -> None:
        """One more holder keeps it gathered (the caller gathers it)."""
        self.pins += 1

    def unpin(self) -> None:
        """One holder less; released when none is left."""
        self.pins = max(self.pins - 1, 0)
        if self.pins == 0:
            self.release()

    def queue_update(self) -> None:
        """An overlapped step's update of it is queued: its gradient stays until done."""
        self.update_pending = True

    def update_done(self) -> None:
        """Its queued update is done (or abandoned)."""
        self.update_pending = False

    def add_dep(self, owner: Unit) -> None:
        """Its modules use parameters ``owner`` owns: gather ``owner`` with it. It then also
        waits for its inputs' gradients before letting go of its pins: its own trainable
        gradients may be complete (a parameter it uses last in forward) while the backward
        of its use of ``owner``'s parameters (``x @ other.weight``, which saves the
        parameter itself) has still to run."""
        self.deps.append(owner)
        self.waits_for_inputs = True

    def report_gathers_to(self, callback) -> None:
        """Call ``callback(unit)`` as each all-gather of it is issued (world size > 1)."""
        self.on_gather = callback

    # ----------------------------------------------------------------------------- gather

    def gather(self, async_op: bool = False) -> None:
        """Make every parameter a view of the whole flat buffer: the parameter tier fetches
        it (see [Note: memory tiers])."""
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.GATHERING:
            self.wait()
            return
        fetch = self.params.fetch(self, async_op)
        if fetch is None:
            self._point_params(self.flat)
            self.state = UnitState.GATHERED
            return
        self._fetch = fetch
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait()

    def note_gather(self) -> None:
        """An all-gather of this unit is issued (the engine fingerprints their order)."""
        if self.on_gather is not None and self.world > 1:
            self.on_gather(self)

    def wait(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        fetch, self._fetch = self._fetch, None
        try:
            fetch.wait(self)
        except BaseException:
            # The fetch failed: back to SHARDED, so that hooks running after the error
            # (release) find a consistent unit.
            self._free_storage()
            self.state = UnitState.SHARDED
            raise
        self._point_params(self.flat)
        self.state = UnitState.GATHERED

    def keep_private(self) -> None:
        """The parameter file's bytes of this unit are about to change (the optimizer
        writes the new master or parameters). A gathered unit mapping that file would see
        the change in the pages it has not written (autograd may still read them): it
        gets a copy of its own first. The overlapped step updates a unit after its
        backward, so it is normally released by then."""
        if not self._mapped or self.state is UnitState.SHARDED:
            return
        own = aligned_empty(self.gathered_bytes, torch.uint8)
        own.copy_(self.flat.view(torch.uint8))
        self.pool.gather_cache.lend_unmanaged(self.flat, own)  # the mapping goes
        self._mapped = False

    def gather_for_preview(self) -> None:
        """Gather it for a lookup whose rows alone are brought up to date (see [Note:
        looked-up rows before their update] in optim/zero_adam.py); ``reread`` or
        ``release`` ends that."""
        self.gather()
        self.previewed = True

    def reread(self) -> None:
        """Read the gathered buffer again from the parameter file (world size 1): it was
        gathered with some rows computed ahead of an update that has now been written."""
        self.wait_writes()
        if self._mapped:
            self.keep_private()  # a buffer of its own to read into
        extent = self.params.extent
        extent.file.read(self.flat, extent.offset).wait()
        self.previewed = False

    def pending_write_handles(self) -> list:
        """The I/O handles of this unit's NVMe writes still queued (oldest first)."""
        return [entry[0] for entry in self.pending_writes]

    def wait_writes(self) -> None:
        """Finish this unit's NVMe writes in flight and give their buffers back."""
        for entry in self.pending_writes:
            self.pool.writes.finish(entry)
        self.pending_writes.clear()
        for handle in self.param_file_writes:
            handle.wait()
        self.param_file_writes.clear()

    def place(self, placement: Placement, params, grads) -> None:
        """Move the shards to their tiers (the engine, once, right after building the unit):
        a parameter shard bound for NVMe is written to its extent and leaves memory."""
        self.placement, self.grads = placement, grads
        if isinstance(params, NvmeParams):
            self.wait_writes()
            self.params = params
            params.put(self, self.shard)
            if self.world == 1:
                # The flat buffer was the shard; now it is allocated on each gather.
                self.flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
                self.flat.untyped_storage().resize_(0)
            self.shard = None  # with fp32, self.master keeps the tensor
        self.params = params

    def keep_on_host(self, params: bool, master: bool) -> None:
        """Move the compute-dtype shard (``params``) and the fp32 master (``master``) to host
        memory, pinned when an accelerator exists (the engine, once, while placing it)."""
        if params:
            shared = self.master is self.shard
            self.shard = _to_host(self.shard)
            self.master = self.shard if shared else self.master
            if self.world == 1:
                # The flat buffer was the shard; now its storage exists only while gathered.
                self.flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
                self.flat.untyped_storage().resize_(0)
        if master and self.master is not None and self.master.device != torch.device("cpu"):
            # With fp32 the master was the device shard itself: now a host copy.
            self.master = _to_host(self.master.float())

    def drop_master(self) -> None:
        """No fp32 master in memory from now on: the optimizer's files hold it, or the unit
        never trains (its parameters are its weights)."""
        self.master = None

    def store_shard(self, values: torch.Tensor, give_back=None) -> None:
        """After an optimizer step: the new compute-dtype shard, written to NVMe (async;
        ``give_back(values)`` runs once the write is done) or copied into memory."""
        self.params.store(self, values, give_back)

    def keep_shapes(self) -> None:
        """Point each parameter of this released unit at one shared element expanded to its
        shape: autograd stores a gradient only into a parameter of the gradient's shape, and
        an embedding's unit is not gathered for its backward (it reads no weight). Only
        there: elsewhere a node reading a released weight finds an empty tensor and fails
        loudly instead of computing with zeros. ``release`` empties them again."""
        if self.persistent or self.state is not UnitState.SHARDED:
            return
        one = torch.zeros((), dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = one.expand(s.shape)
        self._placeholders = True

    def release(self) -> None:
        """Drop the gathered parameters (no-op for persistent units); placeholders left by
        ``keep_shapes`` and a preview (``gather_for_preview``) go too."""
        self.previewed = False
        if self.persistent:
            return
        if self.state is UnitState.SHARDED:
            if self._placeholders:
                self._empty_params()
            return
        self.wait()
        self._empty_params()
        if self.params.lends_storage(self):
            self._free_storage()
        self.state = UnitState.SHARDED

    def layout(self) -> tuple:
        """What the same unit of another engine over the same model and configuration has
        too: the shard's size and each slot's name, offset and size."""
        return self.shard_numel, [(s.name, s.offset, s.numel) for s in self.slots]

    def refresh(self) -> None:
        """After an optimizer step: bring a persistent unit's full buffer up to date."""
        if not self.persistent or self.world == 1 or self.numel == 0:
            return
        send = self.pool.acquire(self.shard_numel, self.dtype)
        send.copy_(self.shard)
        zdist.all_gather_into(self.full, send, group=self.group)
        self.pool.release(send)

    def reload(self) -> None:
        """After its shard was overwritten (``load_unit_state``): a persistent unit
        refreshes, a gathered one whose whole buffer is not its shard (a held unit) fetches
        it again. Collective at world size > 1, like the gather."""
        if self.persistent:
            self.refresh()
            return
        if self.state is UnitState.SHARDED or not self.params.lends_storage(self):
            return
        self.release()
        self.gather()

    def alloc_storage(self, mapped: torch.Tensor | None = None) -> None:
        """Give the flat buffer storage: ``mapped`` (a mapping of the parameter file), a
        buffer lent by the gather cache, or its own."""
        cache = self.pool.gather_cache
        if mapped is not None:
            cache.lend_unmanaged(self.flat, mapped)
            self._mapped = True
        elif cache is not None:
            self._lent = cache.lend(self.flat, self.gathered_bytes)
        else:
            self.flat.untyped_storage().resize_(self.gathered_bytes)
        self.pool.gathered.add(self.gathered_bytes)

    def lends_aligned_storage(self) -> bool:
        """Whether the flat buffer's storage is lent by the gather cache (aligned for I/O)."""
        return self._lent is not None

    def _free_storage(self) -> None:
        self._mapped = False
        if self.flat.untyped_storage().nbytes():
            self.flat.untyped_storage().resize_(0)
            self.pool.gathered.sub(self.gathered_bytes)
        if self._lent is not None:
            self.pool.gather_cache.give_back(self._lent)
            self._lent = None

    def _point_params(self, flat: torch.Tensor) -> None:
        for s in self.slots:
            s.param.data = flat[s.offset : s.offset + s.numel].view(s.shape)
        self._placeholders = False

    def _empty_params(self) -> None:
        for s in self.slots:
            s.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self._placeholders = False

    # ------------------------------------------------------------------------------ grads
    # Reduction and accumulation: ``accumulator`` (see [Note: gradient accumulation]).
    @property
    def one_parameter(self) -> bool:
        """One parameter fills the flat buffer (an embedding at world size 1)."""
        return len(self.slots) == 1 and self.padded_numel == self.numel

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """The gradient shard when it is in memory (None before the first gradient, or on
        NVMe)."""
        return None if self.grads.on_disk else self.grads.flat(self)

    # ------------------------------------------------------------------------- accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the unit, by kind (see memory report in the engine)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = nbytes(self.full) if self.persistent else nbytes(self.shard)
        master = 0 if self.master is self.shard else nbytes(self.master)
        return {
            "params": params,
            "master": master,
            "grads": self.grads.resident_bytes(self),
            "padding_elements": self.padded_numel - self.numel,
        }
