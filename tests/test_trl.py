"""TRL's trainers through zerotune.hf.zero(): SFT on chat data, DPO with its reference model
and GRPO generating its completions, at stage 3 without offload and with both tiers on NVMe,
and RLOO, KTO and a reward model at stage 3, log the plain trainers' losses; a Trainer
subclass of the user's own keeps its overrides and callbacks."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_world, tiny_gpt2
from datasets import Dataset
from trainer_cases import COMMON, dataset, logged, model
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from zerotune.hf import ZeroTrainer, ZeroTrainingArguments, zero
from zerotune.hf.data import byte_tokenizer

RTOL = 1e-5
ARGS = dict(
    per_device_train_batch_size=4,
    max_steps=3,
    learning_rate=1e-3,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    seed=0,
    use_cpu=True,
    bf16=False,  # TRL's configs default to bf16; the plain run here is fp32
    max_length=64,
    disable_tqdm=True,
    dataloader_num_workers=0,
)
# A chat template marking the assistant's turns, for TRL's assistant-only loss.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|endoftext|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>"
    "{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ZERO = {
    "stage3": dict(zero_stage=3),
    "stage3-nvme": dict(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"),
    # Compiled blocks (the reference model's too); generation runs them eagerly.
    "stage3-compiled": dict(zero_stage=3, torch_compile=True, torch_compile_backend="aot_eager"),
}


def byte_gpt2():
    # The byte tokenizer's 259 ids; 256 = <|endoftext|>, 257 = <|pad|>.
    return tiny_gpt2(
        seed=0, vocab_size=259, n_positions=64, bos_token_id=256, eos_token_id=256, pad_token_id=257
    )


def chat_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def chats() -> Dataset:
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"count from {i}"},
                    {"role": "assistant", "content": " ".join(str(i + k) for k in range(4))},
                ]
            }
            for i in range(16)
        ]
    )


def preferences() -> Dataset:
    return Dataset.from_list(
        [
            {
                "prompt": f"count from {i}:",
                "chosen": " ".join(str(i + k) for k in range(1, 4)),
                "rejected": " ".join(str(i - k) for k in range(1, 4)),
            }
            for i in range(16)
        ]
    )


def zero_options(tmp_path, zero_name: str) -> dict:
    """The zerotune fields of a ZERO setting, with a swap folder under ``tmp_path``."""
    options = dict(ZERO[zero_name])
    if "nvme" in options.values():
        (tmp_path / "swap").mkdir(exist_ok=True)
        options["nvme_path"] = str(tmp_path / "swap")
    return options


def _zero_args(cls, tmp_path, zero_name: str, **extra):
    options = zero_options(tmp_path, zero_name)
    return zero(cls)(output_dir=str(tmp_path / "zero"), **ARGS, **options, **extra)


SFT = dict(assistant_only_loss=True, gradient_checkpointing=True)


@pytest.fixture(scope="module")
def plain_sft(tmp_path_factory):
    """The plain SFTTrainer's logs, for every ZeRO setting."""
    plain = SFTTrainer(
        model=byte_gpt2(),
        args=SFTConfig(output_dir=str(tmp_path_factory.mktemp("plain")), **ARGS, **SFT),
        train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )
    plain.train()
    return {key: logged(plain, key) for key in ("loss", "mean_token_accuracy")}


@pytest.mark.parametrize("zero_name", list(ZERO))
def test_sft_on_chat_data_logs_the_plain_sft_losses(tmp_path, zero_name, plain_sft):
    """Assistant-only loss and TRL's default gradient checkpointing included."""
    trainer = zero(SFTTrainer)(
        model=byte_gpt2(),
        args=_zero_args(SFTConfig, tmp_path, zero_name, **SFT),
        train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )
    assert isinstance(trainer, ZeroTrainer) and isinstance(trainer, SFTTrainer)
    trainer.train()
    assert len(logged(trainer)) == ARGS["max_steps"]
    torch.testing.assert_close(logged(trainer), plain_sft["loss"], rtol=RTOL, atol=0)
    torch.testing.assert_close(
        logged(trainer, "mean_token_accuracy"), plain_sft["mean_token_accuracy"]
    )
    trainer.close()


