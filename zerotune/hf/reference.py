"""TRL's ``sync_ref_model`` for sharded models: the reference model's shards mixed with the
trained model's.

[Note: syncing the reference model]
With ``sync_ref_model=True`` TRL's DPO, KTO, GRPO and RLOO trainers move the reference
model towards the trained one every ``ref_model_sync_steps`` steps: each reference weight
becomes ``(1 - alpha) * ref + alpha * model`` (``ref_model_mixup_alpha``). TRL's callback
does it parameter by parameter on ``param.data``; at stage 3 those are empty placeholders
between forwards, so it would mix nothing and say nothing. ZeroTrainer puts this callback
in its place. Both models are sharded by the same arguments into the same units, so the
mix is elementwise on each rank's slices: the trained model's fp32 master (its optimizer's,
wherever its tier keeps it) and the reference's, written back through
``load_unit_state``, which also brings the reference's compute-dtype copy on its tier up to
date. No rank talks to another but for gathered (persistent) units, and no model is ever
gathered whole. The mix runs in fp32 from the masters, where TRL's mixes the parameters in
their own dtype: the same numbers in fp32, closer ones in bf16.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..sharding import ZeroEngine


def engine_of(model) -> ZeroEngine:
    engine = model if isinstance(model, ZeroEngine) else getattr(model, "_zerotune_engine", None)
    if engine is None:
        raise ValueError("sync_ref_model: the model is not sharded by zerotune")
    return engine


def check_same_layout(engine: ZeroEngine, ref: ZeroEngine) -> None:
    """Refuse a reference model whose units do not match the trained model's slot by slot."""

    def layout(e: ZeroEngine) -> list:
        return [(u.shard_numel, [(s.name, s.offset, s.numel) for s in u.slots]) for u in e.units]

    if (engine.world, engine.rank) != (ref.world, ref.rank) or layout(engine) != layout(ref):
        raise ValueError(
            "sync_ref_model: the reference model is not sharded like the trained model (other "
            "parameters or another zero configuration); give both the same architecture"
        )


@torch.no_grad()
def mix_into_reference(engine: ZeroEngine, ref: ZeroEngine, alpha: float) -> None:
    """``ref = (1 - alpha) * ref + alpha * model``, unit by unit on this rank's slices (see
    [Note: syncing the reference model]). Every rank must call it."""
    check_same_layout(engine, ref)
    for unit, ref_unit in zip(engine.units, ref.units):
        trained = engine.unit_state(unit)["master"]
        mixed = ref.unit_state(ref_unit)["master"].float().mul(1.0 - alpha)
        mixed.add_(trained.to(mixed.device, torch.float32), alpha=alpha)
        ref.load_unit_state(ref_unit, {"master": mixed})


class SyncReferenceShards(TrainerCallback):
    """TRL's ``SyncRefModelCallback`` for sharded models (ZeroTrainer adds it in that one's
    place): every ``ref_model_sync_steps`` steps the reference model's shards are mixed with
    the trained model's."""

    def __init__(self, ref_model) -> None:
        self.ref_model = ref_model

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            engine = engine_of(model)
            mix_into_reference(engine, engine_of(self.ref_model), args.ref_model_mixup_alpha)


def replaces_trl_sync(callback) -> bool:
    """Whether ``callback`` is TRL's ``SyncRefModelCallback`` (an instance or the class)."""
    cls = callback if isinstance(callback, type) else type(callback)
    return any(
        c.__name__ == "SyncRefModelCallback" and c.__module__.startswith("trl.")
        for c in cls.__mro__
    )
