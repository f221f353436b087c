"""fp16 dynamic loss scaling.

[Note: two loss-scale rules]
Both rules multiply the loss by ``scale``, skip the step on overflow, and never go below
``min_scale``; they differ in when the scale moves:
- "torch" (torch's GradScaler, what the plain Trainer uses): each overflow halves the scale;
  after ``window`` good steps in a row it doubles.
- "deepspeed" (DeepSpeed's DynamicLossScaler, for a DeepSpeed config): an overflow halves the
  scale only once ``hysteresis`` overflows have used up the budget (each one before that
  counts it down); the scale doubles when the good steps since the last overflow, not
  counting the current one, reach a multiple of ``window``, and the budget refills then
  (with ``consecutive_hysteresis``, at every good step instead). DeepSpeed stops the run
  when the scale is at its minimum and overflows again; here it stays at the minimum.
tests/test_deepspeed_configs.py drives DeepSpeed's own class with the same overflows.
"""

from __future__ import annotations

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Multiply the loss by ``scale``; on overflow skip the step and lower the scale, after
    good steps raise it ([Note: two loss-scale rules])."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        window: int = 1000,
        min_scale: float = 1.0,
        rule: str = "torch",
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
    ):
        self.scale = float(init_scale)
        self.window = window
        self.min_scale = float(min_scale)
        self.rule = rule
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.good_steps = 0
        self.overflows = 0
        # The deepspeed rule's counters: steps seen, the last overflow's step, budget left.
        self.steps = 0
        self.last_overflow = -1
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        if self.rule == "deepspeed":
            self._update_deepspeed(overflow)
        elif overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.overflows += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2.0

    def _update_deepspeed(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.steps
            self.overflows += 1
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.steps - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.steps += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "overflows": self.overflows,
            "steps": self.steps,
            "last_overflow": self.last_overflow,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows = int(state["overflows"])
        # Checkpoints written before the deepspeed rule hold only the three above.
        self.steps = int(state.get("steps", self.good_steps))
        self.last_overflow = int(state.get("last_overflow", -1))
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