def test_sft_with_packing_logs_the_plain_sft_losses(tmp_path):
    """TRL's packing (several conversations a row, told apart by their position ids):
    ZeroTrainer logs the plain SFTTrainer's losses."""
    packed = dict(ARGS, **SFT, packing=True, max_length=128)
    plain = SFTTrainer(
        model=byte_gpt2(),
        args=SFTConfig(output_dir=str(tmp_path / "plain"), **packed),
        train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )
    batch = next(iter(plain.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch  # flattened rows
    plain.train()
    trainer = zero(SFTTrainer)(
        model=byte_gpt2(),
        args=zero(SFTConfig)(output_dir=str(tmp_path / "zero"), **packed, zero_stage=3),
        train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )
    trainer.train()
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    trainer.close()


DPO_LOGGED = ("loss", "rewards/margins", "logps/chosen")


@pytest.fixture(scope="module")
def plain_dpo(tmp_path_factory):
    """The plain DPOTrainer's logs, for every ZeRO setting."""
    plain = DPOTrainer(
        model=byte_gpt2(),
        ref_model=byte_gpt2(),
        args=DPOConfig(output_dir=str(tmp_path_factory.mktemp("plain")), **ARGS),
        train_dataset=preferences(),
        processing_class=byte_tokenizer(),
    )
    plain.train()
    return {key: logged(plain, key) for key in DPO_LOGGED}


@pytest.mark.parametrize("zero_name", list(ZERO))
def test_dpo_shards_its_reference_model_and_logs_the_plain_dpo_losses(
    tmp_path, zero_name, plain_dpo
):
    trainer = zero(DPOTrainer)(
        model=byte_gpt2(),
        ref_model=byte_gpt2(),
        args=_zero_args(DPOConfig, tmp_path, zero_name),
        train_dataset=preferences(),
        processing_class=byte_tokenizer(),
    )
    # The reference model is sharded like the trained one, frozen, with no optimizer.
    ref = trainer.ref_engine
    assert ref is not None and trainer.ref_model is ref.module and ref is not trainer.engine
    assert ref.optimizer is None
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    released = [s.param.numel() for u in ref.units if not u.persistent for s in u.slots]
    assert len(released) > 4 and not any(released)
    if "torch_compile" in ZERO[zero_name]:  # both models' blocks
        assert len(trainer.engine.compiled.modules) == len(ref.compiled.modules) == 2
    trainer.train()
    for key in DPO_LOGGED:
        torch.testing.assert_close(logged(trainer, key), plain_dpo[key], rtol=RTOL, atol=1e-6)
    trainer.close()


def test_zero_makes_each_class_once_and_refuses_others():
    assert zero(SFTTrainer) is zero(SFTTrainer) and zero(ZeroTrainer) is ZeroTrainer
    assert issubclass(zero(SFTConfig), ZeroTrainingArguments)
    assert issubclass(zero(SFTConfig), SFTConfig)
    with pytest.raises(TypeError, match="Trainer or TrainingArguments subclass"):
        zero(dict)


def test_zero_configs_keep_the_trl_defaults():
    """``zero(Config)`` has the values of ``Config`` for every field it shares with it (TRL's
    learning rates, ``bf16`` on, ``remove_unused_columns`` off, KTO's sequential sampling),
    not those of ``TrainingArguments``; its zerotune fields come on top."""
    import trl
    from trl.experimental.online_dpo import OnlineDPOConfig

    configs = [getattr(trl, n) for n in ("SFTConfig", "DPOConfig", "GRPOConfig", "KTOConfig")]
    configs += [trl.RLOOConfig, trl.DistillationConfig, trl.RewardConfig, OnlineDPOConfig]
    for cls in configs:
        plain = cls(output_dir="out", use_cpu=True).to_dict()
        made = zero(cls)(output_dir="out", use_cpu=True, zero_stage=3)
        got = made.to_dict()
        assert {k: got[k] for k in plain} == plain, cls.__name__
        assert made.zero.stage == 3 and str(made.zero.dtype) == "bf16"  # TRL's bf16 default
    assert zero(trl.KTOConfig)(output_dir="out").train_sampling_strategy == "sequential"
    assert zero(trl.GRPOConfig)(output_dir="out").remove_unused_columns is False


class _Doubled(ZeroTrainer):
    """The user's own subclass: a loss of its own, and a callback."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = model(**inputs)
        loss = 2.0 * out["loss"]
        return (loss, out) if return_outputs else loss


class _CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def test_a_users_own_trainer_subclass_keeps_its_loss_and_callbacks(tmp_path):
    from transformers import Trainer, TrainingArguments

    class PlainDoubled(Trainer):
        compute_loss = _Doubled.compute_loss

    short = {**COMMON, "max_steps": 3, "warmup_steps": 0}
    counts = [_CountSteps(), _CountSteps()]
    plain = PlainDoubled(
        model=model(),
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **short),
        train_dataset=dataset(),
        callbacks=[counts[0]],
    )
    plain.train()
    trainer = _Doubled(
        model=model(),
        args=ZeroTrainingArguments(output_dir=str(tmp_path / "zero"), **short, zero_stage=3),
        train_dataset=dataset(),
        callbacks=[counts[1]],
    )
    trainer.train()
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    assert counts[0].steps == counts[1].steps == 3
    trainer.close()


def counted_length(completions, **kwargs) -> list[float]:
    """A reward that varies within a group: how many digits a completion holds."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


# GRPO and RLOO: four completions of at most 8 tokens a prompt (their own length options).
GRPO_ARGS = {
    **{k: v for k, v in ARGS.items() if k != "max_length"},
    "num_generations": 4,
    "max_completion_length": 8,
}
GRPO_LOGGED = ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length")


def unwrapped(cls):
    """The plain class, where the other runs pass ``zero``."""
    return cls


def grpo_run(wrap, args):
    from trl import GRPOTrainer

    tok = byte_tokenizer()
    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(GRPOTrainer)(
        model=byte_gpt2(),
        reward_funcs=counted_length,
        args=args,
        train_dataset=prompts,
        processing_class=tok,
    )
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in GRPO_LOGGED}


@pytest.mark.parametrize("zero_name", list(ZERO))
def test_grpo_generates_and_logs_the_plain_grpo_rewards_and_losses(tmp_path, zero_name):
    """GRPO hands its training step prompts, generates completions with the trained model
    (every token a forward through the engine's gathers) and trains on their rewards."""
    from trl import GRPOConfig

    _, plain = grpo_run(unwrapped, GRPOConfig(output_dir=str(tmp_path / "plain"), **GRPO_ARGS))
    options = zero_options(tmp_path, zero_name)
    args = zero(GRPOConfig)(output_dir=str(tmp_path / "zero"), **GRPO_ARGS, **options)
    trainer, logs = grpo_run(zero, args)
    assert isinstance(trainer, ZeroTrainer)
    assert max(plain["reward_std"]) > 0  # the rewards differ within a group: a gradient
    for key in GRPO_LOGGED:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


def reward_gpt2():
    """A GPT-2 reward model (one score) over the byte tokenizer's ids."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(7)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64, num_labels=1,
        pad_token_id=257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config)


@pytest.mark.parametrize(
    "zero_name, given",
    [
        ("stage3", "module"),
        ("stage3-nvme", "module"),
        ("stage3-nvme", "folder"),
        ("stage3", "by TRL"),
    ],
)
def test_grpo_shards_its_reward_model_and_logs_the_plain_rewards(tmp_path, zero_name, given):
    """A reward model among GRPO's reward functions is sharded and frozen like a reference
    model (TRL would place it whole on the device) and scores as the plain one does; named
    by its folder, it is streamed into the shards (TRL would load it whole); with TRL's own
    loading options, TRL loads it and it is sharded afterwards."""
    from trl import GRPOConfig, GRPOTrainer

    folder = tmp_path / "reward"
    reward_gpt2().save_pretrained(folder)
    grpo = (
        {**GRPO_ARGS, "model_init_kwargs": {"dtype": "float32"}} if given == "by TRL" else GRPO_ARGS
    )

    def run(wrap, args):
        prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
        scorer = reward_gpt2() if given == "module" else str(folder)  # or TRL loads it
        trainer = wrap(GRPOTrainer)(
            model=byte_gpt2(), reward_funcs=[scorer, counted_length], args=args,
            train_dataset=prompts, processing_class=byte_tokenizer(),
            reward_processing_classes=[byte_tokenizer(), None],
        )  # fmt: skip
        trainer.train()
        return trainer, {key: logged(trainer, key) for key in GRPO_LOGGED}

    _, plain = run(unwrapped, GRPOConfig(output_dir=str(tmp_path / "plain"), **grpo))
    options = zero_options(tmp_path, zero_name)
    trainer, logs = run(zero, zero(GRPOConfig)(str(tmp_path / "zero"), **grpo, **options))
    scorer = trainer.reward_funcs[0]
    engine = trainer.companions.engines["reward_funcs[0]"]
    assert scorer is engine.module and engine.optimizer is None
    assert engine.memory_report()["master"] == 0
    assert all(u.state.name == "SHARDED" for u in engine.units if not u.persistent)
    assert trainer.reward_func_names[0] == ("" if given == "module" else "reward")
    assert max(plain["reward_std"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


def test_a_reward_model_named_by_a_causal_lm_folder_gets_a_new_score_head(tmp_path):
    """A causal LM's folder as a reward model: no score head in its checkpoint, so (as TRL
    does) transformers builds one; the model is sharded and frozen, its other weights the
    checkpoint's."""
    from transformers import AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    folder = tmp_path / "lm"
    byte_gpt2().save_pretrained(folder)
    args = zero(GRPOConfig)(str(tmp_path / "zero"), **{**GRPO_ARGS, "max_steps": 1}, zero_stage=3)
    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(4)]})
    trainer = zero(GRPOTrainer)(
        model=byte_gpt2(), reward_funcs=str(folder), args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(), reward_processing_classes=byte_tokenizer(),
    )  # fmt: skip
    engine = trainer.companions.engines["reward_funcs[0]"]
    expected = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    with engine.gathered():
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert got.keys() == dict(expected.named_parameters()).keys()
    for name, p in expected.named_parameters():
        if name != "score.weight":  # drawn at random, as TRL's is
            assert torch.equal(got[name], p.detach()), name
    head = got["score.weight"]
    assert head.shape == (1, 32) and 0.01 < head.std().item() < 0.03  # initializer_range 0.02
    trainer.train()
    assert len(logged(trainer, "reward")) == 1
    trainer.close()


