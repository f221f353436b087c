"""Modules users write themselves (not transformers architectures) train like plain AdamW
at stage 3: a cell applied in a loop of reentrant checkpoints under an overlapped step,
gradients discarded with ``model.zero_grad()``, a unit reading another unit's weight before
using its own parameter last, an in-place op on an output that is a view, an output
dataclass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_world
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerotune

STEPS = 3


class Recurrent(nn.Module):
    """One cell applied three times, each application in a reentrant checkpoint: every
    recompute runs an inner backward that completes the cell's gradients once more."""

    def __init__(self):
        super().__init__()
        self.inp, self.cell, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def step(self, h):
        return torch.tanh(self.cell(h))

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = checkpoint(self.step, h, use_reentrant=True)
        return self.head(h)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ScaledByRoot(nn.Module):
    """The root reads ``proj.weight`` (another unit's, kept by matmul for its backward) and
    uses its own ``scale`` last: its own gradient is complete before that matmul's
    backward has run."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(6, 8), nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.head(self.proj(x) @ self.proj.weight) * self.scale


class InPlaceOnView(nn.Module):
    """nn.Linear on a 3-D input returns a view (addmm(...).view), which ``+=`` and
    ReLU(inplace=True) rewrite: the view's history, and a hook on its old node, leave the
    graph."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.fc1(x)
        h += 0.1
        h = F.relu(h, inplace=True)
        return self.head(torch.tanh(self.fc2(h)))


@dataclasses.dataclass
class Gated:
    h: torch.Tensor
    gate: torch.Tensor


class GatedInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.g = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return Gated(self.fc(x), self.g(x))


class DataclassOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.inner, self.head = nn.Linear(6, 8), GatedInner(), nn.Linear(8, 3)

    def forward(self, x):
        o = self.inner(self.inp(x))
        return self.head(o.h * torch.sigmoid(o.gate))


MODELS = {
    "recurrent": Recurrent,
    "mlp": Mlp,
    "scaled_by_root": ScaledByRoot,
    "in_place_on_view": InPlaceOnView,
    "dataclass_output": DataclassOutput,
}


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))


def compare(rank, world, name, config, *, overlap=False, discard=False):
    """Losses and weights of ``STEPS`` AdamW steps, plain (whole batch, one process) and
    zerotune (this rank's half). ``discard``: each step first computes a batch whose
    gradients ``model.zero_grad()`` throws away."""
    torch.manual_seed(0)
    ref, model = MODELS[name](), MODELS[name]()
    model.load_state_dict(ref.state_dict())
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    losses, ref_losses = [], []
    try:
        for _ in range(STEPS):
            x, y = torch.randn(8, 4, 6, generator=g), torch.randint(0, 3, (8, 4), generator=g)
            if discard:
                bad = 100 * torch.randn(8, 4, 6, generator=g)
                _loss(ref(bad), y).backward()
                ref.zero_grad()
                engine.backward(_loss(engine(bad[mine]), y[mine]))
                model.zero_grad()
            loss = _loss(ref(x), y)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(float(loss))
            loss = _loss(engine(x[mine]), y[mine])
            if overlap:
                with opt.overlapped():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        weights = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()
    return losses, ref_losses, weights, {k: v.detach().numpy() for k, v in ref.state_dict().items()}


def check(result, world):
    losses, ref_losses, weights, ref_weights = result
    if world == 1:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, w in ref_weights.items():
        np.testing.assert_allclose(weights[k], w, rtol=1e-5, atol=1e-6, err_msg=k)


def nvme(tmp_path):
    return {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
            "nvme_path": str(tmp_path)}  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cell_in_a_loop_of_reentrant_checkpoints(overlap, tmp_path):
    """The overlapped step used to update the cell after the first checkpoint's inner
    backward, with a third of its gradient (weights 0.02 off)."""
    check(compare(0, 1, "recurrent", nvme(tmp_path), overlap=overlap), 1)


def test_model_zero_grad_discards_reduced_gradients(tmp_path):
    """``model.zero_grad()`` forgets what the units reduced into their shards (it cleared
    only ``param.grad``, and the next step applied both batches: weights 0.03 off)."""
    check(compare(0, 1, "mlp", nvme(tmp_path), discard=True), 1)


def _zero_grad_at_two(rank, world):
    return compare(rank, world, "mlp", {"stage": 3}, discard=True)


def test_model_zero_grad_discards_reduced_gradients_at_two_ranks():
    check(run_world(2, _zero_grad_at_two)[0], 2)


def test_zero_grad_of_part_of_a_unit_is_refused():
    torch.manual_seed(0)
    model = DataclassOutput()
    engine = zerotune.shard(model, {"stage": 3})
    try:
        x, y = torch.randn(8, 4, 6), torch.randint(0, 3, (8, 4))
        engine.backward(_loss(engine(x), y))
        model.head.zero_grad()  # a unit of its own: fine
        with pytest.raises(RuntimeError, match="clears part of unit inner"):
            model.inner.fc.zero_grad()  # the unit is `inner`: fc and g in one shard
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["scaled_by_root", "in_place_on_view", "dataclass_output"])
def test_units_gathered_for_their_backward(name):
    """Each crashed in backward on a released (empty) weight: the root let go of
    ``proj`` before the backward of its matmul; the in-place op dropped the output's hook;
    no hook went inside a dataclass."""
    check(compare(0, 1, name, {"stage": 3}), 1)
