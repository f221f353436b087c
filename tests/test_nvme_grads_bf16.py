"""Gradient shards kept in bf16 (``grad_dtype: bf16``) in the NVMe gradient file: the same
numbers as plain AdamW whose gradients are rounded to bf16 after each micro-batch, and the
same bits as bf16 shards kept in host memory; half the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import LR, MAX_NORM, WD, batches, build, loss_of, no_decay_groups

import zerotune

STEPS = 4
ACCUM = 2

# (name, extra config, step): "sequential" the step after backward, "overlapped" updates
# during backward, "clipped" overlapped(clipping=True); all with clipping but "overlapped".
RUNS = [
    ("sequential", {"grad_host_bytes": 0}, "sequential"),
    ("clipped, all spilled", {"grad_host_bytes": 0}, "clipped"),
    ("clipped, some kept", {"grad_host_bytes": 2**15}, "clipped"),
    ("overlapped", {"grad_host_bytes": 0}, "overlapped"),
]


def _plain_bf16_grads(clip: float | None, world: int = 1) -> dict:
    """Plain AdamW; each micro-batch's gradient is added to a bf16 sum (in fp32, rounded),
    which the step then uses: what a bf16 gradient shard holds."""
    model = build("gpt2")
    opt = torch.optim.AdamW(no_decay_groups(model, WD), lr=LR)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    per_rank = 12 // world
    micro = per_rank // ACCUM
    for ids in batches("gpt2", STEPS):
        acc = [None] * len(params)
        total = 0.0
        for k in range(ACCUM):
            # micro-batch k of every rank at once (the ranks' mean gradient)
            part = torch.cat(
                [
                    ids[r * per_rank + k * micro : r * per_rank + (k + 1) * micro]
                    for r in range(world)
                ]
            )
            loss = loss_of(model, part) / ACCUM
            loss.backward()
            total += float(loss.detach())
            for i, p in enumerate(params):
                g = p.grad if acc[i] is None else acc[i].float() + p.grad
                acc[i] = g.to(torch.bfloat16)
                p.grad = None
        for p, a in zip(params, acc):
            p.grad = a.float()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def run_bf16_grads(rank, world, nvme_root, runs, grads_tier):
    import torch.distributed as dist

    out = []
    for _, extra, step in runs:
        config = {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "grad_dtype": "bf16",
            "nvme_path": nvme_root,
            "staging_bytes": 3 * 16 * 4096 * 3,
            **extra,
        }
        if grads_tier == "host":
            config["grad_host_bytes"] = 2**30
        model = build("gpt2")
        groups = no_decay_groups(model, WD)  # reads shapes: before sharding empties them
        engine = zerotune.shard(model, config)
        opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
        per_rank = 12 // world
        micro = per_rank // ACCUM
        losses, norms = [], []
        for ids in batches("gpt2", STEPS):
            mine = ids[rank * per_rank : (rank + 1) * per_rank]
            total = torch.zeros(())
            for k in range(ACCUM):
                loss = loss_of(engine, mine[k * micro : (k + 1) * micro]) / ACCUM
                if k == ACCUM - 1 and step != "sequential":
                    with opt.overlapped(clipping=step == "clipped"):
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                total += loss.detach()
            if step != "overlapped":
                norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
            opt.step()
            opt.zero_grad()
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total) / world)
        on_disk = [u for u in engine.units if u.grads.on_disk]
        files = engine.swap.files
        out.append(
            {
                "losses": losses,
                "norms": norms,
                "weights": engine.full_state_dict(),
                "grad_file_bytes": files["grad"].size if "grad" in files else 0,
                "shard_elements": sum(u.shard_numel for u in on_disk),
            }
        )
        engine.close()
    return out


def test_bf16_gradient_file_matches_plain_adamw_with_bf16_gradients(tmp_path):
    clipped = _plain_bf16_grads(MAX_NORM)
    unclipped = _plain_bf16_grads(None)
    assert min(clipped["norms"]) > MAX_NORM  # clipping clips every step
    results = run_world(1, run_bf16_grads, str(tmp_path), RUNS, "nvme")[0]
    for (name, _, step), res in zip(RUNS, results):
        # Every trained unit's shard is on disk, two bytes an element (and 4 KiB rounding).
        assert res["shard_elements"] > 0, name
        assert 2 * res["shard_elements"] <= res["grad_file_bytes"], name
        assert res["grad_file_bytes"] < 2 * res["shard_elements"] + 4096 * 16, name
        ref = unclipped if step == "overlapped" else clipped
        # The first step's are the same numbers; later, weights a kernel's rounding apart
        # give gradients that now and then round to the neighbouring bf16 value.
        if step != "overlapped":
            assert res["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-6), name
            np.testing.assert_allclose(res["norms"], ref["norms"], rtol=2e-4, err_msg=name)
        np.testing.assert_allclose(res["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        for key, w in ref["weights"].items():
            np.testing.assert_allclose(
                np.asarray(res["weights"][key]), w.numpy(), rtol=1e-4, atol=1e-4, err_msg=key
            )


@pytest.mark.parametrize("world", [2])
def test_bf16_gradient_file_equals_bf16_shards_in_memory(world, tmp_path):
    runs = [RUNS[0], RUNS[1], RUNS[3]]  # at world 2 the 32 KiB budget holds every shard
    on_disk = run_world(world, run_bf16_grads, str(tmp_path / "disk"), runs, "nvme")[0]
    in_memory = run_world(world, run_bf16_grads, str(tmp_path / "host"), runs, "host")[0]
    for (name, _, _), disk, host in zip(runs, on_disk, in_memory):
        assert disk["grad_file_bytes"] > 0 and host["grad_file_bytes"] == 0, name
        assert disk["losses"] == host["losses"], name
        assert disk["norms"] == host["norms"], name
        for key, w in host["weights"].items():
            assert np.array_equal(disk["weights"][key], w), (name, key)
    plain = _plain_bf16_grads(MAX_NORM, world)
    # Ranks sum in another order than one process: bf16 rounding may differ by an ulp.
    np.testing.assert_allclose(on_disk[0]["losses"], plain["losses"], rtol=1e-3)


def _train_on_grad_file(root, mode: str, clip: float | None):
    """Tiny GPT-2, both tiers on NVMe, every fp32 gradient shard in the file, 3 steps of 2
    micro-batches (the second under ``overlapped`` unless ``mode`` is "sequential"):
    losses and weights."""
    import torch
    from conftest import tiny_gpt2

    import zerotune

    config = {
        "stage": 3,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "nvme_path": str(root),
        "grad_host_bytes": 0,
    }
    engine = zerotune.shard(tiny_gpt2(seed=0), config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        for k in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss / 2
            if mode == "sequential" or k == 0:
                loss.backward()
            else:
                with opt.overlapped(clipping=clip is not None):
                    loss.backward()
            losses.append(loss.item())
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    weights = engine.full_state_dict()
    engine.close()
    return losses, weights


def test_a_lone_parameters_spilled_gradient_is_written(tmp_path):
    """The clipped overlapped step with every fp32 gradient shard spilled to the file: a
    unit of one parameter (the embedding) holds the parameter's own gradient, which the
    file cannot take as it is (not aligned); it is staged, and training follows the
    clipped step after backward (the norms sum in another order: an ulp of the clip
    factor apart). GPT-2's attention key bias, whose gradient is rounding noise (softmax
    ignores a shift of every key's score), is held to what Adam moves it: lr a step."""
    import torch

    overlapped = _train_on_grad_file(tmp_path / "overlapped", "clipped", 0.05)
    sequential = _train_on_grad_file(tmp_path / "sequential", "sequential", 0.05)
    torch.testing.assert_close(overlapped[0], sequential[0], rtol=1e-6, atol=0)
    for name, w in sequential[1].items():
        atol = torch.full_like(w, 1e-6)
        if name.endswith("attn.c_attn.bias"):
            d = w.shape[0] // 3  # query, key, value
            atol[d : 2 * d] = 3 * 1e-2  # three steps of lr 1e-2
        diff = (overlapped[1][name] - w).abs()
        bad = diff > atol + 1e-5 * w.abs()
        assert not bad.any(), (name, diff.max().item())