def generate_per_rank(rank, world):
    """Rank r asks for 2 + 3r new tokens: the ranks finish at different steps."""
    import zerotune

    plain = byte_gpt2().eval()
    engine = zerotune.shard(byte_gpt2().eval(), {"stage": 3})
    prompt = torch.tensor([[ord(c) for c in f"count from {rank}:"]])
    new = 2 + 3 * rank
    with torch.no_grad():
        expected = plain.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
        got = engine.module.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
    engine.close()
    return got.tolist(), expected.tolist()


def test_generate_at_world_2_runs_the_ranks_together_until_all_are_done():
    """At stage 3 every forward gathers units with collectives: transformers' generate keeps
    the rank that finished first running forwards (``synced_gpus``, as for FSDP) until the
    other is done, instead of leaving it waiting in a gather alone."""
    results = run_world(2, generate_per_rank, timeout=120)
    for rank, (got, expected) in enumerate(results):
        assert got == expected
        assert len(got[0]) == len(f"count from {rank}:") + 2 + 3 * rank


def teacher_gpt2():
    """A teacher of the byte GPT-2's vocabulary, other weights, one layer more."""
    return tiny_gpt2(
        seed=5, layers=3, vocab_size=259, n_positions=64, bos_token_id=256, eos_token_id=256,
        pad_token_id=257,
    )  # fmt: skip


