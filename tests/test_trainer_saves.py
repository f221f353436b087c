"""ZeroTrainer checkpoints: a marker covers everything a resume reads; a save that fails
(a full disk) leaves nothing behind and says so in one line; a damaged newest checkpoint
falls back to the one before."""

from __future__ import annotations

import errno
import json
import logging
import shutil

import pytest
import torch
from trainer_cases import logged, zero_run

from zerotune.checkpoint import CheckpointError
from zerotune.checkpoint.files import TensorFileWriter
from zerotune.hf.trainer import (
    TRAINER_MARKER,
    check_resumable,
    latest_complete_checkpoint,
)

SAVES = dict(save_strategy="steps", save_steps=2, zero_stage=3)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Six steps, a checkpoint every two: the reference for resumes."""
    out = tmp_path_factory.mktemp("run")
    trainer = zero_run(str(out), **SAVES)
    losses = logged(trainer)
    trainer.close()
    return out, losses


def test_every_checkpoint_is_marked_complete_after_its_trainer_state(saved_run):
    out, _ = saved_run
    for step in (2, 4, 6):
        folder = out / f"checkpoint-{step}"
        record = json.loads((folder / TRAINER_MARKER).read_text())
        assert record["step"] == step
        assert (folder / TRAINER_MARKER).stat().st_mtime_ns >= (
            folder / "trainer_state.json"
        ).stat().st_mtime_ns
        check_resumable(folder)
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-6")


@pytest.mark.parametrize("cut", ["empty state", "no state", "no marker"])
def test_a_save_cut_short_falls_back_to_the_checkpoint_before(saved_run, tmp_path, cut, caplog):
    """A kill during the Trainer's write of trainer_state.json (empty, or not there yet) or
    just before the marker: the marker, written last, is missing, so the folder is skipped."""
    out = tmp_path / "out"
    shutil.copytree(saved_run[0], out)
    newest = out / "checkpoint-6"
    (newest / TRAINER_MARKER).unlink()
    if cut == "empty state":
        (newest / "trainer_state.json").write_text("")
    elif cut == "no state":
        (newest / "trainer_state.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_complete_checkpoint(out) == str(out / "checkpoint-4")
    assert "skipping" in caplog.text and "checkpoint-6" in caplog.text
    with pytest.raises(CheckpointError, match="checkpoint-6 cannot be resumed: no ") as err:
        check_resumable(newest)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change", ["emptied", "edited"])
def test_a_state_changed_after_the_save_is_refused_not_skipped(saved_run, tmp_path, change):
    out = tmp_path / "out"
    shutil.copytree(saved_run[0], out)
    state = out / "checkpoint-6" / "trainer_state.json"
    state.write_text("" if change == "emptied" else state.read_text().replace("6", "7"))
    says = "checkpoint-6 was changed after its save .trainer_state.json does not match"
    with pytest.raises(CheckpointError, match=says):
        latest_complete_checkpoint(out)
    with pytest.raises(CheckpointError, match="checkpoint-6 cannot be resumed"):
        check_resumable(out / "checkpoint-6")
    check_resumable(out / "checkpoint-4")


def test_resume_after_a_save_cut_short_continues_from_the_checkpoint_before(saved_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(saved_run[0], out)
    (out / "checkpoint-6" / TRAINER_MARKER).unlink()  # its save was cut short
    (out / "checkpoint-6" / "trainer_state.json").write_text("")
    shutil.rmtree(out / "checkpoint-2")
    trainer = zero_run(str(out), train=False, **SAVES)
    trainer.train(resume_from_checkpoint=True)
    # Resumed at step 4 (its trainer state holds the first four losses): steps 5 and 6
    # again, with the losses of the straight run.
    assert trainer.state.global_step == 6
    torch.testing.assert_close(logged(trainer), saved_run[1], rtol=1e-6, atol=0)
    trainer.close()


def test_a_full_disk_during_a_save_leaves_no_folder_and_one_line(tmp_path, monkeypatch):
    real_put = TensorFileWriter._put
    saves = []

    def put(self, data):
        if len(saves) >= 1 and self.path.name.startswith("rank-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, data)

    real_commit = TensorFileWriter.commit

    def commit(self):
        out = real_commit(self)
        if self.path.name.startswith("rank-"):
            saves.append(self.path)
        return out

    monkeypatch.setattr(TensorFileWriter, "_put", put)
    monkeypatch.setattr(TensorFileWriter, "commit", commit)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as err:
        zero_run(str(out), **SAVES)
    message = str(err.value)
    assert "\n" not in message
    assert "checkpoint-4" in message and "No space left on device" in message
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not [p for p in (out / "checkpoint-2").rglob("*") if p.name.startswith(".")]
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-2")


def test_rotation_happens_once_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    from zerotune.hf import trainer as zt

    order = []
    real_mark = zt.mark_complete

    def mark(folder, step):
        order.append(("marked", step, sorted(p.name for p in folder.parent.glob("checkpoint-*"))))
        return real_mark(folder, step)

    monkeypatch.setattr(zt, "mark_complete", mark)
    out = tmp_path / "out"
    zero_run(str(out), save_total_limit=1, **SAVES).close()
    # When step 4 was marked complete, step 2 was still there; only the newest is left.
    assert order[1] == ("marked", 4, ["checkpoint-2", "checkpoint-4"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
