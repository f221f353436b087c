"""TRL's experimental trainers through zerotune.hf.zero: GKD (a teacher, generation with the
student or the teacher), SDPO (a self-distillation teacher that is the student, a frozen
copy of it, or an EMA of it synced every step), Online DPO (a reference deep-copied from
the trained model), CPO (data mapped with a method of the trainer), BEMA, ORPO and TPO (no
second model), GOLD and IW-OPD (a teacher), GMPO (a reference with a KL term), A2PO (a
reference deep-copied from the trained model) and SDFT (teachers as SDPO's). Each is run
plainly and through ``zero`` at stage 3 with the same seed; their logs must agree."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from conftest import run_world, tiny_gpt2
from datasets import Dataset
from test_trl import (
    ARGS,
    DISTIL_ARGS,
    GRPO_ARGS,
    RTOL,
    ZERO,
    byte_gpt2,
    chat_tokenizer,
    chats,
    counted_length,
    preferences,
    teacher_gpt2,
    unwrapped,
    zero_options,
)
from trainer_cases import logged

from zerotune.hf import zero
from zerotune.hf.data import byte_tokenizer

LOGGED = ("loss", "grad_norm")


def gkd_run(wrap, args, generated: list[int]):
    """GKD with half its steps on-policy (completions sampled from the student) and the rest
    sequence-level (sampled from the teacher); ``generated`` gets the layer count of the
    model that sampled each step's completions."""
    from trl.experimental.gkd import GKDTrainer

    class Counted(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):
            generated.append(model.config.n_layer)
            return GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)

    random.seed(0)  # GKD draws on-policy steps from Python's random: 0.84, 0.76, 0.42
    trainer = wrap(Counted)(
        model=byte_gpt2(), teacher_model=teacher_gpt2(), args=args, train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in LOGGED}


@pytest.mark.parametrize("zero_name", ["stage3", "stage3-nvme"])
def test_gkd_shards_its_teacher_and_logs_the_plain_losses(tmp_path, zero_name):
    """The teacher is sharded and frozen; it samples the sequence-level steps' completions
    (gathered once per generate call) and scores every step."""
    from trl.experimental.gkd import GKDConfig

    gkd = dict(ARGS, lmbda=0.5, seq_kd=True, max_new_tokens=8)
    plain_sampled, zero_sampled = [], []
    args = GKDConfig(output_dir=str(tmp_path / "plain"), **gkd)
    _, plain = gkd_run(unwrapped, args, plain_sampled)
    options = zero_options(tmp_path, zero_name)
    args = zero(GKDConfig)(output_dir=str(tmp_path / "zero"), **gkd, **options)
    trainer, logs = gkd_run(zero, args, zero_sampled)
    assert plain_sampled == zero_sampled == [3, 3, 2]  # teacher, teacher, student
    teacher = trainer.teacher_engine
    assert teacher is not None and trainer.teacher_model is teacher.module
    assert teacher.optimizer is None and teacher.memory_report()["master"] == 0
    assert type(teacher.module.__dict__["generate"]).__name__ == "GatheredGenerate"
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


@pytest.fixture(scope="module")
def student_folder(tmp_path_factory):
    """SDPO builds its frozen and EMA teachers from the student's folder; its re-prompts
    need more positions than byte_gpt2 has."""
    folder = tmp_path_factory.mktemp("sdpo") / "student"
    tiny_gpt2(
        seed=0, vocab_size=259, n_positions=512, bos_token_id=256, eos_token_id=256,
        pad_token_id=257,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def sdpo_run(wrap, args, folder):
    from trl.experimental.sdpo import SDPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(SDPOTrainer)(
        model=folder, reward_funcs=counted_length, args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in LOGGED}


def teacher_weights(trainer) -> dict[str, torch.Tensor]:
    engine = getattr(trainer, "teacher_engine", None)  # None: the plain trainer's teacher
    if engine is None:
        return {n: p.detach().clone() for n, p in trainer.teacher_model.named_parameters()}
    with engine.gathered():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize(
    "kind, zero_name",
    [("live", "stage3"), ("base", "stage3"), ("ema", "stage3"), ("ema", "stage3-nvme")],
)
def test_sdpo_teachers_log_the_plain_losses(tmp_path, student_folder, kind, zero_name):
    """``live``: the teacher is the trained model itself, not a second engine; ``base``: a
    frozen sharded copy; ``ema``: a sharded copy that TRL's SyncTeacherModelCallback (a
    subclass of the reference sync) mixes towards the student every step, on the shards."""
    from trl.experimental.sdpo import SDPOConfig

    sdpo = dict(GRPO_ARGS, teacher_model_kind=kind)
    args = SDPOConfig(output_dir=str(tmp_path / "plain"), **sdpo)
    plain_trainer, plain = sdpo_run(unwrapped, args, student_folder)
    options = zero_options(tmp_path, zero_name)
    args = zero(SDPOConfig)(output_dir=str(tmp_path / "zero"), **sdpo, **options)
    trainer, logs = sdpo_run(zero, args, student_folder)
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    check_teacher(trainer, plain_trainer, kind)
    trainer.close()


def check_teacher(trainer, plain_trainer, kind: str) -> None:
    """A self-distillation teacher: the student itself (``live``), or sharded and frozen,
    its weights where the plain teacher's end (unmoved for ``base``, moved for ``ema``)."""
    if kind == "live":
        assert trainer.teacher_model is trainer.model and trainer.teacher_engine is None
        return
    assert trainer.teacher_engine.optimizer is None
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    expected = teacher_weights(plain_trainer)
    got = teacher_weights(trainer)
    start = dict(tiny_gpt2(seed=0, vocab_size=259, n_positions=512).named_parameters())
    moved = max((expected[n] - start[n]).abs().max().item() for n in expected)
    assert moved > 1e-4 if kind == "ema" else moved == 0.0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=1e-6)


