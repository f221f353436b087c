"""ZeroTrainer against the plain HF Trainer: same logged losses at every stage and offload tier,
at world 1 and under torchrun at world 2 (DDP), exact resume, HF folders, argument checks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import start_for
from trainer_cases import COMMON, DS_ZERO3_NVME, dataset, logged, model, plain_run, zero_run

import zerotune
from zerotune.hf import ZeroTrainer, ZeroTrainingArguments

RTOL = 1e-5
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def world2_run(request, tmp_path_factory):
    """The torchrun job of ``test_world2_torchrun_matches_ddp`` (at the end of this file),
    started with the module's first test. Yields it and the JSON file it writes."""
    out = tmp_path_factory.mktemp("world2") / "world2.json"
    job = start_for(
        request,
        "test_world2_torchrun_matches_ddp",
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / "trainer_cases.py"), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    yield job, out
    if job is not None:
        job.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain Trainer's run (world 1): logs, final weights, evaluation."""
    trainer = plain_run(str(tmp_path_factory.mktemp("plain")))
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.evaluate(dataset(16))
    predictions = trainer.predict(dataset(16)).predictions
    return {
        "loss": logged(trainer),
        "grad_norm": logged(trainer, "grad_norm"),
        "lr": logged(trainer, "learning_rate"),
        "weights": weights,
        "eval_loss": metrics["eval_loss"],
        "logits": predictions[0] if isinstance(predictions, tuple) else predictions,
    }


@pytest.mark.parametrize(
    "zero",
    [
        dict(zero_stage=1),
        dict(zero_stage=2),
        dict(zero_stage=3),
        dict(zero_stage=3, offload_param="cpu", offload_optimizer="cpu"),
        dict(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"),
    ],
    ids=["stage1", "stage2", "stage3", "stage3-cpu", "stage3-nvme"],
)
def test_same_losses_as_plain_trainer(reference, tmp_path, zero):
    if "nvme" in zero.values():
        zero = {**zero, "nvme_path": str(tmp_path)}
    trainer = zero_run(str(tmp_path / "out"), **zero)
    assert isinstance(trainer.optimizer, zerotune.ZeroAdamW)
    assert trainer.model_wrapped is trainer.engine  # no DDP or other wrapper
    assert trainer.state.global_step == COMMON["max_steps"]
    assert len(logged(trainer)) == COMMON["max_steps"]
    torch.testing.assert_close(logged(trainer), reference["loss"], rtol=RTOL, atol=0)
    torch.testing.assert_close(
        logged(trainer, "grad_norm"), reference["grad_norm"], rtol=1e-4, atol=0
    )
    assert logged(trainer, "learning_rate") == pytest.approx(reference["lr"], rel=1e-12)
    weights = trainer.engine.full_state_dict()
    assert set(weights) == set(reference["weights"])
    for name, ref in reference["weights"].items():
        torch.testing.assert_close(weights[name], ref, rtol=RTOL, atol=RTOL, msg=name)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=RTOL)
    out = trainer.predict(dataset(16)).predictions
    logits = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(
        torch.as_tensor(logits), torch.as_tensor(reference["logits"]), rtol=1e-4, atol=1e-4
    )
    if zero["zero_stage"] == 3 and zero.get("offload_param") == "nvme":
        assert trainer.memory_summary()["nvme"] > 0
    trainer.close()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_nvme_steps_overlap_backward(max_grad_norm, tmp_path, monkeypatch):
    """With the optimizer state on NVMe the last backward of each step runs inside
    ``optimizer.overlapped()``, and the updates still queued at ``step()`` go on during the
    next forward (I/O made slow here, so that every step has some). Without clipping the
    units are updated as their gradients become final; with clipping (the Trainer's
    default, here at a norm that clips every step) the norm is summed as backward finishes
    each unit and the updates wait for ``step()``. Either way: the same logged losses,
    gradient norms and weights as the plain Trainer with the same ``max_grad_norm``."""
    from zerotune.memory.aio import IOHandle
    from zerotune.optim import zero_adam
    from zerotune.optim.overlap import OverlappedStep

    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    carried = []
    step = zero_adam.ZeroAdamW.step

    def recording(self, *args, **kwargs):
        info = step(self, *args, **kwargs)
        carried.append(self._carry is not None)
        return info

    monkeypatch.setattr(zero_adam.ZeroAdamW, "step", recording)

    plain = plain_run(str(tmp_path / "plain"), max_grad_norm=max_grad_norm)
    if max_grad_norm:
        assert min(logged(plain, "grad_norm")) > max_grad_norm  # every step clips
    (tmp_path / "nvme").mkdir()
    launched = []
    original = OverlappedStep.launch

    def counting(self, unit):
        launched.append(unit.index)
        return original(self, unit)

    OverlappedStep.launch = counting
    try:
        trainer = zero_run(str(tmp_path / "out"), max_grad_norm=max_grad_norm, zero_stage=3,
                           offload_param="nvme", offload_optimizer="nvme",
                           nvme_path=str(tmp_path / "nvme"))  # fmt: skip
    finally:
        OverlappedStep.launch = original
    assert trainer.overlap_step
    assert carried == [True] * COMMON["max_steps"], carried
    # Every step launched units during backward (all but the tied embedding, final last).
    assert len(launched) >= COMMON["max_steps"] * (len(trainer.engine.units) - 3), launched
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    torch.testing.assert_close(logged(trainer, "grad_norm"), logged(plain, "grad_norm"),
                               rtol=1e-4, atol=0)  # fmt: skip
    weights = trainer.engine.full_state_dict()
    for name, ref in plain.model.named_parameters():
        torch.testing.assert_close(weights[name], ref.detach(), rtol=RTOL, atol=RTOL, msg=name)
    trainer.close()


