"""What the engine cannot do right is refused in one sentence instead of trained wrong:
embeddings that rescale their weight in forward or make sparse gradients, double backward
where weights are released, a second backward inside one overlapped step, and torch-style
optimizer state dicts (the state is sharded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_world
from torch import nn

import zerotune

LR = 1e-2


class EmbedNet(nn.Module):
    def __init__(self, **embedding) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, **embedding)
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).pow(2).mean()


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step))


def test_embedding_max_norm_is_refused_where_its_change_would_be_lost(tmp_path):
    def net():
        torch.manual_seed(0)
        model = EmbedNet(max_norm=1.0)
        with torch.no_grad():
            model.emb.weight.mul_(3)  # rows of norm ~8: forward rescales those it looks up
        return model

    for config in (
        {"stage": 3, "offload_param": "nvme", "nvme_path": str(tmp_path)},
        {"stage": 2, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)},
        {"stage": 3, "dtype": "bf16"},
    ):
        with pytest.raises(zerotune.ConfigError, match=r"emb: Embedding\(max_norm=1.0\)"):
            zerotune.shard(net(), config)
        assert list(tmp_path.iterdir()) == []
    # One process, fp32, no offload: the weight forward rescales is the master, as in torch.
    ref = net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    engine = zerotune.shard(net(), {"stage": 3})
    zopt = zerotune.ZeroAdamW(engine, lr=LR)
    for step in range(3):
        ref(_ids(step)).backward()
        opt.step()
        opt.zero_grad()
        engine(_ids(step)).backward()
        zopt.step()
    got = engine.full_state_dict()["emb.weight"]
    np.testing.assert_allclose(got.numpy(), ref.emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    looked_up = torch.cat([_ids(s).reshape(-1) for s in range(3)]).unique()
    assert float(got[looked_up].norm(dim=1).max()) < 1.01  # rescaled rows kept
    engine.close()


def test_a_sparse_embedding_is_refused():
    with pytest.raises(zerotune.ConfigError, match=r"emb: Embedding\(sparse=True\)"):
        zerotune.shard(EmbedNet(sparse=True), {"stage": 2})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _xy(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _penalized(model, x, y):
    """A gradient penalty: the input gradient's graph is built (create_graph=True)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.mse_loss(out, y) + 0.1 * g.pow(2).mean()


def _penalty_run(rank, world, stage):
    engine = zerotune.shard(_mlp(), {"stage": stage})
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    out = {}
    for step in range(3):
        x, y = (t[rank::world] for t in _xy(step))
        try:
            _penalized(engine, x, y).backward()
        except RuntimeError as exc:
            out["error"] = str(exc)
            # The same engine trains on without the penalty.
            F.mse_loss(engine(x), y).backward()
        opt.step()
    out["weights"] = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_parameters_the_fp32_master_would_change_are_refused(dtype):
    """A float64 model would be cast to fp32 silently (and then fail on float64 inputs);
    an integer parameter would lose its values above 2**24."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_parameter(
        "extra", nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=dtype.is_floating_point)
    )
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(zerotune.ConfigError, match=f"parameter '1.extra' is {name}: zerotune"):
        zerotune.shard(model, {"stage": 3})
    model[1].extra = nn.Parameter(torch.ones(3))
    zerotune.shard(model, {"stage": 3}).close()  # fp32: accepted


def test_double_backward_is_refused_at_stage_3_and_trains_at_stage_2():
    def reference(penalty: bool):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(3):
            x, y = _xy(step)
            losses = [
                _penalized(model, x[r::2], y[r::2])
                if penalty
                else F.mse_loss(model(x[r::2]), y[r::2])
                for r in range(2)
            ]
            (sum(losses) / 2).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().numpy() for n, p in model.named_parameters()}

    for stage, penalty in ((2, True), (3, False)):
        ref = reference(penalty)
        for res in run_world(2, _penalty_run, stage, timeout=60):
            if stage == 3:
                assert "create_graph=True" in res["error"] and "use stage 2" in res["error"]
            else:
                assert "error" not in res
            for name, w in ref.items():
                np.testing.assert_allclose(res["weights"][name], w, rtol=1e-5, atol=1e-6)


def test_a_second_backward_inside_one_overlapped_step_is_refused(tmp_path):
    engine = zerotune.shard(
        _mlp(), {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}
    )
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    x, y = _xy(0)
    loss = F.mse_loss(engine(x), y)
    with pytest.raises(RuntimeError, match="a second backward pass inside one overlapped"):
        with opt.overlapped():
            loss.backward(retain_graph=True)
            F.mse_loss(engine(2 * x), -y).backward()
    with pytest.raises(RuntimeError, match="a second backward pass was refused"):
        opt.step()
    # A backward that launches nothing first (an input gradient only) is not refused.
    x = x.clone().requires_grad_(True)
    loss = F.mse_loss(engine(x), y)
    with opt.overlapped():
        torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward()
    opt.step()
    engine.close()


def test_torch_style_optimizer_state_dicts_are_refused():
    engine = zerotune.shard(_mlp(), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=LR)
    with pytest.raises(RuntimeError, match=r"zerotune.save_checkpoint\(engine, folder"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match=r"zerotune.load_checkpoint\(engine, folder"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    engine.close()
