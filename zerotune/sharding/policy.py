"""How a model is cut into sharding units.

A unit is a module whose parameters are sharded, gathered and released together. The default
policy follows Hugging Face: every instance of a class named in ``_no_split_modules`` (the
transformer blocks), every ``nn.Embedding``, and the output head. Models without
``_no_split_modules`` use their direct children that hold parameters. Whatever no unit claims
belongs to the root unit (the model itself). Units never nest: the outermost match wins,
except for modules marked ``_zerotune_own_unit`` (the tiles of a tiled linear, see
[Note: tiling] in tiling.py), which are units wherever they are.

This module reads attributes only; it does not import transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

__all__ = ["UnitSpec", "select_unit_modules"]

UnitSpec = Iterable[str] | Callable[[str, nn.Module], bool] | None


def _default_matcher(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except (AttributeError, NotImplementedError):
            head = None
    if block_names:

        def match(name: str, module: nn.Module) -> bool:
            return (
                type(module).__name__ in block_names
                or isinstance(module, nn.Embedding)
                or (head is not None and module is head)
            )

        return match

    # No block classes declared: the children that hold parameters, looking through
    # containers whose forward is never called (ModuleList, ModuleDict).
    chosen: set[int] = set()
    stack = list(model.children())
    while stack:
        child = stack.pop()
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            stack.extend(child.children())
        elif any(True for _ in child.parameters()):
            chosen.add(id(child))
    return lambda name, module: id(module) in chosen


def select_unit_modules(model: nn.Module, spec: UnitSpec = None) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs that become units, in module order.

    ``spec`` is a list of class names, a predicate ``(name, module) -> bool``, or None for the
    default policy. The root module itself is never returned (it is the root unit).
    """
    if spec is None:
        match = _default_matcher(model)
    elif callable(spec):
        match = spec
    else:
        names = set(spec)
        known = {type(m).__name__ for m in model.modules()}
        unknown = sorted(names - known)
        if unknown:
            raise ValueError(
                f"unit_modules names classes that are not in the model: {unknown}; "
                f"the model has {sorted(known)}"
            )
        match = lambda name, module: type(module).__name__ in names  # noqa: E731

    selected: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module, inside: bool) -> None:
        for child_name, child in module.named_children():
            qualified = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in seen:
                continue
            if getattr(child, "_zerotune_own_unit", False):
                seen.add(id(child))  # a tile (tiling.py): its own unit, even inside another
                selected.append((qualified, child))
            elif not inside and match(qualified, child):
                seen.add(id(child))
                selected.append((qualified, child))
                visit(qualified, child, True)  # only tiles nest
            else:
                visit(qualified, child, inside)

    visit("", model, False)
    return selected
