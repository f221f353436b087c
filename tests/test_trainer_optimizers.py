"""Every --optim the plain Trainer can run here, and optimizers passed in, train under
ZeroTrainer like under the plain Trainer (logged losses and gradient norms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import PlainSGD, assert_weights_match
from trainer_cases import COMMON, dataset, logged, model, plain_run, zero_run

import zerotune
from zerotune.hf import ZeroTrainer, ZeroTrainingArguments
from zerotune.memory.aio import IOHandle
from zerotune.sharding.engine import ZeroEngine

RTOL = 1e-5
# (--optim, ZeroTrainer overrides): stage 3 unless said otherwise
CASES = [
    ("sgd", {}),
    ("adagrad", dict(offload_optimizer="cpu")),
    ("rmsprop", dict(zero_stage=2)),
    ("adafactor", {}),
    ("lion_32bit", dict(zero_stage=1)),
    ("paged_lion_8bit", {}),  # 8-bit, embeddings kept in 32 bits as the plain Trainer does
    ("ademamix", dict(offload_optimizer="cpu")),
    ("ademamix_8bit", {}),
    ("paged_adamw_8bit", dict(zero_stage=2)),
    ("paged_adamw_32bit", {}),
    ("rmsprop_bnb_8bit", dict(offload_optimizer="cpu")),
    ("lion_8bit", {}),
    ("adagrad", dict(offload_optimizer="nvme", offload_param="nvme")),  # state streamed
    ("adafactor", dict(zero_stage=2, offload_optimizer="nvme")),
]
# transformers' Adafactor spreads the normalized rounding noise of GPT-2's key bias over the
# whole bias (see MODEL in test_generic_optimizers.py): its losses agree less closely (with
# the state on NVMe the clipped overlapped step sums the norm in another order, unit by
# unit), and so do its weights.
LOOSE = {"adafactor": 2e-4}
LR = {"sgd": 0.1, "lion_32bit": 1e-3, "paged_lion_8bit": 1e-3, "lion_8bit": 1e-3}
STEPS = COMMON["max_steps"]
# Optimizers whose update jumps on a threshold (Lion's sign, 8-bit states' codes), as FLIPS in
# test_generic_optimizers.py: a gradient element summed in another order (BLAS kernels that
# pick their blocking by CPU and operand alignment) can land on the other side and move its
# weight by up to a whole update. A few elements of a parameter may be off by that much,
# every other one is held to WEIGHT_ATOL (or, when an early flip changed every later forward,
# to a twentieth of that bound: see assert_weights_match), and the logged losses and gradient
# norms, which move with those few weights, to FLIPS_LOG_RTOL.
WEIGHT_ATOL = 1e-5
FLIPS_LOG_RTOL = 1e-4


def flips(optim: str, lr: float) -> tuple[float, float]:
    """(fraction of a parameter's elements, bound) allowed to differ for ``optim``."""
    if "lion" in optim:
        return 0.02, 2 * lr * STEPS  # a sign: a step of 2 lr the other way
    if "8bit" in optim:
        return 0.01, lr * STEPS  # a code: at most the step itself
    return 0.0, 0.0


_plain: dict[str, dict] = {}


def weight_atol(weights: dict, lr: float, *, whole_bias: bool) -> dict:
    """WEIGHT_ATOL for every element but GPT-2's key biases: their gradient is rounding noise
    (softmax ignores a shift of all keys' scores), which a normalizing optimizer turns into
    steps of up to lr each. ``whole_bias``: the optimizer scales a tensor's update by its
    RMS (transformers' Adafactor), so that noise reaches the query and value biases too."""
    atol = {}
    for name, w in weights.items():
        atol[name] = np.full(tuple(w.shape), WEIGHT_ATOL)
        if name.endswith("attn.c_attn.bias"):
            d = w.shape[0] // 3  # query, key, value
            lo, hi = (0, 3 * d) if whole_bias else (d, 2 * d)
            atol[name][lo:hi] = lr * STEPS
    return atol


def result_of(plain) -> dict:
    """A plain Trainer's logged losses and gradient norms, and its final weights."""
    return {
        "loss": logged(plain),
        "grad_norm": logged(plain, "grad_norm"),
        "weights": {n: p.detach().clone() for n, p in plain.model.named_parameters()},
    }


def plain_result(tmp_path, optim: str) -> dict:
    """``result_of`` the plain Trainer with ``--optim optim``, run once for the cases that
    share it."""
    if optim not in _plain:
        lr = dict(learning_rate=LR[optim]) if optim in LR else {}
        _plain[optim] = result_of(plain_run(str(tmp_path / "plain"), optim=optim, **lr))
    return _plain[optim]


def assert_trains_like(zero, plain: dict, optim: str) -> None:
    """ZeroTrainer ``zero`` logged the losses and gradient norms of ``plain`` (``result_of``)
    and ended at its weights: within RTOL, but for LOOSE, the key-bias noise and the flips
    of threshold optimizers."""
    lr_max = LR.get(optim, COMMON["learning_rate"])
    allowed = flips(optim, lr_max)
    rtol = LOOSE.get(optim, FLIPS_LOG_RTOL if allowed[0] else RTOL)
    np.testing.assert_allclose(logged(zero), plain["loss"], rtol=rtol)
    np.testing.assert_allclose(logged(zero, "grad_norm"), plain["grad_norm"], rtol=rtol)
    weights = zero.engine.full_state_dict()
    assert set(weights) == set(plain["weights"])
    assert_weights_match(
        weights,
        plain["weights"],
        rtol=LOOSE.get(optim, RTOL),
        atol=weight_atol(plain["weights"], lr_max, whole_bias=optim == "adafactor"),
        flips=allowed,
        label=optim,
    )


def wide_embedding_model(tie: bool = True):
    """The tiny GPT-2 with a vocabulary of 256: an embedding of 8192 elements, large enough
    for bitsandbytes' 8-bit state (the default model's 3072 are below its minimum)."""
    from conftest import tiny_gpt2

    return tiny_gpt2(seed=0, vocab_size=256, tie=tie)


@pytest.mark.parametrize(
    "optim, overrides", CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[1].values()))}" for c in CASES]
)
def test_optim_trains_like_the_plain_trainer(tmp_path, optim, overrides):
    if "nvme" in overrides.values():
        overrides = dict(overrides, nvme_path=str(tmp_path))
    lr = dict(learning_rate=LR[optim]) if optim in LR else {}
    plain = plain_result(tmp_path, optim)
    zero = zero_run(str(tmp_path / "zero"), optim=optim, **lr, **overrides)
    assert not isinstance(zero.optimizer, zerotune.ZeroAdamW)
    if "8bit" in optim and "nvme" not in overrides.values():
        # The matrices keep 8-bit state (the embedding's 32 bits, as the plain Trainer
        # keeps it, are checked on a larger one: test_8bit_optim_keeps_embeddings_in_32_bits).
        kinds = state1_kinds(zero)
        assert kinds["transformer.wte.weight"] == torch.float32, kinds
        assert kinds["transformer.h.0.mlp.c_fc.weight"] == torch.uint8, kinds
    assert_trains_like(zero, plain, optim)
    zero.close()


