"""A forward or backward that raises part way (an out-of-memory error, an interrupt) leaves
the engine and its optimizer ready to go on: after ``zero_grad`` the step is taken again
and training continues exactly as plain AdamW that never saw the failed pass ([Note: a
backward that raises inside overlapped()] in optim/zero_adam.py)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
from conftest import run_world
from harness import (
    GLOBAL_BATCH,
    MAX_NORM,
    assert_weights_match,
    batches,
    build,
    loss_of,
    make_optimizer,
    no_decay_groups,
    train_reference,
)

import zerotune

STEPS = 4
FAIL_AT = 2  # the step that fails once; the one before carries updates into its forward
OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes."


class Failure:
    """Raises the CPU allocator's out-of-memory error once armed: in the forward of
    ``block`` (after the engine's hooks gathered it), or in backward when the gradient
    reaches ``block``'s output (after backward finished every unit behind it)."""

    def __init__(self, block: torch.nn.Module, where: str) -> None:
        self.where = where
        self.armed = False
        self.raised = 0
        block.register_forward_hook(self._forward)

    def _forward(self, module, args, out):
        if not self.armed:
            return None
        if self.where == "forward":
            self._raise()
        hidden = out[0] if isinstance(out, tuple) else out
        hidden.register_hook(lambda grad: self._raise())
        return None

    def _raise(self):
        self.armed = False
        self.raised += 1
        raise RuntimeError(OOM)


def nvme(path) -> dict:
    return {
        "stage": 3,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "nvme_path": str(path),
        "grad_host_bytes": 2**16,  # some gradient shards on NVMe, the first units' kept
        "staging_bytes": 3 * 16 * 4096 * 3,  # chunks of a few KiB: units span several
    }


def train_with_a_failure(
    rank: int,
    world: int,
    config: dict,
    optimizer: str,
    where: str,
    accum: int,
    overlap: bool,
    zero_after: bool = True,
    device: str = "cpu",
) -> dict:
    """As harness.train_zero with clipping, but step FAIL_AT first runs its last micro-batch
    (where="backward", inside ``overlapped`` with ``overlap``) or its first one (where=
    "forward", while the step before's updates are carried) into a failure, then zeroes
    the gradients (unless not ``zero_after``) and takes the whole step again. ``device``:
    where the model is when it is sharded."""
    model = build("gpt2").to(device)
    groups = no_decay_groups(model, 0.1)
    config = dict(config)
    thread = config.pop("thread", None)
    engine = zerotune.shard(model, config)
    opt = make_optimizer(optimizer, groups, engine)
    if thread is not None:
        opt.update_thread = thread  # the arithmetic on the store's thread, as on a GPU
    failure = Failure(model.transformer.h[0], where)
    per_rank = GLOBAL_BATCH // world
    micro = per_rank // accum
    losses, norms, carried = [], [], []

    def micro_batches(mine, fail: bool) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for k in range(accum):
            part = mine[k * micro : (k + 1) * micro]
            last = k == accum - 1
            failure.armed = fail and (k == 0 if where == "forward" else last)
            if not last:
                with engine.no_sync():
                    loss = loss_of(engine, part) / accum
                    engine.backward(loss)
            else:
                loss = loss_of(engine, part) / accum  # outside overlapped(), as ZeroTrainer
                with opt.overlapped(clipping=True) if overlap else contextlib.nullcontext():
                    engine.backward(loss)
            total += loss.detach()
        return total

    for step, ids in enumerate(batches("gpt2", STEPS)):
        mine = ids[rank * per_rank : (rank + 1) * per_rank].to(device)
        if step == FAIL_AT:
            carried.append(opt._carry is not None)
            with pytest.raises(RuntimeError, match="can't allocate memory"):
                micro_batches(mine, fail=True)
            assert failure.raised == 1
            if zero_after:
                opt.zero_grad()
        total = micro_batches(mine, fail=False)
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    weights = {n: w.cpu().clone() for n, w in engine.full_state_dict().items()}
    steps = sorted({opt.step_count(key) for key, *_ in opt.segments()})
    engine.close()
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "steps": steps,
        "carried": carried,
    }


_reference: dict[str, dict] = {}


def reference(optimizer: str) -> dict:
    if optimizer not in _reference:
        _reference[optimizer] = train_reference("gpt2", steps=STEPS, optimizer=optimizer)
    return _reference[optimizer]


def assert_like_plain(result: dict, optimizer: str) -> None:
    ref = reference(optimizer)
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(result["norms"], ref["norms"], rtol=1e-5)
    assert_weights_match(result["weights"], ref["weights"], rtol=1e-5, atol=2e-5, label=optimizer)
    assert result["steps"] == [STEPS]  # the failed pass counted no step


