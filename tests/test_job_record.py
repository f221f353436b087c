"""A run's output folder (zerotune.hf.record): the job record that --resume continues from,
the refusals of a resume that would train another job, and what an earlier run left there.
In process, no training: the CLI tests run the same policy end to end."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerotune.hf.job import JobError
from zerotune.hf.record import (
    JOB_RECORD,
    RECORDED,
    ZERO_OPTIONS,
    adopt_recorded_job,
    check_output_dir,
    check_recorded_arguments,
    check_resume,
    clear_output_dir,
    is_inside,
    is_run_output,
    job_record,
    read_job_record,
    write_job_record,
)


def _options(out: Path, **given) -> dict:
    """zerotune finetune's options at their defaults, ``given`` over them."""
    options = {key: None for key in RECORDED}
    options.update(train_on_prompt=False, eval_split=0.0, resume=False, overwrite=False)
    options.update(output_dir=str(out), zero_config=None, hf_args=())
    options.update(given)
    return options


def _args(dtype="fp32", resume_from_checkpoint=None):
    return SimpleNamespace(zero=SimpleNamespace(dtype=dtype),
                           resume_from_checkpoint=resume_from_checkpoint)  # fmt: skip


def _started(tmp_path, monkeypatch) -> tuple[Path, dict]:
    """The record of a run started from ``tmp_path`` with a relative dataset path, bf16 and
    Trainer flags, written into its output folder."""
    data = tmp_path / "data.txt"
    data.write_text("some text\n")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    hf_args = ("--output_dir", str(out), "--bf16", "--learning_rate", "1e-3",
               "--per_device_train_batch_size=2", "--gradient_accumulation_steps", "2")  # fmt: skip
    options = _options(out, dataset="data.txt", block_size=32, model="tiny-gpt2",
                       init="random", hf_args=hf_args)  # fmt: skip
    write_job_record(out, job_record(options, _args("bf16")))
    return out, options


def test_the_record_round_trip(tmp_path, monkeypatch):
    """What a run records: its model and data options (a local path made absolute), its
    dtype, and the Trainer flags a resume takes over (not the output folder, not the
    dtype flags); written whole, read back the same."""
    out, _ = _started(tmp_path, monkeypatch)
    record = read_job_record(out)
    expected = {key: None for key in (*RECORDED, *ZERO_OPTIONS, "seed")}
    expected.update(model="tiny-gpt2", init="random", dataset=str(tmp_path / "data.txt"),
                    block_size=32, train_on_prompt=False, eval_split=0.0, dtype="bf16",
                    trainer_args=["--learning_rate", "1e-3", "--per_device_train_batch_size=2",
                                  "--gradient_accumulation_steps", "2"])  # fmt: skip
    assert record == expected
    assert json.loads((out / JOB_RECORD).read_text()) == expected
    assert sorted(p.name for p in out.iterdir()) == [JOB_RECORD]  # no partial file left
    assert read_job_record(tmp_path / "elsewhere") is None  # no record: nothing to compare


def test_a_resume_takes_over_what_it_is_not_given(tmp_path, monkeypatch):
    out, _ = _started(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path.parent)  # a resume from another folder
    options = _options(out, resume=True, hf_args=("--max_steps", "9", "--learning_rate", "5e-4"))
    adopt_recorded_job(options, given={"output_dir", "resume"})
    assert options["dataset"] == str(tmp_path / "data.txt") and options["block_size"] == 32
    assert (options["model"], options["init"]) == ("tiny-gpt2", "random")
    # The flags given win; the run's others follow them, and its dtype as a flag.
    assert options["hf_args"] == ("--max_steps", "9", "--learning_rate", "5e-4",
                                  "--per_device_train_batch_size=2",
                                  "--gradient_accumulation_steps", "2", "--bf16")  # fmt: skip
    # A config file given decides the dtype itself (compared once parsed).
    options = _options(out, resume=True, zero_config="zero3")
    adopt_recorded_job(options, given={"output_dir", "resume", "zero_config"})
    assert "--bf16" not in options["hf_args"]
    # The same value given again is no difference (a relative path as the absolute one).
    monkeypatch.chdir(tmp_path)
    options = _options(out, resume=True, dataset="data.txt", block_size=32)
    adopt_recorded_job(options, given={"output_dir", "resume", "dataset", "block_size"})
    assert options["dataset"] == "data.txt"


def test_a_resume_that_would_train_another_job_is_refused(tmp_path, monkeypatch):
    out, _ = _started(tmp_path, monkeypatch)
    options = _options(out, resume=True, block_size=16, tokenizer="gpt2")
    with pytest.raises(JobError) as refused:
        adopt_recorded_job(options, given={"output_dir", "resume", "block_size", "tokenizer"})
    assert str(refused.value) == (
        "--resume: this run was started with --tokenizer the default (now gpt2); "
        "--block-size 32 (now 16). Resume with the run's own options (leave them out to "
        "reuse them), or train on from one of its checkpoints into another folder: "
        f"--resume_from_checkpoint {out}/checkpoint-N --output-dir NEW"
    )
    check_recorded_arguments(_options(out), _args("bf16"))  # the run's own dtype
    with pytest.raises(JobError, match=re.escape("started with dtype bf16 (now fp16)")):
        check_recorded_arguments(_options(out), _args("fp16"))