def state1_kinds(zero) -> dict[str, torch.dtype]:
    """The dtype of each parameter's first state tensor in a ZeroTrainer's bitsandbytes
    optimizer: in memory, or as laid out on NVMe."""
    opt = zero.optimizer
    if opt.store is not None:
        probes, of = opt.store.probes, opt.store.whole_probe
        return {name: probes[key].tensors["state1"][0] for name, key in of.items()}
    names = {id(p): n for n, p in zero.engine.module.named_parameters()}
    param_of = opt.param_of_keys()
    return {names[id(param_of[id(k)])]: st["state1"].dtype for k, st in opt.inner.state.items()}


@pytest.mark.parametrize(
    "optim, overrides, tie",
    [
        ("paged_adamw_8bit", dict(offload_optimizer="nvme", offload_param="nvme"), True),
        ("paged_adamw_8bit", dict(offload_optimizer="nvme"), False),
        ("lion_8bit", dict(zero_stage=2, offload_optimizer="nvme"), True),
        ("ademamix_8bit", dict(offload_optimizer="cpu"), True),
    ],
    ids=["paged_adamw_8bit-nvme", "paged_adamw_8bit-untied", "lion_8bit-2-nvme", "ademamix_8bit"],
)
def test_8bit_optim_keeps_embeddings_in_32_bits(tmp_path, optim, overrides, tie):
    """An 8-bit bitsandbytes --optim on a model whose embedding is large enough for 8-bit
    state (8192 elements; the other cases' 3072 are below bitsandbytes' minimum): the
    embedding's state is 32-bit, as the plain Trainer keeps it, in memory and as laid out
    on NVMe (untied, the head of the same shape stays 8-bit), and training matches the
    plain Trainer's. The plain run goes first in this process: the settings it leaves in
    bitsandbytes' process-wide manager must not reach the zerotune run."""
    from transformers import Trainer, TrainingArguments

    lr = dict(learning_rate=LR[optim]) if optim in LR else {}
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), optim=optim, **{**COMMON, **lr})
    plain = Trainer(model=wide_embedding_model(tie), args=args, train_dataset=dataset())
    plain.train()
    if "nvme" in overrides.values():
        overrides = dict(overrides, nvme_path=str(tmp_path))
    model_ = wide_embedding_model(tie)
    zero = zero_run(str(tmp_path / "zero"), model_source=model_, optim=optim, **lr, **overrides)
    kinds = state1_kinds(zero)
    assert kinds["transformer.wte.weight"] == torch.float32, kinds
    assert kinds["transformer.h.0.mlp.c_fc.weight"] == torch.uint8, kinds
    if not tie:
        assert kinds["lm_head.weight"] == torch.uint8, kinds
    assert_trains_like(zero, result_of(plain), optim)
    zero.close()


