"""On a CUDA device: the engine trains like plain AdamW on the same device, host shards are
pinned, offloaded state leaves the device, activation offload's side stream gives the same
bits, 8-bit states run through bitsandbytes' CUDA kernels, and the estimate's device tier
matches torch.cuda's measured peak.

These need a GPU, so they are skipped on a machine without one (CI has none); they run on a
lent GPU machine with ``python3 -m pytest tests/test_gpu.py`` (docs/design.md, status), or
with the ZeroTrainer case as a step of its own through ``benchmarks/gpu_suite.sh``."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from harness import MAX_NORM, batches, build, loss_of, train_reference, train_zero
from test_engine_equivalence import check

import zerotune

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def full_fp32_matmuls():
    """TF32 rounds fp32 products to 10 mantissa bits: the reference and the engine would
    each be right yet differ by ~1e-3. Compare full fp32 on both sides."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


_references: dict[tuple, dict] = {}


def cuda_reference(model_name: str, clip: float | None = MAX_NORM) -> dict:
    key = (model_name, clip)
    if key not in _references:
        ref = train_reference(model_name, clip=clip, device="cuda")
        ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
        ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
        _references[key] = ref
    return _references[key]


CASES = [
    # (model, config, accumulation micro-batches, no_sync for the first one)
    ("gpt2", {"stage": 1}, 2, False),
    ("gpt2", {"stage": 2}, 2, True),
    ("gpt2", {"stage": 3}, 2, True),
    ("odd", {"stage": 3}, 2, True),
    ("gpt2_ckpt", {"stage": 3}, 2, False),
    ("gpt2", {"stage": 1, "offload_optimizer": "cpu"}, 2, False),
    ("gpt2", {"stage": 3, "offload_optimizer": "cpu"}, 2, False),
    ("gpt2", {"stage": 2, "offload_optimizer": "cpu"}, 2, True),
    ("gpt2", {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}, 2, False),
    ("gpt2", {"stage": 3, "offload_optimizer": "nvme"}, 2, False),
    ("gpt2", {"stage": 3, "offload_param": "nvme"}, 1, False),
    (
        "gpt2",
        {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "grad_host_bytes": 0},
        2,
        False,
    ),
    ("gpt2_ckpt", {"stage": 3, "offload_activations": "cpu", "offload_optimizer": "cpu"}, 1, False),
    ("gpt2_ckpt", {"stage": 3, "offload_activations": "nvme"}, 2, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[1].values()))}")
def test_every_mode_matches_plain_adamw_on_the_device(case, tmp_path):
    model, extra, accum, no_sync = case
    config = dict(extra)
    if "nvme" in config.values():
        config.update(nvme_path=str(tmp_path), staging_bytes=3 * 16 * 4096 * 3)
    res = train_zero(0, 1, model, config, accum=accum, use_no_sync=no_sync, device="cuda")
    res["weights"] = {k: v.numpy() for k, v in res["weights"].items()}
    ref = cuda_reference(model)
    check(res, ref, f"cuda {case}")
    np.testing.assert_allclose(res["eval_loss"], ref["eval_loss"], rtol=1e-5)
    if "offload_activations" in config:
        memory = res["memory"]
        assert memory["checkpoints_device"] == 0
        assert memory["checkpoints_offloaded_peak"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("clip", [MAX_NORM, None], ids=["clipped", "unclipped"])
def test_overlapped_step_with_host_state_matches_plain_adamw_on_the_device(clip):
    """[Note: host updates off the launching thread]: with the optimizer on the host, the
    overlapped step's Adam runs on the update thread and carries into the next forward."""
    config = {"stage": 3, "offload_optimizer": "cpu"}
    res = train_zero(0, 1, "gpt2", config, accum=2, clip=clip, device="cuda", overlap=True)
    res["weights"] = {k: v.numpy() for k, v in res["weights"].items()}
    ref = cuda_reference("gpt2", clip)
    check(res, ref, f"cuda overlapped {config} clip={clip}")
    assert res["launched"] > 0 and res["carried"] > 0, (res["launched"], res["carried"])


def test_a_failed_overlapped_backward_on_the_device_is_given_up():
    """[Note: a backward that raises inside overlapped()] with the Adam on the update
    thread and the model on the device: after an out-of-memory error in the last
    micro-batch's clipped overlapped backward and ``zero_grad``, the step taken again
    trains like plain AdamW on the device."""
    from test_failed_passes import FAIL_AT, STEPS, train_with_a_failure

    config = {"stage": 3, "offload_optimizer": "cpu"}
    res = train_with_a_failure(0, 1, config, "zero_adamw", "backward", 2, True, device="cuda")
    ref = train_reference("gpt2", steps=STEPS, device="cuda")
    ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
    ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
    res["weights"] = {k: v.numpy() for k, v in res["weights"].items()}
    assert res["steps"] == [STEPS] and FAIL_AT < STEPS
    check(res, ref, "cuda failed overlapped backward")


def test_bf16_on_the_device_stays_within_bf16_tolerance():
    ref = cuda_reference("gpt2")
    res = train_zero(0, 1, "gpt2", {"stage": 3, "dtype": "bf16"}, accum=2, device="cuda")
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=2e-2)
    assert res["losses"][-1] < res["losses"][0] - 0.1
    for name, w in ref["weights"].items():
        assert np.abs(res["weights"][name].float().numpy() - w).max() < 5e-2, name


