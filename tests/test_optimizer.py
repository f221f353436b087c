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


def test_groups_asking_for_what_zero_adamw_does_not_do_are_refused():
    """A group's own hyper-parameters are checked as the defaults are, and a group setting
    torch's ``amsgrad`` or ``maximize`` is refused (ZeroAdamW stepped as without them)."""
    import zerotune

    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": 3})
    params = list(model.parameters())
    for extra, match in [
        ({"amsgrad": True}, "group 1 sets amsgrad=True"),
        ({"maximize": True}, "group 1 sets maximize=True"),
        ({"betas": (0.9, 1.0)}, r"in parameter group 1: .*betas=\(0.9, 1.0\)"),
        ({"eps": 0.0}, "in parameter group 1: eps=0.0"),
        ({"lr": -1.0}, "in parameter group 1: lr=-1.0"),
    ]:
        groups = [{"params": params[:2]}, {"params": params[2:], **extra}]
        with pytest.raises(ValueError, match=match):
            zerotune.ZeroAdamW(engine, groups, lr=LR)
    # What changes nothing is accepted (the engine is still free for an optimizer).
    opt = zerotune.ZeroAdamW(engine, [{"params": params, "amsgrad": False, "foreach": None}])
    assert opt.param_groups[0]["lr"] == 1e-3


def _plain_steps(plan, max_mid):
    """torch.optim.AdamW on the whole batch through ``plan``: "zero" (clip, zero_grad, a
    new backward: the step skipped, as on a non-finite norm) or "more" (clip, then one more
    backward into the same step); then a step, and one more plain step."""
    model = build("gpt2")
    opt = torch.optim.AdamW(no_decay_groups(model, WD), lr=LR)
    ids = batches("gpt2", 3)
    loss_of(model, ids[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_mid)
    if plan == "zero":
        opt.zero_grad()
    loss_of(model, ids[1]).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    opt.step()
    opt.zero_grad()
    loss_of(model, ids[2]).backward()
    opt.step()
    return norm, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 3])
def test_what_clip_grad_norm_read_goes_with_the_gradients(stage):
    """``clip_grad_norm_`` then ``zero_grad`` (a step skipped) then a new backward: the
    clipping factor and the gradients it read are gone, as torch's are (not the next
    step's factor, nor at stage 1 its gradients). A backward after a clip that did not
    clip joins the step; after one that clipped it is refused (torch would add its
    gradients unscaled)."""
    import zerotune

    for plan, max_mid, zero_grad in [("zero", 0.01, "optimizer"), ("zero", 0.01, "model"),
                                     ("more", 1e9, None)]:  # fmt: skip
        model = build("gpt2")
        groups = no_decay_groups(model, WD)
        engine = zerotune.shard(model, {"stage": stage})
        opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
        ids = batches("gpt2", 3)
        engine.backward(loss_of(engine, ids[0]))
        opt.clip_grad_norm_(max_mid)
        if plan == "zero":
            (opt if zero_grad == "optimizer" else model).zero_grad()
        engine.backward(loss_of(engine, ids[1]))
        norm = float(opt.clip_grad_norm_(1e9))
        opt.step()
        engine.backward(loss_of(engine, ids[2]))
        opt.step()
        weights = engine.full_state_dict()
        engine.close()
        ref_norm, ref = _plain_steps(plan, max_mid)
        assert norm == pytest.approx(ref_norm, rel=1e-5), plan
        for name, w in ref.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)

    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": stage})
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
    assert float(opt.clip_grad_norm_(0.01)) > 0.01
    with pytest.raises(RuntimeError, match="after clip_grad_norm_.* and before step"):
        engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
    engine.close()


def test_a_backward_or_zero_grad_between_an_overlapped_backward_and_its_step():
    """After ``overlapped()``'s backward and before ``step()``: another backward joins a
    clipping step (nothing was updated yet) and is refused after a plain one (its units
    were updated without it); ``zero_grad`` gives a clipping step up whole, as torch's
    ``zero_grad`` before ``step`` does."""
    import zerotune

    def run(clipping, between):
        model = build("gpt2")
        groups = no_decay_groups(model, WD)
        engine = zerotune.shard(model, {"stage": 3})
        opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
        ids = batches("gpt2", 2)
        with opt.overlapped(clipping=clipping):
            engine.backward(loss_of(engine, ids[0]))
        try:
            if between == "backward":
                engine.backward(loss_of(engine, ids[1]))
            else:
                opt.zero_grad()
        finally:
            opt.step()
            weights = engine.full_state_dict()
            engine.close()
        return weights

    ref = build("gpt2")
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(no_decay_groups(ref, WD), lr=LR)
    for ids in batches("gpt2", 2):
        loss_of(ref, ids).backward()
    opt.step()
    joined = run(True, "backward")
    for name, p in ref.named_parameters():
        torch.testing.assert_close(joined[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(RuntimeError, match="after an overlapped.* backward and before its step"):
        run(False, "backward")
    given_up = run(True, "zero_grad")
    for name, w in start.items():
        assert torch.equal(given_up[name], w), name