def test_8bit_optim_on_nvme_resumes_exactly(tmp_path):
    """The same 8-bit --optim on NVMe, resumed from a checkpoint of step 3: the layout with
    the embedding's 32-bit state is made again before the checkpoint is read, and steps 4-6
    log what the uninterrupted run logged."""
    run = dict(
        optim="paged_adamw_8bit",
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path=str(tmp_path),
        save_strategy="steps",
        save_steps=3,
    )
    whole = zero_run(str(tmp_path / "out"), model_source=wide_embedding_model(), **run)
    expected = logged(whole)
    whole.close()
    again = zero_run(str(tmp_path / "out"), model_source=wide_embedding_model(), train=False, **run)
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert logged(again)[3:] == expected[3:]
    again.close()


def test_a_module_override_registered_after_the_optimizer_is_built(tmp_path):
    """bitsandbytes' documented way, its process-wide manager's ``register_module_override``,
    called after a ZeroOptimizer with its state on NVMe is built (the layout was probed
    without it): the layout is made again at the first step, the embedding's state is
    32-bit, and the losses are plain bitsandbytes' with the same override."""
    import bitsandbytes as bnb
    from harness import batches, loss_of

    manager = bnb.optim.GlobalOptimManager.get_instance()
    registered = len(manager.module_weight_config_triple)

    def run(zero: bool) -> list[float]:
        model = wide_embedding_model()
        if zero:
            config = {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}
            model = zerotune.shard(model, config)
            opt = zerotune.ZeroOptimizer(model, bnb.optim.AdamW8bit, lr=2e-3)
            wte = model.module.transformer.wte
        else:
            opt = bnb.optim.AdamW8bit(model.parameters(), lr=2e-3)
            wte = model.transformer.wte
        manager.register_module_override(wte, "weight", {"optim_bits": 32})
        losses = []
        for ids in batches("gpt2", 3):
            loss = loss_of(model, ids)
            model.backward(loss) if zero else loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        if zero:
            key = opt.store.whole_probe["transformer.wte.weight"]
            assert opt.store.probes[key].tensors["state1"][0] == torch.float32
            model.close()
        return losses

    try:
        plain = run(zero=False)
        np.testing.assert_allclose(run(zero=True), plain, rtol=RTOL)
    finally:  # the manager is process-wide: later optimizers would look these modules up
        del manager.module_weight_config_triple[registered:]


def test_overrides_after_the_first_step_are_refused(tmp_path):
    """bitsandbytes settings for a parameter take effect before the first step only: later
    they would change nothing (or, on NVMe, the layout of state already on disk)."""
    import bitsandbytes as bnb

    engine = zerotune.shard(model(), {"stage": 3})
    opt = zerotune.ZeroOptimizer(engine, bnb.optim.AdamW8bit, lr=1e-3)
    wte = engine.module.transformer.wte.weight
    opt.override_config(wte, {"optim_bits": 32})  # before: taken
    ids = dataset()[:4]["input_ids"]
    engine.backward(engine(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss)
    opt.step()
    with pytest.raises(RuntimeError, match="override_config after the first step"):
        opt.override_config(wte, {"optim_bits": 8})
    engine.close()


def test_optimizer_class_and_kwargs_and_a_built_optimizer(tmp_path):
    from transformers import Trainer, TrainingArguments

    def plain_with(**kwargs):
        args = TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON)
        trainer = Trainer(model=model(), args=args, train_dataset=dataset(), **kwargs)
        trainer.train()
        return logged(trainer)

    cls_kwargs = (PlainSGD, {"lr": 0.05, "momentum": 0.8})
    plain = plain_with(optimizer_cls_and_kwargs=cls_kwargs)
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "a"), **COMMON)
    zero = ZeroTrainer(
        model=model(), args=args, train_dataset=dataset(), optimizer_cls_and_kwargs=cls_kwargs
    )
    zero.train()
    np.testing.assert_allclose(logged(zero), plain, rtol=RTOL)
    zero.close()

    def built(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    # A ZeroOptimizer built over the engine given as the model is used as it is.
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "c"), **COMMON)
    engine = zerotune.shard(model(), args.zero)
    opt = zerotune.ZeroOptimizer(engine, PlainSGD, lr=0.05, momentum=0.8)
    zero = ZeroTrainer(model=engine, args=args, train_dataset=dataset(), optimizers=(opt, None))
    zero.train()
    assert zero.optimizer is opt
    m = model()  # the same optimizer over every parameter (no decay groups)
    same = plain_with_model(tmp_path, m, (PlainSGD(m.parameters(), lr=0.05, momentum=0.8), None))
    np.testing.assert_allclose(logged(zero), same, rtol=RTOL)
    zero.close()

    m = model()
    plain = plain_with_model(tmp_path, m, built(m))
    m = model()
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "b"), **COMMON)
    zero = ZeroTrainer(model=m, args=args, train_dataset=dataset(), optimizers=built(m))
    zero.train()
    assert zero.optimizer.optimizer_class is torch.optim.SGD
    np.testing.assert_allclose(logged(zero), plain, rtol=RTOL)
    np.testing.assert_allclose(
        logged(zero, "learning_rate"), [1 / (1 + s) * 0.05 for s in range(6)], rtol=1e-6
    )
    zero.close()
    # Linears the engine cut into tiles: the optimizer built over the untiled weights is
    # rebuilt over the tiles.
    m = model()
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "d"), tile_linear_bytes=4096, **COMMON)
    zero = ZeroTrainer(model=m, args=args, train_dataset=dataset(), optimizers=built(m))
    assert zero.engine.tiled_from
    zero.train()
    np.testing.assert_allclose(logged(zero), plain, rtol=RTOL)
    zero.close()


