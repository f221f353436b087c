"""A finished multi-rank run ends with exit code 0, every time: the rank path leaves through
``zerotune.dist.leave`` (see [Note: leaving a gloo rank]), even with the engine, its work
and the optimizer still referenced."""

from __future__ import annotations

import os
import subprocess
import sys

# Imports torch and zerotune once, then forks two fresh ranks per run (a new gloo group each
# time): ten runs take seconds, not the minute of ten process starts.
DRIVER = r"""
import os, socket, sys
import torch
from torch import nn
import zerotune
from zerotune import dist as zdist
from zerotune.optim.cpu_adam import backend

backend()  # loaded once before the forks: the C++ Adam op, and what torch's optimizers
import torch._dynamo  # noqa: E402,F401 - import on their first construction


def rank_body(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    zdist.init_from_env("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))
    global ENGINE, OPT  # still referenced when the rank leaves
    ENGINE = zerotune.shard(model, {"stage": 3, "prefetch_bytes": 1 << 20})
    OPT = zerotune.ZeroAdamW(ENGINE, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(8, 16, generator=g)
        ENGINE.backward(ENGINE(x).square().mean())
        OPT.clip_grad_norm_(1.0)
        OPT.step()
    zdist.leave(0)


for run in range(10):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                rank_body(rank, port)
            finally:
                os._exit(70)  # rank_body never returns: leave() ends the process
        pids.append(pid)
    for rank, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        print(f"run {run} rank {rank} status {os.waitstatus_to_exitcode(status)}", flush=True)
"""


def test_ten_two_rank_runs_all_exit_cleanly():
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    statuses = [line.rsplit(" ", 1)[1] for line in lines if line.startswith("run ")]
    assert statuses == ["0"] * 20, (proc.stdout, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
