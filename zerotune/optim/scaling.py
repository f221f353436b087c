"""fp16 dynamic loss scaling."""

from __future__ import annotations

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Multiply the loss by ``scale``; on overflow skip the step and halve the scale,
    after ``window`` good steps in a row double it."""

    def __init__(self, init_scale: float = 2.0**16, window: int = 1000, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.window = window
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows = int(state["overflows"])