def test_config_and_pretrained_folder_models(reference, tmp_path):
    """A folder (streamed into the shards) trains like the module it was saved from; a config
    is zero-initialized (its own seed-per-unit init, so only its loss is checked)."""
    folder = tmp_path / "hf"
    model().save_pretrained(folder)
    trainer = zero_run(str(tmp_path / "a"), model_source=str(folder))
    torch.testing.assert_close(logged(trainer), reference["loss"], rtol=RTOL, atol=0)
    trainer = zero_run(str(tmp_path / "b"), model_source=model().config)
    losses = logged(trainer)
    assert len(losses) == COMMON["max_steps"] and losses[-1] < losses[0]


def test_resume_from_mid_run_checkpoint(tmp_path):
    """Checkpoints every 2 steps, keeping 2: a new trainer resumed from step 4 logs the
    never-stopped run's losses for steps 5-6; resume_from_checkpoint=True skips a save that
    was cut short."""
    saving = dict(save_strategy="steps", save_steps=2, save_total_limit=2, zero_stage=3)
    full = zero_run(str(tmp_path / "full"), **saving)
    expected = logged(full)
    names = sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*"))
    assert names == ["checkpoint-4", "checkpoint-6"]  # save_total_limit rotated checkpoint-2
    ckpt = tmp_path / "full" / "checkpoint-4"
    assert (ckpt / "zero" / "COMPLETE").is_file() and (ckpt / "trainer_state.json").is_file()
    assert not list(ckpt.rglob("*.pt*")) and not list(ckpt.rglob("*.bin"))  # no pickle

    resumed = zero_run(str(tmp_path / "full"), train=False, **saving)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == COMMON["max_steps"]
    torch.testing.assert_close(logged(resumed)[-2:], expected[-2:], rtol=RTOL, atol=0)

    # A newer checkpoint whose save was cut short (its zerotune files, and so the Trainer's
    # marker written after them, never completed) is skipped.
    from zerotune.hf.trainer import TRAINER_MARKER

    (tmp_path / "full" / "checkpoint-6" / "zero" / "COMPLETE").unlink()
    (tmp_path / "full" / "checkpoint-6" / TRAINER_MARKER).unlink()
    again = zero_run(str(tmp_path / "full"), train=False, **saving)
    again.train(resume_from_checkpoint=True)
    torch.testing.assert_close(logged(again)[-2:], expected[-2:], rtol=RTOL, atol=0)


