"""8-bit Adam moments: blockwise quantization with bitsandbytes' dynamic codes.

[Note: 8-bit optimizer states]
With ``optim_state_bits=8`` the optimizer keeps both Adam moments of a unit quantized, on
whatever tier holds its optimizer state (device, host, NVMe); the fp32 master stays fp32.
The scheme is bitsandbytes' ``AdamW8bit``: blocks of 256 elements, one fp32 absmax per block
and moment, ``exp_avg`` in the signed dynamic code and ``exp_avg_sq`` in the unsigned one
(``bitsandbytes.functional.create_dynamic_map``). On the CPU zerotune's own kernel
(csrc/adam/quant8.cpp) quantizes to the nearest code and dequantizes, several times faster
than bitsandbytes' CPU ``quantize_blockwise`` / ``dequantize_blockwise`` (benchmarks/
RESULTS.md) and exact where bitsandbytes' search is approximate (a few % of its codes are
one off, some tiny exp_avg_sq values several codes up), except that a positive
``exp_avg_sq`` never becomes code 0 (see [Note: no positive value becomes zero] there);
elsewhere (CUDA), or when the op is not built, bitsandbytes' functions run. Blocks
count from the start of this rank's shard of the unit, so a block may span two parameters
of the unit (bitsandbytes quantizes each tensor on its own).

Which units: those of at least ``MIN_8BIT_NUMEL`` (4096, bitsandbytes' ``min_8bit_size``)
elements, counted over the whole unit so the choice does not depend on the world size.
Smaller units (a final norm, a small embedding) keep fp32 moments: they cost little, and
small tensors are where bitsandbytes found 8-bit state hurts. Inside a quantized unit its
norm weights and biases are quantized with the rest (bitsandbytes decides per tensor).

The update, per chunk of a shard (chunks start on block boundaries): on the CPU one C++
pass per block of 256 dequantizes both moments to the stack, runs the ordinary Adam
arithmetic (the kernel of cpu_adam.adam_update, per parameter-group segment) and quantizes
them back (``cpu_adam.adam_update_8bit``, [Note: fused 8-bit step] in
csrc/adam/cpu_adam.cpp). Elsewhere (CUDA, or no C++ op) the same three steps run over the
chunk: dequantize into a scratch buffer the optimizer reuses, ``adam_update`` or its torch
fallback, quantize; the bytes are the same. bitsandbytes' own CPU
``optimizer_update_8bit_blockwise`` does the three steps with its own torch-op Adam; using
zerotune's kernel keeps one Adam (Adam with L2, no bias correction and the fused bf16/fp16
write work unchanged). Fresh state
is all-zero codes with zero absmax, which dequantizes to zero (as bitsandbytes starts).

Bytes per element of a quantized shard: 1 + 1 for the moments and 8/256 for the absmax
values; with the fp32 master that is 6.03 instead of 12 (see ``state_bytes``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "BLOCK",
    "MIN_8BIT_NUMEL",
    "Q8Moments",
    "blocks",
    "quantized",
    "require_bitsandbytes",
    "state_bytes",
]

BLOCK = 256
MIN_8BIT_NUMEL = 4096
MOMENTS = ("exp_avg", "exp_avg_sq")
_SIGNED = {"exp_avg": True, "exp_avg_sq": False}
_codes: dict[tuple[str, bool], torch.Tensor] = {}


def quantized(unit_numel: int, bits: int) -> bool:
    """Whether a unit of ``unit_numel`` elements keeps 8-bit moments under ``bits``."""
    return bits == 8 and unit_numel >= MIN_8BIT_NUMEL


def blocks(n: int) -> int:
    return math.ceil(n / BLOCK)


def state_bytes(n: int) -> int:
    """Bytes of both quantized moments of ``n`` elements: codes and absmax values."""
    return 2 * n + 2 * 4 * blocks(n)


def require_bitsandbytes():
    """``bitsandbytes.functional``, or a ConfigError saying how to get it."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as exc:
        from ..config import ConfigError

        raise ConfigError(
            f"optim_state_bits=8 needs bitsandbytes ({exc}); install it with "
            "`pip install zerotune[bnb]` or use optim_state_bits=32"
        ) from None
    return bnbf


def code(name: str, device: torch.device) -> torch.Tensor:
    """The dynamic code of moment ``name`` on ``device`` (signed for exp_avg)."""
    key = (str(device), _SIGNED[name])
    if key not in _codes:
        bnbf = require_bitsandbytes()
        _codes[key] = bnbf.create_dynamic_map(signed=_SIGNED[name]).to(device)
    return _codes[key]


def _cpu_op(tensors):
    """The C++ quantizer (csrc/adam/quant8.cpp, [Note: nearest code by table]) when every
    tensor is a contiguous CPU tensor and the op is built; else None (bitsandbytes)."""
    tensors = list(tensors)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    from ..ops import load_op

    return load_op("adam")


