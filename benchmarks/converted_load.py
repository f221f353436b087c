"""Loading a hub-layout MoE checkpoint: transformers' from_pretrained vs zerotune's streaming load.

A Qwen3-MoE-shaped model with random weights is saved by transformers in bf16, one tensor
per expert (the layout of hub checkpoints, which transformers 5 merges into one
``experts.gate_up_proj`` / ``experts.down_proj`` per layer while loading). In one
invocation, subprocesses then load it:
- ``plain``: ``AutoModelForCausalLM.from_pretrained`` (bf16, the whole model in memory);
- ``zerotune``: ``zerotune.from_pretrained`` at stage 3 with parameters and optimizer state
  on NVMe (swap files in a temporary folder), which merges the experts one at a time;
- ``zerotune_merged``: the same load of the same weights saved in the model's own layout
  (merged experts), the baseline for what the conversion costs;
- an export (``export_hf``, bf16) of a checkpoint of the ``zerotune`` load back into the
  hub layout, compared with transformers' files.
Each load reports its peak RSS growth over the RSS after imports, the page cache's growth
(the swap files and the checkpoint read through it) and its wall time, and all compute the
same loss on one batch. The last line is one JSON object with ``params_m``,
``plain_peak_mb``, ``zerotune_peak_mb``, ``zerotune_page_cache_mb``, ``peak_ratio``,
``largest_merged_mb`` (one merged parameter in bf16), ``plain_s``, ``zerotune_s``,
``time_ratio``, ``merged_layout_peak_mb``, ``merged_layout_s``, ``conversion_time_ratio``,
``same_loss``, ``export_peak_mb``, ``export_s`` and ``export_equals_checkpoint``.

    python benchmarks/converted_load.py [--layers 8 --hidden 1024 --experts 32 --moe 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors import safe_open

WORKER = r"""
import json, resource, sys, time
import psutil, torch
from transformers import AutoModelForCausalLM
mode, folder, swap = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(2)
if mode == "zerotune":
    import zerotune
def cached():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("Cached:"))
base, cache = psutil.Process().memory_info().rss, cached()
start = time.perf_counter()
if mode == "zerotune":
    config = {"stage": 3, "dtype": "bf16", "offload_param": "nvme",
              "offload_optimizer": "nvme", "nvme_path": swap}
    engine = zerotune.from_pretrained(folder, config)
    model = engine.module
else:
    model = AutoModelForCausalLM.from_pretrained(folder)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    loss = float(model(input_ids=ids, labels=ids).loss)
print(json.dumps({"grew": peak - base, "cache": cached() - cache, "seconds": seconds,
                  "loss": loss}), flush=True)
if mode == "zerotune" and len(sys.argv) > 4:  # a checkpoint for the export below
    zerotune.save_checkpoint(engine, sys.argv[4], step=0)
"""

# zerotune export of that checkpoint back into the hub layout, in a fresh process.
EXPORT = r"""
import json, resource, sys, time
import psutil, torch
torch.set_num_threads(2)
from zerotune.checkpoint import export_hf
base = psutil.Process().memory_info().rss
start = time.perf_counter()
export_hf(sys.argv[1], sys.argv[2], dtype="bf16")
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"grew": peak - base, "seconds": seconds}), flush=True)
"""

SAVE = r"""
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
folder, layers, hidden, experts, moe = sys.argv[1], *map(int, sys.argv[2:])
config = Qwen3MoeConfig(
    vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
    num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
    num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=moe,
)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(folder)
# The same weights in the model's own layout (merged experts), as a baseline for the load.
import os, shutil
from safetensors.torch import save_file
os.makedirs(folder + "-merged")
for f in ("config.json", "generation_config.json"):
    shutil.copy(os.path.join(folder, f), folder + "-merged")
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
         or not config.tie_word_embeddings}
