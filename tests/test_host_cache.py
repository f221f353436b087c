"""The host buffer cache (csrc/aio/host_cache.cpp, memory/host.py): a CPU allocator that keeps
freed tensors of 1 MiB and more for reuse within a byte budget, installed by an engine that
offloads on a CPU device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zerotune
from zerotune.memory.host import host_cache_report, keep_freed_buffers
from zerotune.ops import load_op

MIB = 2**20
pytestmark = pytest.mark.skipif(load_op("aio") is None, reason="the aio op cannot be built here")


def _mib_tensor(n_mib: float) -> torch.Tensor:
    return torch.empty(int(n_mib * MIB) // 4, dtype=torch.float32)


@pytest.fixture(autouse=True)
def isolated_cache():
    """Each test starts with the cache taken out, and the owners of earlier tests' engines
    (still referenced somewhere, or not yet collected) get it back afterwards."""
    from zerotune.memory import host

    op = load_op("aio")
    saved = dict(host._cache_budgets)
    host._cache_budgets.clear()
    op.host_cache_disable()
    yield
    op.host_cache_disable()
    host._cache_budgets.clear()
    host._cache_budgets.update(saved)
    if saved:
        op.host_cache_enable(max(saved.values()), host.CACHE_MIN_BYTES)


@pytest.fixture
def cache():
    """Install with a 4 MiB budget for the test, and take it out again whatever happens."""
    release = keep_freed_buffers(4 * MIB)
    assert release is not None
    try:
        yield release
    finally:
        release()


def test_a_freed_buffer_serves_the_next_request_of_its_size(cache):
    before = host_cache_report()
    a = _mib_tensor(2)
    ptr = a.data_ptr()
    del a
    assert host_cache_report()["kept"] == 2 * MIB
    b = _mib_tensor(2)  # same page-rounded size: the same memory
    assert b.data_ptr() == ptr
    after = host_cache_report()
    assert after["hits"] - before["hits"] == 1
    assert after["misses"] - before["misses"] == 1
    assert after["kept"] == 0
    # Requests below 1 MiB go to the previous allocator: no hit, no miss, nothing kept.
    small = torch.ones(1000)
    del small
    assert host_cache_report()["misses"] == after["misses"]
    assert host_cache_report()["kept"] == 0
    # Tensors made from kept memory compute like any others.
    x = torch.arange(2 * MIB // 4, dtype=torch.float32)
    del x
    y = torch.arange(2 * MIB // 4, dtype=torch.float32)
    assert y.sum().item() == pytest.approx((2 * MIB // 4) * (2 * MIB // 4 - 1) / 2)


def test_the_budget_keeps_the_most_recently_freed(cache):
    bufs = [_mib_tensor(1) for _ in range(5)]
    ptrs = [t.data_ptr() for t in bufs]
    for i in range(5):
        bufs[i] = None  # freed in order 0..4: the first one no longer fits the 4 MiB
    report = host_cache_report()
    assert report["kept"] == 4 * MIB
    assert report["peak_kept"] <= 4 * MIB
    again = [_mib_tensor(1) for _ in range(4)]
    # newest first, and the oldest (0) was given back to the system
    assert [t.data_ptr() for t in again] == [ptrs[4], ptrs[3], ptrs[2], ptrs[1]]
    # A buffer larger than the whole budget is never kept.
    big = _mib_tensor(8)
    del big
    assert host_cache_report()["kept"] == 0
    del again
    assert host_cache_report()["kept"] == 4 * MIB


def test_owners_share_the_largest_budget_and_the_last_release_uninstalls():
    first = keep_freed_buffers(2 * MIB)
    second = keep_freed_buffers(6 * MIB)
    assert first is not None and second is not None
    try:
        assert host_cache_report()["budget"] == 6 * MIB
        bufs = [_mib_tensor(1) for _ in range(6)]
        del bufs
        assert host_cache_report()["kept"] == 6 * MIB
        second()
        second()  # twice is harmless
        report = host_cache_report()
        assert report["budget"] == 2 * MIB and report["kept"] == 2 * MIB
    finally:
        first()
        second()
    report = host_cache_report()
    assert report["budget"] == 0 and report["kept"] == 0
    misses = report["misses"]
    t = _mib_tensor(2)  # the previous allocator serves it again
    del t
    assert host_cache_report()["misses"] == misses
    assert keep_freed_buffers(0) is None  # a zero budget installs nothing


FORK_SCRIPT = r"""
import json, torch
from torch.utils.data import DataLoader, Dataset
from zerotune.memory.host import host_cache_report, keep_freed_buffers

