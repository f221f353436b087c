"""Offloaded activation checkpoints (offload_activations): training equals plain AdamW, the
checkpoint bytes leave the compute device (counted and in RSS), the swap file is private,
bounded and removed, and bad configurations are refused."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import run_world, start_for, tiny_gpt2
from harness import batches, build, loss_of, train_zero
from test_engine_equivalence import check, reference

import zerotune
from zerotune.sharding.activations import WRITES_IN_FLIGHT

CASES = [
    # (model, extra config, accumulation micro-batches, no_sync for the first one)
    ("gpt2_ckpt", {"offload_activations": "nvme"}, 2, False),
    (
        "gpt2_ckpt_reentrant",
        {"offload_activations": "nvme", "offload_param": "nvme", "offload_optimizer": "nvme"},
        2,
        True,
    ),
    ("gpt2_ckpt", {"offload_activations": "cpu", "offload_optimizer": "cpu"}, 1, False),
    ("gpt2_ckpt_reentrant", {"offload_activations": "cpu", "stage": 2}, 2, False),
]


def run_cases(rank, world, nvme_root):
    out = []
    for model, extra, accum, no_sync in CASES:
        config = {"stage": 3, **extra}
        if "nvme" in config.values():
            config["nvme_path"] = nvme_root
            config["staging_bytes"] = 3 * 16 * 4096 * 3
        out.append(train_zero(rank, world, model, config, accum=accum, use_no_sync=no_sync))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_checkpoints_match_plain_adamw(world, tmp_path):
    results = run_world(world, run_cases, str(tmp_path))
    for case, res in zip(CASES, results[0]):
        ref = reference(case[0])
        label = f"world={world} {case}"
        check(res, ref, label)
        # no_grad evaluation after training (it saves nothing) gives the plain model's loss.
        np.testing.assert_allclose(res["eval_loss"], ref["eval_loss"], rtol=1e-5, err_msg=label)
        memory = res["memory"]
        assert memory["checkpoints_device"] == 0, label
        assert memory["checkpoints_offloaded"] == 0, label  # nothing outlives its step
        if case[1]["offload_activations"] == "nvme":
            assert memory["checkpoints_offloaded_peak"] > 0, label
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a["losses"] == b["losses"]
    assert os.listdir(tmp_path) == []  # every swap file and run folder removed at close


LAYERS, MICRO, SEQ, HIDDEN = 6, 4, 16, 32


def _ckpt_model(reentrant: bool):
    model = tiny_gpt2(seed=0, layers=LAYERS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


def _measured_run(mode: str, reentrant: bool, nvme_root: str, steps: int = 3) -> dict:
    """A bare engine loop that reads the checkpoint counters between forward and backward."""
    config = {"stage": 3, "offload_activations": mode}
    if mode == "nvme":
        config["nvme_path"] = nvme_root
    engine = zerotune.shard(_ckpt_model(reentrant), config)
    opt = zerotune.ZeroAdamW(engine, lr=2e-3)
    out = {"losses": [], "after_forward": [], "after_step": [], "files": []}
    for ids in batches("gpt2", steps):
        ids = ids[:MICRO]
        if engine.activations is not None:
            engine.activations.reset_peaks()
        loss = loss_of(engine, ids)
        out["after_forward"].append(engine.memory_report())
        loss.backward()
        opt.step()
        out["losses"].append(float(loss))
        out["after_step"].append(engine.memory_report())
    with torch.no_grad():
        before = engine.activations.saved if engine.activations is not None else 0
        out["eval_loss"] = float(loss_of(engine, batches("gpt2", 1)[0][:MICRO]))
        after = engine.activations.saved if engine.activations is not None else 0
        out["saved_in_eval"] = after - before
    out["weights"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_bytes_leave_the_device(tmp_path, reentrant):
    # What activation checkpointing keeps per step: each block's input hidden states.
    checkpoint_bytes = MICRO * SEQ * HIDDEN * 4 * LAYERS
    plain = _measured_run("none", reentrant, str(tmp_path))
    counted = _measured_run("cpu", reentrant, str(tmp_path))  # host device: a counting no-op
    moved = _measured_run("nvme", reentrant, str(tmp_path))
    # Same results: the restored checkpoints are the saved ones, bit for bit.
    for run in (counted, moved):
        assert run["losses"] == plain["losses"]
        assert run["eval_loss"] == plain["eval_loss"]
        for name, w in plain["weights"].items():
            assert torch.equal(run["weights"][name], w), name
    for step in range(3):
        kept = counted["after_forward"][step]
        gone = moved["after_forward"][step]
        # Without moving, every block's input stays on the compute device until backward.
        assert kept["checkpoints_device"] == checkpoint_bytes
        assert kept["checkpoints_offloaded_peak"] == 0
        # With nvme, none is left there between forward and backward; all are in the file.
        assert gone["checkpoints_device"] == 0
        assert gone["checkpoints_offloaded"] == checkpoint_bytes
        assert gone["checkpoints_offloaded_peak"] == checkpoint_bytes
        # During forward at most the writes in flight held a copy.
        assert gone["checkpoints_device_peak"] <= WRITES_IN_FLIGHT * checkpoint_bytes // LAYERS
        # Only the newest came back ahead of backward.
        assert gone["checkpoints_restored_peak"] == checkpoint_bytes // LAYERS
        # After the step nothing is held anywhere, and the file did not grow.
        for run in (counted, moved):
            after = run["after_step"][step]
            assert after["checkpoints_device"] == after["checkpoints_offloaded"] == 0
        assert moved["after_step"][step]["checkpoints_file"] == (1 << 20)
    # Backward brought back one block ahead of the one in use (prefetch) and no more.
    assert moved["after_step"][0]["checkpoints_restored_peak"] <= 3 * checkpoint_bytes // LAYERS
    assert counted["saved_in_eval"] == moved["saved_in_eval"] == 0  # no_grad saves nothing
    assert os.listdir(tmp_path) == []


RSS_SCRIPT = r"""
import json, sys
import psutil, torch, zerotune
from transformers import GPT2Config, GPT2LMHeadModel
from zerotune.memory.host import prefer_mmap_for_large_buffers
prefer_mmap_for_large_buffers()  # both runs: freed buffers leave RSS
cfg = GPT2Config(n_layer=8, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
ids = torch.randint(0, 64, (128, 64), generator=torch.Generator().manual_seed(0))
out = {}
for mode in ("none", "nvme"):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    config = {"stage": 3, "offload_activations": mode}
    if mode == "nvme":
        config["nvme_path"] = sys.argv[1]
    engine = zerotune.shard(model, config)
    engine(input_ids=ids, labels=ids).loss.backward()  # warm up: allocator, file, unit order
    proc = psutil.Process()
    base = proc.memory_info().rss
    loss = engine(input_ids=ids, labels=ids).loss
    grew = proc.memory_info().rss - base
    loss.backward()
    report = engine.memory_report()
    engine.close()
    out[mode] = {"grew": grew, "loss": loss.item(), "file": report.get("checkpoints_file", 0)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def rss_run(request, tmp_path_factory):
    """The script of ``test_nvme_checkpoints_lower_rss_after_forward`` (at the end of this
    file), started with the module's first test. Yields it and its swap folder."""
    tmp = tmp_path_factory.mktemp("rss")
    script, swap = tmp / "rss.py", tmp / "swap"
    script.write_text(RSS_SCRIPT)
    swap.mkdir()
    job = start_for(
        request,
        "test_nvme_checkpoints_lower_rss_after_forward",
        [sys.executable, str(script), str(swap)],
    )
    yield job, swap
    if job is not None:
        job.stop()


def test_swap_file_is_private_and_removed_at_close(tmp_path):
    engine = zerotune.shard(
        _ckpt_model(reentrant=False),
        {"stage": 3, "offload_activations": "nvme", "nvme_path": str(tmp_path)},
    )
    ids = batches("gpt2", 1)[0][:MICRO]
    loss_of(engine, ids).backward()
    swap_file = engine.activations.space.dir / "activations.swap"
    assert swap_file.exists()
    assert stat.S_IMODE(os.stat(swap_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(swap_file.parent).st_mode) == 0o700
    assert engine.swap is None  # the engine's own swap space is untouched: none was needed
    engine.close()
    assert os.listdir(tmp_path) == []


def test_file_grows_then_merges_into_one_bounded_file(tmp_path):
    engine = zerotune.shard(
        _ckpt_model(reentrant=True),
        {"stage": 3, "offload_activations": "nvme", "nvme_path": str(tmp_path)},
    )
    extents = engine.activations.extents
    ids = batches("gpt2", 1)[0]  # 12 rows of 2 KiB each: 24 KiB per checkpoint
    # A first segment that holds two checkpoints: the other four need more segments.
    extents._grow(2 * 6 * 4096)
    loss_of(engine, ids).backward()
    assert len(extents.segments) > 1
    total = extents.file_bytes
    loss_of(engine, ids).backward()  # nothing live at its start: one file of the same size
    assert len(extents.segments) == 1 and extents.file_bytes == total
    assert len(list(engine.activations.space.dir.glob("*.swap"))) == 1
    for _ in range(3):  # steady state: no growth, every extent comes back
        loss_of(engine, ids).backward()
        assert extents.file_bytes == total and extents.used_bytes == 0
    engine.close()
    assert os.listdir(tmp_path) == []


class _Blocks(torch.nn.Module):
    """A non-HF model that checkpoints its blocks through ``engine.checkpoint`` and hands every
    block the same ``scale`` tensor (saved once)."""

    def __init__(self, width: int = 24, blocks: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(37, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 40), torch.nn.GELU(), torch.nn.Linear(40, width)
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(width, 37)
        self.ckpt = None  # set to engine.checkpoint; plain torch checkpoint otherwise

    def forward(self, input_ids, labels=None):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(input_ids)
        scale = torch.linspace(0.5, 1.5, h.shape[-1])
        for block in self.blocks:

            def run(x, s, b=block):
                return x + b(x) * s

            if self.ckpt is not None:
                h = self.ckpt(run, h, scale)
            else:
                h = checkpoint(run, h, scale, use_reentrant=False)
        logits = self.head(h)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_engine_checkpoint_offloads_non_hf_models_and_saves_shared_inputs_once(tmp_path):
    ids = batches("odd", 4)
    torch.manual_seed(0)
    plain = _Blocks()
    opt = torch.optim.AdamW(plain.parameters(), lr=2e-3)
    ref = []
    for x in ids:
        loss = plain(x, x)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    torch.manual_seed(0)
    model = _Blocks()
    engine = zerotune.shard(
        model,
        {
            "stage": 3,
            "offload_activations": "nvme",
            "nvme_path": str(tmp_path),
            "unit_modules": ["Sequential"],
        },
    )
    model.ckpt = engine.checkpoint
    zopt = zerotune.ZeroAdamW(engine, lr=2e-3)
    got = []
    for x in ids:
        saved = engine.activations.saved
        loss = engine(x, x)["loss"]
        # Three block inputs and one shared scale: four tensors, the scale moved once.
        assert engine.activations.saved - saved == 4
        width_bytes = x.numel() * 24 * 4
        assert engine.memory_report()["checkpoints_offloaded"] == 3 * width_bytes + 24 * 4
        loss.backward()
        zopt.step()
        got.append(float(loss))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    engine.close()


def test_config_errors(tmp_path):
    with pytest.raises(zerotune.ConfigError, match="offload_activations must be one of"):
        zerotune.ZeroConfig(offload_activations="disk")
    with pytest.raises(zerotune.ConfigError, match="needs nvme_path"):
        zerotune.ZeroConfig(offload_activations="nvme")
    # Offload asked for, but the model checkpoints nothing: one clear error at the first
    # training forward (no_grad and eval-mode forwards save nothing and pass).
    engine = zerotune.shard(
        build("gpt2"), {"offload_activations": "nvme", "nvme_path": str(tmp_path)}
    )
    ids = batches("gpt2", 1)[0]
    with torch.no_grad():
        loss_of(engine, ids)
    engine.module.eval()
    loss_of(engine, ids)
    engine.module.train()
    # The method as the installed transformers names it (5.2x: its old name warns).
    name = "activation_checkpointing_enable"
    name = name if hasattr(engine.module, name) else "gradient_checkpointing_enable"
    with pytest.raises(
        zerotune.ConfigError, match=rf"needs activation checkpointing.*call model\.{name}\(\)"
    ):
        loss_of(engine, ids)
    engine.close()
    assert os.listdir(tmp_path) == []


def test_full_disk_is_one_clear_error(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)])
    if mounted.returncode != 0:
        pytest.fail("this test needs to mount a small tmpfs (run as root)")
    try:
        engine = zerotune.shard(
            _ckpt_model(reentrant=False),
            {"stage": 3, "offload_activations": "nvme", "nvme_path": str(small)},
        )
        # The file's size is known only once checkpoints arrive: the first segment (1 MiB)
        # does not fit in 256 KiB.
        with pytest.raises(OSError, match="offloaded activation checkpoints need 1.0 MiB more"):
            loss_of(engine, batches("gpt2", 1)[0][:MICRO])
        engine.close()
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)])


