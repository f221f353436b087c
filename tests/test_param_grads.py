"""At world size 1 on a CPU a unit's gradient shard in memory is the parameters' ``.grad``
tensors (see [Note: gradients left in the parameters] in memory/tiers.py): no copy, the
same numbers as plain PyTorch, and a flat shard only for a reader that needs one."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import tiny_gpt2
from harness import LR, MAX_NORM, WD, batches, loss_of, no_decay_groups

import zerotune

STEPS = 4
ACCUM = 2


def _plain(optimizer: str = "adamw", clip: bool = True):
    """Plain PyTorch over the same micro-batches: losses, clipped norms, the gradients each
    step's backward left (before clipping) and the final weights."""
    model = tiny_gpt2(seed=0)
    opt = _optimizer(optimizer, no_decay_groups(model, WD))
    losses, norms, grads = [], [], []
    for ids in batches("gpt2", STEPS):
        for part in ids.chunk(ACCUM):
            loss = loss_of(model, part) / ACCUM
            loss.backward()
            losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights}


def _optimizer(name, groups, engine=None):
    if name == "adamw":
        if engine is None:
            return torch.optim.AdamW(groups, lr=LR)
        return zerotune.ZeroAdamW(engine, groups, lr=LR)
    # A generic torch optimizer over the shards, per-element (flat) layout.
    if engine is None:
        return torch.optim.Adagrad(groups, lr=0.01)
    return zerotune.ZeroOptimizer(engine, torch.optim.Adagrad, groups, lr=0.01)


def _zero(config: dict, optimizer="adamw", overlapped=False, no_sync=True, clip=True):
    model = tiny_gpt2(seed=0)
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = _optimizer(optimizer, groups, engine)
    trainable = [u for u in engine.units if u.trainable]
    losses, norms, grads, flat_after_step = [], [], [], []
    for ids in batches("gpt2", STEPS):
        ctx = opt.overlapped(clipping=clip) if overlapped else nullcontext()
        with ctx:
            for k, part in enumerate(ids.chunk(ACCUM)):
                quiet = engine.no_sync() if (no_sync and k == 0) else nullcontext()
                with quiet:
                    loss = loss_of(engine, part) / ACCUM
                    engine.backward(loss)
                losses.append(float(loss.detach()))
            if not overlapped and not flat_after_step:
                # Before any reader: the shard is the parameters' gradients, no flat copy.
                assert all(u.grads.keeps_params() for u in trainable)
                assert all(u.grads.shard is None for u in trainable)
            if not overlapped:
                grads.append(
                    {
                        s.name: u.grads.view(u, s.offset, s.offset + s.numel).view(s.shape)
                        for u in trainable
                        for s in u.slots
                    }
                )
                grads[-1] = {k: v.clone() for k, v in grads[-1].items()}
            if clip:
                norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        flat_after_step.append(sum(u.grads.shard is not None for u in trainable))
        opt.zero_grad()
        if not overlapped:
            assert all(s.param.grad is None for u in engine.units for s in u.slots)
    weights = {n: w.clone() for n, w in engine.full_state_dict().items()}
    # An update carried into the next forward read the gradients left in its parameters
    # after zero_grad; they are gone once it is done (gathering finished every update).
    assert all(s.param.grad is None for u in engine.units for s in u.slots)
    report = engine.memory_report()
    engine.close()
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "weights": weights,
        "flat_after_step": flat_after_step,
        "report": report,
        "units": len(trainable),
        "multi": sum(len(u.slots) > 1 for u in trainable),
    }


@pytest.fixture(scope="module")
def plain_adamw():
    return _plain("adamw")


def _check_weights(got, ref, lr=LR):
    """Weights within 1e-5; an element whose gradient is rounding noise (GPT-2's attention
    key bias, see test_engine_equivalence.py) within what the optimizer moves it, ``lr`` a
    step."""
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for name, w in ref["weights"].items():
        noise = torch.stack([g[name].abs() for g in ref["grads"]]).amax(0) < 1e-6
        atol = torch.where(noise, lr * STEPS, 1e-5)
        bad = (got["weights"][name] - w).abs() > atol + 1e-5 * w.abs()
        assert not bad.any(), (name, int(bad.sum()))


