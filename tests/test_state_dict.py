"""``model.state_dict()`` and ``model.load_state_dict()`` of a sharded model, against the
plain model: the whole weights out, and weights in that the next steps train from."""

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

import zerotune

STEPS = 3
WD = 0.01
NVME = {"offload_param": "nvme", "offload_optimizer": "nvme"}


def _config(config: dict, swap: str) -> dict:
    return {**config, "nvme_path": swap} if "nvme" in config.values() else config


def _same(sd: dict, ref: dict) -> None:
    """Same keys in the same order, shapes, dtypes and values (``sd`` may come from
    ``run_world``: numpy arrays, with ``sd["dtypes"]`` beside them)."""
    dtypes = sd.pop("dtypes", None)
    assert list(sd) == list(ref)
    for k, v in ref.items():
        got = torch.as_tensor(np.asarray(sd[k]))
        assert got.shape == v.shape, k
        if dtypes is not None:
            assert dtypes[k] == str(v.dtype), k
        else:
            assert got.dtype == v.dtype, k
        assert torch.equal(got, v.to(got.dtype)), k


def _with_dtypes(sd: dict) -> dict:
    """Copies (torch's entries are views of the parameters) and their dtypes."""
    copies = {k: v.clone() for k, v in sd.items()}
    return {**copies, "dtypes": {k: str(v.dtype) for k, v in sd.items()}}


# ------------------------------------------------------------------------------ state_dict
def state_dicts(rank, world, swap, configs):
    """Each config's state dicts of the sharded tiny GPT-2 (model, engine, a block, with
    keep_vars), after a load of another model's weights too."""
    out = []
    for config in configs:
        model = tiny_gpt2(seed=0)
        engine = zerotune.shard(model, _config(config, f"{swap}/{rank}"))
        sd = model.state_dict()
        engine_sd = _with_dtypes(engine.state_dict())
        block = _with_dtypes(model.transformer.h[1].state_dict())
        kept = model.state_dict(keep_vars=True)
        released = [u.state.value for u in engine.units if not u.persistent]
        tied = sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
        sd = _with_dtypes(sd)
        model.load_state_dict(tiny_gpt2(seed=1).state_dict())
        out.append(
            {
                "sd": sd,
                "engine": engine_sd,
                "block": block,
                "tied": tied,
                "kept_params": all(kept[n] is p for n, p in model.named_parameters()),
                "released": released,
                "loaded": _with_dtypes(model.state_dict()),
            }
        )
        engine.close()
    return out


CONFIGS = [
    {"stage": 3},
    {"stage": 3, **NVME},
    {"stage": 3, "tile_linear_bytes": 4096},  # c_fc and c_proj in 4 tiles each
    {"stage": 2},
]


@pytest.mark.parametrize("world", [1, 2])
def test_state_dict_is_the_plain_models(world, tmp_path):
    plain, other = tiny_gpt2(seed=0), tiny_gpt2(seed=1).state_dict()
    ref = plain.state_dict()
    results = run_world(world, state_dicts, str(tmp_path), CONFIGS)
    for rank_results in results:
        for config, res in zip(CONFIGS, rank_results):
            _same(res["sd"], ref)
            _same(res["engine"], {f"module.{k}": v for k, v in ref.items()})
            _same(res["block"], plain.transformer.h[1].state_dict())
            _same(res["loaded"], other)
            assert res["tied"] and res["kept_params"], config
            assert set(res["released"]) <= {"sharded"}, config  # gathered one unit at a time


# ------------------------------------------------------------------------- load_state_dict
def plain_run(load_after: int) -> dict:
    """Plain AdamW on the whole batch; another model's weights loaded after ``load_after``
    steps."""
    weights = tiny_gpt2(seed=1).state_dict()
    return plain_adamw_run(
        tiny_gpt2(seed=0), steps=STEPS, wd=WD, at=load_after,
        change=lambda m: m.load_state_dict(weights),
    )  # fmt: skip


def zero_run(rank, world, swap, config, load_after):
    """The same with zerotune over ``world`` ranks (each its slice of the batch)."""
    model, other = tiny_gpt2(seed=0), tiny_gpt2(seed=1)
    engine = zerotune.shard(model, _config(config, f"{swap}/{rank}"))
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    per_rank = GLOBAL_BATCH // world
    losses, loaded, masters = [], None, True
    for step, ids in enumerate(batches("gpt2", STEPS)):
        if step == load_after:
            model.load_state_dict(other.state_dict())
            loaded = _with_dtypes(model.state_dict())
            # The masters are the other model's fp32 weights (in bf16 too: only the
            # compute copy is rounded), in this rank's slices.
            whole = dict(other.named_parameters())
            for u in engine.units:
                flat = torch.zeros(u.padded_numel)
                for s in u.slots:
                    flat[s.offset : s.offset + s.numel] = whole[s.name].detach().reshape(-1)
                mine = flat[u.shard_start : u.shard_start + u.shard_numel]
                master = engine.unit_state(u, master_only=True)["master"]
                masters &= torch.equal(master.float().cpu(), mine)
        loss = loss_of(engine, ids[rank * per_rank : (rank + 1) * per_rank])
        losses.append(step_and_mean_loss(engine, opt, loss, world))
    weights = {k: v.float() for k, v in model.state_dict().items()}
    engine.close()
    return {"losses": losses, "weights": weights, "loaded": loaded, "masters": masters}


BF16 = {"stage": 3, "dtype": "bf16", **NVME}