@pytest.mark.parametrize("save_strategy", ["steps", "best"])
def test_evaluation_during_training_and_best_model(tmp_path, save_strategy):
    """eval_strategy steps with load_best_model_at_end: the engine ends with the weights of
    the best checkpoint (here the first: a larger eval loss is declared better), also when
    the best is the checkpoint just saved (save_strategy best saves only that one)."""
    trainer = zero_run(
        str(tmp_path / "best"),
        zero_stage=3,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy=save_strategy,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    evals = logged(trainer, "eval_loss")
    assert len(evals) == 3 and evals[0] == max(evals)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[0], rel=RTOL)


def test_best_model_of_save_only_model_checkpoints(tmp_path):
    """save_only_model + load_best_model_at_end: the best checkpoint holds an HF folder
    only, and its weights are loaded at the end of training, as the plain Trainer loads
    them (train() used to fail there, after all the training)."""
    from safetensors.torch import load_file

    trainer = zero_run(
        str(tmp_path / "best"),
        zero_stage=3,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_only_model=True,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # the first evaluation is the best
    )
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-2" and not (best / "zero").exists()
    saved = load_file(best / "model.safetensors")
    weights = trainer.engine.full_state_dict()
    assert set(weights) <= set(saved)
    for name, w in weights.items():
        torch.testing.assert_close(w, saved[name], rtol=0, atol=0, msg=name)
    evals = logged(trainer, "eval_loss")
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[0], rel=RTOL)


def test_label_smoothing_and_total_flos_as_plain_trainer(tmp_path):
    """label_smoothing_factor shifts the labels of a causal LM as in the plain Trainer (it
    looks at the unwrapped model's class, which used to be the engine's), and total_flos
    counts the parameters without the embeddings, as transformers does."""
    plain = plain_run(str(tmp_path / "plain"), label_smoothing_factor=0.1, max_steps=3)
    zero = zero_run(str(tmp_path / "zero"), zero_stage=3, label_smoothing_factor=0.1, max_steps=3)
    torch.testing.assert_close(logged(zero), logged(plain), rtol=RTOL, atol=0)
    assert zero.evaluate()["eval_loss"] == pytest.approx(
        plain.evaluate(dataset(16))["eval_loss"], rel=RTOL
    )
    assert zero.state.total_flos == plain.state.total_flos > 0
    zero.close()


def test_save_model_writes_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = zero_run(str(tmp_path / "run"), zero_stage=3, save_strategy="steps", save_steps=3)
    trainer.save_model()  # into the output folder, next to its checkpoints
    out = tmp_path / "run"
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-6").is_dir()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    weights = trainer.engine.full_state_dict()
    for name, p in loaded.named_parameters():
        if name in weights:
            torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
    # save_only_model checkpoints hold an HF folder and refuse to resume.
    only = zero_run(
        str(tmp_path / "only"), save_strategy="steps", save_steps=6, save_only_model=True
    )
    ckpt = tmp_path / "only" / "checkpoint-6"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "zero").exists()
    with pytest.raises(zerotune.CheckpointError, match="no optimizer state"):
        only.train(resume_from_checkpoint=str(ckpt))