def plain_with_model(tmp_path, m, optimizers):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "plain2"), **COMMON)
    trainer = Trainer(model=m, args=args, train_dataset=dataset(), optimizers=optimizers)
    trainer.train()
    return logged(trainer)


def test_optimizers_that_cannot_run_say_why(tmp_path):
    for optim, why in [
        ("galore_adamw", "hooks into the whole model's parameters"),
        ("schedule_free_adamw", "cannot run here: You need to install `schedulefree`"),
        ("adamw_torch_xla", "cannot run here: Trainer failed to import syncfree AdamW"),
    ]:
        with pytest.raises(zerotune.ConfigError, match=why):
            ZeroTrainingArguments(output_dir="unused", optim=optim)
    # A stepped optimizer would lose its state when rebuilt over the shards.
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(
        input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
    ).loss.backward()
    opt.step()
    args = ZeroTrainingArguments(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(ValueError, match="has stepped already.*optimizer_cls_and_kwargs"):
        ZeroTrainer(model=m, args=args, train_dataset=dataset(), optimizers=(opt, None))


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_nvme_updates_overlap_backward_with_clipping_or_without(tmp_path, monkeypatch, max_norm):
    """The state of an --optim other than AdamW on NVMe: ZeroTrainer runs each step's last
    backward inside overlapped() (with clipping=True unless --max_grad_norm 0, the updates
    then carried into the next forward) and logs the plain Trainer's losses and gradient
    norms, with clipping that clips; evaluations between steps (their forward finishes the
    carried updates first) give the plain Trainer's losses."""
    calls = []
    overlapped = zerotune.ZeroOptimizer.overlapped

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("clipping", False))
        return overlapped(self, *args, **kwargs)

    monkeypatch.setattr(zerotune.ZeroOptimizer, "overlapped", spy)
    carried = []
    carry = ZeroEngine.carry_into_forward
    monkeypatch.setattr(
        ZeroEngine, "carry_into_forward", lambda self, on: (carried.append(on), carry(self, on))
    )
    run = dict(optim="adagrad", max_grad_norm=max_norm, eval_strategy="steps", eval_steps=2)
    plain = plain_run(str(tmp_path / "plain"), **run)
    nvme = dict(offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path))
    # I/O done only once waited for: each step's updates are carried into the next forward.
    monkeypatch.setattr(IOHandle, "done", lambda self: False)
    zero = zero_run(str(tmp_path / "zero"), **run, **nvme)
    assert zero.overlap_step and calls == [max_norm > 0] * 6
    assert carried.count(True) == 6
    assert len(logged(zero, "eval_loss")) == 3
    np.testing.assert_allclose(logged(zero, "eval_loss"), logged(plain, "eval_loss"), rtol=RTOL)
    if max_norm:
        assert max(logged(plain, "grad_norm")) > max_norm  # the clipping clips
    np.testing.assert_allclose(logged(zero), logged(plain), rtol=RTOL)
    np.testing.assert_allclose(logged(zero, "grad_norm"), logged(plain, "grad_norm"), rtol=RTOL)
    zero.close()
