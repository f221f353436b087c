"""The shared job of the ZeroTrainer tests: a tiny GPT-2, a small dataset, the same arguments for
the plain Trainer and ZeroTrainer. Run as a script under torchrun, it trains the plain Trainer
(DDP) and ZeroTrainer at several stages in the same processes and writes their logs as JSON:

    python -m torch.distributed.run --standalone --nproc-per-node 2 trainer_cases.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from conftest import tiny_gpt2  # noqa: E402

# Global batch 8 per optimizer step at world 1 (4 x 2 accumulation), 16 at world 2.
COMMON = dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    max_steps=6,
    learning_rate=2e-3,
    weight_decay=0.1,
    max_grad_norm=0.5,  # small enough to clip
    lr_scheduler_type="linear",
    warmup_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
    use_cpu=True,
    dataloader_num_workers=0,
)


def dataset(n: int = 64, seq: int = 16, vocab: int = 96):
    """Learnable rows: each counts up from a random start by a random stride."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = ((start + stride * torch.arange(seq)) % vocab).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def model():
    return tiny_gpt2(seed=0)  # dropout off: the two trainers see the same function


# A DeepSpeed ZeRO-3 config as transformers' DeepSpeed docs write one: "auto" wherever the
# Trainer's arguments decide, both tiers on NVMe, DeepSpeed's own tuning knobs.
DS_ZERO3_NVME = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "SWAP", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "SWAP", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e6,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip


def logged(trainer, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "step" in h]


def plain_run(output_dir: str, **overrides):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, **{**COMMON, **overrides})
    trainer = Trainer(model=model(), args=args, train_dataset=dataset(), eval_dataset=dataset(16))
    trainer.train()
    return trainer


def zero_run(output_dir: str, *, model_source=None, train: bool = True, **overrides):
    from zerotune.hf import ZeroTrainer, ZeroTrainingArguments

    args = ZeroTrainingArguments(output_dir=output_dir, **{**COMMON, **overrides})
    trainer = ZeroTrainer(
        model=model() if model_source is None else model_source,
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(16),
    )
    if train:
        trainer.train()
    return trainer


CASES_WORLD2 = {
    "stage1": dict(zero_stage=1),
    "stage3": dict(zero_stage=3),
    "stage2_nvme_optimizer": dict(zero_stage=2, offload_optimizer="nvme"),
}


def main(out: str) -> None:
    import tempfile

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    work = Path(out).parent
    results = {}
    plain = plain_run(str(work / "plain"))
    results["plain"] = {"world": plain.args.world_size, "loss": logged(plain)}
    for name, overrides in CASES_WORLD2.items():
        extra = dict(overrides)
        if "nvme" in extra.values():
            extra["nvme_path"] = tempfile.gettempdir()
        trainer = zero_run(str(work / name), **extra)
        results[name] = {
            "world": trainer.args.world_size,
            "engine_world": trainer.engine.world,
            "loss": logged(trainer),
            "grad_norm": logged(trainer, "grad_norm"),
        }
        trainer.close()
    # TRL's GRPO: completions generated on each rank by the sharded model, then trained on.
    from test_trl import GRPO_ARGS, grpo_run, unwrapped
    from trl import GRPOConfig

    from zerotune.hf import zero

    _, plain_grpo = grpo_run(unwrapped, GRPOConfig(str(work / "grpo-plain"), **GRPO_ARGS))
    zero_args = zero(GRPOConfig)(str(work / "grpo-zero"), **GRPO_ARGS, zero_stage=3)
    trainer, zero_grpo = grpo_run(zero, zero_args)
    grpo = {"engine_world": trainer.engine.world, "plain": plain_grpo, "zero": zero_grpo}
    trainer.close()
    # TRL's distillation: the teacher sharded too, its head read outside its forward.
    from test_trl import DISTIL_ARGS, distil_run
    from trl import DistillationConfig

    _, plain_distil = distil_run(
        unwrapped, DistillationConfig(str(work / "d-plain"), **DISTIL_ARGS)
    )
    zero_args = zero(DistillationConfig)(str(work / "d-zero"), **DISTIL_ARGS, zero_stage=3)
    trainer, zero_distil = distil_run(zero, zero_args)
    distil = {
        "engine_world": trainer.teacher_engine.world,
        "plain": plain_distil,
        "zero": zero_distil,
    }
    trainer.close()
    # TRL's Online DPO: its reference deep-copied from the sharded model (copy_sharded).
    from test_trl import ARGS
    from test_trl_experimental import online_dpo_run
    from trl.experimental.online_dpo import OnlineDPOConfig

    options = dict(ARGS, max_new_tokens=8)
    _, plain_online = online_dpo_run(unwrapped, OnlineDPOConfig(str(work / "o-plain"), **options))
    zero_args = zero(OnlineDPOConfig)(str(work / "o-zero"), **options, zero_stage=3)
    trainer, zero_online = online_dpo_run(zero, zero_args)
    online = {"engine_world": trainer.ref_engine.world, "plain": plain_online, "zero": zero_online}
    trainer.close()
    # TRL's BEMA over the shards of both ranks, moving DPO's reference every step.
    from test_trl_experimental import bema_run
    from trl import DPOConfig

    _, plain_bema = bema_run(unwrapped, DPOConfig(str(work / "b-plain"), **ARGS))
    trainer, zero_bema = bema_run(zero, zero(DPOConfig)(str(work / "b-zero"), **ARGS, zero_stage=3))
    bema = {"engine_world": trainer.engine.world, "plain": plain_bema, "zero": zero_bema}
    trainer.close()
    # TRL's SDPO: its EMA teacher mixed towards the student on both ranks' shards every step.
    from test_trl_experimental import sdpo_run
    from trl.experimental.sdpo import SDPOConfig

    folder = str(work / "sdpo-student")
    if rank == 0:  # transformers saves from the main process only
        tiny_gpt2(
            seed=0, vocab_size=259, n_positions=512, bos_token_id=256, eos_token_id=256,
            pad_token_id=257,
        ).save_pretrained(folder)  # fmt: skip
    torch.distributed.barrier()
    options = dict(GRPO_ARGS, teacher_model_kind="ema")
    _, plain_sdpo = sdpo_run(unwrapped, SDPOConfig(str(work / "s-plain"), **options), folder)
    zero_args = zero(SDPOConfig)(str(work / "s-zero"), **options, zero_stage=3)
    trainer, zero_sdpo = sdpo_run(zero, zero_args, folder)
    sdpo = {"engine_world": trainer.teacher_engine.world, "plain": plain_sdpo, "zero": zero_sdpo}
    trainer.close()
    if rank == 0:
        results["plain"]["grad_norm"] = logged(plain, "grad_norm")
        cases = {"grpo": grpo, "distil": distil, "online_dpo": online, "bema": bema}
        cases["sdpo"] = sdpo
        Path(out).write_text(json.dumps({**results, **cases}))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        from zerotune.dist import shutdown

        shutdown()
