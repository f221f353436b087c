"""Streaming from_pretrained: each rank reads its own ranges; the weights are bit-exact."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from conftest import run_world, tiny_gpt2, tiny_llama_config


def _llama_like(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(tiny_llama_config(kind))


def _save(kind: str, folder, shard_size=None):
    model = tiny_gpt2(seed=3) if kind == "gpt2" else _llama_like(kind)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "gpt2": str(_save("gpt2", root / "gpt2")),
        "gpt2_sharded": str(_save("gpt2", root / "gpt2_sharded", shard_size="20KB")),
        "llama": str(_save("llama", root / "llama")),
        "qwen2": str(_save("qwen2", root / "qwen2")),
        "gemma2": str(_save("gemma2", root / "gemma2")),  # its init indexes the padding row
    }


def load_and_check(rank, world, folders):
    import zerotune
    from zerotune.init.pretrained import SafetensorsCheckpoint

    reads = []
    real_read = SafetensorsCheckpoint.read

    def counting_read(self, key, start, stop, out):
        reads.append(stop - start)
        return real_read(self, key, start, stop, out)

    SafetensorsCheckpoint.read = counting_read
    out = {}
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, folder in folders.items():
        reads.clear()
        engine = zerotune.from_pretrained(folder, {"stage": 3})
        loss = float(engine(input_ids=ids, labels=ids).loss)
        out[name] = {
            "weights": engine.full_state_dict(),
            "loss": loss,
            "elements_read": sum(reads),
            "total": sum(u.numel for u in engine.units),
        }
    SafetensorsCheckpoint.read = real_read
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loaded_weights_are_bit_exact_and_losses_equal(folders, world):
    from transformers import AutoModelForCausalLM

    results = run_world(world, load_and_check, folders)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, folder in folders.items():
        plain = AutoModelForCausalLM.from_pretrained(folder)
        expected = {n: p.detach().numpy() for n, p in plain.named_parameters()}
        got = results[0][name]
        assert sorted(got["weights"]) == sorted(expected), name
        for n, w in expected.items():
            np.testing.assert_array_equal(got["weights"][n], w, err_msg=f"{name}: {n}")
        assert got["loss"] == float(plain(input_ids=ids, labels=ids).loss), name
        # Each rank read only its own slice: together the ranks read every element once.
        assert sum(r[name]["elements_read"] for r in results) == got["total"], name
        for r in results:
            assert r[name]["elements_read"] <= got["total"] // world + world * 8


def test_checkpoint_without_base_model_prefix_loads(folders, tmp_path):
    # Old GPT-2 checkpoints name tensors "h.0.attn..." instead of "transformer.h.0.attn...".
    from safetensors.torch import load_file, save_file

    import zerotune

    src = load_file(f"{folders['gpt2']}/model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in src.items()}
    (tmp_path / "config.json").write_text(open(f"{folders['gpt2']}/config.json").read())
    save_file(renamed, tmp_path / "model.safetensors")
    engine = zerotune.from_pretrained(tmp_path, {"stage": 3})
    got = engine.full_state_dict()
    for k, v in src.items():
        assert torch.equal(got[k], v), k


def test_a_config_file_instead_of_a_folder_is_explained(folders):
    import zerotune
    from zerotune.init.pretrained import ModelLoadError

    with pytest.raises(ModelLoadError, match="is a file; give the model folder") as info:
        zerotune.from_pretrained(f"{folders['gpt2']}/config.json")
    assert "--init random" in str(info.value) and "zerotune.zero_init" in str(info.value)
    with pytest.raises(ModelLoadError, match="is a file") as info:
        zerotune.from_pretrained(f"{folders['gpt2']}/model.safetensors")
    assert "--init random" not in str(info.value)


def test_hidden_parameters_come_back_as_they_were():
    # A tied weight listed twice is hidden and restored once; the HF "initialized" mark
    # is only there while hidden.
    from zerotune.init.construct import hidden

    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))
    q._is_hf_initialized = False
    with hidden([p, q, p], torch.device("cpu")):
        assert p.numel() == 0 and p._is_hf_initialized and q._is_hf_initialized
    assert torch.equal(p.data, torch.ones(3)) and not hasattr(p, "_is_hf_initialized")
    assert torch.equal(q.data, torch.ones(2)) and q._is_hf_initialized is False


def test_missing_model_id_offline_gives_one_clear_error(monkeypatch):
    import zerotune
    from zerotune.init.pretrained import ModelLoadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not a local folder") as info:
        zerotune.from_pretrained("no-such-org/no-such-model")
    assert "local folder with config.json" in str(info.value)
    assert "\n" not in str(info.value)


def test_truncated_file_is_named(folders, tmp_path):
    import zerotune
    from zerotune.init.pretrained import ModelLoadError

    data = open(f"{folders['gpt2']}/model.safetensors", "rb").read()
    (tmp_path / "config.json").write_text(open(f"{folders['gpt2']}/config.json").read())
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated"):
        zerotune.from_pretrained(tmp_path, {"stage": 3})


def test_wrong_shapes_and_missing_tensors_are_explained(folders, tmp_path):
    import zerotune
    from zerotune.init.pretrained import ModelLoadError

    cfg = json.loads(open(f"{folders['gpt2']}/config.json").read())
    cfg["n_embd"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(
        open(f"{folders['gpt2']}/model.safetensors", "rb").read()
    )
    with pytest.raises(ModelLoadError, match="has shape"):
        zerotune.from_pretrained(tmp_path, {"stage": 3})
    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 4
    )
    with pytest.raises(ModelLoadError, match="lacks"):
        zerotune.from_pretrained(tmp_path, {"stage": 3})


def test_a_checkpoint_transformers_converts_on_load_is_explained(tmp_path):
    """transformers 5 saves a Mixtral with one tensor per expert and merges them while
    loading; the streaming load reads the model's own layout only, and says so."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import zerotune
    from zerotune.init.pretrained import ModelLoadError

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="layout transformers converts while loading"):
        zerotune.from_pretrained(tmp_path, {"stage": 3})


def test_a_folder_is_built_as_the_class_its_config_names(tmp_path):
    """An encoder-decoder (T5) has no causal-LM class: the streaming load builds the class
    named in its config's ``architectures``, with the saved weights' logits."""
    from transformers import T5Config, T5ForConditionalGeneration

    import zerotune

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    engine = zerotune.from_pretrained(tmp_path, {"stage": 3})
    assert type(engine.module) is T5ForConditionalGeneration
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).logits
        got = engine.module.eval()(input_ids=ids, labels=ids).logits
    assert torch.equal(got, expected)
    engine.close()
