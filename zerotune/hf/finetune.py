"""Full fine-tuning of a causal LM from one set of options: what ``zerotune finetune`` runs,
importable from Python (``prepare_job`` then ``run_job``).

[Note: finetune flow]
1. Parse (``cli/finetune.py``): click takes the zerotune options; every other ``--flag``
   goes to ``HfArgumentParser(ZeroTrainingArguments)``, so any TrainingArguments flag
   works. A job file (``apply_job_file``) and, with --resume, the run's record
   (``adopt_recorded_job``) fill the options not given.
2. Check everything that can be wrong before writing anything (``prepare_job``): the
   zerotune config (preset YAML merged with --stage / --offload / --nvme-path), the dataset
   and its columns, the model, the arguments, the tokenizer, the memory plan; then, in
   ``run_job``, the engine itself (NVMe space is checked when its swap files are made,
   before any weight is loaded), then tokenization and packing. Bad input ends here with a
   JobError (one line and exit code 2 from the command), and the output folder has not been
   created.
3. ``--nproc-per-node N`` (outside torchrun) re-runs the command in N processes through
   ``zerotune.launch`` once step 2 passed in the parent (all but the engine, which only
   the ranks build: ``check_before_launch``); the launcher owns the processes.
4. Train with ZeroTrainer, write the consolidated HF folder into --output-dir, then (rank 0)
   the loss curve PNG, ``run_summary.json`` and the summary (``RunReport.format``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .job import as_job_error
from .prepare import Job, tokenize

__all__ = [
    "RunReport",
    "check_before_launch",
    "describe_folder",
    "plot_losses",
    "run_job",
    "since_start",
]

log = logging.getLogger(__name__)


def _log(message: str, err: bool = False) -> None:
    (log.warning if err else log.info)(message)


Echo = Callable[..., None]  # echo(message, err=False): how a run reports what it does


def check_before_launch(job: Job) -> None:
    """The launcher's share of step 2 of [Note: finetune flow] (its ranks build the
    engine): no other run holds the output folder, and the data makes blocks (tokenized
    once here, then read from the datasets cache by the ranks). Raises JobError; the job's
    temporary NVMe folder is removed then."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.lock import FolderLock

    try:
        with as_job_error(CheckpointError):
            FolderLock.check_free(job.args.output_dir)  # another run's ranks hold it
        tokenize(job)
    except BaseException:
        if job.temp_nvme is not None:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)
        raise


