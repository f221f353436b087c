"""Parameters used outside their unit are registered automatically; reads outside forward
raise a clear error instead of handing out an empty tensor."""

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


def test_reading_a_sharded_parameter_outside_forward():
    from harness import build

    import zerotune

    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": 3})
    with pytest.raises(zerotune.ShardedParameterError, match="engine.gathered"):
        model.transformer.h[0].attn.c_attn.weight.sum()
    with engine.gathered():
        w = model.transformer.h[0].attn.c_attn.weight.clone()
    assert torch.equal(w, engine.full_state_dict()["transformer.h.0.attn.c_attn.weight"])
    assert w.shape == (32, 96)


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
