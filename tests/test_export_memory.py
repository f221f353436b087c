"""Export memory: a checkpoint more than 3x the memory the export process may use is exported,
and the export's peak RSS growth stays at one piece of one tensor plus a fixed overhead."""

from __future__ import annotations

import json
import subprocess
import sys

import zerotune
from zerotune.checkpoint.export import CHUNK_ELEMENTS

MB = 2**20
OVERHEAD = 48 * MB  # allocator slack, first-use buffers of torch ops, hashing buffer

# Peak RSS is VmHWM of the export process's own address space: ru_maxrss would carry over
# the RSS of the pytest process that forked it (Linux keeps the high-water mark across exec).
SCRIPT = r"""
import json, resource, sys
import psutil, torch
torch.set_num_threads(1)
from zerotune.checkpoint import export_hf
ckpt, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
info = psutil.Process().memory_info()
# The memory limit: address space beyond what the imports took.
resource.setrlimit(resource.RLIMIT_AS, (info.vms + limit, info.vms + limit))
export_hf(ckpt, out, dtype="bf16", max_shard_size="100MB")
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak = int(status["VmHWM"].split()[0]) * 1024
print(json.dumps({"base": info.rss, "peak": peak}))
"""


def test_export_of_a_checkpoint_3x_the_memory_limit(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=1024, n_positions=128,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    engine = zerotune.zero_init(config, {"stage": 3})  # 86M parameters, fp32: 344 MB
    largest = max(s.numel for u in engine.units for s in u.slots)
    numel = sum(u.numel for u in engine.units)
    folder = zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0)
    del engine
    checkpoint_bytes = sum(p.stat().st_size for p in folder.iterdir())
    limit = checkpoint_bytes // 3

    script = tmp_path / "export.py"
    script.write_text(SCRIPT)
    out = tmp_path / "hf"
    run = subprocess.run(
        [sys.executable, str(script), str(folder), str(out), str(limit)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    grew = result["peak"] - result["base"]
    piece = min(largest, CHUNK_ELEMENTS) * (4 + 2)  # fp32 read + its bf16 copy
    print(
        f"checkpoint {checkpoint_bytes / MB:.0f} MB, limit {limit / MB:.0f} MB, "
        f"peak RSS growth {grew / MB:.1f} MB (piece {piece / MB:.1f} MB)"
    )
    assert grew < piece + OVERHEAD, grew / MB
    assert grew < checkpoint_bytes / 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weights = sorted(out.glob("model-*.safetensors"))
    assert len(weights) == 2
    assert index["metadata"] == {"total_size": 2 * numel, "total_parameters": numel}
    assert sum(p.stat().st_size for p in weights) > 2 * numel  # data + headers
