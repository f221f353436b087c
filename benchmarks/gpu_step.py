"""Tokens/s and GPU memory on one CUDA GPU: plain PyTorch vs zerotune with and without CPU
offload, in one invocation (issue 5's GPU check: gpt2-xl bf16, optimizer offload to CPU).

Each variant runs in a fresh subprocess (its own peak GPU memory and RSS):

* ``plain``: the model in bf16 (or fp32) on the GPU, ``torch.optim.AdamW(fused=True)``;
* ``zerotune``: ZeRO-3 at world size 1, fp32 master and moments on the GPU;
* ``zerotune-optim-cpu``: master, moments and gradient shards on pinned host memory, the
  C++ CPU Adam (ZeRO-Offload);
* ``zerotune-both-cpu``: parameter shards on the host too (ZeRO-Infinity, CPU tier).

A step is ``--accum`` micro-batches of ``--batch`` x ``--seq`` tokens and one optimizer step.
Prints a table, and last one JSON line with ``tokens_per_s`` / ``gpu_peak_gib`` per variant
and ``offload_tokens_ratio`` / ``offload_gpu_memory_ratio`` (optimizer on CPU / on the GPU).

    python benchmarks/gpu_step.py --model gpt2-xl --dtype bf16
    python benchmarks/gpu_step.py --model gpt2 --steps 3 --variants plain,zerotune
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from _variants import answer_as_variant, run_variants

VARIANTS = ["plain", "zerotune", "zerotune-optim-cpu", "zerotune-both-cpu"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt2-xl", help="preset name or config.json path")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    return ap.parse_args()


def run_variant(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import zerotune
    from zerotune.hf import model_config

    torch.manual_seed(0)
    config = model_config(args.model)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.cuda.reset_peak_memory_stats()
    if args.variant == "plain":
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        runner, backward = model, lambda loss: loss.backward()
    else:
        zcfg = {"stage": 3, "dtype": args.dtype}
        if args.variant in ("zerotune-optim-cpu", "zerotune-both-cpu"):
            zcfg["offload_optimizer"] = "cpu"
        if args.variant == "zerotune-both-cpu":
            zcfg["offload_param"] = "cpu"
        runner = zerotune.zero_init(config, zcfg)
        model = runner.module
        opt = zerotune.ZeroAdamW(runner, lr=1e-5)
        backward = runner.backward
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
    times, fwd_bwd, losses = [], [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(args.accum):
            loss = runner(input_ids=ids, labels=ids).loss / args.accum
            backward(loss)
            total += float(loss.detach())
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        losses.append(total)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            fwd_bwd.append(t1 - t0)
    step_s = statistics.median(times)
    result = {
        "step_s": step_s,
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "tokens_per_s": args.batch * args.seq * args.accum / step_s,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": [round(x, 4) for x in losses],
    }
    if args.variant != "plain":
        runner.close()
    return result


def main() -> None:
    args = parse()
    if answer_as_variant(args, run_variant):
        return
    results = run_variants(__file__, args.variants.split(","))
    print(
        f"model {args.model}, {args.dtype}, {args.accum} x {args.batch} x {args.seq} tokens a "
        f"step, median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"{'variant':<22}{'fwd+bwd s':>10}{'step s':>9}{'tokens/s':>11}{'GPU GiB':>10}"
        f"{'RSS GiB':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:<22}{r['fwd_bwd_s']:>10.3f}{r['step_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
            f"{r['gpu_peak_gib']:>10.2f}{r['peak_rss_gib']:>10.2f}  losses {r['losses']}"
        )
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "checkpointing": args.checkpointing,
        "tokens_per_step": args.batch * args.seq * args.accum,
    }
    for name, r in results.items():
        summary[f"{name}_tokens_per_s"] = round(r["tokens_per_s"], 1)
        summary[f"{name}_step_s"] = round(r["step_s"], 3)
        summary[f"{name}_fwd_bwd_s"] = round(r["fwd_bwd_s"], 3)
        summary[f"{name}_gpu_peak_gib"] = round(r["gpu_peak_gib"], 3)
        summary[f"{name}_peak_rss_gib"] = round(r["peak_rss_gib"], 3)
    if "zerotune" in results and "zerotune-optim-cpu" in results:
        on, off = results["zerotune"], results["zerotune-optim-cpu"]
        summary["offload_tokens_ratio"] = round(off["tokens_per_s"] / on["tokens_per_s"], 4)
        summary["offload_gpu_memory_ratio"] = round(off["gpu_peak_gib"] / on["gpu_peak_gib"], 4)
    if "plain" in results and "zerotune" in results:
        plain, zt = results["plain"], results["zerotune"]
        summary["zerotune_vs_plain_tokens_ratio"] = round(
            zt["tokens_per_s"] / plain["tokens_per_s"], 4
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
