"""ZeRO-Infinity offload: every tier combination trains like plain AdamW; swap files are
private, checked for space up front, and removed; broken reads raise."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time

import pytest
from conftest import run_together, run_world
from harness import train_zero
from test_engine_equivalence import check, reference

COMBOS = [
    # (offload_param, offload_optimizer, grads on NVMe too)
    ("none", "cpu", False),
    ("cpu", "cpu", False),
    ("none", "nvme", False),
    ("nvme", "nvme", True),
    ("nvme", "none", False),
]


def run_offload(rank, world, nvme_root, combos):
    out = []
    for param, optim, grads_on_disk in combos:
        config = {"stage": 3, "offload_param": param, "offload_optimizer": optim}
        if "nvme" in (param, optim):
            config["nvme_path"] = nvme_root
            # Small staging: the optimizer streams several chunks per unit.
            config["staging_bytes"] = 3 * 16 * 4096 * 3
            if grads_on_disk:
                config["grad_host_bytes"] = 0
        result = train_zero(rank, world, "gpt2", config, accum=2, use_no_sync=False)
        out.append(result)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offload_tiers_match_plain_adamw(world, tmp_path):
    results = run_world(world, run_offload, str(tmp_path), COMBOS)[0]
    ref = reference("gpt2")
    for combo, res in zip(COMBOS, results):
        check(res, ref, f"world={world} offload={combo}")
    # Clean exit: every swap file and run folder is gone.
    assert os.listdir(tmp_path) == []


ACTIVATIONS_SCRIPT = r"""
import json, resource
import psutil, torch
from transformers import AutoModelForCausalLM, GPT2Config
torch.manual_seed(0)
cfg = GPT2Config(n_layer=8, n_embd=768, n_head=12, vocab_size=1024, n_positions=64)
AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8))
model = AutoModelForCausalLM.from_config(cfg).requires_grad_(False)
ids = torch.randint(0, 1024, (4, 64))
base = psutil.Process().memory_info().rss
with torch.enable_grad():
    model.transformer.wte.weight.requires_grad_(True)  # so that forward saves activations
    model(input_ids=ids, labels=ids).loss
print(json.dumps({"grew": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}))
"""

MEMORY_SCRIPT = r"""
import json, resource, sys
import psutil, torch, zerotune
from transformers import AutoModelForCausalLM, GPT2Config
torch.manual_seed(0)
cfg = GPT2Config(n_layer=8, n_embd=768, n_head=12, vocab_size=1024, n_positions=64)
AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8))
base = psutil.Process().memory_info().rss
staging = 32 * 2**20
engine = zerotune.zero_init(cfg, {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                  "nvme_path": sys.argv[1], "staging_bytes": staging,
                                  "grad_host_bytes": 0, "prefetch_bytes": 30 * 2**20})
