"""``zerotune finetune``: full fine-tuning of a causal LM with ZeroTrainer, from one command.

This module parses the options, prints, and turns a refused job (a JobError) into one line
on stderr and exit code 2. What a job is, how it is checked, resumed and run lives in
``zerotune.hf`` (``prepare.py``, ``record.py``, ``finetune.py``: see [Note: finetune flow]
there), and the launcher of ``--nproc-per-node`` in ``zerotune/launch.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
from pathlib import Path

import click
from click.core import ParameterSource

from zerotune.hf.finetune import check_before_launch, run_job
from zerotune.hf.job import JobError, apply_job_file
from zerotune.hf.prepare import DEFAULT_MODEL, prepare_job
from zerotune.hf.record import adopt_recorded_job
from zerotune.launch import (
    BAD_INPUT_EXIT,
    LaunchStopped,
    RanksFailed,
    child_argv,
    die_with_launcher,
    exit_on_sigterm,
    launch,
    launched_rank,
    report_error,
    threads_per_process,
    under_launcher,
)

from .messages import one_line


class BadInput(click.ClickException):
    """Bad input: one line on stderr, exit code 2. A message quoting a library's error keeps
    its first line (transformers' go on with advice over several)."""

    exit_code = BAD_INPUT_EXIT

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))

    def show(self, file=None) -> None:
        if report_error(self.message):
            return  # a rank under --nproc-per-node: the launcher prints each distinct one once
        click.echo(f"zerotune finetune: error: {self.message}", err=True)


@contextlib.contextmanager
def _bad_input():
    """A job refused by zerotune (a JobError) as BadInput: its one line, exit code 2."""
    try:
        yield
    except JobError as exc:
        raise BadInput(str(exc)) from None


def _say(message: str, err: bool = False) -> None:
    """What a run reports, as this command's lines."""
    click.echo(f"zerotune finetune: {message}", err=err)


class _Command(click.Command):
    """Usage errors (a bad choice, a missing --output-dir) as one line and exit code 2. Each
    of this command's flags also takes the TrainingArguments spelling (``--output_dir`` for
    ``--output-dir``), and is given once; so is each TrainingArguments flag."""

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
            if dashed in seen and dashed not in ("--help", "--"):
                # argparse would keep the last of a TrainingArguments flag given twice
                raise BadInput(
                    f"{dashed} is given more than once ({seen[dashed]}, then {flag}); give it once"
                )
            if dashed.startswith("--"):
                seen[dashed] = flag
            if dashed in own:
                arg = dashed + eq + value
            out.append(arg)
        return out


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
    "--packing",
    is_flag=True,
    help="Chat data or prompt/response pairs: pack several into each block, each seeing "
    "only itself (instead of a padded block per conversation, or pairs run together).",
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
    with _bad_input():
        if options["job"] is not None:
            apply_job_file(options, given)
        if options["output_dir"] is None:
            raise BadInput("give the output folder: --output-dir (or training.output_dir in --job)")
        if options["resume"]:
            adopt_recorded_job(options, given)
    if nproc is not None and nproc < 1:
        raise BadInput(f"--nproc-per-node must be at least 1, got {nproc}")
    if nproc is not None and nproc > 1 and not under_launcher():
        _launch(nproc, options)
        return
    if under_launcher():
        _run_rank(options)
    try:
        _run(options)
    except KeyboardInterrupt:
        # Ctrl-C: the checkpoints written so far are complete (a partial one is not marked
        # so).
        click.echo(_stopped_line("SIGINT", options["output_dir"]), err=True)
        sys.exit(128 + signal.SIGINT)
    except SystemExit as exc:  # SIGTERM (exit_on_sigterm): said as a launcher says it
        if exc.code == 128 + signal.SIGTERM:
            click.echo(_stopped_line("SIGTERM", options["output_dir"]), err=True)
        raise


def _own_flags() -> set[str]:
    """This command's own flag names, underscored (for "did you mean" on an unknown one)."""
    return {o.lstrip("-").replace("-", "_") for p in finetune.params for o in p.opts}


def _print_trainer_help(ctx) -> None:
    from transformers import HfArgumentParser

    from zerotune.hf.args import ZeroTrainingArguments

    parser = HfArgumentParser(ZeroTrainingArguments, prog="zerotune finetune", add_help=False)
    click.echo(parser.format_help())
    ctx.exit(0)


def _threads_per_process(nproc: int) -> int:
    """Threads for each of ``nproc`` processes (``zerotune.launch.threads_per_process``),
    said once; set here for one process."""
    threads, why = threads_per_process(nproc)
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


def _stopped_line(signal_name: str, output_dir) -> str:
    """What an interrupted run says: how to go on, if any checkpoint is complete."""
    from zerotune.hf.checkpoints import TRAINER_MARKER

    if not list(Path(output_dir).glob(f"checkpoint-*/{TRAINER_MARKER}")):
        return f"zerotune finetune: stopped by {signal_name} before the first checkpoint"
    return (
        f"zerotune finetune: stopped by {signal_name}; the complete checkpoints in "
        f"{output_dir} resume with --resume"
    )


def _launch(nproc: int, options: dict) -> None:
    """Check the job here, then run this command on ``nproc`` processes with torchrun (see
    [Note: launching ranks] in zerotune/launch.py)."""
    with _bad_input():  # bad input stops here, before any process starts
        job = prepare_job(options, world=nproc, known_flags=_own_flags())
        check_before_launch(job)
    _build_ops_once()  # here, once, rather than in every rank at the same moment
    threads = _threads_per_process(nproc)
    click.echo(f"zerotune finetune: launching {nproc} processes (torch.distributed.run)", err=True)
    try:
        launch(nproc, ["finetune", *child_argv(options)], threads=threads, temp_nvme=job.temp_nvme)
    except LaunchStopped as exc:  # Ctrl-C or a kill of this process: the ranks are stopped
        click.echo(_stopped_line(exc.signal_name, job.args.output_dir), err=True)
        sys.exit(128 + exc.signum)
    except RanksFailed as exc:
        for message in exc.messages:  # bad input: the same line from every rank, shown once
            click.echo(f"zerotune finetune: error: {message}", err=True)
        if not exc.messages and exc.exit_code > 128:  # a rank killed by a signal
            name = signal.Signals(exc.exit_code - 128).name
            click.echo(_stopped_line(f"{name} of a rank", job.args.output_dir), err=True)
        sys.exit(exc.exit_code)
    finally:
        if job.temp_nvme is not None:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)


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
    except SystemExit as exc:  # SIGTERM (exit_on_sigterm), or a sys.exit below
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        leave(code)
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)


def _run(options: dict) -> None:
    """The job in this process: one process, or one rank of several."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    if launched_rank():
        die_with_launcher()
    with _bad_input():  # first: it fails fast on bad input, before the slow imports
        job = prepare_job(options, known_flags=_own_flags())
    if not launched_rank():  # one process (a rank's launcher did these)
        _threads_per_process(1)
        _build_ops_once()
    with _bad_input():
        run_job(job, echo=_say)
