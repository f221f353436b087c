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


def _hub_config(name: str):
    """The config of hub id ``name`` (config.json only: from the local cache, or downloaded
    where the hub is reachable and HF_HUB_OFFLINE is not set), or None."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name)
    except Exception:  # noqa: BLE001 - not a hub id, not cached, or no network: not found
        return None


def model_config(name_or_path: str):
    """A transformers config from a preset name (``gpt2-xl``), a config.json path, a folder
    holding one, or a hub id (its config.json only: from the cache, or downloaded)."""
    from transformers import AutoConfig

    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
    else:
        preset = _preset_dir() / f"{name_or_path}.json"
        if not preset.is_file():
            hub = _hub_config(str(name_or_path))
            if hub is not None:
                return hub
            raise ValueError(
                f"unknown model {name_or_path!r}: not a preset ({', '.join(list_presets())}), "
                "a config.json path, a folder, or a hub id whose config is in the local "
                "Hugging Face cache or can be downloaded"
            )
        data = json.loads(preset.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{name_or_path}: config has no model_type")
    return AutoConfig.for_model(model_type, **data)
