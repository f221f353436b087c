"""``zerotune finetune``: full fine-tuning of a causal LM with ZeroTrainer, from one command.

[Note: finetune flow]
1. Parse: click takes the zerotune options; every other ``--flag`` goes to
   ``HfArgumentParser(ZeroTrainingArguments)``, so any TrainingArguments flag works.
2. Check everything that can be wrong before writing anything: the zerotune config (preset
   YAML merged with --stage / --offload / --nvme-path), the dataset and its columns, the
   model, the arguments, the tokenizer, then the engine itself (NVMe space is checked when
   its swap files are made, before any weight is loaded), then tokenization and packing.
   Bad input ends here with one line and exit code 2, and the output folder has not been
   created.
3. ``--nproc-per-node N`` (outside torchrun) re-runs this command in N processes through
   ``torch.distributed.run`` once step 2 passed in the parent (all but the engine, which only
   the ranks build); the launcher owns the processes.
4. Train with ZeroTrainer, write the consolidated HF folder into --output-dir, then (rank 0)
   the loss curve PNG, ``run_summary.json`` and the summary on the terminal.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from .messages import one_line

BAD_INPUT = 2

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


class BadInput(click.ClickException):
    """Bad input: one line on stderr, exit code 2. A message quoting a library's error keeps
    its first line (transformers' go on with advice over several)."""

    exit_code = BAD_INPUT

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))

    def show(self, file=None) -> None:
        report_dir = os.environ.get(_ERRORS_ENV)
        if report_dir:
            # A rank under --nproc-per-node: the parent prints each distinct message once.
            rank = os.environ.get("RANK", "0")
            Path(report_dir, f"rank{rank}.txt").write_text(self.message)
            return
        click.echo(f"zerotune finetune: error: {self.message}", err=True)


class _Command(click.Command):
    """Usage errors (a bad choice, a missing --output-dir) as one line and exit code 2. Each
    of this command's flags also takes the TrainingArguments spelling (``--output_dir`` for
    ``--output-dir``), and is given once."""

    def parse_args(self, ctx, args):
        args = self._own_spelling(ctx, list(args))
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise BadInput(exc.format_message()) from None

    def _own_spelling(self, ctx, args: list[str]) -> list[str]:
        own = {o for p in self.get_params(ctx) for o in p.opts if o.startswith("--")}
        seen: dict[str, str] = {}
        out = []
        for arg in args:
            flag, eq, value = arg.partition("=")
            dashed = flag.replace("_", "-") if flag.startswith("--") else flag
            if dashed in own:
                if dashed in seen and dashed not in ("--help",):
                    raise BadInput(
                        f"{dashed} is given more than once ({seen[dashed]}, then {flag}); "
                        "give it once"
                    )
                seen[dashed] = flag
                arg = dashed + eq + value
            out.append(arg)
        return out


def _default_dataset() -> str:
    from importlib import resources

    return str(resources.files("zerotune._configs") / "data" / "tiny_corpus.txt")


@dataclass
class Job:
    """Everything a run needs, checked (see [Note: finetune flow])."""

    args: object  # ZeroTrainingArguments
    model_name: str
    init: str  # "pretrained" or "random"
    model_source: object  # a folder path (pretrained) or a transformers config (random)
    tokenizer: object
    tokenizer_kind: str
    dataset: str
    block_size: int
    raw: object  # the dataset as read
    columns: object
    train_on_prompt: bool
    eval_split: float
    train: object = None  # blocks, once tokenized
    eval: object = None
    temp_nvme: str | None = None
    start_step: int = 0  # the global step training started from (resume)


