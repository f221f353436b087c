"""What DeepSpeed users bring beyond the ZeRO section (tests/test_trainer.py has that): a
scheduler section, checked against DeepSpeed's own schedule classes (a plain Trainer stepping
``deepspeed.runtime.lr_schedules`` as DeepSpeed's engine steps them under transformers logs
the learning rates and losses ZeroTrainer logs with the section), and the DeepSpeed config
``accelerate launch`` hands its processes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_cases import COMMON, DS_ZERO3_NVME, dataset, logged, model, plain_run, zero_run

import zerotune
from zerotune.hf import ZeroTrainingArguments

RTOL = 1e-5
# ZeRO-3; the Trainer's clipping (DeepSpeed would clip at 1.0 without the key).
DS_BASE = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
# What transformers fills in for "auto" (its DeepSpeed integration), for this run.
AUTO = {
    "warmup_min_lr": 0,
    "warmup_max_lr": COMMON["learning_rate"],
    "total_num_steps": COMMON["max_steps"],
    "warmup_num_steps": COMMON["warmup_steps"],
}


def deepspeed_reference(tmp_path, kind: str, params: dict, decay_all: bool):
    """The plain Trainer with DeepSpeed's schedule over its optimizer, built (and so setting
    the first learning rate) as DeepSpeed's engine builds it; ``decay_all``: weight decay on
    every parameter, as with a DeepSpeed optimizer section."""
    from deepspeed.runtime import lr_schedules
    from transformers import Trainer, TrainingArguments

    class Plain(Trainer):
        def get_decay_parameter_names(self, model):
            if decay_all:
                return [n for n, _ in model.named_parameters()]
            return super().get_decay_parameter_names(model)

    args = TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON)
    plain = Plain(model=model(), args=args, train_dataset=dataset())
    plain.create_optimizer()
    resolved = {k: AUTO[k] if v == "auto" else v for k, v in params.items()}
    plain.lr_scheduler = getattr(lr_schedules, kind)(plain.optimizer, **resolved)
    if kind == "OneCycle":  # the rate its constructor set, logged as ZeroTrainer logs it
        plain.lr_scheduler._last_lr = [g["lr"] for g in plain.optimizer.param_groups]
    plain.train()
    return plain


CASES = {
    # As transformers' DeepSpeed docs write the section: log warmup from 0, the first two
    # updates at learning rate 0.
    "warmup-auto": ("WarmupLR", {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                 "warmup_num_steps": "auto"}),
    "warmup-linear": ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_num_steps": 2,
                                   "warmup_type": "linear"}),
    "decay": ("WarmupDecayLR", {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                "warmup_max_lr": "auto", "warmup_num_steps": "auto"}),
    "cosine": ("WarmupCosineLR", {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                  "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    # Up for 2 steps, down for 1, then decaying; Adam's betas cycle (beta2 0.99).
    "onecycle": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3,
                              "cycle_first_step_size": 2, "cycle_second_step_size": 1,
                              "decay_step_size": 1, "decay_lr_rate": 0.5,
                              "decay_mom_rate": 0.02, "cycle_min_mom": 0.85}),
    "onecycle-stairs": ("OneCycle", {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": 2e-3,
                                     "cycle_first_step_size": 4, "cycle_first_stair_count": 2,
                                     "cycle_momentum": False}),
    "range-test": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2,
                                   "lr_range_test_step_rate": 0.5,
                                   "lr_range_test_staircase": True}),
}  # fmt: skip
FIRST_LR = {"warmup-linear": 1e-4, "onecycle": 1e-4, "onecycle-stairs": 1e-4, "range-test": 1e-4}


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_schedules_step_as_deepspeed_does(tmp_path, case):
    kind, params = CASES[case]
    docs = case == "warmup-auto"  # the whole docs config: both tiers on NVMe, AdamW section
    plain = deepspeed_reference(tmp_path, kind, params, decay_all=docs)
    ds = {**DS_BASE, "scheduler": {"type": kind, "params": params}}
    if docs:
        ds = {**DS_ZERO3_NVME, "scheduler": ds["scheduler"]}
        swap = str(tmp_path / "swap")
        ds = json.loads(json.dumps(ds).replace('"SWAP"', json.dumps(swap)))
    trainer = zero_run(str(tmp_path / "out"), deepspeed=ds)
    lrs = logged(trainer, "learning_rate")
    assert lrs == logged(plain, "learning_rate")  # exactly: the same float operations
    assert len(set(lrs)) >= 2 and lrs[0] == FIRST_LR.get(case, 0.0)
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    weights = trainer.engine.full_state_dict()
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=RTOL, atol=RTOL, msg=name)
    trainer.close()


@pytest.mark.parametrize("case", ["decay", "onecycle"])
def test_a_deepspeed_schedule_resumes(tmp_path, case):
    """The schedule's state goes into zerotune's checkpoint (JSON): resumed at step 3, the
    run logs the uninterrupted run's learning rates and losses (OneCycle's betas too)."""
    kind, params = CASES[case]
    ds = {**DS_BASE, "scheduler": {"type": kind, "params": params}}
    saving = dict(save_strategy="steps", save_steps=3, deepspeed=ds)
    full = zero_run(str(tmp_path / "full"), **saving)
    state = json.loads((tmp_path / "full/checkpoint-3/zero/manifest.json").read_text())
    assert state["scheduler"]["last_epoch"] == 3 and state["scheduler"]["kind"] == kind
    resumed = zero_run(str(tmp_path / "full"), train=False, **saving)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full/checkpoint-3"))
    assert logged(resumed, "learning_rate")[-3:] == logged(full, "learning_rate")[-3:]
    torch.testing.assert_close(logged(resumed)[-3:], logged(full)[-3:], rtol=RTOL, atol=0)
    full.close()
    resumed.close()


def test_deepspeed_scheduler_without_a_config_file(tmp_path):
    """--deepspeed_scheduler takes the section alone (JSON), checked the same way."""
    section = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 4}}
    args = ZeroTrainingArguments(output_dir="unused", deepspeed_scheduler=json.dumps(section))
    assert args.deepspeed_scheduler == {
        "type": "WarmupLR",
        "params": {"warmup_max_lr": args.learning_rate, "warmup_num_steps": 4},
    }


@pytest.mark.parametrize(
    "section, message",
    [
        ({"type": "OneCycleLR"}, "scheduler type 'OneCycleLR' is not supported"),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}},
            "OneCycle needs scheduler.params.cycle_max_lr",
        ),
        (
            {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_momentum": "yes"},
            },
            "cycle_momentum must be true or false",
        ),
        (
            {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0},
            },
            "cycle_first_step_size must be positive",
        ),
        (
            {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2.5}},
            "lr_range_test_step_size must be an integer of at least 1",
        ),
        (
            {"type": "LRRangeTest", "params": {"lr_range_test_step_rate": [1, 2]}},
            "lr_range_test_step_rate must be one number",
        ),
        ({"type": "WarmupDecayLR"}, "WarmupDecayLR needs scheduler.params.total_num_steps"),
        (
            {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}},
            "warmup_max_lr=0.1 but --learning_rate is 0.002",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
            'warmup_type must be "log" or "linear"',
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_min_lr": 0}},
            "'warmup_min_lr' is not a DeepSpeed setting zerotune knows .did you mean "
            "'warmup_min_ratio'",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
            'warmup_num_steps must be a positive integer or "auto", got 0',
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "cos_min_ratio": "auto"}},
            "cos_min_ratio must be a number",
        ),
    ],
)
def test_deepspeed_scheduler_refusals(section, message):
    ds = {**DS_BASE, "scheduler": section}
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed=ds)


def test_a_one_cycle_momentum_past_one_is_refused_before_training(tmp_path):
    """DeepSpeed would hand Adam a beta1 of 1.08 at the last step; refused when the
    schedule is built, before the first step."""
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 2,
              "decay_step_size": 1, "decay_mom_rate": 0.2}  # fmt: skip
    section = {"type": "OneCycle", "params": params}
    trainer = zero_run(str(tmp_path), train=False, deepspeed={**DS_BASE, "scheduler": section})
    with pytest.raises(zerotune.ConfigError, match=r"momentum \(Adam's beta1\) leaves \[0, 1\)"):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer.close()


def test_deepspeed_step_counts_must_match_the_run(tmp_path):
    """A given warmup_num_steps or total_num_steps must be the run's (transformers checks
    it the same way): with --max_steps when the arguments are read, else when the schedule
    is built, before any step."""
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 3}}
    with pytest.raises(
        zerotune.ConfigError,
        match="total_num_steps=5 but the run has 6; scheduler.params.warmup_num_steps=3 but "
        "the run has 2",
    ):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed_scheduler=section)
    by_epochs = dict(max_steps=-1, num_train_epochs=1, deepspeed_scheduler=section)
    trainer = zero_run(str(tmp_path / "out"), train=False, **by_epochs)
    # Named by the flag that gave the section (this one, not a --deepspeed config).
    with pytest.raises(
        zerotune.ConfigError,
        match="^--deepspeed_scheduler: scheduler.params.total_num_steps=5 but the run has 8",
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer.close()


@pytest.fixture
def launched(monkeypatch):
    """The environment accelerate launch gives its processes for a DeepSpeed config (set by
    the test), read afresh."""
    from zerotune.hf import deepspeed

    monkeypatch.setattr(deepspeed, "_LAUNCHED", [])
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    return monkeypatch


def test_accelerate_launch_with_deepspeed_trains_on_the_engine(launched, tmp_path):
    """accelerate launch's DeepSpeed settings (stage, offload, accumulation) become the
    zerotune config: neither the Trainer nor accelerate starts DeepSpeed (which crashed in
    the first backward), and the run logs the plain Trainer's losses."""
    launched.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    launched.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    launched.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    trainer = zero_run(str(tmp_path / "out"))
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ and not trainer.is_deepspeed_enabled
    zero = trainer.args.zero
    assert (zero.stage, zero.offload_optimizer, zero.offload_param) == (3, "cpu", "none")
    plain = plain_run(str(tmp_path / "plain"))
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    trainer.close()
    # Arguments built again in the process read the same config; given ones win.
    again = ZeroTrainingArguments(output_dir="unused", **COMMON)
    assert again.zero.offload_optimizer == "cpu"
    given = ZeroTrainingArguments(output_dir="unused", **COMMON, zero_config={"stage": 2})
    assert (given.zero.stage, given.zero.offload_optimizer) == (2, "none")


