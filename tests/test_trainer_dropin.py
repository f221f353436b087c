"""ZeroTrainer where tests of the plain Trainer use it in ways beyond one run: the same model
given to a second trainer, model_init, optimizer groups over the model's parameters, and
parameters read after training. Each against the plain Trainer doing the same."""

from __future__ import annotations

import pytest
import torch
from trainer_cases import COMMON, dataset, logged, model

from zerotune.hf import ZeroTrainer, ZeroTrainingArguments

RTOL = 1e-5
SHORT = {**COMMON, "max_steps": 3, "warmup_steps": 0}


_plain_twice_runs: dict[str, tuple] = {}


def _plain_twice(tmp_path, optim: str):
    """Two plain Trainers over one model object: the second goes on from the first's weights
    with an optimizer of its own (run once per optimizer)."""
    if optim not in _plain_twice_runs:
        _plain_twice_runs[optim] = _train_plain_twice(tmp_path, optim)
    return _plain_twice_runs[optim]


def _train_plain_twice(tmp_path, optim: str):
    from transformers import Trainer, TrainingArguments

    m = model()
    out = []
    for i, lr in enumerate((2e-3, 1e-3)):
        args = TrainingArguments(
            output_dir=str(tmp_path / f"plain{i}"), **{**SHORT, "learning_rate": lr}, optim=optim
        )
        trainer = Trainer(model=m, args=args, train_dataset=dataset())
        trainer.train()
        out.append(logged(trainer))
    weight = m.transformer.h[0].mlp.c_fc.weight.detach().clone()
    return out, weight


@pytest.mark.parametrize(
    "optim, zero",
    [
        ("adamw_torch", dict(zero_stage=3)),
        ("adamw_torch", dict(zero_stage=3, offload_param="nvme", offload_optimizer="nvme")),
        ("adagrad", dict(zero_stage=3, offload_optimizer="nvme")),
    ],
    ids=["stage3", "stage3-nvme", "adagrad-nvme"],
)
def test_the_same_model_given_to_a_second_trainer(tmp_path, optim, zero):
    """The second trainer trains the first one's model on, as the plain Trainer does: a new
    optimizer whose state starts at zero (the NVMe moments of the first are reset, a generic
    optimizer's swap file is replaced), and the first one's optimizer refuses to step."""
    reference, ref_weight = _plain_twice(tmp_path, optim)
    if "nvme" in zero.values():
        (tmp_path / "swap").mkdir()
        zero = {**zero, "nvme_path": str(tmp_path / "swap")}
    first = None
    m = model()
    for i, lr in enumerate((2e-3, 1e-3)):
        args = ZeroTrainingArguments(
            output_dir=str(tmp_path / f"zero{i}"),
            **{**SHORT, "learning_rate": lr},
            optim=optim,
            **zero,
        )
        trainer = ZeroTrainer(model=m, args=args, train_dataset=dataset())
        trainer.train()
        torch.testing.assert_close(logged(trainer), reference[i], rtol=RTOL, atol=0)
        first = first or trainer
        m = trainer.model  # the sharded model, as tests of the plain Trainer pass it on
    assert trainer.engine is first.engine
    # At world size 1 a parameter read outside forward gives its value (stage 3 included).
    torch.testing.assert_close(m.transformer.h[0].mlp.c_fc.weight, ref_weight, rtol=RTOL, atol=RTOL)
    with pytest.raises(RuntimeError, match="took its shards over"):
        first.optimizer.step()
    swap = tmp_path / "swap"
    if swap.exists():  # one set of swap files: the first optimizer's state file is gone
        assert len([p for p in swap.rglob("gstate.swap")]) == (optim == "adagrad")
    trainer.close()


def test_model_init_builds_a_fresh_sharded_model_for_each_train(tmp_path):
    """As the plain Trainer: model_init is called with the seed set, at construction and at
    each train(); each train() starts from fresh weights, and the engine before is closed."""
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    config = model().config

    def model_init():
        return GPT2LMHeadModel(config)  # random init from the global RNG: the seed matters

    plain = Trainer(
        model_init=model_init,
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **SHORT),
        train_dataset=dataset(),
    )
    plain.train()
    (tmp_path / "swap").mkdir()
    args = ZeroTrainingArguments(
        output_dir=str(tmp_path / "zero"),
        **SHORT,
        zero_stage=3,
        offload_param="nvme",
        nvme_path=str(tmp_path / "swap"),
    )
    zero = ZeroTrainer(model_init=model_init, args=args, train_dataset=dataset())
    engines = [zero.engine]
    for _ in range(2):
        zero.train()
        torch.testing.assert_close(logged(zero)[-3:], logged(plain), rtol=RTOL, atol=0)
        engines.append(zero.engine)
    assert len({id(e) for e in engines}) == 3  # construction, then one per train()
    assert zero.model is zero.engine.module
    # Only the live engine keeps swap files.
    assert len(list((tmp_path / "swap").rglob("param.swap"))) == 1
    zero.close()
    # A model_init returning a config builds through zero-init (never whole), seeded with
    # args.seed: each train() starts from the same weights.
    zero = ZeroTrainer(model_init=lambda: config, args=args, train_dataset=dataset())
    runs = []
    for _ in range(2):
        zero.train()
        runs.append(logged(zero)[-3:])
    assert runs[0] == runs[1] and len(runs[0]) == 3
    zero.close()


