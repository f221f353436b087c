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


def test_a_tensor_read_in_pieces_is_the_same(folders, monkeypatch):
    """Ranges are read through a bounded buffer: pieces of 25 elements (not a divisor of
    any row) give the same weights."""
    from transformers import AutoModelForCausalLM

    import zerotune
    from zerotune.init import pretrained

    monkeypatch.setattr(pretrained, "READ_BYTES", 100)
    for name in ("gpt2", "qwen2"):
        engine = zerotune.from_pretrained(folders[name], {"stage": 3})
        got = engine.full_state_dict()
        for n, p in AutoModelForCausalLM.from_pretrained(folders[name]).named_parameters():
            assert torch.equal(torch.as_tensor(got[n]), p.detach()), (name, n)
        engine.close()


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


def _converted_models():
    """Models whose transformers 5 checkpoints are in another layout than the model's own:
    Mixtral (a renamed block, experts one tensor each, merged on load), Qwen3-MoE saved in
    bf16 (two tensors per expert concatenated) and LLaVA (renamed towers)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(5)
    mixtral = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
        )
    )  # fmt: skip
    qwen = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, head_dim=8,
        )
    ).to(torch.bfloat16)  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        image_size=16, patch_size=4,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    llava = LlavaForConditionalGeneration(
        LlavaConfig(vision_config=vision, text_config=text, image_token_index=95)
    )
    return {"mixtral": mixtral, "qwen3_moe": qwen, "llava": llava}


@pytest.fixture(scope="module")
def converted_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    folders = {}
    for name, model in _converted_models().items():
        model.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


def load_converted(rank, world, folders, nvme_dir):
    import zerotune
    from zerotune.init.converted import ConvertedCheckpoint

    built = []
    real_convert = ConvertedCheckpoint._convert

    def counting_convert(self, group, meta, expert=None):
        if not meta:
            built.append((group, expert))
        return real_convert(self, group, meta, expert)

    ConvertedCheckpoint._convert = counting_convert
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    try:
        for name, folder in folders.items():
            built.clear()
            config = {"stage": 3, "offload_param": "nvme", "nvme_path": f"{nvme_dir}/{rank}"}
            engine = zerotune.from_pretrained(folder, config)
            loss = float(engine(input_ids=ids, labels=ids).loss)
            at_load = list(built)
            built.clear()
            # load_weights reads the same sources into an engine that already exists.
            zerotune.load_weights(engine, folder)
            after = float(engine(input_ids=ids, labels=ids).loss)
            out[name] = {
                "weights": engine.full_state_dict(),
                "loss": loss,
                "after": after,
                "built": [at_load, list(built)],
            }
            engine.close()
    finally:
        ConvertedCheckpoint._convert = real_convert
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoints_transformers_converts_on_load_stream_into_shards(
    converted_folders, world, tmp_path
):
    """The per-expert and renamed tensors are read through transformers' own conversion
    table: the shards hold exactly the weights transformers' from_pretrained makes, and the
    losses are equal. Experts stacked into one parameter are built one at a time, each by the
    ranks whose slices cover it, so together the ranks build each expert about once."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    results = run_world(world, load_converted, converted_folders, str(tmp_path))
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for name, folder in converted_folders.items():
        auto = AutoModelForImageTextToText if name == "llava" else AutoModelForCausalLM
        plain = auto.from_pretrained(folder, dtype=torch.float32)
        expected = {n: p.detach().numpy() for n, p in plain.named_parameters()}
        got = results[0][name]
        assert sorted(got["weights"]) == sorted(expected), name
        for n, w in expected.items():
            np.testing.assert_array_equal(got["weights"][n], w, err_msg=f"{name}: {n}")
        loss = float(plain(input_ids=ids, labels=ids).loss)
        assert got["loss"] == loss and got["after"] == loss, name
        merged = [n for n in expected if n.endswith(("gate_up_proj", "down_proj")) and
                  "experts" in n]  # fmt: skip
        assert len(merged) == (0 if name == "llava" else 4), name
        experts = {"mixtral": 3, "qwen3_moe": 4, "llava": 0}[name]
        every = {(g, e) for g in merged for e in range(experts)}
        for load in range(2):  # from_pretrained, then load_weights
            built = [r[name]["built"][load] for r in results]
            for rows in built:
                assert len(rows) == len(set(rows)) and set(rows) <= every, name
            # Every expert of every merged parameter was built, on one rank but where two
            # ranks' slices meet inside an expert's row.
            assert set().union(*built) == every, name
            assert sum(map(len, built)) <= len(every) + (world - 1) * len(merged), name


