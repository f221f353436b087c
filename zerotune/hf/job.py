"""Job files: one YAML for a whole fine-tuning job (``zerotune finetune --job job.yaml``).

[Note: job files]
A job file has four sections, each optional:

    model:    {name, init, tokenizer}                     the --model / --init / --tokenizer flags
    data:     {dataset, text_column, prompt_column, response_column, chat_column,
               chat_template, train_on_prompt, packing, block_size, eval_split}
    zero:     the fields of a zerotune config (stage, offload_param, nvme_path, ...)
    training: TrainingArguments and ZeroTrainingArguments fields (output_dir, learning_rate,
              max_steps, ...)

``read_job_file`` checks every key against all four groups: a key in the wrong section or
misspelt is refused with the closest match across them ("training.stage: did you mean
zero.stage?"). Relative paths (dataset, chat template, tokenizer, model folder, output and
NVMe folders) are relative to the job file's folder. Flags given on the command line win over the
file, key by key; ``--config`` replaces the ``zero`` section as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "JobError",
    "JobFile",
    "JobFileError",
    "apply_job_file",
    "as_job_error",
    "read_job_file",
    "training_fields",
]

MODEL_KEYS = {"name": "model", "init": "init", "tokenizer": "tokenizer"}
DATA_KEYS = {
    "dataset": "dataset",
    "text_column": "text_column",
    "prompt_column": "prompt_column",
    "response_column": "response_column",
    "chat_column": "chat_column",
    "chat_template": "chat_template",
    "train_on_prompt": "train_on_prompt",
    "packing": "packing",
    "block_size": "block_size",
    "eval_split": "eval_split",
}
SECTIONS = ("model", "data", "zero", "training")
# Values that may name files or folders: a relative one that exists next to the job file
# is that one (else it stays a name: a preset, a hub id).
_INPUTS = {("data", "dataset"), ("data", "chat_template"), ("model", "tokenizer"),
           ("model", "name")}  # fmt: skip
# Folders a run writes: a relative one is relative to the job file's folder.
_OUTPUTS = {("zero", "nvme_path"), ("training", "output_dir"), ("training", "nvme_path")}


class JobError(ValueError):
    """A fine-tuning job that cannot run as given (a missing file, a refused option, an
    impossible setting): the message is one sentence that says what to do instead.
    ``zerotune finetune`` prints it as its one error line."""


@contextlib.contextmanager
def as_job_error(*kinds: type[BaseException]):
    """Turn the expected errors of a step (``kinds``: a ConfigError, a DataError, ...) into
    JobError with their message; a JobError passes as it is."""
    try:
        yield
    except JobError:
        raise
    except kinds as exc:
        raise JobError(str(exc).strip() or repr(exc)) from None


class JobFileError(JobError):
    """The job file cannot be used as written; the message says where and why."""


@dataclass
class JobFile:
    """A job file, checked: ``options`` (zerotune finetune's option names to values),
    ``training`` (TrainingArguments fields), ``zero`` (a zerotune config mapping)."""

    path: Path
    options: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    zero: dict[str, Any] = field(default_factory=dict)

    def training_flags(self, given: set[str]) -> list[str]:
        """The ``training`` section as command-line flags, leaving out ``given`` names."""
        argv: list[str] = []
        for key, value in self.training.items():
            if key in given or value is None:
                continue
            if isinstance(value, bool):
                argv += [f"--{key}", "true" if value else "false"]
            elif isinstance(value, (list, tuple)):
                argv += [f"--{key}", *map(str, value)]
            elif isinstance(value, dict):
                argv += [f"--{key}", json.dumps(value)]
            else:
                argv += [f"--{key}", str(value)]
        return argv


def training_fields() -> set[str]:
    """The fields of ZeroTrainingArguments (TrainingArguments' and zerotune's), by name."""
    from .args import ZeroTrainingArguments

    return {f.name for f in dataclasses.fields(ZeroTrainingArguments) if f.init}


def apply_job_file(options: dict[str, Any], given: set[str]) -> None:
    """Fill ``options`` (zerotune finetune's option names to values) from the job file that
    ``options["job"]`` names, where the command line gave none (``given``: the names it
    gave): its model and data settings, its output and NVMe folders, and its training
    section as flags before ``options["hf_args"]``. Its zero section is read by
    ``zerotune.hf.prepare.zero_settings`` (also when --resume names the job)."""
    from .flags import flag_groups, flag_name

    job = read_job_file(options["job"])
    for key, value in job.options.items():
        if key not in given:
            options[key] = value
    for key in ("output_dir", "nvme_path"):  # zerotune finetune's own flags
        value = job.training.get(key) or (job.zero.get(key) if key == "nvme_path" else None)
        if value is not None and key not in given:
            options[key] = value
    named = {flag_name(g[0]) for g in flag_groups(options["hf_args"])}
    flags = job.training_flags(named | {"output_dir", "nvme_path"})
    options["hf_args"] = (*flags, *options["hf_args"])


def _zero_fields() -> set[str]:
    from ..config import ZeroConfig

    return {f.name for f in dataclasses.fields(ZeroConfig)}


def read_job_file(path: str | Path) -> JobFile:
    """The job file at ``path``, every key checked (see [Note: job files])."""
    import yaml

    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise JobFileError(f"job file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise JobFileError(
            f"job file {path} is not valid YAML ({str(exc).splitlines()[0]})"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise JobFileError(f"job file {path}: a mapping of sections ({', '.join(SECTIONS)})")
    known = {
        "model": set(MODEL_KEYS),
        "data": set(DATA_KEYS),
        "zero": _zero_fields(),
        "training": training_fields(),
    }
    job = JobFile(path)
    for section, body in data.items():
        if section not in known:
            raise JobFileError(f"job file {path}: {section!r} {_guess(section, known)}")
        if section == "model" and isinstance(body, str):
            body = {"name": body}  # model: gpt2
        if body is None:
            continue
        if not isinstance(body, dict):
            raise JobFileError(f"job file {path}: section {section!r} must be a mapping")
        for key, value in body.items():
            if key not in known[section]:
                where = f"{section}.{key}"
                raise JobFileError(f"job file {path}: {where!r} {_guess(key, known, section)}")
            if section in ("model", "data"):
                _check_type(path, f"{section}.{key}", key, value)
            if isinstance(value, str) and not Path(value).expanduser().is_absolute():
                beside = path.parent / value
                if (section, key) in _OUTPUTS or ((section, key) in _INPUTS and beside.exists()):
                    value = str(beside.resolve())
            if section == "model":
                job.options[MODEL_KEYS[key]] = value
            elif section == "data":
                job.options[DATA_KEYS[key]] = value
            elif section == "zero":
                job.zero[key] = value
            else:
                job.training[key] = value
    return job


_TYPES = {"block_size": (int, "a whole number"), "eval_split": ((int, float), "a number"),
          "train_on_prompt": (bool, "true or false"),
          "packing": (bool, "true or false")}  # fmt: skip


def _check_type(path: Path, where: str, key: str, value) -> None:
    kind, what = _TYPES.get(key, (str, "text"))
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise JobFileError(f"job file {path}: {where!r} is {value!r}, not {what}")


def _guess(name: str, known: dict[str, set[str]], section: str | None = None) -> str:
    """What to say of an unknown ``name``: not known, and the closest key of any section (of
    ``section`` itself first), or at the top (``section`` None) the closest section or key."""
    order = sorted(known, key=lambda s: s == section)  # the own section last: it wins
    candidates = {k: f"{s}.{k}" for s in order for k in known[s]}
    if section is None:
        candidates.update({s: s for s in SECTIONS})
        what = f"is not a section ({', '.join(SECTIONS)})"
    else:
        what = "is not a known key"
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.7)
    return f"{what}; did you mean {candidates[close[0]]}?" if close else what
