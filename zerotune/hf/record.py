"""A fine-tuning run's output folder: what an earlier run left there, the job record that
``--resume`` continues from, and when a resume is refused.

[Note: job record]
A run writes ``zerotune_job.json`` into its output folder once its input is known good,
just before training: the options that define its model and data (``RECORDED``), its dtype
and the TrainingArguments flags it was given (``trainer_args``, less those a resume never
takes over: ``NOT_RESUMED``). ``--resume`` continues the run as it was started:
``adopt_recorded_job`` fills the options it is not given from the record and refuses ones
that differ (they would silently train another job from the checkpoint); the dtype and seed
the resumed arguments give are compared once they are parsed (``check_recorded_arguments``). A
folder without a record (an older zerotune, checkpoints copied in) has nothing to compare.
A folder holding an earlier run is refused unless the run continues it or ``--overwrite``
replaces it (``check_output_dir``); its files are deleted only once the input has been
checked (``clear_output_dir``), and other files in it are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .flags import flag_groups, flag_name
from .job import JobError, as_job_error

__all__ = [
    "JOB_RECORD",
    "RECORDED",
    "RUN_FILES",
    "adopt_recorded_job",
    "check_output_dir",
    "check_recorded_arguments",
    "check_resume",
    "clear_output_dir",
    "is_inside",
    "is_run_output",
    "job_record",
    "read_job_record",
    "write_job_record",
]

# What a run writes into its output folder (the model, its tokenizer, the Trainer's
# checkpoints, the summary): an earlier run's, and what --overwrite deletes.
RUN_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "training_args.json",
        "run_summary.json",
        "loss_curve.png",
        "zerotune_job.json",
    }
)
JOB_RECORD = "zerotune_job.json"
# The options that define a run's training data and model (see [Note: job record]).
RECORDED = (
    "job",  # its zero section: the rest is recorded below
    "model",
    "init",
    "tokenizer",
    "dataset",
    "text_column",
    "prompt_column",
    "response_column",
    "chat_column",
    "chat_template",
    "train_on_prompt",
    "packing",
    "block_size",
    "eval_split",
)
# zerotune finetune's own ZeRO flags (--stage, --offload, --nvme-path, --config): recorded,
# and taken over by a resume that does not give them (a checkpoint loads at any stage or
# tier, so one given anew wins, as a TrainingArguments flag does).
ZERO_OPTIONS = ("stage", "offload", "nvme_path", "zero_config")
# Flags a resume never takes over from the run it continues (the dtype is the record's own).
NOT_RESUMED = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "bf16", "fp16")
_DTYPE_FLAGS = ("--bf16", "--fp16")


def is_run_output(entry: Path) -> bool:
    """Whether ``entry`` of an output folder is a run's (``RUN_FILES``, weight shards,
    checkpoints), not the user's own."""
    name = entry.name
    if entry.is_dir() and not entry.is_symlink():
        return name.startswith(("checkpoint-", ".zerotune-model-"))
    return name in RUN_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def is_inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or below it (links resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def check_output_dir(out: Path, options: dict[str, Any], args, model_source) -> None:
    """The output folder can be made and written, and holds no earlier run (its model,
    checkpoints, summary) unless the run resumes it or --overwrite says to replace it:
    checkpoints of two runs side by side would be rotated away, or resumed from, as if
    they were this run's. Other files in it are left alone, --overwrite or not. Raises
    JobError."""
    continues = options["resume"] or bool(
        args.resume_from_checkpoint and is_inside(Path(args.resume_from_checkpoint), out)
    )  # the run that is there (a checkpoint elsewhere starts this folder afresh)
    if options["overwrite"] and continues:
        raise JobError("--overwrite replaces the run that --resume would continue: give one")
    if isinstance(model_source, Path) and out.exists() and out.resolve() == model_source.resolve():
        raise JobError(f"--output-dir {out} is the model's own folder; choose another one")
    if not out.exists():
        from ..checkpoint.files import cannot_create

        why = cannot_create(out.parent)
        if why is not None:
            raise JobError(f"cannot create --output-dir {out}: {why}")
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise JobError(f"--output-dir {out}: no permission to write there")
    earlier = sorted(e.name for e in out.iterdir() if is_run_output(e))
    if earlier == [JOB_RECORD]:
        earlier = []  # a run stopped before it wrote anything else: nothing to keep
    if not earlier or continues:
        return  # nothing of an earlier run (the run writes next to the user's files), or its own
    shown = ", ".join(earlier[:4]) + (", ..." if len(earlier) > 4 else "")
    if not options["overwrite"]:
        raise JobError(
            f"--output-dir {out} holds an earlier run ({shown}): add --resume to continue it, "
            "--overwrite to replace it, or choose another folder"
        )
    inputs = {"--model": model_source if isinstance(model_source, Path) else None}
    for flag, key in (("--tokenizer", "tokenizer"), ("--dataset", "dataset")):
        if options[key] and Path(options[key]).exists():
            inputs[flag] = Path(options[key])
    for flag, path in inputs.items():
        if path is not None and is_inside(path, out):
            raise JobError(
                f"--overwrite: {flag} {path} is inside --output-dir {out}; move it out first"
            )


def clear_output_dir(out: Path) -> None:
    """--overwrite, once the model is built and the data tokenized (bad input has been found
    by then): the earlier run's files go; other files stay."""
    for entry in list(out.iterdir()) if out.is_dir() else []:
        if not is_run_output(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _as_recorded(value):
    """A local path as an absolute one (a resume may run from another folder)."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def job_record(options: dict[str, Any], args) -> dict[str, Any]:
    """The record of a run started with ``options`` and parsed TrainingArguments ``args``
    (see [Note: job record])."""
    record = {key: _as_recorded(options[key]) for key in RECORDED}
    if options.get("job") is None:  # a job file's zero section is read again from the file
        record.update({key: _as_recorded(options.get(key)) for key in ZERO_OPTIONS})
    record["dtype"] = args.zero.dtype  # from --bf16 / --fp16 or the config file
    record["seed"] = getattr(args, "seed", None)  # it chose the held-out blocks and order
    # The TrainingArguments flags as given (batch size, accumulation, schedule, ...): a
    # resume that does not give them again trains with these.
    groups = flag_groups(options["hf_args"])
    record["trainer_args"] = [a for g in groups if flag_name(g[0]) not in NOT_RESUMED for a in g]
    return record


def write_job_record(out: Path, record: dict[str, Any]) -> None:
    """Write ``record`` into the output folder ``out`` (whole or not at all)."""
    tmp = out / f".{JOB_RECORD}.partial"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / JOB_RECORD)


def read_job_record(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The job record in ``output_dir``; None when there is none. Raises JobError for one
    that cannot be read."""
    path = Path(output_dir).expanduser() / JOB_RECORD
    if not path.is_file():
        return None  # a run of an older zerotune, or checkpoints copied in: nothing to compare
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise JobError(f"--resume: cannot read {path} ({exc})") from None
    if not isinstance(record, dict):
        raise JobError(f"--resume: cannot read {path} (not a JSON object)")
    return record


def _refuse_resume(output_dir, differ: list[str]) -> None:
    raise JobError(
        f"--resume: this run was started with {'; '.join(differ)}. Resume with the run's "
        "own options (leave them out to reuse them), or train on from one of its "
        "checkpoints into another folder: --resume_from_checkpoint "
        f"{output_dir}/checkpoint-N --output-dir NEW"
    )


def adopt_recorded_job(options: dict[str, Any], given: set[str]) -> None:
    """--resume: the options the command line did not give (``given``: the names it gave)
    come from the record of the run in ``options["output_dir"]``; ones that differ from it
    are refused, and the TrainingArguments flags not given again are the run's (a new value
    wins). See [Note: job record]. Raises JobError."""
    record = read_job_record(options["output_dir"])
    if record is None:
        return
    differ = []
    for key in RECORDED:
        if key not in record:
            continue
        if key not in given:
            options[key] = record[key]
        elif _as_recorded(options[key]) != record[key]:
            was = "the default" if record[key] is None else record[key]
            differ.append(f"--{key.replace('_', '-')} {was} (now {options[key]})")
    if differ:
        _refuse_resume(options["output_dir"], differ)
    for key in ZERO_OPTIONS:
        if key in record and key not in given:
            options[key] = record[key]
    given_flags = {flag_name(g[0]) for g in flag_groups(options["hf_args"])}
    for group in flag_groups(record.get("trainer_args", [])):
        if flag_name(group[0]) not in given_flags:
            options["hf_args"] = (*options["hf_args"], *group)
    dtype = record.get("dtype", "fp32")
    named = any(a.split("=")[0] in _DTYPE_FLAGS for a in options["hf_args"])
    if dtype != "fp32" and not named and "zero_config" not in given:
        options["hf_args"] = (*options["hf_args"], f"--{dtype}")


def check_recorded_arguments(options: dict[str, Any], args) -> None:
    """--resume: the dtype the parsed arguments give (flags or config file) and their seed
    (another one holds out other blocks: evaluation data would be trained on) are the run's.
    Raises JobError."""
    record = read_job_record(options["output_dir"])
    if record is None:
        return
    differ = []
    if record.get("dtype", args.zero.dtype) != args.zero.dtype:
        differ.append(f"dtype {record['dtype']} (now {args.zero.dtype})")
    seed = getattr(args, "seed", None)
    if record.get("seed") not in (None, seed):
        differ.append(f"--seed {record['seed']} (now {seed})")
    if differ:
        _refuse_resume(options["output_dir"], differ)


def check_resume(args) -> None:
    """The checkpoint a resume starts from is there and complete: --resume_from_checkpoint's,
    or the newest complete one in the output folder. Raises JobError."""
    from ..checkpoint import CheckpointError
    from .checkpoints import check_resumable, latest_complete_checkpoint

    with as_job_error(CheckpointError):  # a damaged one: its line, not a traceback
        if args.resume_from_checkpoint:
            check_resumable(Path(args.resume_from_checkpoint))
        elif latest_complete_checkpoint(args.output_dir) is None:
            raise JobError(f"--resume: no complete checkpoint in {args.output_dir}")
