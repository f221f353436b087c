"""Who hears of the engine's construction, unit by unit (``zerotune finetune``'s progress bar).

Building a large model's engine (initializing or reading each unit, writing its shards to
their tiers) takes minutes; the engine reports each unit it has placed to the listener set
with ``report_units`` in the calling context, if any.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

__all__ = ["report_units", "unit_built"]

_LISTENER: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "units_built", default=None
)


@contextlib.contextmanager
def report_units(listener: Callable[[int, int], None]) -> Iterator[None]:
    """Engines built inside call ``listener(units placed, units in all)`` after each unit."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def unit_built(done: int, total: int) -> None:
    listener = _LISTENER.get()
    if listener is not None:
        listener(done, total)
