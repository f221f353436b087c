"""One run per output folder, and ranks that end with their launcher."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

from zerotune.checkpoint import CheckpointError
from zerotune.checkpoint.lock import NAME, FolderLock

HOLD = """
import sys, time
from zerotune.checkpoint.lock import FolderLock
lock = FolderLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(60)
"""


def test_a_held_folder_is_refused_naming_its_holder(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE)
    try:
        assert _line(holder.stdout).strip() == b"held"
        assert FolderLock.holder(out) == holder.pid
        assert oct((out / NAME).stat().st_mode & 0o777) == "0o600"
        with pytest.raises(
            CheckpointError, match=f"in use by another zerotune run .pid {holder.pid}"
        ):
            FolderLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    # The kernel let go with the process: the file it left blocks nobody.
    assert (out / NAME).exists() and FolderLock.holder(out) is None
    with FolderLock(out) as lock:
        assert FolderLock.holder(out) == os.getpid()
        assert lock.path.read_text().strip() == str(os.getpid())
    assert not (out / NAME).exists()


def test_a_folder_the_lock_made_goes_when_nothing_was_written(tmp_path):
    out = tmp_path / "new" / "out"
    with FolderLock(out):
        assert out.is_dir()
    assert not out.exists()
    with FolderLock(out):
        (out / "trainer_state.json").write_text("{}")
    assert out.is_dir() and not (out / NAME).exists()


WATCHED = """
import os, signal, sys, time
from zerotune.launch import die_with_launcher
def bye(signum, frame):
    open(sys.argv[1], "w").write("left through SIGTERM")
    sys.exit(143)
signal.signal(signal.SIGTERM, bye)
die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(60)
"""

LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
child_pid = child.pid
print(child_pid, flush=True)
sys.stdin.readline()  # killed while waiting here
"""


def _line(pipe, seconds: float = 60) -> bytes:
    """The next line from ``pipe``, or a failure (not a hang) when none comes in time."""
    ready, _, _ = select.select([pipe], [], [], seconds)
    assert ready, "no line in time"
    return pipe.readline()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_rank_ends_when_its_launcher_is_killed(tmp_path):
    note = tmp_path / "note"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WATCHED, str(note)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        child = int(_line(launcher.stdout))
        assert int(_line(launcher.stdout)) == child  # the rank is up, watching
    except BaseException:
        os.killpg(launcher.pid, 9)
        raise
    os.kill(launcher.pid, 9)  # no cleanup in the launcher: kill -9
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    assert note.read_text() == "left through SIGTERM"
