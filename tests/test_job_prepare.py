"""A job checked before anything is written (zerotune.hf.prepare): the zerotune settings from
the flags, a config and a job file; the TrainingArguments over the command's defaults; the
default job prepared whole, and a refused one leaving nothing behind. In process."""

from __future__ import annotations

import json
import re
import tempfile

import pytest

from zerotune.hf.job import JobError, JobFileError, apply_job_file
from zerotune.hf.prepare import (
    DEFAULT_JOB_ARGS,
    DEFAULT_MODEL,
    parse_training_args,
    prepare_job,
    zero_settings,
)

OPTIONS = {  # zerotune finetune's options at their defaults
    "model": None,
    "init": None,
    "tokenizer": None,
    "dataset": None,
    "text_column": None,
    "prompt_column": None,
    "response_column": None,
    "chat_column": None,
    "chat_template": None,
    "train_on_prompt": False,
    "packing": False,
    "block_size": None,
    "eval_split": 0.0,
    "stage": None,
    "offload": None,
    "nvme_path": None,
    "zero_config": None,
    "output_dir": None,
    "job": None,
    "resume": False,
    "overwrite": False,
    "no_memory_check": False,
    "hf_args": (),
}


def _options(**given) -> dict:
    return {**OPTIONS, **given}


def test_zero_settings_flags_over_config_over_defaults(tmp_path):
    # The default job: ZeRO-3 with both tiers on NVMe, in a folder made later.
    assert zero_settings(_options()) == {"zero_stage": 3, "offload_optimizer": "nvme",
                                         "offload_param": "nvme", "nvme_path": None}  # fmt: skip
    # A model of one's own: no offload unless asked; stage 2 offloads no parameters.
    assert zero_settings(_options(model="m")) == {"zero_stage": 3}
    assert zero_settings(_options(model="m", stage="2", offload="cpu")) == {
        "zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none"}  # fmt: skip
    # A config file's stage, under the flag's; the TrainingArguments spelling wins over both.
    config = tmp_path / "z.yaml"
    config.write_text("stage: 1\n")
    assert zero_settings(_options(zero_config=str(config))) == {"zero_stage": 1}
    options = _options(zero_config=str(config), stage="2", hf_args=("--zero_stage", "3"))
    assert zero_settings(options) == {"zero_stage": 3}
    # The default job's tiers give way to the TrainingArguments offload flags.
    options = _options(hf_args=("--offload_param", "cpu", "--offload_optimizer=cpu"))
    assert zero_settings(options) == {"zero_stage": 3}
    refused = {
        "--nvme-path is set but nothing is offloaded to nvme": _options(model="m", nvme_path="x"),
        "impossible zerotune configuration": _options(model="m", stage="2",
                                                      hf_args=("--offload_param", "nvme")),
        "give the zerotune config once": _options(zero_config="zero3",
                                                  hf_args=("--zero_config", str(config))),
    }  # fmt: skip
    for message, options in refused.items():
        with pytest.raises(JobError, match=message):
            zero_settings(options)


