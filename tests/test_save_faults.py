"""Fault injection for checkpoint saves: each filesystem call of a save fails in turn (a full
disk, an I/O error); the save says so in one line, the previous checkpoint stays loadable,
and loading the root picks a complete checkpoint."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from harness import WD, batches, build, loss_of, no_decay_groups

import zerotune
from zerotune.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zerotune.checkpoint import files as ckpt_files
from zerotune.checkpoint import save as ckpt_save

# (where, name): the calls a save makes that can fail with an OSError.
CALLS = [
    (os, "mkdir"),
    (os, "open"),
    (os, "fsync"),
    (os, "replace"),
    (os, "rename"),
    (ckpt_files.TensorFileWriter, "_put"),  # a rank file's bytes
    (ckpt_save, "atomic_write_bytes"),  # manifest, marker, latest
]


def _engine():
    model = build("odd")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3})
    return engine, zerotune.ZeroAdamW(engine, groups, lr=1e-3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A root holding step 1, and the engine trained one step further (not saved yet)."""
    root = tmp_path_factory.mktemp("faults") / "root"
    engine, opt = _engine()
    weights = {}
    for step in (1, 2):
        engine.backward(loss_of(engine, batches("odd", 1)[0]))
        opt.step()
        weights[step] = engine.full_state_dict()
        if step == 1:
            save_checkpoint(engine, root, step=1, optimizer=opt)
    return root, engine, opt, weights


def _counting(monkeypatch, counts):
    for owner, name in CALLS:
        real = getattr(owner, name)

        def wrapped(*args, _real=real, _key=name, **kwargs):
            counts[_key] = counts.get(_key, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)


def _failing(monkeypatch, key, at):
    for owner, name in CALLS:
        if name != key:
            continue
        real = getattr(owner, name)
        seen = [0]

        def wrapped(*args, _real=real, seen=seen, **kwargs):
            seen[0] += 1
            if seen[0] == at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)


def _loads(path, expected) -> bool:
    engine, opt = _engine()
    load_checkpoint(engine, path, optimizer=opt)
    got = engine.full_state_dict()
    return all(torch.equal(got[k], v) for k, v in expected.items())


def test_every_failing_call_of_a_save_leaves_a_loadable_checkpoint(trained, tmp_path):
    base, engine, opt, weights = trained
    counts: dict[str, int] = {}
    with pytest.MonkeyPatch.context() as mp:
        _counting(mp, counts)
        save_checkpoint(engine, tmp_path / "dry", step=2, optimizer=opt)
    assert counts.get("fsync", 0) >= 3 and counts.get("_put", 0) >= 1, counts
    cases = [(key, at) for key, n in sorted(counts.items()) for at in range(1, n + 1)]
    raised = 0
    for key, at in cases:
        root = tmp_path / f"{key}-{at}"
        shutil.copytree(base, root)
        try:
            with pytest.MonkeyPatch.context() as mp:
                _failing(mp, key, at)
                save_checkpoint(engine, root, step=2, optimizer=opt)
        except CheckpointError as exc:
            raised += 1
            assert "\n" not in str(exc), (key, at, str(exc))
            assert "No space left on device" in str(exc), (key, at, str(exc))
        # The previous checkpoint is whole; the root loads a complete one (step 1, or
        # step 2 when the failure came once it was complete).
        assert _loads(root / "step-00000001", weights[1]), (key, at)
        chosen = zerotune.latest_checkpoint(root)
        assert chosen is not None, (key, at)
        step = int(chosen.name.split("-")[1])
        assert _loads(root, weights[step]), (key, at)
        hidden = [p.name for p in root.iterdir() if p.name.startswith(".writing-")]
        assert not hidden, (key, at, hidden)
    assert raised >= len(cases) // 2, (raised, len(cases))
