"""In-place writes inside ``engine.gathered(what, modifier_rank=0)`` reach every rank's shards,
against the plain model doing the same writes: the steps after train from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world, tiny_gpt2
from harness import (
    GLOBAL_BATCH,
    LR,
    assert_trains_like_plain,
    batches,
    loss_of,
    plain_adamw_run,
    step_and_mean_loss,
)
from torch import nn

import zerotune

STEPS, EDIT_AFTER = 3, 1  # after a step: Adam's moments exist, and stay as they are
WD = 0.01
NVME = {"offload_param": "nvme", "offload_optimizer": "nvme"}
# As in test_engine_equivalence.py: fp32 reduction-order rounding; a parameter whose gradient
# is rounding noise (GPT-2's attention key bias) moves by up to lr a step either way.
EDITED = {
    "transformer.h.0.mlp.c_fc.weight",
    "transformer.h.1.attn.c_attn.weight",
    "transformer.wpe.weight",
    "transformer.h.1.mlp.c_proj.weight",
    "transformer.h.1.mlp.c_proj.bias",
}


@torch.no_grad()
def edit(model, rank: int) -> None:
    """Rank 0's writes (the plain model's too); rank 1 writes others, which must not count."""
    h = model.transformer.h
    if rank == 0:
        h[0].mlp.c_fc.weight.clamp_(-0.01, 0.01)
        h[1].attn.c_attn.weight.mul_(1.5)
        model.transformer.wpe.weight.copy_(torch.linspace(-0.1, 0.1, 32 * 32).reshape(32, 32))
    else:
        h[0].mlp.c_fc.weight.fill_(3.0)
        model.transformer.wpe.weight.mul_(-2)
        h[1].ln_1.weight.add_(1)
        # Rank 0's slice of a unit rank 0 leaves as it is (at stages 1-2 rank 1's copy of it
        # stays gathered).
        model.transformer.ln_f.weight.add_(1)
    torch.manual_seed(100 + rank)  # a re-init seeded per rank: each rank's differs
    nn.init.normal_(h[1].mlp.c_proj.weight, std=0.05)
    h[1].mlp.c_proj.bias.zero_()


def plain_run() -> dict:
    return plain_adamw_run(
        tiny_gpt2(seed=0), steps=STEPS, wd=WD, at=EDIT_AFTER, change=lambda m: edit(m, 0)
    )


def _masters(engine) -> list[torch.Tensor]:
    return [
        engine.unit_state(u, master_only=True)["master"].to("cpu", torch.float32, copy=True)
        for u in engine.units
    ]


def _unwritten_kept(engine, before: list[torch.Tensor]) -> bool:
    """The master elements of the parameters nobody wrote are bit for bit as they were
    (in bf16 too: the write rounds only what changed)."""
    for unit, old, new in zip(engine.units, before, _masters(engine)):
        lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
        for s in unit.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if s.name in EDITED or a >= b:
                continue
            if not torch.equal(new[a - lo : b - lo], old[a - lo : b - lo]):
                return False
    return True


def zero_run(rank, world, swap, config):
    model = tiny_gpt2(seed=0)
    config = {**config, "nvme_path": f"{swap}/{rank}"} if "nvme" in config.values() else config
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    wpe = dict(model.named_parameters())["transformer.wpe.weight"]
    per_rank = GLOBAL_BATCH // world
    losses, kept = [], None
    for step, ids in enumerate(batches("gpt2", STEPS)):
        if step == EDIT_AFTER:
            before = _masters(engine)
            # Modules and a parameter: the units owning them.
            what = [model.transformer.h, model.transformer.ln_f, wpe]
            with engine.gathered(what, modifier_rank=0):
                edit(model, rank)
            kept = _unwritten_kept(engine, before)
        loss = loss_of(engine, ids[rank * per_rank : (rank + 1) * per_rank])
        losses.append(step_and_mean_loss(engine, opt, loss, world))
    weights = {k: v.float() for k, v in model.state_dict().items()}
    engine.close()
    return {"losses": losses, "weights": weights, "kept": kept}


@pytest.mark.parametrize(
    "world,config",
    [
        (1, {"stage": 3}),
        (1, {"stage": 3, **NVME}),  # gathers map the parameter file
        (2, {"stage": 3, **NVME}),
        (2, {"stage": 2}),
        (2, {"stage": 3, "dtype": "bf16", **NVME}),
        (1, {"stage": 2, "dtype": "bf16"}),
    ],
)
def test_writes_inside_gathered_train_like_the_plain_models(world, config, tmp_path):
    ref = plain_run()
    for res in run_world(world, zero_run, str(tmp_path), config):
        assert res["kept"], config
        weights = {k: torch.as_tensor(np.asarray(v)) for k, v in res["weights"].items()}
        bf16 = config.get("dtype") == "bf16"
        assert_trains_like_plain(res["losses"], weights, ref, bf16=bf16, steps=STEPS)


def _c_fc(model) -> torch.Tensor:
    return model.transformer.h[0].mlp.c_fc.weight


@torch.no_grad()
def _write(model) -> None:
    _c_fc(model).fill_(0.5)


def test_without_modifier_rank_the_write_is_gone_after_a_step():
    """In bf16 the write reaches the compute copy alone: the step rewrites it from the
    fp32 master. With ``modifier_rank`` it is the master."""
    original = _c_fc(tiny_gpt2(seed=0)).detach().clone()
    for modifier_rank in (None, 0):
        model = tiny_gpt2(seed=0)
        engine = zerotune.shard(model, {"stage": 3, "dtype": "bf16"})
        opt = zerotune.ZeroAdamW(engine, lr=LR)
        with engine.gathered(model.transformer.h[0], modifier_rank=modifier_rank):
            _write(model)
        engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
        opt.step()
        with engine.gathered(model.transformer.h[0]):
            w = _c_fc(model).detach().float()
        if modifier_rank is None:
            assert (w - original).abs().max() < 2e-2  # one step from the original
        else:
            assert (w - 0.5).abs().max() < 2e-2  # one step from the write
        engine.close()


def test_an_exception_inside_writes_nothing(tmp_path):
    model = tiny_gpt2(seed=0)
    engine = zerotune.shard(model, {"stage": 3, **NVME, "nvme_path": str(tmp_path)})
    zerotune.ZeroAdamW(engine, lr=LR)
    before = model.state_dict()
    with pytest.raises(KeyError):
        with engine.gathered(model, modifier_rank=0):
            _write(model)
            raise KeyError("stop")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(u.persistent or u.state.value == "sharded" for u in engine.units)
    engine.close()


def test_refusals_take_one_line_and_write_nothing():
    model = tiny_gpt2(seed=0)
    engine = zerotune.shard(model, {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    before = model.state_dict()

    def refused(error, match, what=None, modifier_rank=0):
        with pytest.raises(error, match=match) as e:
            with engine.gathered(what, modifier_rank=modifier_rank):
                _write(model)
        assert "\n" not in str(e.value)

    refused(ValueError, "a rank of the engine's group, 0 to 0", modifier_rank=1)
    refused(ValueError, "a rank of the engine's group", modifier_rank=True)
    refused(ValueError, "not part of the sharded model", what=nn.Linear(2, 2).weight)
    copy = model.transformer.h[0].mlp.c_fc.weight  # read outside gathered(): a copy
    refused(ValueError, "a sharded parameter is a copy: pass the module", what=copy)
    refused(TypeError, "units, modules or parameters, not str", what=["transformer.wpe.weight"])
    refused(ValueError, "not part of the sharded model", what=[model.transformer, nn.Linear(2, 2)])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with opt.overlapped():
        engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
    refused(
        RuntimeError, r"modifier_rank=0\) of a model sharded by zerotune, between an overlapped"
    )
    opt.step()
    opt.zero_grad()
    assert all(u.pins == 0 for u in engine.units)  # refused before anything was gathered

    def in_forward(module, args):
        with engine.gathered(module, modifier_rank=0):
            pass

    handle = model.transformer.h[1].register_forward_pre_hook(in_forward)
    with pytest.raises(RuntimeError, match="inside a forward or backward of the model") as e:
        loss_of(engine, batches("gpt2", 1)[0])
    assert "\n" not in str(e.value)
    handle.remove()
    engine.close()
