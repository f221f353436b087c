"""Training loops shared by the tests: plain single-process AdamW and zerotune on each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import external_net, odd_net, tiny_gpt2

import zerotune

GLOBAL_BATCH = 12
SEQ = 16
STEPS = 10
LR = 2e-3
WD = 0.1
MAX_NORM = 0.5
FIXED = torch.arange(32).reshape(2, 16) * 7 % 96  # input ids the saved models are run on


def build(model_name: str):
    """Test models by name: gpt2 (tied embeddings), gpt2_ckpt / gpt2_ckpt_reentrant
    (activation checkpointing), gpt2_frozen (a whole block and the position embedding
    frozen), odd (non-HF, odd sizes), odd_twice (a module called twice per forward),
    odd_switch (another unit order every other forward), odd_tied_twice (a head without
    parameters of its own, tied to the embedding, run twice)."""
    if model_name == "gpt2":
        return tiny_gpt2(seed=0)
    if model_name in ("gpt2_ckpt", "gpt2_ckpt_reentrant"):
        model = tiny_gpt2(seed=0)
        reentrant = model_name.endswith("reentrant")
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        model.train()
        return model
    if model_name == "gpt2_frozen":
        model = tiny_gpt2(seed=0)
        model.transformer.h[0].requires_grad_(False)
        model.transformer.wpe.requires_grad_(False)
        return model
    if model_name == "odd":
        return odd_net(seed=0)
    if model_name == "external":
        return external_net(seed=0)
    if model_name.startswith("odd_"):
        return odd_net(seed=0, mode=model_name.split("_", 1)[1])
    raise ValueError(model_name)


def vocab_of(model_name: str) -> int:
    return 37 if model_name.startswith(("odd", "external")) else 96


def batches(model_name: str, steps: int = STEPS) -> list[torch.Tensor]:
    """Learnable sequences: each row counts up from a random start by a random stride (1-3)."""
    g = torch.Generator().manual_seed(1234)
    vocab = vocab_of(model_name)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ)) % vocab)
    return out


def assert_weights_match(
    weights: dict, ref: dict, *, rtol: float, atol, flips=(0.0, 0.0), label: str = ""
) -> None:
    """Every element of every reference parameter within ``atol + rtol * |ref|`` (``atol``: a
    number, or one per parameter name). ``flips=(fraction, bound)``: an optimizer whose update
    jumps on a threshold may put up to that fraction of a parameter's elements (one at least,
    in a small parameter) off by up to ``bound`` instead; after such a flip in an early step
    every later forward differs a little, so the other elements may drift by up to
    ``bound / 20``."""
    import numpy as np

    fraction, bound = flips
    for name, w in ref.items():
        w = np.asarray(w)
        diff = np.abs(np.asarray(weights[name]) - w)
        tol = atol[name] if isinstance(atol, dict) else atol
        bad = diff > tol + rtol * np.abs(w)
        allowed = max(fraction * bad.size, 1.0) if fraction else 0.0
        far = diff > tol + rtol * np.abs(w) + bound / 20
        if bad.sum() <= allowed and (diff[bad] <= bound).all():
            continue
        if fraction and far.sum() <= allowed and (diff <= bound).all():
            continue
        raise AssertionError(
            f"{label}: {name}: {bad.sum()} of {bad.size} differ, worst {diff.max():.3g}"
        )


def plain_adamw_run(model, *, steps: int, wd: float, at: int, change) -> dict:
    """Plain AdamW on the whole batch, ``change(model)`` before step ``at``: losses,
    weights and each parameter's largest gradient (for ``assert_trains_like_plain``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=wd)
    grad_max = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    losses = []
    for step, ids in enumerate(batches("gpt2", steps)):
        if step == at:
            change(model)
        loss = loss_of(model, ids)
        loss.backward()
        for n, p in model.named_parameters():
            torch.maximum(grad_max[n], p.grad.abs(), out=grad_max[n])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": model.state_dict(), "grad_max": grad_max}


