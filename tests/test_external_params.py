"""Parameters used outside their unit are registered automatically; reads outside forward
give the value at world size 1 and a clear error at larger sizes, never an empty tensor."""

from __future__ import annotations

import pytest
import torch
from conftest import run_world
from harness import train_zero
from test_engine_equivalence import check
from test_engine_hooks import _ref


def run_external(rank, world, auto):
    if not auto:
        import zerotune

        try:
            train_zero(
                rank, world, "external", {"stage": 3, "auto_external_params": False}, steps=1
            )
        except zerotune.ShardedParameterError as exc:
            return {"error": str(exc)}
        return {"error": None}
    out = train_zero(rank, world, "external", {"stage": 3}, accum=2, use_no_sync=True)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_external_use_trains_like_plain_adamw(world):
    res = run_world(world, run_external, True)[0]
    check(res, _ref("external"), f"external world={world}")
    assert set(res["states_after"]) == {"sharded"}


def test_switching_auto_registration_off_breaks_the_external_model():
    # The test above exercises auto-registration: without it the same model fails loudly.
    res = run_world(2, run_external, False)[0]
    assert res["error"] is not None
    assert "auto_external_params is off" in res["error"]


def test_registrations_are_the_expected_ones(caplog):
    from harness import batches, build, loss_of

    import zerotune

    model = build("external")
    engine = zerotune.shard(model, {"stage": 3})
    with caplog.at_level("INFO", logger="zerotune.sharding.external"):
        loss_of(engine, batches("external", 1)[0]).backward()
        loss_of(engine, batches("external", 1)[0]).backward()
    found = {(owner, user) for _, owner, user in engine.external.registered}
    assert found == {("emb", "<root>"), ("blocks.0", "blocks.1"), ("proj", "<root>")}
    # Logged once each, not once per step.
    assert len([r for r in caplog.records if "registered as an external" in r.message]) == 3


def _read_outside_forward(rank, world, config):
    """Train one step, then read a weight through its module outside forward."""
    from harness import batches, build, loss_of

    import zerotune

    model = build("gpt2")
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    loss_of(engine, batches("gpt2", 1)[0]).backward()
    opt.step()
    attn = model.transformer.h[0].attn.c_attn
    try:
        read = attn.weight
    except zerotune.ShardedParameterError as exc:
        read = str(exc)
    with engine.gathered():
        inside = attn.weight.detach().clone()
    whole = engine.full_state_dict()["transformer.h.0.attn.c_attn.weight"]
    return {"read": read, "inside": inside, "whole": whole, "empty": attn._parameters["weight"]}


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_reading_a_parameter_outside_forward_at_world_size_1(tmp_path, offload):
    """Nothing to gather from another rank: the read gives the trained value, from the tier
    holding it, as a copy that refuses writes; the parameter itself stays released."""
    config = {"stage": 3, "offload_param": offload}
    if offload == "nvme":
        config["nvme_path"] = str(tmp_path)
    out = _read_outside_forward(0, 1, config)
    assert out["read"].shape == (32, 96) and not isinstance(out["read"], torch.nn.Parameter)
    assert torch.equal(out["read"], out["whole"]) and torch.equal(out["inside"], out["whole"])
    assert out["empty"].numel() == 0  # released again after the read
    with pytest.raises(RuntimeError, match="[Ii]nplace update to inference tensor"):
        out["read"].add_(1.0)


def test_reading_a_sharded_parameter_outside_forward_at_world_size_2():
    """An attribute read that all-gathered would hang when only one rank reads: it raises,
    naming what to do instead, and that works."""
    for out in run_world(2, _read_outside_forward, {"stage": 3}):
        assert "engine.gathered()" in out["read"] and "over 2 ranks" in out["read"], out["read"]
        inside, whole = torch.as_tensor(out["inside"]), torch.as_tensor(out["whole"])
        assert torch.equal(inside, whole) and whole.shape == (32, 96)


def test_manual_registration():
    from harness import batches, build, loss_of

    import zerotune

    model = build("external")
    engine = zerotune.shard(model, {"stage": 3, "auto_external_params": False})
    engine.register_external("emb.weight", model)
    engine.register_external("blocks.0.ff.0.weight", model.blocks[1])
    engine.register_external("proj.weight", model)
    loss = loss_of(engine, batches("external", 1)[0])
    loss.backward()
    assert torch.isfinite(loss)


def _param_counts(model) -> list[int]:
    return [
        model.num_parameters(only_trainable=t, exclude_embeddings=e)
        for t in (False, True)
        for e in (False, True)
    ]


def run_param_counts(rank, world, config):
    """transformers' num_parameters of a model before and after shard(), a layer frozen."""
    from conftest import tiny_llama_config
    from transformers import AutoModelForCausalLM

    import zerotune

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    before = _param_counts(model)
    engine = zerotune.shard(model, config)
    after = _param_counts(engine.module)
    engine.close()
    return before, after


@pytest.mark.parametrize(
    "world, config",
    [(1, {"stage": 3}), (2, {"stage": 3, "tile_linear_bytes": 512}), (2, {"stage": 2})],
)
def test_num_parameters_counts_the_full_sizes(world, config):
    """At stage 3 the released parameters are empty; the model's num_parameters (logged by
    the Trainer's integrations) still counts the plain model's sizes, tiles merged."""
    for before, after in run_world(world, run_param_counts, config):
        assert before[0] > before[1] > 0 and before[0] > before[2] > 0, before
        assert after == before
