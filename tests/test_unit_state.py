"""The training states a unit passes through (see [Note: unit life cycle] in
sharding/unit.py): forward, backward with accumulation, activation checkpointing, the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerotune
from zerotune.sharding.unit import TrainingState, Unit, UnitState

VERBS = ("begin_forward", "end_forward", "begin_backward", "end_backward", "end_pass")


class Net(nn.Module):
    """An embedding, two blocks and a head: each a unit of its own (their parent holds
    nothing, the root unit)."""

    def __init__(self, ckpt: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.b0 = nn.Linear(8, 8)
        self.b1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11)
        self.ckpt = ckpt

    def forward(self, ids):
        h = self.emb(ids)
        if self.ckpt:
            h = checkpoint(self.b0, h, use_reentrant=False)
        else:
            h = self.b0(h)
        h = self.b1(torch.tanh(h))
        return self.head(torch.tanh(h))


@pytest.fixture
def transitions(monkeypatch):
    """Every change of a unit's training state, in order: ``(unit name, state)``."""
    seen: list[tuple[str, str]] = []

    def wrap(verb):
        original = getattr(Unit, verb)

        def recorded(unit, *args):
            before = unit.training_state
            result = original(unit, *args)
            if unit.training_state is not before:
                seen.append((unit.name, unit.training_state.value))
            return result

        return recorded

    for verb in VERBS:
        monkeypatch.setattr(Unit, verb, wrap(verb))
    return seen


def _per_unit(seen, names):
    return {n: [s for u, s in seen if u == n] for n in names}


def _train_step(engine, opt, micro_batches: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        ids = torch.randint(0, 11, (2, 5), generator=g)
        logits = engine(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1))
        engine.backward(loss / micro_batches)


PASS = ["forward", "idle", "backward", "post_backward", "idle"]


@pytest.mark.parametrize("ckpt", [False, True])
def test_states_of_a_step_with_accumulation(transitions, ckpt):
    model = Net(ckpt=ckpt)
    engine = zerotune.shard(model, {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, model.parameters(), lr=1e-2)
    names = [u.name for u in engine.units]
    assert names[1:] == ["emb", "b0", "b1", "head"]
    _train_step(engine, opt, micro_batches=2)
    per_unit = _per_unit(transitions, names)
    # Blocks and head: gathered again for their backward (BACKWARD), let go once their
    # gradients are reduced (POST_BACKWARD), IDLE when the pass ends; per micro-batch.
    for name in ("b0", "b1", "head"):
        assert per_unit[name] == PASS * 2, (name, per_unit[name])
    # The embedding is not gathered for its backward: it never holds backward pins.
    assert per_unit["emb"] == ["forward", "idle", "post_backward", "idle"] * 2
    # The root unit owns no trainable parameter and waits for its input's gradient, which
    # never comes (token ids): it holds its pins to the end of the pass.
    assert per_unit[names[0]] == ["forward", "idle", "backward", "idle"] * 2
    # Backward runs from the head down; each unit is done before the one below it starts.
    ends = [u for u, s in transitions[: len(transitions) // 2] if s == "post_backward"]
    assert ends == ["head", "b1", "b0", "emb"]

    before = len(transitions)
    opt.step()
    opt.zero_grad()
    assert len(transitions) == before  # the step moves no unit's training state
    for unit in engine.units:
        assert unit.training_state is TrainingState.IDLE
        assert unit.state is UnitState.SHARDED or unit.persistent
        assert unit.pins == 0
        assert unit.pass_state.grads_ready == 0 and unit.pass_state.input_waits == 0
        assert not unit.pass_state.grads_final and not unit.pass_state.inputs_final
    engine.close()


def test_failed_backward_starts_the_next_pass_clean(transitions):
    model = Net()
    engine = zerotune.shard(model, {"stage": 3})
    ids = torch.randint(0, 11, (2, 5))

    def fail(grad):
        raise RuntimeError("boom")

    logits = engine(ids)
    logits.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        engine.backward(logits.sum())
    # The pass began (the head's pre-backward ran before the error) and never ended.
    assert engine.units[-1].training_state is TrainingState.BACKWARD
    engine(ids)  # the next forward ends the failed pass first
    for unit in engine.units:
        assert unit.training_state is TrainingState.IDLE
        assert unit.pins == 0
    engine.close()
