"""Memory-centric tiling: TiledLinear equals nn.Linear / Conv1D, a tiled GPT-2 trains like
plain AdamW, a wide layer's gathered bytes fall by the tiling factor, exports keep the
untiled names, and bad values are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import (
    FIXED,
    LR,
    STEPS,
    WD,
    build,
    no_decay_groups,
    train_and_save,
    train_reference,
    train_zero,
)
from test_engine_equivalence import check, reference
from torch import nn
from transformers.pytorch_utils import Conv1D

import zerotune
from zerotune.checkpoint import CheckpointError, export_hf
from zerotune.config import ConfigError, ZeroConfig
from zerotune.sharding.plan import plan_units
from zerotune.sharding.tiling import MAX_TILES, LinearTile, TiledLinear, apply_tiling


# --------------------------------------------------------------------- the layer itself
def _weight_grad(tiled: TiledLinear) -> torch.Tensor:
    whole = torch.zeros(tiled.weight_shape)
    for tile, (r0, r1), (c0, c1) in tiled.blocks():
        whole[r0:r1, c0:c1] = tile.weight.grad
    return whole


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize(
    "in_splits,out_splits",
    [(1, 3), (3, 1), (2, 4), ([2, 5, 6], [1, 4, 6]), (13, 11)],
    ids=["out", "in", "both", "uneven", "every-feature"],
)
def test_tiled_linear_equals_the_untiled_layer(kind, in_splits, out_splits):
    torch.manual_seed(0)
    layer = nn.Linear(13, 11) if kind == "linear" else Conv1D(11, 13)
    with torch.no_grad():
        layer.bias.normal_()
    tiled = TiledLinear.from_linear(layer, in_splits=in_splits, out_splits=out_splits)
    assert tiled.bias is layer.bias  # the same parameter, under the same name
    assert len(tiled.tiles) == (len(tiled.in_bounds) - 1) * (len(tiled.out_bounds) - 1)
    x = torch.randn(3, 5, 13, dtype=torch.float32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = layer(x1), tiled(x2)
    # Partial sums over input tiles add in another order than one matmul: float rounding.
    np.testing.assert_allclose(y2.detach(), y1.detach(), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y1)
    bias_grads = []
    for module, y in ((layer, y1), (tiled, y2)):
        y.backward(g)
        bias_grads.append(module.bias.grad.clone())
        module.bias.grad = None
    np.testing.assert_allclose(x2.grad, x1.grad, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_weight_grad(tiled), layer.weight.grad, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(bias_grads[1], bias_grads[0])  # bias added once


def test_tiled_linear_without_bias_and_fresh_weights():
    torch.manual_seed(0)
    t = TiledLinear(10, 6, bias=False, in_splits=2, out_splits=3)
    assert t.bias is None and len(t.tiles) == 6
    # Fresh tiles draw like nn.Linear: uniform within 1/sqrt(in_features) of the whole layer.
    w = torch.cat([tile.weight.detach().reshape(-1) for tile in t.tiles])
    assert w.abs().max() <= 1 / np.sqrt(10) and w.std() > 0.1
    x = torch.randn(4, 10)
    ref = (
        x
        @ torch.cat(
            [torch.cat([t.tiles[j * 2 + i].weight for i in range(2)], 1) for j in range(3)]
        ).T
    )
    np.testing.assert_allclose(t(x).detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    assert t.weight.shape == (6, 10) and t.weight.is_meta  # shape reads still work


def test_apply_tiling_cuts_large_layers_into_tiles_of_at_most_the_limit():
    model = build("gpt2")
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    replaced = apply_tiling(model, 1536, 4)
    tiled = [m for m in model.modules() if isinstance(m, TiledLinear)]
    # c_attn (32x96), attn.c_proj (32x32), c_fc (32x128), mlp.c_proj (128x32), per block;
    # the tied head is left whole.
    assert len(tiled) == 8 and len(replaced) == 8
    for m in tiled:
        assert max(t.weight.numel() * 4 for t in m.tiles) <= 1536
    assert model.lm_head.weight is model.transformer.wte.weight
    c_fc = model.transformer.h[0].mlp.c_fc
    assert (len(c_fc.out_bounds) - 1, len(c_fc.in_bounds) - 1) == (11, 1)
    # 480 bytes (120 elements) is less than one output feature of mlp.c_proj (in 128).
    model = build("gpt2")
    apply_tiling(model, 480, 4)
    c_proj = model.transformer.h[0].mlp.c_proj
    assert (len(c_proj.out_bounds) - 1, len(c_proj.in_bounds) - 1) == (32, 2)
    # The unit plan (zerotune estimate) is the engine's, and planning leaves the model as is.
    model = build("gpt2")
    config = ZeroConfig(stage=3, tile_linear_bytes=1536)
    plans = plan_units(model, config, 1)
    assert not any(isinstance(m, TiledLinear) for m in model.modules())
    engine = zerotune.shard(model, config)
    assert [(p.name, p.numel) for p in plans] == [(u.name, u.numel) for u in engine.units]
    # root, wte, wpe, the (tied) head; per block the block and its 8 + 3 + 11 + 11 tiles
    assert len(engine.units) == 4 + 2 * (1 + 8 + 3 + 11 + 11)
    # Every untiled name is still a weight or bias of the model, or a tile of one.
    model = build("gpt2")
    apply_tiling(model, 480, 4)
    tile_names = {n for n, _ in model.named_parameters() if ".tiles." in n}
    assert tile_names and all(n.rsplit(".tiles.", 1)[0] + ".weight" in names for n in tile_names)


# ---------------------------------------------------------------- training equivalence
def run_tiled(rank, world, cases):
    out = []
    for tile_bytes, stage, accum, steps in cases:
        config = {"stage": stage, "tile_linear_bytes": tile_bytes}
        res = train_zero(rank, world, "gpt2", config, accum=accum, steps=steps)
        out.append(res)
    return out


# (tile_linear_bytes, stage, accumulation micro-batches, steps). 1536: output-feature
# tiles only; 480: mlp.c_proj also split along input features (partial sums), 8x more units.
TILED_CASES = {
    1: [(1536, 3, 1, STEPS), (1536, 2, 2, STEPS)],
    2: [(1536, 3, 2, STEPS), (480, 3, 1, 4)],
}


@pytest.mark.parametrize("world", [1, 2])
def test_tiled_gpt2_trains_like_plain_adamw(world):
    results = run_world(world, run_tiled, TILED_CASES[world])[0]
    for case, res in zip(TILED_CASES[world], results):
        steps = case[3]
        if steps == STEPS:
            ref = reference("gpt2")
        else:
            ref = train_reference("gpt2", steps=steps)
            ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
            ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
        # full_state_dict gives the untiled names and shapes (check compares them).
        check(res, ref, f"world={world} tiled {case}")


# ------------------------------------------------------------------ gathered bytes
class WideNet(nn.Module):
    """One very wide linear (64 -> 4096, 1 MiB of fp32 weights) and a squared loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(64, 4096)

    def forward(self, x):
        return self.wide(x).pow(2).mean()


