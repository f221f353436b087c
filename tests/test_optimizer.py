"""ZeroAdamW behaves like a torch optimizer: LR schedulers, per-group hyper-parameters,
Adam without decoupled decay; small units can stay resident (persistence threshold)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import LR, WD, batches, build, loss_of, no_decay_groups

STEPS = 6


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def reference(adamw: bool) -> dict:
    model = build("gpt2")
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(no_decay_groups(model, WD), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    losses = []
    for ids in batches("gpt2", STEPS):
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "weights": {n: p.detach().numpy() for n, p in model.named_parameters()},
    }


def run_scheduled(rank, world, adamw, config):
    import torch.distributed as dist

    import zerotune

    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR, adamw_mode=adamw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    losses, lrs = [], []
    for ids in batches("gpt2", STEPS):
        loss = loss_of(engine, ids[rank::world])
        loss.backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        total = loss.detach().reshape(1) / world
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total))
    persistent = [u.name for u in engine.units if u.persistent and u.numel]
    return {
        "losses": losses,
        "weights": engine.full_state_dict(),
        "lrs": lrs,
        "persistent": persistent,
    }


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
def test_scheduler_and_groups_match_torch(adamw):
    ref = reference(adamw)
    # Units up to 20 KB stay gathered (embeddings, root) while the blocks are sharded.
    config = {"stage": 3, "persistence_threshold": 20_000}
    res = run_world(2, run_scheduled, adamw, config)[0]
    assert res["lrs"] == pytest.approx([LR * _schedule(s + 1) for s in range(STEPS)])
    assert "transformer.wpe" in res["persistent"] and "transformer.h.0" not in res["persistent"]
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=1e-5)
    for name, w in ref["weights"].items():
        np.testing.assert_allclose(res["weights"][name], w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_bad_hyper_parameters_and_groups_are_rejected():
    import zerotune

    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": 3})
    with pytest.raises(ValueError, match="invalid Adam"):
        zerotune.ZeroAdamW(engine, lr=-1)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="more than one parameter group"):
        zerotune.ZeroAdamW(engine, [{"params": params}, {"params": params[:1]}])
    # Groups from attribute reads at stage 3, world size 1: copies of the values, which no
    # step would update (the real parameters would silently stop training).
    head = model.transformer.h[0].mlp.c_fc
    with pytest.raises(ValueError, match=r"group 1 holds a tensor of shape \(32, 128\) .*copy"):
        zerotune.ZeroAdamW(engine, [{"params": params[:2]}, {"params": [head.weight]}])
    with pytest.raises(ValueError, match="not a parameter of the sharded model; build"):
        zerotune.ZeroOptimizer(engine, torch.optim.SGD, [torch.zeros(3)], lr=0.1)


def _fused_run(dtype: str, batched: bool, monkeypatch) -> dict:
    """ZeroAdamW at stage 3 on the CPU through torch's fused multi-tensor step (what a
    device runs): in one call over every unit (``batched``) or chunk by chunk."""
    import zerotune
    from zerotune.optim import cpu_adam, zero_adam
    from zerotune.optim.zero_adam import ZeroAdamW

    def multi_tensor(master, grad, moments, segments, out):
        cpu_adam.multi_tensor_adam_update(master, grad, *moments, segments, out)

    monkeypatch.setattr(ZeroAdamW, "_adam", staticmethod(multi_tensor))
    calls = []  # shards per call of the batched entry
    batched_entry = zero_adam.multi_tensor_adam_update_shards

    def counted(shards):
        calls.append(len(shards))
        batched_entry(shards)

    monkeypatch.setattr(zero_adam, "multi_tensor_adam_update_shards", counted)
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3, "dtype": dtype})
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    opt._on_device = lambda units: batched
    losses, norms = [], []
    for ids in batches("gpt2", STEPS):
        loss = loss_of(engine, ids)
        engine.backward(loss)
        norms.append(float(opt.clip_grad_norm_(0.5)))  # clips: the factor is applied too
        opt.step()
        losses.append(float(loss.detach()))
    weights = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "norms": norms, "weights": weights, "calls": calls}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_fused_step_over_all_units_equals_the_chunk_by_chunk_step(dtype, monkeypatch):
    """[Note: one fused step over a device's units]: bit for bit, clipped, two groups."""
    one = _fused_run(dtype, True, monkeypatch)
    each = _fused_run(dtype, False, monkeypatch)
    assert min(one["norms"]) > 0.5  # every step clips
    assert len(one["calls"]) == STEPS and min(one["calls"]) >= 5 and each["calls"] == []
    assert one["losses"] == each["losses"] and one["losses"][-1] < one["losses"][0] - 0.1
    for name, w in each["weights"].items():
        assert torch.equal(one["weights"][name], w), name