opt = zerotune.ZeroAdamW(engine, lr=1e-4)
ids = torch.randint(0, 1024, (4, 64))
losses = []
for _ in range(2):
    loss = engine(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    losses.append(float(loss))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
report = engine.memory_report()
engine.close()
print(json.dumps({"grew": peak - base, "largest": max(u.gathered_bytes for u in engine.units),
                  "numel": sum(u.numel for u in engine.units), "staging": report["staging"],
                  "staging_limit": staging, "losses": losses, "nvme": report["nvme"],
                  "host_cache": report["host_cache"]}))
"""


def test_nvme_peak_memory_stays_within_staging_unit_and_activations(tmp_path):
    import json
    import sys

    def script(name, code):
        path = tmp_path / f"{name}.py"
        path.write_text(code)
        return [sys.executable, str(path)]

    swap = tmp_path / "swap"
    swap.mkdir()
    # Both at once: each measures its own process's memory.
    runs = run_together(
        [*script("memory", MEMORY_SCRIPT), str(swap)], script("activations", ACTIVATIONS_SCRIPT)
    )
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
    r, plain = (json.loads(out.stdout.strip().splitlines()[-1]) for out in runs)
    # Activations of this batch plus torch's own first-forward overhead, measured on a plain
    # forward of the same model (no parameter gradients, no optimizer).
    activations = plain["grew"]
    mb = 2**20
    model_state = r["numel"] * 16  # fp32 params + grads + master-sized moments: what plain holds
    assert r["staging"] <= r["staging_limit"]
    assert r["nvme"] >= r["numel"] * 16  # params, master, moments and grads are on disk
    # The configured buffers (staging; the prefetch budget, its read buffer and gathered
    # copy) + the unit in use with its gradient buffers: gathered weights, their gradients,
    # the fp32 reduce buffer, two gradient writes in flight and a read buffer (6 units) +
    # activations (measured) + a fixed 150 MB.
    bound = r["staging_limit"] + 2 * 30 * mb + 6 * r["largest"] + activations + 150 * mb
    # Freed tensors kept for reuse (host_cache_bytes, 128 MiB by default) fit in that bound too.
    assert 0 < r["host_cache"] <= 128 * mb
    assert r["grew"] < bound, (r["grew"] / mb, bound / mb, activations / mb)
    # Plain training holds the model state and the activations.
    assert r["grew"] < 0.6 * (model_state + activations), (r["grew"] / mb, model_state / mb)
    assert r["losses"][-1] < r["losses"][0]
    assert list(swap.iterdir()) == []


def test_full_disk_is_refused_at_start(tmp_path):
    import subprocess

    import zerotune

    small = tmp_path / "small"
    small.mkdir()
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)]).returncode
        == 0
    )
    if not mounted:
        pytest.fail("this test needs to mount a small tmpfs (run as root)")
    try:
        from harness import build

        need = r"KiB free; this run needs [0-9.]+ [KMG]iB of swap files"
        with pytest.raises(zerotune.ConfigError, match=need):
            zerotune.shard(
                build("gpt2"),
                {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(small)},
            )
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)])


def test_corrupt_swap_file_raises_instead_of_returning_garbage(tmp_path):
    from harness import batches, build, loss_of

    import zerotune

    engine = zerotune.shard(
        build("gpt2"), {"stage": 3, "offload_param": "nvme", "nvme_path": str(tmp_path)}
    )
    swap_file = engine.swap.files["param"].path
    assert stat.S_IMODE(os.stat(swap_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(swap_file.parent).st_mode) == 0o700
    os.truncate(swap_file, 0)  # the data under the swap is gone
    with pytest.raises(OSError, match="param.swap"):
        loss_of(engine, batches("gpt2", 1)[0])
    engine.close()


def test_nvme_path_is_made_or_refused(tmp_path):
    """A missing folder is made, parents too; one that cannot be made (under a file) is
    refused by name, and so is a file given as the folder."""
    from harness import build

    import zerotune

    made = tmp_path / "not" / "yet"
    engine = zerotune.shard(
        build("gpt2"), {"stage": 3, "offload_param": "nvme", "nvme_path": str(made)}
    )
    assert made.is_dir() and engine.memory_report()["nvme"] > 0
    engine.close()
    (tmp_path / "file").write_text("")
    for path, message in ((tmp_path / "file" / "sub", "cannot make nvme_path"),
                          (tmp_path / "file", "is not a folder")):  # fmt: skip
        with pytest.raises(zerotune.ConfigError, match=message):
            config = {"stage": 3, "offload_param": "nvme", "nvme_path": str(path)}
            zerotune.shard(build("gpt2"), config)


def test_stale_swap_folders_are_removed_at_start_and_live_ones_kept(tmp_path):
    import socket
    import subprocess
    import sys

    from harness import build

    import zerotune

    host = socket.gethostname()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]

    def run_folder(name, owners):
        folder = tmp_path / name
        (folder / "rank0").mkdir(parents=True)
        (folder / "rank0" / "param.swap").write_bytes(b"x" * 4096)
        for i, text in enumerate(owners):
            (folder / f"owner-rank{i}").write_text(text)
        return folder

    gone = run_folder("zerotune-gone", [f"{host} {dead}\n", f"{host} {dead}\n"])
    live = run_folder("zerotune-live", [f"{host} {dead}\n", f"{host} {os.getpid()}\n"])
    remote = run_folder("zerotune-remote", [f"another-host {dead}\n"])
    unreadable = run_folder("zerotune-unreadable", [""])  # counts as alive, never guessed dead
    engine = zerotune.shard(
        build("gpt2"), {"stage": 3, "offload_param": "nvme", "nvme_path": str(tmp_path)}
    )
    own = engine.swap.run_dir
    assert not gone.exists()
    assert live.exists() and remote.exists() and unreadable.exists()
    assert (own / "owner-rank0").read_text().split() == [host, str(os.getpid())]
    assert not list(own.glob(".partial*"))
    engine.close()
    assert not own.exists()  # removed at a clean exit
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "zerotune-live",
        "zerotune-remote",
        "zerotune-unreadable",
    ]


# ------------------------------------------------------------ reused gather buffers
def test_lend_storage_points_views_at_the_lent_buffer():
    import torch

    from zerotune.memory.pool import GatherCache

    cache = GatherCache.create(torch.device("cpu"))
    assert cache is not None  # the aio op is built in CI (zerotune env --build)
    cache.keep_bytes = 64
    flat = torch.empty(8)
    flat.untyped_storage().resize_(0)
    a = cache.lend(flat, 32)
    flat.copy_(torch.arange(8.0))
    view = flat[2:5]  # what autograd would save in forward
    assert a.view(torch.float32).tolist() == list(map(float, range(8)))
    assert a.data_ptr() % 4096 == 0 and flat.data_ptr() == a.data_ptr()
    flat.untyped_storage().resize_(0)
    cache.give_back(a)
    assert cache.kept_bytes == 32 and cache.allocations == 1
    b = cache.lend(flat, 32)  # the same buffer again: nothing allocated, nothing faulted
    assert b is a and cache.allocations == 1 and cache.kept_bytes == 0
    flat.fill_(7.0)
    assert view.tolist() == [7.0, 7.0, 7.0]  # the old view reads the refilled storage
    flat.untyped_storage().resize_(0)
    cache.give_back(b)
    other = torch.empty(24)
    other.untyped_storage().resize_(0)
    c = cache.lend(other, 96)  # another size: a new buffer; a is still kept
    other.untyped_storage().resize_(0)
    cache.give_back(c)  # 32 + 96 > keep_bytes: c is freed, not kept
    assert cache.allocations == 2 and cache.kept_bytes == 32 and cache.peak_kept_bytes == 32


def _made_per_step(engine, opt, allocations, check=None) -> list[int]:
    """How much ``allocations()`` grew during each of three steps of a tiny GPT-2 batch
    (``check()`` runs after each step)."""
    import torch

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    made = []
    for _ in range(3):
        before = allocations()
        engine(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        made.append(allocations() - before)
        if check is not None:
            check()
    return made


def test_nvme_gathers_reuse_buffers_after_the_first_step(tmp_path):
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.sharding.buffers import gather_cache_bytes

    model = tiny_gpt2(seed=0, layers=4)
    config = {"stage": 3, "offload_param": "nvme", "nvme_path": str(tmp_path)}
    # Gathers read the file here (mapping it needs no buffer: see the test below).
    engine = zerotune.shard(model, {**config, "prefetch_bytes": 0, "map_param_file": False})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    cache = engine.pool.gather_cache
    sizes = [u.gathered_bytes for u in engine.units if not u.persistent and u.numel]
    assert (
        cache.keep_bytes
        == gather_cache_bytes(sizes, 0)
        == 2 * max(n for n in sizes if sizes.count(n) >= 2)
    )
    made = _made_per_step(engine, opt, lambda: cache.allocations)
    # The first step allocates each buffer the units need at once; then every gather reuses
    # a kept one (here two block-sized buffers hold whatever is released, the embeddings and
    # the final norm being smaller than a block).
    assert made[0] >= 2 and made[1:] == [0, 0], made
    report = engine.memory_report()
    assert 0 < report["gather_cache"] <= cache.keep_bytes
    engine.close()


def test_nvme_gathers_map_the_parameter_file(tmp_path):
    """At world size 1 on a CPU a gather maps the parameter file's pages (copy-on-write):
    no gather buffer is ever made or kept, the mapping shows what the optimizer wrote,
    a write into a gathered parameter never reaches the file, the mapping goes with the
    release, and training equals the read path bit for bit."""
    import torch
    from conftest import tiny_gpt2

    import zerotune

    def run(mapped: bool):
        model = tiny_gpt2(seed=0, layers=4)
        config = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"}
        root = tmp_path / str(mapped)
        root.mkdir()
        engine = zerotune.shard(model, {**config, "nvme_path": str(root), "map_param_file": mapped})
        opt = zerotune.ZeroAdamW(engine, lr=1e-3)
        made = _made_per_step(engine, opt, lambda: engine.pool.gather_cache.allocations)
        return engine, made, engine.full_state_dict()

    engine, made, weights = run(True)
    _, made_read, weights_read = run(False)
    assert made == [0, 0, 0] and made_read[0] > 0, (made, made_read)
    assert engine.pool.gather_cache.keep_bytes == 0
    assert engine.memory_report()["gather_cache"] == 0
    for name, w in weights_read.items():
        assert torch.equal(weights[name], w), name
    block = next(u for u in engine.units if u.name == "transformer.h.0")
    assert block.params.mapped
    pid_maps = "/proc/self/maps"
    swap_path = str(block.params.extent.file.path)
    with engine.gathered([block]):
        assert sum(swap_path in line for line in open(pid_maps)) == 1
        p = block.slots[0].param
        expected = weights[block.slots[0].name]
        assert torch.equal(p.data, expected)  # the master the optimizer wrote
        p.data.add_(1.0)  # a private page now; the file keeps the master
    assert sum(swap_path in line for line in open(pid_maps)) == 0  # unmapped on release
    # The optimizer writes the new master into those pages: a unit gathered meanwhile
    # keeps the values it had (it gets a copy of its own first).
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    engine(input_ids=ids, labels=ids).loss.backward()
    opt_stats = engine.optimizer.store.bytes_written
    with engine.gathered([block]):
        engine.optimizer.step()
        assert torch.equal(block.slots[0].param.data, expected)
    with engine.gathered([block]):
        assert not torch.equal(block.slots[0].param.data, expected)
    # The master is updated in the parameter file's pages, the two moments (regions of
    # whole pages, O_DIRECT) are written.
    trainable = [u for u in engine.units if u.trainable]
    pages = sum(-(-u.shard_numel * 4 // 4096) for u in trainable)
    assert engine.optimizer.store.bytes_written - opt_stats == 2 * 4096 * pages
    engine.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_master_is_updated_in_the_page_cache(overlap, tmp_path, monkeypatch, caplog):
    """With fp32 moments the step updates the master in the parameter file's pages through
    a shared mapping (see [Note: the master updated in the page cache]): bit for bit what
    the copying path gives (losses, weights, moments), with the master's bytes neither read
    nor written through staging but asked of the page cache ahead (each chunk's exactly,
    once a step); buffered files take 4 MiB blocks; a kernel without
    MADV_POPULATE_WRITE, or a filesystem refusing shared mappings, makes the store copy the
    chunks started after the first one, with one log line and the same results."""
    import errno
    import inspect
    import logging

    import torch
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.memory.aio import SwapFile
    from zerotune.optim import state_store

    def refuse(self, offset, nbytes):
        raise OSError(errno.ENODEV, "No such device")

    asked = []
    will_need = SwapFile.will_need

    def spy(self, offset, nbytes):
        if inspect.currentframe().f_back.f_code.co_name == "start":  # a step's chunk, not a gather
            asked.append((offset, nbytes))
        return will_need(self, offset, nbytes)

    monkeypatch.setattr(SwapFile, "will_need", spy)

    def run(name, in_place=True, populate=None, shared_maps=True):
        asked.clear()
        if populate is not None:
            monkeypatch.setattr(state_store, "_MADV_POPULATE_WRITE", populate)
        if not shared_maps:  # a filesystem that maps files copy-on-write only
            monkeypatch.setattr(SwapFile, "map_shared", refuse)
        root = tmp_path / name
        root.mkdir()
        config = {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "nvme_path": str(root),
            "staging_bytes": 3 * 16 * 4096 * 3,  # several chunks per unit
        }
        engine = zerotune.shard(tiny_gpt2(seed=0, layers=2), config)
        opt = zerotune.ZeroAdamW(engine, lr=1e-2)
        opt.store.in_place = in_place
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 96, (2, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            if overlap:
                with opt.overlapped():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        states = [engine.unit_state(u) for u in engine.units if u.trainable]
        out = (losses, engine.full_state_dict(), states, opt.store.bytes_read, opt.store.in_place)
        swap = engine.swap
        offsets = [e.offset for (kind, _), e in swap.extents.items() if kind == "param"]
        blocks = {kind: f.block_bytes for kind, f in swap.files.items()}
        masters = sum(u.shard_numel * 4 for u in engine.units if u.trainable)
        extents = [u.params.extent for u in engine.units if u.trainable]
        inside = [
            any(e.offset <= a and a + n <= e.offset + e.nbytes for e in extents) for a, n in asked
        ]
        engine.close()
        return out, offsets, blocks, (masters, sorted(asked), all(inside))

    (losses, weights, states, read, kept), offsets, blocks, (masters, asked, inside) = run(
        "in-place"
    )
    assert kept and len(offsets) > 3
    assert inside and len(set(asked)) > len(offsets)  # several chunks per unit
    if not overlap:  # (overlapped, reads ahead given up ask again)
        assert sum(n for _, n in asked) == 3 * masters and len(set(asked)) * 3 == len(asked)
    assert blocks == {"param": 4 << 20, "optim": 1 << 20}, blocks
    copied, _, _, (_, copied_asked, _) = run("copied", in_place=False)
    with caplog.at_level(logging.INFO, logger="zerotune.optim.state_store"):
        unsupported, *_ = run("no-populate", populate=0x7FFF)  # EINVAL, as an old kernel
        unmapped, *_ = run("no-shared-maps", shared_maps=False)
    messages = [r.message for r in caplog.records]
    assert len(messages) == 2, messages
    assert "MADV_POPULATE_WRITE" in messages[0] and "cannot be mapped shared" in messages[1]
    for other in (copied, unsupported, unmapped):
        assert other[0] == losses
        for name, w in weights.items():
            assert torch.equal(other[1][name], w), name
        for mine, theirs in zip(states, other[2]):
            for key, value in mine.items():
                assert torch.equal(theirs[key], value), key
        assert not other[4]
        assert other[3] > read
    assert copied_asked == []  # the copying path reads the master through staging
    if not overlap:  # (overlapped, reads ahead given up add bytes that depend on timing)
        assert copied[3] - read == 3 * masters  # each master chunk once a step


def test_parameter_extents_of_2_mib_or_more_start_on_2_mib_boundaries():
    """Large extents of the parameter file are aligned for huge page-cache pages (see [Note:
    huge page-cache pages]); small ones, and every extent of the other files, are packed on
    4 KiB boundaries; the plan the estimate uses lays the files out the same way."""
    from zerotune.memory.swap import extent_align, extent_layout
    from zerotune.sharding.plan import SwapPlan

    MiB = 1 << 20
    sizes = {0: 5000, 1: 3 * MiB, 2: 100, 3: 2 * MiB, 4: 2 * MiB - 4096}
    offsets, total = extent_layout(sizes, extent_align("param"))
    assert offsets == {
        0: (0, 8192), 1: (2 * MiB, 3 * MiB), 2: (5 * MiB, 4096), 3: (6 * MiB, 2 * MiB),
        4: (8 * MiB, 2 * MiB - 4096),
    }  # fmt: skip
    assert total == 10 * MiB - 4096
    packed, packed_total = extent_layout(sizes, extent_align("optim"))
    assert packed[1] == (8192, 3 * MiB) and packed_total == 8192 + 7 * MiB + 4096 - 4096
    plan = SwapPlan(sizes={"param": sizes, "optim": sizes})
    assert plan.file_bytes("param") == total and plan.file_bytes("optim") == packed_total


def test_overlapped_updates_find_their_units_released(tmp_path, monkeypatch):
    """An overlapped step updates each unit once its backward is over, after the unit let
    go of its mapping of the parameter file: no unit copies its weights to keep them
    private (it did, for most blocks, when the update ran before the release: a fresh
    copy of a block's weights each step)."""
    import torch
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.sharding.unit import Unit, UnitState

    copies = []
    keep_private = Unit.keep_private

    def counted(unit):
        if unit._mapped and unit.state is not UnitState.SHARDED:
            copies.append(unit.name)
        keep_private(unit)

    monkeypatch.setattr(Unit, "keep_private", counted)
    model = tiny_gpt2(seed=0, layers=4)
    config = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"}
    engine = zerotune.shard(model, {**config, "nvme_path": str(tmp_path)})
    assert all(u.params.mapped for u in engine.units if u.placement.params == "nvme")
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    launched = []
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 8), generator=g)
        with opt.overlapped():
            engine(input_ids=ids, labels=ids).loss.backward()
        launched.append(len(opt._overlap.launched))
        opt.step()
    engine.close()
    assert min(launched) >= 4, launched  # the blocks were updated during backward
    assert copies == []


