"""Export a sharded checkpoint to an HF folder: zerotune's streaming export vs the naive
consolidation (every shard into memory, one state dict, ``safetensors.torch.save_file``).

Builds the checkpoint once (zero-init at world size 1, no optimizer state), then runs each
variant in a fresh subprocess so its peak RSS is its own (VmHWM: ``ru_maxrss`` would carry
over this process's peak across exec). Prints a table and, last, one JSON line with
``peak_rss_ratio`` and ``time_ratio`` (zerotune / naive).

    python benchmarks/export_memory.py                  # gpt2 (124M): a 0.5 GB checkpoint
    python benchmarks/export_memory.py --model gpt2-medium --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_rss() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) * 1024


def run_variant(variant: str, ckpt: str, out: str, dtype: str) -> dict:
    import psutil
    import torch

    from zerotune.checkpoint import export_hf

    base = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    if variant == "zerotune":
        export_hf(ckpt, out, dtype=dtype, verify=False)
    else:
        from safetensors.torch import save_file

        from zerotune.checkpoint.load import RankFiles, open_checkpoint

        folder, manifest = open_checkpoint(ckpt)
        files = RankFiles(folder, manifest["world_size"])
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        state = {}
        for p in manifest["params"]:
            full = torch.empty(p["numel"], dtype=torch.float32)
            for rank, a, b, at in p["ranges"]:
                files[rank].read(f"u{p['unit']}.master", at, at + b - a, full[a:b])
            state[p["name"]] = full.view(p["shape"]).to(torch_dtype[dtype])
        Path(out).mkdir()
        save_file(state, f"{out}/model.safetensors", metadata={"format": "pt"})
    return {"time_s": time.perf_counter() - t0, "peak_growth": _peak_rss() - base}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt2", help="preset name or config.json path")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--variant", choices=["zerotune", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.ckpt, args.out, args.dtype)))
        return

    import zerotune
    from zerotune.hf import model_config

    with tempfile.TemporaryDirectory() as tmp:
        engine = zerotune.zero_init(model_config(args.model), {"stage": 3})
        folder = zerotune.save_checkpoint(engine, f"{tmp}/ckpt", step=0)
        del engine
        size = sum(p.stat().st_size for p in folder.iterdir())
        results = {}
        for variant in ("naive", "zerotune"):
            cmd = [sys.executable, __file__, "--variant", variant, "--dtype", args.dtype,
                   "--ckpt", str(folder), "--out", f"{tmp}/{variant}"]  # fmt: skip
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"{args.model}, checkpoint {size / mib:.0f} MiB, export to {args.dtype}")
    print(f"{'variant':<10}{'time s':>10}{'peak RSS growth MiB':>22}")
    for name, r in results.items():
        print(f"{name:<10}{r['time_s']:>10.2f}{r['peak_growth'] / mib:>22.1f}")
    z, n = results["zerotune"], results["naive"]
    print(
        json.dumps(
            {
                "model": args.model,
                "checkpoint_mib": round(size / mib, 1),
                "peak_rss_ratio": round(z["peak_growth"] / max(n["peak_growth"], 1), 4),
                "time_ratio": round(z["time_s"] / n["time_s"], 3),
                "zerotune_peak_growth_mib": round(z["peak_growth"] / mib, 1),
                "naive_peak_growth_mib": round(n["peak_growth"] / mib, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