def test_a_resume_keeps_the_zero_flags_and_the_seed(tmp_path):
    """--stage / --offload / --nvme-path / --config are the run's unless given anew (a
    resume of an NVMe run used to train without offload); another --seed is refused (it
    holds out other blocks with --eval-split)."""
    out = tmp_path / "out"
    out.mkdir()
    options = _options(out, model="tiny-gpt2", init="random", stage="2", offload="cpu",
                       nvme_path=None, zero_config="zero3")  # fmt: skip
    write_job_record(out, job_record(options, SimpleNamespace(
        zero=SimpleNamespace(dtype="fp32"), seed=7)))  # fmt: skip
    options = _options(out, resume=True, stage=None, offload=None, nvme_path=None)
    adopt_recorded_job(options, given={"output_dir", "resume"})
    assert (options["stage"], options["offload"], options["zero_config"]) == ("2", "cpu", "zero3")
    options = _options(out, resume=True, stage=None, offload="nvme", nvme_path=None)
    adopt_recorded_job(options, given={"output_dir", "resume", "offload"})
    assert options["offload"] == "nvme"  # given anew: it wins
    args = SimpleNamespace(zero=SimpleNamespace(dtype="fp32"), seed=7)
    check_recorded_arguments(_options(out), args)
    args.seed = 8
    with pytest.raises(JobError, match=re.escape("started with --seed 7 (now 8)")):
        check_recorded_arguments(_options(out), args)


def test_a_resume_from_a_checkpoint_changed_after_its_save_is_one_line(tmp_path):
    """The newest checkpoint's trainer_state.json edited (or damaged) after its save: a
    JobError (one line, exit code 2), where it used to be a CheckpointError traceback."""
    from zerotune.hf.checkpoints import TRAINER_MARKER

    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{")
    (ckpt / TRAINER_MARKER).write_text(json.dumps({"trainer_state_sha256": "0" * 64}))
    args = SimpleNamespace(resume_from_checkpoint=None, output_dir=str(tmp_path))
    with pytest.raises(JobError, match="was changed after its save"):
        check_resume(args)


@pytest.mark.parametrize(
    "text, message", [("[]", "(not a JSON object)"), ("{", "(Expecting property name")]
)
def test_a_damaged_record_is_one_line(tmp_path, text, message):
    (tmp_path / JOB_RECORD).write_text(text)
    with pytest.raises(JobError, match=re.escape(f"--resume: cannot read {tmp_path / JOB_RECORD}")):
        read_job_record(tmp_path)
    with pytest.raises(JobError, match=re.escape(message)):
        adopt_recorded_job(_options(tmp_path, resume=True), given={"output_dir", "resume"})


def _earlier_run(out: Path) -> None:
    (out / "checkpoint-20").mkdir(parents=True)
    (out / "checkpoint-20" / "trainer_state.json").write_text("{}")
    for name in ("config.json", "model-00001-of-00002.safetensors", JOB_RECORD, "loss_curve.png"):
        (out / name).write_text("")
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()


def test_what_an_earlier_run_left_is_refused_or_replaced(tmp_path):
    out = tmp_path / "out"
    _earlier_run(out)
    assert [e.name for e in sorted(out.iterdir()) if is_run_output(e)] == [
        "checkpoint-20", "config.json", "loss_curve.png", "model-00001-of-00002.safetensors",
        JOB_RECORD,
    ]  # fmt: skip
    with pytest.raises(JobError) as refused:
        check_output_dir(out, _options(out), _args(), None)
    assert str(refused.value) == (
        f"--output-dir {out} holds an earlier run (checkpoint-20, config.json, loss_curve.png, "
        "model-00001-of-00002.safetensors, ...): add --resume to continue it, --overwrite to "
        "replace it, or choose another folder"
    )
    check_output_dir(out, _options(out, resume=True), _args(), None)  # its own run
    inside = _args(resume_from_checkpoint=str(out / "checkpoint-20"))
    check_output_dir(out, _options(out), inside, None)  # continues it too
    with pytest.raises(JobError, match="--overwrite replaces the run that --resume would"):
        check_output_dir(out, _options(out, overwrite=True), inside, None)
    with pytest.raises(JobError, match=r"--overwrite: --dataset .* is inside --output-dir"):
        check_output_dir(out, _options(out, overwrite=True, dataset=str(out / "data")), _args(),
                         None)  # fmt: skip
    with pytest.raises(JobError, match="is the model's own folder"):
        check_output_dir(out, _options(out), _args(), out)
    check_output_dir(out, _options(out, overwrite=True), _args(), None)
    clear_output_dir(out)
    assert sorted(p.name for p in out.iterdir()) == ["data", "notes.txt"]  # the user's own
    check_output_dir(out, _options(out), _args(), None)  # no earlier run: it writes beside
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / JOB_RECORD).write_text("{}")  # a run stopped before it wrote anything else
    check_output_dir(lone, _options(lone), _args(), None)


def test_an_output_folder_that_cannot_be_written(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(JobError, match=re.escape(f"cannot create --output-dir {a_file}/sub")):
        check_output_dir(a_file / "sub", _options(a_file / "sub"), _args(), None)
    if os.geteuid() == 0:
        return  # root writes anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(JobError, match="no permission to write there"):
        check_output_dir(locked, _options(locked), _args(), None)


def test_is_inside(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert is_inside(tmp_path / "a" / "b", tmp_path / "a")
    assert is_inside(tmp_path / "a", tmp_path / "a")
    assert is_inside(tmp_path / "link" / "b", tmp_path / "a")  # links resolved
    assert not is_inside(tmp_path / "a", tmp_path / "a" / "b")
    assert not is_inside(tmp_path / "ab", tmp_path / "a")