class _BuildBar:
    """A progress bar over the units the engine builds, made at the first one placed (a run
    refused before, e.g. for NVMe space, prints nothing else)."""

    def __init__(self, show: bool):
        self.show, self.bar = show, None

    def __call__(self, done: int, total: int) -> None:
        if not self.show:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="building the model", unit="unit")
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(job: Job, echo: Echo = _log) -> RunReport | None:
    """Steps 2 (the engine, the data) and 4 of [Note: finetune flow] in this process (one
    rank): train ``job``, save the model into its output folder and, on rank 0, write the
    summary and loss curve and return the report (None on other ranks). ``echo(message,
    err=False)`` reports progress (default: this module's logger). Raises JobError for bad
    input found on the way."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.lock import FolderLock
    from ..config import ConfigError
    from ..init.pretrained import ModelLoadError
    from ..launch import shared_temp_nvme
    from ..sharding.hooks import report_units
    from . import ZeroTrainer, build_engine
    from .record import clear_output_dir, job_record, write_job_record

    options = job.options
    lock = None
    report = None
    try:
        args = job.args
        writer = os.environ.get("RANK", "0") == "0"  # the rank that writes the output folder
        if writer:  # early and cheap; held below, once the input is known good
            with as_job_error(CheckpointError):
                FolderLock.check_free(args.output_dir)
        bar = _BuildBar(show=writer)
        try:
            with as_job_error(ConfigError, ModelLoadError), report_units(bar):
                engine = build_engine(job.model_source, args)  # NVMe space is checked here
        finally:
            bar.close()
        if args.zero.nvme_path and engine.rank == 0 and job.temp_nvme is None:
            echo(f"swap files in {describe_folder(args.zero.nvme_path)}")
        tokenize(job)  # the data's own checks (too few blocks, bad text) come here
        if writer:
            lock = FolderLock(args.output_dir)
            with as_job_error(CheckpointError):
                lock.acquire()
        if options["overwrite"]:  # the input is good: the earlier run's files go now
            from .. import dist as zdist

            if engine.rank == 0:
                clear_output_dir(Path(args.output_dir))
            zdist.barrier(engine.group)
        from transformers import default_data_collator

        from .data import packed_collator

        with as_job_error(ValueError):
            trainer = ZeroTrainer(
                model=engine,
                args=args,
                train_dataset=job.train,
                eval_dataset=job.eval,
                processing_class=job.tokenizer,
                data_collator=packed_collator if job.packing else default_data_collator,
            )
        from transformers import TrainerCallback

        class StartStep(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                job.start_step = state.global_step  # after a resume: the checkpoint's step
                if engine.rank == 0:  # what --resume continues, once the input is good
                    out = Path(args.output_dir)
                    out.mkdir(parents=True, exist_ok=True)
                    write_job_record(out, job_record(options, args))

        trainer.add_callback(StartStep())
        resume = args.resume_from_checkpoint or (True if options["resume"] else None)

        # A checkpoint that turns out damaged on loading; a schedule that does not fit the
        # run's length (known only now).
        with as_job_error(CheckpointError, ConfigError):
            result = trainer.train(resume_from_checkpoint=resume)
        eval_metrics = None
        if job.eval is not None:
            eval_metrics = trainer.evaluate()
        trainer.save_model()
        memory = trainer.memory_summary()
        if trainer.is_world_process_zero():
            report = _finish(job, trainer, result, eval_metrics, memory, since_start(), echo)
            echo(report.format())
        trainer.close()
    finally:
        if lock is not None:
            lock.release()
        if job.temp_nvme is not None and shared_temp_nvme() is None:
            shutil.rmtree(job.temp_nvme, ignore_errors=True)
        from ..dist import shutdown

        shutdown()  # see its docstring: a live gloo group can abort the exit of a rank
    return report


def since_start() -> float:
    """Seconds since this process started (imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def describe_folder(path: str | os.PathLike) -> str:
    """``path (filesystem, free space)``: the filesystem of the longest mount point above it."""
    import psutil

    from .record import is_inside

    real = Path(path).resolve()
    mounts = [m for m in psutil.disk_partitions(all=True) if is_inside(real, Path(m.mountpoint))]
    fstype = max(mounts, key=lambda m: len(m.mountpoint)).fstype if mounts else "unknown"
    free = shutil.disk_usage(real).free
    return f"{path} ({fstype}, {free / 2**30:,.1f} GiB free)"


@dataclass
class RunReport:
    """What a finished run reports: ``summary`` (as written to ``run_summary.json``), the
    zerotune configuration in words, the Trainer's mean training loss, and whether data was
    held out for evaluation."""

    summary: dict[str, Any]
    zero_description: str
    training_loss: float
    held_out: bool

    def format(self) -> str:
        """The summary for a terminal, several lines."""
        s = self.summary
        memory = s["memory_rank0"]

        def mib(n):
            return "none" if n is None else f"{n / 2**20:,.1f} MiB"

        losses = s["losses"]
        if losses:
            (first_step, first), (_, last) = losses[0], losses[-1]
            loss_line = f"  loss     {first:.4f} (step {first_step}) -> {last:.4f}"
        else:
            loss_line = (
                f"  loss     mean {self.training_loss:.4f} (fewer steps than --logging_steps)"
            )
        if s["eval_loss"] is not None:
            loss_line += f"; eval {s['eval_loss']:.4f}"
        tokens = s["tokens_this_run"]
        lines = [
            f"done in {s['elapsed_s']:.1f} s",
            f"  model    {s['model']} ({s['init']} init, {s['parameters'] / 1e6:.2f}M "
            f"parameters); {self.zero_description}; world size {s['world_size']}",
            f"  data     {s['dataset']}: {s['train_blocks']} blocks of {s['block_size']} tokens "
            + ("packed " if s["packing"] else "")
            + (f"(+{s['eval_blocks']} held out) " if self.held_out else "")
            + f"({s['columns']}; {s['tokenizer']})",
            f"  steps    {s['steps_this_run']} this run (global step {s['global_step']}), "
            + (
                f"{tokens:,} tokens, {s['tokens_per_s'] or 0:,.0f} tokens/s"
                if tokens is not None
                else "tokens not counted (--include_num_input_tokens_seen no)"
            ),
            loss_line,
            f"  memory   per rank, peak: accelerator {mib(memory['accelerator_peak'])}, host "
            f"{mib(memory['host_peak'])} (RSS), nvme {mib(memory['nvme'] or None)} (swap files)",
            f"  output   {s['output_dir']}/ (config.json, safetensors, tokenizer); loss curve "
            f"{s['loss_curve'] or '(not drawn)'}; run_summary.json",
        ]
        return "\n".join(lines)


def _finish(job: Job, trainer, result, eval_metrics, memory, elapsed: float, echo) -> RunReport:
    """Rank 0 after training: the loss curve and ``run_summary.json`` in the output folder."""
    from .configs import describe_config

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
    png = plot_losses(out / "loss_curve.png", losses, evals, job.model_name, echo)
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
        "packing": job.packing,  # several conversations (or pairs) a block
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
    return RunReport(
        summary=summary,
        zero_description=describe_config(trainer.engine.config),
        training_loss=result.training_loss,
        held_out=job.eval is not None,
    )


def plot_losses(path: Path, losses, evals, title: str, echo: Echo = _log) -> Path | None:
    """Draw the training (and evaluation) losses, ``(step, loss)`` pairs, into the PNG file
    ``path`` (written whole or not at all); None, said through ``echo``, without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo(
            "matplotlib is missing, so no loss curve is drawn (pip install zerotune[plot])",
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