def assert_trains_like_plain(
    losses, weights: dict, ref: dict, *, bf16: bool, steps: int, label: str = ""
) -> None:
    """A zerotune run's losses and weights against a plain fp32 one's (``ref``: losses,
    weights, ``grad_max`` per parameter). fp32: tight bounds, but an element whose gradient
    stayed below 1e-6 may differ by lr a step (Adam turns rounding noise into full steps);
    bf16 compute: the bounds of test_engine_equivalence.py."""
    import numpy as np

    assert list(weights) == list(ref["weights"]), label
    if bf16:
        np.testing.assert_allclose(losses, ref["losses"], rtol=2e-2, err_msg=label)
        for name, w in ref["weights"].items():
            assert (weights[name] - w).abs().max() < 5e-2, (label, name)
        return
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5, atol=1e-6, err_msg=label)
    for name, w in ref["weights"].items():
        noise = ref["grad_max"].get(name, torch.ones(()))
        atol = torch.where(noise < 1e-6, LR * steps, 1e-5)
        assert ((weights[name] - w).abs() <= atol + 1e-5 * w.abs()).all(), (label, name)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out["loss"]


def step_and_mean_loss(engine, opt, loss: torch.Tensor, world: int) -> float:
    """Backward of ``loss`` and one optimizer step; the loss averaged over the ranks."""
    engine.backward(loss)
    opt.step()
    opt.zero_grad()
    mean = loss.detach().float().reshape(1) / world
    if world > 1:
        torch.distributed.all_reduce(mean)
    return float(mean)


def no_decay_groups(model, wd: float):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


class PlainSGD(torch.optim.Optimizer):
    """A user's own optimizer as the simplest ones are written: it iterates
    ``group["params"]``, reads ``p.grad`` and keeps ``self.state[p]`` (momentum, and a step
    count as a Python int)."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["n"] = 0
                state["n"] += 1
                g = p.grad.add(p, alpha=group["weight_decay"])
                state["buf"].mul_(group["momentum"]).add_(g)
                p.add_(state["buf"], alpha=-group["lr"] / (1 + 0.1 * state["n"]))


def optimizer_spec(name: str):
    """(class, kwargs) of the optimizers the tests train with, by name."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": LR}
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": 0.01}
    if name == "rmsprop":
        return torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}
    if name == "adafactor":
        return torch.optim.Adafactor, {"lr": 1e-2}
    if name == "hf_adafactor":
        from transformers.optimization import Adafactor

        return Adafactor, {"lr": 1e-3, "scale_parameter": False, "relative_step": False}
    if name == "lion":
        import bitsandbytes as bnb

        return bnb.optim.Lion, {"lr": 1e-3, "optim_bits": 32}
    if name == "adamw_bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW, {"lr": LR, "optim_bits": 8, "min_8bit_size": 256}
    if name == "custom":
        return PlainSGD, {}
    raise ValueError(name)


def make_optimizer(name: str, groups, engine=None):
    """Optimizer ``name`` over ``groups``: plain, or over ``engine``'s shards (ZeroAdamW for
    "zero_adamw", else zerotune.ZeroOptimizer)."""
    if name == "zero_adamw":
        return (
            torch.optim.AdamW(groups, lr=LR)
            if engine is None
            else zerotune.ZeroAdamW(engine, groups, lr=LR)
        )
    cls, kwargs = optimizer_spec(name)
    if engine is None:
        opt = cls(groups, **kwargs)
        if hasattr(opt, "mng"):  # bitsandbytes: not the overrides other tests registered
            opt.mng = object.__new__(type(opt.mng))
            opt.mng.initialize()
        return opt
    return zerotune.ZeroOptimizer(engine, cls, groups, **kwargs)


def train_reference(
    model_name: str,
    steps: int = STEPS,
    clip: float | None = MAX_NORM,
    device: str = "cpu",
    optimizer: str = "zero_adamw",
) -> dict:
    """Plain PyTorch: whole batch, one process, torch.optim.AdamW (or ``optimizer``, see
    ``make_optimizer``) on ``device``; weights and gradient maxima come back on the CPU."""
    model = build(model_name).to(device)
    opt = make_optimizer(optimizer, no_decay_groups(model, WD))
    losses, norms = [], []
    grad_max = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for ids in batches(model_name, steps):
        loss = loss_of(model, ids.to(device))
        loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.maximum(grad_max[n], p.grad.abs(), out=grad_max[n])
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        eval_loss = float(loss_of(model, batches(model_name, 1)[0].to(device)))
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "grad_max": {n: g.cpu() for n, g in grad_max.items()},
        "eval_loss": eval_loss,
    }


