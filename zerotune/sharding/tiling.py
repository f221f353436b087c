"""Memory-centric tiling: a huge linear layer as a sequence of tiles, each its own unit.

[Note: tiling]
ZeRO-Infinity's memory-centric tiling bounds the working memory of one huge operator: a
linear layer ``y = x W^T + b`` (``nn.Linear``, weight ``[out, in]``) or HF GPT-2's ``Conv1D``
(``y = x W + b``, weight ``[in, out]``) is computed as a grid of tiles, split along output
features (tiles of one input slice concatenate) and/or input features (partial sums add up).
``TiledLinear`` holds the tiles in a ``ModuleList``; every ``LinearTile`` is its own
sharding unit (``_zerotune_own_unit``: the policy makes it a unit even inside a transformer
block, see [Note: unit policy] in plan.py), so the engine's hooks gather a tile just before
its forward and release it right after, and backward gathers and reduces one tile at a time.
The gathered parameters of the layer are one tile's, not the whole weight. The bias is added
once, after the tiles, and stays a parameter of ``TiledLinear`` under its original name
(``c_fc.bias``); it belongs to the enclosing unit.

A tile's weight is the block ``W[r0:r1, c0:c1]`` of the stored weight (rows are dim 0 of the
original tensor, ``out`` for ``nn.Linear``, ``in`` for ``Conv1D``), in the same orientation.
``TiledWeight`` records, for each tiled original, its name, stored shape and blocks; with it
state dicts, checkpoints and exports put the original ``*.weight`` back together
(``merge_tiles``, ``iter_row_bands``), and a pretrained untiled file fills a tile by reading
its block row by row (``read_block``). Exports therefore have the untiled names and shapes.

``apply_tiling(model, max_bytes, itemsize)`` replaces, in place, every ``nn.Linear`` (exact
class) and ``Conv1D`` whose weight is larger than ``max_bytes`` in the compute dtype by a
``TiledLinear`` whose tiles hold at most ``max_bytes``: output-feature splits first (no partial
sums), input-feature splits only when one output feature's weights are larger than the
limit. A weight shared with another module (a tied head) is left whole. The engine applies
``ZeroConfig.tile_linear_bytes`` before it forms units; ``zero_init`` and ``from_pretrained``
go through the engine, and ``from_pretrained`` tiles the meta model first to map tiles to
file entries. The map ``id(original weight) -> tile parameters`` lets optimizer parameter
groups built from the untiled model keep working.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MAX_TILES",
    "LinearTile",
    "TileBlock",
    "TiledLinear",
    "TiledWeight",
    "apply_tiling",
    "choose_splits",
    "init_tile",
    "iter_row_bands",
    "merge_tiles",
    "read_block",
    "tiled_copy",
    "tiled_weights",
]

log = logging.getLogger(__name__)

MAX_TILES = 4096  # per layer: beyond, the tile size is almost surely a typo
_LAYOUTS = ("linear", "conv1d")


def _is_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (read by attributes: this layer does not import transformers)."""
    w = module._parameters.get("weight")
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and hasattr(module, "nx")
        and w is not None
        and tuple(w.shape) == (module.nx, module.nf)
    )


