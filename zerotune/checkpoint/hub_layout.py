"""The names and tensors ``save_pretrained`` writes for a model, from its own parameters.

[Note: the hub layout on export]
transformers 5 trains some models in another layout than their checkpoints: a Mixtral's
experts are one `experts.gate_up_proj` parameter, its checkpoint one `w1`/`w3` tensor per
expert; LLaVA's towers live under `model.` and are saved without it ([Note: converted
checkpoints]). `save_pretrained` reverts its conversion table when it writes, so a
checkpoint keeps the layout the hub and other tools read. An export writes what
`save_pretrained` writes, so it does the same, with the same reversed table
(`HubLayout`):
- a renamed parameter is streamed as any other, under its checkpoint name;
- one parameter of stacked experts that the converter splits (`Group.rows`) is written
  expert by expert: each expert's row is converted alone;
- any other converted group (the parameters one reversed converter reads) is written where
  its last member comes in the model's order: its members are held whole, in the export
  dtype, until then, and the converter's own operations make the checkpoint tensors.
The file layout is known before any data: the reversal runs on meta tensors first. Memory
beyond the streaming export is one expert's row and tensors, or one group's members and
outputs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ..init.converted import ParamShapes, run_converter

__all__ = ["HubLayout", "has_hub_layout", "meta_model"]


@dataclass
class Group:
    """Parameters one reversed converter turns into checkpoint tensors."""

    key: str
    converter: object
    members: list[tuple[str, str]] = field(default_factory=list)  # (pattern, parameter)
    outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    # One parameter of stacked experts that the converter splits expert by expert: per
    # expert, the names of its tensors in writing order (None: written whole).
    rows: list[list[str]] | None = None


class HubLayout:
    """``save_pretrained``'s names for ``entries`` (``(name, shape)`` in the model's order):
    ``name(p)`` for a parameter written alone, ``group_at(p)`` for the group written once
    ``p`` has come (its last member), ``in_group(p)`` for a member of a group."""

    def __init__(self, model: nn.Module | None, entries: list[tuple[str, tuple[int, ...]]]):
        # Converters that ask for a parameter's shape get it from ``entries`` (a live
        # engine's parameters are sharded, tiled weights are tiles).
        self.model = ParamShapes(model, dict(entries)) if model is not None else None
        self._names: dict[str, str] = {}
        self._member_of: dict[str, Group] = {}
        self._last: dict[str, Group] = {}
        self._renamings: list = []
        transforms = _reversed_conversions(model) if model is not None else []
        if not transforms:
            return
        from transformers.core_model_loading import (
            WeightConverter,
            apply_converters,
            apply_renamings,
        )

        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        groups: dict[str, Group] = {}
        for name, _ in entries:
            key, pattern = apply_converters(name, converters)
            if pattern is None:
                self._names[name] = apply_renamings(name, self._renamings)
                continue
            group = groups.setdefault(key, Group(key, by_pattern[pattern]))
            group.members.append((pattern, name))
            self._member_of[name] = group
        shapes = dict(entries)
        for group in groups.values():
            self._last[group.members[-1][1]] = group
            metas = {n: torch.empty(shapes[n], device="meta") for _, n in group.members}
            group.outputs = [(n, tuple(t.shape)) for n, t in self.convert(group, metas).items()]
            group.rows = self._rows(group, shapes[group.members[0][1]])

    def _rows(self, group: Group, shape: tuple[int, ...]) -> list[list[str]] | None:
        """Per expert, its tensors' names, when ``group`` is one parameter of experts stacked
        along dim 0 that the converter splits (SplitModulelist(0), after at most a Chunk
        along another dim): expert e's tensors are then those of row e converted alone."""
        from transformers.core_model_loading import Chunk, SplitModulelist

        ops = group.converter.operations
        if len(group.members) != 1 or not (type(ops[-1]) is SplitModulelist and ops[-1].dim == 0):
            return None
        if not all(type(op) is Chunk and op.dim >= 1 for op in ops[:-1]) or shape[0] < 2:
            return None
        one = {group.members[0][1]: torch.empty((1, *shape[1:]), device="meta")}
        first = list(self.convert(group, one))  # expert 0's names
        marks = [t.replace("*", "0") for t in group.converter.target_patterns if "*" in t]

        def of(name: str, e: int) -> str:
            mark = next((m for m in marks if m in name), None)
            return name if mark is None else name.replace(mark, mark.replace(".0.", f".{e}."), 1)

        rows = [[of(name, e) for name in first] for e in range(shape[0])]
        return rows if [n for row in rows for n in row] == [n for n, _ in group.outputs] else None

    def convert_row(self, group: Group, e: int, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert ``e``'s checkpoint tensors from its row (shape ``(1, ...)``) of the group's
        parameter (``group.rows`` set), in writing order."""
        built = self.convert(group, {group.members[0][1]: row})
        return dict(zip(group.rows[e], built.values()))

    def name(self, param: str) -> str:
        return self._names.get(param, param)

    def in_group(self, param: str) -> bool:
        return param in self._member_of

    def group_at(self, param: str) -> Group | None:
        return self._last.get(param)

    def convert(self, group: Group, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of ``group`` from its members' whole tensors, in a fixed order."""
        from transformers.core_model_loading import apply_renamings, dot_natural_key

        members = [(p, name, tensors[name]) for p, name in group.members]
        built = run_converter(group.converter, group.key, members, self.model)
        out = {apply_renamings(k, self._renamings): v for k, v in built.items()}
        return {k: out[k] for k in sorted(out, key=dot_natural_key)}


def _reversed_conversions(model: nn.Module) -> list:
    """transformers' conversion table for a model built from its config, reversed, as
    ``save_pretrained`` applies it (no legacy renamings, no prefix changes)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return []
    try:
        forward = get_model_conversion_mapping(model, add_legacy=False)
    except (AttributeError, TypeError):  # not a transformers model
        return []
    forward = [t for t in forward if not isinstance(t, PrefixChange)]
    return [t.reverse_transform() for t in forward[::-1]]


def has_hub_layout(model: nn.Module) -> bool:
    """Whether ``save_pretrained`` writes ``model`` in another layout than its parameters'
    (what a checkpoint's manifest records, so that an export builds the model only then)."""
    if "transformers" not in sys.modules:  # not a transformers model: nothing to import
        return False
    return bool(_reversed_conversions(model))


def meta_model(config_json: bytes) -> nn.Module | None:
    """The transformers model a checkpoint's config.json describes, on the meta device (None
    when it names none transformers can build)."""
    import json

    from ..init.construct import build_from_config

    try:
        from transformers import AutoConfig

        data = json.loads(config_json)
        config = AutoConfig.for_model(**data)
        with torch.device("meta"):
            return build_from_config(config, None)
    except Exception:  # noqa: BLE001 - no model: the export keeps the parameters' names
        return None
