"""A generic optimizer's state (zerotune.ZeroOptimizer) survives a checkpoint: resuming at
the same or another world size continues the never-stopped run's losses and weights, and the
state the optimizer made for itself (per element, factored, scalars) comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import GLOBAL_BATCH, WD, batches, build, loss_of, make_optimizer, no_decay_groups

import zerotune

STEPS, SAVE_AT = 6, 3


def train(rank, world, name, config, folder, start, save_at=None):
    """Steps ``start``..STEPS of the tiny GPT-2 with optimizer ``name``, after loading
    ``folder`` when ``start`` > 0; saves there after step ``save_at``."""
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = make_optimizer(name, groups, engine)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    if start:
        zerotune.load_checkpoint(engine, folder, optimizer=opt, scheduler=sched)
    per = GLOBAL_BATCH // world
    losses = []
    for i, ids in enumerate(batches("gpt2", STEPS)):
        if i < start:
            continue
        loss = loss_of(engine, ids[rank * per : (rank + 1) * per])
        engine.backward(loss)
        opt.clip_grad_norm_(0.5)
        opt.step()
        sched.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
        if save_at is not None and i + 1 == save_at:
            zerotune.save_checkpoint(engine, folder, step=i + 1, optimizer=opt, scheduler=sched)
    # What the optimizer keeps for the parameters whose state this rank writes.
    state_kinds = sorted({k for e in opt.extra_state()[1]["params"].values() for k in e})
    weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "weights": weights, "state_kinds": state_kinds}


@pytest.mark.parametrize(
    "name, stage, offload, save_world, load_world",
    [
        ("sgd", 3, "none", 2, 2),  # per element, re-sliced below
        ("sgd", 2, "cpu", 2, 3),
        ("adafactor", 3, "none", 2, 1),  # whole parameters: factored rows and columns
        ("adafactor", 3, "cpu", 1, 3),
        ("custom", 2, "none", 3, 2),  # a Python int in its state
        ("adagrad", 3, "nvme", 2, 2),  # state on NVMe (Adagrad's made at construction)
        ("sgd", 3, "nvme", 3, 2),  # re-sliced
        ("adafactor", 3, "nvme-both", 2, 1),
    ],
)
def test_resume_continues_the_run(tmp_path, name, stage, offload, save_world, load_world):
    config = {"stage": stage, "offload_optimizer": offload.split("-")[0]}
    if offload.startswith("nvme"):
        config["nvme_path"] = str(tmp_path)
    if offload == "nvme-both":
        config["offload_param"] = "nvme"
    folder = str(tmp_path / "ckpt")
    full = run_world(save_world, train, name, config, folder, 0, SAVE_AT)[0]
    resumed = run_world(load_world, train, name, config, folder, SAVE_AT)[0]
    assert full["state_kinds"], "the optimizer kept no state: the test would prove nothing"
    exact = save_world == load_world
    # Across world sizes the sums of gradients round differently: SGD and Adafactor keep
    # that within rtol; Adagrad would turn the rounding noise of GPT-2's key bias (whose
    # gradient is zero in exact arithmetic) into steps of lr, so it resumes at its own.
    rtol = 0 if exact else 1e-5
    np.testing.assert_allclose(resumed["losses"], full["losses"][SAVE_AT:], rtol=rtol, atol=0)
    for k, w in full["weights"].items():
        np.testing.assert_allclose(resumed["weights"][k], w, rtol=rtol, atol=0 if exact else 1e-6)
    # Without the optimizer state the run goes elsewhere: the state was really restored.
    fresh = run_world(1, _fresh_losses, name, config, folder)[0]
    assert np.abs(np.array(fresh) - full["losses"][SAVE_AT:]).max() > 1e-4


def _fresh_losses(rank, world, name, config, folder):
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = make_optimizer(name, groups, engine)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    zerotune.load_checkpoint(engine, folder, load_optimizer=False, scheduler=sched)
    losses = []
    for ids in batches("gpt2", STEPS)[SAVE_AT:]:
        loss = loss_of(engine, ids)
        engine.backward(loss)
        opt.clip_grad_norm_(0.5)
        opt.step()
        sched.step()
        losses.append(float(loss))
    engine.close()
    return losses


def test_another_optimizer_class_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    run_world(1, train, "sgd", {"stage": 3}, folder, 0, 1)
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3})
    opt = make_optimizer("adagrad", groups, engine)
    with pytest.raises(zerotune.CheckpointError, match="saved by torch.optim.sgd.SGD.*Adagrad"):
        zerotune.load_checkpoint(engine, folder, optimizer=opt)
    engine.close()
    # The same class in the other layout: refused too (state of another shape).
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3})
    opt = zerotune.ZeroOptimizer(engine, torch.optim.SGD, groups, lr=0.05, layout="whole")
    with pytest.raises(zerotune.CheckpointError, match="layout='flat', this .* layout='whole'"):
        zerotune.load_checkpoint(engine, folder, optimizer=opt)
    engine.close()


def _save_and_keep_weights(rank, world, folder):
    """Two steps of Adafactor with its state on NVMe, a checkpoint, and the weights then."""
    config = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
    config["nvme_path"] = str(Path(folder).parent)
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = make_optimizer("adafactor", groups, engine)
    per = GLOBAL_BATCH // world
    for ids in batches("gpt2", 2):
        engine.backward(loss_of(engine, ids[rank * per : (rank + 1) * per]))
        opt.step()
    zerotune.save_checkpoint(engine, folder, optimizer=opt)
    weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    engine.close()
    return weights


def test_export_of_a_generic_optimizers_checkpoint(tmp_path):
    """zerotune export reads the master weights of a checkpoint a ZeroOptimizer saved (state
    on NVMe, world size 2) like one of ZeroAdamW: the model as it was at the save."""
    from safetensors.torch import load_file

    folder = tmp_path / "ckpt"
    saved = run_world(2, _save_and_keep_weights, str(folder))[0]
    out = zerotune.export_hf(folder, tmp_path / "hf", dtype="fp32")
    exported = load_file(str(out / "model.safetensors"))
    assert "transformer.h.0.mlp.c_fc.weight" in exported
    for name, w in exported.items():
        np.testing.assert_array_equal(w.numpy(), saved[name], err_msg=name)
    fresh = build("gpt2").state_dict()["transformer.h.0.mlp.c_fc.weight"]
    assert not np.array_equal(fresh.numpy(), saved["transformer.h.0.mlp.c_fc.weight"])
