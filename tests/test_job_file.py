"""Job files (zerotune finetune --job): every key checked across the four sections, paths
relative to the file, the shipped examples run, and flags on the command line win."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.hf.job import JobFileError, read_job_file

JOBS = Path(__file__).resolve().parent.parent / "configs" / "jobs"
COMMAND = [sys.executable, "-c", "from zerotune.cli import main; main()", "finetune"]


def _job(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("training:\n  stage: 3\n", "'training.stage' is not a known key; did you mean zero.stage"),
        ("training:\n  learning_rat: 1\n", "did you mean training.learning_rate?"),
        ("zero:\n  ofload_param: nvme\n", "did you mean zero.offload_param?"),
        ("data:\n  blocksize: 8\n", "did you mean data.block_size?"),
        ("trainng:\n  max_steps: 3\n", "'trainng' is not a section (model, data, zero, "
         "training); did you mean training?"),
        ("data:\n  block_size: eight\n", "'data.block_size' is 'eight', not a whole number"),
        ("data:\n  train_on_prompt: 1\n", "'data.train_on_prompt' is 1, not true or false"),
        ("model: [gpt2]\n", "section 'model' must be a mapping"),
        ("- just a list\n", "a mapping of sections"),
        ("model: {name: gpt2\n", "is not valid YAML"),
    ],
)  # fmt: skip
def test_bad_job_files_name_the_key_and_the_closest_one(tmp_path, text, message):
    with pytest.raises(JobFileError, match=re.escape(message)):
        read_job_file(_job(tmp_path, text))


def test_sections_and_relative_paths(tmp_path):
    (tmp_path / "data.jsonl").write_text("{}\n")
    job = read_job_file(
        _job(
            tmp_path,
            "model: gpt2\n"
            "data: {dataset: data.jsonl, block_size: 64, eval_split: 0.1}\n"
            "zero: {stage: 2, offload_optimizer: nvme, nvme_path: swap}\n"
            "training: {output_dir: out, learning_rate: 1.0e-4, bf16: true, report_to: [none],\n"
            "           lr_scheduler_kwargs: {min_lr: 0.0}}\n",
        )
    )
    assert job.options == {
        "model": "gpt2",  # a name, not a file here: left as it is
        "dataset": str(tmp_path / "data.jsonl"),
        "block_size": 64,
        "eval_split": 0.1,
    }
    assert job.zero == {
        "stage": 2,
        "offload_optimizer": "nvme",
        "nvme_path": str(tmp_path / "swap"),
    }
    assert job.training["output_dir"] == str(tmp_path / "out")
    flags = job.training_flags(given={"output_dir", "learning_rate"})
    assert flags == ["--bf16", "true", "--report_to", "none",
                     "--lr_scheduler_kwargs", '{"min_lr": 0.0}']  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-gpt2-nvme", "chat-sft-cpu"])
def test_the_shipped_job_files_run_and_flags_win(tmp_path, name):
    out = tmp_path / "out"
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    import os

    # The nvme job's swap folder goes to this test's temp folder (a flag, winning over it).
    extra = ["--nvme-path", str(tmp_path / "swap")] if "nvme" in name else []
    proc = subprocess.run(
        [*COMMAND, "--job", str(JOBS / f"{name}.yaml"), "--output_dir", str(out),
         "--max_steps", "4", "--logging_steps", "2", "--save_strategy", "steps",
         "--save_steps", "4", *extra],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "run_summary.json").read_text())
    assert s["global_step"] == 4  # --max_steps 4 over the file's
    assert s["model"] == "tiny-gpt2" and s["init"] == "random"
    if name == "chat-sft-cpu":
        assert s["columns"] == "chat column 'messages'" and s["block_size"] == 128
        assert (s["zero"]["stage"], s["zero"]["offload_optimizer"]) == (3, "cpu")
        args = json.loads((out / "training_args.json").read_text())
        assert args["gradient_accumulation_steps"] == 2  # from the file
        # --resume without --job: the job's zero section and Trainer flags again.
        resumed = subprocess.run(
            [*COMMAND, "--output-dir", str(out), "--resume", "--max_steps", "6",
             "--save_strategy", "no"],
            capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        s = json.loads((out / "run_summary.json").read_text())
        assert (s["global_step"], s["zero"]["offload_optimizer"]) == (6, "cpu")
        args = json.loads((out / "training_args.json").read_text())
        assert args["gradient_accumulation_steps"] == 2
    else:
        assert (s["zero"]["offload_param"], s["zero"]["offload_optimizer"]) == ("nvme", "nvme")
        assert s["zero"]["nvme_path"] == str(tmp_path / "swap") and s["eval_blocks"] > 0
