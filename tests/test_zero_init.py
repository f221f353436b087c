"""Zero-init: the model's own init, per-unit seeds, never whole in one process."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from conftest import run_together, run_world, tiny_gpt2, tiny_llama_config

import zerotune


def build_zero(rank, world, seed):
    import zerotune

    config = tiny_gpt2(layers=3).config
    engine = zerotune.zero_init(config, {"stage": 3}, seed=seed)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(7))
    loss = float(engine(input_ids=ids, labels=ids).loss)
    return {"weights": engine.full_state_dict(), "loss": loss}


@pytest.fixture(scope="module")
def per_world():
    return {world: run_world(world, build_zero, 0)[0] for world in (1, 2, 3)}


def test_same_seed_same_model_at_every_world_size(per_world):
    one = per_world[1]["weights"]
    for world in (2, 3):
        other = per_world[world]["weights"]
        assert sorted(other) == sorted(one)
        for name in one:
            np.testing.assert_array_equal(other[name], one[name], err_msg=f"world {world}: {name}")


def test_init_matches_plain_from_config_statistics(per_world):
    # A plain from_config model of the same config: per-tensor mean and std agree within
    # sampling error; constant tensors (norm weights, biases) agree exactly.
    plain = {n: p.detach().numpy() for n, p in tiny_gpt2(layers=3).named_parameters()}
    zero = per_world[1]["weights"]
    for name, ref in plain.items():
        got = zero[name]
        assert got.shape == ref.shape, name
        if ref.std() == 0:
            np.testing.assert_array_equal(got, ref, err_msg=name)
            continue
        n = ref.size
        assert abs(got.mean() - ref.mean()) < 5 * ref.std() / math.sqrt(n), name
        assert abs(got.std() / ref.std() - 1) < 5 / math.sqrt(2 * n), name
    # GPT-2's scaled init of residual projections was applied (std 0.02 / sqrt(2 * layers)).
    c_proj = zero["transformer.h.0.attn.c_proj.weight"]
    assert abs(c_proj.std() - 0.02 / math.sqrt(6)) < 0.0015


def test_first_loss_matches_plain_from_config(per_world):
    model = tiny_gpt2(layers=3)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(7))
    plain_loss = float(model(input_ids=ids, labels=ids).loss)
    # Random init, same distribution: both near ln(96) = 4.56, within sampling error
    # (the DeepSpeed-without-HF-init failure mode gives hundreds).
    assert abs(per_world[1]["loss"] - plain_loss) < 0.05
    assert abs(plain_loss - math.log(96)) < 0.1


def test_llama_rotary_buffers_are_initialized():
    from transformers import AutoModelForCausalLM

    import zerotune

    cfg = tiny_llama_config("llama")
    engine = zerotune.zero_init(cfg, {"stage": 3})
    plain = AutoModelForCausalLM.from_config(cfg)
    torch.testing.assert_close(
        engine.module.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    assert abs(float(engine(input_ids=ids, labels=ids).loss) - math.log(96)) < 0.1


def test_a_built_model_is_refused():
    import zerotune

    with pytest.raises(ValueError, match="zerotune.shard"):
        zerotune.zero_init(tiny_gpt2())


MEMORY_SCRIPT = r"""
import json, os, resource, sys
import psutil, torch, zerotune
from transformers import AutoModelForCausalLM, GPT2Config
import torch.distributed as dist
mode = sys.argv[1]
cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=1024, n_positions=128)
if mode == "zero":
    dist.init_process_group("gloo")
# Import what building a GPT-2 imports before the baseline is taken.
AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8))
base = psutil.Process().memory_info().rss
if mode == "zero":
    engine = zerotune.zero_init(cfg, {"stage": 3})
    shards = sum(u.shard_numel for u in engine.units) * 4
    largest = max(u.gathered_bytes for u in engine.units)
else:
    model = AutoModelForCausalLM.from_config(cfg)
    shards = largest = 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if mode == "zero":
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        sys.exit(0)
print(json.dumps({"base": base, "peak": peak, "shards": shards, "largest": largest}))
"""


def test_zero_init_peak_memory_stays_within_shards_plus_one_unit(tmp_path):
    import json

    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT)
    zero = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(script), "zero"]  # fmt: skip
    # Both at once: each measures its own processes' memory.
    runs = run_together(zero, [sys.executable, str(script), "plain"])
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
    zero, plain = (json.loads(out.stdout.strip().splitlines()[-1]) for out in runs)
    mb = 2**20
    grew = zero["peak"] - zero["base"]
    # The bound of the issue, counted from the process's RSS after imports: this rank's
    # shards (fp32), one whole unit being initialized, and 300 MB of overhead.
    assert grew < zero["shards"] + zero["largest"] + 300 * mb, (grew / mb, zero)
    # And far below a plain from_config of the same model.
    plain_grew = plain["peak"] - plain["base"]
    # At world size 2: about half the parameters plus one unit.
    assert grew < 0.75 * plain_grew, (grew / mb, plain_grew / mb)


def tiny_llava():
    """A CLIP vision tower (its own _init_weights fills its position_ids buffer) under a
    Llama; 16 image tokens of a 16x16 picture."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4, projection_dim=32,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=10, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )  # fmt: skip
    return lambda: LlavaForConditionalGeneration(config)


def test_a_composite_model_inits_each_tower_with_its_own_init():
    """transformers dispatches a nested model's own _init_weights (CLIP's fills its
    position_ids buffer); zero-init does the same, and the model runs on an image."""
    engine = zerotune.zero_init(tiny_llava(), {"stage": 3})
    buffers = dict(engine.module.named_buffers())
    ids = next(b for n, b in buffers.items() if "vision" in n and n.endswith("position_ids"))
    assert ids.tolist() == [list(range(17))]  # 16 patches and the class token
    tokens = torch.randint(11, 128, (1, 24))
    tokens[0, 1:17] = 10
    out = engine.module(input_ids=tokens, pixel_values=torch.randn(1, 3, 16, 16), labels=tokens)
    assert math.isfinite(float(out.loss)) and out.logits.shape == (1, 24, 128)
    engine.close()


def whisper_positions(rank, world):
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.models.whisper.modeling_whisper import sinusoids

    config = WhisperConfig(
        vocab_size=128, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    engine = zerotune.zero_init(lambda: WhisperForConditionalGeneration(config), {"stage": 3})
    with engine.gathered():
        table = engine.module.model.encoder.embed_positions.weight.detach().clone()
    engine.close()
    return float((table - sinusoids(*table.shape)).abs().max()), list(table.shape)


@pytest.mark.parametrize("world", [1, 2])
def test_a_parent_init_fills_a_frozen_table_another_unit_owns(world):
    """Whisper's encoder init writes sinusoids into its position table, an embedding of its
    own unit (built first, frozen): the enclosing init wins, as in transformers."""
    for error, shape in run_world(world, whisper_positions):
        assert shape == [16, 32] and error == 0.0


def test_the_build_reports_each_unit_it_places(tmp_path):
    """report_units hears of every unit once it is on its tiers, in order, with the count
    (zerotune finetune's progress bar); nothing outside the context."""
    from transformers import GPT2Config

    from zerotune.sharding.hooks import report_units

    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    heard = []
    nvme = {"offload_param": "nvme", "nvme_path": str(tmp_path)}
    with report_units(lambda done, total: heard.append((done, total))):
        engine = zerotune.zero_init(config, {"stage": 3, **nvme})
    units = len(engine.units)
    assert units > 3 and heard == [(i, units) for i in range(1, units + 1)]
    engine.close()
    zerotune.zero_init(config, {"stage": 3}).close()
    assert len(heard) == units