@pytest.mark.parametrize("dtype, rtol", [("fp16", 1e-3), ("bf16", 3e-2)])
def test_low_precision_tracks_fp32(reference, tmp_path, dtype, rtol):
    """--fp16 / --bf16 set the engine's dtype (no autocast); fp16 scales the loss through the
    engine's scaler, so the logged gradient norm is the unscaled one."""
    trainer = zero_run(str(tmp_path / dtype), **{dtype: True})
    assert trainer.engine.config.dtype == dtype and trainer.args.mixed_precision == "no"
    if dtype == "fp16":
        assert trainer.engine.scaler.scale == 2.0**16 and not trainer.optimizer.step_was_skipped
    torch.testing.assert_close(logged(trainer), reference["loss"], rtol=rtol, atol=0)
    torch.testing.assert_close(
        logged(trainer, "grad_norm"), reference["grad_norm"], rtol=10 * rtol, atol=0
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(
                deepspeed={"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}},
                deepspeed_scheduler={"type": "WarmupLR"},
            ),
            "--deepspeed has its own scheduler section and --deepspeed_scheduler gives one",
        ),
        (
            dict(
                deepspeed={
                    "zero_optimization": {"stage": 3},
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                },
                deepspeed_optimizer={"type": "SGD", "params": {"lr": "auto"}},
            ),
            "--deepspeed has its own optimizer section and --deepspeed_optimizer gives one",
        ),
        (
            dict(
                deepspeed={
                    "zero_optimization": {"stage": 3},
                    "gradient_clipping": 0.5,
                    "train_micro_batch_size_per_gpu": 4,
                }
            ),
            r"train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size is 8; "
            r"gradient_clipping=0.5 but --max_grad_norm is 1.0",
        ),
        (
            dict(deepspeed={"zero_optimization": {"stage": 3, "overlap_com": True}}),
            "'overlap_com' is not a DeepSpeed setting zerotune knows .did you mean 'overlap_comm'",
        ),
        (
            dict(deepspeed={"zero_optimization": {"stage": 3}}, zero_config={"stage": 3}),
            "--deepspeed and --zero_config both give",
        ),
        (
            dict(deepspeed={"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lamb"}}),
            "optimizer 'Lamb' is DeepSpeed's own and not supported",
        ),
        (
            dict(deepspeed={"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}),
            "zero_quantized_weights .ZeRO.. quantized communication. is not supported",
        ),
        (dict(deepspeed="/no/such/ds_config.json"), "--deepspeed: no such file"),
        (
            dict(
                deepspeed={"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
            ),
            "NVMe offload needs --nvme_path",
        ),
        (dict(fsdp="hybrid_shard"), "--fsdp hybrid_shard .* has no zerotune counterpart"),
        (dict(fsdp="full_shard", zero_stage=2, zero_config={"stage": 3}), "both give the"),
        (dict(offload_param="nvme"), "NVMe offload needs --nvme_path"),
        (dict(zero_config="zero3-offload-nvme"), "NVMe offload needs --nvme_path"),
        (dict(zero_stage=2, offload_param="cpu"), "needs stage 3"),
        (dict(optim="galore_adamw"), "--optim galore_adamw is not supported"),
        (dict(zero_config={"stag": 3}), "did you mean 'stage'"),
        (dict(bf16=True, zero_config={"dtype": "fp16"}), "--bf16 contradicts"),
        (dict(optim="sgd", zero_config={"optim_state_bits": 8}), "--optim sgd contradicts"),
        (
            dict(optim="adamw_8bit", zero_config={"optim_state_bits": 32}),
            "--optim adamw_8bit contradicts optim_state_bits=32",
        ),
        (dict(offload_activations="nvme"), "needs nvme_path"),
    ],
)
def test_arguments_reject_contradictions(kwargs, message):
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", **kwargs)


def test_a_deepspeed_config_trains_like_the_plain_trainer(reference, tmp_path):
    """--deepspeed ds_config.json: its ZeRO section becomes zerotune's config (parameter
    counts become bytes), its "auto" values follow the Trainer's arguments, and the run logs
    the plain Trainer's losses and learning rates."""
    swap = str(tmp_path / "swap")
    config = {k: v for k, v in DS_ZERO3_NVME.items() if k != "optimizer"}
    (tmp_path / "ds_config.json").write_text(json.dumps(config).replace('"SWAP"', json.dumps(swap)))
    trainer = zero_run(str(tmp_path / "out"), deepspeed=str(tmp_path / "ds_config.json"))
    args, z = trainer.args, trainer.args.zero
    assert args.deepspeed is None and args.gather_weights_on_save is True
    assert not args.weight_decay_all  # no optimizer section: the Trainer's decay groups
    assert (z.stage, z.offload_param, z.offload_optimizer, z.nvme_path) == (3, "nvme", "nvme", swap)
    assert (z.max_live_bytes, z.persistence_threshold) == (4 * 10**6, 0)  # 1e6 fp32 parameters
    assert (z.aio_queue_depth, z.aio_threads, z.aio_block_bytes) == (8, 1, 2**20)
    assert z.dtype == "fp32" and z.loss_scale_init == 2.0**16
    assert trainer.memory_summary()["nvme"] > 0
    torch.testing.assert_close(logged(trainer), reference["loss"], rtol=RTOL, atol=0)
    assert logged(trainer, "learning_rate") == pytest.approx(reference["lr"], rel=1e-12)
    trainer.close()


def test_a_deepspeed_optimizer_section_decays_every_parameter(reference, tmp_path):
    """With an optimizer section, transformers hands DeepSpeed every parameter in one group,
    so weight decay reaches biases and norms: the run equals a plain Trainer whose decay
    groups hold every parameter, and differs from the Trainer's own groups."""
    from transformers import Trainer, TrainingArguments

    class DecayAll(Trainer):
        def get_decay_parameter_names(self, model):
            return [n for n, _ in model.named_parameters()]

    args = TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON)
    plain = DecayAll(model=model(), args=args, train_dataset=dataset())
    plain.train()
    ds = {"zero_optimization": {"stage": 3}, "optimizer": DS_ZERO3_NVME["optimizer"],
          "gradient_clipping": "auto"}  # fmt: skip
    trainer = zero_run(str(tmp_path / "out"), deepspeed=ds)
    assert trainer.args.weight_decay_all and COMMON["weight_decay"] > 0
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    weights = trainer.engine.full_state_dict()
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=RTOL, atol=RTOL, msg=name)
    moved = [abs(a - b) for a, b in zip(logged(trainer), reference["loss"])]
    assert max(moved) > 1e-6  # the biases' and norms' decay changed the losses
    trainer.close()