def test_a_job_files_zero_section_is_its_config(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("zero: {stage: 2, offload_optimizer: cpu}\n")
    options = _options(model="m", job=str(job))
    assert zero_settings(options) == {"zero_stage": 2}
    assert json.loads(options["zero_config"]) == {"stage": 2, "offload_optimizer": "cpu"}


def test_a_job_file_fills_what_the_command_line_does_not_give(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {name: gpt2, init: random}\n"
        "data: {dataset: data.txt, block_size: 64}\n"
        "zero: {nvme_path: swap}\n"
        "training: {output_dir: out, learning_rate: 1.0e-4, max_steps: 9, bf16: true}\n"
    )
    options = _options(job=str(job), block_size=32, hf_args=("--max_steps", "3"))
    apply_job_file(options, given={"job", "block_size"})
    assert (options["model"], options["init"], options["block_size"]) == ("gpt2", "random", 32)
    assert options["dataset"] == "data.txt"  # no such file beside the job: a name
    assert options["output_dir"] == str(tmp_path / "out")
    assert options["nvme_path"] == str(tmp_path / "swap")
    assert options["hf_args"] == ("--learning_rate", "0.0001", "--bf16", "true",
                                  "--max_steps", "3")  # fmt: skip
    job.write_text("training: {stage: 3}\n")
    with pytest.raises(JobFileError, match="did you mean zero.stage"):
        apply_job_file(_options(job=str(job)), given={"job"})
    assert issubclass(JobFileError, JobError)  # the command's one line, exit code 2


def test_default_job_takes_the_epochs_asked_for():
    """The default job trains 40 steps unless told otherwise: --num_train_epochs is told
    otherwise (its max_steps used to override the epochs silently); --max_steps too."""

    def parsed(*flags):
        options = dict(
            model=None, output_dir="out", zero_config=None, hf_args=flags, eval_split=0.0
        )
        return parse_training_args(options, {}, None)

    assert parsed().max_steps == 40
    epochs = parsed("--num_train_epochs", "1")
    assert epochs.max_steps == -1 and epochs.num_train_epochs == 1
    assert parsed("--max_steps=7").max_steps == 7
    assert parsed("--num_train_epochs=2", "--max_steps", "5").max_steps == 5


def test_training_arguments_over_the_commands_defaults():
    def parsed(*flags, model=None, known=()):
        options = _options(model=model, output_dir="out", hf_args=flags)
        return parse_training_args(options, {"zero_stage": 2}, None, known)

    args = parsed()
    for key, value in DEFAULT_JOB_ARGS.items():
        assert getattr(args, key) == value, key
    assert (args.logging_steps, args.save_total_limit, args.zero.stage) == (5, 2, 2)
    assert parsed(model="m").max_steps == -1  # a model of one's own: the Trainer's default
    assert parsed("--zero_stage", "1").zero.stage == 1  # the flag given wins
    with pytest.raises(JobError, match=re.escape("did you mean --block_size?")):
        parsed("--blok_size", "3", known={"block_size"})
    with pytest.raises(JobError, match=re.escape("did you mean --block-size?")):
        parsed("--blok-size", "3", known={"block_size"})  # in the spelling given
    with pytest.raises(JobError, match=re.escape("fraction in --warmup_steps")):
        parsed("--warmup_ratio", "0.1")
    with pytest.raises(JobError, match="needs held-out data: add --eval-split"):
        parsed("--eval_strategy", "steps")


def test_the_default_job_prepared_and_a_refused_one_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    job = prepare_job(_options(output_dir=str(tmp_path / "out")))
    try:
        assert (job.model_name, job.init, job.block_size) == (DEFAULT_MODEL, "random", 128)
        assert job.tokenizer_kind == "byte-level tokenizer (no tokenizer given)"
        assert job.dataset.endswith("tiny_corpus.txt") and job.columns.text == "text"
        assert job.args.zero.nvme_path == job.temp_nvme and job.args.max_steps == 40
        assert [p.name for p in (tmp_path / "tmp").iterdir()] == [job.temp_nvme.split("/")[-1]]
        assert not (tmp_path / "out").exists()  # nothing written yet
    finally:
        import shutil

        shutil.rmtree(job.temp_nvme)
    with pytest.raises(JobError, match="--block-size 4096 exceeds the model's context length"):
        prepare_job(_options(output_dir=str(tmp_path / "out"), block_size=4096))
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary NVMe folder is gone
    assert not (tmp_path / "out").exists()


def test_the_memory_check_plans_the_least_batch_auto_find_batch_size_can_reach(monkeypatch):
    """gpt2 at 8 x 1024 tokens, fp32, stage 3, needs 30 GiB on a CPU: refused on a 16 GiB
    host; with --auto_find_batch_size the Trainer lowers the batch until it fits, so the
    check plans for one row (5.37 GiB): it passes there and is refused on a 1 GiB host."""
    from transformers import GPT2Config

    from zerotune.hf import ZeroTrainingArguments
    from zerotune.hf.prepare import check_memory

    def check(host: str, auto: bool) -> None:
        monkeypatch.setenv("ZEROTUNE_HOST_MEMORY", host)
        args = ZeroTrainingArguments(
            output_dir="unused", per_device_train_batch_size=8, auto_find_batch_size=auto,
            use_cpu=True, zero_stage=3,
        )  # fmt: skip
        check_memory(GPT2Config(), args, 1024, 1)

    with pytest.raises(JobError, match=r"micro-batch 8 x 1024 tokens: per host: needs 30.00"):
        check("16GiB", auto=False)
    check("16GiB", auto=True)
    with pytest.raises(JobError, match=r"micro-batch 1 x 1024 tokens: per host: needs 5.37"):
        check("1GiB", auto=True)