def test_optimizer_groups_are_found_by_model_parameter(tmp_path):
    """get_optimizer_group answers in the model's parameters (the optimizer's param_groups
    hold shard segments); the group it returns writes through to the optimizer."""
    from transformers import Trainer, TrainingArguments

    plain = Trainer(
        model=model(),
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **SHORT),
        train_dataset=dataset(),
    )
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "zero"), **SHORT, zero_stage=3)
    zero = ZeroTrainer(model=model(), args=args, train_dataset=dataset())
    for trainer in (plain, zero):
        with pytest.raises(ValueError, match="optimizer is None"):
            trainer.get_optimizer_group()
        trainer.create_optimizer()
    sizes = [sorted(len(g) for g in t.get_optimizer_group()) for t in (plain, zero)]
    assert sizes[0] == sizes[1] and len(sizes[0]) == 2
    # The plain Trainer's lookup compares tensors by value: it answers for the first
    # parameter only (others raise a size mismatch); ZeroTrainer answers for every one.
    first = next(plain.model.parameters())
    assert first in plain.get_optimizer_group(first)["params"]
    decay = {n for n, _ in plain.model.named_parameters()} & set(
        plain.get_decay_parameter_names(plain.model)
    )
    for name, param in zero.model.named_parameters():
        group = zero.get_optimizer_group(param)
        assert param in group["params"] and param in zero.get_optimizer_group(name)["params"]
        assert group["weight_decay"] == (COMMON["weight_decay"] if name in decay else 0.0), name
    group = zero.get_optimizer_group(zero.model.transformer.wte._parameters["weight"])
    group["lr"] = 0.5
    index = [g["weight_decay"] for g in zero.optimizer.param_groups].index(group["weight_decay"])
    assert zero.optimizer.param_groups[index]["lr"] == 0.5
    zero.close()