def _bounds(n: int, splits: int | Sequence[int], what: str) -> list[int]:
    """Boundaries ``[0, ..., n]`` of ``splits`` near-equal parts, or of the given sizes."""
    if isinstance(splits, int) and not isinstance(splits, bool):
        if not 1 <= splits <= n:
            raise ValueError(f"{what} must be between 1 and {n} (the number of features), "
                             f"got {splits}")  # fmt: skip
        return [i * n // splits for i in range(splits + 1)]
    sizes = list(splits)
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != n:
        raise ValueError(f"{what} must be a count or positive sizes summing to {n}, got {splits!r}")
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


def choose_splits(out_features: int, in_features: int, itemsize: int, max_bytes: int):
    """``(out_splits, in_splits)`` for tiles of at most ``max_bytes``: the fewest input
    splits (partial sums), then the fewest output splits."""
    limit = max_bytes // itemsize
    if limit < 1:
        raise ValueError(
            f"tile_linear_bytes={max_bytes} is smaller than one weight element "
            f"({itemsize} bytes); use 0 to turn tiling off"
        )
    in_splits = math.ceil(in_features / limit)
    rows = limit // math.ceil(in_features / in_splits)
    out_splits = math.ceil(out_features / rows)
    return out_splits, in_splits


@dataclass(frozen=True)
class TileBlock:
    """One tile parameter: the block ``[rows[0]:rows[1], cols[0]:cols[1]]`` of its original."""

    name: str
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


@dataclass(frozen=True)
class TiledWeight:
    """A tiled original weight: its name, stored shape and tiles."""

    name: str
    shape: tuple[int, int]
    tiles: tuple[TileBlock, ...]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "tiles": [[t.name, *t.rows, *t.cols] for t in self.tiles],
        }

    @classmethod
    def from_json(cls, data: dict) -> TiledWeight:
        tiles = tuple(TileBlock(n, (a, b), (c, d)) for n, a, b, c, d in data["tiles"])
        return cls(data["name"], tuple(data["shape"]), tiles)


class LinearTile(nn.Module):
    """One tile of a ``TiledLinear``: a bias-free linear map over a slice of the features."""

    _zerotune_own_unit = True  # [Note: unit policy]: always its own unit, even inside another

    def __init__(self, weight: torch.Tensor, layout: str, fan_in: int, requires_grad: bool = True):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.layout = layout
        self.fan_in = fan_in  # of the whole layer (for reset_parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "linear":
            return F.linear(x, self.weight)
        return torch.matmul(x, self.weight)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """What ``nn.Linear`` (uniform, bound 1/sqrt(fan_in) of the whole layer) or
        ``Conv1D`` (normal, std 0.02) would draw for these weights."""
        if self.layout == "linear":
            bound = 1 / math.sqrt(self.fan_in) if self.fan_in > 0 else 0.0
            self.weight.uniform_(-bound, bound)
        else:
            self.weight.normal_(0.0, 0.02)

    def extra_repr(self) -> str:
        return f"{self.layout}, weight={tuple(self.weight.shape)}"


