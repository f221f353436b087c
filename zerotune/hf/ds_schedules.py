"""DeepSpeed's learning-rate schedules as torch ``LRScheduler``s, stepped as DeepSpeed's engine
steps them under transformers (a DeepSpeed config's ``scheduler`` section, read in
deepspeed.py).

[Note: DeepSpeed schedules]
Under transformers a DeepSpeed scheduler section is built and stepped by DeepSpeed's engine,
not the Trainer; `DeepSpeedSchedule` (warmups) and `DeepSpeedCycle` (OneCycle, LRRangeTest)
give the same learning rate at every step:
- Its constructor already sets the rate, to `warmup_min_lr` (0 for "auto"; a ratio of 0 for
  WarmupCosineLR), and each step's `step()` moves it to the value for iteration
  `step - 1`: the first update runs at the minimum, and with the log warmup (the default)
  the second does too. Iteration i of the warmup is `log(i + 1) / log(N)` of the way up
  (`i / N` for "linear"), N = max(2, warmup_num_steps).
- "auto" values are transformers': warmup_min_lr 0, warmup_max_lr the learning rate,
  total_num_steps the run's steps, warmup_num_steps max(1, the Trainer's warmup steps).
  Given values of the last three must equal those (checked when the schedule is built,
  as transformers does); a key left out takes DeepSpeed's default (1000 warmup steps).
- OneCycle with `cycle_momentum` sets each group's betas to (momentum, 0.99) too, as
  DeepSpeed does, for an optimizer that has betas; a momentum that would leave [0, 1)
  within the run is refused when the schedule is built. Its keys have no "auto".
- The rate is a torch `LRScheduler`'s, so the Trainer steps it after each update (not
  after a skipped fp16 step, as DeepSpeed), logs it, and zerotune's checkpoints keep it.
- `--lr_scheduler_type` and warmup's shape are then DeepSpeed's, as under transformers.
  The rate logged is the one the step used; under DeepSpeed transformers logs the next.
`tests/test_deepspeed_configs.py` runs DeepSpeed's own classes in a plain Trainer as the
reference.
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from ..config import ConfigError

__all__ = ["SCHEDULES", "DeepSpeedCycle", "DeepSpeedSchedule"]

# The schedules zerotune runs: the keys each takes, with DeepSpeed's defaults
# (deepspeed.runtime.lr_schedules; None: required, or the optimizer's learning rate).
SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0,
                       "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8,
                 "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000,
                    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False},
}  # fmt: skip


class DeepSpeedSchedule(LRScheduler):
    """DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR, stepped as its engine steps
    them under the Trainer ([Note: DeepSpeed schedules]). ``params`` as DeepSpeed takes them
    (no "auto" left)."""

    def __init__(self, optimizer, kind: str, params: dict[str, Any]):
        p = {**SCHEDULES[kind], **params}
        self.kind = kind
        self.warmup_type: str = p["warmup_type"]
        self.warmup_num_steps: int = max(2, p["warmup_num_steps"])
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        self.total_num_steps: int | None = p.get("total_num_steps")
        groups = optimizer.param_groups
        self.min_lrs = _per_group(p.get("warmup_min_lr", 0.0), groups, "warmup_min_lr")
        top = p.get("warmup_max_lr")
        self.max_lrs = _per_group([g["lr"] for g in groups] if top is None else top, groups,
                                  "warmup_max_lr")  # fmt: skip
        self.warmup_min_ratio: float = p.get("warmup_min_ratio", 0.0)
        self.cos_min_ratio: float = p.get("cos_min_ratio", 0.0)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        step = self.last_epoch - 1  # DeepSpeed's last_batch_iteration
        if self.kind == "WarmupCosineLR":
            ratio = 0.0 if step < 0 else self._cosine_ratio(step)
            return [lr * ratio for lr in self.base_lrs]
        if step < 0:
            return list(self.min_lrs)
        gamma = self._gamma(step)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _warmup(self, step: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warmup * math.log(step + 1)
        return step / self.warmup_num_steps

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self._warmup(step)
        if self.kind == "WarmupDecayLR":
            left = float(self.total_num_steps - step)
            return max(0.0, left / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))
        return 1.0

    def _cosine_ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(step) * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / span)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)


class DeepSpeedCycle(LRScheduler):
    """DeepSpeed's OneCycle (learning rate and, with ``cycle_momentum``, Adam's betas) or
    LRRangeTest, stepped as its engine steps them under the Trainer ([Note: DeepSpeed
    schedules]); ``params`` as DeepSpeed takes them."""

    def __init__(self, optimizer, kind: str, params: dict[str, Any]):
        p = {**SCHEDULES[kind], **params}
        groups = optimizer.param_groups
        self.kind = kind
        if kind == "LRRangeTest":
            self.min_lrs = _per_group(p["lr_range_test_min_lr"], groups, "lr_range_test_min_lr")
            self.step_size: int = p["lr_range_test_step_size"]
            self.step_rate: float = p["lr_range_test_step_rate"]
            self.staircase: bool = p["lr_range_test_staircase"]
            self.momentum = False
        else:
            first, second = p["cycle_first_step_size"], p["cycle_second_step_size"]
            first, second = float(first), float(first if second is None else second)
            self.first_size, self.second_size, self.total_size = first, second, first + second
            self.first_stairs: int = p["cycle_first_stair_count"]
            self.second_stairs: int = (self.first_stairs if p["cycle_second_stair_count"] is None
                                       else p["cycle_second_stair_count"])  # fmt: skip
            self.decay_size: float = p["decay_step_size"]
            self.min_lrs = _per_group(p["cycle_min_lr"], groups, "cycle_min_lr")
            self.max_lrs = _per_group(p["cycle_max_lr"], groups, "cycle_max_lr")
            self.lr_decay: float = p["decay_lr_rate"]
            self.mom_decay: float = p["decay_mom_rate"]
            # As DeepSpeed: betas cycle only for an optimizer that has them; beta2 is 0.99.
            self.momentum = bool(p["cycle_momentum"]) and "betas" in optimizer.defaults
            self.min_moms = _per_group(p["cycle_min_mom"], groups, "cycle_min_mom")
            self.max_moms = _per_group(p["cycle_max_mom"], groups, "cycle_max_mom")
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        step = self.last_epoch - 1  # DeepSpeed's last_batch_iteration
        if step < 0:
            return list(self.min_lrs)
        if self.kind == "LRRangeTest":
            interval = (step + 1) / self.step_size
            rise = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
            return [lr * rise for lr in self.min_lrs]
        if step < self.total_size:
            scale = self._scale(step)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = self._decay(self.lr_decay, step)
        return [lr / factor for lr in self.min_lrs]

    def _betas(self, step: int) -> list[tuple[float, float]]:
        if step < 0:
            moms = self.min_moms
        elif step < self.total_size:
            scale = self._scale(step)
            moms = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        else:
            factor = self._decay(self.mom_decay, step)
            moms = [m * factor for m in self.max_moms]
        return [(m, 0.99) for m in moms]

    def _decay(self, rate: float, step: int) -> float:
        """The factor after the cycle (1 where DeepSpeed skips the decay)."""
        if math.isclose(self.decay_size, 0) or math.isclose(rate, 0):
            return 1.0
        return 1 + rate * (step - self.total_size + 1) / self.decay_size

    def check_betas(self, num_training_steps: int) -> None:
        """Refuse a momentum that leaves [0, 1) within the run (DeepSpeed would hand it to
        the optimizer): the cycle stays between its bounds, the decay moves one way."""
        if not self.momentum:
            return
        for step in (-1, 0, self.total_size - 1, num_training_steps - 2):
            if not all(0 <= beta1 < 1 for beta1, _ in self._betas(int(step))):
                raise ConfigError(
                    "--deepspeed: OneCycle's momentum (Adam's beta1) leaves [0, 1) within the "
                    f"run's {num_training_steps} steps (cycle_min_mom, cycle_max_mom, "
                    "decay_mom_rate and decay_step_size)"
                )

    def _scale(self, step: int) -> float:
        """Where iteration ``step`` is in its cycle: 0 at the bottom, 1 at the top."""
        at = step + 1
        x = 1.0 + at / self.total_size - math.floor(1 + at / self.total_size)
        ratio = self.first_size / self.total_size
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:
            inside = at % self.total_size
            if inside <= self.first_size:
                position = inside * stairs / self.first_size
            else:
                position = (self.total_size - inside) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def step(self, epoch=None) -> None:
        """The rate, then the betas (a checkpoint restores both with the groups)."""
        super().step(epoch)
        if self.momentum:
            for group, betas in zip(self.optimizer.param_groups, self._betas(self.last_epoch - 1)):
                group["betas"] = betas


def _per_group(value, groups, name: str) -> list[float]:
    if isinstance(value, list):
        if len(value) != len(groups):
            raise ConfigError(
                f"--deepspeed: scheduler.params.{name} lists {len(value)} values for "
                f"{len(groups)} parameter groups"
            )
        return [float(v) for v in value]
    return [float(value)] * len(groups)