def _dinov2_swiglu():
    """Dinov2 with a SwiGLU MLP: its checkpoint holds `weights_in`, which transformers splits
    into two Linear weights (Chunk) on load and concatenates back on save."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(6)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2,
        image_size=8, patch_size=4, use_swiglu_ffn=True,
    )  # fmt: skip
    return Dinov2Model(config)


def _qwen3_vl_moe():
    """Qwen3-VL-MoE: transformers saves its experts under their own names, and on load
    transposes a hub checkpoint's (experts, in, out) tensors, asking the model for the
    parameter's shape (Transpose with check_dims)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(7)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_parameters=rope,
        moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
        num_position_embeddings=16, deepstack_visual_indexes=[0],
    )  # fmt: skip
    config = Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=95, video_token_id=94,
        vision_start_token_id=93,
    )  # fmt: skip
    return Qwen3VLMoeForConditionalGeneration(config)


def export_converted(rank, world, folders, out_dir):
    import zerotune
    from zerotune.checkpoint import export_hf
    from zerotune.checkpoint.export import save_hf
    from zerotune.checkpoint.hub_layout import HubLayout
    from zerotune.sharding.tiling import tiled_weights

    rows = []
    real_row = HubLayout.convert_row

    def counting_row(self, group, e, row):
        rows.append(e)
        return real_row(self, group, e, row)

    HubLayout.convert_row = counting_row
    out = {}
    try:
        for name, folder in folders.items():
            # Tiles small enough to tile Dinov2's split Linear weights (sharding/tiling.py).
            config = {"stage": 3, "tile_linear_bytes": 2048}
            engine = zerotune.from_pretrained(folder, config)
            tiled = sorted(tw.name for tw in tiled_weights(engine.module))
            dtype = "bf16" if name == "qwen3_moe" else "fp32"
            rows.clear()
            save_hf(engine, f"{out_dir}/{name}-live", dtype=dtype)
            live_rows = len(rows)
            zerotune.save_checkpoint(engine, f"{out_dir}/{name}-ckpt", step=0)
            rows.clear()
            if rank == 0:
                export_hf(f"{out_dir}/{name}-ckpt", f"{out_dir}/{name}-export", dtype=dtype)
            out[name] = {"tiled": tiled, "rows": (live_rows, len(rows))}
            engine.close()
    finally:
        HubLayout.convert_row = real_row
    return out


def test_exports_write_the_layout_save_pretrained_writes(converted_folders, tmp_path):
    """A model loaded from a converted checkpoint and written again (from the live engine,
    and from a sharded checkpoint) gives back transformers' files tensor for tensor: the
    per-expert tensors, the renamed towers, Dinov2's concatenated tiled weights and
    Qwen3-VL-MoE's experts."""
    from safetensors.torch import load_file

    folders = dict(converted_folders)
    _dinov2_swiglu().save_pretrained(tmp_path / "dinov2")
    folders["dinov2"] = str(tmp_path / "dinov2")
    # Its converter asks the (sharded) model for a parameter's shape while writing.
    _qwen3_vl_moe().save_pretrained(tmp_path / "qwen3_vl_moe")
    folders["qwen3_vl_moe"] = str(tmp_path / "qwen3_vl_moe")
    written = run_world(2, export_converted, folders, str(tmp_path))[0]
    assert "encoder.layer.0.mlp.gate_proj.weight" in written["dinov2"]["tiled"]
    # Stacked experts are written expert by expert (2 layers x 2 parameters x experts), by
    # save_hf from the live engine and by export_hf; other conversions whole.
    expected_rows = {"mixtral": 12, "qwen3_moe": 16}
    for name, result in written.items():
        rows = expected_rows.get(name, 0)
        assert result["rows"] == (rows, rows), name
    for name, folder in folders.items():
        expected = load_file(f"{folder}/model.safetensors")
        for kind in ("live", "export"):
            got = load_file(tmp_path / f"{name}-{kind}" / "model.safetensors")
            assert sorted(got) == sorted(expected), (name, kind)
            for key, tensor in expected.items():
                assert torch.equal(got[key], tensor), (name, kind, key)


def test_a_checkpoint_from_before_manifests_named_the_layout_exports_it(
    converted_folders, tmp_path, monkeypatch
):
    """A checkpoint whose manifest has no ``hub_layout`` (saved before it was recorded) is
    exported in the layout save_pretrained writes too: the export looks at the model."""
    from safetensors.torch import load_file

    import zerotune
    from zerotune.checkpoint import export_hf, save

    real = save._build_manifest

    def without_the_key(*args, **kwargs):
        manifest = real(*args, **kwargs)
        del manifest["hub_layout"]
        return manifest

    monkeypatch.setattr(save, "_build_manifest", without_the_key)
    engine = zerotune.from_pretrained(converted_folders["mixtral"], {"stage": 3})
    folder = zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0)
    engine.close()
    assert "hub_layout" not in json.loads((folder / "manifest.json").read_text())
    export_hf(folder, tmp_path / "out", dtype="fp32")
    expected = load_file(f"{converted_folders['mixtral']}/model.safetensors")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for k, w in expected.items():
        assert torch.equal(got[k], w), k


