"""``zerotune env``: what this machine has, and whether zerotune's native ops work on it."""

from __future__ import annotations

import json
import os
import platform
import sys

import click


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    # Versions from the installed metadata: importing bitsandbytes (say) prints its own
    # lines about kernels this report does not need.
    for name in ("transformers", "datasets", "safetensors", "click"):
        out[name] = version(name)
    for name, extra in (("bitsandbytes", "bnb"), ("matplotlib", "plot"), ("trl", "trl")):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = f"not installed (optional: pip install zerotune[{extra}])"
    import zerotune

    out["zerotune"] = zerotune.__version__
    return out


def _accelerator() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    info: dict[str, object] = {
        "cuda_build": torch.version.cuda or "none (CPU build)",
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
    return info


def collect(build: bool) -> dict[str, object]:
    import psutil

    from zerotune import ops

    statuses = ops.build_all() if build else {n: ops.op_status(n) for n in ops.OPS}
    return {
        "versions": _versions(),
        "accelerator": _accelerator(),
        "cpu": {
            "machine": platform.machine(),
            "model": ops.cpu_model(),
            "cores": os.cpu_count(),
            "simd": ops.cpu_simd_level(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            # elements ahead the CPU Adam prefetches (per vendor); None: the op not loaded
            "adam_prefetch": ops.adam_prefetch(),
        },
        "ops": {
            n: {"state": s.state, "reason": s.reason, "path": s.path} for n, s in statuses.items()
        },
        "op_cache": str(ops.cache_root()),
    }


@click.command()
@click.option("--build", is_flag=True, help="Build (or load) every C++ op now, ahead of training.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def env(build: bool, as_json: bool) -> None:
    """Report versions, the accelerator, CPU SIMD level and the state of each C++ op.

    \b
    Examples:
      zerotune env            # what is there, without building anything
      zerotune env --build    # compile the C++ ops now (cached per user)
    """
    info = collect(build)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    v, a, c = info["versions"], info["accelerator"], info["cpu"]
    click.echo("zerotune environment")
    click.echo("-" * 60)
    for name, ver in v.items():
        click.echo(f"  {name:<14}{ver}")
    click.echo(
        f"  {'cuda':<14}{a['cuda_build']}; available: {'yes' if a['cuda_available'] else 'no'}"
    )
    for dev in a["devices"] or ["none"]:
        click.echo(f"  {'accelerator':<14}{dev}")
    click.echo(f"  {'backends':<14}gloo: {_yn(a['gloo'])}, nccl: {_yn(a['nccl'])}")
    cpu = f"{c['machine']}, {c['cores']} cores, SIMD {c['simd']}, {c['memory_gib']} GiB RAM"
    click.echo(f"  {'cpu':<14}{cpu}")
    if c["model"]:
        click.echo(f"  {'':<14}{c['model']}")
    click.echo("-" * 60)
    for name, op in info["ops"].items():
        line = f"  op {name:<11}{op['state']}"
        if op["path"]:
            line += f"  ({op['path']})"
        click.echo(line)
        if name == "adam" and c["adam_prefetch"] is not None:
            click.echo(f"  {'':<14}prefetch {c['adam_prefetch']} elements ahead (per CPU vendor)")
        if op["reason"]:
            click.echo(f"  {'':<14}{op['reason']}")
    if not build and any(op["state"] == "not built" for op in info["ops"].values()):
        click.echo("  ops are built on first use; `zerotune env --build` builds them now")
    if build and any(op["state"] == "fallback" for op in info["ops"].values()):
        sys.exit(1)  # asked to build, and a build failed: say so in the exit code


def _yn(flag: object) -> str:
    return "yes" if flag else "no"