@click.command(
    cls=_Command,
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.option(
    "--model",
    default=None,
    help="A local HF folder, a hub id (from the cache), or with --init random a preset "
    "(tiny-gpt2, gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a config.json. "
    f"Default: the {DEFAULT_MODEL} preset from random weights (the embedded default job).",
)
@click.option(
    "--init",
    type=click.Choice(["pretrained", "random"]),
    default=None,
    help="pretrained: load the model's weights (default); random: zero-init from its config.",
)
@click.option(
    "--tokenizer",
    default=None,
    help="Tokenizer folder or hub id (default: the "
    "model's own; without one, a byte-level tokenizer that needs no download).",
)
@click.option(
    "--dataset",
    default=None,
    help="json/jsonl/csv/parquet/txt file or folder, or a hub dataset name. "
    "Default: the small corpus shipped with zerotune.",
)
@click.option("--text-column", default=None, help="Column holding the text (default: text).")
@click.option("--prompt-column", default=None, help="Prompt column of prompt/response data.")
@click.option("--response-column", default=None, help="Response column of prompt/response data.")
@click.option(
    "--chat-column",
    default=None,
    help="Column of conversations (default: messages, or ShareGPT's conversations).",
)
@click.option(
    "--chat-template",
    default=None,
    help="A Jinja chat template file for chat data (default: the tokenizer's own, else "
    "zerotune's simple one, saved with the tokenizer).",
)
@click.option(
    "--train-on-prompt",
    is_flag=True,
    help="Also compute the loss on prompt tokens (chat data: on every turn, not only the "
    "assistant's).",
)
@click.option(
    "--block-size",
    type=int,
    default=None,
    help="Tokens per training block (default: the model's context length, at most 1024).",
)
@click.option(
    "--eval-split",
    type=float,
    default=0.0,
    show_default=True,
    help="Fraction of the blocks held out for evaluation.",
)
@click.option(
    "--stage",
    type=click.Choice(["1", "2", "3"]),
    default=None,
    help="ZeRO stage (default 3, or the config's).",
)
@click.option(
    "--offload",
    type=click.Choice(["none", "cpu", "nvme"]),
    default=None,
    help="Offload optimizer state (and at stage 3 parameters) to CPU RAM or NVMe.",
)
@click.option(
    "--nvme-path",
    default=None,
    help="Folder for NVMe swap files (default: a temporary folder, removed at the end).",
)
@click.option(
    "--config",
    "zero_config",
    default=None,
    help="zerotune config: a YAML/JSON file or a preset name (zero3, "
    "zero3-offload-cpu, zero3-offload-nvme); the flags above override it.",
)
@click.option(
    "--output-dir",
    default=None,
    help="Where the model, checkpoints, loss curve and summary go (required, here or as "
    "training.output_dir in the job file).",
)
@click.option(
    "--job",
    default=None,
    help="A YAML job file: model, data, zero and training sections (see configs/jobs/); "
    "the flags given here win over it.",
)
@click.option(
    "--nproc-per-node",
    type=int,
    default=None,
    help="Run N processes on this node through torch.distributed.run.",
)
@click.option(
    "--resume", is_flag=True, help="Resume from the newest complete checkpoint in --output-dir."
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace what an earlier run left in --output-dir (refused without it).",
)
@click.option(
    "--no-memory-check",
    is_flag=True,
    help="Skip the check, before loading, that the memory plan of this run fits the free "
    "host (and GPU) memory (ZEROTUNE_HOST_MEMORY=16GiB plans for another amount).",
)
@click.option(
    "--help-trainer",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _, value: _print_trainer_help(ctx) if value else None,
    help="List every TrainingArguments / ZeroTrainingArguments flag, and exit.",
)
@click.argument("hf_args", nargs=-1, type=click.UNPROCESSED)
def finetune(**options) -> None:
    """Fully fine-tune a causal LM with ZeRO-3 / ZeRO-Infinity.

    With only --output-dir it trains the embedded default job: the tiny-gpt2 preset from
    random weights on the corpus shipped with zerotune, ZeRO-3 with NVMe offload to a
    temporary folder, 40 steps (a minute or two on 2 CPU cores).

    Every TrainingArguments flag works too (--max_steps 100, --learning_rate 2e-5, --bf16,
    --gradient_accumulation_steps 4, --eval_strategy steps, --save_steps 500, ...), and so do
    the ZeroTrainingArguments ones (--prefetch_bytes 64MiB, --offload_param cpu, ...):
    --help-trainer lists them. Each flag takes either spelling (--output_dir, --output-dir).

    \b
    Examples:
      zerotune finetune --output-dir out          # the embedded default job
      zerotune finetune --model path/to/hf-model --dataset data.jsonl --output-dir out \\
          --offload cpu --max_steps 500 --bf16
      zerotune finetune --model gpt2-xl --init random --config zero3-offload-nvme \\
          --nvme-path /mnt/nvme --output-dir out
      zerotune finetune --output-dir out --nproc-per-node 2
      zerotune finetune --output-dir out --resume --max_steps 120
    """
    nproc = options.pop("nproc_per_node")
    ctx = click.get_current_context()
    given = {k for k in options if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
    if options["job"] is not None:
        _apply_job_file(options, given)
    if options["output_dir"] is None:
        raise BadInput("give the output folder: --output-dir (or training.output_dir in --job)")
    if options["resume"]:
        _adopt_recorded_job(options, given)
    under_launcher = (
        "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
    )
    if nproc is not None and nproc < 1:
        raise BadInput(f"--nproc-per-node must be at least 1, got {nproc}")
    if nproc is not None and nproc > 1 and not under_launcher:
        _launch(nproc, options)
        return
    if under_launcher:
        _run_rank(options)
    try:
        _run(options)
    except KeyboardInterrupt:
        # Ctrl-C: the checkpoints written so far are complete (a partial one is not marked
        # so).
        click.echo(_stopped_line("SIGINT", options["output_dir"]), err=True)
        sys.exit(128 + signal.SIGINT)


_HOST_MEMORY_ENV = "ZEROTUNE_HOST_MEMORY"  # plan for this much host memory, not what is free


def _check_memory(config, args, block: int, world: int) -> None:
    """Refuse, before anything heavy is loaded, a run the memory plan says will not fit
    the free memory here (see zerotune.estimate.preflight)."""
    import psutil
    import torch

    from zerotune.config import ConfigError, parse_bytes
    from zerotune.estimate import preflight

    zero = args.zero
    given = os.environ.get(_HOST_MEMORY_ENV)
    with _fail_on(ConfigError):
        host = parse_bytes(given, name=_HOST_MEMORY_ENV) if given else None
    host = host or psutil.virtual_memory().available
    cuda = torch.cuda.is_available() and not args.use_cpu
    gpu = torch.cuda.mem_get_info()[0] if cuda else None
    with _fail_on(ConfigError, ValueError):
        refusal = preflight(
            config,
            zero,
            world_size=world,
            seq_len=block,
            micro_batch=args.per_device_train_batch_size,
            checkpointing=bool(args.gradient_checkpointing),
            device="cuda" if cuda else "cpu",
            host_memory=host,
            gpu_memory=gpu,
            # NVMe space: the engine sizes its swap files exactly, before any weight is
            # loaded, and refuses a folder without room itself.
        )
    if refusal is not None:
        raise BadInput(f"{refusal}; --no-memory-check runs it anyway")


def _apply_job_file(options: dict, given: set[str]) -> None:
    """The job file's model, data and training settings where the command line gives none
    (its zero section: ``_zero_settings``, also when --resume names the job); see [Note:
    job files]."""
    from zerotune.hf.job import JobFileError, read_job_file

    with _fail_on(JobFileError):
        job = read_job_file(options["job"])
    for key, value in job.options.items():
        if key not in given:
            options[key] = value
    for key in ("output_dir", "nvme_path"):  # this command's own flags
        value = job.training.get(key) or (job.zero.get(key) if key == "nvme_path" else None)
        if value is not None and key not in given:
            options[key] = value
    named = {_flag_name(g[0]) for g in _flag_groups(options["hf_args"])}
    flags = job.training_flags(named | {"output_dir", "nvme_path"})
    options["hf_args"] = (*flags, *options["hf_args"])


def _threads_per_process(nproc: int) -> int:
    """Threads for each of ``nproc`` processes: the CPUs this process may use, shared out
    (OMP_NUM_THREADS, when set, decides). Said once; set here for one process."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        threads, why = int(given), "OMP_NUM_THREADS"
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cpus or 1) // nproc)
        why = f"{cpus} CPUs shared by {nproc} process(es); OMP_NUM_THREADS sets another number"
    if nproc == 1:
        import torch

        torch.set_num_threads(threads)
    click.echo(f"zerotune finetune: {threads} thread(s) per process ({why})")
    return threads


def _build_ops_once() -> None:
    """Compile the C++ ops now if this machine has not yet, saying so (else the first
    step would seem stuck for the minute it takes)."""
    from zerotune.ops.build import OPS, build_all, op_status

    if any(op_status(name).state == "not built" for name in OPS):
        click.echo("zerotune finetune: building the C++ ops (first run only, about a minute)")
        build_all()


def _describe_folder(path: Path) -> str:
    """``path (filesystem, free space)``: the filesystem of the longest mount point above it."""
    import psutil

    real = Path(path).resolve()
    mounts = [m for m in psutil.disk_partitions(all=True) if _inside(real, Path(m.mountpoint))]
    fstype = max(mounts, key=lambda m: len(m.mountpoint)).fstype if mounts else "unknown"
    free = shutil.disk_usage(real).free
    return f"{path} ({fstype}, {free / 2**30:,.1f} GiB free)"


def _stopped_line(signal_name: str, output_dir) -> str:
    """What an interrupted run says: how to go on, if any checkpoint is complete."""
    from zerotune.hf.trainer import TRAINER_MARKER

    if not list(Path(output_dir).glob(f"checkpoint-*/{TRAINER_MARKER}")):
        return f"zerotune finetune: stopped by {signal_name} before the first checkpoint"
    return (
        f"zerotune finetune: stopped by {signal_name}; the complete checkpoints in "
        f"{output_dir} resume with --resume"
    )


def _run_rank(options: dict) -> None:
    """``_run`` as a rank under a launcher, ending through ``zerotune.dist.leave`` whatever
    happens (see [Note: leaving a gloo rank]): bad input shows its line (the launcher
    prints it once), an interrupt leaves quietly (the launcher says it), anything else
    prints its traceback; the exit codes are those click would give."""
    import traceback

    from zerotune.dist import leave

    try:
        _run(options)
    except click.ClickException as exc:
        exc.show()
        leave(exc.exit_code)
    except KeyboardInterrupt:
        leave(128 + signal.SIGINT)
    except SystemExit as exc:  # SIGTERM (_exit_on_sigterm), or a sys.exit below
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        leave(code)
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)


# ------------------------------------------------------------------------------ checks
@contextlib.contextmanager
def _fail_on(*kinds):
    """Turn the expected errors of a step into BadInput (its first line)."""
    try:
        yield
    except BadInput:
        raise
    except kinds as exc:
        raise BadInput(str(exc).strip() or repr(exc)) from None  # its first line


def _zero_settings(options: dict) -> dict:
    """The zerotune fields from --config / --stage / --offload / --nvme-path (the flags win),
    checked as a whole. ``nvme_path`` None with nvme offload: a temporary folder is made."""
    from zerotune.config import ConfigError, ZeroConfig
    from zerotune.hf.configs import read_zero_config_file

    passed_config = _flag_value(options["hf_args"], "zero_config")
    if passed_config is not None:
        if options["zero_config"] not in (None, passed_config):
            raise BadInput("give the zerotune config once (--config or --zero_config)")
        options["zero_config"] = passed_config  # the same file, read once, as --config
    if not options["zero_config"] and options["job"] is not None:
        from zerotune.hf.job import read_job_file

        # The job file's zero section (checked by _apply_job_file) goes on as an inline
        # config: read here and by the TrainingArguments as a config file is.
        section = read_job_file(options["job"]).zero
        options["zero_config"] = json.dumps(section) if section else None
    base: dict = {}
    if options["zero_config"]:
        with _fail_on(ConfigError):
            base = read_zero_config_file(options["zero_config"])
    default_job = options["model"] is None
    # The TrainingArguments spellings (--zero_stage, --offload_param, --offload_optimizer)
    # win over --stage / --offload, which win over the config file.
    passed = {k: _flag_value(options["hf_args"], k) for k in _PASSED_ZERO_FLAGS}
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
    activations = _flag_value(options["hf_args"], "offload_activations") or base.get(
        "offload_activations", "none"
    )
    if "nvme" in (param, optim, activations):
        settings["nvme_path"] = options["nvme_path"] or base.get("nvme_path")
    elif options["nvme_path"]:
        raise BadInput("--nvme-path is set but nothing is offloaded to nvme (add --offload nvme)")
    merged = {**base, **{_CONFIG_KEYS.get(k, k): v for k, v in settings.items()}}
    merged.update(offload_param=param, offload_optimizer=optim)  # passed-through flags win
    merged["offload_activations"] = activations  # a passed-through flag; checked here too
    if "nvme_path" in settings and merged["nvme_path"] is None:
        merged["nvme_path"] = tempfile.gettempdir()  # stands for the folder made later
    with _fail_on(ConfigError):
        try:
            ZeroConfig.from_dict(merged)
        except ConfigError as exc:
            raise ConfigError(f"impossible zerotune configuration: {exc}") from None
    return settings


_CONFIG_KEYS = {"zero_stage": "stage"}
_PASSED_ZERO_FLAGS = ("zero_stage", "offload_param", "offload_optimizer")


def _flag_value(argv: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value of ``--name`` (or ``--name-with-dashes``) among the passed-through
    TrainingArguments flags, in either ``--flag value`` or ``--flag=value`` form."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _print_trainer_help(ctx) -> None:
    from transformers import HfArgumentParser

    from zerotune.hf.args import ZeroTrainingArguments

    parser = HfArgumentParser(ZeroTrainingArguments, prog="zerotune finetune", add_help=False)
    click.echo(parser.format_help())
    ctx.exit(0)


def _known_flags() -> list[str]:
    """Every flag name this command takes: its own and the TrainingArguments ones."""
    from zerotune.hf.job import training_fields

    names = training_fields()
    names.update(o.lstrip("-").replace("-", "_") for p in finetune.params for o in p.opts)
    return sorted(n for n in names if n not in ("h", "help"))


def _parse_training_args(options: dict, zero: dict, nvme_path: str | None):
    from transformers import HfArgumentParser

    from zerotune.hf.args import ZeroTrainingArguments

    class Parser(HfArgumentParser):
        def error(self, message):  # argparse would print usage and exit
            raise BadInput(message)

    parser = Parser(ZeroTrainingArguments, allow_abbrev=False)  # --learning_rat is no flag
    defaults = dict(CLI_ARGS)
    if options["model"] is None:
        defaults.update(DEFAULT_JOB_ARGS)
        if _flag_value(options["hf_args"], "num_train_epochs") is not None:
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
    with _fail_on(ValueError):
        args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        names = [f.split("=")[0].lstrip("-").replace("-", "_") for f in rest if f[:2] == "--"]
        hints = [_RENAMED[n] for n in names if n in _RENAMED]
        known = _known_flags()
        for name in names:
            if name not in _RENAMED:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
                hints += [f"did you mean --{close[0]}?"] if close else []
        hint = f"; {'; '.join(hints)}" if hints else ""
        raise BadInput(
            f"unknown option(s): {' '.join(rest)} (neither a zerotune finetune nor a "
            f"TrainingArguments flag; see zerotune finetune --help){hint}"
        )
    if options["eval_split"] == 0 and str(getattr(args.eval_strategy, "value", "no")) != "no":
        raise BadInput(
            f"--eval_strategy {args.eval_strategy.value} needs held-out data: add --eval-split "
            "0.1 (for example)"
        )
    _check_job_args(args)
    return args


# The metrics this command's evaluation reports (it computes the loss only).
_EVAL_METRICS = ("loss", "eval_loss")


def _check_job_args(args) -> None:
    """TrainingArguments that the Trainer would only trip over once the run has started (a
    traceback, an output folder half made), refused first."""
    if args.max_steps == 0 or (args.max_steps < 0 and args.num_train_epochs <= 0):
        raise BadInput(
            "nothing to train: give --max_steps of at least 1, or --num_train_epochs above 0"
        )
    activations = args.zero.offload_activations
    if activations != "none" and not (
        args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)
    ):
        raise BadInput(
            f"--offload_activations {activations} moves the saved inputs of checkpointed "
            "blocks: add --activation_checkpointing (or --gradient_checkpointing)"
        )
    if args.metric_for_best_model is not None and args.metric_for_best_model not in _EVAL_METRICS:
        raise BadInput(
            f"--metric_for_best_model {args.metric_for_best_model}: the evaluation of "
            "zerotune finetune computes no metric but the loss; use --metric_for_best_model loss"
        )
    _check_scheduler(args)
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    for name in args.report_to or []:
        if name not in ("none", "all") and name not in available:
            raise BadInput(
                f"--report_to {name}: its package is not installed (installed: "
                f"{', '.join(sorted(available)) or 'none'}); install it or use --report_to none"
            )
    if args.push_to_hub and os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise BadInput("--push_to_hub needs the network, and HF_HUB_OFFLINE is set")
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise BadInput("--use_liger_kernel needs the liger-kernel package, which is not installed")


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
        raise BadInput(
            f"--lr_scheduler_type {name}: {str(exc).splitlines()[0]} (pass them as "
            "--lr_scheduler_kwargs '{\"name\": value}')"
        ) from None


# What a run of this command writes into its output folder (the model, its tokenizer, the
# Trainer's checkpoints, the summary): an earlier run's, and what --overwrite deletes.
_RUN_FILES = frozenset(
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
# What defines a run's training data and model, recorded in its output folder when it starts
# (``zerotune_job.json``): --resume reuses what it is not given and refuses what differs.
_JOB_RECORD = "zerotune_job.json"
_RECORDED = (
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
    "block_size",
    "eval_split",
)
_DTYPE_FLAGS = ("--bf16", "--fp16")


def _is_run_output(entry: Path) -> bool:
    name = entry.name
    if entry.is_dir() and not entry.is_symlink():
        return name.startswith(("checkpoint-", ".zerotune-model-"))
    return name in _RUN_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _check_output_dir(out: Path, options: dict, args, model_source) -> None:
    """The output folder can be made and written, and holds no earlier run (its model,
    checkpoints, summary) unless the run resumes it or --overwrite says to replace it:
    checkpoints of two runs side by side would be rotated away, or resumed from, as if
    they were this run's. Other files in it are left alone, --overwrite or not."""
    continues = options["resume"] or bool(
        args.resume_from_checkpoint and _inside(Path(args.resume_from_checkpoint), out)
    )  # the run that is there (a checkpoint elsewhere starts this folder afresh)
    if options["overwrite"] and continues:
        raise BadInput("--overwrite replaces the run that --resume would continue: give one")
    if isinstance(model_source, Path) and out.exists() and out.resolve() == model_source.resolve():
        raise BadInput(f"--output-dir {out} is the model's own folder; choose another one")
    if not out.exists():
        from zerotune.checkpoint.files import cannot_create

        why = cannot_create(out.parent)
        if why is not None:
            raise BadInput(f"cannot create --output-dir {out}: {why}")
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise BadInput(f"--output-dir {out}: no permission to write there")
    earlier = sorted(e.name for e in out.iterdir() if _is_run_output(e))
    if earlier == [_JOB_RECORD]:
        earlier = []  # a run stopped before it wrote anything else: nothing to keep
    if not earlier or continues:
        return  # nothing of an earlier run (the run writes next to the user's files), or its own
    shown = ", ".join(earlier[:4]) + (", ..." if len(earlier) > 4 else "")
    if not options["overwrite"]:
        raise BadInput(
            f"--output-dir {out} holds an earlier run ({shown}): add --resume to continue it, "
            "--overwrite to replace it, or choose another folder"
        )
    inputs = {"--model": model_source if isinstance(model_source, Path) else None}
    for flag, key in (("--tokenizer", "tokenizer"), ("--dataset", "dataset")):
        if options[key] and Path(options[key]).exists():
            inputs[flag] = Path(options[key])
    for flag, path in inputs.items():
        if path is not None and _inside(path, out):
            raise BadInput(
                f"--overwrite: {flag} {path} is inside --output-dir {out}; move it out first"
            )


def _clear_output_dir(out: Path) -> None:
    """--overwrite, once the model is built and the data tokenized (bad input has been found
    by then): the earlier run's files go; other files stay."""
    for entry in list(out.iterdir()) if out.is_dir() else []:
        if not _is_run_output(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# TrainingArguments flags that transformers 5 renamed or folded into others.
_RENAMED = {
    "warmup_ratio": "transformers 5 takes a fraction in --warmup_steps (e.g. --warmup_steps 0.1)",
    "group_by_length": "use --train_sampling_strategy group_by_length",
    "evaluation_strategy": "use --eval_strategy",
    "overwrite_output_dir": "use --overwrite (or --resume to continue the run)",
}


def _as_recorded(value):
    """A local path as an absolute one (a resume may run from another folder)."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def _job_record(options: dict, args) -> dict:
    record = {key: _as_recorded(options[key]) for key in _RECORDED}
    record["dtype"] = args.zero.dtype  # from --bf16 / --fp16 or the config file
    # The TrainingArguments flags as given (batch size, accumulation, schedule, ...): a
    # resume that does not give them again trains with these.
    record["trainer_args"] = [
        a
        for g in _flag_groups(options["hf_args"])
        if _flag_name(g[0]) not in _NOT_RESUMED
        for a in g
    ]
    return record


# Flags a resume never takes over from the run it continues (the dtype is the record's own).
_NOT_RESUMED = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "bf16", "fp16")


def _flag_groups(argv) -> list[list[str]]:
    """``--flag value ...`` groups of a flag list (values do not start with ``--``)."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("--"):
            groups.append([arg])
        elif groups:
            groups[-1].append(arg)
    return groups


def _flag_name(flag: str) -> str:
    return flag[2:].split("=")[0].replace("-", "_")


def _write_job_record(out: Path, record: dict) -> None:
    tmp = out / f".{_JOB_RECORD}.partial"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / _JOB_RECORD)


def _read_job_record(options: dict) -> dict | None:
    path = Path(options["output_dir"]).expanduser() / _JOB_RECORD
    if not path.is_file():
        return None  # a run of an older zerotune, or checkpoints copied in: nothing to compare
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"--resume: cannot read {path} ({exc})") from None
    if not isinstance(record, dict):
        raise BadInput(f"--resume: cannot read {path} (not a JSON object)")
    return record


def _refuse_resume(options: dict, differ: list[str]) -> None:
    raise BadInput(
        f"--resume: this run was started with {'; '.join(differ)}. Resume with the run's "
        "own options (leave them out to reuse them), or train on from one of its "
        "checkpoints into another folder: --resume_from_checkpoint "
        f"{options['output_dir']}/checkpoint-N --output-dir NEW"
    )


def _adopt_recorded_job(options: dict, given: set[str]) -> None:
    """--resume continues the run in --output-dir as it was started: the model, data and
    dtype options it is not given come from the run's record; ones that differ from it are
    refused (they would silently train another job from the checkpoint). The dtype given
    is compared once the arguments are parsed (``_check_recorded_dtype``). The
    TrainingArguments flags it is not given again are the run's (a new value wins)."""
    record = _read_job_record(options)
    if record is None:
        return
    differ = []
    for key in _RECORDED:
        if key not in record:
            continue
        if key not in given:
            options[key] = record[key]
        elif _as_recorded(options[key]) != record[key]:
            was = "the default" if record[key] is None else record[key]
            differ.append(f"--{key.replace('_', '-')} {was} (now {options[key]})")
    if differ:
        _refuse_resume(options, differ)
    given_flags = {_flag_name(g[0]) for g in _flag_groups(options["hf_args"])}
    for group in _flag_groups(record.get("trainer_args", [])):
        if _flag_name(group[0]) not in given_flags:
            options["hf_args"] = (*options["hf_args"], *group)
    dtype = record.get("dtype", "fp32")
    named = any(a.split("=")[0] in _DTYPE_FLAGS for a in options["hf_args"])
    if dtype != "fp32" and not named and "zero_config" not in given:
        options["hf_args"] = (*options["hf_args"], f"--{dtype}")


def _check_recorded_dtype(options: dict, args) -> None:
    """--resume: the dtype the arguments give (flags or config file) is the run's."""
    record = _read_job_record(options)
    if record is not None and record.get("dtype", args.zero.dtype) != args.zero.dtype:
        _refuse_resume(options, [f"dtype {record['dtype']} (now {args.zero.dtype})"])


def _check_resume(options: dict, args) -> None:
    from zerotune.checkpoint import CheckpointError
    from zerotune.hf.trainer import check_resumable, latest_complete_checkpoint

    if args.resume_from_checkpoint:
        with _fail_on(CheckpointError):
            check_resumable(Path(args.resume_from_checkpoint))
    elif latest_complete_checkpoint(args.output_dir) is None:
        raise BadInput(f"--resume: no complete checkpoint in {args.output_dir}")


def _resolve_model(options: dict):
    """(name, init, source, config): source is a folder for pretrained, the config itself
    for random init."""
    from zerotune.hf import list_presets, model_config

    name = options["model"] or DEFAULT_MODEL
    init = options["init"] or ("random" if options["model"] is None else "pretrained")
    if _looks_like_a_path(name) and not Path(name).exists():
        raise BadInput(f"--model {name}: no such file or folder")
    if init == "random":
        try:
            config = model_config(name)  # a preset, a config file or folder, a hub id
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        _check_causal_lm(name, config)
        return name, init, config, config
    from transformers import AutoConfig

    from zerotune.init.pretrained import ModelLoadError, resolve_model_folder

    try:
        folder = resolve_model_folder(name)
    except ModelLoadError as exc:
        hint = ""
        if name in list_presets():
            hint = f" ({name!r} is also a zerotune preset: add --init random to train it from "
            hint += "random weights)"
        raise BadInput(f"unknown model: {exc}{hint}") from None
    if not any(folder.glob("*.safetensors")):
        raise BadInput(
            f"model {name!r}: {folder} has no *.safetensors weights (zerotune loads only "
            "safetensors; add --init random to start from random weights)"
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"model {name!r}: cannot read {folder}/config.json: {exc}") from None
    _check_causal_lm(name, config)
    return name, init, folder, config


def _check_causal_lm(name: str, config) -> None:
    """finetune trains a causal language model: the config must have transformers' class
    for one (a T5 or BERT config has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = getattr(config, "model_type", None) or type(config).__name__
        raise BadInput(
            f"model {name!r}: transformers has no causal language model class for {kind!r} "
            "models (AutoModelForCausalLM), which finetune trains"
        )


def _looks_like_a_path(name: str) -> bool:
    """A name meant as a local path (not a hub id ``org/name``): absolute, relative to
    ``.`` / ``..`` / ``~``, or ending in .json."""
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".json")


def _resolve_tokenizer(options: dict, source, config):
    from transformers import AutoTokenizer

    from zerotune.hf.data import byte_tokenizer

    given = options["tokenizer"]
    if given is not None and _looks_like_a_path(given) and not Path(given).exists():
        raise BadInput(f"--tokenizer {given}: no such folder")
    folder = source if isinstance(source, Path) else None
    if folder is None and options["model"] and Path(options["model"]).is_dir():
        folder = Path(options["model"])  # --init random from a folder: its tokenizer
    if given is None and folder is not None and _has_tokenizer(folder):
        given = str(folder)
    if given is not None:
        try:
            tok = AutoTokenizer.from_pretrained(given)
        except Exception as exc:  # noqa: BLE001
            raise BadInput(f"cannot load tokenizer {given!r}: {exc}") from None
        kind = f"tokenizer of {given}"
    else:
        tok = byte_tokenizer()
        kind = "byte-level tokenizer (no tokenizer given)"
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise BadInput(
            f"the {kind} has {len(tok)} tokens but the model's vocabulary is {vocab}; give a "
            "matching --tokenizer"
        )
    if tok.eos_token_id is None:
        raise BadInput(f"the {kind} has no end-of-sequence token")
    return tok, kind


def _has_tokenizer(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any((folder / n).is_file() for n in names)


def _context_length(config, default: int | None = 1024) -> int | None:
    """The model's context length from its config, or ``default`` when it names none."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _prepare(options: dict, world: int = 1) -> Job:
    """Steps 1-2 of [Note: finetune flow], cheapest checks first, without touching the output
    folder."""
    from zerotune.hf.data import DataError, choose_columns, load_raw_dataset

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
        raise BadInput(f"--output-dir {out} exists and is not a folder")
    if options["resume"] and not out.is_dir():
        raise BadInput(f"--resume: {out} does not exist (nothing to resume)")
    zero = _zero_settings(options)
    dataset = options["dataset"] or _default_dataset()
    with _fail_on(DataError):
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
        temp_nvme = os.environ.get(_TEMP_NVME_ENV)  # made by the launcher
        if temp_nvme is None:
            temp_nvme = tempfile.mkdtemp(prefix="zerotune-nvme-")
        nvme_path = temp_nvme
    try:
        name, init, source, config = _resolve_model(options)
        args = _parse_training_args(options, zero, nvme_path)
        if options["resume"] or args.resume_from_checkpoint:
            _check_resume(options, args)
        if options["resume"]:
            _check_recorded_dtype(options, args)
        _check_output_dir(Path(args.output_dir), options, args, source)
        tokenizer, tok_kind = _resolve_tokenizer(options, source, config)
        if options["chat_template"] is not None:
            template = Path(options["chat_template"])
            if not template.is_file():
                raise BadInput(f"--chat-template {template}: no such file")
            tokenizer.chat_template = template.read_text()
        if init == "random":  # the model's special tokens are the tokenizer's
            for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if getattr(tokenizer, key, None) is not None:
                    setattr(config, key, getattr(tokenizer, key))
        context = _context_length(config)
        if options["block_size"] is not None and options["block_size"] < 1:
            raise BadInput(f"--block-size must be at least 1, got {options['block_size']}")
        block = options["block_size"] or min(context, 1024)
        if block > context:
            raise BadInput(f"--block-size {block} exceeds the model's context length {context}")
        if not options["no_memory_check"] and _ERRORS_ENV not in os.environ:
            _check_memory(config, args, block, world)  # a launcher's ranks: checked there
    except BaseException:
        if temp_nvme is not None and _TEMP_NVME_ENV not in os.environ:
            shutil.rmtree(temp_nvme, ignore_errors=True)
        raise
    return Job(
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
        temp_nvme=temp_nvme,
    )


def _tokenize(job: Job) -> None:
    """Tokenize and pack the dataset into ``job.train`` / ``job.eval`` (rank 0 first, the
    others then read the datasets cache)."""
    from zerotune.hf.data import DataError, prepare_datasets

    with job.args.main_process_first(desc="dataset preparation"), _fail_on(DataError):
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
        )