def _device_bytes_at_rest(config: dict) -> tuple[int, zerotune.ZeroEngine]:
    """Device bytes the engine holds between steps (after one step), and the engine. No
    unit stays gathered (persistence_threshold 0), so what the model states leave on the
    device shows."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    engine = zerotune.shard(build("gpt2").cuda(), {**config, "persistence_threshold": 0})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    ids = batches("gpt2", 1)[0].cuda()
    engine.backward(loss_of(engine, ids))
    opt.step()
    opt.zero_grad()
    del ids
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - base, engine


def test_cpu_offload_pins_host_shards_and_empties_the_device():
    numel = sum(p.numel() for p in build("gpt2").parameters())
    kept, engine = _device_bytes_at_rest({"stage": 3})
    engine.close()
    # On the device: fp32 parameter shards, gradient shards and two moments.
    assert kept >= 4 * 4 * numel
    moved, engine = _device_bytes_at_rest(
        {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}
    )
    trainable = [u for u in engine.units if u.trainable]
    for unit in trainable:
        assert unit.master.device.type == "cpu" and unit.master.is_pinned(), unit.name
        assert unit.grad_shard is None or unit.grad_shard.device.type == "cpu", unit.name
    # Nothing per parameter stays on the device, only the pool's fp32 buffers that carried
    # each unit's gradient to the host (one per size, two of a size that recurs).
    sizes = [u.padded_numel * 4 for u in trainable]
    assert engine.pool.allocated_bytes <= sum(set(sizes)) + max(sizes)
    assert moved <= engine.pool.allocated_bytes + 1024, moved  # at most a stray scalar
    assert all(u.grad_shard.is_pinned() for u in trainable)
    engine.close()


def test_a_refused_registration_leaves_no_error_for_the_next_kernel(monkeypatch):
    """The driver refuses a null pointer; the error raised names the pinning, and the next
    kernel launch runs instead of reporting the driver's last error as its own."""
    from zerotune.memory import pinned

    register = pinned._register
    monkeypatch.setattr(pinned, "_register", lambda ptr, nbytes: register(0, nbytes))
    with pytest.raises(RuntimeError, match=r"cannot pin 4,096 bytes .*cudaHostRegister error 1\)"):
        pinned.pinned_empty(10, torch.float32)
    assert torch.ones(3, device="cuda").sum().item() == 3
    empty = pinned.pinned_empty(0, torch.float32)  # nothing to lock: never registered
    assert empty.shape == (0,) and empty.device.type == "cpu"