class Big(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.full((2**19,), float(i))  # 2 MiB: made by the cache in the worker

release = keep_freed_buffers(8 * 2**20)
churn = [torch.empty(2**19) for _ in range(3)]
del churn
loader = DataLoader(Big(), batch_size=None, num_workers=2, multiprocessing_context="fork")
sums = [float(b.sum()) for b in loader]
kept = host_cache_report()["kept"]
release()
print(json.dumps({"sums": sums, "kept": kept}))
"""


def test_forked_workers_allocate_through_it(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["sums"] == [float(i * 2**19) for i in range(4)]
    assert r["kept"] == 6 * MIB


def _engine(tmp_path, **extra):
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=512, n_head=8, vocab_size=512, n_positions=64)
    model = AutoModelForCausalLM.from_config(cfg)
    config = {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", **extra}
    return zerotune.shard(model, config)


def _faults_per_step(engine, steps: int = 3) -> tuple[list[int], list[float]]:
    import resource

    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    faults, losses = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        losses.append(float(loss.detach()))
    return faults, losses


REUSE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_host_cache import MIB, _engine, _faults_per_step
from zerotune.memory.host import host_cache_report

engine = _engine(None, host_cache_bytes="64MiB")
out = {"budget": host_cache_report()["budget"]}
out["cached_faults"], out["cached_losses"] = _faults_per_step(engine)
out["kept"] = engine.memory_report()["host_cache"]
engine.close()
out["budget_after_close"] = host_cache_report()["budget"]
engine = _engine(None, host_cache_bytes=0)
out["plain_budget"] = host_cache_report()["budget"]
out["plain_faults"], out["plain_losses"] = _faults_per_step(engine)
out["plain_kept"] = engine.memory_report()["host_cache"]
engine.close()
print(json.dumps(out))
"""


def test_an_offloading_engine_reuses_freed_tensors_and_counts_them(tmp_path):
    """In a process of its own: page faults depend on what the process's allocator already
    holds, and earlier tests in this one leave glibc's heap in another state."""
    from pathlib import Path

    script = tmp_path / "reuse.py"
    script.write_text(REUSE_SCRIPT)
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, str(script), tests], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["budget"] == 64 * MIB
    assert 0 < r["kept"] <= 64 * MIB
    assert r["budget_after_close"] == 0  # closing took it out
    assert r["plain_budget"] == 0 and r["plain_kept"] == 0
    # Same numbers either way; the steady steps fault far less with the cache (each fresh
    # weight gradient of 1-4 MiB is otherwise page-faulted again every step).
    assert r["cached_losses"] == pytest.approx(r["plain_losses"], rel=1e-5)
    cached, plain = r["cached_faults"], r["plain_faults"]
    assert cached[-1] < 0.5 * plain[-1], (cached, plain)


def test_host_cache_bytes_config():
    assert zerotune.ZeroConfig(host_cache_bytes="64MiB").host_cache_bytes == 64 * MIB
    assert zerotune.ZeroConfig().host_cache_bytes == 128 * MIB
    with pytest.raises(zerotune.ConfigError, match="host_cache_bytes"):
        zerotune.ZeroConfig(host_cache_bytes=-1)


def test_the_estimate_counts_the_budget_or_what_a_step_frees():
    from types import SimpleNamespace

    from zerotune.sharding.buffers import host_cache_bytes

    units = [SimpleNamespace(numel=1000), SimpleNamespace(numel=250)]
    cfg = zerotune.ZeroConfig(offload_optimizer="cpu", host_cache_bytes="1MiB")
    # one unit's fp32 gradients and the activations, within the budget
    assert host_cache_bytes(units, cfg, "cpu", 10_000) == {"host_cache": {"host": 4000 + 10_000}}
    assert host_cache_bytes(units, cfg, "cpu", 10**9) == {"host_cache": {"host": MIB}}
    assert host_cache_bytes(units, cfg, "cuda", 10**9) == {}  # not installed with a GPU device
    assert host_cache_bytes(units, zerotune.ZeroConfig(), "cpu", 10**9) == {}  # nor without offload


def test_a_dropped_engine_is_freed_and_gives_the_cache_back():
    import gc
    import weakref

    engine = _engine(None)
    _faults_per_step(engine, steps=1)
    assert host_cache_report()["budget"] == 128 * MIB
    alive = weakref.ref(engine)
    del engine  # no close(): its gradient hooks (kept by torch in C++) must not hold it
    gc.collect()
    assert alive() is None
    assert host_cache_report()["budget"] == 0
