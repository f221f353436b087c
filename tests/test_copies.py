"""Pickling and deep-copying a sharded model ([Note: copies of a sharded model]): refused
with one line, or (copy_sharded) a second sharded model with the same weights."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from conftest import run_world, tiny_gpt2

import zerotune
from zerotune.sharding.copies import COPIED, CopyOf

IDS = torch.tensor([[5, 17, 33, 2]])


def nvme_config(root, rank: int, **extra) -> dict:
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": path,
            **extra}  # fmt: skip


def test_a_sharded_model_is_not_pickled_and_its_deep_copy_refuses_to_run(tmp_path):
    engine = zerotune.shard(tiny_gpt2(seed=1), nvme_config(str(tmp_path), 0))
    from datasets.fingerprint import Hasher  # dill, as datasets pickles a transform

    with pytest.raises(TypeError, match="Unit of a model sharded by zerotune cannot be pickled"):
        Hasher.hash(engine.module)
    with pytest.raises(TypeError, match="ZeroEngine of a model sharded by zerotune"):
        pickle.dumps(engine)
    copied = copy.deepcopy(engine.module)
    assert isinstance(copied._zerotune_engine, CopyOf)
    assert copied._zerotune_engine.source is engine
    with pytest.raises(AttributeError, match="is a copy"):
        copied._zerotune_engine.units  # noqa: B018
    with pytest.raises(RuntimeError, match="is a copy"):
        copied(IDS)
    assert engine.module(IDS).logits.shape == (1, 4, 96)  # the original is untouched
    assert COPIED.startswith("this module is a copy")
    engine.close()


def copy_per_rank(rank, world, root, frozen):
    """copy_sharded of an engine whose weights moved (one AdamW step): the copy's weights
    equal the source's, at its own tier, with or without a master."""
    torch.manual_seed(0)
    source = zerotune.shard(tiny_gpt2(seed=2), nvme_config(root, rank, dtype="fp32"))
    optimizer = zerotune.ZeroAdamW(source, lr=1e-2)
    source(IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    copied = zerotune.copy_sharded(source, frozen=frozen)
    with torch.no_grad():
        expected, got = source.module(IDS).logits, copied.module(IDS).logits
    errors = {}
    for unit, twin in zip(source.units, copied.units):
        a, b = source.unit_state(unit)["master"], copied.unit_state(twin)["master"]
        errors[unit.name] = float((a - b).abs().max()) if a.numel() else 0.0
    trainable = sum(p.requires_grad for p in copied.module.parameters())
    master = copied.memory_report()["master"]
    copied.close()
    source.close()
    return errors, float((expected - got).abs().max()), trainable, master


@pytest.mark.parametrize("world,frozen", [(1, True), (2, True), (2, False)])
def test_copy_sharded_gives_the_same_weights_in_shards_of_its_own(tmp_path, world, frozen):
    for errors, logits, trainable, master in run_world(world, copy_per_rank, str(tmp_path), frozen):
        assert max(errors.values()) == 0.0, errors
        assert logits == 0.0
        if frozen:
            assert trainable == 0 and master == 0
        else:
            assert trainable == len(list(tiny_gpt2().parameters()))


def test_copy_sharded_refuses_what_it_cannot_rebuild(tmp_path):
    source = zerotune.shard(tiny_gpt2(seed=2), {"stage": 3})
    with pytest.raises(ValueError, match="is not sharded like the source's"):
        zerotune.copy_sharded(source, {"stage": 3, "tile_linear_bytes": 1024})
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    plain = zerotune.shard(mlp, {"stage": 3})
    with pytest.raises(TypeError, match="rebuilds transformers models"):
        zerotune.copy_sharded(plain)
    source.close()
    plain.close()


def test_resize_token_embeddings_to_the_rows_it_has_changes_nothing(tmp_path):
    """A resize that keeps the row count does what transformers does then (the embedding
    returned, vocab_size set); one after the optimizer exists is refused before anything
    changes; a deep copy's refuses as the copy does."""
    plain = tiny_gpt2(seed=1)
    engine = zerotune.shard(tiny_gpt2(seed=1), {"stage": 3})
    model, units = engine.module, engine.units
    with torch.no_grad():
        before = model(IDS).logits.clone()
    embeddings = model.get_input_embeddings()
    for args in [(), (96,), (90, 32), (None, 48)]:
        assert model.resize_token_embeddings(*args) is embeddings
        assert plain.resize_token_embeddings(*args) is plain.get_input_embeddings()
    assert model.vocab_size == plain.vocab_size == model.config.vocab_size == 96
    assert engine.units is units  # not sharded again
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an integer"):
        model.resize_token_embeddings(96, 8.0)
    zerotune.ZeroAdamW(engine, lr=1e-3)
    with pytest.raises(RuntimeError, match="its optimizer exists already; resize before"):
        model.resize_token_embeddings(97)
    assert model.config.vocab_size == 96 and engine.units is units
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before)
    copied = copy.deepcopy(model)  # a deep copy's refers to the engine it came from
    with pytest.raises(AttributeError, match="is a copy"):
        copied.resize_token_embeddings(97)
    engine.close()


