"""What every optimizer over the engine's shards shares, and the step interface the engine
and checkpoints use.

[Note: the step interface]
The engine and an optimizer over its shards meet through a few named methods, never through
each other's private fields. The engine hands gradients over as shards (``finalize_grads``,
``grad_chunks``), takes the compute-dtype copy of an updated shard back through
``lowp_target`` / ``lowp_done``, and offers an optimizer that starts early the hooks of
backward and forward: ``attach_optimizer``, its gradient reducer's (``engine.reducer``)
``syncing``, ``overlapping`` and ``begin_overlapped_step`` / ``end_overlapped_step``
(backward then calls ``launch(unit)`` on the step as each unit's gradient is final, and
``pump()`` between layers) and ``carry_into_forward`` (forward then pumps the optimizer and
settles a unit's update before gathering it). The optimizer answers, for each unit:
- ``owns(unit)``: it updates parameters of the unit (it keeps state for it);
- ``state_specs`` / ``state_numels`` / ``read_unit`` / ``write_unit``: the unit's state as
  flat tensors of this rank's shard (``master`` and what the optimizer keeps per element),
  for checkpoints and ``engine.unit_state``;
- ``step_count(key)`` / ``set_step_count(key, n)``: each segment's own step count (see
  [Note: segments] in zero_adam.py), saved per parameter in checkpoints;
- ``settle`` / ``promote`` / ``pump`` / ``can_preview``: the updates an overlapped step
  carries into the next forward (ZeroAdamW's, and ZeroOptimizer's with its state on NVMe;
  only ZeroAdamW previews looked-up rows).
Where a unit's master and gradient live is its ``placement``, decided once by the tier layer
(see [Note: memory tiers] in memory/tiers.py): an optimizer reads it, and reads gradients
through the unit's gradient tier, rather than deciding placement again.
Optimizers differ in how they update a chunk: ``ZeroAdamW`` streams fused C++ Adam over
chunks of any tier; ``ZeroOptimizer`` runs any ``torch.optim.Optimizer`` over views of the
shards (see [Note: any torch optimizer over the shards] in generic.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import dist as zdist

if TYPE_CHECKING:
    from .overlap import OverlappedStep

__all__ = ["Segment", "ShardedOptimizer", "StepInfo"]

log = logging.getLogger(__name__)


@dataclass
class StepInfo:
    """What one optimizer step did."""

    skipped: bool  # fp16 overflow: no update was made
    loss_scale: float  # the loss scale in force for this step (1.0 without fp16)
    grad_norm: float | None  # global gradient norm, when clip_grad_norm_ ran


@dataclass
class Segment:
    unit: object
    start: int  # shard-local element range
    end: int
    group: int = 0
    key: torch.Tensor | None = None  # the tensor in param_groups standing for the segment
    slot: object = None  # the parameter (sharding.unit.Slot) whose part of the shard it is
    counted: bool = False  # its parameter got a gradient: this step updates it


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers over a zerotune engine's shards: segments, gradient norm and
    clipping, fp16 overflow checks, and the step interface (see [Note: the step interface])."""

    engine: object
    unit_segments: dict[int, list[Segment]]
    model_param_groups: list[list[torch.nn.Parameter]]
    _groups_fixed = False  # the groups are built: add_param_group is refused

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(params, defaults)
        self._groups_fixed = True

    def add_param_group(self, param_group: dict) -> None:
        """Refused once built: the groups hold segments of the shards and the state (and its
        layout on NVMe) is made for them, so a group added later would never be updated."""
        if self._groups_fixed:
            raise RuntimeError(
                f"{type(self).__name__}.add_param_group: the parameter groups are fixed when "
                "the optimizer is built over the shards; pass every group to the constructor"
            )
        super().add_param_group(param_group)

    def _build_segments(self, engine, params: Iterable | None) -> list[dict]:
        """Set ``engine`` and ``unit_segments`` (this rank's part of each trainable
        parameter in a group, unit by unit) and return the model's parameter groups."""
        if engine.optimizer is not None:
            raise ValueError("this engine already has an optimizer")
        self.engine = engine
        groups = self._model_groups(engine, params)
        # The model's parameters of each group (``param_groups`` hold shard segments).
        self.model_param_groups = [list(g["params"]) for g in groups]
        group_of: dict[int, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in group_of:
                    raise ValueError("a parameter appears in more than one parameter group")
                group_of[id(p)] = gi
        self._refuse_foreign(engine, groups, group_of)
        for unit in engine.units:
            changed = [s.name for s in unit.slots if s.trainable != s.watched]
            if changed:
                raise ValueError(
                    f"requires_grad of {', '.join(changed)} changed after the model was "
                    "sharded: the engine watches the gradients of the parameters that were "
                    "trainable then; set requires_grad before zerotune.shard()"
                )
        self.unit_segments = {}
        for unit in engine.units:
            lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
            segs: list[Segment] = []
            for slot in unit.slots:
                gi = group_of.get(id(slot.param))
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if gi is None or not slot.trainable or a >= b:
                    continue
                segs.append(Segment(unit, a - lo, b - lo, gi, slot=slot))
            if segs:
                self.unit_segments[unit.index] = sorted(segs, key=lambda seg: seg.start)
        self._prepared = False
        self._overflow = False
        self._clipped = False  # clip_grad_norm_ scaled this step's gradients
        self._factor = 1.0  # applied to gradients in the update: 1/loss scale * clip coef
        self._grad_norm: float | None = None
        self._summed_norm: float | None = None  # a clipping overlapped step's, unclipped
        self._sum_sq: torch.Tensor | None = None
        self._overlap: OverlappedStep | None = None  # from overlapped() to step()
        self.launch_order: list[int] = []  # unit indices, as the last overlapped step went
        # The last overlapped step's pipeline, still running into the next forward, and
        # the hyper-parameters and gradient factor its updates use (see [Note: carrying the
        # step into the next forward] in zero_adam.py).
        self._carry: OverlappedStep | None = None
        self._frozen_groups: list[dict] | None = None
        self._frozen_factor = 1.0
        # With overlapped(track_norm=True): this rank's sum of grad**2, added as the updates
        # (or, clipping, backward) read the gradients, and the norm step() fills in.
        self.norm_sq: torch.Tensor | None = None
        self.pending_grad_norm: torch.Tensor | None = None
        return groups

    @staticmethod
    def _refuse_foreign(engine, groups: list[dict], group_of: dict[int, int]) -> None:
        """A tensor in a group that is none of the model's parameters would never be
        updated: refused, instead of training without it."""
        known = {id(s.param) for unit in engine.units for s in unit.slots}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in known:
                    continue
                hint = (
                    " (at stage 3 a parameter read through its module outside forward is a "
                    "copy of its value)"
                    if isinstance(p, torch.Tensor) and p.is_inference()
                    else ""
                )
                raise ValueError(
                    f"parameter group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    f"not a parameter of the sharded model{hint}; build the groups from "
                    "model.named_parameters() (or before zerotune.shard())"
                )

    @staticmethod
    def _model_groups(engine, params) -> list[dict]:
        if params is None:
            return [{"params": [p for p in engine.module.parameters() if p.requires_grad]}]
        params = list(params)
        if not params:
            raise ValueError("the optimizer got an empty parameter list")
        # A weight the engine tiled (sharding/tiling.py) stands for its tiles.
        tiled = getattr(engine, "tiled_from", {})

        def expand(ps):
            out = []
            for p in ps:
                original, tiles = tiled.get(id(p), (None, None))
                out.extend(tiles if original is p else [p])
            return out

        if isinstance(params[0], dict):
            return [dict(g, params=expand(g["params"])) for g in params]
        return [{"params": expand(params)}]

    # ------------------------------------------------------------------ step interface
    def owns(self, unit) -> bool:
        """Whether this optimizer updates parameters of ``unit`` (and keeps state for it)."""
        return unit.index in self.unit_segments

    def segments(self):
        """(state key, unit, start, end) for every segment: ``step_count(key)`` is its step
        count, ``[start, end)`` its range in this rank's shard of ``unit``."""
        for segs in self.unit_segments.values():
            for seg in segs:
                yield seg.key, seg.unit, seg.start, seg.end

    def step_count(self, key) -> int:
        return int(self.state[key]["step"])

    def set_step_count(self, key, step: int) -> None:
        self.state[key]["step"] = step

    def count_step(self, unit) -> None:
        """The unit is about to be updated: one more step for each of its segments whose
        parameter got a gradient (the others are left alone, as torch's AdamW leaves a
        parameter whose ``.grad`` is None)."""
        for seg in self.unit_segments[unit.index]:
            # Read once, here: the update follows this, not a flag set later.
            seg.counted = seg.slot.got_grad
            if seg.counted:
                self.set_step_count(seg.key, self.step_count(seg.key) + 1)

    def uncount_step(self, unit) -> None:
        """Give back the step counts ``count_step`` took for ``unit`` (its update will not
        be made: the backward of an overlapped step raised)."""
        for seg in self.unit_segments[unit.index]:
            if seg.counted:
                self.set_step_count(seg.key, self.step_count(seg.key) - 1)
                seg.counted = False

    @contextlib.contextmanager
    def _overlapping(self, overlap: OverlappedStep):
        """The body of ``overlapped()``: backward hands units to ``overlap``; should it
        raise, the step is given up ([Note: a backward that raises inside overlapped()] in
        zero_adam.py)."""
        self._overlap = overlap
        reducer = self.engine.reducer
        reducer.begin_overlapped_step(overlap)
        try:
            yield
        except BaseException:
            reducer.end_overlapped_step()
            if not overlap.broken:  # else step() says what happened
                self._abort_overlap()
            raise
        reducer.end_overlapped_step()

    def _abort_overlap(self, why: str = "backward raised") -> None:
        # Should finishing the updates in flight fail, the step is broken: it stays, and
        # step() refuses it.
        updated = self._overlap.abort()
        self._overlap = None
        self.norm_sq = None
        self.pending_grad_norm = None
        self._factor = 1.0
        self._overlap_aborted()
        if updated:
            owned = sum(1 for u in self.engine.units if self.owns(u))
            log.warning(
                "overlapped(): %s after %d of %d units were updated with this step's "
                "gradients; the others were not (overlapped(clipping=True) updates nothing "
                "before step())",
                why,
                updated,
                owned,
            )

    def _overlap_aborted(self) -> None:
        """After an overlapped step was given up (its queued updates done)."""

    def settle(self, unit=None, overwrite: bool = False) -> None:
        """Finish the updates the last step carried into this forward (see [Note: carrying
        the step into the next forward] in zero_adam.py): all of them, or ``unit``'s (moved
        to the front). ``overwrite``: the caller replaces every unit's state (a checkpoint
        loads), so a carry that failed is dropped instead of raising again."""
        carry = self._carry
        if carry is None:
            return
        if overwrite and carry.failed:
            carry.abandon()
        else:
            carry.settle(unit)
        if not carry.unfinished:
            self._carry = None
            self.engine.carry_into_forward(False)
            self._frozen_groups = None
            carry.finish()
            self._carry_done()

    def _carry_done(self) -> None:
        """The updates carried into the next forward are all made (or dropped)."""

    def updates_off_thread(self) -> bool:
        """Whether an overlapped step's arithmetic runs on the store's update thread (see
        [Note: host updates off the launching thread] in zero_adam.py; ZeroAdamW's)."""
        return False

    @property
    def can_overlap(self) -> bool:
        """Whether ``overlapped()`` can update units during backward (ZeroAdamW always can;
        see ``ZeroOptimizer.can_overlap``)."""
        return True

    @property
    def step_open(self) -> bool:
        """Whether an overlapped backward has run and its ``step()`` has not: some units may
        be updated already, the others wait for ``step()``."""
        return self._overlap is not None

    _detached = False  # another optimizer took the engine's shards over

    def detach(self) -> None:
        """Give up the state this optimizer keeps, so that a new optimizer over the same
        engine starts fresh (``engine.detach_optimizer`` calls it, after the last carried
        updates). The master weights stay: they belong to the engine's tiers."""
        self._detached = True

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError(
                f"this {type(self).__name__} no longer updates the engine: another optimizer "
                "took its shards over (a second ZeroTrainer given the same model, or "
                "engine.detach_optimizer())"
            )

    def promote(self, unit) -> None:
        """Move ``unit``'s carried update to the front of the queue (it is needed soon)."""
        if self._carry is not None:
            self._carry.feed.promote(unit)

    def pump(self) -> None:
        """Advance the carried updates as far as their I/O allows, without waiting."""
        if self._carry is not None:
            self._carry.pump()

    def can_preview(self, unit) -> bool:
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def grads_zeroed(self) -> None:
        """The engine's gradients were zeroed (``engine.zero_grad``) before ``step()``: as
        with torch's ``.grad``, what ``clip_grad_norm_`` and the fp16 overflow check
        prepared from them (the clipping factor, the norm, the verdict) goes with them, or
        it would apply to the next step's gradients; an overlapped backward's step is
        given up, as when its backward raises ([Note: a backward that raises inside
        overlapped()] in zero_adam.py)."""
        overlap = self._overlap
        if overlap is not None and self.engine.reducer.overlapping:
            if overlap.launched:  # inside the block, after its backward
                raise RuntimeError(
                    "zero_grad() inside overlapped() after its backward: that backward's "
                    "step is under way; call zero_grad() before the block or after step()"
                )
        elif overlap is not None:
            self._abort_overlap("zero_grad() came before step()")
        self._forget_prepared()

    def before_backward(self) -> None:
        """A backward pass starts (its first hook): its gradients add to those the step
        has read so far. Refused where they could not count as torch's would: after an
        overlapped backward whose units were updated already, and after
        ``clip_grad_norm_`` clipped (torch scales the gradients there and then, so the new
        ones would add unscaled; here the factor would scale them too). Otherwise the step
        reads the gradients again (the norm, the fp16 overflow check)."""
        overlap = self._overlap
        # (Inside overlapped() the reducer refuses a second backward itself.)
        after_block = overlap is not None and not self.engine.reducer.overlapping
        if after_block and not overlap.clipping and overlap.launched:
            raise RuntimeError(
                "a backward pass after an overlapped() backward and before its step(): the "
                "units that backward finished were updated already, without this one's "
                "gradients; call step() first, or use overlapped(clipping=True), which "
                "updates nothing before step()"
            )
        if not self._prepared:
            return
        if self._clipped or overlap is not None:  # (a clipped overlapped step's norm is summed)
            raise RuntimeError(
                "a backward pass after clip_grad_norm_() and before step(): the clipping "
                "factor would scale its gradients too; clip after the last backward of the "
                "step (or call zero_grad() to start the step again)"
            )
        self._forget_prepared()

    def _forget_prepared(self) -> None:
        """What ``_prepare`` and ``clip_grad_norm_`` set from this step's gradients."""
        self._prepared = False
        self._overflow = False
        self._clipped = False
        self._factor = 1.0
        self._grad_norm = self._summed_norm = None
        self._sum_sq = None

    # ------------------------------------------------------------ gradients and norms
    def _live_units(self):
        return [
            u
            for u in self.engine.units
            if u.index in self.unit_segments and not u.accumulator.is_zero
        ]

    def _grad_sum_of_squares(self) -> torch.Tensor:
        """Sum over this rank's live segments of grad**2 (inf/nan if any gradient is)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.engine.device)
        for unit in self._live_units():
            self.add_unit_sum_of_squares(sq, unit)
        return sq

    def add_unit_sum_of_squares(self, sq: torch.Tensor, unit) -> None:
        """``sq += grad**2`` summed over the unit's segments, its whole gradient shard."""
        for c0, c1, grad in self.engine.grad_chunks(unit):
            self.add_sum_of_squares(sq, unit, c0, c1, grad)

    def add_sum_of_squares(self, sq: torch.Tensor, unit, c0: int, c1: int, grad) -> None:
        """``sq += grad**2`` summed over the unit's segments within chunk ``[c0, c1)``."""
        for seg in self.unit_segments[unit.index]:
            a, b = max(seg.start, c0), min(seg.end, c1)
            if a < b:
                g = grad[a - c0 : b - c0].float()
                sq += torch.dot(g, g)

    def _prepare(self) -> None:
        """Finalize gradients; with fp16, check every rank for overflow (once per step)."""
        if self._prepared:
            return
        self.engine.finalize_grads()
        self._prepared = True
        scaler = self.engine.scaler
        self._factor = 1.0 if scaler is None else 1.0 / scaler.scale
        if scaler is not None:
            sq = self._grad_sum_of_squares()
            zdist.all_reduce_sum(sq, self.engine.group)
            self._overflow = not bool(torch.isfinite(sq).item())
            self._sum_sq = sq

    def _before_clip(self) -> None:
        """Called first by ``clip_grad_norm_``."""
        if self._overlap is not None and not self._overlap.clipping:
            raise RuntimeError(
                "clip_grad_norm_ after an overlapped backward: units were updated during "
                "backward, before the global norm existed; use overlapped(clipping=True)"
            )
        self.settle()

    def _clipping_norm(self, overlap) -> None:
        """A clipping overlapped step (see [Note: a clipped overlapped step] in
        zero_adam.py): the global norm, once, from the sums of squares added as backward
        finished each unit and those of the units finished only at the end of backward;
        into ``_grad_norm`` and ``pending_grad_norm``."""
        if self.norm_sq is None:
            return  # done already (clip_grad_norm_ before step())
        sq, self.norm_sq = self.norm_sq, None
        for unit in self._live_units():
            if unit.index not in overlap.launched:
                self.add_unit_sum_of_squares(sq, unit)
        zdist.all_reduce_sum(sq, self.engine.group)
        self._grad_norm = self._summed_norm = float(sq.sqrt())
        self.pending_grad_norm.fill_(self._grad_norm)

    def _end_overlap(self, overlap: OverlappedStep) -> dict[int, None]:
        """In ``step()``, after an overlapped backward: with clipping the norm is known now,
        so every update is queued; the updates still queued are carried into the next
        forward or run to their end. Returns the units that step updated (or queued)."""
        overlap.close()
        if overlap.clipping:
            self._prepare()
            self._clipping_norm(overlap)
            if not self._overflow:
                late = [u for u in self._live_units() if u.index not in overlap.launched]
                overlap.release(late)
        self._carry_or_finish(overlap)
        return overlap.launched

    def _carry_or_finish(self, overlap: OverlappedStep) -> None:
        """Leave the updates still queued to the next forward (see [Note: carrying the step
        into the next forward] in zero_adam.py), or run them to their end now."""
        # step() updates more units itself: the pipeline would be busy.
        can_carry = overlap.carry and all(u.index in overlap.launched for u in self._live_units())
        if can_carry:
            # Units that stay gathered are not gathered again: they need their values now.
            for unit in self.engine.units_kept_gathered():
                overlap.settle(unit)
        if not (can_carry and overlap.unfinished):
            overlap.finish()
            return
        if self.norm_sq is not None:
            self._add_carried_norm(overlap)
        # Copies of tensor values too: a scheduler may update a tensor lr in place.
        self._frozen_groups = [
            copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.param_groups
        ]
        self._frozen_factor = self._factor  # clipping's, for the updates carried
        self._carry = overlap
        self.engine.carry_into_forward(True)
        overlap.carried = True
        overlap.phase = "after step() (carried into the next forward)"

    def _add_carried_norm(self, carry: OverlappedStep) -> None:
        """With ``track_norm``: add the gradients the carried updates have not read yet (the
        norm is due at ``step()``; those updates then add nothing, ``norm_sq`` being gone)."""
        for index, unit in carry.unfinished.items():
            done = carry.begun.get(index, 0)
            for c0, c1, grad in self.engine.grad_chunks(unit):
                if c1 > done:
                    a = max(c0, done)
                    self.add_sum_of_squares(self.norm_sq, unit, a, c1, grad[a - c0 :])

    def _update_factor(self) -> float:
        """What the updates multiply the gradients by (clipping, the fp16 loss scale): the
        step's, or for updates carried into the next forward the one frozen with them."""
        return self._factor if self._frozen_groups is None else self._frozen_factor

    def _update_groups(self) -> list[dict]:
        """The hyper-parameters the updates use: the groups', or for updates carried into
        the next forward those frozen at ``step()``."""
        return self.param_groups if self._frozen_groups is None else self._frozen_groups

    def _start_overlap(self, track_norm: bool, clipping: bool = False) -> None:
        """What every ``overlapped()`` checks and sets before backward: updates made before
        every gradient exists cannot be undone or rescaled."""
        self._check_attached()
        engine = self.engine
        if engine.scaler is not None:
            raise RuntimeError(
                "overlapped(): fp16 loss scaling must see every gradient before any update "
                "(an overflow skips the whole step); use bf16 or fp32"
            )
        if engine.config.stage < 2:
            raise RuntimeError(
                "overlapped(): stage 1 keeps whole gradients until the step; use stage 2 or 3"
            )
        if not engine.reducer.syncing:
            raise RuntimeError(
                "overlapped(): the backward inside must be synchronized, not in no_sync()"
            )
        if self._overlap is not None or engine.reducer.overlapping:
            raise RuntimeError("overlapped(): call step() before the next overlapped backward")
        self._factor = 1.0
        if track_norm or clipping:
            self.norm_sq = torch.zeros(1, dtype=torch.float32, device=engine.device)
            self.pending_grad_norm = torch.zeros(())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm (over all ranks) is at most ``max_norm``;
        returns the norm before clipping (like ``torch.nn.utils.clip_grad_norm_`` over the
        parameters of this optimizer's groups: a trainable parameter in no group is neither
        counted nor updated)."""
        self._before_clip()
        self._prepare()
        if self._overflow:
            return torch.tensor(float("inf"))
        if self._overlap is not None:  # clipping: summed as backward went
            self._clipping_norm(self._overlap)
            # A second call sees the gradients the first one scaled, as torch's does.
            norm = torch.tensor(self._summed_norm * self._factor)
        else:
            if self.engine.scaler is None:
                sq = self._grad_sum_of_squares()
                zdist.all_reduce_sum(sq, self.engine.group)
            else:
                sq = self._sum_sq
            norm = sq.sqrt() * self._factor
        coef = max_norm / (norm.item() + 1e-6)
        if coef < 1.0:
            self._factor *= coef
            self._clipped = True
        self._grad_norm = norm.item()
        return norm

    def _fill_tracked_norm(self, info: StepInfo) -> None:
        """With ``overlapped(track_norm=True)``: the global norm from every rank's sum of
        squares, into ``info`` and ``pending_grad_norm``."""
        if self.norm_sq is not None:
            zdist.all_reduce_sum(self.norm_sq, self.engine.group)
            info.grad_norm = float(self.norm_sq.sqrt())
            self.pending_grad_norm.fill_(info.grad_norm)

    def _step_info(self) -> StepInfo:
        scaler = self.engine.scaler
        return StepInfo(
            skipped=self._overflow,
            loss_scale=scaler.scale if scaler is not None else 1.0,
            grad_norm=self._grad_norm,
        )

    def _end_step(self) -> None:
        """After the update (or a skipped fp16 step): the loss scale, flags, gradients."""
        scaler = self.engine.scaler
        if scaler is not None:
            scaler.update(self._overflow)
        self._forget_prepared()
        self.engine.zero_grad()