DISTIL_ARGS = {k: v for k, v in GRPO_ARGS.items() if k != "num_generations"}


def distil_run(wrap, args):
    """TRL's DistillationTrainer: completions sampled from the student, scored against the
    teacher's distributions (its logits computed from its head's weight, chunk by chunk)."""
    from trl import DistillationTrainer

    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(DistillationTrainer)(
        model=byte_gpt2(), teacher_model=teacher_gpt2(), args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in ("loss", "grad_norm", "entropy")}


@pytest.mark.parametrize("zero_name", ["stage3", "stage3-nvme"])
def test_distillation_shards_its_teacher_and_logs_the_plain_losses(tmp_path, zero_name):
    """The teacher is sharded like the student, frozen, before the trainer places it on the
    device; its head's unit stays gathered (TRL reads that weight outside the teacher's
    forward), the other units are released between forwards."""
    from trl import DistillationConfig

    args = DistillationConfig(output_dir=str(tmp_path / "plain"), **DISTIL_ARGS)
    _, plain = distil_run(unwrapped, args)
    options = zero_options(tmp_path, zero_name)
    args = zero(DistillationConfig)(output_dir=str(tmp_path / "zero"), **DISTIL_ARGS, **options)
    trainer, logs = distil_run(zero, args)
    teacher = trainer.teacher_engine
    assert teacher is not None and trainer.teacher_model is teacher.module
    assert teacher.optimizer is None and len(teacher.units) == 7  # root, wte, wpe, 3 blocks, head
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    kept = [u.name for u in teacher.units if u.state.name == "GATHERED" and not u.persistent]
    released = [u for u in teacher.units if u.state.name == "SHARDED"]
    assert kept == ["transformer.wte"] and len(released) == 5  # the head's weight is tied to wte
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()
    assert all(u.state.name == "SHARDED" for u in teacher.units if not u.persistent)


