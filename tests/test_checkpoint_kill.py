"""Kill test: a process saving checkpoints in a loop is SIGKILLed at random moments; every
time, the next run loads the last complete checkpoint and training goes on exactly."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# A server that imports once and forks one trainer per request, so each run starts in
# milliseconds instead of seconds; the trainer is the process that gets killed. The server
# runs no tensor op before forking (OpenMP is not fork-safe once its threads exist).
SERVER = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
import zerotune
from zerotune.optim import cpu_adam
from conftest import odd_net

cpu_adam.backend()  # load the C++ op once, here
torch.optim.SGD([torch.nn.Parameter(torch.empty(0))])  # torch.optim's lazy imports, here

def say(*words):
    # One write per line: a pipe write this small is atomic, so a kill never leaves half a
    # line for the server's next report to run into.
    os.write(1, (" ".join(map(str, words)) + "\n").encode())

def train(root, total, name):
    torch.set_num_threads(1)
    engine = zerotune.shard(odd_net(seed=0), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    start = 0
    if zerotune.latest_checkpoint(root) is not None:
        start = zerotune.load_checkpoint(engine, root).step
    say("resumed", start)
    for step in range(start, total):
        ids = torch.randint(0, 37, (4, 8), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        say("loss", step, float(loss.detach()).hex())
        name_ = None if name == "-" else name
        zerotune.save_checkpoint(engine, root, step=step + 1, keep_last=2, name=name_)
        say("saved", step + 1)

say("ready")
for line in sys.stdin:
    root, total, name = line.split()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(root, int(total), name)
        except BaseException as exc:
            say("error", repr(exc))
            code = 1
        os._exit(code)
    say("child", pid)
    _, status = os.waitpid(pid, 0)
    say("reaped", pid, status)
"""


class Server:
    def __init__(self, tmp: Path):
        script = tmp / "server.py"
        script.write_text(SERVER)
        tests = str(Path(__file__).parent)
        self.stderr = tmp / "server.err"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), tests],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr.open("w"),
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.child: int | None = None  # the trainer of a run not yet reaped
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["<server exited>"])

    def expect(self, word: str, timeout: float = 60) -> tuple[list[str], list[list[str]]]:
        """Lines up to (and including) the first starting with ``word``; fails after ``timeout``
        seconds without a line (a trainer that makes progress may take longer in all: the
        uninterrupted runs train and save dozens of steps, slow on a loaded machine)."""
        seen = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                tail = seen[-3:]
                raise AssertionError(
                    f"no output for {timeout} s waiting for {word!r}; last: {tail}"
                ) from None
            seen.append(line)
            if line == ["<server exited>"]:
                err = self.stderr.read_text()[-2000:]
                raise AssertionError(f"the server exited waiting for {word!r}:\n{err}")
            if line and line[0] == "error":
                raise AssertionError(f"trainer failed: {line}")
            if line and line[0] == word:
                return line, seen

    def run(self, root: Path, total: int, kill_after: float | None, name: str | None = None):
        """One trainer run; killed ``kill_after`` seconds after it resumed, or run to the end;
        ``name``: every save under this one name (else step-N). Returns (resumed step,
        [(step, loss)], last saved step, killed)."""
        self.proc.stdin.write(f"{root} {total} {name or '-'}\n")
        self.proc.stdin.flush()
        (_, pid), _ = self.expect("child")
        self.child = int(pid)
        (_, resumed), seen = self.expect("resumed")
        if kill_after is not None:
            time.sleep(kill_after)
            os.kill(int(pid), signal.SIGKILL)
        _, rest = self.expect("reaped")
        self.child = None
        seen += rest
        losses = [(int(w[1]), float.fromhex(w[2])) for w in seen if w[0] == "loss"]
        saved = [int(w[1]) for w in seen if w[0] == "saved"]
        return int(resumed), losses, max(saved, default=int(resumed)), kill_after is not None

    def close(self) -> None:
        if self.child is not None:  # a run that failed midway: its trainer may go on
            os.kill(self.child, signal.SIGKILL)
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers():
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


@pytest.fixture
def server(servers, tmp_path_factory):
    """The module's server (each run forks a fresh trainer, on its own folders); a new one
    after a test that failed in the middle of a run."""
    if servers and servers[-1].child is not None:
        servers.pop().close()
    if not servers:
        servers.append(Server(tmp_path_factory.mktemp("server")))
    return servers[0]


@pytest.mark.parametrize("name", [None, "last"], ids=["step-names", "one-name"])
def test_sigkill_during_saves_always_leaves_the_last_complete_checkpoint(server, tmp_path, name):
    """Also when every save has the same name (it replaces the one before: the old one must
    stay whole until the new one is complete; it used to be removed first)."""
    rng = random.Random(20240601)
    root = tmp_path / "ckpt"
    runs = []
    last_saved = 0
    mid_save = 0  # kills that left a checkpoint folder without its marker
    for _ in range(6):
        resumed, losses, saved, _ = server.run(root, 100_000, rng.uniform(0.02, 0.4), name)
        # The newest complete checkpoint: the last one reported saved, or the one whose
        # save finished in the instant between its completion and the report.
        assert last_saved <= resumed <= last_saved + 1, (resumed, last_saved)
        runs.append(losses)
        last_saved = saved
        mid_save += any(p.is_dir() and not (p / "COMPLETE").exists() for p in root.iterdir())
    resumed, losses, saved, _ = server.run(root, last_saved + 3, None, name)
    assert last_saved <= resumed <= last_saved + 1
    assert saved == last_saved + 3
    runs.append(losses)
    # The reference: one run that was never killed, through the same code.
    _, reference, _, _ = server.run(tmp_path / "reference", last_saved + 3, None)
    expected = dict(reference)
    steps_seen = 0
    for losses in runs:
        for step, loss in losses:
            assert loss == expected[step], (step, loss, expected[step])
            steps_seen += 1
    assert steps_seen >= last_saved
    # keep_last=2: two complete checkpoints and the pointer; nothing else after a clean save.
    names = sorted(p.name for p in root.iterdir())
    if name is None:
        assert names == ["latest", f"step-{saved - 1:08d}", f"step-{saved:08d}"], names
    else:
        assert names == [name, "latest"], names
    print(f"{mid_save} of 6 kills interrupted a save")
