"""FSDP settings given to ``ZeroTrainingArguments`` (``--fsdp``, ``--fsdp_config``, or
``accelerate launch`` with an FSDP config).

[Note: FSDP settings]
Users moving from FSDP bring `--fsdp "full_shard offload auto_wrap"` with an `--fsdp_config`,
or an accelerate config that turns FSDP on. FSDP and zerotune shard the same data-parallel
way and train the same numbers, so the settings become zerotune's config:
- the sharding, read as transformers reads it: `reshard_after_forward` (FSDP2, the default:
  true is stage 3, false stage 2, parameters gathered from forward to backward; FSDP1: a
  strategy name), else FSDP1's `sharding_strategy`, else the `--fsdp` word (`full_shard`,
  `shard_grad_op`). `no_shard` and hybrid sharding are refused;
- CPU offload (`offload`, `cpu_offload`, accelerate's `offload_params`): FSDP keeps the
  parameter shards and gradients on the host and steps there; zerotune puts the parameters
  (stage 3) and the optimizer state on the CPU tier;
- `activation_checkpointing` is the Trainer's; `activation_checkpointing_offload` also
  sends the checkpoints to the host (`offload_activations`); an explicit `state_dict_type`
  says whether saves gather the weights (`gather_weights_on_save`);
- a word and a config key that disagree are refused; wrapping, prefetch, precision-policy
  and loading knobs tune FSDP itself (zerotune picks its own units) and are named in the
  log; XLA's FSDP and unknown keys are refused.
Under `accelerate launch` the settings come from accelerate's own
`FullyShardedDataParallelPlugin` (its FSDP_* variables), and ACCELERATE_USE_FSDP is removed
from the process so that neither the Trainer nor accelerate wraps the engine.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..config import ConfigError, did_you_mean, first_line

__all__ = ["launcher_fsdp_settings", "zero_config_from_fsdp"]

log = logging.getLogger(__name__)

_STAGES = {"full_shard": 3, "shard_grad_op": 2}
_REFUSED = {
    "no_shard": "no_shard (plain data parallelism: use the plain Trainer)",
    "hybrid_shard": "hybrid_shard (sharding within a node, replicas across nodes)",
    "hybrid_shard_zero2": "hybrid_shard_zero2 (sharding within a node, replicas across nodes)",
}
_WORDS = set(_STAGES) | set(_REFUSED) | {"offload", "auto_wrap"}
# fsdp_config keys that tune FSDP itself (or that the Trainer does not read): ignored, logged.
_IGNORED = {
    "min_num_params", "transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap",
    "auto_wrap_policy", "backward_prefetch", "backward_prefetch_policy", "forward_prefetch",
    "limit_all_gathers", "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading",
    "offload_state_dict", "ignored_modules", "cpu_offload_pin_memory", "mixed_precision_policy",
}  # fmt: skip
_USED = {"version", "reshard_after_forward", "sharding_strategy", "cpu_offload",
         "offload_params", "activation_checkpointing", "activation_checkpointing_offload",
         "state_dict_type"}  # fmt: skip
_XLA = {"xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2"}


def zero_config_from_fsdp(fsdp, fsdp_config) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(zerotune config mapping, Trainer argument values)`` from ``--fsdp`` (True, a string
    of options or a list) and ``--fsdp_config`` (a dict, JSON, a JSON file or None); see
    [Note: FSDP settings]. Raises ConfigError in one line for what zerotune cannot honour."""
    if isinstance(fsdp, str) and fsdp.lower() in ("true", "1"):  # --fsdp true: all in the config
        fsdp = True
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    words = [str(w).lower() for w in words]
    for word in words:
        if word not in _WORDS:
            hint = did_you_mean(word, _WORDS, cutoff=0.6)
            raise ConfigError(f"--fsdp: unknown option {word!r}{hint}")
        if word in _REFUSED:
            raise ConfigError(f"--fsdp {_REFUSED[word]} has no zerotune counterpart")
    config = _read(fsdp_config)
    for key in config:
        if key in _XLA and config[key]:
            raise ConfigError(f"--fsdp_config: {key} (XLA's FSDP) is not supported")
        if key not in _IGNORED | _USED | _XLA:
            raise ConfigError(
                f"--fsdp_config: {key!r} is not an FSDP setting zerotune knows"
                + did_you_mean(key, _IGNORED | _USED | _XLA, cutoff=0.6)
            )
    version = str(config.get("version", 2))
    stage = _stage(words, config, version)
    out: dict[str, Any] = {"stage": stage}
    offload = _offload(words, config)
    if offload:
        out["offload_optimizer"] = "cpu"
        if stage == 3:
            out["offload_param"] = "cpu"
    trainer: dict[str, Any] = {}
    if _true(config.get("activation_checkpointing")):
        trainer["activation_checkpointing"] = True
    if _true(config.get("activation_checkpointing_offload")):
        if not _true(config.get("activation_checkpointing")) or version == "1":
            raise ConfigError("--fsdp_config: activation_checkpointing_offload needs "
                              "activation_checkpointing and FSDP2, as in accelerate")  # fmt: skip
        out["offload_activations"] = "cpu"
    kind = str(config.get("state_dict_type", "")).upper().replace("_STATE_DICT", "")
    if kind in ("FULL", "SHARDED"):  # what save_model and checkpoints write
        trainer["gather_weights_on_save"] = kind == "FULL"
    ignored = sorted(k for k in config if k in _IGNORED)
    if ignored:
        log.info("zerotune: FSDP settings with no counterpart, ignored: %s", ", ".join(ignored))
    return out, trainer


