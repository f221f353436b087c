"""Which model and tokenizer a job trains (zerotune.hf.models): a local folder built from a
tiny config, a preset from random weights, and the refusals, in one line each, before
anything is loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from zerotune.hf.data import byte_tokenizer
from zerotune.hf.job import JobError
from zerotune.hf.models import (
    context_length,
    looks_like_a_path,
    meta_model,
    resolve_model,
    resolve_tokenizer,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny GPT-2 saved as transformers does (safetensors), with its byte tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=259, n_positions=48)
    GPT2LMHeadModel(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_a_local_folder_with_its_tokenizer(folder):
    name, init, source, config = resolve_model(str(folder), "pretrained")
    assert (name, init, source) == (str(folder), "pretrained", folder)
    assert (config.model_type, config.n_layer, config.n_embd) == ("gpt2", 1, 16)
    assert context_length(config) == 48
    tok, kind = resolve_tokenizer(None, str(folder), source, config)
    assert kind == f"tokenizer of {folder}" and len(tok) == 259
    assert tok("ab").input_ids == [97, 98]  # bytes as ids
    # --init random from the same folder: its config, and its tokenizer still.
    name, init, source, config = resolve_model(str(folder), "random")
    assert init == "random" and source is config and config.n_positions == 48
    assert resolve_tokenizer(None, str(folder), source, config)[1] == f"tokenizer of {folder}"


def test_a_preset_from_random_weights_with_the_byte_tokenizer():
    name, init, source, config = resolve_model("tiny-gpt2", "random")
    assert (name, init) == ("tiny-gpt2", "random") and source is config
    assert (config.n_layer, config.n_embd, config.vocab_size) == (2, 64, 259)
    assert context_length(config) == 128
    tok, kind = resolve_tokenizer(None, None, source, config)
    assert kind == "byte-level tokenizer (no tokenizer given)" and tok.eos_token_id == 256


def test_refusals_name_what_to_do(folder, tmp_path):
    from transformers import GPT2Config, T5Config

    empty = tmp_path / "no-weights"
    empty.mkdir()
    GPT2Config(n_layer=1).save_pretrained(empty)
    t5 = tmp_path / "t5.json"
    T5Config(d_model=8, num_layers=1).to_json_file(t5)
    refused = {
        "./no/such/model": ("pretrained", "--model ./no/such/model: no such file or folder"),
        str(empty): ("pretrained", f"{empty} has no *.safetensors weights (zerotune loads only "
                                   "safetensors; add --init random"),
        str(t5): ("random", "no causal language model class for 't5' models"),
        "tiny-gpt2": ("pretrained", "'tiny-gpt2' is also a zerotune preset: add --init random"),
    }  # fmt: skip
    for name, (init, message) in refused.items():
        with pytest.raises(JobError, match=re.escape(message)):
            resolve_model(name, init)
    small = GPT2Config(n_layer=1, vocab_size=100)
    with pytest.raises(JobError, match="has 259 tokens but the model's vocabulary is 100"):
        resolve_tokenizer(None, str(folder), folder, small)
    with pytest.raises(JobError, match=re.escape("--tokenizer ./nope: no such folder")):
        resolve_tokenizer("./nope", None, folder, small)
    with pytest.raises(JobError, match="cannot load tokenizer 'zt-test/absent'"):
        resolve_tokenizer("zt-test/absent", None, folder, small)  # not in the cache, offline


def test_names_that_are_paths_and_context_lengths():
    assert all(map(looks_like_a_path, ["/m", "./m", "../m", "~/m", "config.json"]))
    assert not any(map(looks_like_a_path, ["gpt2", "org/model", "tiny-gpt2"]))
    from transformers import LlamaConfig

    assert context_length(LlamaConfig(max_position_embeddings=4096)) == 4096
    assert context_length(object()) == 1024 and context_length(object(), default=None) is None


def test_meta_model_builds_the_preset_without_storage():
    from transformers import AutoModelForCausalLM

    module, name = meta_model("tiny-gpt2")
    assert name == "tiny-gpt2"
    params = list(module.parameters())
    assert params and all(p.is_meta for p in params)
    real = AutoModelForCausalLM.from_config(module.config)
    assert sum(p.numel() for p in params) == sum(p.numel() for p in real.parameters())
    assert meta_model(real) == (real, type(real).__name__)  # a module as it is