def resize_per_rank(rank, world, root, tie, zero, size):
    """transformers' resize of the plain model and zerotune's of the sharded one, from the
    same random state; then three AdamW steps of each."""
    plain = tiny_gpt2(seed=1, tie=tie)
    config = nvme_config(root, rank, dtype="fp32") if zero == "nvme" else {"stage": zero}
    engine = zerotune.shard(tiny_gpt2(seed=1, tie=tie), config)
    model = engine.module
    torch.manual_seed(5)
    plain.resize_token_embeddings(*size)
    torch.manual_seed(5)
    returned = model.resize_token_embeddings(*size)
    assert returned is model.get_input_embeddings() and model._zerotune_engine is engine
    ids = torch.tensor([[5, 17, model.vocab_size - 1, 60, 2, 66]])  # the last row too
    got, expected = engine.full_state_dict(), plain.state_dict()
    weights = max(float((got[k] - expected[k]).abs().max()) for k in got)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    opt = zerotune.ZeroAdamW(engine, lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(3):
        pair = []
        for runner, optimizer in ((plain, plain_opt), (engine, opt)):
            loss = runner(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pair.append(float(loss.detach()))
        losses.append(pair)
    final = engine.full_state_dict()
    trained = max(
        float((final[k] - v).abs().max()) for k, v in plain.state_dict().items() if k in final
    )
    shapes = (
        model.config.vocab_size,
        model.vocab_size,
        tuple(final["transformer.wte.weight"].shape),
    )
    engine.close()
    return weights, losses, trained, shapes, set(expected) - set(got)


@pytest.mark.parametrize(
    "world,tie,zero,size,rows",
    [
        (1, True, 3, (110, 8), 112),
        (1, False, 2, (110, 8), 112),
        (2, True, "nvme", (110, 8), 112),
        (2, False, 3, (110, 8), 112),
        (1, True, "nvme", (80,), 80),
    ],
)
def test_resize_token_embeddings_of_a_sharded_model_is_transformers_resize(
    tmp_path, world, tie, zero, size, rows
):
    """[Note: resizing a sharded model's embeddings]: the same weights as transformers'
    resize of the plain model (its random rows included), then the same training."""
    for weights, losses, trained, shapes, missing in run_world(
        world, resize_per_rank, str(tmp_path), tie, zero, size
    ):
        assert weights == 0.0 and missing == ({"lm_head.weight"} if tie else set())  # tied
        assert shapes == (rows, rows, (rows, 32))
        for plain, sharded in losses:
            assert sharded == pytest.approx(plain, rel=1e-5), losses
        assert trained < 1e-5, trained


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64))  # fmt: skip


def _llama_padded():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=64, pad_token_id=88))  # fmt: skip


@pytest.mark.parametrize(
    "build,size",
    [
        (_bert, (100,)),  # a tied head with its own bias: padded with zeros, as tie_weights
        (_bert, (80,)),
        (_llama_padded, (80,)),  # the padding row 88 goes with the rows past 80
        (_llama_padded, (97, 8)),
    ],
)
def test_resize_keeps_a_tied_heads_bias_and_the_padding_row_as_transformers(build, size):
    torch.manual_seed(1)
    plain = build()
    torch.manual_seed(1)
    engine = zerotune.shard(build(), {"stage": 3})
    torch.manual_seed(5)
    plain.resize_token_embeddings(*size)
    torch.manual_seed(5)
    engine.module.resize_token_embeddings(*size)
    got, expected = engine.full_state_dict(), plain.state_dict()
    assert max(float((got[k] - expected[k]).abs().max()) for k in got) == 0.0
    pad = plain.get_input_embeddings().padding_idx
    assert engine.module.get_input_embeddings().padding_idx == pad
    ids = torch.tensor([[1, 2, plain.config.vocab_size - 1, 3]])
    plain.eval(), engine.module.eval()  # BERT's dropout
    with torch.no_grad():
        assert torch.equal(engine.module(input_ids=ids).logits, plain(input_ids=ids).logits)
    engine.close()


def test_a_model_with_its_own_resize_is_refused_before_anything_changes():
    """BART resizes its final_logits_bias buffer in its own resize_token_embeddings."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=90, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=32)  # fmt: skip
    engine = zerotune.shard(BartForConditionalGeneration(config), {"stage": 3})
    units = engine.units
    assert engine.module.resize_token_embeddings(90) is engine.module.get_input_embeddings()
    with pytest.raises(RuntimeError, match="BartForConditionalGeneration has its own resize_token"):
        engine.module.resize_token_embeddings(100)
    assert engine.units is units and engine.module.config.vocab_size == 90
    engine.close()
