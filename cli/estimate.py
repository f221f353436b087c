"""``zerotune estimate``: bytes per GPU, host and NVMe for each stage and offload, before launch."""

from __future__ import annotations

import json
import shutil
import sys

import click

from .messages import one_line

_USAGE_ERROR = 2


def _fail(message: str) -> None:
    # 400 characters: transformers' unknown-model error lists every model type it knows
    click.echo(f"zerotune estimate: error: {one_line(message, limit=400)}", err=True)
    sys.exit(_USAGE_ERROR)


class _OneLineErrors(click.Command):
    """Bad options give one line and exit code 2 (click would print the usage too)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.Exit:
            raise
        except click.UsageError as exc:
            _fail(exc.format_message().replace("\n", " "))


@click.command(cls=_OneLineErrors)
@click.option("--model", help="Preset name (gpt2-xl), config.json path, model folder or hub id.")
@click.option("--params", help="A bare parameter count instead of a model (7.5e9).")
@click.option("--world-size", type=int, default=1, show_default=True, help="Data-parallel ranks.")
@click.option("--gpus-per-node", type=int, help="Ranks per host [default: min(world size, 8)].")
@click.option(
    "--device",
    type=click.Choice(["gpu", "cpu"]),
    default="gpu",
    show_default=True,
    help="Where the run computes: cpu plans a run without an accelerator, which holds "
    "everything but NVMe files (activations, gathered parameters, buffers) in host memory.",
)
@click.option("--gpu-memory", default="80GB", show_default=True, help="Per GPU; 'none' skips it.")
@click.option("--host-memory", help="Host RAM per node (512GB); not checked if left out.")
@click.option("--nvme-space", help="Free NVMe space per node (2TB) [default: free on --nvme-path].")
@click.option("--nvme-path", help="Folder for swap files (used in the printed flags).")
@click.option("--seq-len", type=int, help="Tokens per sequence [default: model's, at most 2048].")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Sequences per rank.")
@click.option("--activation-checkpointing", is_flag=True, help="Plan with checkpointing.")
@click.option(
    "--dtype",
    help="Compute dtype: bf16, fp16, fp32 [default: bf16 on a GPU, fp32 on a CPU, as finetune].",
)
@click.option("--grad-dtype", default="fp32", show_default=True, help="Gradient shard dtype.")
@click.option(
    "--optim-state-bits",
    type=click.Choice(["32", "8"]),
    default="32",
    show_default=True,
    help="Adam moments in fp32 or 8-bit (finetune's --optim adamw_8bit).",
)
@click.option(
    "--headroom",
    type=float,
    default=0.1,
    show_default=True,
    help="Share of each tier kept free for what is not counted (CUDA context, fragmentation).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(
    model,
    params,
    world_size,
    gpus_per_node,
    device,
    gpu_memory,
    host_memory,
    nvme_space,
    nvme_path,
    seq_len,
    micro_batch,
    activation_checkpointing,
    dtype,
    grad_dtype,
    optim_state_bits,
    headroom,
    as_json,
) -> None:
    """Memory per GPU, per host and on NVMe for every ZeRO stage and offload tier, what fits
    the machine, and the weakest stage and offload that fit (with its finetune flags).

    \b
    Examples:
      zerotune estimate --model gpt2-xl --world-size 8 --host-memory 512GB
      zerotune estimate --params 7.5e9 --world-size 64 --json
      zerotune estimate --model ./my-model --gpu-memory 24GB --nvme-path /mnt/nvme --seq-len 2048
      zerotune estimate --model gpt2 --device cpu --host-memory 24GB --micro-batch 4
    """
    from zerotune.config import ConfigError, parse_bytes
    from zerotune.estimate import estimate as make_plan

    if (model is None) == (params is None):
        _fail("give --model or --params (one of them)")
    given = click.get_current_context().get_parameter_source
    if device == "cpu" and given("gpu_memory") != click.core.ParameterSource.DEFAULT:
        _fail("--gpu-memory is for --device gpu; a CPU run holds everything in host memory")
    count = None
    if params is not None:
        try:
            count = float(params)
        except ValueError:
            _fail(f"--params: cannot read {params!r} as a number; write e.g. 7.5e9")
    sizes = {}
    for option, value in (
        ("--gpu-memory", gpu_memory),
        ("--host-memory", host_memory),
        ("--nvme-space", nvme_space),
    ):
        if value is None or value.strip().lower() == "none":
            sizes[option] = None
            continue
        try:
            sizes[option] = parse_bytes(value, name=option)
        except ConfigError as exc:
            _fail(str(exc))
    gpu_memory, host_memory, nvme_space = sizes.values()
    if nvme_space is None and nvme_path is not None:
        try:
            nvme_space = shutil.disk_usage(nvme_path).free
        except OSError as exc:
            _fail(f"--nvme-path {nvme_path}: {exc.strerror or exc}")
    target = None
    if model is not None:
        from zerotune.hf.models import context_length, meta_model

        try:
            target, _ = meta_model(model)
        except Exception as exc:  # noqa: BLE001 - any failure to read the model is bad input
            _fail(f"--model {model}: {str(exc).strip() or type(exc).__name__}")
        config = getattr(target, "config", None)
        context = context_length(config, default=None) if config is not None else None
        if seq_len is not None and context is not None and seq_len > context:
            _fail(f"--seq-len {seq_len} exceeds the model's context length {context}")
    try:
        plan = make_plan(
            target,
            params=count,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            gpu_memory=gpu_memory,
            host_memory=host_memory,
            nvme_space=nvme_space,
            seq_len=seq_len,
            micro_batch=micro_batch,
            activation_checkpointing=activation_checkpointing,
            dtype=dtype or ("fp32" if device == "cpu" else "bf16"),
            grad_dtype=grad_dtype,
            optim_state_bits=int(optim_state_bits),
            headroom=headroom,
            nvme_path=nvme_path,
            device="cpu" if device == "cpu" else "cuda",
        )
    except ConfigError as exc:
        _fail(str(exc))
    if model is not None:
        plan.model = model
        plan.random_init = _without_weights(model)
    if as_json:
        click.echo(json.dumps(plan.to_dict()))
    else:
        click.echo(plan.format())
    if not as_json and given("device") == click.core.ParameterSource.DEFAULT and not _has_gpu():
        # The plan is for GPUs; a run on this machine would hold it all in host memory.
        click.echo(
            "note: planned for GPUs; this machine has none: --device cpu plans a run here", err=True
        )


def _has_gpu() -> bool:
    """Whether ``zerotune finetune`` would train on a GPU here (its memory check's test)."""
    import torch

    return torch.cuda.is_available()


def _without_weights(model: str) -> bool:
    """Whether ``zerotune finetune --model MODEL`` needs ``--init random``: a config file,
    a folder without safetensors, or a preset name that is not a model in the local Hugging
    Face cache."""
    from pathlib import Path

    from zerotune.hf.presets import list_presets

    path = Path(model)
    if path.is_file():
        return True
    if path.is_dir():
        return not any(path.glob("*.safetensors"))
    if model not in list_presets():
        return False  # a hub id: its weights
    try:
        from huggingface_hub import try_to_load_from_cache

        return not isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id either: the preset it is
        return True