def online_dpo_run(wrap, args):
    """Online DPO without a reference model: TRL makes one with ``copy.deepcopy``."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(OnlineDPOTrainer)(
        model=byte_gpt2(), ref_model=None, reward_funcs=counted_length, args=args,
        train_dataset=prompts, processing_class=byte_tokenizer(),
    )  # fmt: skip
    trainer.train()
    keys = (*LOGGED, "objective/scores", "objective/kl")
    return trainer, {key: logged(trainer, key) for key in keys}


@pytest.mark.parametrize("zero_name", ["stage3", "stage3-nvme"])
def test_online_dpo_copies_its_reference_from_the_sharded_model(tmp_path, zero_name):
    """TRL deep-copies the trained model for its reference; the copy becomes a frozen
    sharded model with the trained model's first weights (copy_sharded), and the logs
    (KL against the reference included) are plain Online DPO's. Its config keeps TRL's
    remove_unused_columns=False, or the prompts would be dropped."""
    from trl.experimental.online_dpo import OnlineDPOConfig

    options = dict(ARGS, max_new_tokens=8)
    args = OnlineDPOConfig(output_dir=str(tmp_path / "plain"), **options)
    _, plain = online_dpo_run(unwrapped, args)
    zero_args = zero(OnlineDPOConfig)(
        output_dir=str(tmp_path / "zero"), **options, **zero_options(tmp_path, zero_name)
    )
    trainer, logs = online_dpo_run(zero, zero_args)
    ref = trainer.ref_engine
    assert ref is not None and trainer.ref_model is ref.module and ref is not trainer.engine
    assert ref.optimizer is None and ref.memory_report()["master"] == 0
    assert max(abs(v) for v in plain["objective/kl"]) > 1e-3  # the reference matters
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


def test_cpo_maps_its_data_with_a_bound_method_of_the_trainer(tmp_path):
    """CPO tokenizes with ``dataset.map(self.tokenize_row)``: datasets pickles the trainer,
    and with it the engine, to fingerprint the call. Units refuse pickling, so datasets
    uses a random fingerprint (it read freed storage before: a crash with parameters on
    NVMe); the losses are plain CPO's."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    def run(wrap, args):
        trainer = wrap(CPOTrainer)(
            model=byte_gpt2(), args=args, train_dataset=preferences(),
            processing_class=byte_tokenizer(),
        )  # fmt: skip
        trainer.train()
        return {key: logged(trainer, key) for key in (*LOGGED, "rewards/margins")}

    plain = run(unwrapped, CPOConfig(output_dir=str(tmp_path / "plain"), **ARGS))
    options = zero_options(tmp_path, "stage3-nvme")
    logs = run(zero, zero(CPOConfig)(output_dir=str(tmp_path / "zero"), **ARGS, **options))
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)


def bema_run(wrap, args):
    """DPO whose reference model TRL's BEMA callback moves every step."""
    from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    bema = BEMACallback(
        update_freq=1, update_after=1, update_ref_model=True, ref_model_update_freq=1,
        ref_model_update_after=0,
    )  # fmt: skip
    trainer = wrap(DPOTrainer)(
        model=byte_gpt2(), ref_model=byte_gpt2(), args=args, train_dataset=preferences(),
        processing_class=byte_tokenizer(), callbacks=[bema],
    )  # fmt: skip
    trainer.train()
    logs = {key: logged(trainer, key) for key in (*LOGGED, "rewards/margins", "logps/chosen")}
    return trainer, logs