def test_host_shards_lock_their_own_size_not_a_power_of_two():
    """[Note: exact-size pinned memory]: a host shard of 129 MiB locks about 129 MiB, where
    torch's pinned allocator locks the 256 MiB block it rounds the request up to (measured
    here too, so that a machine where locking does not show in RSS fails loudly)."""
    import psutil

    from zerotune.memory.pinned import pinned_empty

    nbytes = 2**27 + 2**20
    proc, numel = psutil.Process(), nbytes // 4
    # Blocks earlier tests freed would hide the rounding (an older torch: the private call).
    (getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache)()
    before = proc.memory_info().rss
    ours = pinned_empty(numel, torch.float32)
    grown = proc.memory_info().rss - before
    before = proc.memory_info().rss
    theirs = torch.empty(numel, dtype=torch.float32, pin_memory=True)
    grown_torch = proc.memory_info().rss - before
    assert ours.is_pinned() and theirs.is_pinned()
    assert grown_torch >= 0.9 * 2**28, grown_torch
    assert grown <= 1.05 * nbytes, (grown, grown_torch)
    ours.copy_(torch.ones(numel, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    assert ours.sum().item() == numel


PLAN_CASES = [
    {"stage": 3},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    {"stage": 3, "dtype": "bf16", "offload_optimizer": "cpu"},
    {"stage": 3, "dtype": "bf16", "offload_param": "cpu"},
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "nvme"},
]


@pytest.mark.parametrize("config", PLAN_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_device_and_host_bytes_are_where_the_plan_puts_them(config, tmp_path):
    """Each tensor of the model states is on the tier the estimate plans for it (measured
    by where the engine's tensors are, per kind)."""
    from zerotune.estimate import engine_bytes
    from zerotune.sharding.plan import plan_units

    if "nvme" in config.values():
        config = {**config, "nvme_path": str(tmp_path)}
    model = build("gpt2").cuda()
    cfg = zerotune.ZeroConfig.from_dict(config)
    planned = plan_units(model, cfg, 1)
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    engine.backward(loss_of(engine, batches("gpt2", 1)[0].cuda()))
    # Before the step: at world size 1 the gradients may be the parameters' own until then
    # (see [Note: gradients left in the parameters]); grad_shard gives them as one tensor.
    grad_shards = [u.grad_shard for u in engine.units]
    opt.step()
    expected = engine_bytes(planned, cfg, 1, device="cuda")
    found: dict[str, dict[str, int]] = {}

    def add(kind, t):
        if t is not None and t.numel():
            tier = "host" if t.device.type == "cpu" else "device"
            found.setdefault(kind, {}).setdefault(tier, 0)
            found[kind][tier] += t.numel() * t.element_size()

    for u in engine.units:
        add("params", u.full if u.persistent else u.shard)
        if u.master is not None and u.master is not u.shard:
            add("master", u.master)
    for g in grad_shards:
        add("grads", g)
    for m, v in getattr(opt.store, "moments", {}).values():
        add("optimizer", m)
        add("optimizer", v)
    engine.close()
    for kind in ("params", "master", "grads", "optimizer"):
        assert found.get(kind, {}) == expected.get(kind, {}), (kind, found, expected)


def test_8bit_states_on_the_device_follow_the_host_path():
    """The device tier quantizes with bitsandbytes' CUDA kernels, the CPU tier with its CPU
    ones: the same codes up to edge rounding, so the losses agree closely."""
    config = {"stage": 3, "optim_state_bits": 8}
    host = train_zero(0, 1, "gpt2", config, accum=1, clip=None)
    dev = train_zero(0, 1, "gpt2", config, accum=1, clip=None, device="cuda")
    np.testing.assert_allclose(dev["losses"], host["losses"], rtol=2e-3)
    assert dev["losses"][-1] < dev["losses"][0] - 0.25
    assert dev["memory"]["optimizer"] == host["memory"]["optimizer"]


ESTIMATE_CASES = [
    {"stage": 3},
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    {"stage": 3, "dtype": "bf16", "offload_optimizer": "cpu"},
]


@pytest.mark.parametrize("config", ESTIMATE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_estimate_of_device_memory_matches_the_measured_peak(config):
    from transformers import GPT2Config

    seq, micro = 256, 4
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=seq)
    # An earlier case's engine and optimizer (reference cycles) would be collected in the
    # middle of this one, and the peak above the base would miss what they held.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = zerotune.zero_init(cfg, config)
    assert engine.device.type == "cuda"
    opt = zerotune.ZeroAdamW(engine, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    warnings = zerotune.check_estimate(
        engine, {"device": measured}, seq_len=seq, micro_batch=micro, min_bytes=8 * 2**20
    )
    engine.close()
    assert warnings == [], warnings


HOST_COPY_CASES = [
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    {"stage": 3, "dtype": "bf16", "offload_optimizer": "cpu"},
]


@pytest.mark.parametrize("config", HOST_COPY_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_the_estimates_host_copies_are_the_device_buffers_the_engine_allocates(config):
    """World size 1, gradients bound for an optimizer on the host: the device buffers they
    pass through (sharding/grads.py ``_gradients_to_host``: with accumulation two per unit,
    two units in flight) are the estimate's ``host_copies`` line plus its device-tier pool
    buffers, byte for byte (tests/test_sizing.py checks the other lines on a CPU)."""
    from zerotune.sharding.buffers import host_copy_buffers, pool_buffers
    from zerotune.sharding.plan import plan_swap, plan_units

    cfg = zerotune.ZeroConfig.from_dict(config)
    units = plan_units(build("gpt2"), cfg, 1)
    swap = plan_swap(units, cfg, 1)
    keys, _, _ = pool_buffers(units, cfg, 1, swap, "cuda")
    copies = host_copy_buffers(units, cfg, 1, swap, "cuda")
    assert copies.get("device", 0) > 0, copies  # these cases copy through device buffers
    planned = copies["device"] + sum(
        numel * size * n for (numel, size, tier), n in keys.items() if tier == "device"
    )
    engine = zerotune.shard(build("gpt2").cuda(), cfg)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    for ids in batches("gpt2", 2):
        for part in ids.cuda().chunk(2):  # two micro-batches: the second adds on the device
            engine.backward(loss_of(engine, part) / 2)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    used = {
        (numel, dtype.itemsize): n for (numel, dtype), n in engine.pool.most_in_use.items() if n
    }
    engine.close()
    allocated = sum(numel * size * n for (numel, size), n in used.items())
    assert allocated == planned, (used, copies, keys)


def test_a_device_named_without_its_index_keeps_the_shards():
    """``device="cuda"`` is ``cuda:<current>``: a shard in device memory is not mistaken for
    a host shard (whose gathered copy is freed after use)."""
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    engine = zerotune.zero_init(cfg, {"stage": 3}, device="cuda")
    engine.module.eval()  # no dropout: the two passes see the same weights, the same way
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    ids = batches("gpt2", 1)[0].cuda()
    with torch.no_grad():
        first = float(loss_of(engine, ids))
        second = float(loss_of(engine, ids))
    assert first == second
    engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_checkpoint_round_trip_and_export_with_offloaded_shards(offload, tmp_path):
    """Save after two steps, load into a fresh engine (parameter shards on the host or on
    NVMe), same weights and next loss; the HF export has the same weights."""
    from zerotune.checkpoint import export_hf, load_checkpoint, save_checkpoint

    config = {"stage": 3, "offload_param": offload, "offload_optimizer": offload}
    if offload == "nvme":
        config["nvme_path"] = str(tmp_path / "swap")
        os.makedirs(config["nvme_path"])

    def trained(steps):
        engine = zerotune.shard(build("gpt2").cuda(), config)
        opt = zerotune.ZeroAdamW(engine, lr=1e-3)
        for ids in batches("gpt2", steps):
            engine.backward(loss_of(engine, ids.cuda()))
            opt.step()
        return engine, opt

    engine, opt = trained(2)
    save_checkpoint(engine, str(tmp_path / "ckpt"), step=2)
    weights = engine.full_state_dict()
    ids = batches("gpt2", 3)[2].cuda()
    engine.backward(loss_of(engine, ids))
    opt.step()
    after = engine.full_state_dict()
    engine.close()

    fresh, opt2 = trained(0)
    assert load_checkpoint(fresh, str(tmp_path / "ckpt")).step == 2
    got = fresh.full_state_dict()
    for name, w in weights.items():
        assert torch.equal(got[name], w), name
    fresh.backward(loss_of(fresh, ids))
    opt2.step()
    for name, w in fresh.full_state_dict().items():
        assert torch.equal(w, after[name]), name
    fresh.close()
    from safetensors.torch import load_file

    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="fp32")
    exported = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            exported.update(load_file(os.path.join(out, f)))
    for name, w in weights.items():
        if name in exported:
            assert torch.equal(exported[name], w), name
    assert "transformer.wte.weight" in exported


GENERIC_CASES = [
    ("sgd", {"stage": 3}),
    ("adafactor", {"stage": 3}),
    ("adafactor", {"stage": 2, "offload_optimizer": "cpu"}),
    ("hf_adafactor", {"stage": 3}),
    ("lion", {"stage": 3}),
    ("adamw_bnb_8bit", {"stage": 3}),
    ("custom", {"stage": 1, "offload_optimizer": "cpu"}),
    ("sgd", {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}),
    ("adafactor", {"stage": 3, "offload_optimizer": "nvme"}),
]


@pytest.mark.parametrize("name, config", GENERIC_CASES, ids=lambda c: str(c))
def test_generic_optimizers_match_the_plain_optimizer_on_the_device(
    name, config, tmp_path, monkeypatch
):
    """zerotune.ZeroOptimizer on the device (and with its state on the host or NVMe) against
    the same optimizer on the plain model on the same device."""
    import test_generic_optimizers

    # bitsandbytes' CUDA kernels flip more 8-bit codes on last-bit gradient differences than
    # its CPU ones (1.4% and 2.1% of a small weight seen, each by at most 6e-4).
    monkeypatch.setitem(test_generic_optimizers.FLIPS, "adamw_bnb_8bit", (0.05, 1e-3))
    if "nvme" in config.values():
        config = dict(config, nvme_path=str(tmp_path))
    from test_generic_optimizers import MODEL
    from test_generic_optimizers import check as check_generic

    model = MODEL.get(name, "gpt2")
    ref = train_reference(model, optimizer=name, device="cuda")
    ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
    ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
    res = train_zero(0, 1, model, config, accum=2, use_no_sync=True, device="cuda", optimizer=name)
    res["weights"] = {k: v.numpy() for k, v in res["weights"].items()}
    check_generic(res, ref, name, f"cuda {name} {config}")


def test_zero_trainer_on_the_device_logs_the_plain_trainers_losses(tmp_path):
    """ZeroTrainer at stage 3 with the optimizer on the CPU against the plain Trainer, both
    on the GPU (use_cpu off), same arguments and seed."""
    from trainer_cases import logged, plain_run, zero_run

    plain = plain_run(str(tmp_path / "plain"), use_cpu=False)
    zero = zero_run(str(tmp_path / "zero"), use_cpu=False, zero_stage=3, offload_optimizer="cpu")
    assert zero.engine.device.type == "cuda"
    assert all(u.master.device.type == "cpu" for u in zero.engine.units if u.master is not None)
    assert len(logged(zero)) == len(logged(plain)) > 0
    torch.testing.assert_close(logged(zero), logged(plain), rtol=1e-4, atol=0)
    zero.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_gathered_generation_on_the_device_gives_the_plain_tokens(offload, tmp_path):
    """[Note: gathered for generation] on a GPU: the room is the device's free memory (CUDA's
    count), each unit is fetched from the host or the file once, and a budget too small
    falls back to unit by unit with the same tokens."""
    from test_generation import CountGathers, byte_gpt2
    from test_generation import prompts as ids

    from zerotune.hf.generation import free_bytes, gather_for_generation

    prompt = ids().cuda()
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        expected = byte_gpt2().cuda().eval().generate(prompt, **settings).tolist()
    config = {"stage": 3, "offload_param": offload, "offload_optimizer": offload}
    if offload == "nvme":
        config["nvme_path"] = str(tmp_path)
    engine = zerotune.ZeroEngine(byte_gpt2().eval(), zerotune.load_config(config), device="cuda")
    free = torch.cuda.mem_get_info()[0]
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert free <= free_bytes(engine) <= free + cached  # the device's count, not the host's
    units = [u.index for u in engine.units if not u.persistent]
    mp = pytest.MonkeyPatch()
    gathers = CountGathers(mp)
    try:
        for budget, per_unit in ((None, 1), (1, 6)):
            gather_for_generation(engine.module, budget=budget)
            gathers.counts.clear()
            with torch.no_grad():
                assert engine.module.generate(prompt, **settings).tolist() == expected
            assert all(gathers.counts[i] >= per_unit for i in units), gathers.counts
            if budget is None:
                assert gathers.counts == {i: 1 for i in units}
    finally:
        mp.undo()
        engine.close()


def test_inductor_compiled_units_on_the_device_match_plain_adamw():
    """[Note: compiled units] with Triton kernels: the gathered parameters' device memory
    changes between steps under the same compiled graphs. Last in the file: compiling takes
    the longest, and the suite's time limit should cut it rather than the checks above."""
    config = {"stage": 3, "offload_optimizer": "cpu"}
    res = train_zero(
        0, 1, "gpt2", config, device="cuda", overlap=True, compile_kwargs={"backend": "inductor"}
    )
    res["weights"] = {k: v.numpy() for k, v in res["weights"].items()}
    check(res, cuda_reference("gpt2"), f"cuda compiled {config}")
