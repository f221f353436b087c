"""Hooks survive what real models do: modules called twice, activation checkpointing,
no_grad evaluation, frozen units, another path through the model; buffers are reused."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_world
from harness import train_reference, train_zero
from test_engine_equivalence import check, reference

CASES = {
    # name: (model, stage, accumulation, no_sync)
    "twice": ("odd_twice", 3, 2, True),
    "ckpt_reentrant": ("gpt2_ckpt_reentrant", 3, 2, False),
    "ckpt": ("gpt2_ckpt", 3, 1, False),
    "frozen": ("gpt2_frozen", 3, 2, False),
    "switch": ("odd_switch", 3, 1, False),
    "small_prefetch": ("gpt2", 3, 1, False),
    "tied_twice": ("odd_tied_twice", 3, 2, False),
}


def run_cases(rank, world):
    out = {}
    for name, (model, stage, accum, no_sync) in CASES.items():
        config = {"stage": stage}
        if name == "small_prefetch":
            # Budget for one block ahead, and a live bound that forces evictions.
            config.update(prefetch_bytes=30_000, max_live_bytes=60_000)
        out[name] = train_zero(rank, world, model, config, accum=accum, use_no_sync=no_sync)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run_cases)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_plain_adamw(results, name):
    model = CASES[name][0]
    ref = reference(model) if model in ("gpt2",) else _ref(model)
    check(results[name], ref, name)
    # Evaluation under torch.no_grad() gives the plain model's loss, and leaves every
    # unit released.
    np.testing.assert_allclose(results[name]["eval_loss"], ref["eval_loss"], rtol=1e-5)
    assert set(results[name]["states_after"]) == {"sharded"}, results[name]["states_after"]


_refs: dict = {}


def _ref(model):
    if model not in _refs:
        ref = train_reference(model)
        ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
        ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
        _refs[model] = ref
    return _refs[model]


def test_frozen_parameters_do_not_move(results):
    from harness import build

    start = {n: p.detach().numpy() for n, p in build("gpt2_frozen").named_parameters()}
    trained = results["frozen"]["weights"]
    for name in ("transformer.wpe.weight", "transformer.h.0.mlp.c_fc.weight"):
        np.testing.assert_array_equal(trained[name], start[name])
    assert (
        np.abs(
            trained["transformer.h.1.mlp.c_fc.weight"] - start["transformer.h.1.mlp.c_fc.weight"]
        ).max()
        > 1e-4
    )


def test_another_path_rerecords_the_prefetch_order(results):
    # odd_switch reverses its blocks every other step: the recorded order is left and
    # re-recorded instead of deadlocking or gathering the wrong unit.
    assert results["switch"]["rerecords"] >= 2
    assert results["twice"]["rerecords"] == 0


def run_pool_steps(rank, world):
    from harness import batches, build, loss_of

    import zerotune

    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    allocations = []
    for ids in batches("gpt2", 6):
        mine = ids[rank::world]
        loss_of(engine, mine).backward()
        opt.step()
        allocations.append(
            (
                engine.pool.allocations,
                engine.pool.allocated_bytes,
                engine.pool.gathered.now,
                engine.pool.gathered.peak,
            )
        )
    largest_unit = max(u.gathered_bytes for u in engine.units)
    return allocations, largest_unit


def test_buffers_are_reused_and_gathered_memory_is_freed():
    allocations, largest = run_world(2, run_pool_steps)[0]
    # Everything the reduce pool will ever hold is allocated during the first step, and
    # gathered parameters are all freed after each step, with the same peak every step.
    assert allocations[0][0] > 0
    assert all(a[:2] == allocations[0][:2] for a in allocations[1:]), allocations
    # Prefetching starts once the first step recorded the order; from then on the peak of
    # gathered bytes is the same every step.
    assert all(a == allocations[1] for a in allocations[2:]), allocations
    assert allocations[0][2] == 0
    assert largest <= allocations[0][3]


def test_tied_head_and_embeddings_hold_no_weights_through_backward():
    """The tied head lets go of the embedding's weight once its own backward is done, and
    the embeddings are not gathered for theirs (it reads no weight): through the blocks'
    backward and at its end, neither embedding is gathered."""
    import torch
    from harness import batches, build, loss_of

    import zerotune
    from zerotune.sharding.unit import UnitState

    engine = zerotune.shard(build("gpt2"), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    seen = []
    post_backward = engine.post_backward

    def record(unit):
        gathered = {u.name for u in engine.units if u.state is not UnitState.SHARDED}
        seen.append((unit.name, gathered))
        post_backward(unit)

    engine.post_backward = record
    gathers = []  # units gathered from their shards (a prefetch or on demand)

    def counting(unit, gather):
        def wrapped(**kw):
            if unit.state is UnitState.SHARDED:
                gathers.append(unit.name)
            gather(**kw)

        return wrapped

    for unit in engine.units:
        unit.gather = counting(unit, unit.gather)
    for ids in batches("gpt2", 2):
        seen.clear()
        gathers.clear()
        loss_of(engine, ids).backward()
        opt.step()
        opt.zero_grad()
    names = [name for name, _ in seen]
    assert names[-2:] == ["transformer.wpe", "transformer.wte"] or names[-2:] == [
        "transformer.wte",
        "transformer.wpe",
    ], names
    blocks = [(n, g) for n, g in seen if n.startswith("transformer.h.")]
    assert len(blocks) == 2
    for name, gathered in seen:
        assert "transformer.wte" not in gathered and "transformer.wpe" not in gathered, (
            name,
            gathered,
        )
    # In the second step's forward and backward: wte for the embedding and for the head in
    # forward, once more for the head's backward; wpe once; never for an embedding's backward.
    assert gathers.count("transformer.wte") == 3, gathers
    assert gathers.count("transformer.wpe") == 1, gathers
    params = dict(engine.module.named_parameters())
    # Released as usual after backward: no placeholder is left behind.
    assert params["transformer.wte.weight"].shape == (0,)
    assert params["transformer.wpe.weight"].shape == (0,)
    assert torch.isfinite(loss_of(engine, batches("gpt2", 1)[0])).item()


def test_a_parameterless_unit_fed_a_leaf_puts_no_hook_on_it():
    """A hook on a leaf tensor outlives the backward pass: a head without parameters of its
    own fed a leaf (prompt-tuning style) keeps its weight to the end of backward instead of
    hooking the leaf again every step; its gradients are plain PyTorch's."""
    import torch

    import zerotune

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(x).square().mean()

    torch.manual_seed(0)
    plain = Tied()
    torch.manual_seed(0)
    engine = zerotune.shard(Tied(), {"stage": 3, "unit_modules": ["Embedding", "Linear"]})
    head = next(u for u in engine.units if u.name == "head")
    assert head.n_trainable == 0 and [d.name for d in head.deps] == ["emb"]
    x = torch.randn(3, 6, requires_grad=True)
    for _ in range(3):
        x.grad = None
        engine(x).backward()
        assert not x._backward_hooks, x._backward_hooks
    expected = torch.autograd.grad(plain(x), x)[0]
    x.grad = None
    engine(x).backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_unit_with_a_frozen_norm_keeps_it_until_its_inputs_have_gradients(offload, tmp_path):
    """A block whose LayerNorm is frozen and whose linears train: the linears' gradients are
    complete before the norm's backward runs (it reads the norm's weight), so the block
    stays gathered until its input's gradient exists. Gradients equal plain PyTorch's."""
    import torch
    from torch import nn

    import zerotune

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.base = nn.Linear(8, 8)
            self.extra = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            h = self.ln(x)
            return x + self.base(h) + self.extra(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return x.square().mean()

    def make():
        torch.manual_seed(0)
        net = Net()
        with torch.no_grad():
            for b in net.blocks:
                b.ln.weight.uniform_(0.5, 1.5)
                b.ln.requires_grad_(False)
        return net

    x = torch.randn(4, 8)
    plain = make()
    plain(x).backward()
    config = {"stage": 3, "unit_modules": ["Block"]}
    if offload == "nvme":
        config.update(offload_param="nvme", nvme_path=str(tmp_path))
    engine = zerotune.shard(make(), config)
    assert all(u.waits_for_inputs for u in engine.units if u.name.startswith("blocks."))
    for _ in range(2):
        engine.zero_grad()
        engine(x).backward()
        expected = dict(plain.named_parameters())
        for unit in engine.units:
            for s in unit.slots:
                if s.trainable:
                    got = unit.grad_shard[s.offset : s.offset + s.numel]
                    torch.testing.assert_close(
                        got, expected[s.name].grad.reshape(-1), rtol=0, atol=0
                    )
    engine.close()
