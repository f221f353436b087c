"""``engine.compile()`` and ``--torch_compile``: each unit's forward compiled, the engine's hooks
eager ([Note: compiled units] in sharding/compiled.py). Training equals plain (eager) AdamW,
and the compiled graphs are what runs."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import run_world, tiny_llama_config
from harness import assert_weights_match, batches, build, loss_of, train_reference, train_zero
from test_failed_passes import nvme
from trainer_cases import COMMON, dataset, logged, model

import zerotune
from zerotune.config import ConfigError
from zerotune.hf import ZeroTrainer, ZeroTrainingArguments

STEPS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo's caches (and its recompilation limit, past
    which it would run a frame eagerly) are per process."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphCalls:
    """A backend that counts the graphs it compiles and every call of them: a forward that
    dynamo gave up on (past its recompilation limit) runs eagerly and is not counted."""

    def __init__(self, backend: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.backend = lookup_backend(backend)
        self.frames = 0
        self.calls = 0

    def __call__(self, graph, example_inputs):
        self.frames += 1
        run = self.backend(graph, example_inputs)

        def counted(*args):
            self.calls += 1
            return run(*args)

        return counted


BLOCKS = 2  # tiny GPT-2's compiled units (its embeddings and head are torch's own layers)


def compiled_run(rank, world, model_name, config, overlap, backend):
    torch._dynamo.reset()  # rank processes are reused across tests
    counter = GraphCalls(backend)
    out = train_zero(
        rank,
        world,
        model_name,
        config,
        steps=STEPS,
        overlap=overlap,
        compile_kwargs={"backend": counter},
    )
    out["frames"], out["calls"] = counter.frames, counter.calls
    return out


_refs: dict[str, dict] = {}


def reference(model_name: str) -> dict:
    if model_name not in _refs:
        _refs[model_name] = train_reference(model_name, steps=STEPS)
    return _refs[model_name]


CASES = {
    # name: model, config (nvme added with a path), world, overlapped step
    "stage 3": ("gpt2", {"stage": 3}, 1, False),
    "stage 3, world 2": ("gpt2", {"stage": 3}, 2, False),
    "both tiers on nvme, clipped overlapped step": ("gpt2", "nvme", 1, True),
    "checkpointed blocks, their inputs on nvme": (
        "gpt2_ckpt",
        {"stage": 3, "offload_activations": "nvme"},
        1,
        False,
    ),
    "stage 2, world 2": ("gpt2", {"stage": 2}, 2, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_units_train_as_plain_adamw(case, tmp_path):
    model_name, config, world, overlap = CASES[case]
    if config == "nvme":
        config = nvme(tmp_path)
    elif "offload_activations" in config:
        config = {**config, "nvme_path": str(tmp_path)}
    ref = reference(model_name)
    results = run_world(world, compiled_run, model_name, config, overlap, "aot_eager")
    for out in results:
        # Every forward (each step's and the evaluation's) ran each block's graph (a
        # checkpointed block recomputes inside its compiled backward), but for blocks whose
        # checkpoints are offloaded: they train eagerly (see the Note), and evaluate compiled.
        if "offload_activations" in config:
            assert out["calls"] == BLOCKS, out["calls"]
        else:
            assert out["calls"] == BLOCKS * (STEPS + 1), out["calls"]
        assert out["frames"] >= 1
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-5, atol=0)
        assert_weights_match(out["weights"], ref["weights"], rtol=1e-5, atol=2e-5, label=case)
        assert out["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


def test_inductor_compiled_units_train_as_plain_adamw():
    """The default backend: inductor generates C++ for the blocks on a CPU."""
    ref = reference("gpt2")
    out = compiled_run(0, 1, "gpt2", {"stage": 3}, False, "inductor")
    assert out["calls"] == BLOCKS * (STEPS + 1)
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=0)
    assert_weights_match(out["weights"], ref["weights"], rtol=1e-5, atol=2e-5)


def llama_losses(kind: str, compiled: bool) -> tuple[list[float], int]:
    torch._dynamo.reset()
    engine = zerotune.zero_init(tiny_llama_config(kind), {"stage": 3}, seed=0)
    counter = GraphCalls("aot_eager")
    if compiled:
        engine.compile(backend=counter)
    opt = zerotune.ZeroAdamW(engine, lr=1e-2)
    losses = []
    for ids in batches("gpt2", 3):
        loss = engine(input_ids=ids[:4], labels=ids[:4], use_cache=False).loss
        engine.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    engine.close()
    return losses, counter.frames


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_llama_family_blocks_compile_to_the_eager_losses(kind):
    """Rotary embeddings and masks computed by the eager root and handed to compiled decoder
    layers (Qwen2 and Gemma 2 with a tied head): the eager engine's losses, bit for bit."""
    eager, _ = llama_losses(kind, compiled=False)
    compiled, frames = llama_losses(kind, compiled=True)
    # The decoder layer class (embedding and head are torch's layers); Gemma 2 alternates
    # sliding-window and global attention layers: a graph each.
    assert frames == (2 if kind == "gemma2" else 1)
    assert compiled == eager