def train_zero(
    rank: int,
    world: int,
    model_name: str,
    config: dict,
    *,
    steps: int = STEPS,
    accum: int = 1,
    use_no_sync: bool = False,
    clip: float | None = MAX_NORM,
    device: str = "cpu",
    optimizer: str = "zero_adamw",
    overlap: bool = False,
    compile_kwargs: dict | None = None,
) -> dict:
    """zerotune on this rank: its slice of the global batch, split into ``accum`` micro-batches,
    the engine on ``device`` (where the model's parameters are when it is sharded), trained
    with ZeroAdamW or ``optimizer`` over the shards (see ``make_optimizer``); with
    ``overlap`` the last micro-batch's backward runs inside ``opt.overlapped()`` (with
    ``clipping`` when ``clip`` is set); ``compile_kwargs``: ``engine.compile(**them)``."""
    model = build(model_name).to(device)
    groups = no_decay_groups(model, WD)  # reads shapes: before sharding empties the params
    engine = zerotune.shard(model, config)
    if compile_kwargs is not None:
        model.config.use_cache = False  # as the Trainer sets it: see [Note: compiled units]
        engine.compile(**compile_kwargs)
    opt = make_optimizer(optimizer, groups, engine)
    per_rank = GLOBAL_BATCH // world
    micro = per_rank // accum
    losses, norms, infos, launched, carried = [], [], [], 0, 0
    for ids in batches(model_name, steps):
        mine = ids[rank * per_rank : (rank + 1) * per_rank].to(device)
        total = torch.zeros((), device=device)
        for k in range(accum):
            part = mine[k * micro : (k + 1) * micro]
            last = k == accum - 1
            if use_no_sync and not last:
                ctx = engine.no_sync()
            elif overlap and last:
                ctx = opt.overlapped(clipping=clip is not None)
            else:
                ctx = _null()
            with ctx:
                loss = loss_of(engine, part) / accum
                engine.backward(loss)
            total += loss.detach().float()
        if overlap:
            launched += len(opt._overlap.launched)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        infos.append(opt.step())
        carried += opt._carry is not None
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = {n: w.cpu() for n, w in engine.full_state_dict().items()}
    with torch.no_grad():
        eval_loss = float(loss_of(engine, batches(model_name, 1)[0].to(device)))
    memory = engine.memory_report()
    engine.close()
    return {
        "eval_loss": eval_loss,
        "states_after": [u.state.value for u in engine.units if not u.persistent],
        "rerecords": engine.prefetcher.rerecords,
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "skipped": [i.skipped for i in infos],
        "memory": memory,
        "pool_allocations": engine.pool.allocations,
        "launched": launched,  # units updated (or, clipping, queued) during backward
        "carried": carried,  # steps whose updates went on into the next forward
    }


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def train_and_save(rank, world, tmp, steps: int, config: dict):
    """Tiny GPT-2 sharded with ``config``, ``steps`` steps over ``world`` ranks; then a
    checkpoint at ``tmp/ckpt``, a live ``save_hf`` at ``tmp/live``. Returns the engine and
    what to compare with the saved copies: whole weights and logits on ``FIXED``."""
    model = build("gpt2")
    groups = no_decay_groups(model, WD)
    engine = zerotune.shard(model, config)
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    per = GLOBAL_BATCH // world
    for ids in batches("gpt2", steps):
        engine.backward(loss_of(engine, ids[rank * per : (rank + 1) * per]))
        opt.step()
    zerotune.save_checkpoint(engine, f"{tmp}/ckpt", step=steps)
    zerotune.save_hf(engine, f"{tmp}/live", dtype="fp32")
    weights = engine.full_state_dict()
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=FIXED).logits
    return engine, {"weights": weights, "logits": logits}