CASES = [
    # (config, optimizer, where, accum, overlap)
    ("memory", "zero_adamw", "forward", 1, False),
    ("memory", "zero_adamw", "backward", 2, False),
    ("nvme", "zero_adamw", "forward", 1, True),  # carried updates pending in that forward
    ("nvme", "zero_adamw", "backward", 2, True),  # the clipped overlapped step given up
    ("nvme", "sgd", "backward", 1, True),  # ZeroOptimizer's state on NVMe, the same
    ("thread", "zero_adamw", "backward", 1, True),  # updates on the store's thread
]


@pytest.mark.parametrize(
    "kind, optimizer, where, accum, overlap",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-accum{c[3]}" for c in CASES],
)
def test_training_goes_on_after_a_failed_pass_as_if_it_never_ran(
    kind, optimizer, where, accum, overlap, tmp_path, monkeypatch
):
    from zerotune.memory.aio import IOHandle

    # I/O reports itself done only once waited for: step() always leaves updates queued.
    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    config = {
        "nvme": nvme(tmp_path),
        "memory": {"stage": 3},
        "thread": {"stage": 3, "offload_optimizer": "cpu", "thread": True},
    }[kind]
    [result] = run_world(1, train_with_a_failure, config, optimizer, where, accum, overlap)
    if where == "forward" and overlap:
        assert result["carried"] == [True]  # the failed forward had updates to make
    assert_like_plain(result, optimizer)


def test_a_failed_overlapped_backward_at_world_2(tmp_path):
    """Both ranks fail at the same point of the same backward (the Trainer's retry needs
    every rank to): they give the step up alike and go on like plain AdamW."""
    results = run_world(2, train_with_a_failure, nvme(tmp_path), "zero_adamw", "backward", 1, True)
    for result in results:
        assert_like_plain(result, "zero_adamw")


@pytest.mark.parametrize("kind", ["nvme", "thread"])
def test_an_unclipped_overlapped_backward_that_fails_says_what_it_updated(kind, tmp_path, caplog):
    """Without clipping the units whose gradients were final are updated during backward
    and stay updated (their updates in flight are finished, on the store's thread too): the
    failure says how many, and the optimizer takes the next step."""
    model = build("gpt2")
    groups = no_decay_groups(model, 0.1)
    config = nvme(tmp_path) if kind == "nvme" else {"stage": 3, "offload_optimizer": "cpu"}
    engine = zerotune.shard(model, config)
    opt = make_optimizer("zero_adamw", groups, engine)
    if kind == "thread":
        opt.update_thread = True  # the arithmetic on the store's thread, as on a GPU
    failure = Failure(model.transformer.h[0], "backward")
    ids = batches("gpt2", 1)[0]
    before = {n: w.clone() for n, w in engine.full_state_dict().items()}
    failure.armed = True
    with caplog.at_level(logging.WARNING, logger="zerotune.optim.sharded"):
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            with opt.overlapped():
                engine.backward(loss_of(engine, ids))
    owned = sum(1 for u in engine.units if opt.owns(u))
    after = engine.full_state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    # Backward had finished the final norm and block 1 (the head is tied to the embedding,
    # whose gradient is final only at the end of backward).
    assert changed == {n for n in before if n.startswith(("transformer.h.1.", "transformer.ln_f."))}
    [message] = [r.getMessage() for r in caplog.records if "backward raised" in r.getMessage()]
    assert f"after 2 of {owned} units were updated" in message, message
    counts = sorted({opt.step_count(key) for key, *_ in opt.segments()})
    assert counts == [0, 1]  # counted for the units updated only
    opt.zero_grad()
    with opt.overlapped():
        engine.backward(loss_of(engine, ids))
    opt.step()
    assert sorted({opt.step_count(key) for key, *_ in opt.segments()}) == [1, 2]
    engine.close()


def test_a_failed_backward_leaves_its_gradients_as_torch_does(tmp_path):
    """Without ``zero_grad`` after the failure, the next backward adds to what the failed
    one left (the units backward had finished, their gradient shards kept in memory for a
    clipped step included), as it adds to torch's ``.grad``."""
    model = build("gpt2")
    opt = make_optimizer("zero_adamw", no_decay_groups(model, 0.1))
    failure = Failure(model.transformer.h[0], "backward")
    losses, norms = [], []
    for step, ids in enumerate(batches("gpt2", STEPS)):
        if step == FAIL_AT:
            failure.armed = True
            with pytest.raises(RuntimeError, match="can't allocate memory"):
                loss_of(model, ids).backward()
        loss = loss_of(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ref = {"losses": losses, "norms": norms}
    [result] = run_world(
        1, train_with_a_failure, nvme(tmp_path), "zero_adamw", "backward", 1, True, False
    )
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(result["norms"], ref["norms"], rtol=1e-5)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    assert_weights_match(result["weights"], weights, rtol=1e-5, atol=2e-5, label="kept")
    # The failed backward's gradients counted: not the run that zeroed them.
    assert abs(result["norms"][FAIL_AT] - reference("zero_adamw")["norms"][FAIL_AT]) > 1e-3