def trl_run(which: str, wrap, out: str, **options) -> dict[str, list[float]]:
    """RLOO (generating), KTO (with its reference model) or a reward model, for ``wrap``:
    ``zero`` or the plain classes."""
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from trl import KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer

    tok = byte_tokenizer()
    if which == "rloo":
        args = wrap(RLOOConfig)(output_dir=out, **GRPO_ARGS, beta=0.0, **options)
        prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
        trainer = wrap(RLOOTrainer)(
            model=byte_gpt2(), reward_funcs=counted_length, args=args, train_dataset=prompts,
            processing_class=tok,
        )  # fmt: skip
    elif which == "kto":
        # Its default loss pairs each example with its neighbours: sequential batches.
        args = wrap(KTOConfig)(
            output_dir=out, **ARGS, train_sampling_strategy="sequential",
            **options,
        )  # fmt: skip
        rows = [
            {"prompt": f"count from {i}:", "completion": " ".join(str(i + k) for k in range(1, 4)),
             "label": i % 2 == 0}
            for i in range(16)
        ]  # fmt: skip
        trainer = wrap(KTOTrainer)(
            model=byte_gpt2(), ref_model=byte_gpt2(), args=args,
            train_dataset=Dataset.from_list(rows), processing_class=tok,
        )  # fmt: skip
    else:
        args = wrap(RewardConfig)(output_dir=out, **ARGS, **options)
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64, num_labels=1,
            pad_token_id=257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        rows = [
            {"chosen": f"count from {i}: " + " ".join(str(i + k) for k in range(1, 4)),
             "rejected": f"count from {i}: " + " ".join(str(i - k) for k in range(1, 4))}
            for i in range(16)
        ]  # fmt: skip
        trainer = wrap(RewardTrainer)(
            model=GPT2ForSequenceClassification(config), args=args,
            train_dataset=Dataset.from_list(rows), processing_class=tok,
        )  # fmt: skip
    trainer.train()
    logs = {key: logged(trainer, key) for key in ("loss", "grad_norm")}
    if options:
        trainer.close()
    return logs


@pytest.mark.parametrize("which", ["rloo", "kto", "reward"])
def test_rloo_kto_and_reward_trainers_log_the_plain_losses(tmp_path, which):
    plain = trl_run(which, unwrapped, str(tmp_path / "plain"))
    logs = trl_run(which, zero, str(tmp_path / "zero"), zero_stage=3)
    assert len(logs["loss"]) == 3 and max(logs["grad_norm"]) > 0
    for key, values in plain.items():
        torch.testing.assert_close(logs[key], values, rtol=RTOL, atol=1e-6, msg=key)