_TEMP_NVME_ENV = "ZEROTUNE_FINETUNE_TEMP_NVME"
_ERRORS_ENV = "ZEROTUNE_FINETUNE_ERRORS"  # where ranks leave their bad-input message


# ------------------------------------------------------------------------------ launch
def _launch(nproc: int, options: dict) -> None:
    """Check the job here, then run this command on ``nproc`` processes with torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    job = _prepare(options, world=nproc)  # bad input stops here, before any process starts
    from zerotune.checkpoint import CheckpointError
    from zerotune.checkpoint.lock import FolderLock

    try:
        with _fail_on(CheckpointError):
            FolderLock.check_free(job.args.output_dir)  # another run's ranks hold it
        _tokenize(job)
    except BaseException:
        if job.temp_nvme is not None:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)
        raise
    _build_ops_once()  # here, once, rather than in every rank at the same moment
    saved_env = {k: os.environ.get(k) for k in (_TEMP_NVME_ENV, _ERRORS_ENV, "OMP_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = str(_threads_per_process(nproc))  # torchrun keeps it
    if job.temp_nvme is not None:
        os.environ[_TEMP_NVME_ENV] = job.temp_nvme
    errors = tempfile.mkdtemp(prefix="zerotune-errors-")
    os.environ[_ERRORS_ENV] = errors
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--no-python",
        sys.executable,
        "-c",
        "from zerotune.cli import main; main()",
        "finetune",
        *_child_argv(options),
    ]
    click.echo(f"zerotune finetune: launching {nproc} processes (torch.distributed.run)", err=True)
    # torchrun logs a failed rank as an error line of its own; for bad input (exit code 2)
    # the rank's one-line message below says everything.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _DropBadInputExit()
    agent_log.addFilter(quiet)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun(argv)
    except SignalException as exc:  # Ctrl-C or a kill of this process: the ranks are stopped
        click.echo(_stopped_line(exc.sigval.name, job.args.output_dir), err=True)
        sys.exit(128 + int(exc.sigval))
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        code = BAD_INPUT if BAD_INPUT in codes else next((c for c in codes if c), 1)
        messages = sorted({p.read_text() for p in Path(errors).glob("rank*.txt")})
        for message in messages:  # bad input: the same line from every rank, shown once
            click.echo(f"zerotune finetune: error: {message}", err=True)
        sys.exit(code)
    finally:
        agent_log.removeFilter(quiet)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(errors, ignore_errors=True)
        if job.temp_nvme is not None:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)


class _DropBadInputExit(logging.Filter):
    """Hides torchrun's lines about a rank that exited with the bad-input code and about
    stopping the other ranks after it (a crash still shows the rank's own traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return f"exitcode: {BAD_INPUT})" not in text and "closing signal" not in text


def _child_argv(options: dict) -> list[str]:
    argv: list[str] = []
    for key, value in options.items():
        if key == "hf_args" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "zero_config":
            flag = "--config"
        if key == "eval_split" and not value:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv + list(options["hf_args"])


# --------------------------------------------------------------------------------- run
def _exit_on_sigterm(signum, frame) -> None:
    # torchrun stops the other ranks with SIGTERM when one fails or is interrupted: leave
    # through the finally blocks (a temporary NVMe folder is removed) instead of dying.
    sys.exit(128 + signum)


def _die_with_launcher() -> None:
    """A rank started by ``_launch`` ends when its launcher does, however the launcher ends
    (kill -9 included): a thread watches the parent; once it is gone the rank gets SIGTERM
    (leaving through its finally blocks), and exits outright 30 s later if still alive."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="zerotune-launcher-watch", daemon=True).start()


def _run(options: dict) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if _ERRORS_ENV in os.environ:  # a rank of _launch
        _die_with_launcher()
    job = _prepare(options)  # first: it fails fast on bad input, before the slow imports
    if _ERRORS_ENV not in os.environ:  # one process (a rank's launcher did these)
        _threads_per_process(1)
        _build_ops_once()
    from zerotune.checkpoint import CheckpointError
    from zerotune.checkpoint.lock import FolderLock
    from zerotune.config import ConfigError
    from zerotune.hf import ZeroTrainer, build_engine
    from zerotune.init.pretrained import ModelLoadError

    lock = None
    try:
        args = job.args
        writer = os.environ.get("RANK", "0") == "0"  # the rank that writes the output folder
        if writer:  # early and cheap; held below, once the input is known good
            with _fail_on(CheckpointError):
                FolderLock.check_free(args.output_dir)
        with _fail_on(ConfigError, ModelLoadError):
            engine = build_engine(job.model_source, args)  # NVMe space is checked here
        if args.zero.nvme_path and engine.rank == 0 and job.temp_nvme is None:
            click.echo(f"zerotune finetune: swap files in {_describe_folder(args.zero.nvme_path)}")
        _tokenize(job)  # the data's own checks (too few blocks, bad text) come here
        if writer:
            lock = FolderLock(args.output_dir)
            with _fail_on(CheckpointError):
                lock.acquire()
        if options["overwrite"]:  # the input is good: the earlier run's files go now
            from zerotune import dist as zdist

            if engine.rank == 0:
                _clear_output_dir(Path(args.output_dir))
            zdist.barrier(engine.group)
        from transformers import default_data_collator

        with _fail_on(ValueError):
            trainer = ZeroTrainer(
                model=engine,
                args=args,
                train_dataset=job.train,
                eval_dataset=job.eval,
                processing_class=job.tokenizer,
                data_collator=default_data_collator,
            )
        from transformers import TrainerCallback

        class StartStep(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                job.start_step = state.global_step  # after a resume: the checkpoint's step

        trainer.add_callback(StartStep())
        if engine.rank == 0:  # what --resume continues (written once the input is good)
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            _write_job_record(out, _job_record(options, args))
        resume = args.resume_from_checkpoint or (True if options["resume"] else None)

        with _fail_on(CheckpointError):  # a checkpoint that turns out damaged on loading
            result = trainer.train(resume_from_checkpoint=resume)
        eval_metrics = None
        if job.eval is not None:
            eval_metrics = trainer.evaluate()
        trainer.save_model()
        memory = trainer.memory_summary()
        if trainer.is_world_process_zero():
            _finish(job, trainer, result, eval_metrics, memory, _since_start())
        trainer.close()
    finally:
        if lock is not None:
            lock.release()
        if job.temp_nvme is not None and _TEMP_NVME_ENV not in os.environ:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)
        from zerotune.dist import shutdown

        shutdown()  # see its docstring: a live gloo group can abort the exit of a rank


def _since_start() -> float:
    """Seconds since this process started (imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def _finish(job: Job, trainer, result, eval_metrics, memory, elapsed: float) -> None:
    from zerotune.hf.trainer import describe_config

    args = trainer.args
    out = Path(args.output_dir)
    history = trainer.state.log_history
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    steps_run = result.global_step - job.start_step
    world = trainer.engine.world
    tokens = None  # counted by the Trainer unless --include_num_input_tokens_seen no
    if args.include_num_input_tokens_seen != "no":
        start = getattr(trainer, "_initial_num_input_tokens_seen", 0)
        tokens = int(trainer.state.num_input_tokens_seen - start)
    runtime = result.metrics.get("train_runtime") or elapsed
    png = _plot_losses(out / "loss_curve.png", losses, evals, job.model_name)
    summary = {
        "model": job.model_name,
        "init": job.init,
        "parameters": trainer.num_parameters,
        "zero": trainer.engine.config.to_dict(),
        "world_size": world,
        "dataset": job.dataset,
        "columns": job.columns.describe(),
        "tokenizer": job.tokenizer_kind,
        "block_size": job.block_size,
        "train_blocks": len(job.train),
        "eval_blocks": len(job.eval) if job.eval is not None else 0,
        "global_step": result.global_step,
        "steps_this_run": steps_run,
        "tokens_this_run": tokens,
        "train_runtime_s": runtime,
        "tokens_per_s": tokens / runtime if runtime and tokens is not None else None,
        "losses": losses,
        "eval_loss": eval_metrics.get("eval_loss") if eval_metrics else None,
        "memory_rank0": memory,
        "output_dir": str(out),
        "loss_curve": str(png) if png else None,
        "elapsed_s": elapsed,
    }
    (out / "run_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    def mib(n):
        return "none" if n is None else f"{n / 2**20:,.1f} MiB"

    if losses:
        loss_line = f"  loss     {losses[0][1]:.4f} (step {losses[0][0]}) -> {losses[-1][1]:.4f}"
    else:
        loss_line = f"  loss     mean {result.training_loss:.4f} (fewer steps than --logging_steps)"
    if summary["eval_loss"] is not None:
        loss_line += f"; eval {summary['eval_loss']:.4f}"
    lines = [
        f"zerotune finetune: done in {elapsed:.1f} s",
        f"  model    {job.model_name} ({job.init} init, {trainer.num_parameters / 1e6:.2f}M "
        f"parameters); {describe_config(trainer.engine.config)}; world size {world}",
        f"  data     {job.dataset}: {len(job.train)} blocks of {job.block_size} tokens "
        + (f"(+{len(job.eval)} held out) " if job.eval is not None else "")
        + f"({job.columns.describe()}; {job.tokenizer_kind})",
        f"  steps    {steps_run} this run (global step {result.global_step}), "
        + (
            f"{tokens:,} tokens, {summary['tokens_per_s'] or 0:,.0f} tokens/s"
            if tokens is not None
            else "tokens not counted (--include_num_input_tokens_seen no)"
        ),
        loss_line,
        f"  memory   per rank, peak: accelerator {mib(memory['accelerator_peak'])}, host "
        f"{mib(memory['host_peak'])} (RSS), nvme {mib(memory['nvme'] or None)} (swap files)",
        f"  output   {out}/ (config.json, safetensors, tokenizer); loss curve "
        f"{png if png else '(not drawn)'}; run_summary.json",
    ]
    click.echo("\n".join(lines))


def _plot_losses(path: Path, losses, evals, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo(
            "zerotune finetune: matplotlib is missing, so no loss curve is drawn "
            "(pip install zerotune[plot])",
            err=True,
        )
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if losses:
        ax.plot(*zip(*losses), marker=".", label="training loss")
    if evals:
        ax.plot(*zip(*evals), marker="o", linestyle="--", label="evaluation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"zerotune finetune: {title}")
    ax.grid(True, alpha=0.3)
    if losses or evals:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss logged (fewer steps than --logging_steps)",
                ha="center", va="center", transform=ax.transAxes)  # fmt: skip
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
