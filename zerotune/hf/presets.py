"""Model presets shipped in ``configs/models/*.json`` (random-init configs, no download)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

__all__ = ["list_presets", "model_config"]


def _preset_dir():
    return resources.files("zerotune._configs") / "models"


def list_presets() -> list[str]:
    return sorted(
        p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json")
    )


def model_config(name_or_path: str):
    """A transformers config from a preset name (``gpt2-xl``), a config.json path, or a folder
    holding one."""
    from transformers import AutoConfig

    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
    else:
        preset = _preset_dir() / f"{name_or_path}.json"
        if not preset.is_file():
            raise ValueError(
                f"unknown model preset {name_or_path!r}; presets: {', '.join(list_presets())}, "
                "or give a config.json path"
            )
        data = json.loads(preset.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{name_or_path}: config has no model_type")
    return AutoConfig.for_model(model_type, **data)
