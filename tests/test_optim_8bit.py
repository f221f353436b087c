"""8-bit Adam moments (optim_state_bits=8): training tracks fp32 AdamW as closely as
bitsandbytes' own AdamW8bit does, on every tier and at world size 2; NVMe optimizer traffic
and optimizer memory roughly halve; checkpoints carry the quantized state exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import run_world, tiny_gpt2
from harness import LR, WD, batches, build, loss_of, no_decay_groups, train_zero

import zerotune
from zerotune.checkpoint import load_checkpoint, save_checkpoint
from zerotune.checkpoint.files import TensorFileReader
from zerotune.optim.quant8 import MIN_8BIT_NUMEL, Q8Moments, blocks
from zerotune.sharding.plan import plan_units

STEPS = 50


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """bitsandbytes' CPU (de)quantization runs OpenMP threads: on a busy 2-core machine,
    spinning on tiny blocks costs 100x what it computes (as for the CLI tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Several chunks per 8-bit unit on NVMe (4096 elements each, units of 12,704).
SMALL_STAGING = 200_000


def train_plain(make_optimizer, steps: int = STEPS) -> np.ndarray:
    """The harness's tiny GPT-2 and data, one process, the given optimizer, no clipping."""
    model = build("gpt2")
    opt = make_optimizer(model)
    losses = []
    for ids in batches("gpt2", steps):
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return np.array(losses)


def bnb_adamw8bit(model):
    """bitsandbytes' AdamW8bit quantizing the same tensors zerotune does: every parameter
    of the units with at least MIN_8BIT_NUMEL elements, none of the others."""
    import bitsandbytes as bnb

    config = zerotune.ZeroConfig(optim_state_bits=8)
    small = {
        s.name for u in plan_units(model, config, 1) if u.numel < MIN_8BIT_NUMEL for s in u.slots
    }
    assert small  # the embeddings and the final norm: the fp32 side is exercised too
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    named = dict(model.named_parameters())
    for name in small:
        manager.override_config(named[name], "min_8bit_size", 2**62)
    return bnb.optim.AdamW8bit(no_decay_groups(model, WD), lr=LR, min_8bit_size=1)


@pytest.fixture(scope="module")
def yardstick():
    """fp32 AdamW, bitsandbytes' AdamW8bit, and how far apart their losses get."""
    fp32 = train_plain(lambda m: torch.optim.AdamW(no_decay_groups(m, WD), lr=LR))
    bnb8 = train_plain(bnb_adamw8bit)
    deviation = float(np.abs(bnb8 - fp32).max())
    return {"fp32": fp32, "bnb8": bnb8, "bound": 1.5 * deviation + 1e-4, "deviation": deviation}


def config_for(tier: str, nvme_root=None, bits: int = 8, **extra) -> dict:
    """``tier`` none, cpu or nvme for the optimizer; "nvme-both" puts the parameters on
    NVMe too (then the parameter file holds the fp32 master and the 8-bit chunk records
    only the moments)."""
    optim = "nvme" if tier == "nvme-both" else tier
    config = {"stage": 3, "offload_optimizer": optim, "optim_state_bits": bits}
    if tier == "nvme-both":
        config["offload_param"] = "nvme"
    if optim == "nvme":
        config.update(nvme_path=str(nvme_root), staging_bytes=SMALL_STAGING)
    return {**config, **extra}


def test_losses_track_fp32_within_bitsandbytes_tolerance(yardstick, tmp_path):
    fp32, bnb8, bound = yardstick["fp32"], yardstick["bnb8"], yardstick["bound"]
    assert yardstick["deviation"] > 1e-5  # 8-bit state visibly differs from fp32
    assert bnb8[-1] < bnb8[0] - 1.0  # and it learns
    losses = {}
    for tier in ("none", "cpu", "nvme", "nvme-both"):
        config = config_for(tier, tmp_path)
        result = train_zero(0, 1, "gpt2", config, steps=STEPS, clip=None)
        losses[tier] = np.array(result["losses"])
        deviation = np.abs(losses[tier] - fp32).max()
        assert deviation <= bound, (tier, deviation, yardstick["deviation"])
        # Close to bitsandbytes itself (its blocks are per tensor, zerotune's per shard).
        assert np.abs(losses[tier] - bnb8).max() <= bound, tier
    # The tiers differ only in where the codes live: the same bits come out.
    np.testing.assert_array_equal(losses["cpu"], losses["none"])
    np.testing.assert_array_equal(losses["nvme"], losses["none"])
    np.testing.assert_array_equal(losses["nvme-both"], losses["none"])
    # And the moments really are 8-bit: fp32 state follows AdamW far more closely.
    exact = np.array(train_zero(0, 1, "gpt2", {"stage": 3}, steps=STEPS, clip=None)["losses"])
    assert np.abs(exact - fp32).max() < 1e-5
    assert np.abs(losses["none"] - exact).max() > 1e-5


# ----------------------------------------------------------------------- world size 2
def world2_cases(rank, world, nvme_root):
    from test_estimate import engine_vs_plan

    nvme = train_zero(rank, world, "gpt2", config_for("nvme", nvme_root), steps=STEPS, clip=None)
    cases = [
        ("gpt2", config_for("none")),
        ("gpt2", config_for("cpu", dtype="bf16")),
        ("gpt2", config_for("nvme", nvme_root, grad_host_bytes=0, offload_param="nvme")),
    ]
    from test_checkpoint import save_then_continue

    saved = save_then_continue(rank, world, f"{nvme_root}/ckpt", "gpt2", config_for("cpu"))
    return {
        "losses": nvme["losses"],
        "plans": engine_vs_plan(rank, world, nvme_root, cases),
        "saved": saved["losses"],
    }


def test_world_2_nvme_tracks_fp32_and_the_estimate_holds(yardstick, tmp_path):
    results = run_world(2, world2_cases, str(tmp_path))
    losses = np.array(results[0]["losses"])
    deviation = np.abs(losses - yardstick["fp32"]).max()
    assert deviation <= yardstick["bound"], (deviation, yardstick["deviation"])
    for rank, result in enumerate(results):
        for r in result["plans"]:
            assert r["report"] == r["expected"], rank
    # Resharded 2 -> 1: the codes are dequantized and quantized again in the new blocks
    # (not bit-exact), and training goes on as the never-stopped run did.
    from test_checkpoint import SAVE_AT, resume

    resumed = resume(0, 1, str(tmp_path / "ckpt"), "gpt2", config_for("cpu"))
    np.testing.assert_allclose(resumed["losses"], results[0]["saved"][SAVE_AT:], rtol=1e-4)


# ------------------------------------------------------------------- bytes and memory
def wide_gpt2():
    """GPT-2 with 64-wide layers: every unit but the position embedding and the final norm
    is large enough for 8-bit state, so the ratios show the per-element costs."""
    return tiny_gpt2(seed=0, n_embd=64)


def _proc_wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def nvme_traffic(bits: int, nvme_root, tier: str = "nvme") -> dict:
    """Bytes the optimizer step writes and reads per step, counted by the store and by the
    kernel (/proc/self/io wchar around ``step()``); bytes of the optim swap file and of the
    fp32 masters of the units that have optimizer state."""
    config = config_for(tier, nvme_root, bits=bits, staging_bytes="4MiB")
    engine = zerotune.shard(wide_gpt2(), config)
    optim = [e for (kind, _), e in engine.swap.extents.items() if kind == "optim"]
    masters = sum(
        4 * u.shard_numel for u in engine.units if ("optim", u.index) in engine.swap.extents
    )
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    store_written, kernel_written, read = [], [], []
    for ids in batches("gpt2", 3):
        engine.backward(loss_of(engine, ids))
        w0, r0, k0 = opt.store.bytes_written, opt.store.bytes_read, _proc_wchar()
        opt.step()
        kernel_written.append(_proc_wchar() - k0)
        store_written.append(opt.store.bytes_written - w0)
        read.append(opt.store.bytes_read - r0)
    report = engine.memory_report()
    engine.close()
    return {
        "store": store_written,
        "kernel": kernel_written,
        "read": read,
        "nvme": report["nvme"],
        "optim_file": sum(e.nbytes for e in optim),
        "masters": masters,
    }


def test_nvme_optimizer_traffic_per_step_halves(tmp_path):
    fp32, q8 = nvme_traffic(32, tmp_path), nvme_traffic(8, tmp_path)
    numel = sum(p.numel() for p in wide_gpt2().parameters())
    for r in (fp32, q8):
        assert len(set(r["store"])) == 1 and r["read"] == r["store"]  # same every step
        # What the kernel saw written equals what the store sent (nothing else writes).
        for store, kernel in zip(r["store"], r["kernel"]):
            assert store <= kernel <= store * 1.02 + 65536, (store, kernel)
    per_param_32 = fp32["store"][0] / numel
    per_param_8 = q8["store"][0] / numel
    assert 12 <= per_param_32 < 12.5  # master + two fp32 moments (+ 4 KiB rounding)
    assert 6 <= per_param_8 < 6.6  # master + two codes + absmax (+ fp32 small units)
    ratio = q8["kernel"][0] / fp32["kernel"][0]
    assert 0.5 <= ratio <= 0.55, ratio
    assert 0.5 <= q8["nvme"] / fp32["nvme"] <= 0.55  # the swap file shrinks alike


def test_with_parameters_on_nvme_8bit_records_hold_only_the_moments(tmp_path):
    """Both tiers on NVMe: the parameter file holds the fp32 master, so an 8-bit chunk
    record is codes and absmax only (~2 bytes a parameter through O_DIRECT instead of 6),
    and the master moves through the page cache (with fp32 moments it is updated there, in
    place, and does not move at all)."""
    fp32, q8 = nvme_traffic(32, tmp_path, "nvme-both"), nvme_traffic(8, tmp_path, "nvme-both")
    numel = sum(p.numel() for p in wide_gpt2().parameters())
    for r, masters in ((fp32, 0), (q8, q8["masters"])):
        assert len(set(r["store"])) == 1 and r["read"] == r["store"]
        # Every step moves the whole optim extent plus each master of a quantized unit
        # once, nothing more (units too small to quantize keep fp32 moments, and so their
        # master where it is).
        assert r["optim_file"] + 0.95 * masters <= r["store"][0] <= r["optim_file"] + masters
        for store, kernel in zip(r["store"], r["kernel"]):
            assert store <= kernel <= store * 1.02 + 65536, (store, kernel)
    assert fp32["masters"] == q8["masters"] == 4 * numel
    assert 8 <= fp32["optim_file"] / numel < 8.5  # two fp32 moments (+ 4 KiB rounding)
    assert 2 <= q8["optim_file"] / numel < 2.4  # two codes + absmax (+ fp32 small units)
    # Against the records that carry the master (optimizer alone on NVMe): 4 bytes less a
    # parameter through O_DIRECT, the same through the kernel in all.
    alone = nvme_traffic(8, tmp_path)
    assert alone["optim_file"] - q8["optim_file"] >= 4 * numel * 0.95
    # (less by the masters of the small fp32-moment units, updated in place)
    assert 0 <= alone["store"][0] - q8["store"][0] <= 0.03 * alone["store"][0]


def optimizer_bytes(bits: int) -> dict:
    engine = zerotune.shard(wide_gpt2(), config_for("cpu", bits=bits, dtype="bf16"))
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    engine.backward(loss_of(engine, batches("gpt2", 1)[0]))
    opt.step()
    return engine.memory_report()


def test_memory_report_optimizer_bytes_are_about_half():
    fp32, q8 = optimizer_bytes(32), optimizer_bytes(8)
    numel = sum(p.numel() for p in wide_gpt2().parameters())
    assert fp32["master"] == q8["master"] == 4 * numel  # the master stays fp32
    assert fp32["optimizer"] == 8 * numel
    ratio = (q8["master"] + q8["optimizer"]) / (fp32["master"] + fp32["optimizer"])
    assert 0.5 <= ratio <= 0.52, ratio  # ~6 of 12 bytes per parameter
    # The rule behind it: 2 bytes + 8 per 256-element block for 8-bit units.
    small = [
        u for u in plan_units(wide_gpt2(), zerotune.ZeroConfig(), 1) if u.numel < MIN_8BIT_NUMEL
    ]
    large = [
        u for u in plan_units(wide_gpt2(), zerotune.ZeroConfig(), 1) if u.numel >= MIN_8BIT_NUMEL
    ]
    expected = sum(8 * u.shard for u in small) + sum(
        2 * u.shard + 8 * math.ceil(u.shard / 256) for u in large
    )
    assert q8["optimizer"] == expected


def test_estimate_takes_the_option():
    from zerotune.estimate import estimate

    plans = {b: estimate(wide_gpt2(), optim_state_bits=b, dtype="bf16") for b in (32, 8)}
    a = plans[32].option(3, "none", "cpu").rows["optimizer"]["host"]
    b = plans[8].option(3, "none", "cpu").rows["optimizer"]["host"]
    report = optimizer_bytes(8)
    assert b == report["master"] + report["optimizer"]
    assert 0.5 <= b / a <= 0.52
    assert plans[8].to_dict()["optim_state_bits"] == 8
    assert plans[8].option(3, "nvme", "nvme").config()["optim_state_bits"] == 8
    assert "Adam moments 8-bit" in plans[8].format()


# ------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("tier", ["none", "nvme", "nvme-both"])
def test_checkpoint_resume_is_exact(tmp_path, tier):
    from test_checkpoint import SAVE_AT, resume, save_then_continue

    config = config_for(tier, tmp_path)
    a = save_then_continue(0, 1, str(tmp_path / "ckpt"), "gpt2", config)
    b = resume(0, 1, str(tmp_path / "ckpt"), "gpt2", config)
    assert b["losses"] == a["losses"][SAVE_AT:]
    # The file holds codes and absmax values for the large units, fp32 for the small ones.
    reader = TensorFileReader(next((tmp_path / "ckpt").glob("step-*/rank-*.safetensors")))
    units = plan_units(build("gpt2"), zerotune.ZeroConfig(**config), 1)
    for u in units[1:]:
        if u.numel >= MIN_8BIT_NUMEL:
            assert reader.entries[f"u{u.index}.exp_avg.q8"].dtype == torch.uint8
            assert reader.entries[f"u{u.index}.exp_avg_sq.absmax"].shape == (
                math.ceil(u.shard / 256),
            )
        elif u.trainable:
            assert reader.entries[f"u{u.index}.exp_avg"].dtype == torch.float32
    assert sum(u.numel >= MIN_8BIT_NUMEL for u in units) == 2  # the two blocks
    reader.close()


def _trained(bits: int, root, steps: int = 3):
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3, "optim_state_bits": bits})
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    for ids in batches("gpt2", steps):
        engine.backward(loss_of(engine, ids))
        opt.step()
    save_checkpoint(engine, root, step=steps)
    return engine, opt


