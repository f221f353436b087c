"""Activation memory of one forward/backward of a transformer, for ``zerotune estimate``.

[Note: activation memory]
Per transformer layer, for micro-batch b, sequence s, hidden h, MLP width f, a heads, element
size e (2 for bf16/fp16, 4 for fp32) and dropout-mask size m (1 byte on GPUs; on CPUs torch's
dropout keeps a mask of the input's dtype, m = e), the bytes autograd keeps are

    s*b*(e*(8h + c_f*f) + n_d*m*h + n_norm*(r - e)*h) + a*s*s*b*c_s

following Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), whose GPT layer (f = 4h, fused GeLU, dropout everywhere, 16-bit) gives the
familiar s*b*h*(34 + 5*a*s/h):
  8h: the inputs of the two norms, of the QKV projection, Q, K and V (K and V narrower with
      grouped-query attention: h + 2*kv_heads*head_dim instead of 3h), the input of the
      attention output projection and of the MLP;
  c_f*f: the MLP's hidden activations: 2 for a fused activation (its input and the second
      projection's input), 4 for a gated MLP (gate, up, act(gate), their product), 5 for
      GPT-2's gelu_new (written out in Python, it keeps four intermediates);
  n_d*m*h: dropout masks after attention and MLP (n_d = 2 when dropout is on, else 0);
  r: bytes a norm keeps per element: e for LayerNorm, 4 + e for RMSNorm written in Python
      (it keeps an fp32 copy of its input);
  c_s: attention scores. Eager attention keeps the softmax output (e) and, with attention
      dropout, its mask (m) and output (e): c_s = e + p*(m + e). Fused attention (SDPA's
      flash / memory-efficient kernels, flash-attention) keeps no s*s matrix, only the
      log-sum-exp (4*a*s*b, added). On CPUs, SDPA with attention dropout falls back to its
      math path (c_s = 3e).
Outside the layers: the embedding's dropout mask, the final norm's and the head's inputs,
and the loss, which for HF's causal-LM loss peaks at about s*b*V*(e + 4 + 8 (+4 for the fp32
upcast when e < 4)) bytes: the logits, the fp32 log-probabilities kept for backward, and the
two fp32 gradients of the loss's backward.
With activation checkpointing (one checkpoint per layer) only each layer's input is kept
(s*b*h*e per layer) plus one layer's activations while it is recomputed.
The peak is the larger of two moments: the loss's backward (everything kept plus the loss
term) and backward through the layers (everything kept, the fp32 gradient of the logits and,
with checkpointing, the recomputed layer). The engine's transient buffers (gathered units,
gradients waiting for their reduction, NVMe reads) exist only at the second moment, so they
add to the peak only beyond the difference (see ``_rows`` in estimate.py).
Not counted: a model's own extras (attention masks built per batch, rotary caches), the
fragmentation of the allocator, the CUDA context. ``headroom`` keeps a share of each tier
free for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelShape", "activation_bytes", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What the activation formula needs from a transformer (see [Note: activation memory])."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int
    kv_heads: int
    max_positions: int | None = None
    mlp_factor: int = 2  # c_f
    rms_norm: bool = False
    dropout: bool = False  # hidden / residual dropout
    attention_dropout: bool = False
    attention: str = "sdpa"  # eager, sdpa, flash_attention_2, ...


def model_shape(model: nn.Module) -> ModelShape | None:
    """The shape of a Hugging Face-style decoder from ``model.config`` and its modules, or
    None when the model does not say (then activations are not estimated)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None

    def get(*names, default=None):
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return v
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, vocab)):
        return None
    names = {type(m).__name__ for m in model.modules()}
    gated = any(n.endswith("gate_proj") for n, _ in model.named_modules())
    act = str(get("hidden_act", "activation_function", default="gelu"))
    mlp_factor = 4 if gated else 5 if act == "gelu_new" else 2
    return ModelShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        intermediate=get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        kv_heads=get("num_key_value_heads", default=heads),
        max_positions=get("max_position_embeddings", "n_positions"),
        mlp_factor=mlp_factor,
        rms_norm=any("RMSNorm" in n for n in names),
        dropout=bool(get("resid_pdrop", "hidden_dropout", "dropout", default=0.0)),
        attention_dropout=bool(get("attn_pdrop", "attention_dropout", default=0.0)),
        attention=getattr(cfg, "_attn_implementation", None) or "sdpa",
    )


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    dtype: torch.dtype,
    *,
    checkpointing: bool = False,
    device: str = "cuda",
) -> dict[str, int]:
    """Activation bytes of one forward/backward (see [Note: activation memory]): ``layer``
    (one layer's), ``held`` (kept from forward into backward: every layer's activations, or
    with checkpointing the layers' inputs, plus what lies outside the layers), ``loss`` (the
    loss's peak on top of ``held``), ``backward`` (the peak while backward runs through the
    layers, without the engine's buffers), ``end`` (what is left when backward reaches the
    input embedding) and ``total`` (the peak)."""
    e = torch.finfo(dtype).bits // 8
    s, b, h, f, a = seq_len, micro_batch, shape.hidden, shape.intermediate, shape.heads
    m = 1 if device != "cpu" else e
    head_dim = h // a
    qkv = h + 2 * shape.kv_heads * head_dim  # Q, K, V
    norm_extra = (4 if shape.rms_norm else 0) * h * 2  # RMSNorm's fp32 copies, two norms
    per_token = e * (5 * h + qkv + shape.mlp_factor * f) + norm_extra
    if shape.dropout:
        per_token += 2 * m * h
    fused = shape.attention != "eager"
    if fused and device == "cpu" and shape.attention_dropout and shape.attention == "sdpa":
        fused = False  # SDPA's math path
    if fused:
        scores = 4 * a * s * b  # log-sum-exp
    else:
        c_s = e + (m + e if shape.attention_dropout else 0)
        if device == "cpu" and shape.attention == "sdpa":
            c_s = 3 * e  # softmax, dropout mask (input dtype), dropout output
        scores = a * s * s * b * c_s
    layer = s * b * per_token + scores
    outside = s * b * h * (2 * e + (m if shape.dropout else 0) + (4 if shape.rms_norm else 0))
    held = outside + (shape.layers * s * b * h * e if checkpointing else shape.layers * layer)
    loss = s * b * shape.vocab * (e + 4 + 8 + (4 if e < 4 else 0))
    # Backward through the layers: the gradient of the logits (fp32) reaches the head, and
    # with checkpointing one layer is recomputed at a time. The loss's own peak comes
    # before that; the larger of the two is the activation peak.
    backward = held + s * b * shape.vocab * 4 + (layer if checkpointing else 0)
    return {
        "layer": layer,
        "held": held,
        "loss": loss,
        "backward": backward,
        # At the end of backward (the input embedding's turn): what lies outside the
        # layers and the fp32 gradient of the embedding's output.
        "end": outside + s * b * h * 4,
        "total": max(held + loss, backward),
    }
