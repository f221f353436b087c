"""zerotune config presets (``configs/*.yaml``), reading config files before validation, and
a config described in one line.

The flags of ``ZeroTrainingArguments`` and ``zerotune finetune`` are merged into a file's
mapping first, and only the result is validated as a ``ZeroConfig``; this module reads the
mapping. It imports neither transformers nor torch, so the command line can check a config
before loading either.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ..config import ConfigError

__all__ = ["describe_config", "list_zero_presets", "read_zero_config_file"]


def list_zero_presets() -> list[str]:
    """Names of the zerotune config presets shipped in ``configs/*.yaml``."""
    folder = resources.files("zerotune._configs")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_zero_config_file(name_or_path: str | Path) -> dict[str, Any]:
    """The mapping in a zerotune config file (YAML or JSON), in a shipped preset given by
    name (``zero3-offload-nvme``), or written inline as a JSON object (a job file's zero
    section passed on). Not validated: flags are merged in first."""
    if isinstance(name_or_path, str) and name_or_path.lstrip().startswith("{"):
        try:
            data = json.loads(name_or_path)
        except ValueError as exc:
            raise ConfigError(f"cannot read the inline zerotune config: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("an inline zerotune config must be a JSON object")
        return data
    path = Path(name_or_path)
    if not path.is_file():
        preset = resources.files("zerotune._configs") / f"{name_or_path}.yaml"
        if not preset.is_file():
            presets = ", ".join(list_zero_presets())
            raise ConfigError(
                f"zerotune config {str(name_or_path)!r} is neither a file nor a preset ({presets})"
            )
        path = Path(str(preset))
    try:
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any read or parse error becomes one message
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot read zerotune config {path}: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a zerotune config must be a mapping of keys to values")
    return data


def describe_config(config) -> str:
    """One line naming a ZeroConfig's stage, dtype, offload tiers and memory options."""
    parts = [f"ZeRO-{config.stage}", config.dtype]
    if config.offload_param != "none" or config.offload_optimizer != "none":
        parts.append(f"offload param={config.offload_param} optimizer={config.offload_optimizer}")
    if config.offload_activations != "none":
        parts.append(f"activation checkpoints on {config.offload_activations}")
    if config.optim_state_bits == 8:
        parts.append("8-bit Adam states")
    if config.tile_linear_bytes:
        parts.append(f"linears tiled above {config.tile_linear_bytes:,} bytes")
    return ", ".join(parts)
