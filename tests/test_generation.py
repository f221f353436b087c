"""generate at stage 3 with the whole model gathered once per call (gather_for_generation):
the plain model's tokens, one gather per unit instead of one per unit and token, the units
released afterwards, and the unit-by-unit path, with one warning, when the model does not
fit; at world size 2 the ranks agree on the path and may stop at different lengths."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import run_world
from test_trl import GRPO_ARGS, byte_gpt2, grpo_run

import zerotune
from zerotune.estimate import format_bytes
from zerotune.hf.generation import GatheredGenerate, gather_for_generation
from zerotune.sharding.unit import Unit, UnitState

NEW = 6  # new tokens: one forward each


class CountGathers:
    """Counts, per unit index, the gathers that fetch a unit (those from SHARDED)."""

    def __init__(self, monkeypatch):
        self.counts: dict[int, int] = {}
        gather = Unit.gather

        def counted(unit, *args, **kwargs):
            if unit.state is UnitState.SHARDED:
                self.counts[unit.index] = self.counts.get(unit.index, 0) + 1
            return gather(unit, *args, **kwargs)

        monkeypatch.setattr(Unit, "gather", counted)


def shard(tmp_path, offload: str, **extra):
    config = {"stage": 3, **extra}
    if offload == "nvme":
        config.update(offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    elif offload == "cpu":
        config.update(offload_param="cpu")
    return zerotune.shard(byte_gpt2().eval(), config)


def prompts() -> torch.Tensor:
    return torch.tensor([[ord(c) for c in "count from 7:"], [ord(c) for c in "count from 9:"]])


def plain_ids() -> list:
    with torch.no_grad():
        return (
            byte_gpt2()
            .eval()
            .generate(prompts(), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
            .tolist()
        )


def generate(model) -> list:
    with torch.no_grad():
        return model.generate(
            prompts(), max_new_tokens=NEW, do_sample=False, eos_token_id=None
        ).tolist()


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_gathered_generate_fetches_each_unit_once_and_gives_the_plain_tokens(
    tmp_path, monkeypatch, offload
):
    expected = plain_ids()
    engine = shard(tmp_path, offload)
    units = [u.index for u in engine.units if not u.persistent]
    assert len(units) >= 3
    gathers = CountGathers(monkeypatch)
    assert generate(engine.module) == expected
    per_token = dict(gathers.counts)
    assert all(per_token.get(i, 0) >= NEW for i in units), per_token  # at least one per token

    gather_for_generation(engine.module)
    assert isinstance(engine.module.generate, GatheredGenerate)
    gathers.counts.clear()
    assert generate(engine.module) == expected
    assert gathers.counts == {i: 1 for i in units}
    assert all(engine.units[i].state is UnitState.SHARDED for i in units)  # released again

    gather_for_generation(engine.module, enabled=False)
    assert "generate" not in engine.module.__dict__
    assert not engine.module.__dict__["generate_batch"].gather  # refused at world size > 1
    gathers.counts.clear()
    assert generate(engine.module) == expected
    assert gathers.counts == per_token
    engine.close()


def paged_tokens(model, requests: list, new: int = NEW) -> list:
    """``generate_batch``'s greedy tokens for each request."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
    # A small paged cache: the default one is sized to the free memory, slow to set up.
    paged = ContinuousBatchingConfig(page_size=16, num_blocks=8, max_batch_tokens=64)
    out = model.generate_batch(
        inputs=requests, generation_config=config, continuous_batching_config=paged,
        warmup=False,
    )  # fmt: skip
    return [out[key].generated_tokens for key in sorted(out)]


def test_continuous_batching_is_gathered_once_too(monkeypatch):
    """``generate_batch`` (TRL's use_transformers_paged): the plain model's tokens, one gather
    per unit for the whole batch of requests."""
    requests = prompts().tolist()
    expected = paged_tokens(byte_gpt2().eval(), requests)
    engine = zerotune.shard(byte_gpt2().eval(), {"stage": 3})
    gather_for_generation(engine.module)
    gathers = CountGathers(monkeypatch)
    assert paged_tokens(engine.module, requests) == expected
    assert gathers.counts == {u.index: 1 for u in engine.units if not u.persistent}
    engine.close()


def generation_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zerotune.hf.generation"]


def test_a_model_that_does_not_fit_generates_unit_by_unit_with_one_warning(
    tmp_path, monkeypatch, caplog
):
    expected = plain_ids()
    engine = shard(tmp_path, "nvme")  # each gather takes memory of its own
    units = [u for u in engine.units if not u.persistent]
    whole = sum(u.gathered_bytes for u in units)
    gather_for_generation(engine.module, budget=whole - 100)
    gathers = CountGathers(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="zerotune.hf.generation"):
        assert generate(engine.module) == expected
        assert generate(engine.module) == expected
    assert all(gathers.counts[u.index] >= 2 * NEW for u in units), gathers.counts
    warnings = generation_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert (
        f"the whole model ({format_bytes(whole)}) would take {format_bytes(100)} more"
        in (warnings[0])
    )

    gather_for_generation(engine.module, budget=whole)  # exactly fits
    gathers.counts.clear()
    assert generate(engine.module) == expected
    assert gathers.counts == {u.index: 1 for u in units}
    engine.close()


def test_shards_that_are_the_whole_buffer_cost_nothing_to_gather(monkeypatch, caplog):
    """World size 1, parameters on the device: the shard is the whole flat buffer, so even a
    budget of nothing gathers the model once, without a warning."""
    engine = zerotune.shard(byte_gpt2().eval(), {"stage": 3})
    gather_for_generation(engine.module, budget=0)
    gathers = CountGathers(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="zerotune.hf.generation"):
        assert generate(engine.module) == plain_ids()
    assert gathers.counts == {u.index: 1 for u in engine.units if not u.persistent}
    assert generation_warnings(caplog) == []
    engine.close()