def _fresh(bits: int):
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, {"stage": 3, "optim_state_bits": bits})
    return engine, zerotune.ZeroAdamW(engine, groups, lr=LR)


def test_checkpoint_converts_between_8_and_32_bits(tmp_path):
    saved8, _ = _trained(8, tmp_path / "q8")
    saved32, _ = _trained(32, tmp_path / "f32")
    # 8-bit into 32-bit: the moments are the dequantized codes the 8-bit run was using.
    engine, _ = _fresh(32)
    load_checkpoint(engine, tmp_path / "q8")
    for unit, old in zip(engine.units, saved8.units):
        state, before = engine.unit_state(unit), saved8.unit_state(old)
        torch.testing.assert_close(state["master"], before["master"], rtol=0, atol=0)
        if "exp_avg.q8" in before:
            values = Q8Moments.from_state(before).dequantize()
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[k], values[k], rtol=0, atol=0)
                assert state[k].abs().max() > 0
        elif "exp_avg" in before:
            torch.testing.assert_close(state["exp_avg"], before["exp_avg"], rtol=0, atol=0)
    # 32-bit into 8-bit: quantized in the run's own blocks.
    engine, _ = _fresh(8)
    load_checkpoint(engine, tmp_path / "f32")
    for unit, old in zip(engine.units, saved32.units):
        state, before = engine.unit_state(unit), saved32.unit_state(old)
        if "exp_avg.q8" in state:
            expected = Q8Moments.zeros(unit.shard_numel, "cpu")
            expected.quantize({k: before[k] for k in ("exp_avg", "exp_avg_sq")})
            for key, value in expected.as_state().items():
                assert torch.equal(state[key], value), key