# ------------------------------------------------------------------ overlapped step
OVERLAP_CONFIGS = [
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "grad_host_bytes": 0},
    {"stage": 3, "offload_optimizer": "nvme", "optim_state_bits": 8},
    {"stage": 2, "offload_optimizer": "cpu"},
    # The arithmetic on the store's update thread, as on an accelerator; the norm tracked.
    {"stage": 2, "offload_optimizer": "cpu", "thread": True},
    {"stage": 3, "offload_optimizer": "cpu", "thread": True},
]


def _record_threads(opt, names: set) -> None:
    """Add to ``names`` the thread that runs each chunk's arithmetic, made slow enough that
    updates are still under way when ``step()`` returns (so the step carries, whatever the
    machine's load)."""
    begin = opt.begin_chunk

    def spied(*args):
        math, finish = begin(*args)

        def recorded():
            names.add(threading.current_thread().name)
            time.sleep(0.02)
            math()

        return recorded, finish

    opt.begin_chunk = spied


def run_overlapped(rank, world, nvme_root, configs):
    import torch.distributed as dist
    from harness import LR, WD, batches, build, loss_of, no_decay_groups

    import zerotune

    out = []
    for config in configs:
        config = dict(config)
        clip = config.pop("clip", None)  # overlapped(clipping=True) and clip_grad_norm_
        thread = config.pop("thread", None)  # opt.update_thread
        if "nvme" in (config.get("offload_param"), config.get("offload_optimizer")):
            config.update(nvme_path=nvme_root, staging_bytes=3 * 16 * 4096 * 3)
        model = build("gpt2")
        groups = no_decay_groups(model, WD)
        engine = zerotune.shard(model, config)
        opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
        opt.update_thread = thread
        threads, carried = set(), []
        if thread:
            _record_threads(opt, threads)
        per_rank = 12 // world
        losses, early, norms, tracked = [], [], [], []
        for ids in batches("gpt2"):
            mine = ids[rank * per_rank : (rank + 1) * per_rank]
            loss = loss_of(engine, mine[: per_rank // 2]) / 2  # accumulation: first half
            engine.backward(loss)
            total = loss.detach()
            with opt.overlapped(clipping=clip is not None, track_norm=thread is not None):
                loss = loss_of(engine, mine[per_rank // 2 :]) / 2
                engine.backward(loss)
            early.append(len(opt._overlap.launched))  # units launched during backward
            if clip is not None:
                norms.append(float(opt.clip_grad_norm_(clip)))
            tracked.append(opt.step().grad_norm)
            carried.append(opt._carry is not None)
            total = total + loss.detach()
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total) / world)
        weights = engine.full_state_dict()
        grad_file = engine.swap.files.get("grad") if engine.swap is not None else None
        held_peak = engine.memory_report()["grads_held_peak"]
        engine.close()
        out.append(
            {
                "losses": losses,
                "weights": weights,
                "early": early,
                "grad_file_bytes": sum(u.shard_numel * 4 for u in engine.units if u.grads.on_disk)
                if grad_file is not None
                else 0,
                "held_peak": held_peak,
                "norms": norms,
                "tracked": tracked,
                "threads": threads,
                "carried": carried,
            }
        )
    return out


# overlapped(clipping=True) with clip_grad_norm_: gradient shards bound for NVMe partly kept
# in memory for the update (grad_host_bytes: the first units in update order), partly
# written and read back; at stage 2 all written.
CLIPPED_CONFIGS = [
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "grad_host_bytes": 2**15},
    {"stage": 2, "offload_optimizer": "nvme", "grad_host_bytes": 0},
    {"stage": 3, "offload_optimizer": "cpu", "thread": True},
]


@pytest.mark.parametrize("world", [2])  # world 1 runs the same hooks without collectives
def test_overlapped_step_matches_plain_adamw(world, tmp_path):
    import numpy as np
    from harness import MAX_NORM, train_reference

    ref = train_reference("gpt2", clip=float("inf"))  # its norms, never clipped
    clipped = train_reference("gpt2", clip=MAX_NORM)
    assert min(clipped["norms"]) > MAX_NORM  # clipping clips every step
    configs = OVERLAP_CONFIGS + [dict(c, clip=MAX_NORM) for c in CLIPPED_CONFIGS]
    results = run_world(world, run_overlapped, str(tmp_path), configs)
    for config, res in zip(configs, results[0]):
        # Most units were launched while backward still ran (all but those whose gradient
        # is final only at the end: the tied embedding's unit, the root).
        assert min(res["early"]) >= 3, (config, res["early"])
        if config.get("thread"):
            assert res["threads"] == {"zerotune-update_0"}, res["threads"]
            np.testing.assert_allclose(
                res["tracked"], (clipped if "clip" in config else ref)["norms"], rtol=1e-5
            )
            if "clip" in config:  # every update waits for the norm: all carried
                assert res["carried"] == [True] * len(res["carried"]), res["carried"]
        else:
            assert res["threads"] == set()
        bits8 = config.get("optim_state_bits") == 8
        rtol = 2e-2 if bits8 else 1e-5  # 8-bit moments: bitsandbytes' quantization error
        if "clip" in config:
            np.testing.assert_allclose(res["norms"], clipped["norms"], rtol=1e-5)
            np.testing.assert_allclose(res["losses"], clipped["losses"], rtol=rtol)
            for name, w in clipped["weights"].items():
                np.testing.assert_allclose(
                    np.asarray(res["weights"][name]), w.numpy(), rtol=1e-5, atol=2e-5
                )
            continue
        np.testing.assert_allclose(res["losses"], ref["losses"], rtol=rtol, err_msg=str(config))
        if bits8:
            continue
        for name, w in ref["weights"].items():
            np.testing.assert_allclose(
                np.asarray(res["weights"][name]), w.numpy(), rtol=1e-5, atol=2e-5, err_msg=name
            )


def test_overlapped_step_runs_updates_queued_while_writes_drain(tmp_path, monkeypatch):
    """The step's pipeline runs across units, and units are queued while it waits: reads
    report done at once and writes only once waited, so the pipeline is caught draining
    its writes with nothing queued, units are queued meanwhile, and ``step()`` closes the
    queue. Every unit must still be updated (an early version returned there and lost
    them): same losses and weights as plain AdamW, at world size 1, with gradients in
    memory and with gradients on NVMe (then final shards are held in memory for their
    update where they can be: fewer gradient-file writes than two micro-batches')."""
    import numpy as np
    from harness import train_reference

    from zerotune.memory import aio

    monkeypatch.setattr(aio.IOHandle, "done", lambda self: self._impl is None or self._op == "read")
    written = {"grad": 0}
    real_write = aio.SwapFile.write

    def counting_write(self, tensor, offset):
        if self.path.name.startswith("grad"):
            written["grad"] += tensor.numel() * tensor.element_size()
        return real_write(self, tensor, offset)

    monkeypatch.setattr(aio.SwapFile, "write", counting_write)
    ref = train_reference("gpt2", clip=None)
    configs = [dict(OVERLAP_CONFIGS[0]), dict(OVERLAP_CONFIGS[0], grad_host_bytes=2**30)]
    for config in configs:
        written["grad"] = 0
        (res,) = run_overlapped(0, 1, str(tmp_path), [config])
        np.testing.assert_allclose(res["losses"], ref["losses"], rtol=1e-5, err_msg=str(config))
        for name, w in ref["weights"].items():
            np.testing.assert_allclose(
                np.asarray(res["weights"][name]), w.numpy(), rtol=1e-5, atol=2e-5, err_msg=name
            )
        if config["grad_host_bytes"] == 0:  # gradients on NVMe
            assert res["grad_file_bytes"] > 0
            # the first micro-batch of every step wrote its gradients; of the last, shards
            # held for their update (one at a time, and the embedding's) were not written
            once = len(ref["losses"]) * res["grad_file_bytes"]
            assert once <= written["grad"] < 2 * once, (written, once)
            assert res["held_peak"] > 0
        else:
            assert written["grad"] == 0 and res["held_peak"] == 0


def test_overlapped_step_reads_ahead_of_backward(tmp_path):
    """From the second overlapped step on, the NVMe pipeline reads the moments
    of the units the last step launched first, in its order, before backward finishes
    them: on entering ``overlapped()`` the reads of the first spare slots are issued.
    When the order is wrong (reversed here on some steps) reads ahead are given up and
    made again, more bytes are read, and training is still exactly plain AdamW's; every
    staging slot is free after each step."""
    import numpy as np
    from harness import LR, WD, batches, build, loss_of, no_decay_groups, train_reference

    import zerotune
    from zerotune.memory.swap import round_up

    ref = train_reference("gpt2", clip=None)
    config = dict(OVERLAP_CONFIGS[0], nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    model = build("gpt2")
    groups = no_decay_groups(model, WD)  # before sharding empties the parameters
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    store, staging = opt.store, engine.staging
    slots = store.layout.slots
    assert slots > 3 and store.layout.grads_on_disk
    losses, ahead, step_reads = [], [], []
    for step, ids in enumerate(batches("gpt2")):
        if step in (4, 7):
            opt.launch_order.reverse()  # a wrong guess: the embedding first
        units = [engine.units[i] for i in opt.launch_order]
        expected = [(u, c) for u in units for c in store.chunks(u)]
        read0 = store.bytes_read
        with opt.overlapped(carry=False):  # each step's reads counted within it
            ahead.append(store.bytes_read - read0)
            loss = loss_of(engine, ids)
            engine.backward(loss)
        opt.step()
        step_reads.append(store.bytes_read - read0)
        losses.append(float(loss.detach()))
        assert len(staging._free) * staging.slot == staging.allocated, step  # all given back
        # The chunks read ahead at entry: two page-rounded moments (the master is updated
        # where it is, in the parameter file's pages).
        first = expected[: slots - 2]
        want = sum(2 * round_up(4 * (c1 - c0)) for _, (c0, c1) in first)
        assert ahead[-1] == want, (step, ahead[-1], want)
    assert ahead[0] == 0 and min(ahead[1:]) > 0
    # Guessing wrong costs reads (a read ahead given up for launched work), not results.
    normal, wrong = max(step_reads[2], step_reads[3]), (step_reads[4], step_reads[7])
    assert min(wrong) >= normal and max(wrong) > normal, step_reads
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    weights = engine.full_state_dict()
    for name, w in ref["weights"].items():
        np.testing.assert_allclose(
            np.asarray(weights[name]), w.numpy(), rtol=1e-5, atol=2e-5, err_msg=name
        )
    engine.close()


def test_reads_ahead_of_units_never_launched_are_given_up(tmp_path):
    """Units expected but not launched before the feed closes are not updated: their
    state on NVMe is unchanged and the staging slots come back."""
    import torch
    from harness import build

    import zerotune
    from zerotune.memory.swap import round_up
    from zerotune.optim.state_store import IDLE, Feed

    config = dict(OVERLAP_CONFIGS[0], nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    engine = zerotune.shard(build("gpt2"), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    store, staging = opt.store, engine.staging
    units = [u for u in engine.units if u.trainable]
    expected = [(u, c0, c1) for u in units for c0, c1 in store.chunks(u)]
    assert len(expected) > store.layout.slots
    before = {u.index: engine.unit_state(u) for u in units}

    def update(*args):
        raise AssertionError("a unit that was not launched was updated")

    feed = Feed(closed=False, expected=expected)
    job = store.pipeline(feed, update)
    read0 = store.bytes_read
    assert next(job) is IDLE
    first = expected[: store.layout.slots - 2]  # two slots stay free for launched work
    n = [c1 - c0 for _, c0, c1 in first]  # two page-rounded moments (the master stays)
    assert store.bytes_read - read0 == sum(2 * round_up(4 * k) for k in n)
    feed.closed = True
    for handle in job:
        handle.wait()
    assert len(staging._free) * staging.slot == staging.allocated
    for u in units:
        after = engine.unit_state(u)
        for key, value in before[u.index].items():
            assert torch.equal(value, after[key]), (u.name, key)
    engine.close()


def test_a_failed_overlapped_update_is_not_a_step(tmp_path, monkeypatch):
    """An update failing during an overlapped backward (here: an exception from the
    update, with reads ahead in flight) surfaces from backward; ``step()`` then refuses
    to pass for a finished step, and every staging slot has come back."""
    from harness import batches, build, loss_of

    import zerotune

    config = dict(OVERLAP_CONFIGS[0], nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    engine = zerotune.shard(build("gpt2"), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    staging = engine.staging
    ids = batches("gpt2", 1)[0]
    with opt.overlapped(carry=False):  # every update done before the failing ones
        engine.backward(loss_of(engine, ids))
    opt.step()  # a launch order to read ahead from
    real, calls = opt.update_chunk, []

    def failing(*args):
        calls.append(args[0].index)
        if len(calls) == 2:
            raise ValueError("update failed on purpose")
        return real(*args)

    monkeypatch.setattr(opt, "update_chunk", failing)
    # Every transfer finishes when asked about: the pump never leaves an update for later,
    # so the second one runs (and fails) inside backward whatever the disk's speed.
    from zerotune.memory.aio import IOHandle

    monkeypatch.setattr(IOHandle, "done", lambda self: (self.wait(), True)[1])
    with pytest.raises(ValueError, match="on purpose"), opt.overlapped():
        engine.backward(loss_of(engine, ids))
    with pytest.raises(RuntimeError, match="update pipeline failed during backward"):
        opt.step()
    assert len(staging._free) * staging.slot == staging.allocated
    engine.close()


@pytest.mark.parametrize(
    "config",
    [
        # fp32: the gradients left in the parameters, kept by zero_grad for the carried update
        {"stage": 3, "offload_optimizer": "cpu"},
        {"stage": 3, "offload_optimizer": "cpu", "dtype": "bf16"},  # the fused bf16 copy
        {"stage": 3, "offload_optimizer": "cpu", "optim_state_bits": 8},  # 8-bit moments
    ],
    ids=["fp32", "bf16", "8bit"],
)
def test_updates_on_the_update_thread_equal_those_on_the_calling_thread(config):
    """Bit for bit: the same chunks, kernels and arguments on either thread ([Note: host
    updates off the launching thread]), with the step carried into the next forward."""
    import numpy as np

    thread, inline = (
        run_world(1, run_overlapped, "", [dict(config, thread=t)])[0][0] for t in (True, False)
    )
    assert thread["threads"] == {"zerotune-update_0"} and inline["threads"] == set()
    assert thread["losses"] == inline["losses"] and thread["tracked"] == inline["tracked"]
    assert thread["carried"] == [True] * len(thread["carried"]), thread["carried"]
    assert inline["carried"] == [False] * len(inline["carried"])  # nothing to wait for
    for name, w in inline["weights"].items():
        np.testing.assert_array_equal(np.asarray(thread["weights"][name]), np.asarray(w), name)


def test_a_failed_update_on_the_update_thread_is_not_a_step():
    """An update whose arithmetic fails on the update thread fails the call that finds it
    (backward's pump or ``step()``); a step after a failure found in backward refuses."""
    from harness import batches, build, loss_of

    import zerotune

    engine = zerotune.shard(build("gpt2"), {"stage": 3, "offload_optimizer": "cpu"})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    opt.update_thread = True
    begin, calls = opt.begin_chunk, []

    def failing(*args):
        math, finish = begin(*args)
        calls.append(args[0].index)
        nth = len(calls)

        def maybe():
            if nth == 2:
                raise ValueError("update failed on purpose")
            math()

        return maybe, finish

    opt.begin_chunk = failing
    ids = batches("gpt2", 1)[0]
    try:
        with opt.overlapped(carry=False):
            engine.backward(loss_of(engine, ids))
    except ValueError as exc:
        assert "on purpose" in str(exc)
        with pytest.raises(RuntimeError, match="update pipeline failed during backward"):
            opt.step()
    else:
        with pytest.raises(ValueError, match="on purpose"):
            opt.step()
    assert len(calls) >= 2
    thread = opt.store.thread
    assert thread is not None and thread.submit(lambda: None).wait() is None  # idle, alive
    engine.close()


def test_overlapped_step_refuses_what_it_cannot_do(tmp_path):
    from harness import batches, build, loss_of

    import zerotune

    ids = batches("gpt2", 1)[0]
    engine = zerotune.shard(build("gpt2"), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    with opt.overlapped():
        engine.backward(loss_of(engine, ids))
    with pytest.raises(RuntimeError, match="clip_grad_norm_ after an overlapped backward"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="call step\\(\\) before"):
        with opt.overlapped():
            pass
    opt.step()
    with engine.no_sync(), pytest.raises(RuntimeError, match="not in no_sync"):
        with opt.overlapped():
            pass
    for config, message in (({"stage": 1}, "stage 1"), ({"stage": 3, "dtype": "fp16"}, "fp16")):
        engine = zerotune.shard(build("gpt2"), config)
        opt = zerotune.ZeroAdamW(engine, lr=1e-3)
        with pytest.raises(RuntimeError, match=message), opt.overlapped():
            pass


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp32_master_lives_in_the_parameter_file(dtype, tmp_path):
    """With fp32 compute and both tiers on NVMe the parameter extent is the master: the optim
    extent holds the two moments only, the step writes no separate parameter copy, and the
    parameters gathered after a step are the master bit for bit. bf16 keeps three regions
    and writes its compute copy."""
    import torch
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.memory.swap import round_up
    from zerotune.sharding.unit import Unit

    config = {
        "stage": 3,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "nvme_path": str(tmp_path),
        "staging_bytes": 3 * 16 * 4096 * 3,  # several chunks per unit
        "dtype": dtype,
    }
    engine = zerotune.shard(tiny_gpt2(seed=0, layers=2), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    swapped = [u for u in engine.units if u.placement.params == "nvme" and u.trainable]
    assert swapped
    regions = 2 if dtype == "fp32" else 3
    for u in engine.units:
        if u.trainable:
            want = (regions if u.placement.params == "nvme" else 3) * round_up(u.shard_numel * 4)
            assert engine.swap.extent("optim", u.index).nbytes == want, u.name
    optim_file = engine.swap.files["optim"]
    assert os.path.getsize(optim_file.path) == sum(
        round_up(engine.swap.extent("optim", u.index).nbytes) for u in engine.units if u.trainable
    )

    stored = []
    original = Unit.store_shard

    def counting(self, values, give_back=None):
        stored.append(self.index)
        return original(self, values, give_back)

    Unit.store_shard = counting
    try:
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
        before = [engine.unit_state(u)["master"].clone() for u in swapped]
        engine(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    finally:
        Unit.store_shard = original
    assert stored == ([] if dtype == "fp32" else [u.index for u in swapped])
    for u, old in zip(swapped, before):
        master = engine.unit_state(u)["master"]
        assert not torch.equal(master, old), u.name  # the step changed it
        with engine.gathered([u]):
            flat = torch.cat([s.param.detach().reshape(-1).float() for s in u.slots])
        want = master[: u.numel] if dtype == "fp32" else master[: u.numel].bfloat16().float()
        assert torch.equal(flat, want), u.name
    engine.close()


@pytest.mark.parametrize("clipped", [False, True], ids=["step-after-backward", "clipped-overlap"])
def test_host_pool_keeps_only_buffers_that_recur(tmp_path, clipped):
    """With offload the reduce/copy pool keeps, for reuse, the gradient buffers of the sizes
    several units share (the blocks), as many as were in use at once (the NVMe writes in
    flight; with a clipped overlapped step also the shards kept in memory until the next
    forward); a size one unit has (the embedding's gradient) is given back after use
    instead of staying resident."""
    import torch
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.sharding.plan import plan_units

    config = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
              "nvme_path": str(tmp_path), "grad_host_bytes": 0}  # fmt: skip
    layers = 8  # more than the writes in flight, so that held shards outnumber them
    plans = plan_units(tiny_gpt2(seed=0, layers=layers), zerotune.ZeroConfig.from_dict(config), 1)
    sizes = [u.padded * 4 for u in plans if u.trainable and u.numel]
    if clipped:  # room for all but one block's shard in memory
        config["grad_host_bytes"] = sum(sizes) - max(sizes) - 1
    engine = zerotune.shard(tiny_gpt2(seed=0, layers=layers), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    pool = engine.pool
    assert sizes == [u.padded_numel * 4 for u in engine.units if u.trainable and u.numel]
    block = max(set(sizes), key=sizes.count)
    assert pool.keep_sizes == {n for n in sizes if sizes.count(n) >= 2} == {block}
    # Held for a clipped step, a unit of one parameter keeps that parameter's own gradient.
    one_off = [
        u.padded_numel * 4
        for u in engine.units
        if u.trainable and u.numel and sizes.count(u.padded_numel * 4) == 1
        if not (clipped and u.one_parameter)
    ]

    def check():
        assert pool.in_use_bytes == 0
        assert pool.allocated_bytes == pool.free_bytes
        kept = [n * 4 for (n, dtype), bufs in pool._free.items() for _ in bufs]
        most = pool.most_in_use[(block // 4, torch.float32)]
        assert kept == [block] * most, (kept, most)
        # The clipped step held all blocks' shards but the last one's (written as soon as
        # its share of the norm is read) at once.
        assert most >= layers - 1 if clipped else most <= pool.writes.limit + 1, most

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    made = []
    for _ in range(3):
        before = pool.allocations
        loss = engine(input_ids=ids, labels=ids).loss
        with opt.overlapped(clipping=True) if clipped else contextlib.nullcontext():
            loss.backward()
        if clipped:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        opt.settle()  # a carried update finishes before the pool is checked
        made.append(pool.allocations - before)
        check()
    # After the first step only the one-off sizes are made again, once each a step; the
    # block-sized buffers are all reused.
    assert made[1] == made[2] == len(one_off), (made, one_off)
    engine.close()


# ------------------------------------------------- a step carried into the next forward
def _lazy_free_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        line = next(x for x in f if x.startswith("LazyFree:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux only")
def test_kept_pool_buffers_are_memory_the_kernel_may_take_back():
    """A buffer the pool keeps for reuse is marked free for the kernel to reclaim under
    memory pressure (MADV_FREE): counted as LazyFree until reused; its contents are
    whatever the next user writes (zeros if the kernel took the pages)."""
    import torch

    from zerotune.memory.pool import BufferPool

    numel = 4 << 20  # 16 MiB of fp32
    pool = BufferPool("cpu")
    pool.keep_only({numel * 4})
    bufs = [pool.acquire(numel, torch.float32).fill_(1.0) for _ in range(2)]
    before = _lazy_free_bytes()
    for b in bufs:
        pool.release(b)
    # All of it but the odd page at a huge page's edge.
    assert _lazy_free_bytes() - before >= 0.99 * 2 * numel * 4
    again = pool.acquire(numel, torch.float32)
    assert any(again.data_ptr() == b.data_ptr() for b in bufs)  # the same memory, reused
    again.fill_(2.0)
    assert bool((again == 2.0).all())
    pool.release(again)


def _train_carried(tmp_path, monkeypatch, carry: bool, steps: int = 6, config=None, clip=None):
    """World size 1, both tiers on NVMe: forward outside ``overlapped(track_norm=True)``,
    an LR scheduler stepped right after each ``step()``. I/O reports itself done only once
    waited for, so the pipeline falls behind during backward and ``step()`` always has a
    backlog. Returns losses, the units each ``step()`` left unfinished, every unit's state read
    right after ``step()``, the final weights, the embeddings previewed, the norms, and the
    bytes of gradient shards held at the end of each backward."""
    import torch
    from harness import LR, WD, batches, build, loss_of, no_decay_groups

    import zerotune
    from zerotune.memory.aio import IOHandle
    from zerotune.optim.zero_adam import ZeroAdamW

    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    previews = []  # embedding lookups served before their unit's update (rows ahead)
    preview_rows = ZeroAdamW.preview_rows

    def counted(self, unit, ids, weight):
        previews.append(unit.name)
        preview_rows(self, unit, ids, weight)

    monkeypatch.setattr(ZeroAdamW, "preview_rows", counted)
    tmp_path.mkdir()
    config = dict(config or OVERLAP_CONFIGS[0], nvme_path=str(tmp_path))
    config.setdefault("staging_bytes", 3 * 16 * 4096 * 3)
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.15 * s)
    losses, left, states, norms, held = [], [], [], [], []
    for ids in batches("gpt2", steps):
        loss = loss_of(engine, ids)
        with opt.overlapped(carry=carry, track_norm=True, clipping=clip is not None):
            loss.backward()
        held.append(engine.host_pool.held_grads.now)  # gradient shards kept for the step
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
        else:
            norms.append(opt.step().grad_norm)
        sched.step()
        opt.zero_grad()
        left.append(0 if opt._carry is None else len(opt._carry.unfinished))
        losses.append(float(loss.detach()))
    states = {u.index: engine.unit_state(u) for u in engine.units if u.trainable}
    assert opt._carry is None  # reading the state finished the carried updates
    weights = engine.full_state_dict()
    staging = engine.staging
    assert len(staging._free) * staging.slot == staging.allocated  # every slot came back
    engine.close()
    return losses, left, states, weights, previews, norms, held


def _plain_scheduled(max_norm: float):
    """Plain AdamW over 6 batches with the scheduler ``_train_carried`` uses, clipping the
    gradient norm at ``max_norm`` (inf: the norm only): the model, losses and norms."""
    import torch
    from harness import LR, WD, batches, build, loss_of, no_decay_groups

    model = build("gpt2")
    opt = torch.optim.AdamW(no_decay_groups(model, WD), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.15 * s)
    losses, norms = [], []
    for ids in batches("gpt2", 6):
        loss = loss_of(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses, norms


def test_a_step_carried_into_the_next_forward_matches_plain_adamw(tmp_path, monkeypatch):
    """``step()`` returns with updates still queued (the units backward finished last) and
    the next forward finishes each before gathering it: losses and weights are those of
    plain AdamW with the same scheduler (whose change right after ``step()`` must not
    reach the carried updates), and the state read after the last step is bit for bit
    that of steps finished in ``step()``."""
    import numpy as np
    import torch

    model, ref_losses, ref_norms = _plain_scheduled(float("inf"))

    losses, left, states, weights, previews, norms, _ = _train_carried(
        tmp_path / "a", monkeypatch, carry=True
    )
    # The gradient norm is there at step(): the carried updates' part summed there.
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert min(left) > 0, left  # every step carried updates into the next forward
    # The next forward's lookups read the embeddings' new rows before their whole update.
    assert previews.count("transformer.wte") == len(left) - 1, previews
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(
            np.asarray(weights[name]), p.detach().numpy(), rtol=1e-5, atol=2e-5, err_msg=name
        )
    plain = _train_carried(tmp_path / "b", monkeypatch, carry=False)
    assert max(plain[1]) == 0
    assert losses == plain[0]
    np.testing.assert_allclose(norms, plain[5], rtol=1e-6)
    for index, state in states.items():
        for key, value in state.items():
            assert torch.equal(value, plain[2][index][key]), (index, key)


def test_a_clipped_overlapped_step_matches_plain_adamw_with_clipping(tmp_path, monkeypatch):
    """World size 1, both tiers on NVMe, gradient shards on NVMe (the first units' kept in
    memory): with ``overlapped(clipping=True)`` the norm is known at the end of backward
    and every update runs after ``step()``, carried into the next forward. Losses, norms
    and weights are those of plain AdamW clipping every step, with a scheduler."""
    import numpy as np
    from harness import MAX_NORM, build

    from zerotune.estimate import estimate

    model, ref_losses, ref_norms = _plain_scheduled(MAX_NORM)
    assert min(ref_norms) > MAX_NORM  # clipping clips every step

    config = dict(OVERLAP_CONFIGS[0], grad_host_bytes=2**16)
    losses, left, _, weights, previews, norms, held = _train_carried(
        tmp_path / "a", monkeypatch, carry=True, config=config, clip=MAX_NORM
    )
    assert min(left) > 0, left  # every step carried updates into the next forward
    assert previews.count("transformer.wte") == len(left) - 1, previews
    # The gradient shards kept in memory from backward to the update: the estimate's line.
    planned = dict(config, nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    plan = estimate(build("gpt2"), dtype="fp32", config=planned, device="cpu", gpu_memory=None)
    kept = plan.option(3, "nvme", "nvme").detail["grads_kept"]["host"]
    assert 0 < kept < 2**16 and held == [kept] * 6, (kept, held)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(
            np.asarray(weights[name]), p.detach().numpy(), rtol=1e-5, atol=2e-5, err_msg=name
        )


def test_a_carried_step_with_8bit_moments_and_gradients_in_memory(tmp_path, monkeypatch):
    """The same with 8-bit moments on NVMe, the parameters and gradients in memory (the
    update then refreshes the parameter shard itself): bit for bit as without carrying."""
    import torch

    config = OVERLAP_CONFIGS[1]
    carried = _train_carried(tmp_path / "a", monkeypatch, carry=True, steps=4, config=config)
    plain = _train_carried(tmp_path / "b", monkeypatch, carry=False, steps=4, config=config)
    assert min(carried[1]) > 0 and max(plain[1]) == 0
    assert carried[0] == plain[0]
    for name, w in plain[3].items():
        assert torch.equal(carried[3][name], w), name


def test_a_carried_update_that_fails_stops_training(tmp_path, monkeypatch):
    """An update failing after ``step()`` (carried into the next forward) comes out of
    that forward, and of every later use, as one error saying the step is incomplete;
    ``close()`` still works and gives every staging slot back."""
    import pytest as _pytest
    from harness import batches, build, loss_of

    import zerotune
    from zerotune.memory.aio import IOHandle

    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    config = dict(OVERLAP_CONFIGS[0], nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    engine = zerotune.shard(build("gpt2"), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    ids = batches("gpt2", 1)[0]
    loss = loss_of(engine, ids)
    with opt.overlapped():
        loss.backward()
    opt.step()
    assert opt._carry is not None and opt._carry.unfinished
    real = opt.update_chunk

    def failing(*args):
        raise ValueError("update failed on purpose")

    monkeypatch.setattr(opt, "update_chunk", failing)
    for _ in range(2):
        with _pytest.raises(RuntimeError, match="failed after step\\(\\).*resume from"):
            loss_of(engine, ids)
    monkeypatch.setattr(opt, "update_chunk", real)
    with _pytest.raises(RuntimeError, match="failed after step"):
        engine.unit_state(engine.units[-1])
    staging = engine.staging
    engine.close()
    assert len(staging._free) * staging.slot == staging.allocated


def test_an_embedding_gathered_for_a_lookup_then_needed_whole(tmp_path, monkeypatch):
    """An embedding gathered for a lookup holds new values only in the looked-up rows; if
    something needs the whole matrix while it is still gathered, its update is finished
    and the matrix read again: equal to the weights of a step finished in ``step()``."""
    import torch
    from harness import batches, build, loss_of

    import zerotune
    from zerotune.memory.aio import IOHandle

    monkeypatch.setattr(IOHandle, "done", lambda self: False)  # backward leaves a backlog
    weights = {}
    for carry in (True, False):
        folder = tmp_path / str(carry)
        folder.mkdir()
        config = dict(OVERLAP_CONFIGS[0], nvme_path=str(folder), staging_bytes=3 * 16 * 4096 * 3)
        engine = zerotune.shard(build("gpt2"), config)
        opt = zerotune.ZeroAdamW(engine, lr=1e-2)
        ids = batches("gpt2", 1)[0]
        loss = loss_of(engine, ids)
        with opt.overlapped(carry=carry):
            loss.backward()
        opt.step()
        (wte,) = [u for u in engine.units if u.name == "transformer.wte"]
        if carry:
            assert wte.update_pending
            engine._pin(wte, ids[:1])  # as the lookup's pre-forward does
            assert wte.previewed and wte.update_pending
            row = int(ids[0, 0])
            looked_up = wte.slots[0].param[row].detach().clone()
            with engine.gathered([wte]):
                weights[carry] = wte.slots[0].param.detach().clone()
            wte.unpin()
            assert not wte.update_pending and not wte.previewed
            assert torch.equal(looked_up, weights[carry][row])  # the preview was exact
        else:
            with engine.gathered([wte]):
                weights[carry] = wte.slots[0].param.detach().clone()
        engine.close()
    assert torch.equal(weights[True], weights[False])


def _carried_pair(tmp_path, monkeypatch, make_model, vocab: int, lr=1e-2, steps: int = 4):
    """Losses and every unit's state after ``steps`` carried steps and after the same steps
    finished in ``step()`` (backlog forced, LambdaLR stepped after each ``step()``)."""
    import torch

    import zerotune
    from zerotune.memory.aio import IOHandle

    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, vocab, (4, 12), generator=g) for _ in range(steps)]
    out = []
    for carry in (True, False):
        folder = tmp_path / f"carry-{carry}"
        folder.mkdir()
        config = dict(OVERLAP_CONFIGS[0], nvme_path=str(folder), staging_bytes=3 * 16 * 4096 * 3)
        engine = zerotune.shard(make_model(), config)
        opt = zerotune.ZeroAdamW(engine, lr=lr() if callable(lr) else lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.15 * s)
        losses = []
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            with opt.overlapped(carry=carry):
                loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        states = {u.index: engine.unit_state(u) for u in engine.units if u.trainable}
        engine.close()
        out.append((losses, states))
    return out


@pytest.mark.parametrize("case", ["opt-positions", "tensor-lr"])
def test_carried_steps_equal_finished_ones_for_subclassed_embeddings_and_tensor_lr(
    case, tmp_path, monkeypatch
):
    """An ``nn.Embedding`` subclass whose forward looks up other rows than its argument
    (OPT's learned positions: from the attention mask, offset by 2) is not previewed; a
    tensor lr that the scheduler updates in place is frozen by value at ``step()``. Both
    used to train differently when carried (found in review)."""
    import torch
    from conftest import tiny_gpt2

    if case == "opt-positions":
        from transformers import OPTConfig, OPTForCausalLM

        def make_model():
            torch.manual_seed(0)
            config = OPTConfig(
                vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                dropout=0.0, attention_dropout=0.0,
            )  # fmt: skip
            return OPTForCausalLM(config)

        lr = 1e-2
    else:

        def make_model():
            return tiny_gpt2(seed=0)

        def lr():
            return torch.tensor(1e-2)

    (carried, plain) = _carried_pair(tmp_path, monkeypatch, make_model, 96, lr)
    assert carried[0] == plain[0]
    for index, state in carried[1].items():
        for key, value in state.items():
            assert torch.equal(value, plain[1][index][key]), (index, key)


def _skewed_world(rank, world, nvme_root, carry):
    """World 2, stage 3, optimizer state on NVMe, prefetch on: rank 0's I/O reports done
    at once, rank 1's only once waited for, so their backlogs at step() differ."""
    import os

    import torch.distributed as dist
    from harness import batches, build, loss_of

    import zerotune
    from zerotune.memory.aio import IOHandle

    done = IOHandle.done
    IOHandle.done = (lambda self: (self.wait(), True)[1]) if rank == 0 else (lambda self: False)
    try:
        folder = os.path.join(nvme_root, f"r{rank}-{carry}")
        os.makedirs(folder)
        config = {"stage": 3, "offload_optimizer": "nvme", "grad_host_bytes": 0,
                  "nvme_path": folder, "staging_bytes": 3 * 16 * 4096 * 3}  # fmt: skip
        engine = zerotune.shard(build("gpt2"), config)
        opt = zerotune.ZeroAdamW(engine, lr=1e-2)
        losses = []
        for ids in batches("gpt2", 4):
            loss = loss_of(engine, ids[rank * 6 : (rank + 1) * 6])
            with opt.overlapped(carry=carry):
                loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total))
        weights = engine.full_state_dict()
        engine.close()
        return {"losses": losses, "weights": {k: v.clone() for k, v in weights.items()}}
    finally:
        IOHandle.done = done


def test_carried_steps_at_world_2_with_ranks_at_different_speeds(tmp_path):
    """Ranks whose disks keep up differently carry different units past step(); the
    gathers ahead must still pair up (prefetch used to gather a unit ahead on the rank
    that had finished its update and not on the other: gloo failed on mismatched sizes)."""
    import numpy as np

    carried = run_world(2, _skewed_world, str(tmp_path), True, timeout=120)
    plain = run_world(2, _skewed_world, str(tmp_path), False, timeout=120)
    assert carried[0]["losses"] == plain[0]["losses"] == carried[1]["losses"]
    for name, w in plain[0]["weights"].items():
        assert np.array_equal(carried[0]["weights"][name], w), name


def frozen_engine_per_rank(rank, world, nvme_root, dtype):
    """A model that never trains, sharded with its parameters on NVMe: no fp32 master in
    memory, its weights read back from the file, written through load_unit_state (also
    while a unit is held gathered)."""
    import torch
    from conftest import tiny_gpt2

    import zerotune

    model = tiny_gpt2(seed=3).requires_grad_(False)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "dtype": dtype,
        "nvme_path": os.path.join(nvme_root, f"rank{rank}"),
    }  # fmt: skip
    os.makedirs(config["nvme_path"], exist_ok=True)
    engine = zerotune.shard(model, config)
    report = engine.memory_report()
    read = engine.full_state_dict()
    unit = engine.units[1]
    doubled = engine.unit_state(unit)["master"] * 2
    engine.load_unit_state(unit, {"master": doubled})
    again = engine.unit_state(unit)["master"]
    # A unit held gathered (a teacher's head) sees what is written while it is held.
    held = engine.units[3]
    with engine.gathered([held]):
        engine.load_unit_state(held, {"master": engine.unit_state(held)["master"] * 3})
        seen = {s.name: s.param.detach().clone() for s in held.slots}
    engine.close()
    to = torch.bfloat16 if dtype == "bf16" else torch.float32
    errors = {
        n: float((read[n].float() - w.to(to).float()).abs().max()) for n, w in weights.items()
    }
    for name, value in seen.items():
        errors[f"held {name}"] = float(
            (value.float() - (weights[name].to(to) * 3).float()).abs().max()
        )
    return report["master"], report["params"], errors, bool(torch.equal(again, doubled))


@pytest.mark.parametrize("world,dtype", [(1, "fp32"), (2, "fp32"), (1, "bf16")])
def test_a_frozen_model_keeps_no_master_in_memory(tmp_path, world, dtype):
    for master, params, errors, written in run_world(
        world, frozen_engine_per_rank, str(tmp_path), dtype
    ):
        assert master == 0  # no fp32 copy of the shards on the compute device
        assert params < 2000  # the persistent root's few bytes; the rest is on NVMe
        assert max(errors.values()) == 0, errors
        assert written


@pytest.mark.parametrize(
    "dtype,bits,optimizer", [("fp32", 32, "adam"), ("bf16", 32, "adam"), ("bf16", 32, "sgd")]
)
def test_reading_the_master_alone_reads_no_moments(tmp_path, monkeypatch, dtype, bits, optimizer):
    """``unit_state(unit, master_only=True)`` (what a reference sync and copy_sharded read)
    gives the same master as the whole state, from its share of the bytes: the moments on
    NVMe stay unread (fp32 compute: the master is the parameter file's)."""
    import torch
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.memory.aio import SwapFile

    config = {
        "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "dtype": dtype,
        "optim_state_bits": bits, "nvme_path": str(tmp_path),
    }  # fmt: skip
    engine = zerotune.shard(tiny_gpt2(seed=4), config)
    if optimizer == "adam":
        opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    else:
        opt = zerotune.ZeroOptimizer(engine, torch.optim.SGD, lr=1e-2, momentum=0.9)
    ids = torch.tensor([[3, 9, 27, 81]])
    engine(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    read_bytes = []
    original = SwapFile.read

    def counted(self, tensor, offset, urgent=False):
        read_bytes.append(tensor.numel() * tensor.element_size())
        return original(self, tensor, offset, urgent)

    monkeypatch.setattr(SwapFile, "read", counted)
    unit = max(engine.units, key=lambda u: u.shard_numel)
    whole = engine.unit_state(unit)
    whole_bytes = sum(read_bytes)
    read_bytes.clear()
    alone = engine.unit_state(unit, master_only=True)
    assert list(alone) == ["master"] and len(whole) >= 2
    assert torch.equal(alone["master"], whole["master"])
    regions = len(whole)  # the master and each per-element state: as many fp32 regions
    assert 0 < sum(read_bytes) * regions <= whole_bytes + 4096 * regions, (read_bytes, whole_bytes)
    engine.close()
