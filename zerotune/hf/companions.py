"""The models a trainer keeps beside the trained one (TRL's reference model, a distilling
teacher, reward models): sharded like it and frozen; and TRL's ``sync_ref_model``.

[Note: models beside the trained one]
TRL's DPO, KTO, GRPO (with a KL term) and RLOO keep a reference model, its
DistillationTrainer a teacher, often larger than the student, and GRPO and RLOO may score
with reward models. Left alone they would sit whole on every rank. ZeroTrainer shards each
(``self.ref_model`` as it is assigned; a teacher, module or folder, and the modules among
``reward_funcs`` given to the constructor, before the subclass places them on the device)
with the trained model's arguments: frozen, without optimizer, without an fp32 master. A
model sharded already is used as it is; the trained model itself (SDPO's live teacher) is
no companion. Replacing one closes the engine built for the one before. A teacher's head
is special: TRL computes its logits chunk by chunk from ``get_output_embeddings().weight``
outside the teacher's forward, where a sharded unit holds nothing, so the unit holding that
weight stays gathered for as long as the teacher is in use (a mix written into it while
held is fetched again). The memory estimate covers the trained model only, so its check
after the first step is skipped while such a model is held.

[Note: syncing the reference model]
With ``sync_ref_model=True`` TRL's DPO, KTO, GRPO and RLOO trainers move the reference
model towards the trained one every ``ref_model_sync_steps`` steps: each reference weight
becomes ``(1 - alpha) * ref + alpha * model`` (``ref_model_mixup_alpha``); SDPO's EMA
teacher does the same on its own schedule, through a subclass of the same callback. TRL
mixes parameter by parameter on ``param.data``; at stage 3 those are empty placeholders
between forwards, so it would mix nothing or fail on shapes. ZeroTrainer keeps the
callback and its schedule and points its ``sync_target_model`` at a mix of shards (a
subclass that mixes in its own way is refused). Both models are sharded by the same
arguments into the same units, so the mix is elementwise on each rank's slices, in fp32:
the trained model's master (its optimizer's, wherever its tier keeps it) and the
reference's parameters, written back to the reference's tier through ``load_unit_state``.
No rank talks to another but for gathered (persistent) units, and no model is gathered
whole. In bf16 the reference is rounded to bf16 after each mix, as TRL's is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from torch import nn

from ..sharding import ZeroEngine

TEACHER = "teacher_model"


class Companions:
    """The frozen models beside the trained one, by the attribute that holds them
    (``ref_model``, ``teacher_model``, ``reward_funcs[i]``); see [Note: models beside the
    trained one].
    ``build(model, **options)``: a frozen engine for a module or a folder, with the trainer's
    arguments."""

    def __init__(self, build: Callable[..., ZeroEngine]) -> None:
        self.build = build
        self.engines: dict[str, ZeroEngine] = {}  # the engine of each model held
        self.built: dict[str, ZeroEngine] = {}  # those built here: closed when let go
        self.holds: dict[str, contextlib.ExitStack] = {}  # units kept gathered

    def assign(self, role: str, model, **build):
        """What ``self.<role> = model`` keeps: the sharded module, or ``model`` itself when
        it is not a model (None, a client of a teacher server); ``build``: options for
        ``self.build``."""
        current = self.engines.get(role)
        if current is not None and model is current.module:
            return model
        self.let_go(role)
        engine = getattr(model, "_zerotune_engine", None) if isinstance(model, nn.Module) else None
        if not isinstance(engine, ZeroEngine):
            engine = None  # a deep copy of a sharded model is built afresh (copy_sharded)
        if engine is None and isinstance(model, (nn.Module, str, os.PathLike)):
            engine = self.built[role] = self.build(model, **build)
        elif engine is None:
            return model
        self.engines[role] = engine
        if role == TEACHER:
            self.holds[role] = keep_head_gathered(engine)
        return engine.module

    def let_go(self, role: str) -> None:
        hold = self.holds.pop(role, None)
        if hold is not None:
            hold.close()
        self.engines.pop(role, None)
        built = self.built.pop(role, None)
        if built is not None:
            built.close()

    def close(self) -> None:
        for role in list(self.engines):
            self.let_go(role)


def keep_head_gathered(engine: ZeroEngine) -> contextlib.ExitStack:
    """Keep the unit holding the model's output embedding gathered until the stack closes
    (every rank calls it together)."""
    stack = contextlib.ExitStack()
    module = engine.module
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is not None:
        weights = list(head.named_parameters(recurse=False))  # the parameters, not copies
        stack.enter_context(engine.gathered([p for _, p in weights]))  # their units
    return stack


def engine_of(model) -> ZeroEngine:
    engine = model if isinstance(model, ZeroEngine) else getattr(model, "_zerotune_engine", None)
    if engine is None:
        raise ValueError("sync_ref_model: the model is not sharded by zerotune")
    return engine


def check_same_layout(engine: ZeroEngine, ref: ZeroEngine) -> None:
    """Refuse a reference model whose units do not match the trained model's slot by slot."""

    def layout(e: ZeroEngine) -> list:
        return [u.layout() for u in e.units]

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
        trained = engine.unit_state(unit, master_only=True)["master"]
        mixed = ref.unit_state(ref_unit)["master"].float().mul(1.0 - alpha)
        mixed.add_(trained.to(mixed.device, torch.float32), alpha=alpha)
        ref.load_unit_state(ref_unit, {"master": mixed})


def trl_class(obj, name: str) -> type | None:
    """TRL's class ``name`` when ``obj`` (an instance or a class) is one or a subclass's."""
    cls = obj if isinstance(obj, type) else type(obj)
    return next((c for c in cls.__mro__ if c.__name__ == name and c.__module__[:4] == "trl."), None)


def mix_shards(model, target_model, alpha: float) -> None:
    """TRL's ``sync_target_model(model, target_model, alpha)`` for sharded models."""
    mix_into_reference(engine_of(model), engine_of(target_model), alpha)


def sync_shards(callback, engine: ZeroEngine | None) -> None:
    """Point TRL's sync callback (or a subclass's) at the shards: its schedule stays, its
    ``sync_target_model`` becomes ``mix_shards`` ([Note: syncing the reference model])."""
    base = trl_class(callback, "SyncRefModelCallback")
    if type(callback).sync_target_model is not base.sync_target_model:
        raise ValueError(
            f"{type(callback).__name__} mixes the reference model in its own "
            "sync_target_model, which sees only empty placeholders of sharded parameters; "
            "leave sync_target_model to TRL's SyncRefModelCallback"
        )
    if callback.ref_model is not None and engine is not None:
        check_same_layout(engine, engine_of(callback.ref_model))
    callback.sync_target_model = mix_shards


def adapt_callback(callback, engine: ZeroEngine | None) -> None:
    """Point TRL's callbacks that read or write whole parameters at the shards: the reference
    syncs ([Note: syncing the reference model]) and, at stage 3, BEMA ([Note: BEMA over
    shards] in hf/bema.py). ``callback`` is an instance."""
    from .bema import ShardedBEMA

    if trl_class(callback, "SyncRefModelCallback") is not None:
        sync_shards(callback, engine)
    elif trl_class(callback, "BEMACallback") and engine is not None and engine.config.stage == 3:
        if not isinstance(getattr(callback.on_step_end, "__self__", None), ShardedBEMA):
            ShardedBEMA(callback, engine).attach()