def test_accelerate_launch_with_a_deepspeed_config_file(launched, tmp_path):
    ds = tmp_path / "ds_config.json"
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"stage": 3, "offload_param": offload}
    ds.write_text(json.dumps({"zero_optimization": zero, "scheduler": {"type": "WarmupLR"},
                              "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto"}))  # fmt: skip
    launched.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    args = ZeroTrainingArguments(output_dir="unused", **COMMON)
    assert (args.zero.offload_param, args.zero.nvme_path) == ("nvme", str(tmp_path))
    assert args.deepspeed_scheduler == {"type": "WarmupLR", "params": {}}


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
            "accelerate launch's DeepSpeed config: the config contradicts the Trainer's "
            "arguments: gradient_accumulation_steps=4 but --gradient_accumulation_steps is 2",
        ),
        (
            {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "/no/such/ds.json"},
            "accelerate launch's DeepSpeed config: Expected a string path to an existing",
        ),
    ],
)
def test_accelerate_launch_refusals(launched, env, message):
    for key, value in env.items():
        launched.setenv(key, value)
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", **COMMON)


@pytest.mark.parametrize("weights", [False, True])
def test_resuming_a_deepspeed_checkpoint_says_what_to_do(tmp_path, weights):
    """A checkpoint the Trainer saved under DeepSpeed (its ZeRO state in pickle files) is not
    resumed; the message says to train on from its weights."""
    from zerotune.hf.checkpoints import check_resumable

    ckpt = tmp_path / "checkpoint-6"
    (ckpt / "global_step6").mkdir(parents=True)
    (ckpt / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (ckpt / "latest").write_text("global_step6")
    (ckpt / "trainer_state.json").write_text("{}")
    if weights:  # stage3_gather_16bit_weights_on_model_save
        (ckpt / "model.safetensors").write_bytes(b"x")
    source = "its model.safetensors" if weights else "what DeepSpeed's zero_to_fp32.py writes"
    with pytest.raises(zerotune.CheckpointError, match=f"is a DeepSpeed checkpoint: .*{source}"):
        check_resumable(ckpt)


def test_deepspeed_spellings_of_the_same_settings():
    """DeepSpeed reads ZeRO-3 keys with or without their stage3_ prefix, its old bfloat16
    section and cpu_offload_param; comment keys are skipped (axolotl's and LLaVA's configs
    write them so)."""
    ds = {
        "_comment": "zero3 with offload",
        "bfloat16": {"enabled": "auto"},
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3, "cpu_offload_param": True, "prefetch_bucket_size": 100,
            "max_live_parameters": 1000, "param_persistence_threshold": 10,
            "gather_16bit_weights_on_model_save": True, "max_reuse_distance": 0,
            "allgather_sequential": False, "compute_grad_norm": True,
        },
    }  # fmt: skip
    args = ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed=ds)
    zero = args.zero
    assert (zero.offload_param, zero.prefetch_bytes, zero.max_live_bytes) == ("cpu", 400, 4000)
    assert zero.persistence_threshold == 40 and args.gather_weights_on_save is True
    both = {"zero_optimization": {"stage": 3, "max_live_parameters": 1,
                                  "stage3_max_live_parameters": 1}}  # fmt: skip
    with pytest.raises(zerotune.ConfigError, match="max_live_parameters and stage3_max_live"):
        ZeroTrainingArguments(output_dir="unused", deepspeed=both)
    # DeepSpeed's tightest bound on live parameters is zerotune's "no bound": left out.
    tight = {"zero_optimization": {"stage": "3", "stage3_max_live_parameters": 0}}  # "3" is 3
    assert ZeroTrainingArguments(output_dir="unused", deepspeed=tight).zero.max_live_bytes == 0


