"""Tokens/s and GPU memory on one CUDA GPU: plain PyTorch vs zerotune with and without CPU
offload vs PyTorch's FSDP2 with CPU offload, in one invocation (issue 5's GPU check, issue 32's
targets: gpt2-xl bf16, optimizer offload to CPU).

Each variant runs in a fresh subprocess (its own peak GPU memory and RSS):

* ``plain``: the model in bf16 (or fp32) on the GPU, ``torch.optim.AdamW(fused=True)``;
* ``zerotune``: ZeRO-3 at world size 1, fp32 master and moments on the GPU;
* ``zerotune-optim-cpu``: master, moments and gradient shards on pinned host memory, the
  C++ CPU Adam (ZeRO-Offload);
* ``zerotune-both-cpu``: parameter shards on the host too (ZeRO-Infinity, CPU tier);
* ``zerotune-optim-cpu-overlap``: ``zerotune-optim-cpu`` with the last micro-batch's backward
  inside ``optimizer.overlapped()``: each unit's CPU Adam runs as soon as its gradient shard
  is final, on the optimizer's update thread while the GPU goes on with backward, the rest
  carried into the next forward (same updates, so the same losses);
* ``zerotune-optim-cpu-clipped``: ``zerotune-optim-cpu`` with ``clip_grad_norm_(1.0)`` before
  each step (the Trainer's default);
* ``zerotune-optim-cpu-clipped-overlap``: the same through ``overlapped(clipping=True)``: the
  norm summed as backward finishes each unit, the updates after it on the update thread,
  carried into the next forward (the same updates, so the same losses as the one before);
* ``zerotune-optim-cpu-overlap-inline``: the same with ``update_thread = False``: the CPU
  Adam on the thread that launches the GPU's kernels, as before the update thread;
* ``fsdp2-cpu-offload``: torch's ``fully_shard`` on every transformer block and the root,
  world size 1, ``CPUOffloadPolicy`` (fp32 parameter shards and gradients in pinned host
  memory), ``MixedPrecisionPolicy`` computing in ``--dtype`` and reducing in fp32 (the same
  fp32 master and bf16 compute as zerotune), ``torch.optim.AdamW(fused=True)`` stepping the
  host shards on the CPU.

A step is ``--accum`` micro-batches of ``--batch`` x ``--seq`` tokens and one optimizer step.
Prints a table, and last one JSON line with ``tokens_per_s`` / ``gpu_peak_gib`` /
``peak_rss_gib`` per variant, ``offload_tokens_ratio`` / ``offload_gpu_memory_ratio``
(optimizer on CPU / on the GPU), ``optim_cpu_vs_plain_tokens_ratio`` (target >= 0.85),
``optim_cpu_vs_fsdp2_tokens_ratio`` (target >= 1.0) and ``both_cpu_vs_fsdp2_tokens_ratio``
(parameters and optimizer on the host, as FSDP2's policy places them). A variant that fails
or runs past ``--time-budget`` is named with its error and the others still report; the exit
status is then 1.

``--device cpu`` runs the same code on the CPU (gloo for FSDP2, GPU memory reported as 0),
to check the variants' logic on a machine without a GPU:

    python benchmarks/gpu_step.py --model gpt2-xl --dtype bf16
    python benchmarks/gpu_step.py --model gpt2 --steps 3 --variants plain,zerotune
    python benchmarks/gpu_step.py --device cpu --model tiny-gpt2 --seq 64 --batch 2 \\
        --accum 2 --steps 2 --warmup 1 --variants plain,zerotune,fsdp2-cpu-offload
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from _variants import answer_as_variant, run_variants

VARIANTS = [
    "plain",
    "zerotune",
    "zerotune-optim-cpu",
    "zerotune-both-cpu",
    "fsdp2-cpu-offload",
    "zerotune-optim-cpu-overlap",
    "zerotune-optim-cpu-clipped",
    "zerotune-optim-cpu-clipped-overlap",
    "zerotune-optim-cpu-overlap-inline",
]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt2-xl", help="preset name or config.json path")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--time-budget",
        type=float,
        help="seconds for all variants: the one running when it is spent is stopped, later "
        "ones are not started, and the JSON line names them",
    )
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    return ap.parse_args()


def build_fsdp2(config, dtype, device):
    """The model under FSDP2 at world size 1 with CPU offload, and its optimizer.

    The process group is this process alone (NCCL on a GPU, gloo on the CPU). The model is
    built in fp32 on ``device`` (a fast random init) and ``fully_shard`` moves each shard to
    host memory, pinned on a GPU; parameters are gathered to the device in ``dtype`` and
    gradients reduced in fp32 into the host shards, where AdamW updates them."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    policy = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
    }
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    if not units:
        raise ValueError(f"{type(model).__name__} names no transformer block class to shard")
    for unit in units:
        fully_shard(unit, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, opt


def run_variant(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import zerotune
    from zerotune.hf import model_config

    torch.manual_seed(0)
    config = model_config(args.model)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    close = None
    if args.variant == "plain":
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        runner, backward = model, lambda loss: loss.backward()
    elif args.variant == "fsdp2-cpu-offload":
        import torch.distributed as dist

        model, opt = build_fsdp2(config, dtype, device)
        runner, backward, close = model, lambda loss: loss.backward(), dist.destroy_process_group
    else:
        zcfg = {"stage": 3, "dtype": args.dtype}
        if args.variant.startswith(("zerotune-optim-cpu", "zerotune-both-cpu")):
            zcfg["offload_optimizer"] = "cpu"
        if args.variant == "zerotune-both-cpu":
            zcfg["offload_param"] = "cpu"
        runner = zerotune.zero_init(config, zcfg, device=device)
        model = runner.module
        opt = zerotune.ZeroAdamW(runner, lr=1e-5)
        if args.variant == "zerotune-optim-cpu-overlap-inline":
            opt.update_thread = False  # the Adam on the thread that launches the GPU's work
        backward, close = runner.backward, runner.close
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=g)
    times, fwd_bwd, losses = [], [], []
    clipped, norms = "clipped" in args.variant, []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        total = 0.0
        for i in range(args.accum):
            loss = runner(input_ids=ids, labels=ids).loss / args.accum
            if "overlap" in args.variant and i == args.accum - 1:
                with opt.overlapped(clipping=clipped):
                    backward(loss)
            else:
                backward(loss)
            total += float(loss.detach())
        sync()
        t1 = time.perf_counter()
        if clipped:  # the Trainer's default max_grad_norm
            norms.append(round(float(opt.clip_grad_norm_(1.0)), 4))
        opt.step()
        opt.zero_grad()
        sync()
        losses.append(total)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            fwd_bwd.append(t1 - t0)
    step_s = statistics.median(times)
    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "step_s": step_s,
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "tokens_per_s": args.batch * args.seq * args.accum / step_s,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_gpu else 0.0,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": [round(x, 4) for x in losses],
    }
    if norms:
        result["grad_norms"] = norms  # above 1.0: the clipping clips
    if close is not None:
        close()
    return result