# ----------------------------------------------------------------------------- errors
def test_config_errors(monkeypatch, tmp_path):
    with pytest.raises(zerotune.ConfigError, match="optim_state_bits must be 32 or 8, got 4"):
        zerotune.ZeroConfig(optim_state_bits=4)
    # Too little staging for three 8-bit chunk records and one chunk's fp32 moments.
    with pytest.raises((zerotune.ConfigError, ValueError), match="staging_bytes=40,000 is too"):
        zerotune.shard(build("gpt2"), config_for("nvme", tmp_path, staging_bytes=40_000))
    # A checkpoint's moments of the wrong kind or size are refused by name.
    engine, opt = _fresh(8)
    block = next(u for u in engine.units if u.numel >= MIN_8BIT_NUMEL)
    n = block.shard_numel
    state = {"exp_avg.q8": torch.zeros(n, dtype=torch.uint8), "exp_avg.absmax": torch.zeros(3)}
    with pytest.raises(ValueError, match=f"exp_avg.absmax has 3 elements, expected {n // 256 + 1}"):
        engine.load_unit_state(block, state)
    with pytest.raises(ValueError, match="give either exp_avg"):
        opt.store.write_unit(block, {"exp_avg": torch.zeros(n), **state})
    # bitsandbytes missing: one sentence saying what to install, before any training.
    import zerotune.optim.quant8 as quant8

    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes.functional", None)
    monkeypatch.setattr(quant8, "_codes", {})
    engine = zerotune.shard(build("gpt2"), config_for("cpu"))
    with pytest.raises(zerotune.ConfigError, match="optim_state_bits=8 needs bitsandbytes"):
        zerotune.ZeroAdamW(engine, lr=LR)


