"""``ZeroTrainer``: the Hugging Face ``Trainer`` running on a zerotune engine.

[Note: how ZeroTrainer plugs into Trainer]
The Trainer keeps its loop, data loading, logging, callbacks, evaluation and schedulers; the
engine replaces what DDP/DeepSpeed would do, through the Trainer's override points:
- ``__init__`` builds the engine before the Trainer sees the model (zero-init for a config,
  a streaming load for a folder or hub id, ``ZeroEngine`` for a built module). ``self.model``
  is the HF model inside the engine; ``ZeroTrainingArguments.place_model_on_device`` is False,
  so the Trainer never moves it.
- ``_wrap_model`` returns the engine, for training and evaluation: the Trainer then skips
  ``accelerator.prepare(model)``, so accelerate adds no DDP. Its ``no_sync(model)`` finds the
  engine's ``no_sync`` for the non-final micro-batches of gradient accumulation.
- ``create_optimizer`` builds ``ZeroAdamW`` (``--optim`` adamw_torch / adamw_8bit, the
  default) or a ``ZeroOptimizer`` over the class the Trainer picks for ``--optim`` (or
  ``optimizer_cls_and_kwargs``) from the Trainer's own decay / no-decay split, by parameter
  *name* (at stage 3 a released parameter has size 0, so shapes cannot be used). An optimizer
  given through ``optimizers=`` was built over the model's parameters: the same class is
  built again over the shards from its groups, and its scheduler is pointed at it.
  The optimizer is marked as prepared, so accelerate's wrapper (which round-trips the state
  dict to move it to the device) leaves it alone; it reports skipped fp16 steps itself.
- ``_clip_grad_norm`` / ``_get_grad_norm`` use the optimizer's global-norm clipping.
- ``training_step``: with the optimizer state on NVMe (no fp16, stage 2-3; ``overlap_step``),
  the last micro-batch of each step runs its backward inside
  ``optimizer.overlapped(track_norm=True)``. Without clipping (``--max_grad_norm 0``, and no
  ``--auto_find_batch_size``) units are updated while backward goes on, and ``_get_grad_norm``
  returns a 0-dim tensor that ``step()`` fills with the norm summed from the gradients the
  updates read (the Trainer logs it after the step, with ``.item()``). With clipping (the
  default), ``clipping=True``: the norm is summed as backward finishes each unit,
  ``_clip_grad_norm`` returns it at once, and the updates run after ``step()`` into the next
  forward.
- Gradients are averaged over ranks as DDP's are, so ``average_tokens_across_devices``
  (each rank's loss scaled by the world size) gives DDP's numbers.
- fp16: the engine's loss scaler multiplies the loss before accelerate's ``backward`` (a
  wrapper set on this trainer's accelerator only); accelerate's own mixed precision is off.
- ``save_model`` writes a consolidated HF folder with ``save_hf`` (all ranks; rank 0 writes).

[Note: ZeroTrainer's checkpoints]
``checkpoint-N/`` holds the Trainer's ``trainer_state.json`` and, in ``checkpoint-N/zero/``, a
zerotune checkpoint (master weights, Adam moments, step counts, scheduler, loss scaler, RNG
states; safetensors and JSON, no pickle), written by ``_save_optimizer_and_scheduler``. Inside a
checkpoint ``save_model`` writes the consolidated model only with ``gather_weights_on_save`` (by
default for models up to 1 GiB) or ``save_only_model``; otherwise the zerotune checkpoint alone
holds the weights (``zerotune export checkpoint-N out`` consolidates them). ``TRAINER_COMPLETE``,
written last (after the fsynced ``trainer_state.json``, before older checkpoints are rotated
out), holds the checksums of ``trainer_state.json`` and of ``zero/COMPLETE``: a folder without
it, or whose files no longer match it, is skipped by ``--resume`` /
``resume_from_checkpoint=True`` (the one before is taken) and refused when named. A save that
fails leaves no folder. Resuming loads everything, at any world size, in
``_load_optimizer_and_scheduler`` once the optimizer and scheduler exist.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PretrainedConfig, Trainer
from transformers.debug_utils import DebugOption, DebugUnderflowOverflow

from .. import dist as zdist
from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_hf
from ..checkpoint.export import export_dtype
from ..estimate import check_estimate
from ..init import copy_sharded, from_pretrained, load_weights, zero_init
from ..init.pretrained import MissingParametersError, resolve_model_folder
from ..memory.probes import accelerator_allocated, current_rss, peak_rss, reset_peak_rss
from ..sharding import ZeroEngine
from ..sharding.copies import CopyOf
from .args import ZeroTrainingArguments
from .checkpoints import (
    TRAINER_MARKER,
    ZERO_DIR,
    capture_rng,
    check_resumable,
    latest_complete_checkpoint,
    mark_complete,
    move_model_files,
    restore_rng,
)
from .companions import TEACHER, Companions, adapt_callback, trl_class
from .configs import describe_config
from .deepspeed import deepspeed_optimizer, deepspeed_schedule
from .generation import gather_for_generation
from .optimizers import (
    ModelGroup,
    ModelParams,
    TrainerAdamW,
    TrainerOptimizer,
    driven_by_trainer,
    embeddings_in_32_bits,
    rebuild_over_shards,
)

__all__ = [
    "TRAINER_MARKER",
    "ZeroTrainer",
    "build_engine",
    "check_resumable",
    "describe_config",
    "latest_complete_checkpoint",
]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

# Checkpoints of a model up to this size also hold its consolidated weights by default.
GATHER_ON_SAVE_BYTES = 2**30


class DebugBeforeRelease(DebugUnderflowOverflow):
    """``--debug underflow_overflow`` whose hooks run before the engine's post-forward hooks,
    while a unit's parameters are still gathered (stage 3 releases them there)."""

    def register_forward_hook(self) -> None:
        self.model.apply(lambda m: m.register_forward_hook(self.forward_hook, prepend=True))