def test_max_live_bytes_bounds_the_gathered_model(tmp_path, monkeypatch, caplog):
    engine = shard(tmp_path, "nvme", max_live_bytes=1)
    gather_for_generation(engine.module)
    gathers = CountGathers(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="zerotune.hf.generation"):
        assert generate(engine.module) == plain_ids()
    assert min(gathers.counts.values()) == NEW
    warnings = generation_warnings(caplog)
    assert len(warnings) == 1 and "more than max_live_bytes (0.0 MiB)" in warnings[0], warnings
    engine.close()


def test_gather_for_generation_refuses_what_it_cannot_wrap():
    with pytest.raises(ValueError, match="not sharded by zerotune"):
        gather_for_generation(byte_gpt2())
    engine = zerotune.shard(byte_gpt2().eval(), {"stage": 3})
    own = engine.module.generate
    engine.module.__dict__["generate"] = own
    with pytest.raises(ValueError, match="its own generate"):
        gather_for_generation(engine.module)
    engine.close()


def generate_gathered_per_rank(rank, world, budget_on_rank_1, enabled=True):
    """Rank r asks for 2 + 3r new tokens; rank 1 alone may be given a budget too small."""
    plain = byte_gpt2().eval()
    engine = zerotune.shard(byte_gpt2().eval(), {"stage": 3})
    budget = budget_on_rank_1 if rank == 1 else None
    gather_for_generation(engine.module, enabled, budget=budget)
    patches = pytest.MonkeyPatch()  # a rank process has no fixture
    gathers = CountGathers(patches)
    try:
        prompt = torch.tensor([[ord(c) for c in f"count from {rank}:"]])
        new = 2 + 3 * rank
        with torch.no_grad():
            expected = plain.generate(
                prompt, max_new_tokens=new, do_sample=False, eos_token_id=None
            )
            got = engine.module.generate(
                prompt, max_new_tokens=new, do_sample=False, eos_token_id=None
            )
    finally:
        patches.undo()
    # Continuous batching, each rank its own requests: gathered, the plain model's tokens;
    # unit by unit refused (its ranks would not step together).
    refusal = batch = expected_batch = None
    try:
        batch = paged_tokens(engine.module, prompt.tolist(), new)
        expected_batch = paged_tokens(plain, prompt.tolist(), new)
    except RuntimeError as exc:
        refusal = str(exc)
    units = [u.index for u in engine.units if not u.persistent]
    engine.close()
    gathered = [gathers.counts.get(i, 0) for i in units]
    return got.tolist(), expected.tolist(), gathered, refusal, batch, expected_batch


@pytest.mark.parametrize("budget_on_rank_1, enabled", [(None, True), (1, True), (None, False)])
def test_world_2_ranks_agree_on_gathering_and_stop_at_different_lengths(budget_on_rank_1, enabled):
    """Rank 1 finishes its tokens later; with a budget too small on rank 1 only, or gathering
    off, both ranks generate unit by unit (one rank alone in gathered() would wait forever),
    and generate_batch is refused instead of hanging."""
    results = run_world(2, generate_gathered_per_rank, budget_on_rank_1, enabled, timeout=120)
    for rank, (got, expected, counts, refusal, batch, expected_batch) in enumerate(results):
        assert got == expected
        assert len(got[0]) == len(f"count from {rank}:") + 2 + 3 * rank
        if budget_on_rank_1 is None and enabled:
            assert counts == [1] * len(counts)
            assert refusal is None and batch == expected_batch and len(batch[0]) == 2 + 3 * rank
        else:
            assert min(counts) == 2 + 3 * 1  # both ranks run rank 1's 5 forwards
            assert "generate_batch at world size > 1 needs the whole model" in refusal
            why = "does not fit" if enabled else "ds3_gather_for_generation=False"
            assert why in refusal


def grpo_gathers(tmp_path, monkeypatch, **flag) -> dict[int, int]:
    """One GRPO step at stage 3 (8 completions of 8 tokens): the gathers of each unit."""
    from trl import GRPOConfig

    from zerotune.hf import zero

    options = {**GRPO_ARGS, "max_steps": 1, "zero_stage": 3, **flag}
    args = zero(GRPOConfig)(output_dir=str(tmp_path / str(flag)), **options)
    gathers = CountGathers(monkeypatch)
    trainer, logs = grpo_run(zero, args)
    gathered = isinstance(trainer.model.__dict__.get("generate"), GatheredGenerate)
    assert gathered == flag.get("ds3_gather_for_generation", True)
    assert trainer.model.__dict__["generate_batch"].gather == gathered  # refused at world > 1
    assert logs["completions/mean_length"][0] == GRPO_ARGS["max_completion_length"]
    trainer.close()
    return dict(gathers.counts)  # a copy: the counter goes on counting


def test_grpo_gathers_the_model_once_per_generation_unless_its_flag_says_not(tmp_path, monkeypatch):
    """TRL's ds3_gather_for_generation (default True): the completions cost one gather per
    unit, against one per unit and token with the flag off; the step's own forward and
    backward gathers are the same in both."""
    once = grpo_gathers(tmp_path, monkeypatch)
    per_token = grpo_gathers(tmp_path, monkeypatch, ds3_gather_for_generation=False)
    assert once.keys() == per_token.keys()
    tokens = GRPO_ARGS["max_completion_length"]
    for unit in once:
        assert per_token[unit] - once[unit] >= tokens - 1, (unit, once, per_token)
