"""FSDP settings given to ``ZeroTrainingArguments`` (``--fsdp``, ``--fsdp_config``, or
``accelerate launch`` with an FSDP config).

[Note: FSDP settings]
Users moving from FSDP bring `--fsdp "full_shard offload auto_wrap"` with an `--fsdp_config`,
or an accelerate config that turns FSDP on. FSDP and zerotune shard the same data-parallel
way and train the same numbers, so the settings become zerotune's config instead of a
refusal:
- the sharding: `full_shard` (FSDP2's `reshard_after_forward` true, FSDP1's FULL_SHARD)
  is stage 3; `shard_grad_op` (false; SHARD_GRAD_OP) stage 2: parameters stay gathered
  between forward and backward. `no_shard` and the hybrid strategies have no zerotune
  counterpart and are refused;
- CPU offload (`offload`, `cpu_offload`, accelerate's `offload_params`): FSDP keeps the
  parameter shards and gradients on the host and steps the optimizer there; zerotune puts
  the parameters (stage 3) and the optimizer state on the CPU tier;
- `activation_checkpointing` is the Trainer's own (`--activation_checkpointing`, earlier
  `--gradient_checkpointing`);
- wrapping (`auto_wrap`, `transformer_layer_cls_to_wrap`, `min_num_params`), prefetching,
  state-dict types and loading options tune FSDP itself: zerotune picks its own units
  (the model's `_no_split_modules`, embeddings and head) and names the ignored keys in the
  log. XLA's FSDP is refused; an unknown key is refused with the nearest known one.
Under `accelerate launch` the settings come from accelerate's own
`FullyShardedDataParallelPlugin` (its FSDP_* variables), and ACCELERATE_USE_FSDP is removed
from the process so that neither the Trainer nor accelerate wraps the engine.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ..config import ConfigError

__all__ = ["launcher_fsdp_settings", "zero_config_from_fsdp"]

log = logging.getLogger(__name__)

_STAGES = {"full_shard": 3, "shard_grad_op": 2}
_REFUSED = {
    "no_shard": "no_shard (plain data parallelism: use the plain Trainer)",
    "hybrid_shard": "hybrid_shard (sharding within a node, replicas across nodes)",
    "hybrid_shard_zero2": "hybrid_shard_zero2 (sharding within a node, replicas across nodes)",
}
_WORDS = set(_STAGES) | set(_REFUSED) | {"offload", "auto_wrap"}
# fsdp_config keys that tune FSDP itself: read and ignored.
_IGNORED = {
    "min_num_params", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "backward_prefetch",
    "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states",
    "cpu_ram_efficient_loading", "state_dict_type", "version", "offload_state_dict",
    "transformer_cls_names_to_wrap",
}  # fmt: skip
_USED = {"reshard_after_forward", "sharding_strategy", "cpu_offload", "offload_params",
         "activation_checkpointing"}  # fmt: skip
_XLA = {"xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2"}


def zero_config_from_fsdp(fsdp, fsdp_config) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(zerotune config mapping, Trainer argument values)`` from ``--fsdp`` (True, a string
    of options or a list) and ``--fsdp_config`` (a dict, a JSON file or None); see [Note:
    FSDP settings]. Raises ConfigError in one line for what zerotune cannot honour."""
    if isinstance(fsdp, str) and fsdp.lower() in ("true", "1"):  # --fsdp true: all in the config
        fsdp = True
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    for word in words:
        if word not in _WORDS:
            raise ConfigError(f"--fsdp: unknown option {word!r}" + _nearest(word, _WORDS))
        if word in _REFUSED:
            raise ConfigError(f"--fsdp {_REFUSED[word]} has no zerotune counterpart")
    config = _read(fsdp_config)
    for key in config:
        if key in _XLA and config[key]:
            raise ConfigError(f"--fsdp_config: {key} (XLA's FSDP) is not supported")
        if key not in _IGNORED | _USED | _XLA:
            raise ConfigError(
                f"--fsdp_config: {key!r} is not an FSDP setting zerotune knows"
                + _nearest(key, _IGNORED | _USED | _XLA)
            )
    stage = _stage(words, config)
    out: dict[str, Any] = {"stage": stage}
    if (
        "offload" in words
        or _true(config.get("cpu_offload"))
        or _true(config.get("offload_params"))
    ):
        out["offload_optimizer"] = "cpu"
        if stage == 3:
            out["offload_param"] = "cpu"
    trainer = {}
    if _true(config.get("activation_checkpointing")):
        trainer["activation_checkpointing"] = True
    ignored = sorted(k for k in config if k in _IGNORED)
    if ignored:
        log.info("zerotune: FSDP settings with no counterpart, ignored: %s", ", ".join(ignored))
    return out, trainer


