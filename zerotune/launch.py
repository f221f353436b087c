"""The launcher of ``zerotune finetune --nproc-per-node N``: this node's ranks through
``torch.distributed.run``, and what a rank needs to end with its launcher.

[Note: launching ranks]
The launching process checks the job first (bad input stops there, before any process
starts), then re-runs the same command (``child_argv``) in N processes with torchrun, which
owns them. The ranks share the CPUs (``threads_per_process``, passed as OMP_NUM_THREADS)
and a temporary NVMe folder the launcher made (``TEMP_NVME_ENV``; the launcher removes
it). A rank that refuses its input writes its one-line message into a folder the launcher
made (``report_error``) and exits with ``BAD_INPUT_EXIT``: every rank finds the same
fault, and the launcher prints each distinct message once (``RanksFailed``), with
torchrun's own report of the failed rank hidden. A rank ends when its launcher does,
however that ends (``die_with_launcher``), and leaves through its ``finally`` blocks on
SIGTERM (``exit_on_sigterm``), which torchrun sends to stop the others when one fails.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BAD_INPUT_EXIT",
    "TEMP_NVME_ENV",
    "LaunchStopped",
    "RanksFailed",
    "child_argv",
    "die_with_launcher",
    "exit_on_sigterm",
    "launch",
    "launched_rank",
    "make_temp_nvme",
    "report_error",
    "shared_temp_nvme",
    "threads_per_process",
    "under_launcher",
]

BAD_INPUT_EXIT = 2  # the exit code of a process that refused its input
TEMP_NVME_ENV = "ZEROTUNE_FINETUNE_TEMP_NVME"  # the launcher's temporary NVMe folder
_ERRORS_ENV = "ZEROTUNE_FINETUNE_ERRORS"  # where ranks leave their bad-input message


class LaunchStopped(Exception):
    """The launcher got a signal (Ctrl-C, a kill): its ranks were stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.signal_name = signal.Signals(self.signum).name
        super().__init__(f"stopped by {self.signal_name}")


class RanksFailed(Exception):
    """A rank failed: ``exit_code`` is the bad-input code if any rank refused its input
    (``messages``: each distinct message once), else the first rank's nonzero code."""

    def __init__(self, exit_code: int, messages: list[str]) -> None:
        self.exit_code = exit_code
        self.messages = messages
        super().__init__("; ".join(messages) or f"a rank exited with code {exit_code}")


def under_launcher() -> bool:
    """Whether this process is one rank of several (started by torchrun or ``launch``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def launched_rank() -> bool:
    """Whether this process is a rank that ``launch`` started (its launcher checked the job
    and built the ops)."""
    return _ERRORS_ENV in os.environ


def shared_temp_nvme() -> str | None:
    """The temporary NVMe folder the launcher made for its ranks, if any."""
    return os.environ.get(TEMP_NVME_ENV)


_TEMP_NVME_PREFIX = "zerotune-nvme-"


def make_temp_nvme() -> str:
    """A temporary NVMe folder for a run without --nvme-path, named after this process
    (``zerotune-nvme-<pid>-...``); those of processes that are gone (a run killed with
    SIGKILL never removes its own, swap files included) are removed first."""
    import re

    from .memory.swap import pid_alive

    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{_TEMP_NVME_PREFIX}*"):
        m = re.match(rf"{_TEMP_NVME_PREFIX}(\d+)-", old.name)
        if m is not None and old.is_dir() and not old.is_symlink():
            if not pid_alive(int(m.group(1))):
                shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_TEMP_NVME_PREFIX}{os.getpid()}-")


def report_error(message: str) -> bool:
    """A rank of ``launch``: leave ``message`` for the launcher to print once, and say so
    (True); any other process: False (it prints the message itself)."""
    report_dir = os.environ.get(_ERRORS_ENV)
    if not report_dir:
        return False
    rank = os.environ.get("RANK", "0")
    Path(report_dir, f"rank{rank}.txt").write_text(message)
    return True


def threads_per_process(nproc: int) -> tuple[int, str]:
    """(threads, why) for each of ``nproc`` processes: the CPUs this process may use, shared
    out; OMP_NUM_THREADS, when set, decides."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given), "OMP_NUM_THREADS"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    why = f"{cpus} CPUs shared by {nproc} process(es); OMP_NUM_THREADS sets another number"
    return max(1, (cpus or 1) // nproc), why


def child_argv(options: Mapping[str, Any]) -> list[str]:
    """``zerotune finetune``'s arguments that give a rank the same job as ``options`` (its
    option names to values, the passed-through TrainingArguments flags last)."""
    argv: list[str] = []
    for key, value in options.items():
        if key == "hf_args" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "zero_config":
            flag = "--config"
        if key == "eval_split" and not value:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv + list(options["hf_args"])


def launch(nproc: int, argv: Sequence[str], *, threads: int, temp_nvme: str | None = None) -> None:
    """Run ``zerotune`` with ``argv`` (``["finetune", ...]``) in ``nproc`` processes on this
    node through ``torch.distributed.run``, ``threads`` threads each, sharing ``temp_nvme``;
    return once all succeeded (see [Note: launching ranks]). Raises LaunchStopped or
    RanksFailed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    saved_env = {k: os.environ.get(k) for k in (TEMP_NVME_ENV, _ERRORS_ENV, "OMP_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torchrun keeps it
    if temp_nvme is not None:
        os.environ[TEMP_NVME_ENV] = temp_nvme
    errors = tempfile.mkdtemp(prefix="zerotune-errors-")
    os.environ[_ERRORS_ENV] = errors
    command = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--no-python",
        sys.executable,
        "-c",
        "from zerotune.cli import main; main()",
        *argv,
    ]
    # torchrun logs a failed rank as an error line of its own; for bad input the rank's
    # one-line message says everything.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _DropBadInputExit()
    agent_log.addFilter(quiet)
    try:
        torchrun(command)
    except SignalException as exc:  # Ctrl-C or a kill of this process: the ranks are stopped
        raise LaunchStopped(exc.sigval) from None
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        code = BAD_INPUT_EXIT if BAD_INPUT_EXIT in codes else next((c for c in codes if c), 1)
        if code < 0:  # torchrun's -N: the rank was killed by signal N; the shell's 128 + N
            code = 128 - code
        # bad input: the same line from every rank, kept once
        messages = sorted({p.read_text() for p in Path(errors).glob("rank*.txt")})
        raise RanksFailed(code, messages) from None
    finally:
        agent_log.removeFilter(quiet)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(errors, ignore_errors=True)


class _DropBadInputExit(logging.Filter):
    """Hides torchrun's lines about a rank that exited with the bad-input code and about
    stopping the other ranks after it (a crash still shows the rank's own traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return f"exitcode: {BAD_INPUT_EXIT})" not in text and "closing signal" not in text


def exit_on_sigterm(signum, frame) -> None:
    """A SIGTERM handler: leave through the ``finally`` blocks (a temporary NVMe folder is
    removed) instead of dying; torchrun stops the other ranks with SIGTERM when one fails
    or is interrupted. Arriving inside a ``__del__``, where Python prints an exception as
    "Exception ignored" and drops it, the signal comes again 50 ms later."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    sys.exit(128 + signum)


def die_with_launcher() -> None:
    """A rank started by ``launch`` ends when its launcher does, however the launcher ends
    (kill -9 included): a thread watches the parent; once it is gone the rank gets SIGTERM
    (leaving through its finally blocks), and exits outright 30 s later if still alive."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="zerotune-launcher-watch", daemon=True).start()