def test_a_deepspeed_train_batch_size_counts_the_ranks():
    """train_batch_size is per-device batch x accumulation x world size: the process's own
    WORLD_SIZE in a rank, the planned one where a launcher checks the job first."""
    from zerotune.hf.deepspeed import planned_world

    ds = {"zero_optimization": {"stage": 3}, "train_batch_size": 32}
    args = dict(output_dir="unused", per_device_train_batch_size=8, gradient_accumulation_steps=2)
    with pytest.raises(zerotune.ConfigError, match="train_batch_size=32 but .* is 16"):
        ZeroTrainingArguments(deepspeed=ds, **args)
    with planned_world(2):
        assert ZeroTrainingArguments(deepspeed=ds, **args).zero.stage == 3
    with planned_world(1), pytest.raises(zerotune.ConfigError, match="is 16"):
        ZeroTrainingArguments(deepspeed=ds, **args)


def test_ddp_find_unused_parameters_sets_the_engines_walk():
    def walk(**kwargs) -> bool:
        return ZeroTrainingArguments(output_dir="unused", **kwargs).zero.find_unused_parameters

    assert walk() is True  # as the Trainer's DDP
    assert walk(ddp_find_unused_parameters=False) is False
    assert walk(ddp_find_unused_parameters=True) is True
    assert walk(zero_config={"find_unused_parameters": False}) is False
    with pytest.raises(zerotune.ConfigError, match="contradicts find_unused_parameters=False"):
        walk(zero_config={"find_unused_parameters": False}, ddp_find_unused_parameters=True)