@pytest.mark.parametrize(
    "config",
    [
        {"stage": 1},
        {"stage": 2},
        {"stage": 3},
        {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    ],
    ids=["stage1", "stage2", "stage3", "stage3-offload-cpu"],
)
def test_zero_adamw_reads_the_gradients_where_autograd_left_them(config, plain_adamw):
    """Stages 1-3 at world size 1 (and the optimizer on the host, which is the device on a
    CPU), 2 micro-batches (the first under no_sync), clipping that clips: the parameters'
    gradients are plain PyTorch's, bit for bit, no flat shard is ever allocated, and the
    losses, norms and weights follow plain AdamW."""
    got = _zero(config)
    assert not any(u for u in got["flat_after_step"])
    assert max(plain_adamw["norms"]) > MAX_NORM  # clipping clipped
    assert got["losses"] == plain_adamw["losses"]
    # The first step's gradients are bit for bit plain's (the same weights); later ones
    # follow weights that a differently rounded clipping factor moved by an ulp.
    for step, (mine, ref) in enumerate(zip(got["grads"], plain_adamw["grads"], strict=True)):
        assert sorted(mine) == sorted(ref)
        for name, g in ref.items():
            if step == 0:
                assert torch.equal(mine[name], g), name
            else:
                torch.testing.assert_close(mine[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(got["norms"], plain_adamw["norms"], rtol=1e-6, atol=0)
    assert got["flat_after_step"] == [0] * STEPS
    _check_weights(got, plain_adamw)
    # The report still counts the gradients' bytes (now in the parameters): all of them.
    n = sum(p.numel() for p in tiny_gpt2(seed=0).parameters())
    assert got["report"]["grads"] == 4 * n


@pytest.mark.parametrize(
    "nvme, clip",
    [(False, True), (True, True), (True, False)],
    ids=["memory", "nvme", "nvme-unclipped"],
)
def test_overlapped_step_reads_them_too(nvme, clip, plain_adamw, tmp_path):
    """The overlapped step updates each unit from its parameters' gradients: in step()
    with the optimizer in memory; during backward and carried into the next forward (after
    zero_grad) with both tiers on NVMe, where the gradient shards fit the host."""
    if not clip:
        plain_adamw = _plain(clip=False)
    config = {"stage": 3}
    if nvme:
        config.update(offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
        # Room for a few chunks only: the updates read their gradients late, in the next
        # forward, after zero_grad.
        config["staging_bytes"] = 3 * 16 * 4096 * 3
    got = _zero(config, overlapped=True, clip=clip)
    torch.testing.assert_close(got["losses"], plain_adamw["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["norms"], plain_adamw["norms"], rtol=1e-6, atol=0)
    # With NVMe the step's chunks read units of several parameters as one flat shard (at
    # the first step some of them only in the next forward, where the updates are carried).
    assert got["flat_after_step"][1:] == [got["multi"] if nvme else 0] * (STEPS - 1)
    _check_weights(got, plain_adamw)


@pytest.mark.parametrize("optimizer", ["adagrad", "adamw"])
def test_a_reader_of_one_flat_tensor_gets_the_flat_shard(optimizer, tmp_path):
    """A generic optimizer's flat layout, and the NVMe step's chunks, read each unit's
    gradient as one tensor: the gradients move into a flat shard at the first step and
    accumulate there afterwards, and training still follows the plain optimizer."""
    ref = _plain(optimizer)
    config = {"stage": 3}
    if optimizer == "adamw":
        config.update(offload_optimizer="nvme", nvme_path=str(tmp_path))
    got = _zero(config, optimizer)
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=0)
    assert got["grads"][0].keys() == ref["grads"][0].keys()
    for name, g in ref["grads"][0].items():
        assert torch.equal(got["grads"][0][name], g), name
    # Flat from the first step on: every trainable unit for the flat layout; for the NVMe
    # step each unit of several parameters (a lone parameter's chunks are views of it).
    flat = got["units"] if optimizer == "adagrad" else got["multi"]
    assert 0 < got["multi"] < got["units"]
    assert got["flat_after_step"] == [flat] * STEPS
    _check_weights(got, ref, lr=0.01 if optimizer == "adagrad" else LR)


def test_grad_shard_moves_the_gradients_once():
    """Reading ``unit.grad_shard`` gives the same numbers as the parameters' gradients and
    leaves one copy: the parameters' are dropped, a later micro-batch adds into the flat
    shard."""
    model = tiny_gpt2(seed=0)
    engine = zerotune.shard(model, {"stage": 3})
    ids = batches("gpt2", 1)[0]
    engine.backward(loss_of(engine, ids))
    unit = next(u for u in engine.units if u.trainable and len(u.slots) > 1)
    before = {s.name: s.param.grad.clone() for s in unit.slots}
    flat = unit.grad_shard
    assert flat.numel() == unit.numel
    for s in unit.slots:
        assert s.param.grad is None
        assert torch.equal(flat[s.offset : s.offset + s.numel], before[s.name].reshape(-1))
    engine.backward(loss_of(engine, ids))  # a second micro-batch adds into the flat shard
    assert all(s.param.grad is None for s in unit.slots)
    for s in unit.slots:
        torch.testing.assert_close(
            unit.grad_shard[s.offset : s.offset + s.numel], 2 * before[s.name].reshape(-1)
        )
    engine.close()