BEMA = {"stage2": dict(zero_stage=2), **{k: ZERO[k] for k in ("stage3", "stage3-nvme")}}


@pytest.mark.parametrize("zero_name", list(BEMA))
def test_bema_over_shards_logs_and_saves_what_trl_does(tmp_path, zero_name):
    """TRL's BEMA callback (theta_0 and an EMA of the weights, a running model saved at the
    end, the reference overwritten from it every step): at stage 2 TRL's own, at stage 3 on
    the shards ([Note: BEMA over shards]); the same logs and the same saved BEMA weights."""
    from safetensors.torch import load_file
    from trl import DPOConfig

    plain_trainer, plain = bema_run(unwrapped, DPOConfig(str(tmp_path / "plain"), **ARGS))
    options = {**BEMA[zero_name]}
    if "nvme" in options.values():
        (tmp_path / "swap").mkdir()
        options["nvme_path"] = str(tmp_path / "swap")
    trainer, logs = bema_run(zero, zero(DPOConfig)(str(tmp_path / "zero"), **ARGS, **options))
    assert max(abs(m) for m in plain["rewards/margins"]) > 1e-4  # not a trivial run
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    expected = load_file(tmp_path / "plain" / "bema" / "model.safetensors")
    got = load_file(tmp_path / "zero" / "bema" / "model.safetensors")
    assert got.keys() == expected.keys()
    start = {n: p.detach() for n, p in byte_gpt2().named_parameters()}
    assert max(float((v - start[k]).abs().max()) for k, v in expected.items()) > 1e-4
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=1e-6, msg=name)
    trainer.close()


def triples() -> Dataset:
    """Preference rows with TPO's third, gold ``reference`` completion."""
    rows = preferences().to_list()
    return Dataset.from_list([dict(row, reference=row["chosen"] + " done") for row in rows])


