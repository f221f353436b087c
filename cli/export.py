"""``zerotune export``: a sharded checkpoint to a Hugging Face folder, streamed."""

from __future__ import annotations

import sys
from pathlib import Path

import click

_USAGE_ERROR = 2  # bad input: a missing or broken checkpoint, an output in the way, bad options
_IO_ERROR = 1  # the machine failed us: disk full, permissions


def _fail(message: str, code: int) -> None:
    click.echo(f"zerotune export: error: {message}", err=True)
    sys.exit(code)


@click.command()
@click.argument("checkpoint_dir", type=click.Path(path_type=Path))
@click.argument("output_dir", type=click.Path(path_type=Path))
@click.option(
    "--dtype", default=None, help="bf16, fp16 or fp32 (default: the dtype it was trained in)."
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Split the weights into several files above this size (bytes, 5GB, 500MiB).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT_DIR if it exists and is not empty.")
@click.option(
    "--no-verify", is_flag=True, help="Skip checking the checkpoint's sha256 checksums first."
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def export(
    checkpoint_dir: Path,
    output_dir: Path,
    dtype: str,
    max_shard_size: str,
    overwrite: bool,
    no_verify: bool,
    quiet: bool,
) -> None:
    """Write the model of CHECKPOINT_DIR as a Hugging Face folder in OUTPUT_DIR.

    CHECKPOINT_DIR is a checkpoint folder, the folder holding checkpoints (the one its
    'latest' file names is exported), or a run's output folder (its newest complete
    checkpoint-N). Memory stays bounded by one piece of one tensor, whatever the
    model size; the output appears only once it is complete.

    \b
    Examples:
      zerotune export runs/ckpt out/model                 # newest checkpoint, its dtype
      zerotune export out out/model                       # a finetune run's newest checkpoint
      zerotune export runs/ckpt/step-00001000 out/model --dtype fp32 --max-shard-size 2GB
    """
    from zerotune.checkpoint import CheckpointError, ExportError, export_hf
    from zerotune.checkpoint.export import check_output, export_dtype

    try:
        if dtype is not None:
            export_dtype(dtype)
        if not checkpoint_dir.exists():
            raise CheckpointError(f"{checkpoint_dir}: no such checkpoint folder")
        check_output(output_dir, overwrite)
    except (CheckpointError, ExportError) as exc:
        _fail(str(exc), _USAGE_ERROR)

    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=None)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done)

    try:
        out = export_hf(
            checkpoint_dir,
            output_dir,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            verify=not no_verify,
            progress=progress if bar is not None else None,
        )
    except (CheckpointError, ExportError) as exc:
        _fail(str(exc), _USAGE_ERROR)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}; nothing was written to {output_dir}", _IO_ERROR)
    except KeyboardInterrupt:
        _fail(f"interrupted; nothing was written to {output_dir}", 130)
    finally:
        if bar is not None:
            bar.close()
    files = sorted(p.name for p in out.iterdir())
    weights = [f for f in files if f.endswith(".safetensors")]
    size = sum((out / f).stat().st_size for f in weights)
    if dtype is None and weights:  # the training dtype: say which
        import torch

        from zerotune.init.pretrained import read_safetensors_header

        kinds = {e.dtype for e in read_safetensors_header(out / weights[0]).values()}
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        dtype = "/".join(sorted(names.get(k, str(k)) for k in kinds))
    click.echo(
        f"exported to {out}: {len(weights)} weight file(s), {size / 2**20:.1f} MiB, "
        f"{dtype}; {len(files)} files in all"
    )
