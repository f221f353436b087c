"""How close ``zerotune estimate`` comes to the peak host memory of real runs on this machine.

Run: ``python benchmarks/estimate_accuracy.py [--steps 3] [--layers 6] [--hidden 512]
[--seq-len 256] [--micro-batch 4] [--dtype fp32] [--optim-state-bits 8]``

Three configurations of one GPT-2-style model, each trained for ``--steps`` steps in its own
process (world size 1, ``zerotune.zero_init`` + ``ZeroAdamW``): stage 3 without offload,
stage 3 with parameters and optimizer offloaded to CPU memory, and stage 3 with both on
NVMe (swap files in a temporary folder, or ``--nvme-dir``). On a CPU-only machine the
compute device is host memory too, so the estimate of peak host memory is the sum over
every tier but NVMe (``estimate(..., device="cpu")``).

Measured: the peak resident set size of the training process (VmHWM, reset after warm-up)
minus its resident size just before the model is built. The warm-up runs the same
configuration on a tiny model first, so libraries, C++ ops and thread pools are loaded and
counted in the baseline, not in the growth.

The table shows estimate, measurement and relative error ((estimate - measured) /
measured) per configuration, with the estimate's parts; the last line is one JSON object
with ``relative_error`` per configuration and ``target`` (0.15).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIGS = {
    "no offload": {"stage": 3},
    "cpu offload": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    "nvme offload": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
}

CHILD = r"""
import json, sys
import torch
import zerotune
from zerotune.memory.host import release_free_memory
from transformers import GPT2Config

args = json.loads(sys.argv[1])
torch.manual_seed(0)
if args["mmap"]:
    from zerotune.memory.host import prefer_mmap_for_large_buffers

    prefer_mmap_for_large_buffers()


def gpt2(layers, hidden, heads, vocab, seq):
    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                      n_positions=seq, bos_token_id=0, eos_token_id=0)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024


def train(cfg, steps, seq, batch):
    engine = zerotune.zero_init(cfg, args["config"], seed=0)
    opt = zerotune.ZeroAdamW(engine, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        losses.append(float(loss))
        del loss
    report = engine.memory_report()
    engine.close()
    return engine, opt, losses, report


# Warm-up: the same configuration on a tiny model loads every library, op and thread pool.
tiny = gpt2(1, 32, 2, 64, 16)
e, o, _, _ = train(tiny, 2, 16, 2)
del e, o
release_free_memory()
base = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM
cfg = gpt2(args["layers"], args["hidden"], args["heads"], args["vocab"], args["seq"])
engine, opt, losses, report = train(cfg, args["steps"], args["seq"], args["batch"])
print(json.dumps({"grew": hwm() - base, "losses": losses, "report": report}))
"""


def run_child(args: dict) -> dict:
    code = CHILD
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"training process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dtype", default="fp32")
    p.add_argument(
        "--optim-state-bits", type=int, default=32, choices=[32, 8], help="8: 8-bit Adam moments"
    )
    p.add_argument("--nvme-dir", default=None, help="folder for swap files (default: a temp dir)")
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from zerotune.estimate import estimate

    hf = GPT2Config(
        n_layer=a.layers,
        n_embd=a.hidden,
        n_head=a.heads,
        vocab_size=a.vocab,
        n_positions=a.seq_len,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf)

    rows = []
    with tempfile.TemporaryDirectory(dir=a.nvme_dir) as nvme:
        for name, config in CONFIGS.items():
            config = dict(config, dtype=a.dtype, optim_state_bits=a.optim_state_bits)
            if "nvme" in config.values():
                config["nvme_path"] = nvme
            plan = estimate(
                meta,
                seq_len=a.seq_len,
                micro_batch=a.micro_batch,
                dtype=a.dtype,
                config={k: v for k, v in config.items() if k != "dtype"},
                device="cpu",
                gpu_memory=None,
            )
            option = plan.option(
                3, config.get("offload_param", "none"), config.get("offload_optimizer", "none")
            )
            row = {
                "config": name,
                "estimated": option.per_rank("host"),
                "parts": {r: option.rows[r].get("host", 0) for r in option.rows},
            }
            for allocator, mmap in (("default", False), ("mmap", True)):
                result = run_child(
                    {
                        "config": config,
                        "layers": a.layers,
                        "hidden": a.hidden,
                        "heads": a.heads,
                        "vocab": a.vocab,
                        "seq": a.seq_len,
                        "batch": a.micro_batch,
                        "steps": a.steps,
                        "mmap": mmap,
                    }
                )
                row[allocator] = result["grew"]
                row[f"error_{allocator}"] = (row["estimated"] - result["grew"]) / result["grew"]
            rows.append(row)

    mb = 1e6
    print(
        f"GPT-2 style, {a.layers} layers, hidden {a.hidden}, heads {a.heads}, vocab {a.vocab}, "
        f"seq {a.seq_len} x batch {a.micro_batch}, {a.dtype}, {a.steps} steps, world size 1, "
        f"{a.optim_state_bits}-bit Adam moments"
    )
    print("measured: peak RSS growth (MB) with glibc's default malloc, and with buffers of")
    print("1 MiB and more served by mmap (zerotune.memory.host.prefer_mmap_for_large_buffers)")
    print(
        f"{'config':<13} {'estimate':>8} {'default':>8} {'error':>7} {'mmap':>8} {'error':>7}"
        "   estimate parts (MB)"
    )
    for r in rows:
        parts = ", ".join(f"{k} {v / mb:.0f}" for k, v in r["parts"].items() if v)
        print(
            f"{r['config']:<13} {r['estimated'] / mb:>8.1f} {r['default'] / mb:>8.1f} "
            f"{r['error_default']:>+7.1%} {r['mmap'] / mb:>8.1f} {r['error_mmap']:>+7.1%}   {parts}"
        )
    print(
        json.dumps(
            {
                "relative_error": {r["config"]: round(r["error_default"], 4) for r in rows},
                "relative_error_mmap": {r["config"]: round(r["error_mmap"], 4) for r in rows},
                "target": 0.15,
                "within_target": all(abs(r["error_default"]) <= 0.15 for r in rows),
                "within_target_mmap": all(abs(r["error_mmap"]) <= 0.15 for r in rows),
                "estimated": {r["config"]: r["estimated"] for r in rows},
                "measured": {r["config"]: r["default"] for r in rows},
                "measured_mmap": {r["config"]: r["mmap"] for r in rows},
            }
        )
    )


if __name__ == "__main__":
    main()
