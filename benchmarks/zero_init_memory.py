"""Peak memory of building a ~350M-parameter GPT-2: plain from_config vs zerotune.zero_init.

Runs, in one invocation, plain ``AutoModelForCausalLM.from_config`` in one subprocess and
``zerotune.zero_init`` at world size 2 (torchrun, gloo) in another, each measuring its peak RSS
growth over the RSS after imports. Prints a table and, last, one JSON line with
``zero_init_peak_mb`` (per rank, the larger), ``plain_peak_mb``, ``ratio``, and the issue's
bound ``shards + largest unit + 300 MB`` with ``within_bound``.

    python benchmarks/zero_init_memory.py [--layers 24 --hidden 1024 --world 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, os, resource, sys
import psutil, torch
from transformers import AutoModelForCausalLM, GPT2Config
mode, layers, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, vocab_size=50257)
AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8))
if mode == "zero":
    import torch.distributed as dist
    import zerotune
    dist.init_process_group("gloo")
base = psutil.Process().memory_info().rss
if mode == "zero":
    engine = zerotune.zero_init(cfg, {"stage": 3})
    shards = sum(u.shard_numel for u in engine.units) * 4
    largest = max(u.gathered_bytes for u in engine.units)
    params = sum(u.numel for u in engine.units)
    rank = dist.get_rank()
    dist.destroy_process_group()
else:
    model = AutoModelForCausalLM.from_config(cfg)
    shards = largest = 0
    params = sum(p.numel() for p in model.parameters())
    rank = 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"rank": rank, "grew": peak - base, "shards": shards, "largest": largest,
                  "params": params}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        dims = [str(args.layers), str(args.hidden)]
        plain = subprocess.run(
            [sys.executable, str(script), "plain", *dims], capture_output=True, text=True
        )
        zero = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={args.world}", str(script), "zero", *dims],
            capture_output=True, text=True,
        )  # fmt: skip
    for name, out in (("plain", plain), ("zero_init", zero)):
        if out.returncode != 0:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    p = json.loads(plain.stdout.strip().splitlines()[-1])
    ranks = [json.loads(line) for line in zero.stdout.splitlines() if line.startswith("{")]
    mb = 2**20
    print(f"GPT-2 {args.layers} layers x {args.hidden}: {p['params'] / 1e6:.0f}M parameters")
    print(f"{'build':<22}{'peak RSS growth MB':>20}{'bound MB':>12}")
    print(f"{'plain from_config':<22}{p['grew'] / mb:>20.0f}{'':>12}")
    worst = max(ranks, key=lambda r: r["grew"])
    for r in sorted(ranks, key=lambda r: r["rank"]):
        bound = r["shards"] + r["largest"] + 300 * mb
        label = f"zero_init rank {r['rank']}"
        print(f"{label:<22}{r['grew'] / mb:>20.0f}{bound / mb:>12.0f}")
    bound = worst["shards"] + worst["largest"] + 300 * mb
    print(
        json.dumps(
            {
                "params_m": round(p["params"] / 1e6, 1),
                "world": args.world,
                "plain_peak_mb": round(p["grew"] / mb),
                "zero_init_peak_mb": round(worst["grew"] / mb),
                "ratio": round(worst["grew"] / p["grew"], 3),
                "bound_mb": round(bound / mb),
                "within_bound": worst["grew"] < bound,
            }
        )
    )


if __name__ == "__main__":
    main()
