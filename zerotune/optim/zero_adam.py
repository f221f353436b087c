"""Adam(W) over the engine's fp32 master shards.

[Note: segments]
The optimizer sees the model's parameter groups (so HF's decay / no-decay split and LR
schedulers work unchanged), but it updates shards, not parameters. For every unit, the part of
this rank's shard that belongs to parameters of one group, contiguous in the flat layout, is
one *segment*: a view of the unit's fp32 master shard, with matching views of the gradient
shard, the two Adam moments (flat per unit) and, for bf16/fp16, the compute-dtype shard that
receives the updated weights in the same pass. ``param_groups[i]["params"]`` holds the master
views, so torch's Optimizer machinery (schedulers, hyper-parameters per group) works as usual.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import dist as zdist
from .cpu_adam import adam_update

__all__ = ["StepInfo", "ZeroAdamW"]


@dataclass
class StepInfo:
    """What one optimizer step did."""

    skipped: bool  # fp16 overflow: no update was made
    loss_scale: float  # the loss scale in force for this step (1.0 without fp16)
    grad_norm: float | None  # global gradient norm, when clip_grad_norm_ ran


@dataclass
class _Segment:
    unit: object
    start: int  # shard-local element range
    end: int


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2, ``adamw_mode=False``) for a model sharded by zerotune.

    ``params`` are the model's parameters or parameter groups, as for ``torch.optim.AdamW``;
    None means every trainable parameter. Use ``clip_grad_norm_`` for global-norm clipping
    across ranks. ``step()`` returns a :class:`StepInfo`.
    """

    def __init__(
        self,
        engine,
        params: Iterable | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr} betas={betas} eps={eps}")
        self.engine = engine
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        groups = self._model_groups(engine, params)
        group_of: dict[int, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in group_of:
                    raise ValueError("a parameter appears in more than one parameter group")
                group_of[id(p)] = gi

        self._moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        segments: list[list[_Segment]] = [[] for _ in groups]
        for unit in engine.units:
            lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
            last: tuple[int, _Segment] | None = None
            for slot in unit.slots:
                gi = group_of.get(id(slot.param))
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if gi is None or not slot.trainable or a >= b:
                    last = None
                    continue
                if last is not None and last[0] == gi and last[1].end == a - lo:
                    last[1].end = b - lo
                    continue
                seg = _Segment(unit, a - lo, b - lo)
                segments[gi].append(seg)
                last = (gi, seg)
            if any(seg.unit is unit for segs in segments for seg in segs):
                self._moments[unit.index] = (
                    torch.zeros_like(unit.master),
                    torch.zeros_like(unit.master),
                )

        torch_groups = []
        self._segment_of: dict[int, _Segment] = {}
        for g, segs in zip(groups, segments):
            views = []
            for seg in segs:
                view = seg.unit.master[seg.start : seg.end]
                self._segment_of[id(view)] = seg
                views.append(view)
            torch_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        super().__init__(torch_groups, defaults)
        for group in self.param_groups:
            for view in group["params"]:
                seg = self._segment_of[id(view)]
                m, v = self._moments[seg.unit.index]
                self.state[view] = {
                    "step": 0,
                    "exp_avg": m[seg.start : seg.end],
                    "exp_avg_sq": v[seg.start : seg.end],
                }
        self._unscaled = False
        self._overflow = False
        self._grad_norm: float | None = None
        engine.optimizer = self

    @staticmethod
    def _model_groups(engine, params) -> list[dict]:
        if params is None:
            return [{"params": [p for p in engine.module.parameters() if p.requires_grad]}]
        params = list(params)
        if not params:
            raise ValueError("the optimizer got an empty parameter list")
        if isinstance(params[0], dict):
            return [dict(g, params=list(g["params"])) for g in params]
        return [{"params": params}]

    # --------------------------------------------------------------------------- helpers
    def _live_segments(self):
        for group in self.param_groups:
            for view in group["params"]:
                seg = self._segment_of[id(view)]
                if not seg.unit.grad_is_zero:
                    yield group, view, seg

    def _grad(self, seg: _Segment) -> torch.Tensor:
        return seg.unit.grad_shard[seg.start : seg.end]

    def _prepare(self) -> bool:
        """Finalize gradients and undo the fp16 loss scale once. Returns True on overflow."""
        if self._unscaled:
            return False
        self.engine.finalize_grads()
        self._unscaled = True
        scaler = self.engine.scaler
        if scaler is None:
            return False
        flag = torch.zeros(1, device=self.engine.device)
        for unit in self.engine.units:
            if unit.grad_shard is not None and not unit.grad_is_zero:
                if not torch.isfinite(unit.grad_shard).all():
                    flag.fill_(1.0)
                    break
        zdist.all_reduce_sum(flag, self.engine.group)
        if flag.item() > 0:
            return True
        inv = 1.0 / scaler.scale
        for unit in self.engine.units:
            if unit.grad_shard is not None and not unit.grad_is_zero:
                unit.grad_shard.mul_(inv)
        return False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm (over all ranks) is at most ``max_norm``;
        returns the norm before clipping (like ``torch.nn.utils.clip_grad_norm_``)."""
        if self._prepare():
            self._overflow = True
            return torch.tensor(float("inf"))
        sq = torch.zeros(1, dtype=torch.float32, device=self.engine.device)
        for _, _, seg in self._live_segments():
            g = self._grad(seg).float()
            sq += torch.dot(g, g)
        zdist.all_reduce_sum(sq, self.engine.group)
        norm = sq.sqrt()
        coef = max_norm / (norm.item() + 1e-6)
        if coef < 1.0:
            for _, _, seg in self._live_segments():
                self._grad(seg).mul_(coef)
        self._grad_norm = norm.item()
        return norm

    @torch.no_grad()
    def step(self, closure=None) -> StepInfo:
        if closure is not None:
            raise ValueError("ZeroAdamW.step does not take a closure")
        overflow = self._overflow or self._prepare()
        scaler = self.engine.scaler
        info = StepInfo(
            skipped=overflow,
            loss_scale=scaler.scale if scaler is not None else 1.0,
            grad_norm=self._grad_norm,
        )
        if not overflow:
            for group, view, seg in self._live_segments():
                state = self.state[view]
                state["step"] += 1
                self._update(group, view, seg, state)
            self.engine.after_step()
        if scaler is not None:
            scaler.update(overflow)
        self._unscaled = False
        self._overflow = False
        self._grad_norm = None
        self.engine.zero_grad()
        return info

    def _update(self, group: dict, view: torch.Tensor, seg: _Segment, state: dict) -> None:
        beta1, beta2 = group["betas"]
        unit = seg.unit
        lowp = None if unit.master is unit.shard else unit.shard[seg.start : seg.end]
        kwargs = dict(
            step=state["step"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw=group["adamw_mode"],
            bias_correction=group["bias_correction"],
        )
        if view.device.type == "cpu":
            adam_update(
                view,
                self._grad(seg),
                state["exp_avg"],
                state["exp_avg_sq"],
                out_lowp=lowp,
                **kwargs,
            )
        else:
            _adam_torch(view, self._grad(seg), state["exp_avg"], state["exp_avg_sq"], **kwargs)
            if lowp is not None:
                lowp.copy_(view)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_bytes(self) -> int:
        return sum(m.numel() * m.element_size() * 2 for m, _ in self._moments.values())


def _adam_torch(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction):
    """Adam on any device with torch ops, in the order torch.optim.AdamW uses."""
    g = g.float()
    if weight_decay:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
