"""Export to a Hugging Face folder: transformers loads it, weights and logits match the
trained engine, sharded output, tokenizer files, atomic output, and the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import run_world
from harness import FIXED, build, train_and_save

import zerotune
from zerotune.checkpoint import CheckpointError, ExportError, export_hf


def train_save_export(rank, world, tmp):
    """Tiny GPT-2, 5 steps at world 2: a checkpoint, a live save_hf, and what to compare."""
    return train_and_save(rank, world, tmp, 5, {"stage": 3})[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    result = run_world(2, train_save_export, str(tmp))[0]
    return tmp, result


def load_hf(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert all(not v for v in info.values()), info  # no missing / unexpected / mismatched keys
    return model


def test_export_loads_in_transformers_with_equal_weights_and_logits(trained, tmp_path):
    tmp, ref = trained
    out = export_hf(tmp / "ckpt", tmp_path / "hf", dtype="fp32")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    model = load_hf(out)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, stored once
    state = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert sorted(state) == sorted(ref["weights"])
    for name, value in ref["weights"].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    with torch.no_grad():
        logits = model(input_ids=FIXED).logits.numpy()
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-6, atol=1e-6)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_save_hf_from_the_live_engine_writes_the_same_files(trained, tmp_path):
    tmp, _ = trained
    out = export_hf(tmp / "ckpt", tmp_path / "hf", dtype="fp32")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp / "live" / name).read_bytes(), name


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_and_sharded_export(trained, tmp_path, dtype):
    tmp, ref = trained
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out = export_hf(tmp / "ckpt", tmp_path / "hf", dtype=dtype, max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref["weights"]) - {"lm_head.weight"}
    assert all(p.stat().st_size <= 20_000 + 1024 for p in out.glob("model-*"))  # + header
    model = load_hf(out, dtype=torch_dtype)
    assert json.loads((out / "config.json").read_text())["dtype"] == str(torch_dtype)[6:]
    for name, p in model.named_parameters():
        expected = torch.from_numpy(ref["weights"][name]).to(torch_dtype)
        assert p.dtype == torch_dtype and torch.equal(p.detach(), expected), name


def test_tokenizer_files_go_with_the_model(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(95)} | {"<unk>": 95}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
    )
    engine = zerotune.shard(build("gpt2"))
    zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0, tokenizer=tokenizer)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.convert_tokens_to_ids(["w3", "w94", "zz"]) == [3, 94, 95]
    load_hf(out)


def test_a_failed_export_leaves_nothing(trained, tmp_path):
    tmp, _ = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", ckpt)
    rank1 = ckpt / "step-00000005" / "rank-00001-of-00002.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-5] ^= 0x01
    rank1.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.safetensors: checksum"):
        export_hf(ckpt, tmp_path / "hf")
    # Without verification the export runs (the flip is in the weights) and would write;
    # an error in the middle (here: a truncated file) still leaves nothing.
    rank1.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.safetensors"):
        export_hf(ckpt, tmp_path / "hf", verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_what_a_killed_export_left_goes_at_the_next(trained, tmp_path):
    """An export killed outright (SIGKILL, the OOM killer) leaves its hidden partial folder;
    the next export to that output removes it (its process is gone), not another's."""
    import os
    import subprocess
    import sys

    tmp, _ = trained
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".hf.partial-{dead.pid}"
    (orphan / "x").mkdir(parents=True)
    live = tmp_path / f".hf.partial-{os.getpid()}x"  # not a pid: left alone
    live.mkdir()
    export_hf(tmp / "ckpt", tmp_path / "hf")
    assert not orphan.exists() and live.exists()


def test_existing_output_needs_overwrite(trained, tmp_path):
    tmp, _ = trained
    out = tmp_path / "hf"
    out.mkdir()
    export_hf(tmp / "ckpt", out)  # an empty folder is fine
    with pytest.raises(ExportError, match=r"hf: exists and is not empty"):
        export_hf(tmp / "ckpt", out)
    (out / "stale.txt").write_text("old")
    export_hf(tmp / "ckpt", out, overwrite=True, dtype="fp32")
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---------------------------------------------------------------------------------- CLI
def cli(*args):
    from zerotune.cli import main

    result = CliRunner().invoke(main, ["export", *map(str, args)])
    return result.exit_code, result.output


def test_cli_exports(trained, tmp_path):
    tmp, _ = trained
    code, output = cli(tmp / "ckpt", tmp_path / "hf", "--dtype", "fp32", "--max-shard-size", "40KB")
    assert code == 0, output
    assert "exported to" in output and "weight file(s)" in output
    load_hf(tmp_path / "hf")


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such checkpoint folder"),
        ("incomplete", "incomplete checkpoint"),
        ("output_exists", "exists and is not empty"),
        ("bad_dtype", "dtype must be one of bf16, fp16, fp32"),
        ("bad_size", "max_shard_size: cannot read"),
        ("empty_root", "no complete checkpoint"),
        ("output_under_a_file", "is not a folder"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(trained, tmp_path, case, message):
    tmp, _ = trained
    ckpt, out, extra = tmp / "ckpt", tmp_path / "hf", []
    if case == "missing":
        ckpt = tmp_path / "nothing"
    elif case == "incomplete":
        ckpt = tmp_path / "ckpt" / "step-00000005"
        shutil.copytree(tmp / "ckpt" / "step-00000005", ckpt)
        (ckpt / "COMPLETE").unlink()
    elif case == "output_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "bad_dtype":
        extra = ["--dtype", "fp8"]
    elif case == "bad_size":
        extra = ["--max-shard-size", "lots"]
    elif case == "empty_root":
        ckpt = tmp_path / "empty"
        ckpt.mkdir()
    elif case == "output_under_a_file":
        (tmp_path / "a-file").write_text("mine")
        out = tmp_path / "a-file" / "sub" / "hf"
    code, output = cli(ckpt, out, *extra)
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerotune export: error: "), output
    assert message in lines[0] and "Traceback" not in output
    if case == "output_exists":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()
    assert not any(p.name.startswith(".hf") for p in tmp_path.iterdir())


@pytest.mark.parametrize("dtype, stored", [("fp32", "F32"), ("bf16", "BF16")])
def test_default_export_dtype_is_the_training_dtype(tmp_path, dtype, stored):
    from safetensors import safe_open

    engine = zerotune.shard(build("gpt2"), {"stage": 3, "dtype": dtype})
    zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {stored}
    assert export_hf(tmp_path / "ckpt", tmp_path / "hf32", dtype="fp32").is_dir()
    with safe_open(str(tmp_path / "hf32" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_a_parameter_two_modules_share_keeps_its_first_name(tmp_path):
    """BERT's head bias is `cls.predictions.bias` and also `cls.predictions.decoder.bias`:
    the engine, its checkpoints and exports name it as named_parameters() and transformers
    do, so full_state_dict() has the plain model's keys and the export transformers' files."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64,
    )  # fmt: skip
    model = BertForMaskedLM(config)
    model.save_pretrained(tmp_path / "plain")
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert "cls.predictions.bias" in expected and "cls.predictions.decoder.bias" not in expected
    engine = zerotune.shard(model, {"stage": 3})
    got = engine.full_state_dict()
    assert sorted(got) == sorted(expected)
    for n, w in expected.items():
        assert torch.equal(torch.as_tensor(got[n]), w), n
    zerotune.save_checkpoint(engine, tmp_path / "ckpt", step=0)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype="fp32")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(plain)
    for n, w in plain.items():
        assert torch.equal(exported[n], w), n