@pytest.mark.parametrize("which, zero_name", [("orpo", "stage3"), ("tpo", "stage3-nvme")])
def test_orpo_and_tpo_log_the_plain_losses(tmp_path, which, zero_name):
    """ORPO (the odds ratio of chosen to rejected) and TPO (a gold reference completion
    besides the pair): preference losses with no second model; the logs are plain TRL's."""
    if which == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer

        rows = preferences
    else:
        from trl.experimental.tpo import TPOConfig as Config
        from trl.experimental.tpo import TPOTrainer as Trainer

        rows = triples

    def run(wrap, args):
        trainer = wrap(Trainer)(
            model=byte_gpt2(), args=args, train_dataset=rows(), processing_class=byte_tokenizer()
        )
        trainer.train()
        return trainer, {key: logged(trainer, key) for key in (*LOGGED, "rewards/margins")}

    _, plain = run(unwrapped, Config(output_dir=str(tmp_path / "plain"), **ARGS))
    options = zero_options(tmp_path, zero_name)
    trainer, logs = run(zero, zero(Config)(output_dir=str(tmp_path / "zero"), **ARGS, **options))
    assert len(plain["loss"]) == 3 and min(plain["grad_norm"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


GOLD = dict(ARGS, lmbda=0.5, seq_kd=True, max_completion_length=8)


def gold_run(wrap, args):
    from trl.experimental.gold import GOLDTrainer

    random.seed(0)
    trainer = wrap(GOLDTrainer)(
        model=byte_gpt2(), teacher_model=teacher_gpt2(), args=args, train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in LOGGED}


def test_gold_shards_its_teacher_and_logs_the_plain_losses(tmp_path):
    """GOLD (GKD's successor, on-policy steps drawn from Python's random): the teacher is
    sharded and frozen and scores every step; the logs are plain GOLD's."""
    from trl.experimental.gold import GOLDConfig

    _, plain = gold_run(unwrapped, GOLDConfig(output_dir=str(tmp_path / "plain"), **GOLD))
    options = zero_options(tmp_path, "stage3-nvme")
    trainer, logs = gold_run(zero, zero(GOLDConfig)(str(tmp_path / "zero"), **GOLD, **options))
    teacher = trainer.teacher_engine
    assert teacher is not None and trainer.teacher_model is teacher.module
    assert teacher.optimizer is None and teacher.memory_report()["master"] == 0
    assert min(plain["grad_norm"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


GMPO = dict(GRPO_ARGS, beta=0.1)


def gmpo_run(wrap, args, folder):
    """GMPO of the model saved in ``folder``, which TRL loads its reference from too."""
    from trl.experimental.gmpo import GMPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(GMPOTrainer)(
        model=str(folder), reward_funcs=counted_length, args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(),
    )  # fmt: skip
    trainer.train()
    keys = (*LOGGED, "reward", "reward_std", "entropy", "kl")
    return trainer, {key: logged(trainer, key) for key in keys}


def test_gmpo_with_a_kl_term_shards_its_reference_and_logs_the_plain_values(tmp_path):
    """GMPO (GRPO with the geometric mean of the token ratios) generating its completions,
    with a KL term: the reference TRL builds from the model's folder is sharded."""
    from trl.experimental.gmpo import GMPOConfig

    folder = tmp_path / "model"
    byte_gpt2().save_pretrained(folder)
    _, plain = gmpo_run(unwrapped, GMPOConfig(output_dir=str(tmp_path / "plain"), **GMPO), folder)
    options = zero_options(tmp_path, "stage3")
    args = zero(GMPOConfig)(str(tmp_path / "zero"), **GMPO, **options)
    trainer, logs = gmpo_run(zero, args, folder)
    ref = trainer.ref_engine
    assert ref is not None and trainer.ref_model is ref.module and ref is not trainer.engine
    assert ref.optimizer is None
    assert max(plain["reward_std"]) > 0 and max(plain["kl"]) > 1e-4  # the reference matters
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


A2PO = dict(DISTIL_ARGS, num_value_samples=2, filter_all_incorrect=False)


def a2po_run(wrap, args):
    from trl.experimental.a2po import A2POTrainer

    prompts = Dataset.from_dict({"prompt": [f"count from {i}:" for i in range(16)]})
    trainer = wrap(A2POTrainer)(
        model=byte_gpt2(), reward_funcs=counted_length, args=args, train_dataset=prompts,
        processing_class=byte_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in (*LOGGED, "reward", "v_star")}


def test_a2po_shards_the_reference_it_copies_and_logs_the_plain_values(tmp_path):
    """A*-PO deep-copies the trained model for its reference, which samples completions for
    the optimal values before training and scores every step; the copy is sharded."""
    from trl.experimental.a2po import A2POConfig

    _, plain = a2po_run(unwrapped, A2POConfig(output_dir=str(tmp_path / "plain"), **A2PO))
    options = zero_options(tmp_path, "stage3-nvme")
    trainer, logs = a2po_run(zero, zero(A2POConfig)(str(tmp_path / "zero"), **A2PO, **options))
    ref = trainer.ref_engine
    assert ref is not None and trainer.ref_model is ref.module and ref is not trainer.engine
    assert ref.optimizer is None and ref.memory_report()["master"] == 0
    assert max(plain["v_star"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


IW_OPD = dict(ARGS, lmbda=1.0, max_completion_length=8)


def teacher_folder(tmp_path) -> str:
    """The teacher and its tokenizer saved in a folder, as IW-OPD reads them."""
    folder = tmp_path / "teacher"
    teacher_gpt2().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return str(folder)


def iw_opd_run(wrap, args, folder):
    from trl.experimental.iw_opd import IWOPDTrainer

    random.seed(0)
    trainer = wrap(IWOPDTrainer)(
        model=byte_gpt2(), teacher_model=folder, args=args, train_dataset=chats(),
        processing_class=chat_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in LOGGED}


def test_iw_opd_streams_its_teacher_folder_into_shards_and_logs_the_plain_losses(tmp_path):
    """IW-OPD (on-policy distillation, lmbda=1.0) reads the teacher's tokenizer from the
    teacher's folder; named by that folder, the teacher is streamed into frozen shards."""
    from trl.experimental.iw_opd import IWOPDConfig

    folder = teacher_folder(tmp_path)
    args = IWOPDConfig(output_dir=str(tmp_path / "plain"), **IW_OPD)
    _, plain = iw_opd_run(unwrapped, args, folder)
    options = zero_options(tmp_path, "stage3")
    args = zero(IWOPDConfig)(str(tmp_path / "zero"), **IW_OPD, **options)
    trainer, logs = iw_opd_run(zero, args, folder)
    teacher = trainer.teacher_engine
    assert teacher is not None and trainer.teacher_model is teacher.module
    assert teacher.optimizer is None and teacher.memory_report()["master"] == 0
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    assert min(plain["grad_norm"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    trainer.close()


def sdft_run(wrap, args, folder):
    from trl.experimental.sdft import SDFTTrainer

    rows = Dataset.from_dict(
        {
            "prompt": [f"count from {i}:" for i in range(16)],
            "privileged_context": [" ".join(str(i + k) for k in range(1, 4)) for i in range(16)],
        }
    )
    trainer = wrap(SDFTTrainer)(
        model=folder, args=args, train_dataset=rows, processing_class=byte_tokenizer()
    )
    trainer.train()
    return trainer, {key: logged(trainer, key) for key in LOGGED}


@pytest.mark.parametrize(
    "kind, zero_name", [("live", "stage3"), ("base", "stage3"), ("ema", "stage3-nvme")]
)
def test_sdft_teachers_log_the_plain_losses(tmp_path, student_folder, kind, zero_name):
    """SDFT's teacher sees the privileged context: the student itself (``live``), a frozen
    copy rebuilt from the student's folder (``base``) or an EMA of the student (``ema``),
    both sharded; the teacher's weights end where the plain one's do."""
    from trl.experimental.sdft import SDFTConfig

    sdft = dict(GRPO_ARGS, teacher_model_kind=kind)
    args = SDFTConfig(output_dir=str(tmp_path / "plain"), **sdft)
    plain_trainer, plain = sdft_run(unwrapped, args, student_folder)
    options = zero_options(tmp_path, zero_name)
    args = zero(SDFTConfig)(output_dir=str(tmp_path / "zero"), **sdft, **options)
    trainer, logs = sdft_run(zero, args, student_folder)
    assert min(plain["grad_norm"]) > 0
    for key in plain:
        torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
    check_teacher(trainer, plain_trainer, kind)
    trainer.close()


def world2_case(which: str, folder: str):
    """A trainer's config class, options and ``run(wrap, args)``; ``folder``: IW-OPD's
    teacher or GMPO's model."""
    if which == "gkd":
        from trl.experimental.gkd import GKDConfig

        options = dict(ARGS, lmbda=0.5, seq_kd=True, max_new_tokens=8)
        return GKDConfig, options, lambda wrap, args: gkd_run(wrap, args, [])
    if which == "iw_opd":
        from trl.experimental.iw_opd import IWOPDConfig

        return IWOPDConfig, IW_OPD, lambda wrap, args: iw_opd_run(wrap, args, folder)
    from trl.experimental.gmpo import GMPOConfig

    return GMPOConfig, GMPO, lambda wrap, args: gmpo_run(wrap, args, folder)


def world2_run(rank, world, which: str, tmp: str, folder: str):
    """One rank: the plain trainer under DDP, then through ``zero`` at stage 3 with both
    tiers on NVMe; both logs, whether the plain model was DDP's, the engines' worlds."""
    from accelerate.state import AcceleratorState
    from torch.nn.parallel import DistributedDataParallel

    ids = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in ids.items()})  # as torchrun sets them
    config, options, run = world2_case(which, folder)
    try:
        plain, plain_logs = run(unwrapped, config(output_dir=f"{tmp}/plain", **options))
        ddp = isinstance(plain.model_wrapped, DistributedDataParallel)
        extra = zero_options(Path(tmp), "stage3-nvme")
        trainer, logs = run(zero, zero(config)(output_dir=f"{tmp}/zero", **options, **extra))
        worlds = [e.world for e in (trainer.engine, *trainer.companions.engines.values())]
        trainer.close()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the pool's next task
    return plain_logs, logs, ddp, worlds


@pytest.mark.parametrize("which", ["gkd", "iw_opd", "gmpo"])
def test_world2_shards_the_second_model_and_logs_what_ddp_logs(tmp_path, which):
    """At world size 2: GKD (a teacher module; completions sampled by the teacher and by
    the student), IW-OPD (a teacher streamed from its folder) and GMPO (its model streamed
    from a folder, the reference TRL loads from it, a KL term) through ``zero`` log what
    plain TRL logs under DDP on the same ranks, the second model sharded over both."""
    if which == "gmpo":
        folder = str(tmp_path / "model")
        byte_gpt2().save_pretrained(folder)
    else:
        folder = teacher_folder(tmp_path)
    for plain, logs, ddp, worlds in run_world(2, world2_run, which, str(tmp_path), folder):
        assert ddp and worlds == [2, 2], worlds
        assert min(plain["grad_norm"]) > 0
        assert max(plain.get("kl", [1.0])) > 1e-4  # GMPO's reference matters
        for key in plain:
            torch.testing.assert_close(logs[key], plain[key], rtol=RTOL, atol=1e-6, msg=key)