def test_arguments_through_hf_argument_parser(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses(
        ["--output-dir", str(tmp_path), "--zero-config", "zero3-offload-cpu", "--zero_stage", "3",
         "--prefetch-bytes", "1MiB", "--persistence_threshold", "4096", "--max_steps", "3",
         "--optim", "adamw_8bit", "--offload_activations", "cpu", "--tile_linear_bytes", "2MiB"]
    )  # fmt: skip
    z = args.zero
    assert (z.stage, z.offload_param, z.offload_optimizer) == (3, "cpu", "cpu")
    assert (z.prefetch_bytes, z.persistence_threshold, args.max_steps) == (2**20, 4096, 3)
    assert (z.optim_state_bits, z.offload_activations, z.tile_linear_bytes) == (8, "cpu", 2**21)
    assert args.place_model_on_device is False and args.use_cpu  # no accelerator here


def test_trainer_refuses_what_it_cannot_do(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="ZeroTrainingArguments"):
        ZeroTrainer(model=model(), args=TrainingArguments(output_dir=str(tmp_path)))
    args = ZeroTrainingArguments(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(ValueError, match="not the model's parameters.*optimizer_cls_and_kwargs"):
        ZeroTrainer(model=model(), args=args, optimizers=(torch.optim.SGD([torch.zeros(1)]), None))


def test_first_step_is_checked_against_the_estimate(tmp_path, caplog, monkeypatch):
    import zerotune.hf.trainer as trainer_mod

    calls = []
    real = trainer_mod.check_estimate

    def spy(engine, measured, **kwargs):
        calls.append((dict(measured), kwargs))
        return real(engine, measured, **kwargs)

    monkeypatch.setattr(trainer_mod, "check_estimate", spy)
    import transformers

    transformers.utils.logging.enable_propagation()
    monkeypatch.setattr(transformers.utils.logging, "get_verbosity", lambda: 20)  # INFO
    with caplog.at_level("INFO"):
        trainer = zero_run(
            str(tmp_path / "run"),
            zero_stage=3,
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
        )
    # Once, after the first of six steps, with this run's micro-batch shape (4 rows of 16).
    assert len(calls) == 1
    measured, kwargs = calls[0]
    assert kwargs["seq_len"] == 16 and kwargs["micro_batch"] == 4
    assert measured["nvme"] == trainer.engine.memory_report()["nvme"] > 0
    assert 0 < measured["host"] < 512 * 2**20
    assert trainer.memory_measured == measured
    assert "peak nvme memory: estimated" in caplog.text
    # Swap files are planned exactly: never a warning about NVMe.
    assert not [w for w in trainer.estimate_warnings if "nvme" in w]
    # The Trainer's start-up log counts the parameters of the sharded model, not 0.
    n = sum(p.numel() for p in model().parameters())
    assert f"Number of trainable parameters = {n:,}" in caplog.text
    transformers.utils.logging.disable_propagation()
    trainer.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_default_callbacks_and_parameter_counts_are_the_plain_trainers(tmp_path, stage):
    """Nothing of zerotune's own shows in the Trainer's callbacks (the first step's estimate
    check is an optimizer hook); the trainable count is the plain Trainer's at every stage,
    frozen parameters left out, before and after training."""
    from trainer_cases import COMMON, dataset
    from transformers import Trainer, TrainingArguments

    def frozen_model():
        m = model()
        m.transformer.wpe.weight.requires_grad_(False)
        return m

    plain = Trainer(
        model=frozen_model(),
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON),
        train_dataset=dataset(),
    )
    zero = zero_run(
        str(tmp_path / "zero"), model_source=frozen_model(), train=False, zero_stage=stage
    )
    kinds = [type(cb) for cb in zero.callback_handler.callbacks]
    assert kinds == [type(cb) for cb in plain.callback_handler.callbacks]
    want = plain.get_num_trainable_parameters()
    assert 0 < want < sum(p.numel() for p in plain.model.parameters())
    assert zero.get_num_trainable_parameters() == want
    zero.train()
    assert zero.get_num_trainable_parameters() == want
    assert zero.memory_measured is not None  # the estimate was checked after the first step
    zero.close()


def test_world2_torchrun_matches_ddp(world2_run):
    """The plain Trainer under DDP and ZeroTrainer (stages 1 and 3; stage 2 with NVMe
    optimizer state), each on 2 ranks under torchrun: the same logged losses and gradient
    norms; and TRL's GRPO, distillation, Online DPO, DPO with BEMA and SDPO, plain and at
    stage 3, the same losses, rewards and norms."""
    job, out = world2_run
    proc = job.result(timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    # TRL's GRPO, generating on both ranks: zero(GRPOTrainer) at stage 3 logs the plain one's.
    # And TRL's distillation with the teacher sharded over both ranks.
    # And TRL's Online DPO, its reference a sharded copy of the trained model; BEMA on shards;
    # SDPO with its EMA teacher.
    for trl_case in ("grpo", "distil", "online_dpo", "bema", "sdpo"):
        got = results.pop(trl_case)
        assert got["engine_world"] == 2 and len(got["plain"]["loss"]) == 3
        for key, values in got["plain"].items():
            torch.testing.assert_close(got["zero"][key], values, rtol=1e-5, atol=1e-6, msg=key)
    plain = results.pop("plain")
    assert plain["world"] == 2 and len(plain["loss"]) == COMMON["max_steps"]
    for name, got in results.items():
        assert got["world"] == 2 and got["engine_world"] == 2, name
        torch.testing.assert_close(got["loss"], plain["loss"], rtol=RTOL, atol=0, msg=name)
        torch.testing.assert_close(
            got["grad_norm"], plain["grad_norm"], rtol=1e-4, atol=0, msg=name
        )
