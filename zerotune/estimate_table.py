"""The memory plan for people: byte counts, the table ``zerotune estimate`` prints, and the
``zerotune finetune`` options of the job a plan is for (see estimate.py)."""

from __future__ import annotations

__all__ = ["format_bytes", "format_plan", "job_flags"]


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**40:
        return f"{n / 2**40:.2f} TiB"
    if n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def _short(n: int) -> str:
    return "0" if n == 0 else f"{n / 2**30:.1f}" if n >= 2**30 * 10 else f"{n / 2**30:.2f}"


def format_plan(plan) -> str:
    """The table of a ``MemoryPlan``. Its columns break down the compute side per rank: the
    GPU's memory, or for a CPU run (``plan.device == "cpu"``) the host memory each process
    holds, where everything but the NVMe files lives."""
    lim = plan.limits
    cpu = plan.device == "cpu"
    where = "process" if cpu else "GPU"
    machine = (
        f"CPUs only, host {format_bytes(lim['host'])}"
        if cpu
        else f"GPU {format_bytes(lim['device'])}, host {format_bytes(lim['host'])}"
    )
    lines = [
        f"zerotune estimate: {plan.model}: {plan.parameters:,} parameters"
        + (f" in {plan.units} units" if plan.units > 1 else ""),
        f"  world size {plan.world_size} ({plan.gpus_per_node} per node), compute {plan.dtype}, "
        f"gradients {plan.grad_dtype}, Adam moments {plan.optim_state_bits}-bit, "
        f"padding {plan.padding_elements:,} elements per rank",
        f"  machine: {machine}, NVMe {format_bytes(lim['nvme'])} (- = not checked); "
        f"{int(plan.headroom * 100)}% kept free",
    ]
    act = plan.activations
    if act is None:
        lines.append("  activations: not estimated (no model shape: give --model)")
    else:
        lines.append(
            f"  activations per {where} (seq {act['seq_len']} x micro-batch "
            f"{act['micro_batch']}): {format_bytes(act['without_checkpointing'])} without "
            f"checkpointing, {format_bytes(act['with_checkpointing'])} with"
            + (" (used below)" if act["checkpointing"] else " (the first used below)")
        )
    lines.append("")
    total = "host" if cpu else "GPU"
    head = (
        f"{'stage':>5} {'param':>5} {'optim':>5} | {'params':>6} {'grads':>6} {'optim':>6} "
        f"{'activ':>6} {'buffer':>6} {total:>7} | {'host/node':>9} | {'NVMe/node':>9} | fits"
    )
    title = (
        "GiB per process (a CPU run holds everything in host memory), per host and NVMe per host"
        if cpu
        else "GiB per GPU (device), per host and NVMe per host"
    )
    lines += [title, head, "-" * len(head)]
    tier = "host" if cpu else "device"
    rec = plan.recommended
    for o in plan.options:
        if o.error:
            lines.append(f"{o.stage:>5} {o.offload_param:>5} {o.offload_optimizer:>5} | {o.error}")
            continue
        row = [o.rows[r].get(tier, 0) for r in ("params", "grads", "optimizer", "activations")]
        row += [o.rows["buffers"].get(tier, 0) + o.rows["staging"].get(tier, 0)]
        mark = ("yes" if o.fits else "no") + (" <- recommended" if o is rec else "")
        lines.append(
            f"{o.stage:>5} {o.offload_param:>5} {o.offload_optimizer:>5} | "
            + " ".join(f"{_short(n):>6}" for n in row)
            + f" {_short(o.per_rank(tier)):>7} | {_short(o.per_host):>9} | "
            + f"{_short(o.nvme_per_host):>9} | {mark}"
        )
    lines.append("")
    if rec is None:
        more = "more host memory" if cpu else "more GPUs, host memory"
        lines.append(f"nothing fits this machine; {more} or NVMe space would help:")
        last = plan.options[-1]
        lines += [f"  {last.name}: {w}" for w in last.why_not]
    else:
        lines.append(f"recommended: {rec.name}")
        lines.append(f"  {plan.command()}")
        keys = plan.config_file()
        if keys is not None:
            held = ", ".join(f"{k}: {v}" for k, v in keys.items())
            lines.append(f"  with zerotune.yaml holding {{{held}}}")
        nodes = -(-plan.world_size // plan.gpus_per_node)
        if nodes > 1:
            lines.append(
                f"  on each of the {nodes} nodes, under torchrun --nnodes {nodes} "
                f"--nproc-per-node {plan.gpus_per_node} (in place of --nproc-per-node)"
            )
    return "\n".join(lines)


def checkpointing_flag() -> str:
    """The Trainer flag for activation checkpointing as the installed transformers names it
    (5.2x: --activation_checkpointing, its old name a deprecated alias; before: only
    --gradient_checkpointing)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    new = "activation_checkpointing" in names
    return "--activation_checkpointing" if new else "--gradient_checkpointing"


def job_flags(plan) -> str:
    """The ``zerotune finetune`` options for what the plan assumed besides the ZeRO tiers
    (dtype, 8-bit moments, sequence length, micro-batch, checkpointing, processes, a CPU
    run): without them the command would run another job than the one that fits."""
    parts = []
    flag = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
    if plan.dtype in flag:  # the config's names and their aliases
        parts.append(f"--{flag[plan.dtype]}")  # finetune trains in fp32 unless told
    if plan.optim_state_bits == 8:
        parts.append("--optim adamw_8bit")
    act = plan.activations
    if act is not None:
        parts.append(f"--block-size {act['seq_len']}")
        parts.append(f"--per_device_train_batch_size {act['micro_batch']}")
        if act["checkpointing"]:
            parts.append(checkpointing_flag())
    if plan.gpus_per_node > 1:
        parts.append(f"--nproc-per-node {plan.gpus_per_node}")
    if plan.device == "cpu":
        parts.append("--use_cpu")  # on a host with a GPU, finetune would train there
    return "".join(" " + p for p in parts)