@pytest.mark.parametrize("world", [1, 2])
def test_a_tensor_stored_in_another_shape_under_its_own_name_is_converted(tmp_path, world):
    """Qwen3-VL-MoE hub checkpoints hold each layer's experts as (experts, in, out) under
    the parameters' own names; transformers transposes them on load, and so does the
    streaming load (from_pretrained and load_weights), on every rank."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    _qwen3_vl_moe().save_pretrained(tmp_path / "saved")
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_bytes((tmp_path / "saved" / "config.json").read_bytes())
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    for k in experts:
        tensors[k] = tensors[k].transpose(1, 2).contiguous()
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    results = run_world(world, load_converted, {"hub": str(hub)}, str(tmp_path))
    plain = Qwen3VLMoeForConditionalGeneration.from_pretrained(hub, dtype=torch.float32)
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = float(plain(input_ids=ids, labels=ids).loss)
    got = results[0]["hub"]
    expected = {n: p.detach().numpy() for n, p in plain.named_parameters()}
    assert sorted(got["weights"]) == sorted(expected)
    for n, w in expected.items():
        np.testing.assert_array_equal(got["weights"][n], w, err_msg=n)
    assert got["loss"] == loss and got["after"] == loss
    for load in range(2):  # from_pretrained, then load_weights: built once per rank at most
        for r in results:
            assert len(set(r["hub"]["built"][load])) == len(r["hub"]["built"][load])
        # A transpose is not stacked expert by expert: each parameter is built whole.
        assert {g for r in results for g in r["hub"]["built"][load]} == {(k, None) for k in experts}


def test_a_split_converter_fills_tiles_and_a_live_engine(tmp_path):
    """A checkpoint with q, k and v fused into one tensor (a Split converter, as Molmo2's):
    loaded into tiled q/k/v, read again by load_weights into the live engine, and written
    back fused by save_hf and export_hf. The converter asks for parameter shapes, which the
    loader answers from the full shapes, never from the tiles or the sharded parameters."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Split, WeightConverter

    import zerotune
    from zerotune.checkpoint import export_hf
    from zerotune.checkpoint.export import save_hf

    fused = WeightConverter(
        "self_attn.qkv_proj",
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        [Split(dim=0)],
    )
    register_checkpoint_conversion_mapping("LlamaForCausalLM", [fused], overwrite=True)
    try:
        _llama_like("llama").save_pretrained(tmp_path / "hf")
        saved = load_file(tmp_path / "hf" / "model.safetensors")
        assert any("qkv_proj" in k for k in saved) and not any("q_proj" in k for k in saved)
        plain = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        expected = {n: p.detach() for n, p in plain.named_parameters()}
        config = {"stage": 3, "tile_linear_bytes": 512}
        engine = zerotune.from_pretrained(tmp_path / "hf", config)
        assert engine.config.tile_linear_bytes == 512
        zerotune.load_weights(engine, tmp_path / "hf")
        got = engine.full_state_dict()
        assert sorted(got) == sorted(expected)
        for n, w in expected.items():
            assert torch.equal(torch.as_tensor(got[n]), w), n
        save_hf(engine, tmp_path / "live", dtype="fp32")
        zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0)
        export_hf(tmp_path / "ckpt", tmp_path / "export", dtype="fp32")
        engine.close()
        for kind in ("live", "export"):
            written = load_file(tmp_path / kind / "model.safetensors")
            assert sorted(written) == sorted(saved), kind
            for k, w in saved.items():
                assert torch.equal(written[k], w), (kind, k)
    finally:  # Llama has no conversions of its own: an empty table is the same
        register_checkpoint_conversion_mapping("LlamaForCausalLM", [], overwrite=True)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        # A renamed tensor (block_sparse_moe.gate -> mlp.gate) of another shape.
        ("mixtral", "num_local_experts", 4, r"block_sparse_moe.gate.weight.*\(3, 32\).*\(4, 32\)"),
        # Per-expert tensors merged, checked on meta tensors before anything is read.
        ("qwen3_moe", "moe_intermediate_size", 16, r"experts.down_proj.*\(4, 32, 24\).*16\)"),
    ],
)  # fmt: skip
def test_a_converted_checkpoint_of_another_shape_is_explained(
    converted_folders, tmp_path, name, field, value, message
):
    import shutil

    import zerotune
    from zerotune.init.converted import ConvertedCheckpoint
    from zerotune.init.pretrained import ModelLoadError

    folder = tmp_path / name
    shutil.copytree(converted_folders[name], folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    real_whole = ConvertedCheckpoint._whole
    reads = []
    ConvertedCheckpoint._whole = lambda self, key, meta: (
        reads.append(meta) or real_whole(self, key, meta)
    )
    try:
        with pytest.raises(ModelLoadError, match=message):
            zerotune.from_pretrained(folder, {"stage": 3})
    finally:
        ConvertedCheckpoint._whole = real_whole
    assert not any(meta is False for meta in reads)


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
    # that class itself, under the engine's per-instance subclass ([Note: external parameters])
    assert type(engine.module).__bases__ == (T5ForConditionalGeneration,)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).logits
        got = engine.module.eval()(input_ids=ids, labels=ids).logits
    assert torch.equal(got, expected)
    engine.close()