def run_wide(rank, world):
    return [_train_wide(rank, tile_bytes) for tile_bytes in (0, 128 * 1024)]


def _train_wide(rank, tile_bytes):
    model = WideNet()
    # The bias (16 KiB) stays gathered (persistence threshold): what is counted is the
    # weight. No prefetch: an on-demand gather of each unit, nothing ahead.
    config = {
        "stage": 3,
        "tile_linear_bytes": tile_bytes,
        "prefetch_bytes": 0,
        "persistence_threshold": 32 * 1024,
    }
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(8, 64, generator=g))
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    sharded = [u for u in engine.units if not u.persistent]
    report = engine.memory_report()
    return {
        "losses": losses,
        "gathered_peak": report["gathered_peak"],
        "gathered_now": report["gathered_now"],
        "unit_bytes": [u.gathered_bytes for u in sharded],
        "weights": engine.full_state_dict(),
    }


def test_peak_gathered_bytes_of_a_wide_layer_fall_by_the_tiling_factor():
    whole, tiled = run_world(2, run_wide)[0]
    assert whole["unit_bytes"] == [(64 * 4096 + 4096) * 4]  # weight and bias, one unit
    assert tiled["unit_bytes"] == [128 * 1024] * 8  # eight tiles of 128 KiB, the bias apart
    # Forward and backward gathered one tile at a time.
    assert whole["gathered_peak"] == 1_064_960
    assert tiled["gathered_peak"] == 131_072
    ratio = whole["gathered_peak"] / tiled["gathered_peak"]
    assert 7.9 < ratio < 8.2, ratio  # 8 tiles (the untiled unit also held the bias)
    assert whole["gathered_now"] == tiled["gathered_now"] == 0
    np.testing.assert_allclose(tiled["losses"], whole["losses"], rtol=1e-5)
    assert sorted(tiled["weights"]) == ["wide.bias", "wide.weight"]
    np.testing.assert_allclose(
        tiled["weights"]["wide.weight"], whole["weights"]["wide.weight"], rtol=1e-5, atol=1e-6
    )