class TiledLinear(nn.Module):
    """``nn.Linear`` (``layout="linear"``, weight ``[out, in]``) or ``Conv1D``
    (``layout="conv1d"``, weight ``[in, out]``) computed tile by tile; see [Note: tiling].

    in_splits / out_splits: a number of near-equal parts, or the part sizes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        in_splits: int | Sequence[int] = 1,
        out_splits: int | Sequence[int] = 1,
        layout: str = "linear",
        device=None,
        dtype=None,
        _weight: torch.Tensor | None = None,
        _bias: nn.Parameter | None = None,
    ):
        super().__init__()
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be 'linear' or 'conv1d', got {layout!r}")
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"a tiled linear needs at least one feature each way, got in_features="
                f"{in_features}, out_features={out_features}"
            )
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.in_bounds = _bounds(in_features, in_splits, "in_splits")
        self.out_bounds = _bounds(out_features, out_splits, "out_splits")
        shape = (out_features, in_features) if layout == "linear" else (in_features, out_features)
        fresh = _weight is None
        if fresh:
            _weight = torch.empty(shape, device=device, dtype=dtype)
        elif tuple(_weight.shape) != shape:
            raise ValueError(f"weight has shape {tuple(_weight.shape)}, expected {shape}")
        requires_grad = fresh or _weight.requires_grad
        self.original_class: type | None = nn.Linear if layout == "linear" else None
        self.tiles = nn.ModuleList()
        for (r0, r1), (c0, c1) in self._grid():
            block = _weight.detach()[r0:r1, c0:c1]
            # A zero-stride placeholder (zero-init, streaming loads) or a meta tensor stays
            # as it is; real data becomes the tile's own contiguous copy.
            if not (block.is_meta or 0 in block.stride()):
                block = block.clone(memory_format=torch.contiguous_format)
            self.tiles.append(LinearTile(block, layout, in_features, requires_grad))
        if _bias is not None:
            self.bias = _bias
        elif bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if fresh:
            self.reset_parameters()

    @classmethod
    def from_linear(
        cls,
        layer: nn.Module,
        *,
        in_splits: int | Sequence[int] = 1,
        out_splits: int | Sequence[int] = 1,
    ) -> TiledLinear:
        """The tiled form of ``layer`` (``nn.Linear`` or HF ``Conv1D``), with its weights; the
        bias stays the same ``nn.Parameter``."""
        if isinstance(layer, nn.Linear):
            in_f, out_f, layout = layer.in_features, layer.out_features, "linear"
        elif _is_conv1d(layer):
            in_f, out_f, layout = layer.nx, layer.nf, "conv1d"
        else:
            raise TypeError(f"can only tile nn.Linear or Conv1D, got {type(layer).__name__}")
        tiled = cls(
            in_f,
            out_f,
            layer.bias is not None,
            in_splits=in_splits,
            out_splits=out_splits,
            layout=layout,
            _weight=layer.weight,
            _bias=layer.bias,
        )
        tiled.original_class = type(layer)  # zero-init initializes tiles as this class
        return tiled

    # The grid: tile k = (output part j, input part i) at k = j * n_in + i.
    def _grid(self) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
        ins = list(zip(self.in_bounds, self.in_bounds[1:]))
        outs = list(zip(self.out_bounds, self.out_bounds[1:]))
        for o in outs:
            for i in ins:
                yield (o, i) if self.layout == "linear" else (i, o)

    @property
    def weight_shape(self) -> tuple[int, int]:
        if self.layout == "linear":
            return (self.out_features, self.in_features)
        return (self.in_features, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """A meta tensor of the untiled weight's shape and dtype: code that reads
        ``layer.weight.shape`` / ``.dtype`` (or initializes it, a no-op) keeps working; the
        values live in the tiles."""
        dtype = self.tiles[0].weight.dtype
        return torch.empty(self.weight_shape, dtype=dtype, device="meta")

    # HF's Conv1D names.
    @property
    def nf(self) -> int:
        return self.out_features

    @property
    def nx(self) -> int:
        return self.in_features

    def blocks(self) -> list[tuple[LinearTile, tuple[int, int], tuple[int, int]]]:
        """(tile, rows, cols) of every tile in the stored weight."""
        return [(t, r, c) for t, (r, c) in zip(self.tiles, self._grid())]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for t in self.tiles:
            t.reset_parameters()
        if self.bias is not None:
            if self.layout == "linear":
                bound = 1 / math.sqrt(self.in_features)
                self.bias.uniform_(-bound, bound)
            else:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_in = len(self.in_bounds) - 1
        slices = [
            x if n_in == 1 else x[..., a:b] for a, b in zip(self.in_bounds, self.in_bounds[1:])
        ]
        parts = []
        for j in range(len(self.out_bounds) - 1):
            acc = None
            for i in range(n_in):
                y = self.tiles[j * n_in + i](slices[i])
                acc = y if acc is None else acc + y
            parts.append(acc)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"{self.layout}, in_features={self.in_features}, out_features="
            f"{self.out_features}, bias={self.bias is not None}, tiles="
            f"{len(self.out_bounds) - 1}x{len(self.in_bounds) - 1} (out x in)"
        )


# ---------------------------------------------------------------------------- the model
def apply_tiling(
    model: nn.Module, max_bytes: int, itemsize: int
) -> dict[int, tuple[nn.Parameter, list[nn.Parameter]]]:
    """Replace, in place, every ``nn.Linear`` / ``Conv1D`` whose weight is larger than
    ``max_bytes`` (at ``itemsize`` bytes per element) by a ``TiledLinear`` of tiles of at
    most ``max_bytes``. Returns ``id(original weight) -> (original weight, its tile
    parameters)``; the original weights are emptied (their values live in the tiles), so
    references kept elsewhere (optimizer groups) hold no memory. ``max_bytes`` 0 does
    nothing; layers already tiled are left alone."""
    if max_bytes <= 0:
        return {}
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    replaced: dict[int, tuple[nn.Parameter, list[nn.Parameter]]] = {}
    for name, module in list(model.named_modules()):
        if not (type(module) is nn.Linear or _is_conv1d(module)):
            continue
        w = module.weight
        if w.numel() * itemsize <= max_bytes:
            continue
        if holders[id(w)] > 1:
            log.info("zerotune: %s is larger than tile_linear_bytes but its weight is shared "
                     "(tied); it is not tiled", name)  # fmt: skip
            continue
        if isinstance(module, nn.Linear):
            out_f, in_f = module.out_features, module.in_features
        else:
            out_f, in_f = module.nf, module.nx
        out_splits, in_splits = choose_splits(out_f, in_f, itemsize, max_bytes)
        if out_splits * in_splits > MAX_TILES:
            raise ValueError(
                f"tile_linear_bytes={max_bytes} would cut {name} ({out_f}x{in_f}) into "
                f"{out_splits * in_splits} tiles (more than {MAX_TILES}); raise tile_linear_bytes"
            )
        tiled = TiledLinear.from_linear(module, in_splits=in_splits, out_splits=out_splits)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent._modules[attr] = tiled
        replaced[id(w)] = (w, [t.weight for t in tiled.tiles])
        w.data = torch.empty(0, dtype=w.dtype, device=w.device)
        log.info("zerotune: %s split into %d x %d tiles (out x in)", name, out_splits, in_splits)
    return replaced


def tiled_copy(model: nn.Module, max_bytes: int, itemsize: int) -> nn.Module:
    """``model`` as ``apply_tiling`` would leave it, without touching it: a copy whose
    parameters and buffers are on the meta device (no memory), tiled; ``model`` itself when
    no layer would be tiled. For planning (``plan_units``, ``zerotune estimate``)."""
    if max_bytes <= 0 or not any(
        (type(m) is nn.Linear or _is_conv1d(m)) and m.weight.numel() * itemsize > max_bytes
        for m in model.modules()
    ):
        return model
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    copy = deepcopy(model, memo)
    apply_tiling(copy, max_bytes, itemsize)
    return copy


def tiled_weights(model: nn.Module) -> list[TiledWeight]:
    """Every tiled weight of ``model``, in module order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, TiledLinear):
            prefix = f"{name}." if name else ""
            blocks = enumerate(m.blocks())
            tiles = tuple(TileBlock(f"{prefix}tiles.{k}.weight", r, c) for k, (_, r, c) in blocks)
            out.append(TiledWeight(f"{prefix}weight", m.weight_shape, tiles))
    return out