def test_deepspeed_sections_switched_off_and_what_deepspeed_ignores():
    ds = {
        **DS_BASE, "torch_autocast": {"enabled": False}, "tensor_parallel": {"autotp_size": 1},
        "amp": {"enabled": "auto", "opt_level": "auto"}, "gradient_allreduce_op": "mean",
        "dataloader_drop_last": True, "cuda_visible_devices": "0",
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu", "ratio": 0.3}},
        "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}},
    }  # fmt: skip
    args = ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed=ds)
    # Stages 1-2 keep the parameters on the device: DeepSpeed ignores offload_param there.
    assert (args.zero.stage, args.zero.offload_param, args.zero.offload_optimizer) == (
        2, "none", "cpu")  # fmt: skip
    assert args.weight_decay_all  # "AdamW" is AdamW for DeepSpeed whatever adam_w_mode says


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"gradient_clipping": None},
            r"no gradient_clipping \(DeepSpeed then clips at 1.0\) "
            r"but --max_grad_norm is 0.5",
        ),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast .autocast over fp32"),
        ({"tensor_parallel": {"autotp_size": 2}}, "AutoTP tensor parallelism"),
        ({"compile": {"deepcompile": True}}, "compile section is not supported; --torch_compile"),
        ({"amp": {"enabled": True}}, "Apex AMP"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op='sum' is not supported"),
        ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}}, "bf16 master"),
        ({"bf16": {"enabled": "auto"}, "bfloat16": {"enabled": "auto"}}, "both given"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "Adam with adam_w"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": "0.9,0.95"}}}, "two numbers"),
    ],
)
def test_deepspeed_refusals_name_what_is_refused(extra, message):
    ds = {k: v for k, v in {**DS_BASE, **extra}.items() if v is not None}
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed=ds)


