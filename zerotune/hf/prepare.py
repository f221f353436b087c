"""A fine-tuning job checked before anything is written: ``prepare_job`` turns ``zerotune
finetune``'s options into a ``Job`` (step 2 of [Note: finetune flow] in
``zerotune/hf/finetune.py``), cheapest checks first; each refusal is a JobError.

``options`` is a mapping of ``zerotune finetune``'s option names (its flags, underscored:
``model``, ``dataset``, ``output_dir``, ``zero_config`` for ``--config``, ...) to values,
with ``hf_args`` the TrainingArguments flags passed through as strings.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .flags import flag_groups, flag_name, flag_value
from .job import JobError, as_job_error

__all__ = [
    "CLI_ARGS",
    "DEFAULT_JOB_ARGS",
    "DEFAULT_MODEL",
    "DEFAULT_OFFLOAD",
    "Job",
    "check_job_args",
    "check_memory",
    "default_dataset",
    "parse_training_args",
    "prepare_job",
    "tokenize",
    "zero_settings",
]

# The embedded default job: what `zerotune finetune --output-dir D` trains.
DEFAULT_MODEL = "tiny-gpt2"
DEFAULT_OFFLOAD = "nvme"
DEFAULT_JOB_ARGS = {
    "max_steps": 40,
    "per_device_train_batch_size": 8,
    "learning_rate": 3e-3,
    "warmup_steps": 5,
    "weight_decay": 0.01,
    "save_steps": 20,
}
# Defaults for every run that differ from TrainingArguments' own.
CLI_ARGS = {
    "logging_steps": 5,
    "report_to": "none",
    "save_total_limit": 2,
    "include_num_input_tokens_seen": True,  # the summary's token count (partial batches too)
}
HOST_MEMORY_ENV = "ZEROTUNE_HOST_MEMORY"  # plan for this much host memory, not what is free


@dataclass
class Job:
    """Everything a run needs, checked (see [Note: finetune flow])."""

    options: dict[str, Any]  # the options it was prepared from
    args: Any  # ZeroTrainingArguments
    model_name: str
    init: str  # "pretrained" or "random"
    model_source: Any  # a folder path (pretrained) or a transformers config (random)
    tokenizer: Any
    tokenizer_kind: str
    dataset: str
    block_size: int
    raw: Any  # the dataset as read
    columns: Any
    train_on_prompt: bool
    eval_split: float
    packing: bool = False  # conversations share blocks ([Note: packed conversations])
    train: Any = None  # blocks, once tokenized
    eval: Any = None
    temp_nvme: str | None = None
    start_step: int = 0  # the global step training started from (resume)


def default_dataset() -> str:
    """The small corpus shipped with zerotune (the default job's data)."""
    from importlib import resources

    return str(resources.files("zerotune._configs") / "data" / "tiny_corpus.txt")


def prepare_job(options: dict[str, Any], world: int = 1, known_flags: Iterable[str] = ()) -> Job:
    """Step 2 of [Note: finetune flow] for a run of ``world`` ranks, cheapest checks
    first, without touching the output folder; ``options`` gets its ``~`` paths expanded.
    ``known_flags``: the caller's own flag names, for "did you mean" on an unknown one.
    Raises JobError."""
    from ..launch import launched_rank, make_temp_nvme, shared_temp_nvme
    from .data import PACKABLE, DataError, choose_columns, load_raw_dataset
    from .deepspeed import planned_world
    from .models import context_length, resolve_model, resolve_tokenizer
    from .record import check_output_dir, check_recorded_arguments, check_resume

    for key in (
        "model",
        "tokenizer",
        "dataset",
        "output_dir",
        "nvme_path",
        "zero_config",
        "chat_template",
    ):
        value = options[key]
        if isinstance(value, str) and value.startswith("~"):
            options[key] = os.path.expanduser(value)  # quoted, so the shell left it
    out = Path(options["output_dir"])
    if out.exists() and not out.is_dir():
        raise JobError(f"--output-dir {out} exists and is not a folder")
    if options["resume"] and not out.is_dir():
        raise JobError(f"--resume: {out} does not exist (nothing to resume)")
    zero = zero_settings(options)
    dataset = options["dataset"] or default_dataset()
    with as_job_error(DataError):
        raw = load_raw_dataset(dataset)
        columns = choose_columns(
            raw.column_names,
            text_column=options["text_column"],
            prompt_column=options["prompt_column"],
            response_column=options["response_column"],
            chat_column=options["chat_column"],
            source=f"dataset {dataset}",
        )
    temp_nvme = None
    nvme_path = zero.get("nvme_path")
    if "nvme_path" in zero and nvme_path is None:
        temp_nvme = shared_temp_nvme()  # made by the launcher
        if temp_nvme is None:
            temp_nvme = make_temp_nvme()
        nvme_path = temp_nvme
    try:
        name = options["model"] or DEFAULT_MODEL
        init = options["init"] or ("random" if options["model"] is None else "pretrained")
        name, init, source, config = resolve_model(name, init)
        with planned_world(world):
            args = parse_training_args(options, zero, nvme_path, known_flags)
        if options["resume"] or args.resume_from_checkpoint:
            check_resume(args)
        if options["resume"]:
            check_recorded_arguments(options, args)
        check_output_dir(Path(args.output_dir), options, args, source)
        tokenizer, tok_kind = resolve_tokenizer(
            options["tokenizer"], options["model"], source, config
        )
        if options["chat_template"] is not None:
            template = Path(options["chat_template"])
            if not template.is_file():
                raise JobError(f"--chat-template {template}: no such file")
            tokenizer.chat_template = template.read_text()
            import jinja2

            try:  # a syntax error found now, before the model is loaded
                _compile_chat_template(tokenizer.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise JobError(
                    f"--chat-template {template}: not a valid Jinja template (line "
                    f"{exc.lineno}: {exc.message})"
                ) from None
        if init == "random":  # the model's special tokens are the tokenizer's
            for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if getattr(tokenizer, key, None) is not None:
                    setattr(config, key, getattr(tokenizer, key))
        context = context_length(config)
        if options["block_size"] is not None and options["block_size"] < 1:
            raise JobError(f"--block-size must be at least 1, got {options['block_size']}")
        block = options["block_size"] or min(context, 1024)
        if block > context:
            raise JobError(f"--block-size {block} exceeds the model's context length {context}")
        if options["packing"] and columns.text is not None:
            raise JobError(
                "--packing is for chat data or prompt/response pairs; a text column is always "
                "cut into full blocks"
            )
        if options["packing"] and config.model_type not in PACKABLE:
            raise JobError(
                f"--packing: a {config.model_type} model takes its positions from the "
                "attention mask, so packed conversations would see each other; packing "
                f"is checked for {', '.join(sorted(PACKABLE))}"
            )
        if not options["no_memory_check"] and not launched_rank():
            check_memory(config, args, block, world)  # a launcher's ranks: checked there
    except BaseException:
        if temp_nvme is not None and shared_temp_nvme() is None:
            shutil.rmtree(temp_nvme, ignore_errors=True)
        raise
    return Job(
        options=options,
        args=args,
        model_name=name,
        init=init,
        model_source=source,
        tokenizer=tokenizer,
        tokenizer_kind=tok_kind,
        dataset=dataset,
        block_size=block,
        raw=raw,
        columns=columns,
        train_on_prompt=options["train_on_prompt"],
        eval_split=options["eval_split"],
        packing=options["packing"],
        temp_nvme=temp_nvme,
    )


def _compile_chat_template(template: str) -> None:
    """Compile ``template`` as transformers does (its ``{% generation %}`` tag and loop
    controls included); raises jinja2.TemplateSyntaxError."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: rendering finds it (a DataError then)
        return
    _compile_jinja_template(template)


def tokenize(job: Job) -> None:
    """Tokenize and pack the dataset into ``job.train`` / ``job.eval`` (rank 0 first, the
    others then read the datasets cache). Raises JobError for data that makes no blocks."""
    from .data import DataError, prepare_datasets

    with job.args.main_process_first(desc="dataset preparation"), as_job_error(DataError):
        job.train, job.eval, job.columns = prepare_datasets(
            job.raw,
            job.tokenizer,
            job.block_size,
            eval_split=job.eval_split,
            text_column=job.columns.text,
            prompt_column=job.columns.prompt,
            response_column=job.columns.response,
            chat_column=job.columns.chat,
            train_on_prompt=job.train_on_prompt,
            seed=job.args.seed,
            name=job.dataset,
            pack=job.packing,
        )


def check_memory(config, args, block: int, world: int) -> None:
    """Refuse, before anything heavy is loaded, a run the memory plan says will not fit
    the free memory here (see zerotune.estimate.preflight); ZEROTUNE_HOST_MEMORY plans for
    another amount of host memory. Raises JobError."""
    import psutil
    import torch

    from ..config import ConfigError, parse_bytes
    from ..estimate import preflight

    zero = args.zero
    given = os.environ.get(HOST_MEMORY_ENV)
    with as_job_error(ConfigError):
        host = parse_bytes(given, name=HOST_MEMORY_ENV) if given else None
    host = host or psutil.virtual_memory().available
    cuda = torch.cuda.is_available() and not args.use_cpu
    gpu = torch.cuda.mem_get_info()[0] if cuda else None
    with as_job_error(ConfigError, ValueError):
        refusal = preflight(
            config,
            zero,
            world_size=world,
            seq_len=block,
            # --auto_find_batch_size lowers the batch until it fits: plan for the least
            micro_batch=1 if args.auto_find_batch_size else args.per_device_train_batch_size,
            checkpointing=bool(args.gradient_checkpointing),
            device="cuda" if cuda else "cpu",
            host_memory=host,
            gpu_memory=gpu,
            # NVMe space: the engine sizes its swap files exactly, before any weight is
            # loaded, and refuses a folder without room itself.
        )
    if refusal is not None:
        raise JobError(f"{refusal}; --no-memory-check runs it anyway")


_CONFIG_KEYS = {"zero_stage": "stage"}
_PASSED_ZERO_FLAGS = ("zero_stage", "offload_param", "offload_optimizer")


def zero_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The zerotune fields from --config / --stage / --offload / --nvme-path (the flags win),
    checked as a whole; as ZeroTrainingArguments fields (``zero_stage``, ...).
    ``nvme_path`` None with nvme offload: a temporary folder is made. Raises JobError."""
    from ..config import ConfigError, ZeroConfig
    from .configs import read_zero_config_file

    passed_config = flag_value(options["hf_args"], "zero_config")
    if passed_config is not None:
        if options["zero_config"] not in (None, passed_config):
            raise JobError("give the zerotune config once (--config or --zero_config)")
        options["zero_config"] = passed_config  # the same file, read once, as --config
    if not options["zero_config"] and options["job"] is not None:
        from .job import read_job_file

        # The job file's zero section (checked by apply_job_file) goes on as an inline
        # config: read here and by the TrainingArguments as a config file is.
        section = read_job_file(options["job"]).zero
        options["zero_config"] = json.dumps(section) if section else None
    base: dict = {}
    if options["zero_config"]:
        with as_job_error(ConfigError):
            base = read_zero_config_file(options["zero_config"])
    deepspeed = flag_value(options["hf_args"], "deepspeed")
    if deepspeed is not None:  # its ZeRO section is the base ([Note: DeepSpeed configs])
        from .deepspeed import deepspeed_zero_base, read_deepspeed_config

        if options["zero_config"]:
            raise JobError("--deepspeed and --config both give the ZeRO configuration; keep one")
        with as_job_error(ConfigError):
            base = deepspeed_zero_base(read_deepspeed_config(deepspeed))
    fsdp = flag_value(options["hf_args"], "fsdp")
    if any(flag_name(g[0]) == "fsdp" for g in flag_groups(options["hf_args"])):
        if fsdp is None or fsdp.startswith("--"):
            fsdp = "true"  # a bare --fsdp: everything in --fsdp_config
    if fsdp is not None:  # its settings are the base ([Note: FSDP settings])
        from .fsdp import zero_config_from_fsdp

        if options["zero_config"] or deepspeed is not None:
            raise JobError("--fsdp and --config (or --deepspeed) both give the sharding; keep one")
        with as_job_error(ConfigError):
            base, _ = zero_config_from_fsdp(fsdp, flag_value(options["hf_args"], "fsdp_config"))
    default_job = options["model"] is None
    # The TrainingArguments spellings (--zero_stage, --offload_param, --offload_optimizer)
    # win over --stage / --offload, which win over the config file.
    passed = {k: flag_value(options["hf_args"], k) for k in _PASSED_ZERO_FLAGS}
    stage_flag = passed["zero_stage"]
    if stage_flag is not None and stage_flag.isdigit():
        stage = int(stage_flag)
    else:
        stage = int(options["stage"]) if options["stage"] else base.get("stage", 3)
    explicit = passed["offload_param"] or passed["offload_optimizer"]
    offload = options["offload"] or (
        DEFAULT_OFFLOAD if default_job and not base and not explicit else None
    )
    settings: dict = {"zero_stage": stage}
    if offload is not None:
        settings["offload_optimizer"] = offload
        settings["offload_param"] = offload if stage == 3 else "none"
    param = passed["offload_param"] or settings.get(
        "offload_param", base.get("offload_param", "none")
    )
    optim = passed["offload_optimizer"] or settings.get(
        "offload_optimizer", base.get("offload_optimizer", "none")
    )
    activations = flag_value(options["hf_args"], "offload_activations") or base.get(
        "offload_activations", "none"
    )
    if "nvme" in (param, optim, activations):
        settings["nvme_path"] = options["nvme_path"] or base.get("nvme_path")
    elif options["nvme_path"]:
        raise JobError("--nvme-path is set but nothing is offloaded to nvme (add --offload nvme)")
    merged = {**base, **{_CONFIG_KEYS.get(k, k): v for k, v in settings.items()}}
    merged.update(offload_param=param, offload_optimizer=optim)  # passed-through flags win
    merged["offload_activations"] = activations  # a passed-through flag; checked here too
    if "nvme_path" in settings and merged["nvme_path"] is None:
        merged["nvme_path"] = tempfile.gettempdir()  # stands for the folder made later
    with as_job_error(ConfigError):
        try:
            ZeroConfig.from_dict(merged)
        except ConfigError as exc:
            raise ConfigError(f"impossible zerotune configuration: {exc}") from None
    return settings


# TrainingArguments flags that transformers 5 renamed or folded into others.
_RENAMED = {
    "warmup_ratio": "transformers 5 takes a fraction in --warmup_steps (e.g. --warmup_steps 0.1)",
    "group_by_length": "use --train_sampling_strategy group_by_length",
    "evaluation_strategy": "use --eval_strategy",
    "overwrite_output_dir": "use --overwrite (or --resume to continue the run)",
}


def parse_training_args(
    options: dict[str, Any],
    zero: dict[str, Any],
    nvme_path: str | None,
    known_flags: Iterable[str] = (),
):
    """ZeroTrainingArguments from the passed-through flags over this command's defaults
    (``CLI_ARGS``; the default job's ``DEFAULT_JOB_ARGS`` without --model), the zerotune
    settings ``zero`` (``zero_settings``) and ``nvme_path``, checked (``check_job_args``).
    An unknown flag is refused naming the closest of ``known_flags`` and the
    TrainingArguments fields. Raises JobError."""
    from transformers import HfArgumentParser

    from .args import ZeroTrainingArguments
    from .job import training_fields

    class Parser(HfArgumentParser):
        def error(self, message):  # argparse would print usage and exit
            raise JobError(message)

    parser = Parser(ZeroTrainingArguments, allow_abbrev=False)  # --learning_rat is no flag
    defaults = dict(CLI_ARGS)
    if options["model"] is None:
        defaults.update(DEFAULT_JOB_ARGS)
        if flag_value(options["hf_args"], "num_train_epochs") is not None:
            # The default job's 40 steps would override the epochs asked for.
            del defaults["max_steps"]
    parser.set_defaults(**defaults)
    argv = ["--output_dir", options["output_dir"]]
    if options["zero_config"]:
        argv += ["--zero_config", options["zero_config"]]
    for key, value in zero.items():
        if key == "nvme_path":
            value = nvme_path
        if value is not None:
            argv += [f"--{key}", str(value)]
    argv += list(options["hf_args"])  # last: an explicit --zero_stage / --offload_param wins
    with as_job_error(ValueError):
        args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        given = [f.split("=")[0].lstrip("-") for f in rest if f[:2] == "--"]
        names = [g.replace("-", "_") for g in given]
        hints = [_RENAMED[n] for n in names if n in _RENAMED]
        names_known = training_fields() | set(known_flags)
        known = sorted(n for n in names_known if n not in ("h", "help"))
        for raw, name in zip(given, names):
            if name not in _RENAMED:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
                if close:  # in the spelling the user wrote: both are accepted
                    sep = "-" if "-" in raw else "_"
                    hints.append(f"did you mean --{close[0].replace('_', sep)}?")
        hint = f"; {'; '.join(hints)}" if hints else ""
        raise JobError(
            f"unknown option(s): {' '.join(rest)} (neither a zerotune finetune nor a "
            f"TrainingArguments flag; see zerotune finetune --help){hint}"
        )
    if options["eval_split"] == 0 and str(getattr(args.eval_strategy, "value", "no")) != "no":
        raise JobError(
            f"--eval_strategy {args.eval_strategy.value} needs held-out data: add --eval-split "
            "0.1 (for example)"
        )
    check_job_args(args)
    return args


# The metrics zerotune finetune's evaluation reports (it computes the loss only).
_EVAL_METRICS = ("loss", "eval_loss")


def check_job_args(args) -> None:
    """TrainingArguments that the Trainer would only trip over once the run has started (a
    traceback, an output folder half made), refused first. Raises JobError."""
    from ..estimate_table import checkpointing_flag

    if args.max_steps == 0 or (args.max_steps < 0 and args.num_train_epochs <= 0):
        raise JobError(
            "nothing to train: give --max_steps of at least 1, or --num_train_epochs above 0"
        )
    activations = args.zero.offload_activations
    if activations != "none" and not (
        args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)
    ):
        raise JobError(
            f"--offload_activations {activations} moves the saved inputs of checkpointed "
            f"blocks: add {checkpointing_flag()}"
        )
    if args.metric_for_best_model is not None and args.metric_for_best_model not in _EVAL_METRICS:
        raise JobError(
            f"--metric_for_best_model {args.metric_for_best_model}: the evaluation of "
            "zerotune finetune computes no metric but the loss; use --metric_for_best_model loss"
        )
    _check_scheduler(args)
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    for name in args.report_to or []:
        if name not in ("none", "all") and name not in available:
            raise JobError(
                f"--report_to {name}: its package is not installed (installed: "
                f"{', '.join(sorted(available)) or 'none'}); install it or use --report_to none"
            )
    if args.push_to_hub and os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise JobError("--push_to_hub needs the network, and HF_HUB_OFFLINE is set")
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise JobError("--use_liger_kernel needs the liger-kernel package, which is not installed")


def _check_scheduler(args) -> None:
    """Build the chosen LR schedule once on a stand-in optimizer: a schedule that needs
    arguments it was not given (--lr_scheduler_kwargs) fails here, in one line."""
    import torch
    from transformers import get_scheduler

    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    steps = args.max_steps if args.max_steps > 0 else 100
    name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if name == "reduce_lr_on_plateau":
        return  # needs evaluation, which the Trainer checks itself with a clear message
    try:
        get_scheduler(
            name,
            stand_in,
            num_warmup_steps=args.get_warmup_steps(steps),
            num_training_steps=steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )
    except (TypeError, ValueError) as exc:
        raise JobError(
            f"--lr_scheduler_type {name}: {str(exc).splitlines()[0]} (pass them as "
            "--lr_scheduler_kwargs '{\"name\": value}')"
        ) from None
