"""8-bit Adam moments in checkpoints (see [Note: 8-bit optimizer states] in optim/quant8.py).

[Note: 8-bit moments in checkpoints]
A unit whose moments are quantized saves them as they are: ``u{i}.exp_avg.q8`` and
``u{i}.exp_avg_sq.q8`` (uint8, one per element of the rank's shard) and
``u{i}.exp_avg.absmax`` / ``u{i}.exp_avg_sq.absmax`` (fp32, one per block of 256 counted from
the shard's start); units with fp32 moments save ``u{i}.exp_avg`` / ``u{i}.exp_avg_sq`` as
before. Loading:
- exactly, byte for byte, when this rank's saved shard of the unit is the same set of
  elements (same world size, same unit sizes and parameter offsets) and the unit is
  quantized in this run too: the codes and absmax values are read whole;
- otherwise the saved codes are dequantized over the element ranges being read (the blocks
  that cover them), giving the fp32 moments the 8-bit run was using; a 32-bit run keeps them,
  an 8-bit run quantizes them again in its own blocks (close, not bit-exact: requantizing can
  move an absmax). A 32-bit checkpoint loaded into an 8-bit run is quantized the same way.
"""

from __future__ import annotations

import torch

from ..optim.quant8 import BLOCK, MOMENTS, Q8Moments, blocks
from .files import TensorFileReader

__all__ = ["exact_moments", "read_dequantized", "saved_quantized"]


def saved_quantized(reader: TensorFileReader, name: str) -> bool:
    """Whether the moment tensor ``name`` (``u{i}.exp_avg``) was saved quantized."""
    return f"{name}.q8" in reader


def read_dequantized(
    reader: TensorFileReader, name: str, start: int, stop: int, out: torch.Tensor
) -> None:
    """Elements ``[start, stop)`` of the saved quantized moment ``name``, dequantized into
    the fp32 tensor ``out``: reads the codes from the first covering block's start and the
    absmax values of the covering blocks."""
    if stop <= start:
        return
    moment = name.rsplit(".", 1)[1]
    b0, b1 = start // BLOCK, blocks(stop)
    lo = b0 * BLOCK
    q = torch.empty(stop - lo, dtype=torch.uint8)
    reader.read(f"{name}.q8", lo, stop, q)
    absmax = torch.empty(b1 - b0, dtype=torch.float32)
    reader.read(f"{name}.absmax", b0, b1, absmax)
    values = Q8Moments({moment: q}, {moment: absmax}).dequantize()[moment]
    out.copy_(values[start - lo :])


def exact_moments(engine, optimizer, unit, manifest: dict, records: list[dict], files) -> dict:
    """The unit's saved quantized moments, read whole, when they can be loaded exactly (see
    [Note: 8-bit moments in checkpoints]); else an empty dict."""
    keys = {key for key, _, _ in optimizer.state_specs(unit)}
    if "exp_avg.q8" not in keys or manifest["world_size"] != engine.world:
        return {}
    saved = next((u for u in manifest["units"] if u["index"] == unit.index), None)
    if saved is None or (saved["numel"], saved["shard_numel"]) != (unit.numel, unit.shard_numel):
        return {}
    for s, rec in zip(unit.slots, records):
        if rec is None or rec["unit"] != unit.index or rec["offset"] != s.offset:
            return {}
    reader = files[engine.rank]
    if not all(f"u{unit.index}.{k}.q8" in reader for k in MOMENTS):
        return {}
    out = {}
    for key, dtype, n in optimizer.state_specs(unit):
        if key != "master":
            out[key] = torch.empty(n, dtype=dtype)
            reader.read(f"u{unit.index}.{key}", 0, n, out[key])
    return out