def _stage(words: list[str], config: dict) -> int:
    named = [_STAGES[w] for w in words if w in _STAGES]
    if len(set(named)) > 1:
        raise ConfigError("--fsdp names both full_shard and shard_grad_op; choose one")
    strategy = config.get("sharding_strategy")
    if strategy is not None:  # FSDP1 / accelerate: a name or its number (1-5)
        name = str(strategy).lower()
        name = {"1": "full_shard", "2": "shard_grad_op", "3": "no_shard"}.get(name, name)
        if name in _REFUSED or name not in _STAGES:
            raise ConfigError(f"--fsdp_config: sharding_strategy {strategy!r} has no zerotune "
                              "counterpart (full_shard and shard_grad_op have)")  # fmt: skip
        named.append(_STAGES[name])
    reshard = config.get("reshard_after_forward")
    if reshard is not None:  # FSDP2: a bool; FSDP1: a strategy name
        text = str(reshard).lower()
        if text in ("true", "false", "1", "0"):
            named.append(3 if text in ("true", "1") else 2)
        elif text in _STAGES:
            named.append(_STAGES[text])
        else:
            raise ConfigError(f"--fsdp_config: reshard_after_forward {reshard!r} has no zerotune "
                              "counterpart (true: stage 3, false: stage 2)")  # fmt: skip
    if len(set(named)) > 1:
        raise ConfigError("--fsdp and --fsdp_config give different sharding strategies")
    return named[0] if named else 3  # FSDP's default: full sharding


def _read(fsdp_config) -> dict[str, Any]:
    if fsdp_config is None:
        return {}
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


def _nearest(word: str, known) -> str:
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def launcher_fsdp_settings() -> dict[str, Any] | None:
    """The FSDP settings ``accelerate launch`` passed this process (ACCELERATE_USE_FSDP and
    its FSDP_* variables, read by accelerate's ``FullyShardedDataParallelPlugin``) as an
    ``fsdp_config``; None when it passed none. Removes ACCELERATE_USE_FSDP."""
    flag = os.environ.pop("ACCELERATE_USE_FSDP", "false")
    if flag.lower() not in ("true", "1", "yes", "on"):
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        plugin = FullyShardedDataParallelPlugin()
    except (ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"accelerate launch's FSDP config: {first}") from None
    settings: dict[str, Any] = {"activation_checkpointing": bool(plugin.activation_checkpointing)}
    if isinstance(plugin.reshard_after_forward, bool):  # FSDP2
        settings["reshard_after_forward"] = plugin.reshard_after_forward
    else:  # FSDP1: a ShardingStrategy
        strategy = plugin.sharding_strategy
        settings["sharding_strategy"] = getattr(strategy, "name", str(strategy)).lower()
    policy = plugin.cpu_offload  # FSDP1: CPUOffload; FSDP2: CPUOffloadPolicy or none
    offload = getattr(policy, "offload_params", None)
    settings["cpu_offload"] = bool(offload) if offload is not None else (
        type(policy).__name__ == "CPUOffloadPolicy")  # fmt: skip
    return settings