class Q8Moments:
    """Both moments of ``n`` elements, quantized: ``q[name]`` (uint8, ``n``) and
    ``absmax[name]`` (fp32, one per block of 256). Slices share memory with the whole."""

    def __init__(self, q: dict[str, torch.Tensor], absmax: dict[str, torch.Tensor]):
        self.q, self.absmax = q, absmax

    @classmethod
    def zeros(cls, n: int, device) -> Q8Moments:
        return cls(
            {k: torch.zeros(n, dtype=torch.uint8, device=device) for k in MOMENTS},
            {k: torch.zeros(blocks(n), dtype=torch.float32, device=device) for k in MOMENTS},
        )

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], partial: bool = False) -> Q8Moments:
        """From the keys ``exp_avg.q8``, ``exp_avg.absmax``, ... (see ``as_state``); with
        ``partial``, only the moments ``state`` holds."""
        names = [k for k in MOMENTS if not partial or f"{k}.q8" in state]
        return cls(
            {k: state[f"{k}.q8"].reshape(-1) for k in names},
            {k: state[f"{k}.absmax"].reshape(-1) for k in names},
        )

    def as_state(self) -> dict[str, torch.Tensor]:
        """The tensors by checkpoint key: ``exp_avg.q8``, ``exp_avg.absmax``, ``exp_avg_sq.q8``,
        ``exp_avg_sq.absmax``."""
        out = {}
        for k in self.q:
            out[f"{k}.q8"] = self.q[k]
            out[f"{k}.absmax"] = self.absmax[k]
        return out

    @property
    def numel(self) -> int:
        return next(iter(self.q.values())).numel()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.as_state().values())

    def slice(self, c0: int, c1: int) -> Q8Moments:
        """Elements ``[c0, c1)``; ``c0`` must start a block."""
        if c0 % BLOCK:
            raise ValueError(f"a quantized chunk must start on a block boundary, got {c0}")
        b0, b1 = c0 // BLOCK, blocks(c1)
        return Q8Moments(
            {k: v[c0:c1] for k, v in self.q.items()},
            {k: v[b0:b1] for k, v in self.absmax.items()},
        )

    def copy_(self, other: Q8Moments) -> None:
        """Copy the moments ``other`` holds (all, or some)."""
        for k in other.q:
            self.q[k].copy_(other.q[k])
            self.absmax[k].copy_(other.absmax[k])

    def dequantize(self, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Both moments (or those held) as fp32 tensors of ``numel`` elements: new ones, or
        written into ``out`` (contiguous, same device) and returned."""
        given = list(out.values()) if out is not None else []
        op = _cpu_op([*self.q.values(), *self.absmax.values(), *given])
        if op is not None:
            res = {}
            for k, q in self.q.items():
                res[k] = out[k] if out is not None else torch.empty(q.numel(), dtype=torch.float32)
                op.dequantize_blockwise(q, self.absmax[k], code(k, q.device), res[k])
            return res
        bnbf = require_bitsandbytes()
        res = {}
        for k, q in self.q.items():
            # (bitsandbytes' CPU backend has no out= variant: copy into ``out`` instead)
            value = bnbf.dequantize_blockwise(
                q, absmax=self.absmax[k], code=code(k, q.device), blocksize=BLOCK
            )
            res[k] = out[k].copy_(value) if out is not None else value
        return res

    def quantize_reached(self, values: dict[str, torch.Tensor], segments) -> None:
        """``quantize`` for the blocks that a ``(start, stop, ...)`` of ``segments`` reaches;
        the others keep their codes and absmax values (as the one-pass op leaves them: a
        round trip through the codes is not exact)."""
        n = self.numel
        reached = torch.zeros(blocks(n), dtype=torch.bool)
        for a, b, *_ in segments:
            if a < b:
                reached[a // BLOCK : (b - 1) // BLOCK + 1] = True
        if bool(reached.all()):
            self.quantize(values)
            return
        device = next(iter(self.q.values())).device
        keep = (~reached).to(device)
        elems = keep.repeat_interleave(BLOCK)[:n]
        saved = {k: (self.q[k][elems].clone(), self.absmax[k][keep].clone()) for k in values}
        self.quantize(values)
        for k, (q, absmax) in saved.items():
            self.q[k][elems] = q
            self.absmax[k][keep] = absmax

    def quantize(self, values: dict[str, torch.Tensor]) -> None:
        """Quantize the fp32 tensors ``values[name]`` (all moments, or some) into these codes
        and absmax values."""
        op = _cpu_op([*values.values(), *self.q.values(), *self.absmax.values()])
        if op is not None:
            for k, x in values.items():
                op.quantize_blockwise(x, code(k, x.device), self.absmax[k], self.q[k])
            return
        bnbf = require_bitsandbytes()
        for k, x in values.items():
            bnbf.quantize_blockwise(
                x, code=code(k, x.device), absmax=self.absmax[k], out=self.q[k], blocksize=BLOCK
            )
