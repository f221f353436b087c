"""Checkpoint tensors that transformers renames or converts while loading, for the streaming load.

[Note: converted checkpoints]
transformers 5 keeps a table of weight conversions per model type (`conversion_mapping.py`).
Renamings move a tensor to another name: LLaVA's `language_model.` becomes
`model.language_model.`, and Mixtral's `block_sparse_moe.` becomes `mlp.`. Converters build
one parameter from several checkpoint tensors: a Mixtral or Qwen-MoE hub checkpoint's
per-expert `experts.3.w1.weight` are stacked into `experts.gate_up_proj`.

A parameter the checkpoint does not hold under its own name, or holds in another shape
(Qwen3-VL-MoE's experts, transposed on load), is looked up through that table with
transformers' own key renaming (`rename_source_key`), so zerotune and transformers always
agree on which tensors make a parameter and in which order. An operation that asks the
model for a parameter's shape gets it from `ParamShapes`, never from the sharded or tiled
parameters themselves.

A renamed tensor is still read by element range. A converted parameter is built by the
converter's own operations on its source tensors, read in their stored dtype, and dropped
once the unit's slice is copied out. Experts stacked along dim 0 (MergeModulelist, then at
most a Concatenate along another dim: every MoE in the table) are built one expert at a
time, only those the slice covers: the peak beyond the shards is one expert's tensors, and
each rank reads about its own share. Any other conversion is built whole (its peak is the
parameter and its sources), by each rank whose slice needs it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from copy import deepcopy

import torch
from torch import nn

__all__ = ["ConvertedCheckpoint", "ParamShapes", "run_converter"]

Reader = Callable[[int, int, torch.Tensor], None]


class ConvertedCheckpoint:
    """Readers for the parameters ``shapes`` names (name -> full shape) that the checkpoint
    holds renamed, or in tensors transformers converts on load. ``readers`` maps a name to
    ``read(start, stop, out)`` over its flattened elements; ``sources`` lists the
    checkpoint keys used. ``all_shapes``: every parameter's full shape, for conversions that
    ask the model for one."""

    def __init__(
        self,
        model: nn.Module,
        ckpt,
        shapes: dict[str, tuple[int, ...]],
        error: type[Exception],
        all_shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        # The converters ask the model for parameter shapes (Split, Transpose(check_dims)):
        # answered from the full shapes, never from the (sharded or tiled) parameters.
        self.model = ParamShapes(model, {**(all_shapes or {}), **shapes})
        self.ckpt, self.error = ckpt, error
        self.readers: dict[str, Reader] = {}
        self.sources: set[str] = set()
        # A converter's first target name -> (the converter, its (pattern, key) sources, the
        # names it yields); each conversion runs on a fresh copy of the converter.
        self._groups: dict[str, tuple[object, list[tuple[str, str]], list[str]]] = {}
        # A group stacked expert by expert (see _expert_count) -> its number of experts.
        self._experts: dict[str, int] = {}
        self._built: dict[str, torch.Tensor] = {}
        self._built_key: tuple[str, int | None] | None = None
        if not shapes:
            return
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                WeightConverter,
                dot_natural_key,
                rename_source_key,
            )
        except ImportError:  # a transformers without the conversion table
            return
        try:
            mapping = get_model_conversion_mapping(model)
        except (AttributeError, TypeError):  # not a transformers model
            return
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        names = dict.fromkeys(shapes, True)
        prefix = getattr(model, "base_model_prefix", None) or None
        for key in sorted(ckpt.entries, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in shapes:
                continue
            self.sources.add(key)
            if pattern is None:
                if target == key:  # its own name, another shape: no conversion (the caller says)
                    continue
                if target not in self.readers:
                    self._check(target, ckpt.entries[key].shape, shapes[target], key)
                    self.readers[target] = functools.partial(ckpt.read, key)
                continue
            converter = by_pattern[pattern]
            if target not in self._groups:
                first = converter.target_patterns[0]
                yields = [target.replace(first, t, 1) for t in converter.target_patterns]
                self._groups[target] = (converter, [], yields)
                for name in yields:
                    if name in shapes:
                        self.readers[name] = self._converted(target, name)
            self._groups[target][1].append((pattern, key))
        # Each conversion run on meta tensors first: shapes are checked before any is read.
        for group, (_, sources, yields) in self._groups.items():
            built = self._convert(group, meta=True)
            for name in yields:
                if name in shapes:
                    self._check(name, built[name].shape, shapes[name], sources[0][1])
            experts = self._expert_count(group, built)
            if experts:
                self._experts[group] = experts

    def _expert_count(self, group: str, whole: dict[str, torch.Tensor]) -> int:
        """E when ``group`` stacks E experts' tensors along dim 0 and then at most
        concatenates along another dim (MergeModulelist(0), then Concatenate(d >= 1)): expert
        e's own conversion is then row e of the whole one, so a slice is built from the
        experts it covers alone. 0 otherwise (built whole)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        template, sources, _ = self._groups[group]
        ops = template.operations
        if not (type(ops[0]) is MergeModulelist and ops[0].dim == 0) or not all(
            type(op) is Concatenate and op.dim >= 1 for op in ops[1:]
        ):
            return 0
        counts = Counter(p for p, _ in sources)
        experts = next(iter(counts.values()))
        if len(set(counts.values())) != 1 or experts < 2:
            return 0
        one = self._convert(group, meta=True, expert=0)
        if any(tuple(one[n].shape) != (1, *whole[n].shape[1:]) for n in whole):
            return 0
        return experts

    def _check(self, name: str, got, want, key: str) -> None:
        if tuple(got) != tuple(want):
            raise self.error(
                f"{key!r} (read as {name!r}, as transformers converts it on load) gives shape "
                f"{tuple(got)}, the model expects {tuple(want)} (a different model or config?)"
            )

    def _converted(self, group: str, name: str) -> Reader:
        def read(start: int, stop: int, out: torch.Tensor) -> None:
            experts = self._experts.get(group)
            if not experts:
                out.copy_(self._build(group)[name].reshape(-1)[start:stop])
                return
            per = math.prod(self.model.shapes[name]) // experts  # one expert's row
            at = start
            while at < stop:
                e = at // per
                end = min(stop, (e + 1) * per)
                row = self._build(group, e)[name].reshape(-1)
                out[at - start : end - start].copy_(row[at - e * per : end - e * per])
                at = end

        return read

    def _whole(self, key: str, meta: bool) -> torch.Tensor:
        entry = self.ckpt.entries[key]
        tensor = torch.empty(entry.shape, dtype=entry.dtype, device="meta" if meta else "cpu")
        if not meta:
            self.ckpt.read(key, 0, tensor.numel(), tensor.view(-1))
        return tensor

    def _build(self, group: str, expert: int | None = None) -> dict[str, torch.Tensor]:
        if self._built_key != (group, expert):
            self.release()
            self._built = self._convert(group, meta=False, expert=expert)
            self._built_key = (group, expert)
        return self._built

    def _convert(
        self, group: str, meta: bool, expert: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The group's parameters built by its converter, or with ``expert`` only that
        expert's row of each (its own tensor of each source pattern)."""
        template, sources, yields = self._groups[group]
        if expert is not None:
            seen: dict[str, int] = {}
            mine = []
            for p, key in sources:  # in expert order: the natural order of the keys
                if seen.setdefault(p, 0) == expert:
                    mine.append((p, key))
                seen[p] += 1
            sources = mine
        tensors = [(p, key, lambda key=key: self._whole(key, meta)) for p, key in sources]
        try:
            built = run_converter(template, group, tensors, self.model)
        except Exception as exc:  # noqa: BLE001 - one line naming the tensors and the reason
            raise self.error(
                f"cannot convert {len(sources)} checkpoint tensor(s) such as {sources[0][1]!r} "
                f"into {group!r} as transformers does on load: {type(exc).__name__}: {exc}"
            ) from None
        if sorted(built) != sorted(yields):
            raise self.error(
                f"converting checkpoint tensors into {group!r} gave {sorted(built)}, "
                f"expected {yields}"
            )
        return built

    def release(self) -> None:
        """Drop the converted parameter (or expert's row) built last."""
        self._built, self._built_key = {}, None


class ParamShapes:
    """What transformers' conversion ops ask of a model, without touching its parameters:
    ``get_parameter(name)`` is a meta tensor of the parameter's full shape and dtype (a
    tiled weight under its untiled name), ``config`` the model's. A sharded model's own
    parameters are empty, and reading one outside forward gathers it or raises
    ([Note: external parameters])."""

    def __init__(self, model: nn.Module, shapes: dict[str, tuple[int, ...]]):
        self.model, self.shapes = model, shapes
        self.config = getattr(model, "config", None)
        self.dtypes: dict[str, torch.dtype] = {}
        for name, p in model.named_parameters():  # iterates _parameters: reads nothing
            self.dtypes[name] = p.dtype
        self.default_dtype = next(iter(self.dtypes.values()), torch.float32)

    def get_parameter(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise AttributeError(f"`{name}` is not an nn.Parameter")
        dtype = self.dtypes.get(name, self.default_dtype)
        return nn.Parameter(torch.empty(self.shapes[name], dtype=dtype, device="meta"), False)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def run_converter(template, key: str, tensors: list[tuple], model: nn.Module) -> dict:
    """A transformers ``WeightConverter``'s operations, on a fresh copy of ``template``, over
    ``tensors`` ((its source pattern, the tensor's name, the tensor or a function making it))
    collected under ``key``: name -> tensor."""
    converter = deepcopy(template)
    for pattern, name, tensor in tensors:
        converter.add_tensor(key, name, pattern, tensor)
    built = converter.convert(key, model=model, config=model.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in built.items()}