save_file(state, folder + "-merged/model.safetensors", metadata={"format": "pt"})
merged = model.model.layers[0].mlp.experts.gate_up_proj.numel()
print(sum(p.numel() for p in model.parameters()), merged)
"""


def _same_tensors(a: Path, b: Path) -> bool:
    """Whether two folders' safetensors hold the same names and values."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for f in folder.glob("*.safetensors"):
            out.update(load_file(f))
        return out

    x, y = tensors(a), tensors(b)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="converted_load-") as tmp:
        tmp = Path(tmp)
        (tmp / "save.py").write_text(SAVE)
        (tmp / "worker.py").write_text(WORKER)
        (tmp / "export.py").write_text(EXPORT)
        dims = [str(v) for v in (args.layers, args.hidden, args.experts, args.moe)]
        saved = subprocess.run(
            [sys.executable, str(tmp / "save.py"), str(tmp / "model"), *dims],
            capture_output=True, text=True,
        )  # fmt: skip
        if saved.returncode != 0:
            sys.exit(f"saving failed:\n{saved.stderr[-3000:]}")
        params, merged = map(int, saved.stdout.split()[-2:])
        keys = []
        for f in (tmp / "model").glob("*.safetensors"):
            with safe_open(f, "pt") as handle:
                keys += list(handle.keys())
        per_expert = sum("layers.0.mlp.experts.0." in k for k in keys)
        results = {}
        for mode, folder in (("plain", "model"), ("zerotune", "model"),
                             ("zerotune_merged", "model-merged")):  # fmt: skip
            ckpt = [str(tmp / "ckpt")] if mode == "zerotune" else []
            run = subprocess.run(
                [sys.executable, str(tmp / "worker.py"), mode.split("_")[0], str(tmp / folder),
                 str(tmp / "swap"), *ckpt],
                capture_output=True, text=True,
            )  # fmt: skip
            if run.returncode != 0:
                sys.exit(f"{mode} failed:\n{run.stderr[-3000:]}")
            results[mode] = json.loads(run.stdout.strip().splitlines()[0])
        run = subprocess.run(
            [sys.executable, str(tmp / "export.py"), str(tmp / "ckpt"), str(tmp / "exported")],
            capture_output=True, text=True,
        )  # fmt: skip
        if run.returncode != 0:
            sys.exit(f"export failed:\n{run.stderr[-3000:]}")
        exported = json.loads(run.stdout.strip().splitlines()[-1])
        same_files = _same_tensors(tmp / "model", tmp / "exported")
    mb = 2**20
    p, z, m = results["plain"], results["zerotune"], results["zerotune_merged"]
    print(
        f"Qwen3-MoE shape: {params / 1e6:.0f}M parameters, {args.layers} layers x "
        f"{args.experts} experts, {per_expert} tensors per expert per layer in the checkpoint"
    )
    print(f"{'load':<18}{'peak RSS growth MB':>20}{'page cache MB':>15}{'seconds':>9}{'loss':>9}")
    for name, r in results.items():
        print(
            f"{name:<18}{r['grew'] / mb:>20.0f}{r['cache'] / mb:>15.0f}{r['seconds']:>9.1f}"
            f"{r['loss']:>9.4f}"
        )
    print(
        json.dumps(
            {
                "params_m": round(params / 1e6, 1),
                "plain_peak_mb": round(p["grew"] / mb),
                "zerotune_peak_mb": round(z["grew"] / mb),
                "zerotune_page_cache_mb": round(z["cache"] / mb),
                "peak_ratio": round(z["grew"] / p["grew"], 3),
                "largest_merged_mb": round(merged * 2 / mb),
                "plain_s": round(p["seconds"], 1),
                "zerotune_s": round(z["seconds"], 1),
                "time_ratio": round(z["seconds"] / p["seconds"], 2),
                "merged_layout_peak_mb": round(m["grew"] / mb),
                "merged_layout_s": round(m["seconds"], 1),
                "conversion_time_ratio": round(z["seconds"] / m["seconds"], 2),
                "same_loss": p["loss"] == z["loss"] == m["loss"],
                "export_peak_mb": round(exported["grew"] / mb),
                "export_s": round(exported["seconds"], 1),
                "export_equals_checkpoint": same_files,
            }
        )
    )


if __name__ == "__main__":
    main()
