"""Parameters that get no gradient in a step: left alone as torch's AdamW leaves them (no
update, no weight decay, no step counted), at every stage, offload and world size, and
resumed from a checkpoint with their own step counts; ranks that each lack a different
parameter update the union, as one process on the whole batch would."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import STEPS as GPT2_STEPS
from torch import nn

LR, WD, STEPS = 1e-2, 0.1, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x, branches):
        """``branches``: the optional layers to go through; with "discard" the block's
        output is computed and dropped (the block passes its input on)."""
        y = torch.tanh(self.a(x))
        for name in branches:
            if name != "discard":
                y = y + getattr(self, name)(y)
        return x if "discard" in branches else y


class BranchNet(nn.Module):
    """Two blocks and a head; ``branches`` names the optional layers a batch goes through."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x, branches=(), reentrant_last=False):
        for i, block in enumerate(self.blocks):
            b = branches[i] if isinstance(branches, list) else branches
            if reentrant_last and i == len(self.blocks) - 1:
                x = torch.utils.checkpoint.checkpoint(block, x, b, use_reentrant=True)
            else:
                x = block(x, b)
        return self.head(x).pow(2).mean()


def branches_of(step: int, rank: int, plan: str) -> tuple[str, ...]:
    """Which optional layers rank ``rank``'s batch uses at ``step``.

    same: b on every third step, the same on every rank; split: rank 0 uses b, rank 1
    uses c (every rank lacks one, so each reduces the blocks at the end of backward);
    swap (a list: per block): rank 0 gives block 0 all its gradients and block 1 not,
    rank 1 the other way round; all: every layer, on every rank."""
    if plan == "all":
        return ("b", "c")
    if plan == "same":
        return ("b",) if step % 3 == 0 else ()
    if plan == "split":
        return ("b",) if rank == 0 else ("c",)
    full, part = ("b", "c"), ("b",)
    return [full, part] if rank == 0 else [part, full]


def data(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))


def reference(plan: str, world: int) -> dict:
    """Single-process AdamW on the whole batch: each rank's part through its branches."""
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x = data(step)
        loss = sum(model(x[r::world], branches_of(step, r, plan)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    steps = {
        n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "weights": {n: p.detach().clone().numpy() for n, p in model.named_parameters()},
        "steps": steps,
    }


def train(rank, world, plan, config, overlapped=False, resume_at=None, tmp=None, micro=1):
    """``micro`` > 1: each step accumulates that many micro-batches (the first ones under
    ``no_sync()``), each through the step's branches. Also returns the units each step
    reduced at the end of backward because of ``find_unused_parameters`` (``deferred``)."""
    import torch.distributed as dist

    import zerotune
    from zerotune.checkpoint import load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        engine = zerotune.shard(BranchNet(), config)
        return engine, zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)

    engine, opt = build()
    losses = []
    deferred, stop_recording = record_deferred()
    try:
        for step in range(STEPS):
            if step == resume_at:
                save_checkpoint(engine, tmp, optimizer=opt)
                engine.close()
                engine, opt = build()
                load_checkpoint(engine, tmp, optimizer=opt)
            x = data(step)[rank::world]
            earlier = 0.0
            for m in range(micro - 1):
                with engine.no_sync():
                    part = engine(x[m::micro], branches_of(step, rank, plan)) / micro
                    part.backward()
                    earlier += float(part.detach())
            x = x[micro - 1 :: micro]
            loss = engine(x, branches_of(step, rank, plan)) / micro
            try:
                if overlapped:
                    with opt.overlapped():
                        loss.backward()
                else:
                    loss.backward()
            except RuntimeError as exc:
                return {"error": str(exc)}
            opt.step()
            total = (loss.detach().reshape(1) + earlier) / world
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total))
        weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()
        stop_recording()
    # The step count of each parameter this rank's shards hold a part of.
    steps = {
        seg.slot.name: int(opt.state[seg.key]["step"])
        for segs in opt.unit_segments.values()
        for seg in segs
    }
    return {"losses": losses, "weights": weights, "steps": steps, "deferred": deferred}


