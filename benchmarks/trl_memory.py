"""Peak memory of a TRL trainer that keeps a second model: plain against zerotune.

TRL's DPO keeps a reference model beside the trained one and its DistillationTrainer a
teacher. Each variant runs in a fresh process (its own peak RSS): the plain trainer, and
the same trainer through ``zerotune.hf.zero`` at stage 3 with parameters and optimizer
state on NVMe, where the second model is sharded and frozen too (no fp32 master; see [Note:
models beside the trained one] in zerotune/hf/companions.py). Both train the same steps
from the same random weights; their losses are printed side by side as a check.

    python benchmarks/trl_memory.py                                   # DPO, gpt2-medium
    python benchmarks/trl_memory.py --trainer distil --model gpt2 --teacher gpt2-medium
    python benchmarks/trl_memory.py --nvme-path /mnt/nvme --steps 3

Buffered reads of the parameter file fill the page cache: its growth is reported beside
RSS. The last line is one JSON object: each variant's ``peak_rss_gib``,
``page_cache_growth_gib``, ``losses``, ``step_s``, and ``peak_rss_ratio`` (zerotune /
plain).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

from _variants import answer_as_variant, page_cache_bytes, run_variants

VARIANTS = ["plain", "zerotune"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trainer", default="dpo", choices=["dpo", "distil"])
    ap.add_argument("--model", default="gpt2-medium", help="preset for the trained model")
    ap.add_argument("--teacher", default="gpt2-medium", help="preset for the teacher (distil)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="swap folder (default: the temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


class CacheWatch:
    """The largest growth of the page cache while it runs (sampled every 0.2 s)."""

    def __init__(self) -> None:
        self.start, self.peak = page_cache_bytes(), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, page_cache_bytes() - self.start)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def run_variant(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from zerotune.hf import model_config, zero
    from zerotune.hf.data import byte_tokenizer
    from zerotune.memory.probes import peak_rss

    torch.set_num_threads(args.threads or os.cpu_count())

    def build(name: str, seed: int):
        torch.manual_seed(seed)
        config = model_config(name)
        config.update(dict(bos_token_id=256, eos_token_id=256, pad_token_id=257))
        return AutoModelForCausalLM.from_config(config)

    wrap = zero if args.variant == "zerotune" else (lambda cls: cls)
    common = dict(
        per_device_train_batch_size=2, max_steps=args.steps, learning_rate=1e-5,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True,
        bf16=False, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    swap = tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="zerotune-trl-")
    if args.variant == "zerotune":
        common.update(
            zero_stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path=swap.name
        )
    tok = byte_tokenizer()
    watch = CacheWatch()
    if args.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        rows = [
            {"prompt": f"count from {i}:", "chosen": " ".join(str(i + k) for k in range(1, 9)),
             "rejected": " ".join(str(i - k) for k in range(1, 9))}
            for i in range(64)
        ]  # fmt: skip
        config = wrap(DPOConfig)(output_dir=swap.name + "/out", max_length=64, **common)
        trainer = wrap(DPOTrainer)(
            model=build(args.model, 0), ref_model=build(args.model, 0), args=config,
            train_dataset=Dataset.from_list(rows), processing_class=tok,
        )  # fmt: skip
    else:
        from trl import DistillationConfig, DistillationTrainer

        prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(64)]})
        config = wrap(DistillationConfig)(
            output_dir=swap.name + "/out", max_completion_length=16, **common
        )
        trainer = wrap(DistillationTrainer)(
            model=build(args.model, 0), teacher_model=build(args.teacher, 1), args=config,
            train_dataset=prompts, processing_class=tok,
        )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    cache = watch.close()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if args.variant == "zerotune":
        trainer.close()
    swap.cleanup()
    return {
        "peak_rss_gib": round(peak_rss() / 2**30, 3),
        "page_cache_growth_gib": round(cache / 2**30, 3),
        "losses": losses,
        "step_s": round(seconds / args.steps, 3),
    }


def main() -> None:
    args = parse()
    if answer_as_variant(args, run_variant):
        return
    results = run_variants(__file__, VARIANTS)
    what = f"{args.trainer}, {args.model}" + (
        f", teacher {args.teacher}" if args.trainer == "distil" else ""
    )
    print(f"{what}, {args.steps} steps, CPU")
    for name, r in results.items():
        print(
            f"  {name:9s} peak RSS {r['peak_rss_gib']:6.2f} GiB, page cache +"
            f"{r['page_cache_growth_gib']:.2f} GiB, {r['step_s']:.2f} s/step, losses {r['losses']}"
        )
    ratio = results["zerotune"]["peak_rss_gib"] / results["plain"]["peak_rss_gib"]
    print(json.dumps({**results, "peak_rss_ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