def ratio(results: dict, num: str, den: str, key: str = "tokens_per_s") -> float | None:
    """results[num][key] / results[den][key], or None when either variant has no result."""
    a, b = results.get(num, {}), results.get(den, {})
    if key not in a or key not in b or not b[key]:
        return None
    return round(a[key] / b[key], 4)


def main() -> None:
    args = parse()
    if answer_as_variant(args, run_variant):
        return
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    results = run_variants(__file__, args.variants.split(","), keep_going=True, deadline=deadline)
    print(
        f"model {args.model}, {args.dtype} on {args.device}, {args.accum} x {args.batch} x "
        f"{args.seq} tokens a step, median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"{'variant':<35}{'fwd+bwd s':>10}{'step s':>9}{'tokens/s':>11}{'GPU GiB':>10}"
        f"{'RSS GiB':>10}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<35}{r['error']}")
            continue
        print(
            f"{name:<35}{r['fwd_bwd_s']:>10.3f}{r['step_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
            f"{r['gpu_peak_gib']:>10.2f}{r['peak_rss_gib']:>10.2f}  losses {r['losses']}"
        )
    done = [r for r in results.values() if "error" not in r]
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "device": done[0]["device"] if done else args.device,
        "torch": done[0]["torch"] if done else None,
        "checkpointing": args.checkpointing,
        "tokens_per_step": args.batch * args.seq * args.accum,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    for name, r in results.items():
        if "error" in r:
            summary[f"{name}_error"] = r["error"]
            continue
        summary[f"{name}_tokens_per_s"] = round(r["tokens_per_s"], 1)
        summary[f"{name}_step_s"] = round(r["step_s"], 3)
        summary[f"{name}_fwd_bwd_s"] = round(r["fwd_bwd_s"], 3)
        summary[f"{name}_gpu_peak_gib"] = round(r["gpu_peak_gib"], 3)
        summary[f"{name}_peak_rss_gib"] = round(r["peak_rss_gib"], 3)
    ratios = {
        "offload_tokens_ratio": ratio(results, "zerotune-optim-cpu", "zerotune"),
        "offload_gpu_memory_ratio": ratio(
            results, "zerotune-optim-cpu", "zerotune", "gpu_peak_gib"
        ),
        "zerotune_vs_plain_tokens_ratio": ratio(results, "zerotune", "plain"),
        "optim_cpu_vs_plain_tokens_ratio": ratio(results, "zerotune-optim-cpu", "plain"),
        "optim_cpu_vs_fsdp2_tokens_ratio": ratio(
            results, "zerotune-optim-cpu", "fsdp2-cpu-offload"
        ),
        "both_cpu_vs_fsdp2_tokens_ratio": ratio(results, "zerotune-both-cpu", "fsdp2-cpu-offload"),
        "optim_cpu_overlap_vs_plain_tokens_ratio": ratio(
            results, "zerotune-optim-cpu-overlap", "plain"
        ),
        "optim_cpu_clipped_vs_plain_tokens_ratio": ratio(
            results, "zerotune-optim-cpu-clipped", "plain"
        ),
        "optim_cpu_clipped_overlap_vs_clipped_tokens_ratio": ratio(
            results, "zerotune-optim-cpu-clipped-overlap", "zerotune-optim-cpu-clipped"
        ),
        "optim_cpu_overlap_thread_vs_inline_tokens_ratio": ratio(
            results, "zerotune-optim-cpu-overlap", "zerotune-optim-cpu-overlap-inline"
        ),
    }
    summary.update({k: v for k, v in ratios.items() if v is not None})
    failed = [name for name, r in results.items() if "error" in r]
    if failed:
        summary["failed"] = failed
    print(json.dumps(summary))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