def _stage(words: list[str], config: dict, version: str) -> int:
    """The ZeRO stage the sharding asks for: reshard_after_forward (FSDP2, the default
    version: a bool; FSDP1: a strategy name), else FSDP1's sharding_strategy (a name or its
    number); the --fsdp words where the config gives neither (transformers' setdefault)."""
    named = {_STAGES[w] for w in words if w in _STAGES}
    if len(named) > 1:
        raise ConfigError("--fsdp names both full_shard and shard_grad_op; choose one")
    keys = [k for k in ("reshard_after_forward", "sharding_strategy") if k in config]
    if keys[1:] or (version != "1" and keys == ["sharding_strategy"]):
        # transformers reads reshard_after_forward (FSDP1: a strategy name, FSDP2: a bool);
        # FSDP1 under accelerate names it sharding_strategy.
        log.info("zerotune: fsdp_config sharding_strategy ignored (FSDP%s reads "
                 "reshard_after_forward)", version)  # fmt: skip
        keys = keys[:1] if keys[0] == "reshard_after_forward" else []
    if not keys:
        return named.pop() if named else 3  # FSDP's default: full sharding
    key = keys[0]
    value = config[key]
    text = str(value).lower()
    text = {"1": "full_shard", "2": "shard_grad_op", "3": "no_shard", "true": "full_shard",
            "false": "shard_grad_op", "0": "shard_grad_op"}.get(text, text)  # fmt: skip
    if text not in _STAGES:
        raise ConfigError(f"--fsdp_config: {key} {value!r} has no zerotune counterpart "
                          "(full sharding is stage 3, shard_grad_op stage 2)")  # fmt: skip
    if named and named != {_STAGES[text]}:
        raise ConfigError(f"--fsdp {' '.join(words)!r} and --fsdp_config's {key} {value!r} "
                          "give different sharding strategies; keep one")  # fmt: skip
    return _STAGES[text]


def _offload(words: list[str], config: dict) -> bool:
    """Whether CPU offload is asked for: the config's cpu_offload (accelerate's
    offload_params too), else the --fsdp word."""
    for key in ("cpu_offload", "offload_params"):
        if key in config:
            if "offload" in words and not _true(config[key]):
                raise ConfigError(f"--fsdp offload and --fsdp_config's {key} false contradict "
                                  "each other; keep one")  # fmt: skip
            return _true(config[key])
    return "offload" in words


def _read(fsdp_config) -> dict[str, Any]:
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, str) and fsdp_config.lstrip().startswith("{"):
        try:
            fsdp_config = json.loads(fsdp_config)
        except ValueError as exc:
            raise ConfigError(f"--fsdp_config: not JSON: {exc}") from None
    if isinstance(fsdp_config, (str, os.PathLike)):
        try:
            fsdp_config = json.loads(Path(fsdp_config).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--fsdp_config: no such file {str(fsdp_config)!r}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--fsdp_config: cannot read {str(fsdp_config)!r}: {exc}") from None
    if not isinstance(fsdp_config, dict):
        raise ConfigError(f"--fsdp_config must be a JSON object, got {fsdp_config!r}")
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in fsdp_config.items()}


def _true(value) -> bool:
    return str(value).lower() in ("true", "1", "yes") if value is not None else False


def launcher_fsdp_settings() -> dict[str, Any] | None:
    """The FSDP settings ``accelerate launch`` passed this process (ACCELERATE_USE_FSDP and
    its FSDP_* variables, read by accelerate's ``FullyShardedDataParallelPlugin``) as an
    ``fsdp_config``; None when it passed none. Removes ACCELERATE_USE_FSDP."""
    flag = os.environ.pop("ACCELERATE_USE_FSDP", "false")
    if flag.lower() not in ("true", "1", "yes", "on"):
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        # Those two would ask for an accelerator device while reading the settings.
        plugin = FullyShardedDataParallelPlugin(sync_module_states=False,
                                                cpu_ram_efficient_loading=False)  # fmt: skip
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"accelerate launch's FSDP config: {first_line(exc)}") from None
    settings: dict[str, Any] = {
        "version": plugin.fsdp_version,
        "activation_checkpointing": bool(plugin.activation_checkpointing),
        "activation_checkpointing_offload": bool(plugin.activation_checkpointing_offload),
    }
    if plugin.fsdp_version == 1:
        strategy = plugin.sharding_strategy
        settings["sharding_strategy"] = getattr(strategy, "name", str(strategy)).lower()
    else:
        settings["reshard_after_forward"] = bool(plugin.reshard_after_forward)
    policy = plugin.cpu_offload  # FSDP1: CPUOffload; FSDP2: CPUOffloadPolicy or none
    offload = getattr(policy, "offload_params", None)
    settings["cpu_offload"] = bool(offload) if offload is not None else (
        type(policy).__name__ == "CPUOffloadPolicy")  # fmt: skip
    if os.environ.get("FSDP_STATE_DICT_TYPE"):
        settings["state_dict_type"] = os.environ["FSDP_STATE_DICT_TYPE"]
    log.info("zerotune: accelerate's FSDP wrapping, prefetch and loading settings do not "
             "apply (zerotune picks its own units)")  # fmt: skip
    return settings
