"""TRL's BEMA callback over sharded parameters.

[Note: BEMA over shards]
TRL's ``BEMACallback`` (bias-corrected EMA of the weights) keeps, for every trainable
parameter, a snapshot theta_0 and an EMA, and a whole "running" model that receives
``ema + alpha * (theta_t - theta_0)`` every ``update_freq`` steps and is saved to
``<output_dir>/bema`` at the end; its experimental subclass can also copy the running
weights into the reference model. It reads ``param`` and ``model.state_dict()``, which at
stage 3 are empty placeholders between forwards. ZeroTrainer keeps TRL's callback object
(its settings, its place among the callbacks) and points its events at ``ShardedBEMA``:
theta_0 and the EMA are this rank's fp32 slices of each unit (on the callback's
``device``), theta_t is the trained model's master (``unit_state(master_only=True)``), the
running model is a frozen sharded copy (``copy_sharded``) written with ``load_unit_state``,
the reference is overwritten from it unit by unit, and the end writes it with ``save_hf``.
Every step is elementwise, so each rank works on its own slices; in fp32 the weights are
TRL's, in bf16 they come from the fp32 master where TRL reads the bf16 parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import save_hf
from ..init import copy_sharded
from ..sharding import ZeroEngine


class ShardedBEMA:
    """The events of TRL's ``BEMACallback`` ``callback`` over ``engine``'s shards (see
    [Note: BEMA over shards]); ``attach`` puts them in the callback's place."""

    def __init__(self, callback, engine: ZeroEngine) -> None:
        self.trl, self.engine = callback, engine
        self.device = torch.device(callback.device)
        self.running: ZeroEngine | None = None
        self.theta0: dict[int, torch.Tensor] = {}
        self.ema: dict[int, torch.Tensor] = {}

    def attach(self) -> None:
        for event in ("on_train_begin", "on_step_end", "on_train_end"):
            setattr(self.trl, event, getattr(self, event))

    def _theta(self, unit) -> torch.Tensor:
        master = self.engine.unit_state(unit, master_only=True)["master"]
        return master.to(self.device, torch.float32, copy=True)

    def _snapshot(self) -> None:
        """theta_0 and the EMA start from the weights now."""
        for unit in self.engine.units:
            self.theta0[unit.index] = self._theta(unit)
            self.ema[unit.index] = self.theta0[unit.index].clone()

    @torch.no_grad()
    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if self.running is not None:
            self.running.close()
        self.running = copy_sharded(self.engine, frozen=True)
        self._snapshot()

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs) -> None:
        bema, step = self.trl, state.global_step
        if step == bema.update_after:
            self._snapshot()
        elif step > bema.update_after and (step - bema.update_after) % bema.update_freq == 0:
            age = bema.lag + bema.multiplier * step
            beta = max(age ** (-bema.ema_power), bema.min_ema_multiplier)
            alpha = age ** (-bema.bias_power)
            for unit, twin in zip(self.engine.units, self.running.units, strict=True):
                theta = self._theta(unit)
                ema = self.ema[unit.index].mul_(1 - beta).add_(theta, alpha=beta)
                running = ema + alpha * (theta - self.theta0[unit.index])
                self.running.load_unit_state(twin, {"master": running})
        after = getattr(bema, "ref_model_update_after", 0)
        every = getattr(bema, "ref_model_update_freq", 1)
        if (
            getattr(bema, "update_ref_model", False)
            and step >= after
            and (step - after) % every == 0
        ):
            from .companions import engine_of, mix_into_reference

            ref = kwargs.get("ref_model")
            if ref is None:
                raise ValueError("BEMACallback(update_ref_model=True) needs a reference model")
            mix_into_reference(self.running, engine_of(ref), 1.0)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.running is not None:
            save_hf(
                self.running, Path(args.output_dir) / "bema", dtype=torch.float32, overwrite=True
            )