# ------------------------------------------------------------- one update, element-wise
def _simd_levels() -> list[str]:
    from zerotune.ops import load_op

    op = load_op("adam")
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(op.set_simd_level("auto")) + 1] if op is not None else ["scalar"]


@pytest.fixture(params=_simd_levels())
def simd(request):
    """Each SIMD level of the C++ op this CPU has (the quantizer's AVX2 path serves avx512)."""
    from zerotune.ops import load_op

    op = load_op("adam")
    if op is None:
        pytest.skip("the C++ adam op is not built here (bitsandbytes' functions run instead)")
    op.set_simd_level(request.param)
    yield op
    op.set_simd_level("auto")


def _nearest(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The nearest code of each value of a sorted table, ties to the lower code: the number
    of midpoints strictly below the value. In float64 the midpoints of fp32 neighbours are
    exact and so is the compare (distances would round: a value of 1e-41 is as far from
    -0.018 as from +0.018 in float64)."""
    t = table.double()
    mids = (t[:-1] + t[1:]) / 2
    codes = (y.double()[:, None] > mids[None, :]).sum(1)
    if table[0] == 0 and table[1] > 0:
        # A table of non-negative codes from 0 (exp_avg_sq's): no positive value becomes
        # 0 (see [Note: no positive value becomes zero] in csrc/adam/quant8.cpp).
        codes = torch.where(y > 0, codes.clamp(min=1), codes)
    return codes


def test_cpu_quantizer_picks_the_nearest_code_and_dequantizes_exactly(simd):
    """The C++ quantizer (csrc/adam/quant8.cpp): each element's code is the nearest one to
    value / absmax of its block (checked against all 256), absmax is the block's largest
    magnitude, a zero block stays zero, a block with a NaN dequantizes to NaN, and
    dequantizing is code[q] * absmax exactly; magnitudes over nine decades, a block of
    denormals (absmax ~1e-40, no finite reciprocal), a short last block, values exactly on
    the codes and on either side of the midpoints between them; at every SIMD level."""
    from zerotune.optim.quant8 import BLOCK, MOMENTS, code

    g = torch.Generator().manual_seed(0)
    n = BLOCK * 40 + 17
    for name in MOMENTS:
        table = code(name, "cpu")
        scale = 10.0 ** -torch.randint(0, 9, (n // BLOCK + 1,), generator=g).float()
        x = torch.randn(n, generator=g) * scale.repeat_interleave(BLOCK)[:n]
        if name == "exp_avg_sq":
            x = x.abs()
        x[BLOCK : 2 * BLOCK] = 0.0  # a zero block
        x[2 * BLOCK : 3 * BLOCK] = table[torch.randint(0, 256, (BLOCK,), generator=g)]
        x[2 * BLOCK] = 1.0  # absmax 1: the values are exactly codes
        mids = ((table[:-1].double() + table[1:].double()) / 2).float()
        near = torch.cat([mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(-mids - 2)])
        x[3 * BLOCK : 3 * BLOCK + near.numel()] = near  # midpoints and their neighbours
        x[3 * BLOCK + near.numel() : 6 * BLOCK] = 0.0
        x[3 * BLOCK] = 1.0
        x[6 * BLOCK : 7 * BLOCK] = torch.randn(BLOCK, generator=g).abs() * 1e-40
        tiny = torch.tensor([1.0, 1e-30, 1e-9, 1e-8, 1e-7, 1.62e-7, 1.63e-7, 3e-7, 0.0])
        x[7 * BLOCK : 7 * BLOCK + tiny.numel()] = tiny  # far below code[1] / 2, and near it
        q8 = Q8Moments.zeros(n, "cpu")
        q8.quantize({name: x})
        q, absmax = q8.q[name], q8.absmax[name]
        per = absmax.repeat_interleave(BLOCK)[:n]
        blocks_max = torch.stack([x[i : i + BLOCK].abs().max() for i in range(0, n, BLOCK)])
        assert torch.equal(absmax, blocks_max)
        y = torch.where(per > 0, x / torch.where(per > 0, per, 1.0), 0.0).double()
        distance = (y[:, None] - table.double()[None, :]).abs()
        best = distance.min(1).values
        ours = (y - table.double()[q.long()]).abs()
        # exp_avg_sq: a positive value nearest to 0 takes code 1 (see [Note: no positive
        # value becomes zero] in csrc/adam/quant8.cpp); every other is the nearest code.
        on_tie = distance.eq(best[:, None]).float().argmax(1)  # ties: the lower code
        floored = (y > 0) & (on_tie == 0) if name == "exp_avg_sq" else torch.zeros_like(y > 0)
        assert (name != "exp_avg_sq") or floored.any()  # the case is covered
        assert torch.equal(q.long()[floored], torch.ones_like(q.long()[floored])), name
        kept = ~floored
        assert torch.equal(ours[kept], best[kept]), name  # the nearest code, exactly
        tie = kept & (ours == best)
        assert torch.equal(q.long()[tie], on_tie[tie]), name
        assert torch.equal(table[q[2 * BLOCK : 3 * BLOCK].long()], x[2 * BLOCK : 3 * BLOCK])
        deq = q8.dequantize()[name]
        assert torch.equal(deq, table[q.long()] * per)
        assert not deq[BLOCK : 2 * BLOCK].any()
        x[5] = float("nan")
        q8.quantize({name: x})
        deq = q8.dequantize()[name]
        assert deq[:BLOCK].isnan().all() and not deq[BLOCK:].isnan().any()
        x[5] = float("inf")
        q8.quantize({name: x})
        assert q8.absmax[name][0].isnan() and not q8.absmax[name][1:].isnan().any()


def test_cpu_quantizer_levels_give_the_same_bytes_for_any_table(simd):
    """Random bit patterns (every finite float, denormals and both zeros; infinities and
    NaNs excluded) quantized with the dynamic maps and with a table dense enough that a
    bucket holds several midpoints (the vector path's check and scalar fallback): codes
    equal to the brute-force nearest, and the same bytes as the scalar level."""
    from zerotune.optim.quant8 import code

    level = simd.simd_level()
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(x.isfinite(), x, 0.0)
    x[::97] *= 1e-30  # blocks whose absmax ranges over many decades
    dense = torch.sort(torch.cat([torch.linspace(-1, 1, 56), torch.linspace(0.9, 0.95, 200)]))[0]
    assert (dense[1:] - dense[:-1]).min() < 2**-8  # several midpoints in one bucket
    for table in (code("exp_avg", "cpu"), code("exp_avg_sq", "cpu"), dense):
        values = x.abs() if table.min() >= 0 else x
        n = values.numel()
        absmax, q = torch.empty(n // 256), torch.empty(n, dtype=torch.uint8)
        simd.quantize_blockwise(values, table, absmax, q)
        y = values / absmax.repeat_interleave(256)
        assert torch.equal(q.long(), _nearest(y, table))
        simd.set_simd_level("scalar")
        absmax_s, q_s = torch.empty_like(absmax), torch.empty_like(q)
        simd.quantize_blockwise(values, table, absmax_s, q_s)
        assert torch.equal(q, q_s) and torch.equal(absmax, absmax_s)
        simd.set_simd_level(level)


def test_one_update_matches_bitsandbytes_8bit_kernel():
    """zerotune's dequantize -> Adam kernel -> quantize against bitsandbytes' own CPU
    ``optimizer_update_8bit_blockwise`` (AdamW8bit's step) on one shard, from the same state
    at every step: the same parameters and absmax values up to float rounding in the Adam
    arithmetic, and codes equal to bitsandbytes' for 95% of elements and never farther from
    the value than its: ours are the nearest codes, its CPU search is approximate (a few %
    one code off, and some tiny exp_avg_sq values several codes up; see [Note: nearest
    code by table] in csrc/adam/quant8.cpp)."""
    import bitsandbytes.functional as bnbf

    from zerotune.optim.cpu_adam import adam_update
    from zerotune.optim.quant8 import BLOCK, code

    n = 5000  # not a multiple of 256: a short last block
    g = torch.Generator().manual_seed(0)
    ours_p = torch.randn(n, generator=g)
    ours = Q8Moments.zeros(n, "cpu")
    theirs = Q8Moments.zeros(n, "cpu")
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    far = 0
    for step in range(1, 11):
        theirs.copy_(ours)
        theirs_p = ours_p.clone()
        grad = torch.randn(n, generator=g) * (1 + step % 3)
        work = ours.dequantize()
        adam_update(ours_p, grad, work["exp_avg"], work["exp_avg_sq"], step=step, **hyper)
        ours.quantize(work)
        bnbf.optimizer_update_8bit_blockwise(
            "adam", grad, theirs_p, theirs.q["exp_avg"], theirs.q["exp_avg_sq"],
            hyper["beta1"], hyper["beta2"], 0.0, 0.0, hyper["eps"], step, hyper["lr"],
            code("exp_avg", "cpu"), code("exp_avg_sq", "cpu"),
            theirs.absmax["exp_avg"], theirs.absmax["exp_avg_sq"], hyper["weight_decay"],
        )  # fmt: skip
        torch.testing.assert_close(ours_p, theirs_p, rtol=1e-5, atol=1e-6)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.absmax[k], theirs.absmax[k], rtol=1e-5, atol=0)
            y = work[k] / ours.absmax[k].repeat_interleave(BLOCK)[:n]
            table = code(k, "cpu")
            ours_err = (y - table[ours.q[k].long()]).abs()
            theirs_err = (y - table[theirs.q[k].long()]).abs()
            assert bool((ours_err <= theirs_err + 1e-7).all()), (step, k)
            differ = (ours.q[k].int() - theirs.q[k].int()).abs()
            assert (differ > 0).float().mean() < 0.05, (step, k)
            far += int((differ > 1).sum())
    assert far > 0  # bitsandbytes' approximate search shows on this data


def test_fused_8bit_update_gives_the_bytes_of_three_passes(simd):
    """The one-pass 8-bit Adam op (csrc/adam/cpu_adam.cpp, [Note: fused 8-bit step]) against
    dequantize -> ``adam_update`` per segment -> quantize: the same parameters, codes, absmax
    values and bf16 copy, bit for bit, at every SIMD level; segments with their own
    hyper-parameters that start and end inside blocks, gaps (padding) between them, a short
    last block, bf16 and fp16 gradients, Adam with L2 and no bias correction, a NaN gradient;
    and a shard large enough for the threaded path (64-block work items) whose first segment
    starts after the first block, with an empty segment."""
    from zerotune.optim.cpu_adam import adam_update, adam_update_8bit

    g = torch.Generator().manual_seed(3)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8)
    small = 256 * 9 + 77
    large = (1 << 17) + 333
    cases = [
        (torch.float32, small, [
            (0, 300, dict(step=3, lr=1e-2, weight_decay=0.1, **hyper)),
            (300, 1000, dict(step=3, lr=5e-3, weight_decay=0.0, **hyper)),
            (1100, 2000, dict(step=7, lr=1e-3, weight_decay=0.05, adamw=False, **hyper)),
            (2000, small - 5, dict(step=1, lr=1e-2, weight_decay=0.0, bias_correction=False,
                                   **hyper)),
        ]),
        (torch.bfloat16, small, [(0, small, dict(step=2, lr=1e-2, weight_decay=0.1, **hyper))]),
        (torch.float16, large, [
            (600, 600, dict(step=2, lr=1e-2, weight_decay=0.1, **hyper)),  # empty
            (600, 70000, dict(step=2, lr=1e-2, weight_decay=0.1, **hyper)),
            (70002, large, dict(step=5, lr=3e-3, weight_decay=0.0, **hyper)),
        ]),
    ]  # fmt: skip
    for grad_dtype, n, segments in cases:
        start = Q8Moments.zeros(n, "cpu")
        start.quantize(
            {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}
        )
        param = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g).to(grad_dtype)
        grad[700] = float("nan")  # its block turns NaN in both paths
        ours, theirs = Q8Moments.zeros(n, "cpu"), Q8Moments.zeros(n, "cpu")
        ours.copy_(start)
        theirs.copy_(start)
        p_ours, p_theirs = param.clone(), param.clone()
        lowp = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
        out_ours, out_theirs = torch.zeros(n, dtype=lowp), torch.zeros(n, dtype=lowp)
        assert adam_update_8bit(p_ours, grad, ours, segments, out_ours)
        work = theirs.dequantize()
        for a, b, kw in segments:
            adam_update(
                p_theirs[a:b], grad[a:b], work["exp_avg"][a:b], work["exp_avg_sq"][a:b],
                out_lowp=out_theirs[a:b], **kw,
            )  # fmt: skip
        theirs.quantize_reached(work, segments)
        same = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN where NaN
        torch.testing.assert_close(p_ours, p_theirs, **same)
        torch.testing.assert_close(out_ours, out_theirs, **same)
        assert p_ours.isnan().sum() == 1  # the NaN gradient's parameter
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.q[k], theirs.q[k]), k
            torch.testing.assert_close(ours.absmax[k], theirs.absmax[k], **same)
            nan = ours.absmax[k].isnan()
            assert nan[700 // 256] and nan.sum() == 1
        changed = p_ours != param
        changed[700] = True  # NaN
        inside = torch.zeros(n, dtype=torch.bool)
        for a, b, _ in segments:
            inside[a:b] = True
        assert changed[inside].float().mean() > 0.99  # it did update the segments
        assert not changed[~inside].any()  # and nothing outside them
        # Blocks no segment reaches keep their bytes (the large case's first two).
        untouched = [i for i in range(blocks(n)) if not inside[i * 256 : (i + 1) * 256].any()]
        assert untouched == ([0, 1] if n == large else []), untouched
        for k in ("exp_avg", "exp_avg_sq"):
            for i in untouched:
                assert torch.equal(
                    ours.q[k][i * 256 : (i + 1) * 256], start.q[k][i * 256 : (i + 1) * 256]
                )
                assert torch.equal(ours.absmax[k][i], start.absmax[k][i])


def test_8bit_training_without_the_fused_op_is_identical(tmp_path, monkeypatch):
    """With the one-pass op unavailable the optimizer dequantizes each chunk into its reused
    scratch buffer, updates and quantizes: the same losses, bit for bit, on the CPU tier and
    with both tiers on NVMe (the chunk records without the master); with no C++ op at all
    (bitsandbytes' CPU functions) it trains too, within their rounding."""
    import zerotune.optim.quant8 as quant8
    import zerotune.optim.zero_adam as zero_adam

    ran = []

    def spy(*args):
        ran.append(real(*args))
        return ran[-1]

    real = zero_adam.adam_update_8bit
    for tier in ("cpu", "nvme-both"):
        ran.clear()
        with monkeypatch.context() as patch:
            patch.setattr(zero_adam, "adam_update_8bit", spy)
            fused = train_zero(0, 1, "gpt2", config_for(tier, tmp_path), steps=8, clip=None)
        assert ran and all(ran), tier  # the one-pass op did every 8-bit update
        with monkeypatch.context() as patch:
            patch.setattr(zero_adam, "adam_update_8bit", lambda *args: False)
            passes = train_zero(0, 1, "gpt2", config_for(tier, tmp_path), steps=8, clip=None)
            # And with bitsandbytes' CPU functions (no C++ op at all): its search is
            # approximate (see test_one_update_matches_bitsandbytes_8bit_kernel), so close.
            patch.setattr(quant8, "_cpu_op", lambda tensors: None)
            bnb = train_zero(0, 1, "gpt2", config_for(tier, tmp_path), steps=8, clip=None)
        assert passes["losses"] == fused["losses"], tier
        np.testing.assert_allclose(bnb["losses"], fused["losses"], rtol=0, atol=2e-3)
        assert bnb["losses"] != fused["losses"]  # it did take bitsandbytes' path


def test_untied_embedding_rows_without_gradient_keep_adam_sized_steps():
    """A tiny Llama with untied embeddings, 8-bit moments against fp32 AdamW: rows of tokens
    absent from later batches get no gradient, and their exp_avg_sq, far below the block's
    largest, used to be stored as code 0 while exp_avg kept their momentum; the next step
    divided by sqrt(0) + eps and moved such weights by ~1.3 (thousands of lr). Now the
    embedding stays as close to fp32 AdamW as bitsandbytes' AdamW8bit keeps it (~4e-3)."""
    import bitsandbytes as bnb
    from conftest import tiny_llama_config
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config("llama")
    config.vocab_size, config.tie_word_embeddings = 300, False
    config._attn_implementation = "eager"

    def model():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)

    g = torch.Generator().manual_seed(1234)
    data = [
        (
            torch.randint(0, 300, (4, 1), generator=g)
            + torch.randint(1, 4, (4, 1), generator=g) * torch.arange(16)
        )
        % 300
        for _ in range(6)
    ]

    def train(net, opt):
        for ids in data:
            net(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    fp32 = model()
    train(fp32, torch.optim.AdamW(fp32.parameters(), lr=3e-3, weight_decay=0.0))
    theirs = model()
    train(theirs, bnb.optim.AdamW8bit(theirs.parameters(), lr=3e-3, weight_decay=0.0))
    engine = zerotune.shard(model(), {"stage": 3, "optim_state_bits": 8})
    train(engine, zerotune.ZeroAdamW(engine, lr=3e-3, weight_decay=0.0))
    ours = engine.full_state_dict()
    name = "model.embed_tokens.weight"
    want = dict(fp32.named_parameters())[name].detach()
    bnb_off = (dict(theirs.named_parameters())[name].detach() - want).abs().max()
    our_off = (ours[name] - want).abs().max()
    assert our_off < max(2 * bnb_off, 1e-3), (float(our_off), float(bnb_off))