@pytest.mark.parametrize("consecutive", [False, True])
def test_the_deepspeed_loss_scale_rule_is_deepspeeds(consecutive, monkeypatch):
    """zerotune's scaler under a DeepSpeed config's rule moves its scale exactly as
    DeepSpeed's own DynamicLossScaler does, over the same overflows (hysteresis 2, a
    window of 3 good steps, a floor)."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16 import loss_scaler

    from zerotune.optim.scaling import DynamicLossScaler

    monkeypatch.setattr(loss_scaler, "dist", SimpleNamespace(get_rank=lambda: 0))  # its log
    ours = DynamicLossScaler(2.0**8, 3, 4.0, "deepspeed", 2, consecutive)
    theirs = loss_scaler.DynamicLossScaler(
        init_scale=2.0**8, scale_window=3, min_scale=4.0, delayed_shift=2,
        consecutive_hysteresis=consecutive, raise_error_at_min_scale=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    overflows = (torch.rand(300, generator=g) < 0.3).tolist()
    scales = []
    for overflow in overflows:
        ours.update(overflow)
        theirs.update_scale(overflow)
        scales.append(ours.scale)
        assert ours.scale == theirs.cur_scale
    assert len(set(scales)) > 5 and min(scales) == 4.0  # it moved, down to the floor
    torch_rule = DynamicLossScaler(2.0**8, 3, 4.0)  # the plain Trainer's rule differs
    assert [torch_rule.update(o) or torch_rule.scale for o in overflows] != scales


def test_a_deepspeed_fp16_section_sets_the_scaler(tmp_path):
    fp16 = {"enabled": "auto", "hysteresis": 3, "loss_scale_window": 50,
            "consecutive_hysteresis": True, "initial_scale_power": 12}  # fmt: skip
    ds = {**DS_BASE, "fp16": fp16}
    trainer = zero_run(str(tmp_path / "out"), train=False, fp16=True, deepspeed=ds)
    scaler = trainer.engine.scaler
    assert (scaler.rule, scaler.hysteresis, scaler.consecutive_hysteresis) == ("deepspeed", 3, True)
    assert (scaler.window, scaler.scale) == (50, 2.0**12)
    trainer.close()


def test_accelerate_launch_mixed_precision_is_the_dtype(launched, tmp_path):
    """accelerate launch --mixed_precision bf16 (the config's mixed_precision): training in
    bf16 (--bf16) unless a flag says otherwise; with a DeepSpeed config too, whose bf16
    section accelerate then turns on."""
    launched.delenv("ACCELERATE_USE_DEEPSPEED")
    launched.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert ZeroTrainingArguments(output_dir="unused").zero.dtype == "bf16"
    launched.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    launched.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args = ZeroTrainingArguments(output_dir="unused")
    assert (args.bf16, args.zero.dtype, args.zero.stage) == (True, "bf16", 3)
    launched.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(zerotune.ConfigError, match="mixed_precision fp8 is not supported"):
        ZeroTrainingArguments(output_dir="unused")


def test_a_parallelism_config_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    with pytest.raises(zerotune.ConfigError, match="a parallelism config .* cannot be combined"):
        ZeroTrainingArguments(output_dir="unused")


TORCH_OPTIMIZERS = {
    # DeepSpeed builds a type it does not run itself from torch.optim by its name.
    "sgd": ("SGD", {"lr": "auto", "momentum": 0.9, "nesterov": True, "weight_decay": "auto"},
            torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adagrad-nvme": ("adagrad", {"lr": "auto", "eps": "auto", "weight_decay": "auto",
                                 "lr_decay": 0.01}, torch.optim.Adagrad, {"lr_decay": 0.01}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TORCH_OPTIMIZERS))
def test_a_torch_optimizer_section_trains_as_the_plain_trainer_with_it(tmp_path, case):
    """Every parameter in one group (weight decay on biases and norms too), "auto" values
    from the Trainer's arguments, the class's own keys passed on."""
    from transformers import Trainer, TrainingArguments

    kind, params, cls, extra = TORCH_OPTIMIZERS[case]

    class Plain(Trainer):
        def get_decay_parameter_names(self, model):
            return [n for n, _ in model.named_parameters()]

    kwargs = {"lr": COMMON["learning_rate"], **extra}
    if cls is torch.optim.Adagrad:
        kwargs["eps"] = 1e-8  # --adam_epsilon, for "auto"
    plain = Plain(model=model(), args=TrainingArguments(output_dir=str(tmp_path / "p"), **COMMON),
                  train_dataset=dataset(), optimizer_cls_and_kwargs=(cls, kwargs))  # fmt: skip
    plain.train()
    ds = {**DS_BASE, "optimizer": {"type": kind, "params": params}}
    if case.endswith("nvme"):
        nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
        ds["zero_optimization"] = {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}
    trainer = zero_run(str(tmp_path / "out"), deepspeed=ds)
    assert trainer.args.weight_decay_all
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    weights = trainer.engine.full_state_dict()
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=RTOL, atol=RTOL, msg=name)
    trainer.close()


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"type": "Lamb"}, "optimizer 'Lamb' is DeepSpeed's own and not supported"),
        ({"type": "sgd"}, "optimizer 'sgd' is neither Adam/AdamW nor a torch.optim class"),
        (
            {"type": "SGD", "params": {"momentun": 0.9}},
            "'momentun' is not a DeepSpeed setting zerotune knows .did you mean 'momentum'",
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1}},
            "optimizer.params.lr=0.1 but --learning_rate is 0.002",
        ),
        (
            {"type": "SGD", "params": {"lr": "auto"}},
            r"optimizer.params.weight_decay \(absent: 0\)=0 but --weight_decay is 0.1",
        ),
    ],
)
def test_optimizer_section_refusals(optimizer, message):
    ds = {**DS_BASE, "optimizer": optimizer}
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed=ds)


def test_deepspeed_optimizer_without_a_config_file():
    args = ZeroTrainingArguments(
        output_dir="unused", **COMMON,
        deepspeed_optimizer='{"type": "SGD", "params": {"lr": "auto", "weight_decay": "auto"}}',
    )  # fmt: skip
    assert args.deepspeed_optimizer == {"type": "SGD", "params": {"lr": 2e-3, "weight_decay": 0.1}}
    assert args.weight_decay_all
    with pytest.raises(zerotune.ConfigError, match="--deepspeed_optimizer: not JSON"):
        ZeroTrainingArguments(output_dir="unused", deepspeed_optimizer="{SGD")
    # A section given alone: its refusals name the flag given, not --deepspeed.
    sgd = {"type": "SGD", "params": {"lr": 1.0}}
    with pytest.raises(zerotune.ConfigError, match=r"^--deepspeed_optimizer: optimizer.params"):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed_optimizer=sgd)
    section = {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}
    with pytest.raises(zerotune.ConfigError, match=r"^--deepspeed_scheduler: scheduler.params"):
        ZeroTrainingArguments(output_dir="unused", **COMMON, deepspeed_scheduler=section)
