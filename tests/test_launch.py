"""The launcher of --nproc-per-node (zerotune.launch), in process: the command line a rank
gets, the threads each process gets, how a rank reports bad input, and which of torchrun's
lines are hidden. The CLI tests start real ranks."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from zerotune import launch


def test_a_rank_gets_the_same_options_back():
    """``child_argv`` of a job's options, parsed by zerotune finetune itself, gives the same
    options: its own flags first (--config for zero_config; defaults left out), the
    passed-through TrainingArguments flags last."""
    from zerotune.cli.finetune import finetune

    options = {
        "model": "gpt2",
        "init": None,
        "dataset": "data.jsonl",
        "train_on_prompt": True,
        "block_size": 64,
        "eval_split": 0.0,
        "zero_config": "zero3-offload-cpu",
        "output_dir": "out",
        "resume": False,
        "overwrite": True,
        "hf_args": ("--max_steps", "5", "--bf16"),
    }
    argv = launch.child_argv(options)
    assert argv == ["--model", "gpt2", "--dataset", "data.jsonl", "--train-on-prompt",
                    "--block-size", "64", "--config", "zero3-offload-cpu", "--output-dir", "out",
                    "--overwrite", "--max_steps", "5", "--bf16"]  # fmt: skip
    parsed = finetune.make_context("finetune", list(argv)).params
    assert parsed["hf_args"] == options["hf_args"]
    for key, value in options.items():
        if key != "hf_args":
            assert parsed[key] == value, key
    held_out = launch.child_argv({**options, "eval_split": 0.2})
    assert held_out[held_out.index("--eval-split") + 1] == "0.2"


def test_threads_are_the_cpus_shared_out(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert launch.threads_per_process(3) == (
        2,
        "8 CPUs shared by 3 process(es); OMP_NUM_THREADS sets another number",
    )
    assert launch.threads_per_process(16)[0] == 1  # at least one
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a number of threads: shared out
    assert launch.threads_per_process(1)[0] == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.threads_per_process(2) == (3, "OMP_NUM_THREADS")


def test_a_rank_of_a_launch_leaves_its_message_to_the_launcher(monkeypatch, tmp_path):
    for key in ("ZEROTUNE_FINETUNE_ERRORS", launch.TEMP_NVME_ENV, "WORLD_SIZE",
                "TORCHELASTIC_RUN_ID"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    assert not launch.launched_rank() and not launch.under_launcher()
    assert launch.shared_temp_nvme() is None
    assert launch.report_error("bad") is False  # one process: it prints the line itself
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.under_launcher() and not launch.launched_rank()
    monkeypatch.setenv("ZEROTUNE_FINETUNE_ERRORS", str(tmp_path))
    monkeypatch.setenv(launch.TEMP_NVME_ENV, str(tmp_path / "nvme"))
    monkeypatch.setenv("RANK", "1")
    assert launch.launched_rank() and launch.shared_temp_nvme() == str(tmp_path / "nvme")
    assert launch.report_error("--block-size 0 is too small") is True
    assert (tmp_path / "rank1.txt").read_text() == "--block-size 0 is too small"


def test_torchrun_lines_about_bad_input_are_hidden():
    quiet = launch._DropBadInputExit()

    def shown(text: str) -> bool:
        return quiet.filter(logging.LogRecord("torchrun", logging.ERROR, "", 0, text, (), None))

    assert not shown(f"failed (exitcode: {launch.BAD_INPUT_EXIT}) local_rank: 0 (pid: 7)")
    assert not shown("Sending process 8 closing signal SIGTERM")
    assert shown("failed (exitcode: 1) local_rank: 0 (pid: 7)")  # a crash is shown


def test_stops_and_failures_carry_what_the_command_says():
    stopped = launch.LaunchStopped(signal.SIGINT)
    assert (stopped.signum, stopped.signal_name) == (2, "SIGINT")
    failed = launch.RanksFailed(launch.BAD_INPUT_EXIT, ["bad", "worse"])
    assert (failed.exit_code, failed.messages, str(failed)) == (2, ["bad", "worse"], "bad; worse")
    with pytest.raises(SystemExit) as leaving:
        launch.exit_on_sigterm(signal.SIGTERM, None)
    assert leaving.value.code == 128 + signal.SIGTERM


def test_a_stop_signal_inside_a_finalizer_comes_again():
    """Python prints an exception raised in ``__del__`` ("Exception ignored", a traceback
    on the rank's stderr) and drops it: the handler sends the signal again instead."""
    import sys
    import time

    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:

        class Finalized:
            def __del__(self):
                launch.exit_on_sigterm(signal.SIGUSR1, sys._getframe())

        Finalized()  # finalized at once; a SystemExit here would be printed and dropped
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == [signal.SIGUSR1]


def test_a_temporary_nvme_folder_of_a_killed_run_goes_at_the_next(monkeypatch, tmp_path):
    """A run killed with SIGKILL leaves its temporary NVMe folder (swap files included);
    the next run that makes one removes those whose process is gone."""
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"zerotune-nvme-{dead.pid}-abc"
    (orphan / "run" / "rank0").mkdir(parents=True)
    mine = launch.make_temp_nvme()
    assert not orphan.exists()
    assert os.path.basename(mine).startswith(f"zerotune-nvme-{os.getpid()}-")
    again = launch.make_temp_nvme()  # this process's own is alive: kept
    assert os.path.isdir(mine) and os.path.isdir(again)


def test_a_rank_killed_by_a_signal_exits_as_a_shell_says_it(monkeypatch, tmp_path):
    """torchrun reports a rank killed by signal N as exit code -N; the launcher exits with
    the shell's 128 + N (137 for SIGKILL), not sys.exit(-9)'s 247."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def killed(argv):
        failure = ProcessFailure(local_rank=1, pid=1234, exitcode=-signal.SIGKILL, error_file="")
        raise ChildFailedError("rank", {1: failure})

    monkeypatch.setattr(torch.distributed.run, "main", killed)
    with pytest.raises(launch.RanksFailed) as failed:
        launch.launch(2, ["finetune"], threads=1, temp_nvme=None)
    assert failed.value.exit_code == 128 + signal.SIGKILL and failed.value.messages == []