@pytest.mark.parametrize(
    "world,config,load_after",
    [
        (2, {"stage": 3, **NVME}, 0),
        (2, {"stage": 3, **NVME}, 1),  # mid-run: Adam's moments stay as they are
        (2, {"stage": 2}, 1),
        (1, {"stage": 3}, 1),
        (1, BF16, 1),
    ],
)
def test_load_state_dict_then_steps_match_plain(world, config, load_after, tmp_path):
    ref = plain_run(load_after)
    res = run_world(world, zero_run, str(tmp_path), config, load_after)[0]
    assert res["masters"]
    bf16 = config.get("dtype") == "bf16"
    other = tiny_gpt2(seed=1).state_dict()
    _same(res["loaded"], {k: v.bfloat16() if bf16 else v for k, v in other.items()})
    weights = {k: torch.as_tensor(v) for k, v in res["weights"].items()}
    assert_trains_like_plain(res["losses"], weights, ref, bf16=bf16, steps=STEPS)


# ----------------------------------------------------------------- strict and refusals
def test_strict_false_reports_what_torch_reports_and_refusals_take_one_line(tmp_path, monkeypatch):
    plain, model = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    engine = zerotune.shard(model, {"stage": 3, **NVME, "nvme_path": str(tmp_path)})
    sd = tiny_gpt2(seed=1).state_dict()
    del sd["transformer.h.0.mlp.c_fc.weight"]
    sd["bogus.weight"] = torch.zeros(3)
    got = model.load_state_dict(sd, strict=False)
    assert got == plain.load_state_dict(sd, strict=False)
    assert got.missing_keys == ["transformer.h.0.mlp.c_fc.weight"]
    _same(model.state_dict(), plain.state_dict())  # c_fc kept its weights, the rest loaded

    def fails_once(module, prefix, keep_vars):
        handle.remove()
        raise RuntimeError("a hook of the user's")

    handle = model.transformer.h[1].register_state_dict_pre_hook(fails_once)
    with pytest.raises(RuntimeError, match="a hook of the user's"):
        engine.state_dict()  # stops between the hooks of the modules above h.1
    whole = {k.removeprefix("module."): v for k, v in engine.state_dict().items()}
    _same(whole, plain.state_dict())  # not the empty parameters
    # strict=True: torch's error, raised after loading what matches (as torch does).
    with pytest.raises(RuntimeError) as mine:
        model.load_state_dict(sd)
    with pytest.raises(RuntimeError) as torchs:
        plain.load_state_dict(sd)
    assert str(mine.value) == str(torchs.value)

    before = model.state_dict()
    bad = tiny_gpt2(seed=2).state_dict()
    bad["transformer.wpe.weight"] = torch.zeros(31, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer\.wpe\.weight") as e:
        model.load_state_dict(bad)
    assert "\n" not in str(e.value) and "[31, 32] given, [32, 32]" in str(e.value)
    with pytest.raises(RuntimeError, match="assign=True") as e:
        model.load_state_dict(bad, assign=True)
    _same(model.state_dict(), before)  # nothing was written

    opt = zerotune.ZeroAdamW(engine, lr=LR)
    with opt.overlapped():
        engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
    for call in (lambda: model.load_state_dict(before), model.state_dict):
        with pytest.raises(RuntimeError, match="between an overlapped backward and its step") as e:
            call()
        assert "\n" not in str(e.value)
    opt.step()
    # A partial load with the masters in the optimizer's NVMe file: c_fc keeps its weights.
    kept = model.state_dict()["transformer.h.0.mlp.c_fc.weight"]
    model.load_state_dict(sd, strict=False)
    now = model.state_dict()
    assert torch.equal(now["transformer.h.0.mlp.c_fc.weight"], kept)
    assert all(torch.equal(now[k], v) for k, v in sd.items() if k in now)

    from zerotune.sharding import state_dict

    class Full:
        available = 1000

    monkeypatch.setattr(state_dict.psutil, "virtual_memory", Full)
    with pytest.raises(RuntimeError, match="more than is available") as e:
        model.state_dict()
    assert "\n" not in str(e.value)
    # Room for one rank's copies, not for the four torchrun put on this host.
    Full.available = 1.5 * sum(v.numel() * v.element_size() for v in now.values())
    assert len(model.state_dict()) == len(now)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="for this host's ranks"):
        model.state_dict()
    engine.close()


# ------------------------------------------------------------------- who calls state_dict
def test_zero_trainer_saves_and_loads_without_a_whole_state_dict(tmp_path, monkeypatch):
    """Training, checkpoints (with the consolidated model), evaluation, loading the best
    model at the end and save_model stream unit by unit: no state_dict() of the sharded
    model gathers it whole on the way (at scale that would not fit in memory)."""
    from trainer_cases import zero_run

    from zerotune.sharding import state_dict

    whole = state_dict._StateDictHooks.whole
    calls = []

    def counted(self, module, sd, prefix):
        calls.append(type(module).__name__)
        whole(self, module, sd, prefix)

    monkeypatch.setattr(state_dict._StateDictHooks, "whole", counted)
    swap = tmp_path / "swap"
    swap.mkdir()
    trainer = zero_run(
        str(tmp_path / "out"),
        max_steps=4,
        zero_stage=3,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(swap),
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
    )
    trainer.save_model()
    assert trainer.state.best_model_checkpoint is not None
    assert calls == []
    trainer.model.state_dict()  # and the counter counts
    assert len(calls) == 1
    trainer.close()