@pytest.mark.parametrize("gather", [None, False])
def test_checkpoints_hold_the_model_from_pretrained_loads(tmp_path, gather):
    """By default (a small model) each checkpoint-N also holds the consolidated weights:
    from_pretrained on it gives what `zerotune export` makes of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from zerotune.checkpoint.export import export_hf

    args = ZeroTrainingArguments(
        output_dir=str(tmp_path / "out"),
        **{**SHORT, "save_strategy": "steps", "save_steps": 3},
        zero_stage=3,
        gather_weights_on_save=gather,
    )
    trainer = ZeroTrainer(model=model(), args=args, train_dataset=dataset())
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert (checkpoint / "TRAINER_COMPLETE").exists()
    if gather is False:
        assert not (checkpoint / "model.safetensors").exists()
        return
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    export_hf(checkpoint / "zero", tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    live = trainer.engine.full_state_dict()
    assert set(loaded) == set(exported)
    for name, value in exported.items():
        assert torch.equal(loaded[name], value), name
        if name in live:
            assert torch.equal(value, live[name]), name
    trainer.close()


class OutOfMemoryAbove:
    """Runs out of memory (the CPU allocator's error, which ``--auto_find_batch_size``
    retries) from the ``at``-th pass whose batch has more than ``limit`` rows on: in the forward
    of ``block``, or in backward as the gradient reaches its output."""

    def __init__(self, block, limit: int, at: int, where: str) -> None:
        self.limit, self.at, self.where = limit, at, where
        self.seen = 0
        self.raised: list[int] = []  # the batch sizes that ran out
        block.register_forward_hook(self._forward)

    def _forward(self, module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        rows = hidden.shape[0]
        if rows <= self.limit or not torch.is_grad_enabled():
            return None
        self.seen += 1
        if self.seen < self.at:
            return None
        if self.where == "forward":
            self._raise(rows)
        hidden.register_hook(lambda grad: self._raise(rows))
        return None

    def _raise(self, rows: int):
        self.raised.append(rows)
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."
        )


AUTO = {**COMMON, "per_device_train_batch_size": 8, "auto_find_batch_size": True}
AUTO_CASES = {
    # the first forward runs out: batch 8, then 7 (also over the limit), then 6
    "stage3-forward": (dict(zero_stage=3), dict(at=1, where="forward"), {}),
    # the third step's overlapped (clipped) backward, its second micro-batch, runs out after
    # two steps were made; the loop starts over from there with batch 7
    "nvme-backward": (
        dict(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"),
        dict(at=6, where="backward"),
        {},
    ),
    # without clipping too: the updates wait for the whole backward
    "nvme-backward-unclipped": (
        dict(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"),
        dict(at=6, where="backward"),
        dict(max_grad_norm=0.0),
    ),
}
_plain_auto: dict[str, tuple] = {}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_find_batch_size_retries_as_the_plain_trainer_does(tmp_path, case):
    """``--auto_find_batch_size``: the Trainer catches the out-of-memory error, multiplies
    the batch by 0.9 and runs its loop again on the weights it has; ZeroTrainer's engine and
    optimizer give the failed pass up and go on, logging the plain Trainer's losses and
    gradient norms and ending at its weights."""
    from transformers import Trainer, TrainingArguments

    zero_args, failure, extra = AUTO_CASES[case]
    key = repr((failure, extra))
    if key not in _plain_auto:
        m = model()
        oom = OutOfMemoryAbove(m.transformer.h[0], limit=7 if failure["at"] > 1 else 6, **failure)
        args = TrainingArguments(output_dir=str(tmp_path / "plain"), **{**AUTO, **extra})
        plain = Trainer(model=m, args=args, train_dataset=dataset())
        plain.train()
        weights = {n: p.detach().clone() for n, p in m.named_parameters()}
        _plain_auto[key] = (logged(plain), logged(plain, "grad_norm"), weights, oom.raised, plain)
    losses, norms, weights, raised, plain = _plain_auto[key]
    assert raised == ([8, 7] if failure["at"] == 1 else [8])
    if "nvme" in zero_args.values():
        (tmp_path / "swap").mkdir()
        zero_args = {**zero_args, "nvme_path": str(tmp_path / "swap")}
    m = model()
    oom = OutOfMemoryAbove(m.transformer.h[0], limit=7 if failure["at"] > 1 else 6, **failure)
    args = ZeroTrainingArguments(
        output_dir=str(tmp_path / "zero"), **{**AUTO, **extra}, **zero_args
    )
    zero = ZeroTrainer(model=m, args=args, train_dataset=dataset())
    checked = []  # the batch shape each memory check read
    check = zero.check_memory_estimate

    def spied():
        checked.append(zero._batch_shape)
        return check()

    zero.check_memory_estimate = spied
    zero.train()
    assert oom.raised == raised
    assert zero.state.train_batch_size == plain.state.train_batch_size == 8 - len(raised)
    # The memory check runs after the first step of each run of the loop that made one.
    assert checked == ([(6, 16)] if failure["at"] == 1 else [(8, 16), (7, 16)]), checked
    if "nvme" in zero_args.values():
        assert zero.overlap_step  # the failure came inside the overlapped backward
    torch.testing.assert_close(logged(zero), losses, rtol=RTOL, atol=0)
    torch.testing.assert_close(logged(zero, "grad_norm"), norms, rtol=RTOL, atol=0)
    live = zero.engine.full_state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(live[name], value, rtol=RTOL, atol=2e-5, msg=name)
    zero.close()


def _debug_run(tmp_path, zero: bool, poisoned: bool, capsys) -> tuple[list[float], str, str]:
    """A run with ``--debug underflow_overflow``: its logged losses, the error it stopped with
    and the frames it printed (each module's weights, inputs and outputs, abs min and max)."""
    from transformers import Trainer, TrainingArguments

    m = model()
    if poisoned:
        with torch.no_grad():
            m.transformer.h[1].mlp.c_fc.weight[0, 0] = float("inf")
    options = {**SHORT, "debug": "underflow_overflow", "disable_tqdm": True}
    if zero:
        args = ZeroTrainingArguments(output_dir=str(tmp_path / "z"), **options, zero_stage=3)
        trainer = ZeroTrainer(model=m, args=args, train_dataset=dataset())
    else:
        args = TrainingArguments(output_dir=str(tmp_path / "p"), **options)
        trainer = Trainer(model=m, args=args, train_dataset=dataset())
    capsys.readouterr()
    error = ""
    try:
        trainer.train()
    except ValueError as exc:
        error = str(exc)
    frames = "\n".join(
        line for line in capsys.readouterr().out.splitlines() if not line.startswith("{")
    )
    assert args.debug == ["underflow_overflow"]  # restored after train()
    return logged(trainer), error, frames


def test_debug_underflow_overflow_reads_the_gathered_weights_as_the_plain_trainer(tmp_path, capsys):
    """``--debug underflow_overflow`` at stage 3: its hooks run before the engine releases a
    unit's parameters, so the frames it prints on an inf weight are the plain Trainer's, byte
    for byte, and a clean run trains as the plain one."""
    plain = _debug_run(tmp_path, zero=False, poisoned=True, capsys=capsys)
    zero = _debug_run(tmp_path, zero=True, poisoned=True, capsys=capsys)
    assert "inf/nan detected" in plain[1] and zero[1] == plain[1]
    assert "transformer.h.1.mlp.c_fc" in plain[2] and zero[2] == plain[2]
    clean_plain = _debug_run(tmp_path, zero=False, poisoned=False, capsys=capsys)
    clean_zero = _debug_run(tmp_path, zero=True, poisoned=False, capsys=capsys)
    assert clean_zero[1] == clean_plain[1] == ""
    torch.testing.assert_close(clean_zero[0], clean_plain[0], rtol=RTOL, atol=0)
