"""Adam/AdamW over flat fp32 CPU shards: the C++ kernel in csrc/adam, or a PyTorch fallback.

``adam_update`` is the one entry point the sharded optimizer calls per shard. It runs the
compiled op when ``zerotune.ops.load_op("adam")`` has one (SIMD picked at run time, OpenMP
across cores, optional fused write of the updated weights in bf16/fp16), and otherwise
torch's fused AdamW step (``multi_tensor_adam_update``), or without bias correction
``fallback_adam_update``, which issues the same in-place torch ops as
``torch.optim.AdamW(foreach=False)``. They follow the formula order given in
[Note: formula order] of csrc/adam/cpu_adam.cpp, so they agree with torch to float tolerance.
(The fallback is not always bit-identical: torch's CPU ``sqrt`` goes through MKL, which is not
correctly rounded, while the kernel's is; the kernel agrees with ``AdamW(fused=True)`` to the
last bit on nearly every element.)

``CPUAdam`` wraps the same update in a ``torch.optim.Optimizer`` for plain CPU fp32 models.
On an accelerator the sharded optimizer runs ``multi_tensor_adam_update`` instead: torch's
fused multi-tensor step over a shard's segments.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerotune.ops import load_op

__all__ = [
    "CPUAdam",
    "adam_update",
    "adam_update_8bit",
    "backend",
    "fallback_adam_update",
    "multi_tensor_adam_update",
    "multi_tensor_adam_update_shards",
]

_FP32_ONLY = torch.float32
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
# The fallback works through the shard in slices so its temporaries stay small.
_FALLBACK_CHUNK = 1 << 20
# multi_tensor_adam_update converts a gradient in another dtype this many elements at a time.
_FUSED_CONVERT = 1 << 24


def backend() -> str:
    """Which implementation ``adam_update`` uses: "cpp-avx512", "cpp-avx2", "cpp-scalar",
    or "torch-fallback" (torch's fused step; builds the op on first call)."""
    op = load_op("adam")
    return "torch-fallback" if op is None else f"cpp-{op.simd_level()}"


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    out_lowp: torch.Tensor | None = None,
) -> None:
    """One Adam (``adamw=False``: L2 added to the grad) or AdamW step, in place.

    Args:
        param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors with the same number of
            elements (shapes may differ: shards are flat). Updated in place.
        grad: contiguous CPU tensor, fp32, bf16 or fp16, same number of elements.
        step: 1-based step count, used for bias correction (an int, or an integral float or
            one-element tensor such as torch.optim's ``state["step"]``).
        out_lowp: optional contiguous bf16/fp16 CPU tensor that receives the updated param,
            rounded to nearest even (exactly ``param.to(out_lowp.dtype)``), in the same pass.
    """
    step = _as_step(step)
    _validate(param, grad, exp_avg, exp_avg_sq, out_lowp, step, lr, beta1, beta2, eps, weight_decay)
    op = load_op("adam")
    if op is None:  # torch's fused step, several times faster than the fallback ops
        kwargs = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
        kwargs.update(weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction)
        flat = [t.reshape(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
        out = out_lowp.reshape(-1) if out_lowp is not None else None
        multi_tensor_adam_update(*flat, [(0, param.numel(), kwargs)], out)
        return
    op.adam_update(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        out_lowp,
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw),
        bool(bias_correction),
    )


def adam_update_8bit(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments,
    segments: list[tuple[int, int, dict]],
    out_lowp: torch.Tensor | None = None,
) -> bool:
    """One Adam/AdamW step over 8-bit moments in one pass per block of 256 with the C++ op
    ([Note: fused 8-bit step] in csrc/adam/cpu_adam.cpp): the same bytes as dequantizing,
    ``adam_update`` per segment and quantizing again.

    ``moments`` is a ``Q8Moments`` of ``param``'s elements (both moments); ``segments`` are
    ``(start, stop, kwargs)`` in order, ``kwargs`` ``adam_update``'s (step, lr, beta1,
    beta2, eps, weight_decay, adamw, bias_correction). Returns False, having done nothing,
    when the op is not built or a tensor is not on the CPU: the caller then takes the
    three-pass path.
    """
    from .quant8 import MOMENTS, code

    named = {"param": param, "grad": grad}
    for k in MOMENTS:
        named[f"{k} codes"], named[f"{k} absmax"] = moments.q[k], moments.absmax[k]
    if out_lowp is not None:
        named["out_lowp"] = out_lowp
    if not all(t.device.type == "cpu" for t in named.values()):
        return False
    op = load_op("adam")
    if op is None:
        return False
    _check_no_overlap(named)
    m, v = MOMENTS
    rows = []
    for _, _, kw in segments:
        step = _as_step(kw["step"])
        _validate_hyper(step, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"])
        rows.append(
            [step, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"]]
            + [float(kw.get("adamw", True)), float(kw.get("bias_correction", True))]
        )
    bounds = torch.tensor([[a, b] for a, b, _ in segments], dtype=torch.int64).reshape(-1, 2)
    hyper = torch.tensor(rows, dtype=torch.float64).reshape(-1, 8)
    op.adam_update_8bit(
        param, grad,
        moments.q[m], moments.absmax[m], code(m, "cpu"),
        moments.q[v], moments.absmax[v], code(v, "cpu"),
        out_lowp, bounds, hyper,
    )  # fmt: skip
    return True


def _as_step(step: Any) -> Any:
    """Accept an int, or an integral float / one-element tensor (torch keeps ``step`` so)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    return step


@torch.no_grad()
def fallback_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    out_lowp: torch.Tensor | None = None,
) -> None:
    """``adam_update`` in plain PyTorch ops (what runs when the C++ op is unavailable).

    Does not validate its inputs; ``adam_update`` does.
    """
    # Per-step scalars in double, as torch.optim computes them.
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    step_size = lr / bc1
    bc2_sqrt = bc2**0.5
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    out = out_lowp.view(-1) if out_lowp is not None else None
    n = flat[0].numel()
    for start in range(0, n, _FALLBACK_CHUNK):
        sl = slice(start, min(n, start + _FALLBACK_CHUNK))
        p, g, m, v = (t[sl] for t in flat)
        if g.dtype != torch.float32:
            g = g.float()
        if weight_decay != 0:
            if adamw:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if out is not None:
            out[sl].copy_(p)


@torch.no_grad()
def multi_tensor_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segments: list[tuple[int, int, dict]],
    out_lowp: torch.Tensor | None = None,
) -> None:
    """``adam_update`` over the segments ``(start, stop, adam_arguments)`` of one flat
    shard, through torch's fused multi-tensor Adam/AdamW: segments that share their
    arguments go in one call, a few kernel launches, where ``fallback_adam_update`` would
    launch about ten per MiB of every segment. What an accelerator runs (on its device the
    numbers are those of ``torch.optim.AdamW(fused=True)``). A gradient in another dtype
    than the master is converted ``_FUSED_CONVERT`` elements at a time; a segment without
    bias correction, which the fused step does not offer, takes the fallback."""
    multi_tensor_adam_update_shards([(param, grad, exp_avg, exp_avg_sq, segments, out_lowp)])


@torch.no_grad()
def multi_tensor_adam_update_shards(shards: list[tuple]) -> None:
    """``multi_tensor_adam_update`` over several shards at once, each ``(param, grad,
    exp_avg, exp_avg_sq, segments, out_lowp)``: the segments of every shard that share
    their arguments go in one call (a step over a device's units launches a few kernels,
    not a few per unit). Element by element the same arithmetic."""
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, (param, grad, exp_avg, exp_avg_sq, segments, out_lowp) in enumerate(shards):
        for a, b, kw in segments:
            if not kw["bias_correction"]:
                lowp = out_lowp[a:b] if out_lowp is not None else None
                fallback_adam_update(
                    param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], out_lowp=lowp, **kw
                )
                continue
            key = tuple(float(kw[n]) for n in ("lr", "beta1", "beta2", "eps", "weight_decay"))
            groups.setdefault((*key, kw["adamw"], _as_step(kw["step"])), []).append((i, a, b))
    convert = any(sh[1].dtype != sh[0].dtype for sh in shards)
    for (lr, beta1, beta2, eps, weight_decay, adamw, step), spans in groups.items():
        # The fused step reads each tensor's step count (torch.optim adds one before).
        count = torch.full((), float(step), device=shards[spans[0][0]][0].device)
        fused = torch._fused_adamw_ if adamw else torch._fused_adam_
        for batch in _batches(spans, _FUSED_CONVERT) if convert else [spans]:
            views = [[t[a:b] for t in shards[k][:4]] for k, a, b in batch]
            params = [v[0] for v in views]
            fused(
                params,
                [g.to(p.dtype) for p, g, _, _ in views],
                [v[2] for v in views],
                [v[3] for v in views],
                [],
                [count] * len(batch),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
            outs = [(shards[k][5], a, b, p) for (k, a, b), p in zip(batch, params)]
            outs = [(out[a:b], p) for out, a, b, p in outs if out is not None]
            if outs:
                torch._foreach_copy_([o for o, _ in outs], [p for _, p in outs])


def _batches(spans: list[tuple[int, int, int]], cap: int):
    """``spans`` ``(shard, start, stop)`` in lists of at most ``cap`` elements in all (a
    longer span is cut)."""
    batch, size = [], 0
    for k, a, b in spans:
        while a < b:
            take = min(b - a, cap - size)
            batch.append((k, a, a + take))
            size += take
            a += take
            if size == cap:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _validate(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    out_lowp: Any,
    step: Any,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out_lowp is not None:
        named["out_lowp"] = out_lowp
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"adam_update: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"adam_update: {name} must be on the CPU, got device {t.device}")
        if t.layout != torch.strided:
            raise ValueError(f"adam_update: {name} must be a dense tensor, got {t.layout}")
        if not t.is_contiguous():
            raise ValueError(
                f"adam_update: {name} must be contiguous (shape {tuple(t.shape)}, "
                f"stride {t.stride()}); pass a flat shard or call .contiguous()"
            )
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != _FP32_ONLY:
            raise TypeError(f"adam_update: {name} must be float32, got {named[name].dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"adam_update: grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if out_lowp is not None and out_lowp.dtype not in _LOWP_DTYPES:
        raise TypeError(f"adam_update: out_lowp must be bfloat16 or float16, got {out_lowp.dtype}")
    n = param.numel()
    for name, t in named.items():
        if t.numel() != n:
            raise ValueError(
                f"adam_update: {name} has {t.numel()} elements but param has {n}; "
                "all tensors must hold the same number of elements"
            )
    _check_no_overlap(named)
    _validate_hyper(step, lr, beta1, beta2, eps, weight_decay)


def _validate_hyper(
    step: Any, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"adam_update: step must be an integer >= 1, got {step!r}")
    if not lr >= 0:
        raise ValueError(f"adam_update: lr must be >= 0, got {lr}")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adam_update: betas must be in [0, 1), got ({beta1}, {beta2})")
    if not eps >= 0:
        raise ValueError(f"adam_update: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"adam_update: weight_decay must be >= 0, got {weight_decay}")


def _check_no_overlap(named: dict[str, torch.Tensor]) -> None:
    spans = []
    for name, t in named.items():
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ValueError(f"adam_update: {name_a} and {name_b} overlap in memory")


def adam_arguments(group: dict, step) -> dict:
    """``adam_update``'s keyword arguments for a parameter group at ``step``."""
    beta1, beta2 = group["betas"]
    return dict(
        step=step,
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        adamw=group["adamw_mode"],
        bias_correction=group["bias_correction"],
    )


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for CPU fp32 parameters, running ``adam_update`` (C++ kernel or fallback).

    State per parameter, with torch.optim.AdamW's keys and types: ``step`` (a float32 scalar
    tensor), ``exp_avg`` and ``exp_avg_sq``.

    Args:
        adamw_mode: decoupled weight decay (AdamW) if True, else L2 added to the gradient.
        bias_correction: divide the moments by (1 - beta**step) as Adam does.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"CPUAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas must be in [0, 1), got {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam: invalid weight_decay {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw_mode": adamw_mode,
            "bias_correction": bias_correction,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                adam_update(
                    p.detach(),
                    p.grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    **adam_arguments(group, state["step"]),
                )
        return loss
