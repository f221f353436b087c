"""What a checkpoint holds beside the units' shards: the model's persistent buffers, its
config files, and each rank's RNG states (torch's as tensors of its rank file, Python's and
numpy's as JSON in its metadata). Saving, loading and export read them from here."""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from torch import nn

from .files import TensorFileReader

__all__ = ["model_files", "persistent_buffers", "rng_state", "set_rng_state"]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state_dict would hold (non-persistent ones are rebuilt by the model)."""
    out, seen = [], set()
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def model_files(module: nn.Module) -> dict[str, bytes]:
    """config.json (and generation_config.json) of an HF model, as save_pretrained writes them."""
    out: dict[str, bytes] = {}
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string())
        data["architectures"] = [type(module).__name__]
        out["config.json"] = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    gen = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if gen is not None and hasattr(gen, "to_json_string") and callable(can_generate):
        if can_generate():
            out["generation_config.json"] = gen.to_json_string().encode()
    return out


def rng_state() -> tuple[dict[str, torch.Tensor], str]:
    """This process's RNG states: torch's (and CUDA's) as tensors, Python's and numpy's as
    one JSON string."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state.cpu()
    version, internal, gauss = random.getstate()
    states: dict = {"python": [version, list(internal), gauss]}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return tensors, json.dumps(states)


def set_rng_state(reader: TensorFileReader, metadata: dict[str, str]) -> None:
    """Restore the RNG states ``rng_state`` gave from a rank file and its metadata."""
    t = torch.empty(reader.entries["rng.torch"].nbytes, dtype=torch.uint8)
    reader.read("rng.torch", 0, t.numel(), t)
    torch.set_rng_state(t)
    if torch.cuda.is_available():
        cuda = sorted(k for k in reader.entries if k.startswith("rng.cuda."))
        for i, key in enumerate(cuda[: torch.cuda.device_count()]):
            t = torch.empty(reader.entries[key].nbytes, dtype=torch.uint8)
            reader.read(key, 0, t.numel(), t)
            torch.cuda.set_rng_state(t, i)
    states = json.loads(metadata.get("rng", "{}"))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