# ------------------------------------------------------------------ export and reload
def train_tiled_and_save(rank, world, tmp, tile_bytes):
    engine, out = train_and_save(rank, world, tmp, 3, {"stage": 3, "tile_linear_bytes": tile_bytes})
    out["n_tiles"] = sum(isinstance(m, LinearTile) for m in engine.module.modules())
    return out


def save_export_reload(rank, world, tmp):
    """Train and save tiled (1536 bytes: GPT-2's Conv1D weights are [in, out], so output-
    feature tiles are column blocks of the saved tensors); export; stream the untiled
    folder back into an engine tiled at 480 bytes (row and column blocks)."""
    trained = train_tiled_and_save(rank, world, tmp, 1536)
    # The checkpoint resumes into an engine tiled the same way.
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    resumed = zerotune.shard(model, {"stage": 3, "tile_linear_bytes": 1536})
    zerotune.ZeroAdamW(resumed, groups, lr=LR)
    zerotune.load_checkpoint(resumed, f"{tmp}/ckpt")
    trained["resumed"] = resumed.full_state_dict()
    if rank == 0:
        export_hf(f"{tmp}/ckpt", f"{tmp}/hf", dtype="fp32")
    torch.distributed.barrier()
    engine = zerotune.from_pretrained(f"{tmp}/hf", {"stage": 3, "tile_linear_bytes": 480})
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=FIXED).logits
    trained["reloaded"] = {"weights": engine.full_state_dict(), "logits": logits}
    return trained


def test_export_and_reload_give_the_untiled_architecture(tmp_path):
    from transformers import AutoModelForCausalLM

    trained = run_world(2, save_export_reload, str(tmp_path))[0]
    assert trained["n_tiles"] == 2 * (8 + 3 + 11 + 11)
    plain = build("gpt2")
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert {n: v.shape for n, v in trained["weights"].items()} == shapes
    for name, value in trained["weights"].items():
        np.testing.assert_array_equal(trained["resumed"][name], value, err_msg=name)

    out = tmp_path / "hf"
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (tmp_path / "live" / name).read_bytes(), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info  # no missing / unexpected keys
    assert type(model.transformer.h[0].mlp.c_proj).__name__ == "Conv1D"
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    for name, value in trained["weights"].items():
        np.testing.assert_array_equal(dict(model.named_parameters())[name].detach(), value)
    with torch.no_grad():
        logits = model(input_ids=FIXED).logits.numpy()
    np.testing.assert_allclose(logits, trained["logits"], rtol=1e-5, atol=1e-5)

    # The untiled folder streamed into a tiled engine (each tile reads its block) at world 2.
    back = trained["reloaded"]
    for name, value in trained["weights"].items():
        np.testing.assert_array_equal(back["weights"][name], value, err_msg=name)
    np.testing.assert_allclose(back["logits"], trained["logits"], rtol=1e-5, atol=1e-5)


