"""Gather the next units ahead of use, in the order recorded on the first pass.

[Note: prefetch]
The first forward (and the first backward) of a run records the order in which units are
used. Later passes follow that order: when a unit is used, the units after it are gathered
asynchronously while its compute runs, as long as the bytes gathered ahead stay within
``prefetch_bytes``. If a pass uses a unit other than the one the recorded order expects (the
model took another path), the order is re-recorded from that point on, and nothing waits
on a prediction: every unit is still gathered on demand when it is needed. All ranks see the
same sequence of uses, so they issue the same collectives in the same order.
"""

from __future__ import annotations

from .unit import Unit, UnitState

__all__ = ["Prefetcher"]


class Prefetcher:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.orders: dict[str, list[Unit]] = {"forward": [], "backward": []}
        self.recorded: dict[str, bool] = {"forward": False, "backward": False}
        self._pos = {"forward": 0, "backward": 0}
        self.rerecords = 0  # how often a pass left the recorded order

    def start_pass(self, kind: str) -> None:
        if not self.recorded[kind] and self.orders[kind]:
            self.recorded[kind] = True  # the previous pass finished recording
        if not self.recorded[kind]:
            self.orders[kind] = []
        self._pos[kind] = 0

    def on_use(self, kind: str, unit: Unit) -> list[Unit]:
        """Note that ``unit`` is used now; return the units to gather ahead of their use."""
        order, pos = self.orders[kind], self._pos[kind]
        if not self.recorded[kind]:
            order.append(unit)
            self._pos[kind] = pos + 1
            return []
        if pos >= len(order) or order[pos] is not unit:
            # Another path than recorded: keep what matched, record the rest anew.
            del order[pos:]
            order.append(unit)
            self.recorded[kind] = False
            self.rerecords += 1
            self._pos[kind] = pos + 1
            return []
        self._pos[kind] = pos + 1
        if self.budget <= 0:
            return []
        ahead, spent = [], 0
        for nxt in order[pos + 1 :]:
            if nxt.persistent or nxt is unit:
                continue
            spent += nxt.gathered_bytes
            if spent > self.budget:
                break
            if nxt.state is UnitState.SHARDED:
                ahead.append(nxt)
        return ahead
