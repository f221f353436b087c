"""Which model and tokenizer a fine-tuning job trains: a local folder, a hub id from the
local cache, a preset or a config file (``--init random``), checked before anything is
loaded; and a model built on the meta device for the memory plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from .job import JobError

__all__ = [
    "ResolvedModel",
    "check_causal_lm",
    "context_length",
    "has_tokenizer",
    "looks_like_a_path",
    "meta_model",
    "resolve_model",
    "resolve_tokenizer",
]


class ResolvedModel(NamedTuple):
    """``source`` is the model's folder (``init`` "pretrained") or its transformers config
    itself (``init`` "random"); ``config`` is its transformers config either way."""

    name: str
    init: str
    source: Any
    config: Any


def looks_like_a_path(name: str) -> bool:
    """A name meant as a local path (not a hub id ``org/name``): absolute, relative to
    ``.`` / ``..`` / ``~``, or ending in .json."""
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".json")


def resolve_model(name: str, init: str) -> ResolvedModel:
    """The model ``name`` names, checked: ``init`` "random" takes a preset, a config file or
    folder, or a hub id's config; "pretrained" a folder or cached hub id holding safetensors
    weights. Either must be a causal language model. Raises JobError."""
    from . import list_presets, model_config

    if looks_like_a_path(name) and not Path(name).exists():
        raise JobError(f"--model {name}: no such file or folder")
    if init == "random":
        try:
            config = model_config(name)  # a preset, a config file or folder, a hub id
        except ValueError as exc:
            raise JobError(str(exc)) from None
        check_causal_lm(name, config)
        return ResolvedModel(name, init, config, config)
    from transformers import AutoConfig

    from ..init.pretrained import ModelLoadError, resolve_model_folder

    try:
        folder = resolve_model_folder(name)
    except ModelLoadError as exc:
        hint = ""
        if name in list_presets():
            hint = f" ({name!r} is also a zerotune preset: add --init random to train it from "
            hint += "random weights)"
        raise JobError(f"unknown model: {exc}{hint}") from None
    if not any(folder.glob("*.safetensors")):
        raise JobError(
            f"model {name!r}: {folder} has no *.safetensors weights (zerotune loads only "
            "safetensors; add --init random to start from random weights)"
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001
        raise JobError(f"model {name!r}: cannot read {folder}/config.json: {exc}") from None
    check_causal_lm(name, config)
    return ResolvedModel(name, init, folder, config)


def check_causal_lm(name: str, config) -> None:
    """Fine-tuning trains a causal language model: the config must have transformers' class
    for one (a T5 or BERT config has none). Raises JobError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = getattr(config, "model_type", None) or type(config).__name__
        raise JobError(
            f"model {name!r}: transformers has no causal language model class for {kind!r} "
            "models (AutoModelForCausalLM), which finetune trains"
        )


def resolve_tokenizer(tokenizer: str | None, model: str | None, source, config):
    """(tokenizer, description): ``tokenizer`` (a folder or hub id) when given, else the
    model's own (its folder: ``source`` when pretrained, ``model`` when that is a folder),
    else a byte-level tokenizer that needs no download. It must fit the vocabulary of
    ``config`` and have an end-of-sequence token. Raises JobError."""
    from transformers import AutoTokenizer

    from .data import byte_tokenizer

    given = tokenizer
    if given is not None and looks_like_a_path(given) and not Path(given).exists():
        raise JobError(f"--tokenizer {given}: no such folder")
    folder = source if isinstance(source, Path) else None
    if folder is None and model and Path(model).is_dir():
        folder = Path(model)  # --init random from a folder: its tokenizer
    if given is None and folder is not None and has_tokenizer(folder):
        given = str(folder)
    if given is not None:
        try:
            tok = AutoTokenizer.from_pretrained(given)
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"cannot load tokenizer {given!r}: {exc}") from None
        kind = f"tokenizer of {given}"
    else:
        tok = byte_tokenizer()
        kind = "byte-level tokenizer (no tokenizer given)"
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise JobError(
            f"the {kind} has {len(tok)} tokens but the model's vocabulary is {vocab}; give a "
            "matching --tokenizer"
        )
    if tok.eos_token_id is None:
        raise JobError(f"the {kind} has no end-of-sequence token")
    return tok, kind


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's files."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any((folder / n).is_file() for n in names)


def context_length(config, default: int | None = 1024) -> int | None:
    """The model's context length from its config, or ``default`` when it names none."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def meta_model(model):
    """(module, name) for ``model``: a module as is; a transformers config, preset name,
    config.json path or folder built on the meta device (no weights)."""
    from torch import nn

    if isinstance(model, nn.Module):
        return model, type(model).__name__
    from ..init.construct import build_on_meta

    name = None
    if isinstance(model, str):
        from .presets import model_config

        name = model
        model = model_config(model)
    built = build_on_meta(model)
    return built, name or type(built).__name__
