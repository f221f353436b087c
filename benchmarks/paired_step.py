"""Time plain PyTorch and zerotune step by step in one process, their steps alternating.

On a shared machine whose speed drifts by 10-15% within a minute, timing each variant in its
own process (benchmarks/train_step.py) compares steps run at different moments. Here both
models live in this process and their steps alternate (plain, zerotune, then zerotune, plain,
and so on), so each pair of steps runs under the same conditions; ``step_time_ratio`` is the
median of the pairs' ratios (zerotune / plain). Both start from the same initial weights
and see the same batch and dropout masks, so their losses are printed side by side as a check.

Plain is ``torch.optim.AdamW(fused=True)`` over an HF GPT-2 config; zerotune is
``zerotune.ZeroEngine`` over a copy of the same model with ``ZeroAdamW`` at world size 1, the chosen
stage and offload (none or cpu: what fits beside a second model in memory; cpu moves the
optimizer state, and at stage 3 the parameters, and zerotune's malloc settings for host
shards, memory/host.py, then hold for plain too). With ``--dtype bf16`` plain steps bf16
weights and zerotune an fp32 master, so their losses part after the first step. Peak RSS is
not reported (one process holds both); benchmarks/train_step.py reports it per variant.

    python benchmarks/paired_step.py                          # gpt2, stage 3, no offload
    python benchmarks/paired_step.py --threads 1 --pairs 40
    python benchmarks/paired_step.py --device cuda --model gpt2-xl --dtype bf16 --seq 1024

The last line is one JSON object: ``step_time_ratio`` (median of the pairs' ratios), the
same per phase (``forward_ratio``, ``backward_ratio``, ``optimizer_ratio``: medians of each
side's phase times), both sides' median step times, the pairs' ratios, and the losses.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

from _variants import add_model_arguments

PHASES = ("forward", "backward", "optimizer")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(ap)
    ap.add_argument("--pairs", type=int, default=30, help="timed pairs of steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first")
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--offload", default="none", choices=["none", "cpu"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = ap.parse_args()
    if args.pairs < 1 or args.warmup < 0:
        ap.error("--pairs must be at least 1 and --warmup at least 0")
    return args


def main() -> None:
    args = parse()
    import torch
    from transformers import AutoModelForCausalLM

    import zerotune
    from zerotune.hf import model_config

    torch.set_num_threads(args.threads or os.cpu_count())
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = model_config(args.model)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).to(dtype)
    plain = copy.deepcopy(base).to(device)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-5, fused=True)
    zcfg = {"stage": args.stage, "dtype": args.dtype}
    if args.offload != "none":  # the optimizer state, and at stage 3 the parameters
        zcfg.update(offload_optimizer=args.offload)
        if args.stage == 3:
            zcfg.update(offload_param=args.offload)
    engine = zerotune.ZeroEngine(base, zerotune.load_config(zcfg), device=device)
    zopt = zerotune.ZeroAdamW(engine, lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(model, opt, seed: int) -> tuple[float, ...]:
        torch.manual_seed(seed)  # the same dropout masks on both sides
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0, float(loss)

    sides = {"plain": (plain, popt), "zerotune": (engine, zopt)}
    losses: dict[str, list[float]] = {"plain": [], "zerotune": []}
    for i in range(args.warmup):
        for name, (model, opt) in sides.items():
            losses[name].append(round(step(model, opt, i)[-1], 4))
    times: dict[str, list[tuple[float, ...]]] = {"plain": [], "zerotune": []}
    for i in range(args.pairs):
        order = ("plain", "zerotune") if i % 2 == 0 else ("zerotune", "plain")
        for name in order:
            t = step(*sides[name], args.warmup + i)
            times[name].append(t[:4])
            losses[name].append(round(t[4], 4))
    engine.close()

    pair_ratios = [z[3] / p[3] for p, z in zip(times["plain"], times["zerotune"])]
    med = {n: [statistics.median(t[k] for t in times[n]) for k in range(4)] for n in times}
    print(
        f"model {args.model}, seq {args.seq}, batch {args.batch}, {args.dtype}, stage "
        f"{args.stage}, offload {args.offload}, {device}, "
        f"{args.threads or os.cpu_count()} threads, {args.pairs} pairs after {args.warmup} "
        "warm-up steps each"
    )
    print(f"{'side':<10}" + "".join(f"{h + ' s':>13}" for h in (*PHASES, "total")))
    for name, m in med.items():
        print(f"{name:<10}" + "".join(f"{x:>13.4f}" for x in m))
    summary = {
        "model": args.model,
        "stage": args.stage,
        "dtype": args.dtype,
        "offload": args.offload,
        "device": str(device),
        "threads": args.threads or os.cpu_count(),
        "pairs": args.pairs,
        "step_time_ratio": round(statistics.median(pair_ratios), 4),
        **{
            f"{p}_ratio": round(med["zerotune"][k] / med["plain"][k], 4)
            for k, p in enumerate(PHASES)
        },
        "step_time_s": round(med["zerotune"][3], 4),
        "plain_step_time_s": round(med["plain"][3], 4),
        "pair_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(pair_ratios, n=4)]
        if len(pair_ratios) > 1
        else None,
        "losses": losses["zerotune"][: args.warmup + 3],
        "plain_losses": losses["plain"][: args.warmup + 3],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
