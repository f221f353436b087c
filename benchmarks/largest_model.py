"""Train the largest model this machine holds: a Llama-2-7B-shaped model (32 layers, hidden
4096, MLP 11008, vocab 32000; 6.7B parameters) built by zero-init with random weights, both
tiers on NVMe, 8-bit Adam moments and bf16 gradient shards, at world size 1.

Plain PyTorch cannot run it here (fp32 weights, gradients and Adam states alone are 16 bytes
a parameter: 108 GB against 24 GiB of RAM), so there is no baseline run: the figures are
absolute. Prints the parameter count, the build time, each step's time and loss, peak RSS,
the machine's page-cache growth, the swap files' bytes per parameter and the disk bytes read
and written per step; the last line is one JSON object.

    HF_HUB_OFFLINE=1 python benchmarks/largest_model.py --nvme-path /tmp/bench
    HF_HUB_OFFLINE=1 python benchmarks/largest_model.py --nvme-path /tmp/bench \\
        --layers 4 --hidden 1024 --intermediate 2816        # a quick check of the script

Before building, the script compares the disk bytes zerotune's estimate plans for the swap
files with the free space under ``--nvme-path`` and stops (exit 2) when less than
``--spare`` would be left.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

from _variants import page_cache_bytes


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nvme-path", required=True, help="folder for the swap files")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grad-dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--state-bits", type=int, default=8, choices=[8, 32])
    ap.add_argument(
        "--tile-linear-bytes",
        default="256MiB",
        help="zerotune's tile_linear_bytes: large linears gathered in tiles ('0': whole)",
    )
    ap.add_argument("--prefetch-bytes", default=None, help="zerotune's prefetch_bytes")
    ap.add_argument(
        "--overlap-step",
        action="store_true",
        help="update each unit during backward (ZeroAdamW.overlapped(), no clipping)",
    )
    ap.add_argument(
        "--spare",
        default="8GiB",
        help="free disk space that must be left beside the planned swap files",
    )
    return ap.parse_args()


def main() -> None:
    args = parse()
    import psutil
    import torch
    from transformers import LlamaConfig

    import zerotune
    from zerotune.config import parse_bytes
    from zerotune.estimate import estimate

    if not os.path.isdir(args.nvme_path):
        sys.exit(f"largest_model.py: --nvme-path {args.nvme_path} is not a folder")
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    zcfg = {
        "stage": 3,
        "dtype": "fp32",
        "grad_dtype": args.grad_dtype,
        "optim_state_bits": args.state_bits,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "tile_linear_bytes": parse_bytes(args.tile_linear_bytes, name="--tile-linear-bytes"),
    }
    if args.prefetch_bytes is not None:
        zcfg["prefetch_bytes"] = parse_bytes(args.prefetch_bytes, name="--prefetch-bytes")

    settings = {k: v for k, v in zcfg.items() if not k.startswith("offload")}
    plan = estimate(config, gpu_memory=None, seq_len=args.seq, micro_batch=args.batch,
                    device="cpu", dtype="fp32", grad_dtype=args.grad_dtype,
                    optim_state_bits=args.state_bits, config=settings)  # fmt: skip
    option = next(
        o
        for o in plan.options
        if (o.stage, o.offload_param, o.offload_optimizer) == (3, "nvme", "nvme")
    )
    planned = option.detail["nvme"]["nvme"]
    free = shutil.disk_usage(args.nvme_path).free
    spare = parse_bytes(args.spare, name="--spare")
    if planned + spare > free:
        print(
            f"largest_model.py: the swap files need {planned / 1e9:.1f} GB and {spare / 2**30:.0f}"
            f" GiB must stay free, but {args.nvme_path} has {free / 1e9:.1f} GB free",
            file=sys.stderr,
        )
        sys.exit(2)
    print(f"estimate: {planned / 1e9:.1f} GB of swap files, {free / 1e9:.1f} GB free", flush=True)

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    folder = tempfile.mkdtemp(prefix="largest-", dir=args.nvme_path)
    zcfg["nvme_path"] = folder
    cached0 = page_cache_bytes()
    cached_peak = 0
    t0 = time.perf_counter()
    try:
        engine = zerotune.zero_init(config, zcfg)
        build_s = time.perf_counter() - t0
        params = sum(u.numel for u in engine.units)
        swap_bytes = sum(f.size for f in engine.swap.files.values())
        print(
            f"built {params / 1e9:.3f}B parameters in {build_s:.0f} s; swap files "
            f"{swap_bytes / 1e9:.1f} GB ({swap_bytes / params:.2f} bytes a parameter)",
            flush=True,
        )
        opt = zerotune.ZeroAdamW(engine, lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        io = psutil.Process().io_counters
        times, losses, read, written = [], [], [], []
        for step in range(args.steps):
            before = io()
            t = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            if args.overlap_step:
                with opt.overlapped():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            after = io()
            read.append(after.read_bytes - before.read_bytes)
            written.append(after.write_bytes - before.write_bytes)
            losses.append(round(float(loss.detach()), 4))
            cached_peak = max(cached_peak, page_cache_bytes() - cached0)
            print(
                f"step {step}: loss {losses[-1]}, {times[-1]:.1f} s, read {read[-1] / 1e9:.1f}"
                f" GB, written {written[-1] / 1e9:.1f} GB",
                flush=True,
            )
        mib = {k: round(v / 2**20) for k, v in engine.memory_report().items()}
        engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result = {
        "params": params,
        "layers": args.layers,
        "hidden": args.hidden,
        "seq": args.seq,
        "grad_dtype": args.grad_dtype,
        "optim_state_bits": args.state_bits,
        "overlap_step": args.overlap_step,
        "build_s": round(build_s, 1),
        "step_time_s": round(statistics.median(times), 2),
        "step_times_s": [round(t, 2) for t in times],
        "losses": losses,
        "peak_rss_gib": round(peak_rss, 3),
        "page_cache_growth_gib": round(cached_peak / 2**30, 2),
        "swap_bytes": swap_bytes,
        "swap_bytes_per_param": round(swap_bytes / params, 3),
        "estimated_swap_bytes": planned,
        "disk_read_gb_per_step": round(statistics.median(read) / 1e9, 2),
        "disk_written_gb_per_step": round(statistics.median(written) / 1e9, 2),
        "memory_report_mib": mib,
    }
    print(
        f"peak RSS {peak_rss:.2f} GiB, page cache grew by {cached_peak / 2**30:.1f} GiB at most,"
        f" memory report (MiB) {mib}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