def mix_per_rank(rank, world, config):
    """The reference's shards mixed with the trained model's, against the mix of the whole
    parameters; ``config`` may keep small units gathered (persistent)."""
    import zerotune
    from zerotune.hf.companions import mix_into_reference

    trained, ref = tiny_gpt2(seed=1), tiny_gpt2(seed=2)
    expected = {
        name: 0.75 * r.detach() + 0.25 * t.detach()
        for (name, r), t in zip(ref.named_parameters(), trained.parameters())
    }
    engine, ref_engine = zerotune.shard(trained, config), zerotune.shard(ref, config)
    mix_into_reference(engine, ref_engine, alpha=0.25)
    with ref_engine.gathered():
        got = {name: p.detach().clone() for name, p in ref_engine.module.named_parameters()}
    persistent = sum(u.persistent for u in ref_engine.units)
    other = zerotune.shard(tiny_gpt2(seed=3, layers=1), config)
    with pytest.raises(ValueError, match="not sharded like the trained model"):
        mix_into_reference(engine, other, alpha=0.25)
    for e in (engine, ref_engine, other):
        e.close()
    return {n: float((got[n] - expected[n]).abs().max()) for n in expected}, persistent


@pytest.mark.parametrize(
    "world,config",
    [(1, {"stage": 3}), (2, {"stage": 3}), (2, {"stage": 3, "persistence_threshold": 4096})],
)
def test_reference_shards_mix_like_whole_parameters(world, config):
    for errors, persistent in run_world(world, mix_per_rank, config):
        assert max(errors.values()) < 1e-6, errors
        # The threshold keeps more than the root's unit gathered.
        assert (persistent > 1) == ("persistence_threshold" in config), persistent


SYNC = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)


def synced_run(which: str, wrap, out: str, folder, **options):
    """GRPO with a KL term (its reference model built from the model's folder) or DPO, the
    reference model mixed with the trained one after every step."""
    from trl import GRPOConfig, GRPOTrainer

    if which == "grpo":
        args = wrap(GRPOConfig)(output_dir=out, **GRPO_ARGS, **SYNC, **options)
        prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
        trainer = wrap(GRPOTrainer)(
            model=str(folder), reward_funcs=counted_length, args=args,
            train_dataset=prompts, processing_class=byte_tokenizer(),
        )  # fmt: skip
        keys = (*GRPO_LOGGED, "kl")
    else:
        args = wrap(DPOConfig)(output_dir=out, **ARGS, **SYNC, **options)
        trainer = wrap(DPOTrainer)(
            model=byte_gpt2(), ref_model=byte_gpt2(), args=args, train_dataset=preferences(),
            processing_class=byte_tokenizer(),
        )  # fmt: skip
        keys = DPO_LOGGED
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in keys}


@pytest.mark.parametrize(
    "which,zero_name", [("grpo", "stage3"), ("grpo", "stage3-nvme"), ("dpo", "stage3")]
)
def test_sync_ref_model_mixes_the_reference_like_the_plain_trainer(tmp_path, which, zero_name):
    """TRL's SyncRefModelCallback would mix the empty placeholders of the sharded parameters
    (nothing): ZeroTrainer's mixes the shards, and the reference ends where the plain one
    does."""
    folder = tmp_path / "model"
    byte_gpt2().save_pretrained(folder)
    plain, plain_logs = synced_run(which, unwrapped, str(tmp_path / "plain"), folder)
    options = zero_options(tmp_path, zero_name)
    trainer, logs = synced_run(which, zero, str(tmp_path / "zero"), folder, **options)
    for key in plain_logs:
        torch.testing.assert_close(logs[key], plain_logs[key], rtol=RTOL, atol=1e-6, msg=key)
    with trainer.ref_engine.gathered():
        ref = {n: p.detach().clone() for n, p in trainer.ref_engine.module.named_parameters()}
    start = dict(byte_gpt2().named_parameters())
    moved = 0.0
    for name, p in plain.ref_model.named_parameters():
        torch.testing.assert_close(ref[name], p.detach(), rtol=1e-5, atol=2e-5, msg=name)
        moved = max(moved, float((p.detach() - start[name].detach()).abs().max()))
    assert moved > 1e-4  # the plain reference moved well past the tolerance: a real mix
    trainer.close()