def test_generating_runs_eager_forwards_and_training_stays_compiled(caplog):
    """Generation hands each block its KV cache: the blocks run eagerly there (see the
    Note), and the training forwards after it run the compiled graphs; a training forward
    given a cache (``use_cache=True``) runs eagerly, with one warning."""
    plain = build("gpt2").eval()
    model = build("gpt2")
    engine = zerotune.shard(model, {"stage": 3})
    counter = GraphCalls("aot_eager")
    engine.compile(backend=counter)
    prompt = batches("gpt2", 1)[0][:2, :6]
    with torch.no_grad():
        model.eval()
        got = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None)
        expected = plain.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None)
        model.train()
    assert torch.equal(got, expected)
    assert counter.calls == 0
    ids = batches("gpt2", 1)[0][:4]
    for step in range(3):
        engine(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert counter.calls == BLOCKS * (step + 1)
    with caplog.at_level("WARNING", logger="zerotune.sharding.compiled"):
        engine(input_ids=ids, labels=ids, use_cache=True).loss.backward()
        engine(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    assert counter.calls == BLOCKS * 3
    warned = [r for r in caplog.records if "use_cache" in r.getMessage()]
    assert len(warned) == 1
    engine.close()


def test_the_blocks_share_their_class_graph_and_the_rest_stays_eager():
    model = build("gpt2")
    model.config.use_cache = False  # as the Trainer sets it: a cache would guard each layer
    engine = zerotune.shard(model, {"stage": 3})
    counter = GraphCalls("aot_eager")
    engine.compile(backend=counter)
    compiled = list(engine.compiled.modules)
    blocks = list(model.transformer.h)
    assert len(compiled) == 2 and all(any(b is c for c in compiled) for b in blocks)
    ids = batches("gpt2", 1)[0][:4]
    loss_of(engine, ids).backward()
    assert counter.frames == 1, counter.frames  # one graph for both blocks
    # Compiling again replaces the compiled forwards instead of wrapping them.
    engine.compile(backend="aot_eager")
    assert len(engine.compiled.modules) == len(compiled)
    engine.remove_hooks()
    assert engine.compiled is None
    assert not any("forward" in m.__dict__ for m in model.modules())
    engine.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "reduce-overhead"}, "records CUDA graphs"),
        ({"mode": "max-autotune"}, "records CUDA graphs"),
        ({"backend": "cudagraphs"}, "records CUDA graphs"),
        ({"mode": "fastest"}, "has no mode 'fastest'"),
        ({"backend": "nope"}, "has no backend 'nope'"),
    ],
)
def test_compile_options_that_cannot_work_are_refused(kwargs, message):
    engine = zerotune.shard(build("gpt2"), {"stage": 3})
    with pytest.raises(ValueError, match=message):
        engine.compile(**kwargs)
    assert engine.compiled is None
    engine.close()
    flags = {f"torch_compile_{k}": v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=f"--torch_compile: .*{message}"):
        ZeroTrainingArguments(output_dir="unused", use_cpu=True, **flags)


def test_torch_compile_logs_the_plain_trainers_losses(tmp_path):
    """``--torch_compile`` in ZeroTrainer against the plain Trainer without it: the same
    losses, gradient norms, evaluation loss and weights."""
    from transformers import Trainer, TrainingArguments

    m = model()
    plain = Trainer(
        model=m,
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON),
        train_dataset=dataset(),
        eval_dataset=dataset(16),
    )
    plain.train()
    plain_eval = plain.evaluate()["eval_loss"]
    args = ZeroTrainingArguments(
        output_dir=str(tmp_path / "zero"),
        **COMMON,
        zero_stage=3,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    zero = ZeroTrainer(model=model(), args=args, train_dataset=dataset(), eval_dataset=dataset(16))
    assert len(zero.engine.compiled.modules) == 2  # the blocks
    zero.train()
    torch.testing.assert_close(logged(zero), logged(plain), rtol=1e-5, atol=0)
    torch.testing.assert_close(
        logged(zero, "grad_norm"), logged(plain, "grad_norm"), rtol=1e-5, atol=0
    )
    assert zero.evaluate()["eval_loss"] == pytest.approx(plain_eval, rel=1e-5)
    live = zero.engine.full_state_dict()
    for name, value in m.named_parameters():
        torch.testing.assert_close(live[name], value.detach(), rtol=1e-5, atol=2e-5, msg=name)
    zero.close()