def check(res: dict, ref: dict, label: str) -> None:
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=1e-5, atol=1e-6, err_msg=label)
    for name, w in ref["weights"].items():
        np.testing.assert_allclose(res["weights"][name], w, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_without_a_gradient_are_left_alone(world, tmp_path):
    ref = reference("same", world)
    # The optional layer got gradients on 2 of the 6 steps, the others on all.
    assert ref["steps"]["blocks.0.b.weight"] == 2 and ref["steps"]["blocks.0.a.weight"] == 6
    nv = tmp_path / "nv"
    nv.mkdir()
    nvme = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(nv)}
    cases = [
        ({"stage": 1}, False),
        ({"stage": 2}, False),
        ({"stage": 3}, False),
        (nvme, False),
        (nvme, True),
        ({"stage": 2, "offload_optimizer": "nvme", "nvme_path": str(nv)}, True),
    ]
    for config, overlapped in cases:
        label = f"world={world} {config} overlapped={overlapped}"
        results = run_world(world, train, "same", config, overlapped)
        for res in results:
            check(res, ref, label)
        # Each rank counts the steps of the parameters its shard holds as AdamW does.
        for res in results:
            assert res["steps"], label
            for name, count in res["steps"].items():
                assert count == ref["steps"][name], (label, name, count)


def test_a_resumed_run_keeps_each_parameters_own_step_count(tmp_path):
    ref = reference("same", 1)
    res = train(0, 1, "same", {"stage": 3}, resume_at=4, tmp=tmp_path / "ckpt")
    check(res, ref, "resumed at step 4")
    assert res["steps"] == ref["steps"]


def test_ranks_missing_different_parameters_update_the_union():
    # Each rank lacks one optional layer, so no rank reduces the blocks before the end of
    # backward; there every rank learns that b and c both got gradients somewhere.
    ref = reference("split", 2)
    assert ref["steps"]["blocks.1.b.weight"] == ref["steps"]["blocks.1.c.weight"] == STEPS
    for config in ({"stage": 1}, {"stage": 2}, {"stage": 3}):
        for res in run_world(2, train, "split", config):
            check(res, ref, f"split {config}")


