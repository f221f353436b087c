"""``resize_token_embeddings`` of a model zerotune has sharded: the engine rebuilt around the
same model with the new embedding (see [Note: resizing a sharded model's embeddings] in
sharding/copies.py)."""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from .. import dist as zdist
from ..sharding.engine import ZeroEngine
from .construct import realize_placeholders

__all__ = ["resize_sharded"]


def resize_sharded(engine: ZeroEngine, new_num_tokens, pad_to_multiple_of, mean_resizing) -> None:
    """Give the model ``engine`` shards an input embedding (and output head) of the new row
    count, as transformers' ``resize_token_embeddings`` computes them, and shard it again by
    the same config; the model object stays the one the caller holds. Every rank calls it."""
    model = engine.module
    why = _refusal(engine)
    if why:
        raise RuntimeError(f"resize_token_embeddings on a model sharded by zerotune: {why}")
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    mine = {id(p) for m in (inp, out) if m is not None for p in m.parameters(recurse=False)}
    # Every parameter of the units holding the embedding or head, whole, from fp32 masters.
    values: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        if not any(id(s.param) in mine for s in unit.slots):
            continue
        flat = torch.empty(unit.padded_numel, dtype=torch.float32, device=engine.device)
        shard = engine.unit_state(unit, master_only=True)["master"]
        zdist.all_gather_into(flat, shard.to(flat), group=engine.group)
        for s in unit.slots:
            values[id(s.param)] = flat[s.offset : s.offset + s.numel].view(s.shape)
    new_in, new_out = _resized(model, inp, out, values, new_num_tokens, pad_to_multiple_of,
                               mean_resizing)  # fmt: skip
    rows = new_in.weight.shape[0]
    for m, new in ((inp, new_in), (out, new_out)):
        if m is None:
            continue
        if m is inp or _weight(m) is not _weight(inp):
            for name, p in m.named_parameters(recurse=False):
                values[id(p)] = _same_on_every_rank(getattr(new, name).detach(), engine)
        elif m._parameters.get("bias") is not None:  # a tied head's own bias, as tie_weights
            bias = values[id(m._parameters["bias"])]
            values[id(m._parameters["bias"])] = F.pad(bias, (0, rows - bias.shape[0]))
        if isinstance(m, nn.Embedding):  # a padding row past the new end is gone
            m.padding_idx = new.padding_idx
    _rebuild(engine, values, {id(inp): rows, id(out): rows})
    model.config.get_text_config().vocab_size = rows
    model.vocab_size = rows


def _refusal(engine: ZeroEngine) -> str:
    from transformers import PreTrainedModel

    model = engine.module
    for name in ("resize_token_embeddings", "_resize_token_embeddings"):
        if getattr(type(model), name) is not getattr(PreTrainedModel, name):
            return (f"{type(model).__name__} has its own {name} (it resizes more than the "
                    "embedding and head); resize it before it is sharded")  # fmt: skip
    if engine.optimizer is not None:
        return "its optimizer exists already; resize before building it (before train())"
    if engine.tiled_from:
        return "its linears are tiled (tile_linear_bytes); resize before it is sharded"
    out = model.get_output_embeddings()
    if not isinstance(model.get_input_embeddings(), nn.Embedding) or not isinstance(
        out, (nn.Embedding, nn.Linear, type(None))
    ):
        return "its embedding or output head is not an nn.Embedding or nn.Linear"
    return ""


def _resized(model, inp, out, values, new_num_tokens, pad_to_multiple_of, mean_resizing):
    """transformers' own arithmetic (``_resize_token_embeddings``) on plain fp32 copies of
    the embedding and the head (tied: one weight), so the random rows are its own."""
    plain_in = nn.Embedding.from_pretrained(
        values[id(_weight(inp))].clone(), freeze=False, padding_idx=inp.padding_idx
    )
    plain_out = None
    if out is not None:
        weight = values[id(_weight(out))]
        if _weight(out) is _weight(inp):
            plain_out = nn.Linear(1, 1, bias=False, device="meta")
            plain_out.weight = plain_in.weight
        elif isinstance(out, nn.Embedding):
            plain_out = nn.Embedding.from_pretrained(weight.clone(), freeze=False)
        else:
            bias = out._parameters.get("bias")
            plain_out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                  device="meta")  # fmt: skip
            plain_out.weight = nn.Parameter(weight.clone())
            if bias is not None:
                plain_out.bias = nn.Parameter(values[id(bias)].clone())
        if isinstance(plain_out, nn.Linear):
            plain_out.in_features, plain_out.out_features = plain_out.weight.shape[::-1]
    new_in = model._get_resized_embeddings(plain_in, new_num_tokens, pad_to_multiple_of,
                                           mean_resizing)  # fmt: skip
    rows = new_in.weight.shape[0]
    new_out = None
    if plain_out is not None:
        if isinstance(plain_out, nn.Embedding):
            new_out = model._get_resized_embeddings(plain_out, rows, mean_resizing=mean_resizing)
        else:
            new_out = model._get_resized_lm_head(plain_out, rows, mean_resizing=mean_resizing)
    return new_in, new_out


def _weight(module: nn.Module) -> nn.Parameter:
    """The module's registered weight (a sharded module's attribute may be a view of it)."""
    return module._parameters["weight"]


def _same_on_every_rank(tensor: torch.Tensor, engine: ZeroEngine) -> torch.Tensor:
    """Rank 0's values (the new rows are random) on every rank."""
    if engine.world == 1:
        return tensor
    moved = tensor.to(engine.device).contiguous()
    src = 0 if engine.group is None else tdist.get_global_rank(engine.group, 0)
    tdist.broadcast(moved, src=src, group=engine.group)
    return moved


def _rebuild(engine: ZeroEngine, values: dict[int, torch.Tensor], rows: dict[int, int]) -> None:
    """Shard ``engine``'s model again, in place, by its config: unchanged units copy their
    slices from the old ones, the others are cut from ``values`` (by the old parameter's
    id). Every parameter becomes a new placeholder of its (new) shape, ties kept."""
    model, device = engine.module, engine.device
    shapes = {id(s.param): s.shape for u in engine.units for s in u.slots}
    old_units = {u.name: u for u in engine.units}
    old_of: dict[int, nn.Parameter] = {}  # new parameter's id -> the one it replaces

    def shape_of(p: nn.Parameter) -> torch.Size:
        return values[id(p)].shape if id(p) in values else shapes.get(id(p), p.shape)

    def placeholders() -> None:
        old_of.update(realize_placeholders(model, device, shape_of))
        for m in model.modules():
            if id(m) in rows:
                attr = "num_embeddings" if isinstance(m, nn.Embedding) else "out_features"
                setattr(m, attr, rows[id(m)])

    def fill(unit, master: torch.Tensor) -> None:
        old = old_units.get(unit.name)
        if old is not None and old.layout() == unit.layout():
            master.copy_(engine.unit_state(old, master_only=True)["master"])
            return
        flat = torch.zeros(unit.padded_numel, dtype=torch.float32, device=master.device)
        for s in unit.slots:
            flat[s.offset : s.offset + s.numel] = values[id(old_of[id(s.param)])].reshape(-1)
        master.copy_(flat[unit.shard_start : unit.shard_start + unit.shard_numel])

    engine.reshard(placeholders, lambda name, modules, params: fill)