def zero_init_tiled(rank, world):
    from conftest import tiny_gpt2

    config = tiny_gpt2(layers=2).config
    engine = zerotune.zero_init(config, {"stage": 3, "tile_linear_bytes": 1536}, seed=3)
    return engine.full_state_dict()


def test_zero_init_tiles_draw_as_the_model_initializes_the_layer():
    w1 = run_world(1, zero_init_tiled)[0]
    w2 = run_world(2, zero_init_tiled)[0]
    for name, value in w1.items():
        np.testing.assert_array_equal(w2[name], value, err_msg=name)  # any world size
    c_fc = w1["transformer.h.0.mlp.c_fc.weight"]
    c_proj = w1["transformer.h.1.mlp.c_proj.weight"]
    assert c_fc.shape == (32, 128) and c_proj.shape == (128, 32)
    # GPT-2: Conv1D weights N(0, 0.02); c_proj scaled by 1/sqrt(2 * n_layer).
    assert abs(c_fc.std() - 0.02) < 0.002, c_fc.std()
    assert abs(c_proj.std() - 0.01) < 0.001, c_proj.std()
    assert not np.any(w1["transformer.h.0.mlp.c_fc.bias"])


# ------------------------------------------------------------------------ bad values
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"in_splits": 0}, "in_splits must be between 1 and 13"),
        ({"out_splits": 12}, "out_splits must be between 1 and 11"),
        ({"in_splits": [5, 5]}, "positive sizes summing to 13"),
        ({"out_splits": [11, 0]}, "positive sizes summing to 11"),
        ({"layout": "conv2d"}, "layout must be 'linear' or 'conv1d'"),
    ],
)
def test_bad_splits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TiledLinear(13, 11, **kwargs)


def test_bad_tile_sizes_are_refused(tmp_path):
    with pytest.raises(TypeError, match="can only tile nn.Linear or Conv1D"):
        TiledLinear.from_linear(nn.Embedding(4, 4))
    with pytest.raises(ConfigError, match="tile_linear_bytes: a size cannot be negative"):
        zerotune.shard(build("odd"), {"tile_linear_bytes": -1})
    with pytest.raises(ValueError, match="smaller than one weight element"):
        zerotune.shard(WideNet(), {"tile_linear_bytes": 3})
    with pytest.raises(ValueError, match=f"tiles \\(more than {MAX_TILES}\\)"):
        zerotune.shard(WideNet(), {"tile_linear_bytes": 64})


def test_a_checkpoint_of_another_tiling_is_refused(tmp_path):
    engine = zerotune.shard(build("gpt2"), {"stage": 3, "tile_linear_bytes": 1536})
    zerotune.ZeroAdamW(engine, lr=LR)
    zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=1)
    other = zerotune.shard(build("gpt2"), {"stage": 3})
    with pytest.raises(CheckpointError, match="resume with the same tile_linear_bytes"):
        zerotune.load_checkpoint(other, tmp_path / "ckpt")


# ------------------------------------------------------------------------ ZeroTrainer
def test_zero_trainer_with_tiling_logs_the_plain_trainers_losses(tmp_path):
    from trainer_cases import logged, plain_run, zero_run
    from transformers import AutoModelForCausalLM

    plain = plain_run(str(tmp_path / "plain"))
    # Decay / no-decay groups come from the tiled model's names (tiles decay like weights).
    zero = zero_run(str(tmp_path / "zero"), zero_stage=3, tile_linear_bytes=1536)
    assert sum(isinstance(m, LinearTile) for m in zero.engine.module.modules()) == 66
    np.testing.assert_allclose(logged(zero), logged(plain), rtol=1e-5)
    zero.save_model(str(tmp_path / "saved"))
    weights = zero.engine.full_state_dict()
    zero.close()
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert all(not v for v in info.values()), info
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach(), weights[name], err_msg=name)  # fp32 run
