"""Corrupted safetensors files (model weights, checkpoint rank files) are either read exactly
as the safetensors library reads them or refused with one line: never read at shifted
offsets."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotune.checkpoint.files import CheckpointError, TensorFileReader, read_metadata
from zerotune.init.pretrained import ModelLoadError, read_safetensors_header


def _base(path) -> bytes:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "h.0.ln_1.weight": torch.ones(16),
        "h.0.attn.c_attn.weight": torch.randn(16, 48, generator=g),
        "h.0.attn.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "wte.weight": torch.randn(24, 16, generator=g),
        "steps": torch.arange(3, dtype=torch.int64),
    }
    save_file(tensors, path, metadata={"format": "pt", "zerotune": "1"})
    return path.read_bytes()


def _ours(path):
    reader = TensorFileReader(path)
    try:
        return {k: reader.whole(k) for k in reader.entries}, read_metadata(path)
    finally:
        reader.close()


def _library(path):
    try:
        return load_file(path)
    except Exception:  # noqa: BLE001 - whatever the library refuses
        return None


def test_a_shifted_offset_is_refused(tmp_path):
    """The issue's case: one digit of a tensor's data_offsets changed, still valid JSON."""
    path = tmp_path / "model.safetensors"
    raw = _base(path)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    begin, end = header["h.0.ln_1.weight"]["data_offsets"]
    text = raw[8 : 8 + n].decode()
    old = f'"data_offsets":[{begin},{end}]'
    assert old in text
    new = f'"data_offsets":[{begin + 4},{end + 4}]'  # same length: the digits change
    if len(new) != len(old):
        pytest.skip("offsets changed length")
    path.write_bytes(raw[:8] + text.replace(old, new).encode() + raw[8 + n :])
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        read_safetensors_header(path)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        TensorFileReader(path)


def test_random_corruption_is_read_as_the_library_reads_it_or_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    base = _base(path)
    (n,) = struct.unpack("<Q", base[:8])
    rng = random.Random(1234)
    counts = {"refused": 0, "read": 0}
    for case in range(300):
        data = bytearray(base)
        kind = case % 3
        if kind == 0:  # a byte of the header (offsets, shapes, dtypes, the JSON itself)
            data[rng.randrange(8, 8 + n)] = rng.randrange(256)
        elif kind == 1:  # any byte, the length prefix and the tensor data included
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        want = _library(path)
        try:
            got, meta = _ours(path)
        except (CheckpointError, ModelLoadError) as exc:
            assert "\n" not in str(exc), (case, str(exc))
            counts["refused"] += 1
            continue
        assert want is not None, f"case {case}: read a file the library refuses"
        assert got.keys() == want.keys(), case
        for k, t in want.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape, (case, k)
            assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), (case, k)
        assert isinstance(meta, dict)
        counts["read"] += 1
    # Both outcomes happen: data flips read as flipped data, header damage is refused.
    assert counts["refused"] > 100 and counts["read"] > 20, counts


def test_fuzzed_manifest_and_marker_load_the_saved_state_or_are_refused(tmp_path):
    """Flips and truncations of a checkpoint's manifest.json and COMPLETE: loading gives the
    saved weights bit for bit, or one CheckpointError line (the marker's checksum, the
    schema); never other weights, never another exception."""
    import shutil

    from harness import batches, build, loss_of

    import zerotune
    from zerotune.checkpoint import load_checkpoint, save_checkpoint

    engine = zerotune.shard(build("odd"), {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, lr=1e-3)
    engine.backward(loss_of(engine, batches("odd", 1)[0]))
    opt.step()
    base = tmp_path / "base"
    folder = save_checkpoint(engine, base, step=1, optimizer=opt)
    saved = engine.full_state_dict()
    rng = random.Random(99)
    counts = {"refused": 0, "loaded": 0}
    for case in range(120):
        root = tmp_path / f"c{case}"
        shutil.copytree(base, root)
        name = "manifest.json" if case % 2 == 0 else "COMPLETE"
        path = root / folder.name / name
        data = bytearray(path.read_bytes())
        if case % 3 == 2:
            data = data[: rng.randrange(len(data))]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        fresh = zerotune.shard(build("odd"), {"stage": 3})
        fresh_opt = zerotune.ZeroAdamW(fresh, lr=1e-3)
        try:
            load_checkpoint(fresh, root / folder.name, optimizer=fresh_opt)
        except CheckpointError as exc:
            assert "\n" not in str(exc), (case, str(exc))
            counts["refused"] += 1
            continue
        got = fresh.full_state_dict()
        assert all(torch.equal(got[k], v) for k, v in saved.items()), case
        counts["loaded"] += 1
        shutil.rmtree(root)
    assert counts["refused"] > 100, counts
