"""fp16 dynamic loss scaling: overflow skips the step and lowers the scale."""

from __future__ import annotations

import numpy as np
import torch
from conftest import run_world
from harness import LR, batches, build, loss_of

STEPS = 10


def run_fp16(rank, world):
    import zerotune

    model = build("gpt2")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerotune.shard(model, {"stage": 3, "dtype": "fp16", "loss_scale_init": 2.0**20})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=0.0)
    infos, losses = [], []
    for ids in batches("gpt2", STEPS):
        loss = loss_of(engine, ids[rank::world])
        engine.backward(loss)
        infos.append(opt.step())
        mean = loss.detach().float().reshape(1) / world
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(float(mean))
        if infos[-1].skipped and all(i.skipped for i in infos):
            # Nothing moved yet.
            current = engine.full_state_dict()
            assert all(torch.equal(current[n].float(), start[n].half().float()) for n in current)
    return {
        "skipped": [i.skipped for i in infos],
        "scales": [i.loss_scale for i in infos],
        "losses": losses,
        "final_scale": engine.scaler.scale,
    }


def test_fp16_overflow_skips_steps_and_halves_the_scale():
    res = run_world(2, run_fp16)[0]
    skipped, scales = res["skipped"], res["scales"] + [res["final_scale"]]
    assert skipped[0], skipped  # 2**20 overflows fp16 gradients at first
    assert not all(skipped), skipped
    for step, skip in enumerate(skipped):
        # Halved after an overflow, kept otherwise (the growth window is 1000 steps).
        assert scales[step + 1] == (scales[step] / 2 if skip else scales[step])

    # The steps that were taken are plain AdamW steps on those batches (fp16 tolerance).
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for step, ids in enumerate(batches("gpt2", STEPS)):
        loss = loss_of(model, ids)
        ref_losses.append(float(loss))
        if not skipped[step]:
            loss.backward()
            opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(res["losses"], ref_losses, rtol=5e-3)
