"""A DeepSpeed config given to ``ZeroTrainingArguments`` (``--deepspeed ds_config.json``).

[Note: DeepSpeed configs]
Users moving from DeepSpeed bring a ds_config.json. `ZeroTrainingArguments` reads it as the
base of zerotune's config (the zerotune flags still override it) instead of handing it to
DeepSpeed:
- `zero_optimization`: the stage, where parameters and optimizer state live, and the sizes
  zerotune has a counterpart for (counted in parameters there, bytes of the compute dtype
  here). Every spelling DeepSpeed reads is read: keys with or without `stage3_`, the old
  `bfloat16` and `cpu_offload_param`. `aio` maps one to one; the fp16 section's loss
  scaler runs DeepSpeed's rule ([Note: two loss-scale rules] in optim/scaling.py).
- What the Trainer's arguments also set (batch sizes, accumulation, clipping, bf16/fp16, an
  Adam/AdamW optimizer's hyperparameters) is "auto" or must equal them, as transformers
  requires; all mismatches are listed in one message. The Trainer leaves clipping to
  DeepSpeed, which clips at 1.0 when the key is missing: another --max_grad_norm is then a
  mismatch. An optimizer section gets every parameter in one group, so weight decay reaches
  biases and norms too (`weight_decay_all`). Adam/AdamW is ZeroAdamW; another type is the
  torch.optim class of that name, as DeepSpeed takes it ("adagrad" too), run by
  ZeroOptimizer with the class's own keys (`deepspeed_optimizer`); without a weight_decay
  key DeepSpeed uses the class's default, so another --weight_decay is a mismatch.
- A `scheduler` section replaces the Trainer's schedule: [Note: DeepSpeed schedules] in
  ds_schedules.py.
- Bucket, communication and monitoring knobs have no counterpart and are named in the log.
  Features zerotune cannot run as DeepSpeed does are refused by name: ZeRO++, MiCS,
  ZenFlow, AutoTP, autocast, Apex AMP, bf16 master weights, summed gradients, DeepSpeed's
  own optimizers (Lamb, Lion, 1-bit, MuP, Muon), a static fp16 loss scale. An unknown key is
  refused with the nearest known one, where DeepSpeed would ignore a typo.
- `accelerate launch` with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED for its
  processes, and the Trainer would start DeepSpeed around the engine: the config accelerate's
  own `DeepSpeedPlugin` builds (its mixed_precision set) is read as `--deepspeed`'s, and the
  variable is removed from the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, did_you_mean, first_line
from .ds_schedules import SCHEDULES, DeepSpeedCycle, DeepSpeedSchedule

__all__ = [
    "check_deepspeed_optimizer",
    "check_deepspeed_scheduler",
    "deepspeed_optimizer",
    "deepspeed_schedule",
    "deepspeed_zero_base",
    "launcher_deepspeed_config",
    "planned_world",
    "read_deepspeed_config",
    "zero_config_from_deepspeed",
]

log = logging.getLogger(__name__)

# Sections and keys that do not change what is trained, or tune DeepSpeed's own buffers and
# communication: read and ignored.
_IGNORED_TOP = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comet", "comms_logger", "checkpoint", "timers", "seq_parallel_communication_data_type",
    "elasticity", "autotuning", "data_types", "disable_allgather", "gradient_accumulation_dtype",
    "dataloader_drop_last", "disable_python_gc", "log_level",
    # Not DeepSpeed settings (it ignores them), found in configs users share.
    "comms_config", "monitor_config", "cuda_visible_devices",
}  # fmt: skip
_IGNORED_ZERO = {
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "allgather_partitions", "reduce_scatter", "sub_group_size", "round_robin_gradients",
    "stage3_max_reuse_distance", "elastic_checkpoint", "load_from_fp32_weights",
    "memory_efficient_linear", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings", "mics_hierarchical_params_gather",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
    "pipeline_loading_checkpoint", "override_module_apply", "leaf_module",
    "stage3_model_persistence_threshold", "stage3_allgather_sequential", "legacy_stage1",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "cpu_offload_use_pin_memory",
    "zeropp_loco_param", "compute_grad_norm",
}  # fmt: skip
# zero_optimization keys read here (the rest of _KNOWN_ZERO is checked, then ignored).
_USED_ZERO = {
    "stage", "offload_param", "offload_optimizer", "cpu_offload",
    "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
}  # fmt: skip
_REFUSED_ZERO = {
    "zero_hpz_partition_size", "mics_shard_size", "zero_quantized_weights",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "zenflow",
}  # fmt: skip
# zero_optimization keys DeepSpeed also reads without their stage3_ prefix.
_STAGE3_ALIASES = (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
)  # fmt: skip
_KNOWN_ZERO = _IGNORED_ZERO | _USED_ZERO | _REFUSED_ZERO
_OFFLOAD_KEYS = {
    "device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
    "ratio", "fast_init", "pipeline_read", "pipeline_write", "pipeline", "super_offload",
    "cpuadam_cores_perc",
}  # fmt: skip
_KNOWN_TOP = _IGNORED_TOP | {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "fp16", "bf16", "optimizer", "scheduler", "zero_optimization", "aio",
    "gradient_allreduce_op", "torch_autocast", "tensor_parallel", "compile", "amp",
}  # fmt: skip
_AIO = {"block_size": "aio_block_bytes", "queue_depth": "aio_queue_depth",
        "thread_count": "aio_threads", "intra_op_parallelism": "aio_threads"}  # fmt: skip
_AIO_IGNORED = {"single_submit", "overlap_events", "use_gds"}
# fp16 loss-scaler key -> zerotune key (DeepSpeed's rule: [Note: two loss-scale rules]).
_FP16 = {"loss_scale_window": "loss_scale_window", "min_loss_scale": "loss_scale_min",
         "hysteresis": "loss_scale_hysteresis",
         "consecutive_hysteresis": "loss_scale_consecutive_hysteresis"}  # fmt: skip
# Schedule keys (ds_schedules.SCHEDULES) that take a count of steps (an integer), a switch,
# or may be null.
_COUNTS = {"cycle_first_stair_count", "cycle_second_stair_count", "lr_range_test_step_size"}
_SWITCHES = {"cycle_momentum", "lr_range_test_staircase"}
_NULLABLE = {"cycle_second_step_size", "cycle_second_stair_count"}
# DeepSpeed's own optimizers (the others it takes from torch.optim by name).
_DEEPSPEED_OWN = {"lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muadam", "muadamw",
                  "musgd", "muon"}  # fmt: skip
# zero_optimization key counted in parameters -> zerotune key in bytes.
_ELEMENTS = {
    "stage3_prefetch_bucket_size": "prefetch_bytes",
    "stage3_max_live_parameters": "max_live_bytes",
    "stage3_param_persistence_threshold": "persistence_threshold",
}


# The world size a launcher is about to start, while it checks the job in its own process
# (where WORLD_SIZE is not set yet): train_batch_size is checked against it.
_PLANNED_WORLD: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "planned_world", default=None
)


@contextlib.contextmanager
def planned_world(world: int):
    """Check DeepSpeed configs read inside as for a run of ``world`` ranks (1: the
    process's own WORLD_SIZE, as in a rank)."""
    token = _PLANNED_WORLD.set(world if world > 1 else None)
    try:
        yield
    finally:
        _PLANNED_WORLD.reset(token)


# The DeepSpeed config accelerate launch gave this process, read once (the variable that
# asks for DeepSpeed is gone after): [Note: DeepSpeed configs].
_LAUNCHED: list[dict[str, Any]] = []
LAUNCHER = "accelerate launch's DeepSpeed config"


def launcher_deepspeed_config() -> dict[str, Any] | None:
    """The DeepSpeed config ``accelerate launch`` passed this process, as accelerate's
    ``DeepSpeedPlugin`` reads it; None when it passed none. Removes ACCELERATE_USE_DEEPSPEED
    from the environment."""
    flag = os.environ.pop("ACCELERATE_USE_DEEPSPEED", "false")
    if flag.lower() in ("true", "1", "yes", "on") and not _LAUNCHED:
        from accelerate.utils import DeepSpeedPlugin

        try:
            plugin = DeepSpeedPlugin()
            # As accelerate does before handing the config to DeepSpeed.
            plugin.set_mixed_precision(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
            config = plugin.deepspeed_config
        except (ValueError, TypeError, OSError, KeyError) as exc:
            raise ConfigError(f"{LAUNCHER}: {first_line(exc)}") from None
        config.pop("steps_per_print", None)  # accelerate sets it to infinity
        _LAUNCHED.append(json.loads(json.dumps(config)))
    return json.loads(json.dumps(_LAUNCHED[0])) if _LAUNCHED else None


def read_deepspeed_config(source: str | dict | os.PathLike) -> dict[str, Any]:
    """The mapping of a DeepSpeed config: a dict, a JSON file, or inline JSON."""
    if isinstance(source, dict):
        return _other_spellings(json.loads(json.dumps(source)))  # a copy, only JSON values
    text = str(source)
    try:
        data = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed: no such file {text!r}") from None
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--deepspeed: cannot read {text!r} as JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed: {text!r} must hold a JSON object")
    return _other_spellings(data)


def _other_spellings(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the names DeepSpeed also reads turned into the ones read here: the old
    ``bfloat16`` section, the ZeRO keys without their ``stage3_`` prefix, the old
    ``cpu_offload_param``; comment keys (``_comment``) dropped."""
    data = {k: v for k, v in data.items() if not str(k).startswith("_")}
    if "bfloat16" in data:
        if "bf16" in data:
            raise ConfigError("--deepspeed: bf16 and bfloat16 (its old name) are both given")
        data["bf16"] = data.pop("bfloat16")
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        zero = {k: v for k, v in zero.items() if not str(k).startswith("_")}
        for name in _STAGE3_ALIASES:
            if name in zero:
                if f"stage3_{name}" in zero:
                    raise ConfigError(f"--deepspeed: zero_optimization.{name} and "
                                      f"stage3_{name} (one setting) are both given")  # fmt: skip
                zero[f"stage3_{name}"] = zero.pop(name)
        if zero.pop("cpu_offload_param", None) and "offload_param" not in zero:
            zero["offload_param"] = {"device": "cpu"}
        data["zero_optimization"] = zero
    return data


def _unknown(keys, known: set[str], where: str) -> None:
    for key in keys:
        if key not in known:
            hint = did_you_mean(key, known, cutoff=0.6)
            raise ConfigError(
                f"--deepspeed: {where}{key!r} is not a DeepSpeed setting zerotune knows{hint}"
            )


def _section(data: dict, key: str, where: str = "") -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"--deepspeed: {where}{key} must be an object, got {value!r}")
    return value


class _Matcher:
    """Values the config and the Trainer's arguments both set: "auto" takes the argument's,
    anything else must equal it (collected, reported together)."""

    def __init__(self):
        self.mismatches: list[str] = []

    def __call__(self, value, expected, ds_key: str, flag: str) -> None:
        if value is None or value == "auto":
            return
        if isinstance(expected, float) or isinstance(value, float):
            same = isinstance(value, (int, float)) and abs(value - expected) <= 1e-12 * max(
                1.0, abs(expected)
            )
        else:
            same = value == expected
        if not same:
            self.mismatches.append(f"{ds_key}={value!r} but {flag} is {expected!r}")

    def refuse_any(self) -> None:
        """A section given alone: its mismatches in one line."""
        if self.mismatches:
            raise ConfigError(f'--deepspeed: {"; ".join(self.mismatches)} (use "auto")')


def zero_config_from_deepspeed(data: dict[str, Any], args) -> tuple[dict[str, Any], dict]:
    """``(zerotune config mapping, Trainer argument values)`` from a DeepSpeed config, checked
    against ``args`` (a ``ZeroTrainingArguments`` being initialized); see [Note: DeepSpeed
    configs]. Raises ConfigError in one line for anything zerotune cannot honour."""
    _unknown(data, _KNOWN_TOP, "")
    match = _Matcher()
    world = _PLANNED_WORLD.get() or int(os.environ.get("WORLD_SIZE", "1"))
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    match(data.get("train_micro_batch_size_per_gpu"), micro, "train_micro_batch_size_per_gpu",
          "--per_device_train_batch_size")  # fmt: skip
    match(data.get("gradient_accumulation_steps"), accum, "gradient_accumulation_steps",
          "--gradient_accumulation_steps")  # fmt: skip
    match(data.get("train_batch_size"), micro * accum * world, "train_batch_size",
          "per-device batch x accumulation x world size")  # fmt: skip
    match(data.get("gradient_clipping"), args.max_grad_norm, "gradient_clipping",
          "--max_grad_norm")  # fmt: skip
    if "gradient_clipping" not in data and args.max_grad_norm != 1.0:
        # The Trainer leaves clipping to DeepSpeed, whose default (since 0.19.3) is 1.0.
        match.mismatches.append(
            f"no gradient_clipping (DeepSpeed then clips at 1.0) but --max_grad_norm is "
            f"{args.max_grad_norm}"
        )
    _features_off(data)
    out: dict[str, Any] = {}
    trainer: dict[str, Any] = {}
    fp16, bf16 = _section(data, "fp16"), _section(data, "bf16")
    _unknown(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow",
                    "bf16_master_weights_and_grads", "bf16_optimizer_states"}, "bf16.")  # fmt: skip
    if bf16.get("bf16_master_weights_and_grads") or bf16.get("bf16_optimizer_states"):
        raise ConfigError("--deepspeed: bf16 master weights, gradients or optimizer states are "
                          "not supported (zerotune keeps fp32 master weights)")  # fmt: skip
    _unknown(fp16, {"enabled", "auto_cast", "loss_scale", "initial_scale_power",
                    "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                    "min_loss_scale", "fp16_master_weights_and_grads"}, "fp16.")  # fmt: skip
    match(bf16.get("enabled"), bool(args.bf16), "bf16.enabled", "--bf16")
    match(fp16.get("enabled"), bool(args.fp16), "fp16.enabled", "--fp16")
    if fp16.get("loss_scale") not in (None, 0, "auto"):
        raise ConfigError(
            f"--deepspeed: fp16.loss_scale={fp16['loss_scale']!r} is a static loss scale; "
            "zerotune scales fp16 losses dynamically (set it to 0)"
        )
    if fp16.get("fp16_master_weights_and_grads"):
        raise ConfigError("--deepspeed: fp16_master_weights_and_grads is not supported "
                          "(zerotune keeps fp32 master weights)")  # fmt: skip
    if fp16.get("initial_scale_power") not in (None, "auto"):
        out["loss_scale_init"] = 2.0 ** fp16["initial_scale_power"]
    for ds_key, key in _FP16.items():
        if fp16.get(ds_key) not in (None, "auto"):
            out[key] = fp16[ds_key]
    out["loss_scale_rule"] = "deepspeed"  # [Note: two loss-scale rules]
    optimizer = _optimizer(_section(data, "optimizer"), args, match)
    if optimizer:
        # transformers hands DeepSpeed's optimizer every parameter in one group.
        trainer["weight_decay_all"] = True
    if isinstance(optimizer, dict):  # a torch optimizer's section
        trainer["deepspeed_optimizer"] = optimizer
    if data.get("scheduler"):
        trainer["deepspeed_scheduler"] = _scheduler(_section(data, "scheduler"), args, match)
    zero = _zero(data, 2 if args.bf16 or args.fp16 else 4, out, trainer)
    aio = _section(data, "aio")
    _unknown(aio, set(_AIO) | _AIO_IGNORED, "aio.")
    for ds_key, key in _AIO.items():
        if aio.get(ds_key) not in (None, "auto"):
            out[key] = aio[ds_key]
    if match.mismatches:
        raise ConfigError(
            "--deepspeed: the config contradicts the Trainer's arguments: "
            + "; ".join(match.mismatches)
            + ' (use "auto" or the same value)'
        )
    ignored = sorted(k for k in data if k in _IGNORED_TOP)
    ignored += sorted(f"zero_optimization.{k}" for k in zero if k in _IGNORED_ZERO)
    if ignored:
        log.info(
            "zerotune: DeepSpeed settings with no counterpart, ignored: %s", ", ".join(ignored)
        )
    return out, trainer


def _features_off(data: dict) -> None:
    """Sections zerotune accepts only switched off, refused with what they are."""
    if data.get("gradient_allreduce_op", "mean") != "mean":
        raise ConfigError(f"--deepspeed: gradient_allreduce_op={data['gradient_allreduce_op']!r}"
                          " is not supported: zerotune averages the ranks' gradients, as DDP "
                          'and DeepSpeed\'s default "mean" do')  # fmt: skip
    if _section(data, "torch_autocast").get("enabled") not in (None, False, "auto"):
        raise ConfigError("--deepspeed: torch_autocast (autocast over fp32 parameters) is not "
                          "supported: --bf16 or --fp16 keep the parameters in it")  # fmt: skip
    if _section(data, "tensor_parallel").get("autotp_size") not in (None, 0, 1):
        raise ConfigError("--deepspeed: tensor_parallel.autotp_size > 1 (AutoTP tensor "
                          "parallelism) is not supported")  # fmt: skip
    if data.get("compile"):
        raise ConfigError("--deepspeed: DeepSpeed's compile section is not supported; "
                          "--torch_compile compiles each block's forward")  # fmt: skip
    if _section(data, "amp").get("enabled") not in (None, False, "auto"):
        raise ConfigError("--deepspeed: amp (Apex AMP, which DeepSpeed dropped) is not "
                          "supported; use --bf16 or --fp16")  # fmt: skip


def _optimizer(section: dict, args, match: _Matcher) -> bool | dict:
    """Check an optimizer section against ``args``; whether there is one (a torch
    optimizer's: the section, resolved)."""
    if not section:
        return False
    _unknown(section, {"type", "params"}, "optimizer.")
    kind = str(section.get("type", ""))
    params = section.get("params") or {}
    if kind.lower() in _DEEPSPEED_OWN:
        raise ConfigError(f"--deepspeed: optimizer {kind!r} is DeepSpeed's own and not supported: "
                          "remove the optimizer section and choose --optim")  # fmt: skip
    if kind.lower() not in ("adam", "adamw"):
        return _torch_section(kind, params, args, match)
    # DeepSpeed runs AdamW for "AdamW" whatever adam_w_mode says, and for "Adam" unless it
    # is false.
    if kind.lower() == "adam" and params.get("adam_w_mode") is False:
        raise ConfigError(
            f"--deepspeed: optimizer '{kind} with adam_w_mode false' is not supported from a "
            "DeepSpeed config: remove the optimizer section and choose --optim (AdamW is "
            "zerotune's own)"
        )
    if not args.uses_zero_adamw:
        raise ConfigError(
            f"--deepspeed: its optimizer section ({kind}) contradicts --optim "
            f"{getattr(args.optim, 'value', args.optim)}; keep one of them"
        )
    _unknown(params, {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                      "bias_correction", "amsgrad"}, "optimizer.params.")  # fmt: skip
    if params.get("bias_correction") is False or params.get("amsgrad"):
        raise ConfigError("--deepspeed: Adam without bias correction, or AMSGrad, is not "
                          "supported")  # fmt: skip
    _trainer_values(params, args, match)
    return True


def _trainer_values(params: dict, args, match: _Matcher) -> dict:
    """``params`` with the values the Trainer's arguments also set (lr, betas, eps,
    weight_decay) "auto"-filled from ``args``; given ones must equal them, as transformers
    checks an optimizer section of any type."""
    resolved = dict(params)
    betas = resolved.get("betas")
    if betas not in (None, "auto"):
        if not (isinstance(betas, list) and len(betas) == 2 and all(map(_is_number, betas))):
            raise ConfigError(f"--deepspeed: optimizer.params.betas must be two numbers or "
                              f'"auto", got {betas!r}')  # fmt: skip
    for key, value, flag in (("lr", args.learning_rate, "--learning_rate"),
                             ("betas", [args.adam_beta1, args.adam_beta2],
                              "--adam_beta1/--adam_beta2"),
                             ("eps", args.adam_epsilon, "--adam_epsilon"),
                             ("weight_decay", args.weight_decay, "--weight_decay")):  # fmt: skip
        if resolved.get(key) == "auto":
            resolved[key] = value
        elif key in resolved:
            match(resolved[key], value, f"optimizer.params.{key}", flag)
    return resolved


def _torch_class(kind: str):
    """The torch optimizer DeepSpeed builds for a type it does not run itself: torch.optim's
    class of that exact name (its "adagrad" is torch's Adagrad too), or None."""
    cls = torch.optim.Adagrad if kind.lower() == "adagrad" else getattr(torch.optim, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _torch_section(kind: str, params: dict, args, match: _Matcher) -> dict:
    """A torch optimizer's section ([Note: DeepSpeed configs]): its keys are the class's,
    "auto" and matching values as transformers fills and checks them."""
    cls = _torch_class(kind)
    if cls is None:
        raise ConfigError(f"--deepspeed: optimizer {kind!r} is neither Adam/AdamW nor a torch."
                          "optim class (DeepSpeed takes those by their exact name)")  # fmt: skip
    signature = inspect.signature(cls.__init__).parameters
    _unknown(params, set(signature) - {"self", "params"}, "optimizer.params.")
    resolved = _trainer_values(params, args, match)
    default = signature["weight_decay"].default if "weight_decay" in signature else 0.0
    if "weight_decay" not in resolved and args.weight_decay != default:
        # DeepSpeed builds it with the class's own; the Trainer's groups carry --weight_decay.
        match(default, args.weight_decay, f"optimizer.params.weight_decay (absent: {default})",
              "--weight_decay")  # fmt: skip
    return {"type": kind, "params": resolved}


def check_deepspeed_optimizer(value: str | dict, args) -> dict[str, Any]:
    """``--deepspeed_optimizer`` (a DeepSpeed optimizer section of a torch optimizer, a dict
    or JSON) checked against ``args`` as ``--deepspeed``'s; raises ConfigError in one line."""
    section = _json_object(value, "--deepspeed_optimizer")
    if not isinstance(section.get("type"), str):
        raise ConfigError(f'--deepspeed_optimizer needs a "type" (a torch optimizer): {value!r}')
    with _refusals_name("--deepspeed_optimizer"):
        _unknown(section, {"type", "params"}, "optimizer.")
        match = _Matcher()
        checked = _torch_section(section["type"], dict(section.get("params") or {}), args, match)
        match.refuse_any()
    return checked


def deepspeed_optimizer(section: dict) -> tuple[type, dict[str, Any]]:
    """``(class, keyword arguments)`` of a checked torch optimizer section, for the Trainer's
    ``optimizer_cls_and_kwargs``."""
    return _torch_class(section["type"]), dict(section["params"])


def check_deepspeed_scheduler(value: str | dict, args) -> dict[str, Any]:
    """``--deepspeed_scheduler`` (a DeepSpeed scheduler section, a dict or JSON) checked
    against ``args``, as ``_scheduler`` leaves it; raises ConfigError in one line."""
    match = _Matcher()
    with _refusals_name("--deepspeed_scheduler"):
        section = _scheduler(_json_object(value, "--deepspeed_scheduler"), args, match)
        match.refuse_any()
    return section


@contextlib.contextmanager
def _refusals_name(flag: str):
    """Refusals name ``flag`` (a section given alone, or a launcher's config) instead of
    ``--deepspeed``."""
    try:
        yield
    except ConfigError as exc:
        text = str(exc)
        if not text.startswith("--deepspeed: "):
            raise
        raise ConfigError(f"{flag}: {text.removeprefix('--deepspeed: ')}") from None


def _json_object(value: str | dict, flag: str) -> dict:
    """A section given alone to ``flag``: a dict, or its JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{flag}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    return value


def _scheduler(section: dict, args, match: _Matcher) -> dict[str, Any]:
    """A scheduler section checked, with "auto" learning rates resolved from ``args``;
    step counts stay "auto" until the run's length is known ([Note: DeepSpeed schedules] in
    ds_schedules.py)."""
    _unknown(section, {"type", "params"}, "scheduler.")
    kind = section.get("type")
    if kind not in SCHEDULES:
        raise ConfigError(
            f"--deepspeed: scheduler type {kind!r} is not supported (zerotune runs "
            f"{', '.join(SCHEDULES)}; or remove the section for --lr_scheduler_type)"
        )
    given = dict(section.get("params") or {})
    _unknown(given, set(SCHEDULES[kind]), "scheduler.params.")
    if "total_num_steps" in SCHEDULES[kind] and "total_num_steps" not in given:
        raise ConfigError(f'--deepspeed: {kind} needs scheduler.params.total_num_steps ("auto")')
    for key in ("cycle_min_lr", "cycle_max_lr"):
        if kind == "OneCycle" and key not in given:
            raise ConfigError(f"--deepspeed: OneCycle needs scheduler.params.{key}")
    if given.get("warmup_min_lr") == "auto":
        given["warmup_min_lr"] = 0.0
    if given.get("warmup_max_lr") == "auto":
        given["warmup_max_lr"] = args.learning_rate
    elif isinstance(given.get("warmup_max_lr"), (int, float)):
        match(given["warmup_max_lr"], args.learning_rate, "scheduler.params.warmup_max_lr",
              "--learning_rate")  # fmt: skip
    for key, value in given.items():
        where = f"--deepspeed: scheduler.params.{key}"
        if key.endswith("_num_steps"):
            if value != "auto" and (type(value) is not int or value <= 0):
                raise ConfigError(f'{where} must be a positive integer or "auto", got {value!r}')
        elif key == "warmup_type":
            if value not in ("log", "linear"):
                raise ConfigError(f'{where} must be "log" or "linear", got {value!r}')
        elif key in _SWITCHES:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {value!r}")
        elif value is None and key in _NULLABLE:
            continue
        elif key in _COUNTS:
            least = 1 if key == "lr_range_test_step_size" else 0
            if type(value) is not int or value < least:
                raise ConfigError(f"{where} must be an integer of at least {least}, got {value!r}")
        elif not all(_is_number(v) for v in (value if isinstance(value, list) else [value])):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        elif isinstance(value, list) and not key.endswith(("_lr", "_mom")):
            raise ConfigError(f"{where} must be one number, got {value!r}")
        elif key.endswith("step_size") and value <= (0 if key.startswith("cycle_first") else -1):
            raise ConfigError(f"{where} must be positive, got {value!r}")
    if args.max_steps > 0:  # the run's length is known: check the step counts now
        _step_counts(given, args.max_steps, args.get_warmup_steps(args.max_steps))
    return {"type": kind, "params": given}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def deepspeed_schedule(section: dict, optimizer, num_training_steps: int, args):
    """The ``DeepSpeedSchedule`` of a checked scheduler section for a run of
    ``num_training_steps`` updates with Trainer arguments ``args``; its refusals name the
    flag that gave the section."""
    with _refusals_name(getattr(args, "deepspeed_scheduler_flag", "--deepspeed")):
        warmup_steps = args.get_warmup_steps(num_training_steps)
        params = _step_counts(section["params"], num_training_steps, warmup_steps)
        if section["type"] in ("OneCycle", "LRRangeTest"):
            schedule = DeepSpeedCycle(optimizer, section["type"], params)
            schedule.check_betas(num_training_steps)
            return schedule
        return DeepSpeedSchedule(optimizer, section["type"], params)


def _step_counts(params: dict, num_training_steps: int, warmup_steps: int) -> dict:
    """``params`` with "auto" step counts filled in for the run; given ones must be the
    run's, as transformers checks them."""
    params = dict(params)
    mismatches = []
    for key, value in (("total_num_steps", num_training_steps),
                       ("warmup_num_steps", max(1, warmup_steps))):  # fmt: skip
        if params.get(key) == "auto":
            params[key] = value
        elif key in params and params[key] != value:
            mismatches.append(f"scheduler.params.{key}={params[key]} but the run has {value}")
    if mismatches:
        raise ConfigError(f'--deepspeed: {"; ".join(mismatches)} (use "auto")')
    return params


def deepspeed_zero_base(data: dict[str, Any]) -> dict[str, Any]:
    """The zerotune keys a DeepSpeed config's ZeRO section gives (sizes as fp32 bytes), for
    planning a job before its Trainer arguments exist; ``zero_config_from_deepspeed`` makes
    the config the run uses."""
    out: dict[str, Any] = {}
    _zero(data, 4, out, {})
    return out


def _zero(data: dict, itemsize: int, out: dict, trainer: dict) -> dict:
    """The ZeRO section of ``data``, checked, read into ``out`` (zerotune config keys, sizes
    in bytes of ``itemsize``) and ``trainer`` (Trainer argument values)."""
    zero = _section(data, "zero_optimization")
    _unknown(zero, _KNOWN_ZERO, "zero_optimization.")
    stage = zero.get("stage", 0)
    if isinstance(stage, str) and stage.isdigit():  # DeepSpeed reads "3" as 3
        stage = int(stage)
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"--deepspeed: zero_optimization.stage must be 1, 2 or 3 for zerotune, got "
            f"{stage!r} (stage 0 is plain data parallelism: use the plain Trainer)"
        )
    out["stage"] = stage
    for key in ("zero_hpz_partition_size", "mics_shard_size"):
        if zero.get(key) not in (None, 0, 1, -1):
            raise ConfigError(f"--deepspeed: zero_optimization.{key} (ZeRO++ / MiCS "
                              "hierarchical partitioning) is not supported")  # fmt: skip
    for key in ("zero_quantized_weights", "zero_quantized_gradients",
                "zero_quantized_nontrainable_weights"):  # fmt: skip
        if zero.get(key):
            raise ConfigError(f"--deepspeed: zero_optimization.{key} (ZeRO++ quantized "
                              "communication) is not supported")  # fmt: skip
    paths = set()
    for kind in ("offload_param", "offload_optimizer"):
        section = _section(zero, kind, "zero_optimization.")
        _unknown(section, _OFFLOAD_KEYS, f"zero_optimization.{kind}.")
        device = section.get("device", "none") or "none"
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"--deepspeed: zero_optimization.{kind}.device must be none, cpu "
                              f"or nvme, got {device!r}")  # fmt: skip
        if kind == "offload_param" and stage < 3:
            if device != "none":  # as DeepSpeed: stages 1-2 keep the parameters gathered
                log.info("zerotune: zero_optimization.offload_param ignored at stage %s", stage)
            continue
        if section:
            out[kind] = device
        if device == "nvme" and section.get("nvme_path"):
            paths.add(str(section["nvme_path"]))
    if zero.get("cpu_offload") and "offload_optimizer" not in out:  # the legacy flag
        out["offload_optimizer"] = "cpu"
    if zero.get("zenflow"):
        raise ConfigError("--deepspeed: zero_optimization.zenflow (ZenFlow's deferred updates "
                          "of less important gradients) is not supported")  # fmt: skip
    if len(paths) > 1:
        raise ConfigError(
            f"--deepspeed: offload_param and offload_optimizer name different nvme_path "
            f"folders ({', '.join(sorted(paths))}); zerotune keeps its swap files in one"
        )
    if paths:
        out["nvme_path"] = paths.pop()
    for ds_key, key in _ELEMENTS.items():
        value = zero.get(ds_key)
        if ds_key == "stage3_max_live_parameters" and value == 0:
            # DeepSpeed's tightest bound, zerotune's "no bound": one unit at a time anyway.
            log.info("zerotune: stage3_max_live_parameters 0 ignored (zerotune gathers one "
                     "unit ahead at most by its prefetch_bytes)")  # fmt: skip
            continue
        if value not in (None, "auto"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"--deepspeed: zero_optimization.{ds_key} must be a number "
                                  f"of parameters, got {value!r}")  # fmt: skip
            out[key] = int(value) * itemsize
    for key in ("stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):  # fmt: skip
        if isinstance(zero.get(key), bool):
            trainer["gather_weights_on_save"] = zero[key]
    return zero