def build_engine(model, args: ZeroTrainingArguments, frozen: bool = False) -> ZeroEngine:
    """The engine for ``model``: a ``ZeroEngine`` or a model it shards (used as is), a built
    ``nn.Module`` (sharded in place), a transformers config (zero-init, seeded with
    ``args.seed``), or a local folder or hub id (pretrained weights streamed into the
    shards). ``frozen``: a module or folder to be only read (no gradients, no master)."""
    device = args.device  # also sets up torch.distributed under torchrun
    config = args.zero
    if isinstance(model, ZeroEngine):
        if model.config != config:
            log.warning(
                "zerotune: the engine given to ZeroTrainer keeps its own config (%s); the "
                "zerotune fields of the arguments (%s) are not applied",
                describe_config(model.config),
                describe_config(config),
            )
        return model
    engine = getattr(model, "_zerotune_engine", None) if isinstance(model, nn.Module) else None
    if isinstance(engine, CopyOf):  # copy.deepcopy of a sharded model (TRL's reference)
        return copy_sharded(engine.source, config, device=device, frozen=frozen)
    if engine is not None:
        # Sharded already (the model of another ZeroTrainer): trained on from its weights,
        # as the plain Trainer does with a model object given twice.
        return build_engine(engine, args)
    if isinstance(model, nn.Module):
        if frozen:
            model.requires_grad_(False)
        for module in model.modules():  # the shards go to `device`; buffers follow
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)
        return ZeroEngine(model, config, device=device)
    if isinstance(model, PretrainedConfig):
        return zero_init(model, config, seed=args.seed, device=device)
    if isinstance(model, (str, os.PathLike)):
        return from_pretrained(model, config, device=device, frozen=frozen)
    raise TypeError(
        "ZeroTrainer needs a model: a ZeroEngine, an nn.Module, a transformers config (random "
        f"init; zerotune.hf.model_config(name) for presets), or a folder / hub id, not {model!r}"
    )


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with ZeRO-1/2/3 sharding and ZeRO-Infinity offload.

    ``model``: a transformers config (zero-init: built one unit at a time, never whole), a
    local HF folder or hub id (weights streamed into the shards), a built ``nn.Module``
    (sharded in place) or a ``ZeroEngine``. ``args`` must be :class:`ZeroTrainingArguments`.
    Everything else is the Trainer's: datasets, collator, callbacks, ``compute_metrics``,
    ``train(resume_from_checkpoint=...)``, ``evaluate()``, ``predict()``, ``save_model()``.
    Call ``close()`` at the end to remove NVMe swap files early (they also go at exit).
    """

    def __init__(self, model=None, args: ZeroTrainingArguments | None = None, **kwargs):
        if args is None:
            args = ZeroTrainingArguments(output_dir="trainer_output")
        if not isinstance(args, ZeroTrainingArguments):
            raise TypeError(
                "ZeroTrainer needs ZeroTrainingArguments (a TrainingArguments subclass with the "
                "zerotune fields), not " + type(args).__name__
            )
        optimizer, scheduler = kwargs.get("optimizers", (None, None))
        if optimizer is not None and kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("pass either optimizers or optimizer_cls_and_kwargs, not both")
        if model is None and kwargs.get("model_init") is None:
            raise ValueError("ZeroTrainer needs a model (a config, a folder, a module or an "
                             "engine) or a model_init")  # fmt: skip
        # Peaks are measured from here: check_estimate compares what the engine and the
        # training add with `zerotune estimate` after the first step.
        reset_peak_rss()
        self._rss_base: int = current_rss()
        self._accel_base: int | None = accelerator_allocated(args.device)
        self._overlap_backward: bool = False  # the next accelerator.backward is a step's last
        self.engine: ZeroEngine | None = None  # with model_init: built by call_model_init
        # The reference model and teacher, sharded and frozen ([Note: models beside the
        # trained one] in hf/companions.py).
        self.companions = Companions(self._build_frozen)
        self._resume_rng: dict | None = None
        self.estimate_warnings: list[str] | None = None  # set after the first step
        self.memory_measured: dict[str, int] | None = None  # what they compared
        self._estimate_hook = None  # see _check_estimate_after_the_first_step
        self._batch_shape: tuple[int, ...] | None = None
        self._debug_overflow: DebugBeforeRelease | None = None  # --debug underflow_overflow
        self.args = args  # call_model_init builds the engine with them
        if model is not None:
            self._use_engine(build_engine(model, args))
            model = self.engine.module
        if self._shards_teacher_first(kwargs.get(TEACHER), args):
            kwargs[TEACHER] = self.companions.assign(TEACHER, kwargs[TEACHER])
        if kwargs.get("reward_funcs") is not None:  # GRPO's and RLOO's reward models
            kwargs["reward_funcs"] = self._shard_reward_models(kwargs["reward_funcs"])
        if optimizer is None or self.engine is None:
            pass  # model_init with optimizers= is the Trainer's to refuse
        elif optimizer is self.engine.optimizer:
            driven_by_trainer(optimizer)  # built over this engine's shards already
        else:
            # Built over the model's parameters: the same class over the shards.
            rebuilt = rebuild_over_shards(self.engine, optimizer, scheduler)
            kwargs["optimizers"] = (rebuilt, scheduler)
        if args.deepspeed_optimizer and not (optimizer or kwargs.get("optimizer_cls_and_kwargs")):
            kwargs["optimizer_cls_and_kwargs"] = deepspeed_optimizer(args.deepspeed_optimizer)
        units = getattr(self.engine, "units", None)
        super().__init__(model=model, args=args, **kwargs)
        if units is not None and self.engine.units is not units:  # resharded by cls.__init__:
            self._use_engine(self.engine)  # an embedding resized (TRL's clone_chat_template)
        if isinstance(getattr(self, "reward_funcs", None), list):  # those TRL loaded too
            self.reward_funcs = self._shard_reward_models(self.reward_funcs)
        for callback in self.callback_handler.callbacks:  # those given to the constructor
            adapt_callback(callback, self.engine)
        if args.world_size != self.engine.world:
            raise ValueError(
                f"the Trainer sees {args.world_size} data-parallel rank(s) but the engine is "
                f"sharded over {self.engine.world}; launch with torchrun and let the arguments "
                "set up torch.distributed before building the engine"
            )

    @property
    def ref_model(self) -> nn.Module | None:
        """The reference model of trainers that keep one (TRL's ``DPOTrainer``): sharded like
        the trained model, and frozen, as it is assigned (see [Note: models beside the
        trained one] in hf/companions.py); None for trainers without one."""
        return self.__dict__.get("_ref_model")

    @ref_model.setter
    def ref_model(self, model: nn.Module | None) -> None:
        self.__dict__["_ref_model"] = self._companion("ref_model", model)

    @property
    def teacher_model(self) -> nn.Module | None:
        """The teacher of trainers that distil (TRL's ``DistillationTrainer``), sharded like
        the reference model; its head's unit stays gathered."""
        return self.__dict__.get("_teacher_model")

    @teacher_model.setter
    def teacher_model(self, model: nn.Module | None) -> None:
        self.__dict__["_teacher_model"] = self._companion(TEACHER, model)

    @property
    def ref_engine(self) -> ZeroEngine | None:
        return self.companions.engines.get("ref_model")

    @property
    def teacher_engine(self) -> ZeroEngine | None:
        return self.companions.engines.get(TEACHER)

    def _build_frozen(self, model, reward: bool = False) -> ZeroEngine:
        """A frozen engine for a companion. ``reward``: a folder or hub id read as TRL reads a
        reward model (a sequence classifier with one label): streamed into shards, or, when
        the checkpoint has no score head, loaded by transformers (the head initialized as
        TRL's is) and sharded."""
        if reward:
            try:
                return self._prepared_frozen(
                    from_pretrained(
                        model,
                        self.args.zero,
                        device=self.args.device,
                        frozen=True,
                        auto_class=AutoModelForSequenceClassification,
                        num_labels=1,
                    )
                )
            except MissingParametersError:
                folder = resolve_model_folder(model)
                model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
        return self._prepared_frozen(build_engine(model, self.args, frozen=True))

    def _prepared_frozen(self, engine: ZeroEngine) -> ZeroEngine:
        self._prepare_forwards(engine)  # a teacher generates too (GKD's seq_kd)
        engine.module._is_accelerate_prepared = True  # placed by the engine: accelerate keeps off
        return engine

    def _companion(self, role: str, model):
        """What ``self.<role> = model`` keeps: the trained model as it is (SDPO's live
        teacher is the student), any other model sharded and frozen."""
        if self.engine is not None and model is self.engine.module:
            self.companions.let_go(role)
            return model
        return self.companions.assign(role, model)

    def _shard_reward_models(self, funcs):
        """The modules among ``reward_funcs`` (one or a list), and the models named there
        (unless TRL's ``model_init_kwargs`` are set: TRL loads those), sharded and frozen like
        a reference model before the subclass loads or places them; the rest as given."""
        trl_loads = bool(getattr(self.args, "model_init_kwargs", None))
        listed = funcs if isinstance(funcs, list) else [funcs]
        for i, f in enumerate(listed):
            if isinstance(f, nn.Module):
                listed[i] = self.companions.assign(f"reward_funcs[{i}]", f)
            elif isinstance(f, (str, os.PathLike)) and not trl_loads:
                listed[i] = self.companions.assign(f"reward_funcs[{i}]", f, reward=True)
        return listed if isinstance(funcs, list) else listed[0]

    @staticmethod
    def _shards_teacher_first(teacher, args) -> bool:
        """A teacher given to the constructor is sharded before the subclass places it on the
        device: a module, or a folder / hub id unless TRL's own loading options are set."""
        if isinstance(teacher, nn.Module):
            return True
        own_loading = ("teacher_model_init_kwargs", "teacher_model_revision")
        return isinstance(teacher, (str, os.PathLike)) and not any(
            getattr(args, name, None) is not None for name in own_loading
        )

    def add_callback(self, callback) -> None:
        """TRL's reference syncs and BEMA would read the placeholders of sharded parameters:
        they work on the shards instead (``adapt_callback``)."""
        if isinstance(callback, type) and trl_class(callback, "BEMACallback"):
            callback = callback()  # made here, to be adapted
        if not isinstance(callback, type):
            adapt_callback(callback, self.engine)
        super().add_callback(callback)

    def _use_engine(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self._prepare_forwards(engine)
        # Counted from the engine: at stage 3 the model's own count sees empty parameters.
        self.num_parameters = sum(s.numel for u in engine.units for s in u.slots)

    def _prepare_forwards(self, engine: ZeroEngine) -> None:
        """``--torch_compile``, and TRL's ``ds3_gather_for_generation`` (default True): the
        whole model gathered once per generate call."""
        self._compile(engine)
        asked = getattr(self.args, "ds3_gather_for_generation", True)
        gathering = engine.config.stage == 3 and asked
        gather_for_generation(engine.module, gathering)

    def _compile(self, engine: ZeroEngine) -> None:
        """``--torch_compile``: the units' forwards compiled, the hooks left eager ([Note:
        compiled units]); what accelerate would compile is the engine, which it never sees.
        Without the flag an engine compiled before (by the user, an earlier trainer) stays so."""
        if self.args.torch_compile:
            engine.compile(
                backend=self.args.torch_compile_backend, mode=self.args.torch_compile_mode
            )

    def call_model_init(self, trial=None):
        """``model_init``'s model, sharded: what it returns (a module, a transformers config
        for zero-init, a folder) goes through ``build_engine``. The Trainer calls it at
        construction and again at each ``train()``; the engine of the model before is
        closed (its swap files removed)."""
        model = super().call_model_init(trial)
        if self.engine is not None and self.engine.module is not model:
            self.engine.close()
        self._use_engine(build_engine(model, self.args))
        return self.engine.module

    # --------------------------------------------------------------- the Trainer's hooks
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The engine wraps the model as DDP would: unwrapping it gives the HF model (the
        # Trainer reads its class name, e.g. to shift labels for label smoothing).
        plain_unwrap = self.accelerator.unwrap_model

        def unwrap_model(model, *args, **kwargs):
            if model is self.engine:
                return self.engine.module
            return plain_unwrap(model, *args, **kwargs)

        self.accelerator.unwrap_model = unwrap_model  # this trainer's accelerator only
        plain_backward = self.accelerator.backward

        def backward(loss, **kwargs):
            scaler = self.engine.scaler
            if scaler is not None:
                loss = loss * scaler.scale
            if self._overlap_backward:
                # The step's last backward, and only it: the forward before it stays
                # outside, so the last step's carried updates run during that forward.
                self._overlap_backward = False
                with self._overlapped_backward():
                    return plain_backward(loss, **kwargs)
            return plain_backward(loss, **kwargs)

        self.accelerator.backward = backward  # this trainer's accelerator only

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.engine

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        section = self.args.deepspeed_scheduler  # [Note: DeepSpeed schedules] (ds_schedules)
        if self.lr_scheduler is None and section:
            opt = optimizer or self.optimizer
            self.lr_scheduler = deepspeed_schedule(section, opt, num_training_steps, self.args)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            # The optimizer of another trainer given the same model (or of this one before
            # model_init) gives the shards up; its state goes with it.
            self.engine.detach_optimizer()
            args = self.args
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            if args.weight_decay_all:
                decay = {n for n, _ in named}
            else:
                decay = set(self.get_decay_parameter_names(self.model))
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            if self.optimizer_cls_and_kwargs is None and args.uses_zero_adamw:
                self.optimizer = TrainerAdamW(
                    self.engine,
                    groups,
                    lr=args.learning_rate,
                    betas=(args.adam_beta1, args.adam_beta2),
                    eps=args.adam_epsilon,
                    weight_decay=args.weight_decay,
                )
            else:
                if self.optimizer_cls_and_kwargs is not None:
                    cls, kwargs = self.optimizer_cls_and_kwargs
                else:
                    cls, kwargs = self.get_optimizer_cls_and_kwargs(args)
                self.optimizer = TrainerOptimizer(self.engine, cls, groups, **dict(kwargs))
                if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
                    embeddings_in_32_bits(self.engine, self.optimizer)
        self._check_estimate_after_the_first_step()
        return self.optimizer

    def get_optimizer_group(self, param: str | nn.Parameter | None = None):
        """As the Trainer's, in the model's parameters: the optimizer's ``param_groups``
        hold this rank's shard segments, so a parameter is found in the group the optimizer
        was given it in. The group returned reads and writes the optimizer's group (its
        ``params`` are the model's parameters, matched by identity)."""
        if self.optimizer is None:
            return super().get_optimizer_group(param)
        opt = self.optimizer
        groups = [ModelParams(ps) for ps in opt.model_param_groups]
        if isinstance(param, str):
            param = dict(self.model.named_parameters()).get(param)
        if param is not None:
            original, tiles = self.engine.tiled_from.get(id(param), (None, None))
            wanted = tiles[0] if original is param else param
            for group, params in zip(opt.param_groups, groups):
                if wanted in params:
                    return ModelGroup(group, params)
        return groups

    def _check_estimate_after_the_first_step(self) -> None:
        """``check_memory_estimate`` once, right after the run's first optimizer step: a
        step hook of the optimizer that removes itself (no callback in the Trainer's list)."""
        if self._estimate_hook is not None or self.memory_measured is not None:
            return

        def once(optimizer, args, kwargs) -> None:
            if self._estimate_hook is not None:
                self._estimate_hook.remove()
                self._estimate_hook = None
                self.check_memory_estimate()

        self._estimate_hook = self.optimizer.register_step_post_hook(once)

    def get_num_trainable_parameters(self) -> int:
        """Counted through the engine: a released stage-3 parameter holds an empty tensor."""
        return self._parameter_count(trainable_only=True)

    def _parameter_count(self, trainable_only: bool = False) -> int:
        return sum(
            s.numel for u in self.engine.units for s in u.slots if s.trainable or not trainable_only
        )

    def _clip_grad_norm(self, model):
        return self.optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        pending = self.optimizer.pending_grad_norm
        if grad_norm is None and pending is not None:
            return pending  # an overlapped step: step() fills it in, before it is logged
        if grad_norm is None:
            grad_norm = self.optimizer.clip_grad_norm_(float("inf"))  # the norm, no clipping
        return float(grad_norm)

    def _main_input(self, inputs) -> torch.Tensor | None:
        """The batch's input ids; None where ``inputs`` holds none (TRL's GRPO and RLOO pass
        a list of prompts that their ``training_step`` generates from)."""
        if not isinstance(inputs, Mapping):
            return None
        ids = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        return ids if isinstance(ids, torch.Tensor) else None

    def training_step(self, model, inputs, *args, **kwargs):
        ids = self._main_input(inputs)
        if ids is not None and self._batch_shape is None:
            self._batch_shape = tuple(ids.shape)  # for check_estimate's activation term
        if self.accelerator.sync_gradients and self.overlap_step:
            # The last micro-batch of a step: update units during its backward (see the
            # accelerator's backward above).
            self._overlap_backward = True
            try:
                return super().training_step(model, inputs, *args, **kwargs)
            finally:
                self._overlap_backward = False
        return super().training_step(model, inputs, *args, **kwargs)

    @property
    def _clips(self) -> bool:
        return (self.args.max_grad_norm or 0) > 0

    @property
    def overlap_step(self) -> bool:
        """Whether the optimizer step overlaps the last backward of each step (see [Note:
        overlapped step] in optim/zero_adam.py): with the optimizer state on NVMe, where the
        step is mostly disk traffic, stage 2 or 3, no fp16 loss scaling and an optimizer that
        ``can_overlap`` (ZeroAdamW; a ZeroOptimizer with per-element state or on one rank).
        With clipping (``--max_grad_norm``, 1.0 by default) the updates wait for the norm and
        are carried into the next forward ([Note: a clipped overlapped step])."""
        engine = self.engine
        if not (
            engine.config.offload_optimizer == "nvme"
            and engine.config.stage >= 2
            and engine.scaler is None
        ):
            return False
        return self.optimizer.can_overlap

    def _overlapped_backward(self):
        # --auto_find_batch_size retries a step whose backward ran out of memory: no update
        # may be made before the whole backward is through ([Note: a backward that raises
        # inside overlapped()] in optim/zero_adam.py).
        defer = self._clips or self.args.auto_find_batch_size
        return self.optimizer.overlapped(track_norm=True, clipping=defer)

    def _update_auto_batch_size(self, batch_size):
        """``--auto_find_batch_size``: the Trainer's loop starts again with ``batch_size``
        after an out-of-memory error; the engine stays (the Trainer's wrapper is dropped).
        The memory check runs again after the new loop's first step, on the new batch's
        shape, with the peaks of the failed pass forgotten."""
        self._batch_shape = None
        if self._estimate_hook is not None:
            self._estimate_hook.remove()
            self._estimate_hook = None
        self.memory_measured = self.estimate_warnings = None
        reset_peak_rss()
        accelerator_allocated(self.args.device)  # resets its peak
        super()._update_auto_batch_size(batch_size)

    def check_memory_estimate(self) -> list[str]:
        """Compare this rank's measured peaks (host: peak RSS added since the engine was
        built; accelerator: peak allocated added; nvme: swap files) with `zerotune
        estimate` for this engine and these arguments; logs both, warns beyond 15% and
        returns the warnings. Called once after the first optimizer step. Not compared while
        a reference model or teacher is held: the estimate covers the trained model only."""
        if self.companions.engines:
            log.info(
                "zerotune: memory not checked against the estimate (a %s is held)",
                "/".join(self.companions.engines),
            )
            self.estimate_warnings = []
            return self.estimate_warnings
        measured = {
            "host": max(peak_rss() - self._rss_base, 0),
            "nvme": self.engine.memory_report().get("nvme", 0),
        }
        accel = accelerator_allocated(self.engine.device, peak=True)
        if accel is not None:
            measured["device"] = max(accel - (self._accel_base or 0), 0)
        seq_len, micro_batch = None, self.args.per_device_train_batch_size
        if self._batch_shape is not None and len(self._batch_shape) == 2:
            micro_batch, seq_len = self._batch_shape
        self.memory_measured = measured
        self.estimate_warnings = check_estimate(
            self.engine,
            measured,
            seq_len=seq_len,
            micro_batch=micro_batch,
            activation_checkpointing=bool(self.args.gradient_checkpointing),
        )
        return self.estimate_warnings

    # -------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model as a consolidated HF folder (config.json, safetensors, tokenizer)
        that ``from_pretrained`` loads; every rank must call it."""
        output = Path(output_dir if output_dir is not None else self.args.output_dir)
        dtype = self.args.save_dtype or self.engine.config.dtype
        if _internal_call and not self.args.save_only_model and not self._gather_on_save(dtype):
            # Inside a checkpoint: the zerotune checkpoint holds the weights. The folder must
            # exist now all the same: the Trainer looks for it right after this call to
            # record the best checkpoint (load_best_model_at_end).
            if self.engine.rank == 0:
                output.mkdir(parents=True, exist_ok=True)
            return
        tokenizer = self.processing_class
        if not hasattr(tokenizer, "save_pretrained"):
            tokenizer = None
        fresh = not output.exists() or not any(output.iterdir())
        # save_hf writes into a new folder and renames it into place; a folder that holds
        # other things (checkpoints, logs) gets the new files moved in one by one.
        target = output if fresh else output / f".zerotune-model-{os.getpid()}"
        bar = None
        if self.engine.rank == 0 and not self.args.disable_tqdm and not _internal_call:
            from tqdm.auto import tqdm

            # delay: a write over in less than a second shows no bar (it would show 0 B)
            bar = tqdm(desc="Writing the model", unit="B", unit_scale=True, leave=False, delay=1)

        def progress(nbytes: int, total: int) -> None:
            bar.total = total
            bar.update(nbytes)

        try:
            save_hf(
                self.engine,
                target,
                dtype=dtype,
                tokenizer=tokenizer,
                progress=progress if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
        if self.engine.rank == 0:
            if not fresh:
                move_model_files(target, output)
            (output / "training_args.json").write_text(self.args.to_json_string())
        zdist.barrier(self.engine.group)
        log.info("zerotune: saved the model to %s", output)

    def _gather_on_save(self, dtype: str) -> bool:
        """Whether a checkpoint also gets the consolidated model (``gather_weights_on_save``;
        by default when it takes at most ``GATHER_ON_SAVE_BYTES``)."""
        choice = self.args.gather_weights_on_save
        if choice is not None:
            return choice
        return self.num_parameters * export_dtype(dtype).itemsize <= GATHER_ON_SAVE_BYTES

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, then a marker covering everything a resume reads
        (``TRAINER_MARKER``: the zerotune checkpoint and ``trainer_state.json``, fsynced).
        Older checkpoints are rotated out only after the new one is complete. A save that
        fails (a full disk) leaves no folder behind and raises one CheckpointError."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # rotated below, once this checkpoint is complete
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                mark_complete(folder, self.state.global_step)
        except (OSError, CheckpointError) as exc:
            if self.args.should_save and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)  # nothing half-written stays
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointError(f"saving the checkpoint {folder} failed: {why}") from None
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save and limit:
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        tokenizer = self.processing_class
        save_checkpoint(
            self.engine,
            output_dir,
            name=ZERO_DIR,
            step=self.state.global_step,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            tokenizer=tokenizer if hasattr(tokenizer, "save_pretrained") else None,
        )

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # the zerotune checkpoint holds every rank's RNG states

    # ------------------------------------------------------------------------- loading
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise CheckpointError(
                    f"no complete checkpoint to resume from in {self.args.output_dir}"
                )
        # The Trainer's start-up log counts parameters through the model, whose released
        # stage-3 parameters are empty: count through the engine while it trains.
        import transformers.trainer as hf_trainer

        real_count = hf_trainer.get_model_param_count

        def count(model, trainable_only=False):
            if model is self.model or model is self.engine:
                return self._parameter_count(trainable_only)
            return real_count(model, trainable_only)

        hf_trainer.get_model_param_count = count
        debug = self.args.debug
        if DebugOption.UNDERFLOW_OVERFLOW in debug:
            # Installed here, its hooks first: the Trainer's would run after the engine's
            # post-forward hooks, which release the parameters they read.
            if self._debug_overflow is None or self._debug_overflow.model is not self.model:
                self._debug_overflow = DebugBeforeRelease(self.model)
            self.args.debug = [o for o in debug if o != DebugOption.UNDERFLOW_OVERFLOW]
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            hf_trainer.get_model_param_count = real_count
            self.args.debug = debug

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Only checked here: the weights are loaded with the optimizer state, once the
        # optimizer exists (_load_optimizer_and_scheduler).
        check_resumable(Path(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        check_resumable(folder)
        load_checkpoint(
            self.engine, folder / ZERO_DIR, optimizer=self.optimizer, scheduler=self.lr_scheduler
        )
        # The Trainer restores RNG states later (after skipping the trained batches); keep
        # what the checkpoint held for then.
        self._resume_rng = capture_rng()

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._resume_rng is not None:
            restore_rng(self._resume_rng)

    def _load_best_model(self) -> None:
        best = Path(self.state.best_model_checkpoint)
        log.info("zerotune: loading the best model from %s", best)
        if self.args.save_only_model and not (best / ZERO_DIR).is_dir():
            # Its checkpoints hold the HF folder only (save_model writes it): load those
            # weights, as the plain Trainer does.
            load_weights(self.engine, best)
            return
        check_resumable(best)
        load_checkpoint(self.engine, best / ZERO_DIR, load_optimizer=False, load_rng=False)

    # ------------------------------------------------------------------------ reporting
    def memory_summary(self) -> dict[str, int | None]:
        """Peak bytes per memory tier of this rank: accelerator (None without one), host
        (peak resident set of this process), nvme (swap files: parameters, gradients and
        optimizer state, and offloaded activation checkpoints), and the engine's report."""
        report = self.engine.memory_report()
        accel = None
        if self.engine.device.type == "cuda":
            accel = torch.cuda.max_memory_allocated(self.engine.device)
        return {
            "accelerator_peak": accel,
            "host_peak": peak_rss(),
            "nvme": report.get("nvme", 0) + report.get("checkpoints_file", 0),
            **{f"engine_{k}": v for k, v in report.items()},
        }

    def close(self) -> None:
        """Finish pending I/O and remove this rank's NVMe swap files."""
        self.companions.close()
        self.engine.close()