def test_ranks_that_reduced_different_units_are_stopped_at_the_end_of_backward():
    # Rank 0 reduces block 0 during backward and leaves block 1 to the end, rank 1 the
    # other way round: their reduce-scatters pair block 0 with block 1 (the same size, so
    # nothing fails there). The end of backward compares what each rank reduced and
    # stops the step on every rank instead of letting the mixed gradients through.
    for res in run_world(2, train, "swap", {"stage": 2}, timeout=60):
        assert "error" in res
        assert "ranks reduced the gradients of different units" in res["error"]
    # The same engines train on after it, like AdamW from where they were.
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(1, 4):
        x = data(step)
        (0.5 * sum(model(x[r::2], branches_of(step, r, "same")) for r in range(2))).backward()
        opt.step()
        opt.zero_grad()
    for res in run_world(2, _go_on_after_the_error, timeout=60):
        for name, p in model.named_parameters():
            np.testing.assert_allclose(res[name], p.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_find_unused_parameters_lets_each_rank_complete_different_units(stage, tmp_path):
    # The plan that is stopped above (and at stage 3 would pair a reduce-scatter with an
    # all-gather): with find_unused_parameters the ranks agree after forward that neither
    # block is complete on every rank, and both reduce them at the end of backward.
    ref = reference("swap", 2)
    nv = tmp_path / "nv"
    nv.mkdir()
    on = {"stage": stage, "find_unused_parameters": True}
    cases = [(on, False, 1), (on, False, 2)]
    if stage == 3:
        nvme = {"offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(nv)}
        cases.append(({**on, **nvme}, True, 1))
    for config, overlapped, micro in cases:
        label = f"{config} overlapped={overlapped} micro={micro}"
        results = run_world(2, train, "swap", config, overlapped, None, None, micro, timeout=120)
        for res in results:
            check(res, ref, label)
            for name, count in res["steps"].items():
                assert count == ref["steps"][name], (label, name, count)
            # Only the two blocks wait for the end of backward; the head does not.
            assert res["deferred"] == [["blocks.0", "blocks.1"]] * STEPS, label


def test_find_unused_parameters_defers_nothing_when_every_rank_is_complete():
    # Every layer runs on every rank: every unit is reduced during backward, as without the
    # option. With the same branches on every rank (c never, b on some steps) the blocks
    # are incomplete on every rank and wait for the end of backward, as they would anyway.
    config = {"stage": 3, "find_unused_parameters": True}
    for plan, blocks in (("all", []), ("same", ["blocks.0", "blocks.1"])):
        ref = reference(plan, 2)
        for res in run_world(2, train, plan, config, timeout=120):
            check(res, ref, plan)
            assert res["deferred"] == [blocks] * STEPS, plan


# Each case: per step, a list of (rank -> (branches, reentrant_last)) forwards, and the
# order their losses are taken backward; "no_sync" runs the first ones under no_sync().
def _case_forwards(case: str, step: int, rank: int):
    swap = branches_of(step, rank, "swap")
    full = ("b", "c")
    if case == "two graphs":  # taken backward in the other order than they were made
        return [(swap, False), (full, False)], [1, 0], 0
    if case == "uneven no_sync":  # rank 0 accumulates two micro-batches first, rank 1 one
        n = 2 if rank == 0 else 1
        return [(full, False)] * n + [(swap, False)], list(range(n + 1)), n
    if case == "reentrant":  # block 1 checkpointed; block 0 (outside) runs on both ranks,
        first = full if rank == 0 else ("discard",)  # its output dropped on rank 1
        return [([first, full], True)], [0], 0
    if case == "extra forward":  # a forward whose graph is dropped, then the step's
        return [(swap, False), (full, False)], [1], 0
    raise ValueError(case)


def _input(x: torch.Tensor, k: int, reentrant: bool) -> torch.Tensor:
    """The k-th forward's input; one that needs a gradient ahead of a reentrant checkpoint
    (whose output needs one only if an input does: rank 1's block 0 passes its input on)."""
    return (x * (k + 1)).requires_grad_(reentrant)


def _special(rank, world, case):
    import torch.distributed as dist

    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(BranchNet(), {"stage": 2, "find_unused_parameters": True})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    deferred, stop_recording = record_deferred()
    try:
        for step in range(STEPS):
            x = data(step)[rank::world]
            forwards, order, unsynced = _case_forwards(case, step, rank)
            losses = []
            for k, (branches, reentrant) in enumerate(forwards):
                if k < unsynced:
                    with engine.no_sync():
                        engine(x * (k + 1), branches, reentrant).backward()
                    continue
                losses.append(engine(_input(x, k, reentrant), branches, reentrant))
            taken = [losses[i - unsynced] for i in order if i >= unsynced]
            for loss in taken:
                loss.backward(retain_graph=True)
            opt.step()
        dist.barrier()
        weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()
        stop_recording()
    return {"weights": weights, "deferred": deferred}


@pytest.mark.parametrize("case", ["two graphs", "uneven no_sync", "reentrant", "extra forward"])
def test_find_unused_parameters_follows_each_forwards_graph(case):
    # two graphs: each backward defers what its own forward found (the swapped blocks
    # for one, nothing for the other); uneven no_sync: forwards under no_sync are not
    # collectives, so ranks may run different numbers of them; reentrant: the block
    # outside the checkpoint, run but unused on one rank, is still found incomplete (only
    # the checkpointed one is taken on trust); extra forward: a graph never taken
    # backward (which would defer both blocks) defers nothing.
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x = data(step)
        total = 0
        for r in range(2):
            forwards, order, _ = _case_forwards(case, step, r)
            for k, (branches, reentrant) in enumerate(forwards):
                if k in order or k < _case_forwards(case, step, r)[2]:
                    total = total + model(_input(x[r::2], k, reentrant), branches, reentrant)
        (total / 2).backward()
        opt.step()
        opt.zero_grad()
    expect = {
        "two graphs": [[], ["blocks.0", "blocks.1"]],
        "uneven no_sync": [["blocks.0", "blocks.1"]],
        "reentrant": [["blocks.0"]],
        "extra forward": [[]],
    }[case]
    for res in run_world(2, _special, case, timeout=120):
        assert res["deferred"] == expect * STEPS
        for name, p in model.named_parameters():
            np.testing.assert_allclose(
                res["weights"][name], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name
            )


def _go_on_after_the_error(rank, world):
    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(BranchNet(), {"stage": 2})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    loss = engine(data(0)[rank::world], branches_of(0, rank, "swap"))
    with pytest.raises(RuntimeError, match="ranks reduced the gradients of different units"):
        loss.backward()
    opt.zero_grad()
    for step in range(1, 4):
        engine(data(step)[rank::world], branches_of(step, rank, "same")).backward()
        opt.step()
    weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    engine.close()
    return weights


class WideNet(nn.Module):
    """One unit of two 64 x 64 layers (over the 8-bit threshold), a frozen one between."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_b=False):
        x = torch.tanh(self.frozen(torch.tanh(self.a(x))))
        return (self.b(x) if use_b else x).pow(2).mean()


def test_8bit_moments_of_a_parameter_without_a_gradient_keep_their_bytes():
    """b gets a gradient at step 0 only: afterwards its master, step count and the codes of
    the 8-bit blocks lying inside it stay as they are (re-quantizing them each step would
    move them: a round trip through the codes is not exact)."""
    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(WideNet(), {"stage": 3, "optim_state_bits": 8, "unit_modules": []})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    (unit,) = [u for u in engine.units if u.trainable]
    slot = {s.name: s for s in unit.slots}["b.weight"]
    first, last = slot.offset // 256 + 1, (slot.offset + slot.numel) // 256  # whole blocks
    assert last - first >= 10

    def b_state():
        state = opt.store.read_unit(unit)
        lo, hi = slot.offset, slot.offset + slot.numel
        return (
            state["master"][lo:hi].clone(),
            *(
                state[f"{k}.q8"][first * 256 : last * 256].clone()
                for k in ("exp_avg", "exp_avg_sq")
            ),
            *(state[f"{k}.absmax"][first:last].clone() for k in ("exp_avg", "exp_avg_sq")),
        )

    for step in range(12):
        engine(data(step).repeat(1, 8), use_b=step == 0).backward()
        opt.step()
        if step == 0:
            after_first = b_state()
            assert after_first[1].any()  # it has moments to keep
    for before, now in zip(after_first, b_state()):
        assert torch.equal(before, now)
    steps = {seg.slot.name: opt.state[seg.key]["step"] for seg in opt.unit_segments[unit.index]}
    assert steps == {"a.weight": 12, "a.bias": 12, "b.weight": 1, "b.bias": 1}
    engine.close()


@pytest.mark.parametrize("bits", [32, 8])
def test_the_fused_low_precision_copy_keeps_what_the_update_skipped(bits, monkeypatch):
    """With the optimizer on the host and bf16 parameters on an accelerator the update
    writes the new bf16 shard into a staging buffer (``lowp_target``) that is copied over
    the shard whole. Simulated here on the CPU with a buffer full of 123.0: after each step
    the shard equals the master rounded to bf16 everywhere, frozen layer and parameter
    without a gradient included (they used to get the buffer's old contents)."""
    import zerotune

    torch.manual_seed(0)
    config = {"stage": 3, "dtype": "bf16", "optim_state_bits": bits, "unit_modules": []}
    engine = zerotune.shard(WideNet(), config)
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    (unit,) = [u for u in engine.units if u.trainable]

    def garbage_target(u):
        buf = torch.full((u.shard_numel,), 123.0, dtype=u.dtype)
        engine._lowp_buffers[u.index] = buf
        return buf

    monkeypatch.setattr(engine, "lowp_target", garbage_target)
    staged = []
    real_done = engine.lowp_done
    monkeypatch.setattr(
        engine, "lowp_done", lambda u, t: (staged.append(u.index), real_done(u, t))[1]
    )
    frozen = unit.shard[slice(*_range(unit, "frozen.weight"))].clone()
    for step in range(3):
        engine(data(step).repeat(1, 8).bfloat16(), use_b=step == 0).backward()
        opt.step()
        assert unit.index in staged  # the staged, fused path ran
        torch.testing.assert_close(
            unit.shard[: unit.numel], unit.master[: unit.numel].to(torch.bfloat16), rtol=0, atol=0
        )
        assert torch.equal(unit.shard[slice(*_range(unit, "frozen.weight"))], frozen)
    engine.close()


def _range(unit, name):
    slot = {s.name: s for s in unit.slots}[name]
    return slot.offset, slot.offset + slot.numel


def test_requires_grad_changed_after_sharding_is_refused():
    import zerotune

    for change in ("unfreeze", "freeze"):
        torch.manual_seed(0)
        model = WideNet()
        engine = zerotune.shard(model, {"stage": 3, "unit_modules": []})
        name = "frozen.weight" if change == "unfreeze" else "a.bias"
        # (named_parameters: a module attribute read of a sharded weight raises)
        dict(model.named_parameters())[name].requires_grad_(change == "unfreeze")
        with pytest.raises(ValueError, match=f"requires_grad of {name} changed after"):
            zerotune.ZeroAdamW(engine, lr=LR)
        engine.close()


def test_a_backward_that_raised_midway_leaves_no_state_behind():
    """A hook raising in the middle of backward (the final callback never runs): the next
    forward starts from clean counts, and training goes on like AdamW from where it is."""
    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(BranchNet(), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    loss = engine(data(0), ("b",))
    loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    opt.zero_grad()
    torch.manual_seed(0)
    model = BranchNet()
    ref = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(1, 4):
        for m, o in ((engine, opt), (model, ref)):
            m(data(step), ("b",)).backward()
            o.step()
            o.zero_grad()
        states = [u.state.value for u in engine.units if not u.persistent]
        assert set(states) == {"sharded"}, states
    got = engine.full_state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def _mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.0,
    )  # fmt: skip


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(step))


def _train_mixtral(rank, world):
    from transformers import MixtralForCausalLM

    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(MixtralForCausalLM(_mixtral_config()), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    for step in range(5):
        ids = _tokens(step)[rank::world]
        engine(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    engine.close()
    return weights


@pytest.mark.parametrize("world", [1, 2])
def test_a_mixture_of_experts_trains_like_adamw(world):
    """A tiny Mixtral (4 experts, 2 per token, 4 tokens a rank: experts go unused). In
    transformers 5 the experts are one 3-D parameter each for all experts, so every
    parameter gets a gradient (zeros for an unused expert), as in plain PyTorch."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(_mixtral_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(5):
        ids = _tokens(step)
        loss = sum(model(input_ids=ids[r::world], labels=ids[r::world]).loss for r in range(world))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    got = run_world(world, _train_mixtral)[0]
    for name, p in model.named_parameters():
        np.testing.assert_allclose(
            got[name], p.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize("model_name", ["gpt2", "gpt2_ckpt", "gpt2_ckpt_reentrant"])
def test_find_unused_parameters_keeps_a_model_that_uses_everything_as_it_was(model_name):
    # The graph walk after forward finds every parameter of a tiny GPT-2 (tied head
    # included), also through activation checkpoints: a reentrant one hides its blocks'
    # parameters until backward, and the blocks that ran count as complete. So no unit
    # waits for the end of backward, and training equals plain AdamW.
    from test_engine_equivalence import check as check_like_adamw
    from test_engine_equivalence import reference as adamw_reference

    for res in run_world(2, _record_deferred, model_name, timeout=120):
        assert res.pop("deferred") == [[]] * GPT2_STEPS
        check_like_adamw(res, adamw_reference(model_name), model_name)


def _record_deferred(rank, world, model_name):
    from harness import train_zero

    seen, stop_recording = record_deferred()
    try:
        config = {"stage": 3, "find_unused_parameters": True}
        out = train_zero(rank, world, model_name, config, steps=GPT2_STEPS)
    finally:
        stop_recording()
    return {"deferred": seen, **{k: out[k] for k in ("losses", "norms", "weights")}}


def record_deferred():
    """``(seen, stop)``: from now until ``stop()``, each synchronized backward's end appends
    the names of the units it reduced there because of ``find_unused_parameters``."""
    from zerotune.sharding.engine import ZeroEngine

    seen = []
    original = ZeroEngine.post_backward_final

    def recording(self):
        if self.reducer.syncing:
            seen.append(sorted(self.units[i].name for i in self.reducer._deferred))
        original(self)

    ZeroEngine.post_backward_final = recording

    def stop():
        ZeroEngine.post_backward_final = original

    return seen, stop


class Routed(nn.Module):
    """Two experts of one size, each its own unit; a batch goes through one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x, expert: int):
        return self.head(torch.tanh(self.experts[expert](x))).pow(2).mean()


def _route_by_rank(rank, world, find_unused):
    import zerotune

    torch.manual_seed(0)
    config = {"stage": 3, "unit_modules": ["Linear"], "find_unused_parameters": find_unused}
    engine = zerotune.shard(Routed(), config)
    try:
        # Each rank gathers one expert, then the head: the same sizes in the same order, so
        # the all-gathers pair rank 0's expert 0 with rank 1's expert 1 without a failure.
        loss = engine(data(0)[rank::world], rank)
        return {"loss": float(loss)}
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()


def test_ranks_that_ran_different_units_at_stage_3_are_stopped_after_forward():
    # Without the option the mixed parameters go unnoticed (the losses are computed from
    # gathers that paired different experts); with it the forward's fingerprint of its
    # gathers differs between the ranks and both raise.
    assert all("loss" in r for r in run_world(2, _route_by_rank, False, timeout=60))
    for res in run_world(2, _route_by_rank, True, timeout=60):
        assert "gathered different units in this forward" in res.get("error", ""), res


class TwoHeads(nn.Module):
    """A trunk and two heads, each its own unit (``unit_modules: ["Linear"]``); the model
    returns both heads' outputs and the loss chooses what to use."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def _heads_loss(a: torch.Tensor, b: torch.Tensor, rank: int, plan: str) -> torch.Tensor:
    """ignore_b: rank 1's loss ignores head b (computed in forward on every rank);
    aux_on_0: head b is an auxiliary term rank 0 alone multiplies in."""
    if plan in ("ignore_b", "ignore_b_eval"):
        return a.pow(2).mean() + (b.pow(2).mean() if rank == 0 else 0)
    return a.pow(2).mean() * (1 + b.mean() if rank == 0 else 1)


def _heads_reference(plan: str, world: int, micro: int) -> dict:
    """Single-process AdamW on the whole batch, each rank's loss (over ``micro``
    micro-batches) averaged, as DDP averages the gradients: a rank that ignores a head
    gives it zero."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(3):
        x = data(step)
        parts = [(r, x[r::world][m::micro]) for r in range(world) for m in range(micro)]
        loss = sum(_heads_loss(*model(part), r, plan) for r, part in parts) / (world * micro)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "weights": {n: p.detach().clone().numpy() for n, p in model.named_parameters()},
    }


def _heads_train(rank, world, plan, config, micro):
    import torch.distributed as dist

    import zerotune

    torch.manual_seed(0)
    engine = zerotune.shard(TwoHeads(), {**config, "unit_modules": ["Linear"]})
    opt = zerotune.ZeroAdamW(engine, lr=LR, weight_decay=WD)
    losses = []
    deferred, stop_recording = record_deferred()
    try:
        for step in range(3):
            x, earlier = data(step)[rank::world], 0.0
            for m in range(micro - 1):  # at stage 3 these gather too: the ranks agree
                with engine.no_sync():
                    part = _heads_loss(*engine(x[m::micro]), rank, plan) / micro
                    part.backward()
                    earlier += float(part.detach())
            loss = _heads_loss(*engine(x[micro - 1 :: micro]), rank, plan) / micro
            if plan.endswith("_eval"):  # a forward without gradients before the backward
                with torch.no_grad():
                    engine(x)
            loss.backward()
            opt.step()
            total = (loss.detach().reshape(1) + earlier) / world
            dist.all_reduce(total)
            losses.append(float(total))
        weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()
        stop_recording()
    return {"losses": losses, "weights": weights, "deferred": deferred}


@pytest.mark.parametrize("plan", ["ignore_b", "aux_on_0", "ignore_b_eval"])
def test_an_output_the_loss_ignores_on_one_rank_trains_like_ddp(plan, tmp_path):
    # Head b runs in forward on both ranks, but one rank's loss does not reach it: that
    # rank's backward never gathers it (stage 3) nor completes its gradients. The ranks
    # agree as backward starts; head b is gathered on both there, and reduced at the end
    # of backward with zeros from the rank that got none, so the step equals DDP's.
    nv = tmp_path / "nv"
    nv.mkdir()
    on = {"find_unused_parameters": True}
    nvme = {"offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(nv)}
    cases = [({**on, "stage": 2}, 1), ({**on, "stage": 3}, 1), ({**on, "stage": 3}, 2)]
    cases.append(({**on, "stage": 3, **nvme}, 1))
    for config, micro in cases:
        ref = _heads_reference(plan, 2, micro)
        for res in run_world(2, _heads_train, plan, config, micro, timeout=120):
            check(res, ref, f"{plan} {config} micro={micro}")
            assert res["deferred"] == [["head_b"]] * 3, (plan, config, res["deferred"])