def merge_tiles(
    state: dict[str, torch.Tensor], tiled: list[TiledWeight]
) -> dict[str, torch.Tensor]:
    """``state`` with each tiled weight's tiles replaced by the whole weight, under its own
    name, where its first tile was."""
    first = {tw.tiles[0].name: tw for tw in tiled}
    members = {t.name for tw in tiled for t in tw.tiles}
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in first:
            tw = first[name]
            whole = value.new_empty(tw.shape)
            for t in tw.tiles:
                whole[t.rows[0] : t.rows[1], t.cols[0] : t.cols[1]] = state[t.name]
            out[tw.name] = whole
        elif name not in members:
            out[name] = value
    return out


ReadFlat = Callable[[int, int, torch.Tensor], None]  # (start, stop, out): flat elements


def read_block(read: ReadFlat, orig_cols: int, block: TileBlock, start: int, stop: int,
               out: torch.Tensor) -> None:  # fmt: skip
    """Elements ``[start, stop)`` of a tile (its block, flattened row-major) into ``out``,
    reading the untiled original through ``read`` (its flattened elements), row by row."""
    (r0, _), (c0, c1) = block.rows, block.cols
    width = c1 - c0
    if width == orig_cols:  # whole rows: one contiguous range
        read(r0 * orig_cols + start, r0 * orig_cols + stop, out)
        return
    pos = start
    while pos < stop:
        row, col = divmod(pos, width)
        end = min(stop, (row + 1) * width)
        at = (r0 + row) * orig_cols + c0 + col
        read(at, at + end - pos, out[pos - start : end - start])
        pos = end