class _Inputs(torch.nn.Module):
    """Three Linear blocks run through ``self.ckpt`` (torch's non-reentrant checkpoint when
    unset) on inputs whose copies are easy to get wrong. "sizes": 4000, 4000, then 4080 bytes
    (one 4 KiB size class, the last a little larger). "strides": a transposed input (a Linear
    saves other tensors for a non-contiguous input than for a contiguous one) and an expanded
    gain (zero strides)."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(10, 10) for _ in range(3))
        self.ckpt = None

    def forward(self, x, labels):
        from torch.utils.checkpoint import checkpoint

        ckpt = self.ckpt or (lambda fn, *args: checkpoint(fn, *args, use_reentrant=False))
        h = x  # 100 x 10 fp32: 4000 bytes
        if self.kind == "sizes":
            for i, block in enumerate(self.blocks):
                if i == 2:
                    h = torch.cat([h, h[:2]])  # 102 x 10: 4080 bytes
                h = ckpt(lambda t, b=block: torch.tanh(b(t)), h)
        else:
            h = h.view(4, 25, 10)
            gain = torch.linspace(0.5, 1.5, 10).expand(4, 25, 10)
            for block in self.blocks:
                h = h + ckpt(
                    lambda t, g, b=block: b(t.transpose(0, 1)) * g, h.transpose(0, 1), gain
                )
            h = h.view(100, 10)
        return {"loss": ((h[:100] - labels) ** 2).mean()}


def _plain_and_offloaded(kind: str, config: dict, steps: int = 3):
    """(plain AdamW with torch's checkpoint, zerotune with ``engine.checkpoint``): losses."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(100, 10, generator=g), torch.randn(100, 10, generator=g))] * steps
    plain = _Inputs(kind)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ref = []
    for x, y in data:
        loss = plain(x, y)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    model = _Inputs(kind)
    engine = zerotune.shard(model, {"stage": 3, "unit_modules": ["Linear"], **config})
    model.ckpt = engine.checkpoint
    zopt = zerotune.ZeroAdamW(engine, lr=1e-2)
    got = []
    for x, y in data:
        loss = engine(x, y)["loss"]
        loss.backward()
        zopt.step()
        got.append(float(loss))
    engine.close()
    return ref, got


@pytest.mark.parametrize("kind", ["sizes", "strides"])
def test_block_inputs_of_any_size_and_layout_come_back_as_saved(kind, tmp_path):
    # sizes: a staging buffer kept for reuse was the first tensor's size, too short for the
    # last (RuntimeError: shape '[102, 10]' is invalid for input of size 1000). strides: the
    # copy came back contiguous, so the recompute saved other tensors than the forward had
    # (CheckpointError: recomputed values have different metadata).
    ref, got = _plain_and_offloaded(
        kind, {"offload_activations": "nvme", "nvme_path": str(tmp_path)}
    )
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert os.listdir(tmp_path) == []


def test_inplace_change_of_a_kept_input_is_refused_as_without_offload():
    # Saved-tensor hooks turn off autograd's own check; where a checkpoint stays in place
    # (offload_activations='cpu' on a CPU), backward read the changed values: wrong gradients.
    class Changed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            y = self.ckpt(lambda t: (t * t).sum(), h)
            with torch.no_grad():
                h.mul_(10)  # the block's saved input changes before backward
            return y

    for mode in ("none", "cpu"):
        model = Changed()
        engine = zerotune.shard(model, {"stage": 3, "offload_activations": mode})
        model.ckpt = engine.checkpoint
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine(torch.ones(3, 4)).backward()
        engine.close()


def test_failed_forward_leaves_nothing_behind(tmp_path, monkeypatch):
    import zerotune.sharding.activations as activations

    engine = zerotune.shard(
        _ckpt_model(reentrant=False),
        {"stage": 3, "offload_activations": "nvme", "nvme_path": str(tmp_path)},
    )
    ids = batches("gpt2", 1)[0][:MICRO]
    # A forward that raises before its first block: that error alone, not also a warning
    # that this forward "checkpointed no block".
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(IndexError):
            loss_of(engine, ids + 1000)

    # A full disk at the first checkpoint; the error's traceback (kept, as a notebook keeps
    # it) holds that checkpoint's record. The next forward once there is room trains: the
    # record, holding nothing, was restored at the next backward (AttributeError).
    class Full:
        free = 4096

    monkeypatch.setattr(activations.shutil, "disk_usage", lambda path: Full)
    with pytest.raises(OSError, match="need 1.0 MiB more") as kept:
        loss_of(engine, ids)
    monkeypatch.undo()
    loss = loss_of(engine, ids)
    loss.backward()
    assert float(loss) == float(loss_of(_ckpt_model(reentrant=False), ids))
    del kept
    engine.close()
    assert os.listdir(tmp_path) == []


def test_nvme_checkpoints_lower_rss_after_forward(rss_run):
    job, swap = rss_run
    out = job.result(timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    plain, moved = result["none"], result["nvme"]
    checkpoint_bytes = 128 * 64 * 32 * 4 * 8  # batch * seq * hidden * fp32 * layers = 8 MiB
    assert moved["loss"] == plain["loss"]
    # Held between forward and backward: the checkpoints plus what the head saves (logits,
    # loss); with nvme the checkpoints are on disk, except the newest, already back for
    # backward (1 MiB of slack for the allocator).
    saved = plain["grew"] - moved["grew"]
    bound = checkpoint_bytes * 7 // 8 - 2**20
    assert saved > bound, (plain["grew"] / 2**20, moved["grew"] / 2**20)
    assert checkpoint_bytes <= moved["file"] < 2 * checkpoint_bytes  # one bounded file
    assert list(swap.iterdir()) == []


def test_transformers_own_activation_offload_is_offload_activations_cpu(tmp_path):
    """``activation_checkpointing_kwargs={"offload": True}`` (transformers' save_on_cpu,
    whose hooks would sit inside the engine's) becomes ``offload_activations: cpu``: the run
    logs the plain Trainer's losses with checkpointing; another tier alongside is refused."""
    from trainer_cases import logged, plain_run, zero_run

    from zerotune.hf import ZeroTrainingArguments

    kwargs = {"offload": True, "use_reentrant": False}
    plain = plain_run(str(tmp_path / "plain"), activation_checkpointing=True,
                      activation_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    trainer = zero_run(str(tmp_path / "zero"), activation_checkpointing=True,
                       activation_checkpointing_kwargs=dict(kwargs))  # fmt: skip
    args = trainer.args
    assert args.zero.offload_activations == "cpu"
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert trainer.engine.activations is not None and trainer.engine.activations.saved > 0
    np.testing.assert_allclose(logged(trainer), logged(plain), rtol=1e-5)
    trainer.close()
    with pytest.raises(zerotune.ConfigError, match="offload_activations nvme both say"):
        ZeroTrainingArguments(
            output_dir="unused", activation_checkpointing=True, offload_activations="nvme",
            nvme_path=str(tmp_path), activation_checkpointing_kwargs=dict(kwargs),
        )  # fmt: skip
