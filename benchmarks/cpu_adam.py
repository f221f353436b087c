"""CPU Adam throughput: zerotune's C++ kernel against torch.optim.AdamW, in one process.

Run: ``python benchmarks/cpu_adam.py [--numel 100000000] [--iters 25]``

Every contender updates the same fp32 tensors (param, grad, and its own exp_avg/exp_avg_sq),
with all cores (``torch.set_num_threads(os.cpu_count())``). The contenders run round-robin,
one step each per round, so slow drifts of the machine hit all of them alike; the table
reports the median step time after the warm-up rounds.

- zerotune:              ``adam_update`` (the C++ op; the fallback if it cannot be built)
- zerotune + bf16 out:   the same, also writing the updated weights as bf16 in the same pass
- torch fused:           ``torch.optim.AdamW(fused=True)``
- torch fused + copy_:   the fused step, then ``bf16_weights.copy_(param)``
- torch foreach:         ``torch.optim.AdamW(foreach=True)``
- DeepSpeedCPUAdam:      only when deepspeed is importable
- other build (+ bf16 out): with ``--compare-op PATH``, another build of the adam op (e.g. the
  ``.so`` of an earlier commit, from ``~/.cache/zerotune/ops/adam-<key>/``), for A/B in one process
- zerotune, prefetch N:   with ``--sweep-prefetch``, the kernel prefetching N elements ahead
  (0: no hints) instead of this CPU's default ([Note: prefetch] in csrc/adam/cpu_adam.cpp)
- bandwidth probe:       a C++/OpenMP loop in the adam op (``stream_probe``) with Adam's memory
  pattern and almost no arithmetic: 4 fp32 streams read, 3 written in place
  (p += g; m += g; v += g), same chunking, threads, vector width and prefetch as the kernel.
  Its rate is about the ceiling for an in-place Adam on this machine (not a strict one: the
  update, whose arithmetic spaces out its memory requests, can come out a few percent above).

GB/s counts Adam's traffic, 16 bytes read and 12 written per element, for every row (the
bf16 copy's extra 2 bytes are not counted). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from zerotune.ops import load_op
from zerotune.optim.cpu_adam import adam_update, backend

BYTES_PER_ELEMENT = 16 + 12
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def _zerotune(p, g, m, v, out=None) -> Callable[[], None]:
    step = [0]

    def run() -> None:
        step[0] += 1
        adam_update(
            p,
            g,
            m,
            v,
            step=step[0],
            lr=LR,
            beta1=BETA1,
            beta2=BETA2,
            eps=EPS,
            weight_decay=WD,
            out_lowp=out,
        )

    return run


def _at_distance(op, ahead: int, run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with the kernel prefetching ``ahead`` elements ahead, then the default again."""

    def timed() -> None:
        op.set_prefetch(ahead)
        try:
            run()
        finally:
            op.set_prefetch(-1)

    return timed


def _op_from(path: str, p, g, m, v, out=None) -> Callable[[], None]:
    name = os.path.basename(path).split(".")[0]  # the module name the library exports
    spec = importlib.util.spec_from_file_location(name, path)
    op = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op)
    step = [0]

    def run() -> None:
        step[0] += 1
        op.adam_update(p, g, m, v, out, step[0], LR, BETA1, BETA2, EPS, WD, True, True)

    return run


def _torch_adamw(p, g, **flags) -> Callable[[], None]:
    param = torch.nn.Parameter(p)  # shares p's storage
    param.grad = g
    opt = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, **flags)
    return opt.step


def _deepspeed(p, g) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its op fails to build
        return None
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    return opt.step


def _time(fns: dict[str, Callable[[], None]], warmup: int, iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-foreach", action="store_true", help="skip the slow foreach row")
    parser.add_argument("--compare-op", metavar="PATH", help="another build of the adam op (.so)")
    parser.add_argument(
        "--sweep-prefetch",
        action="store_true",
        help="also run the kernel at prefetch distances 0, 64, 128, 256 and 512 elements",
    )
    args = parser.parse_args()

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)

    fns: dict[str, Callable[[], None]] = {
        "zerotune": _zerotune(p, g, m, v),
        "zerotune + bf16 out": _zerotune(p, g, m, v, out),
        "torch fused": _torch_adamw(p, g, fused=True),
    }
    fused_step = fns["torch fused"]

    def fused_then_copy() -> None:
        fused_step()
        out.copy_(p)

    fns["torch fused + copy_"] = fused_then_copy
    if not args.no_foreach:
        fns["torch foreach"] = _torch_adamw(p, g, foreach=True)
    if args.compare_op:
        om, ov = torch.zeros(n), torch.zeros(n)
        fns["other build"] = _op_from(args.compare_op, p, g, om, ov)
        fns["other build + bf16 out"] = _op_from(args.compare_op, p, g, om, ov, out)
    ds = _deepspeed(p, g)
    if ds is not None:
        fns["DeepSpeedCPUAdam"] = ds
    op = load_op("adam")
    sweep = (0, 64, 128, 256, 512) if args.sweep_prefetch and op is not None else ()
    for ahead in sweep:
        fns[f"zerotune, prefetch {ahead}"] = _at_distance(
            op, ahead, _zerotune(p, g, torch.zeros(n), torch.zeros(n))
        )
    if op is not None:
        pp, pm, pv = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        fns["bandwidth probe"] = lambda: op.stream_probe(pp, g, pm, pv)

    med = _time(fns, args.warmup, args.iters)
    rate = {name: n / t for name, t in med.items()}
    probe = rate.get("bandwidth probe")

    print(f"CPU Adam, {n:,} fp32 elements, {threads} threads, backend {backend()}")
    print(f"median of {args.iters} steps after {args.warmup} warm-up rounds; GB/s at 28 B/elem")
    print(f"{'method':<22}{'ms/step':>10}{'M elem/s':>11}{'GB/s':>8}{'of probe':>10}")
    for name, t in med.items():
        frac = f"{rate[name] / probe:.2f}" if probe else "-"
        gbs = rate[name] * BYTES_PER_ELEMENT / 1e9
        print(f"{name:<22}{t * 1e3:>10.1f}{rate[name] / 1e6:>11.0f}{gbs:>8.1f}{frac:>10}")
    if ds is None:
        print("DeepSpeedCPUAdam: not importable, skipped")

    result = {
        "numel": n,
        "threads": threads,
        "backend": backend(),
        "melem_per_s": {name: round(r / 1e6, 1) for name, r in rate.items()},
        "zt_vs_torch_fused": round(rate["zerotune"] / rate["torch fused"], 3),
        "zt_fused_bf16_vs_torch_fused_plus_copy": round(
            rate["zerotune + bf16 out"] / rate["torch fused + copy_"], 3
        ),
        "zt_fraction_of_bandwidth": round(rate["zerotune"] / probe, 3) if probe else None,
        "zt_vs_other_build": (
            round(rate["zerotune"] / rate["other build"], 3) if args.compare_op else None
        ),
        "zt_bf16_vs_other_build_bf16": (
            round(rate["zerotune + bf16 out"] / rate["other build + bf16 out"], 3)
            if args.compare_op
            else None
        ),
        "probe_gb_per_s": round(probe * BYTES_PER_ELEMENT / 1e9, 1) if probe else None,
        "prefetch_elements": op.prefetch_distance() if op is not None else None,
        "prefetch_vs_torch_fused": {
            ahead: round(rate[f"zerotune, prefetch {ahead}"] / rate["torch fused"], 3)
            for ahead in sweep
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