def iter_row_bands(
    tw: TiledWeight,
    read_tile: Callable[[str, int, int, torch.Tensor], None],
    max_elements: int,
    dtype: torch.dtype = torch.float32,
) -> Iterator[torch.Tensor]:
    """The untiled weight, flattened, in bands of whole rows of at most ``max_elements``
    (at least one row); ``read_tile(tile name, start, stop, out)`` reads a tile's flattened
    elements. Each band is valid until the next one is produced."""
    rows, cols = tw.shape
    per = max(1, max_elements // cols)
    band = torch.empty(min(per, rows) * cols, dtype=dtype)
    tmp = torch.empty_like(band)
    for ra in range(0, rows, per):
        rb = min(rows, ra + per)
        view = band[: (rb - ra) * cols].view(rb - ra, cols)
        for t in tw.tiles:
            (r0, r1), (c0, c1) = t.rows, t.cols
            a, b = max(ra, r0), min(rb, r1)
            if a >= b:
                continue
            width = c1 - c0
            part = tmp[: (b - a) * width]
            read_tile(t.name, (a - r0) * width, (b - r0) * width, part)
            view[a - ra : b - ra, c0:c1].copy_(part.view(b - a, width))
        yield band[: (rb - ra) * cols]


# ------------------------------------------------------------------------------ zero-init
@torch.no_grad()
def init_tile(model: nn.Module, tile: LinearTile | TiledLinear,
              init_fn: Callable[[nn.Module], None], is_hf: bool) -> None:  # fmt: skip
    """Initialize a tile (or a tiled layer's bias) as the model initializes the layer it
    came from; zero-init calls this instead of ``init_fn`` for these modules.

    HF models: ``init_fn`` runs on a stand-in of the original class (``nn.Linear`` or
    ``Conv1D``) holding the tile's weight, then on the layer's parent with the stand-in in the
    layer's place and every other parameter hidden, so name-based rules of the parent
    (GPT-2 scales ``c_proj``) apply to the tile as they would to the whole weight; for a
    ``TiledLinear`` the stand-in holds its bias and a meta weight. Others:
    ``reset_parameters()`` (with the whole layer's fan-in)."""
    if isinstance(tile, TiledLinear):
        if is_hf:
            init_fn(_stand_in(tile, None))
        elif tile.bias is not None:
            tile.reset_parameters()  # the tiles' own weights are hidden (empty) here
        return
    if not is_hf:
        tile.reset_parameters()
        return
    path = next(n for n, m in model.named_modules() if m is tile)
    layer_name = path.rsplit(".tiles.", 1)[0]
    layer: TiledLinear = model.get_submodule(layer_name)
    parent_name, _, attr = layer_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else None
    stand_in = _stand_in(layer, tile)
    init_fn(stand_in)
    if parent is None:
        return
    others = [p for p in parent.parameters() if p is not tile.weight]
    saved = [p.data for p in others]
    for p in others:
        p.data = torch.empty(0, dtype=p.dtype, device=tile.weight.device)
    parent._modules[attr] = stand_in
    try:
        init_fn(parent)
    finally:
        parent._modules[attr] = layer
        for p, d in zip(others, saved):
            p.data = d


def _stand_in(layer: TiledLinear, tile: LinearTile | None) -> nn.Module:
    """A module of the original class whose weight is ``tile.weight`` (no bias), or with
    ``tile`` None the layer's bias and a meta weight."""
    cls = layer.original_class
    if cls is None:
        raise ValueError(
            "a TiledLinear with layout='conv1d' built directly cannot be initialized by an HF "
            "model's init; build it with TiledLinear.from_linear(conv1d)"
        )
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    if tile is None:
        stand_in.weight = nn.Parameter(layer.weight, requires_grad=False)  # meta
        stand_in.register_parameter("bias", layer.bias)
        rows, cols = layer.weight_shape
    else:
        stand_in.weight = tile.weight
        stand_in.register_parameter("bias", None)
        rows, cols = tile.weight.shape
    if layer.layout == "linear":
        stand_in.out_features, stand_in.in_features = rows, cols
    else:
        stand_in.nx, stand_in.nf = rows, cols
    return stand_in