def swap_files(folder) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def test_a_teacher_folder_is_streamed_into_shards_and_let_go_when_replaced(tmp_path):
    """A teacher named by its folder is loaded straight into frozen shards (its parameters
    on NVMe, no fp32 master); a teacher sharded elsewhere is used as it is, its head held;
    replacing a teacher closes the engine built for it; TRL's sync callback mixes shards,
    one that mixes in its own way is refused."""
    from trl import DistillationConfig, DistillationTrainer
    from trl.trainer.callbacks import SyncRefModelCallback

    import zerotune
    from zerotune.hf.companions import mix_shards

    folder, swap = tmp_path / "teacher", tmp_path / "swap"
    teacher_gpt2().save_pretrained(folder)
    swap.mkdir()
    args = zero(DistillationConfig)(
        output_dir=str(tmp_path / "out"), **DISTIL_ARGS, zero_stage=3, offload_param="nvme",
        offload_optimizer="nvme", nvme_path=str(swap),
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(4)]})
    trainer = zero(DistillationTrainer)(
        model=byte_gpt2(), teacher_model=str(folder), args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(),
    )  # fmt: skip
    built = trainer.teacher_engine
    assert built is not None and trainer.teacher_model is built.module
    assert built.memory_report()["master"] == 0 and built.memory_report()["params"] == 0
    assert not any(p.requires_grad for p in built.module.parameters())
    expected = dict(teacher_gpt2().named_parameters())
    with built.gathered():
        for name, p in built.module.named_parameters():
            assert torch.equal(p, expected[name].detach()), name
    files = swap_files(swap)

    other = zerotune.shard(teacher_gpt2(), {"stage": 3})
    trainer.teacher_model = other.module
    assert trainer.teacher_engine is other and swap_files(swap) < files  # the built one closed
    head = [u for u in other.units if u.state.name == "GATHERED" and not u.persistent]
    assert [u.name for u in head] == ["transformer.wte"]
    trainer.teacher_model = None
    assert trainer.teacher_engine is None and head[0].state.name == "SHARDED"

    class OwnMix(SyncRefModelCallback):
        @staticmethod
        def sync_target_model(model, target_model, alpha):
            pass

    with pytest.raises(ValueError, match="OwnMix mixes the reference model in its own"):
        trainer.add_callback(OwnMix(None, None))
    sync = SyncRefModelCallback(None, None)
    trainer.add_callback(sync)
    assert sync.sync_target_model is mix_shards
    assert trainer.pop_callback(SyncRefModelCallback) is sync
    trainer.close()
    other.close()


@pytest.mark.parametrize("rows", [259, 320])
def test_sft_cloning_a_chat_template_logs_the_plain_sft_losses(tmp_path, rows):
    """TRL's chat_template_path naming a tokenizer folder resizes the embedding to a
    multiple of 64 rows ([Note: resizing a sharded model's embeddings]): from the byte
    tokenizer's 259 the sharded model grows to 320 as the plain one does, new rows and all;
    with 320 already it keeps them."""
    chat_tokenizer().save_pretrained(tmp_path / "source")
    extra = dict(chat_template_path=str(tmp_path / "source"), **SFT)

    def gpt2():
        return tiny_gpt2(seed=0, vocab_size=rows, n_positions=64, bos_token_id=256,
                         eos_token_id=256, pad_token_id=257)  # fmt: skip

    plain = SFTTrainer(
        model=gpt2(),
        args=SFTConfig(output_dir=str(tmp_path / "plain"), **ARGS, **extra),
        train_dataset=chats(),
        processing_class=byte_tokenizer(),
    )
    plain.train()
    trainer = zero(SFTTrainer)(
        model=gpt2(),
        args=_zero_args(SFTConfig, tmp_path, "stage3-nvme", **extra),
        train_dataset=chats(),
        processing_class=byte_tokenizer(),
    )
    assert trainer.model.vocab_size == 320 and len(trainer.processing_class.vocab) == 320
    assert trainer.num_parameters == plain.model.num_parameters()
    trainer.train()
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=RTOL, atol=0)
    trainer.close()
