"""Benchmarks run each variant in a fresh process of the same script, so that peak memory
(RSS, GPU) is the variant's own: the parent calls ``run_variants``, the child (started with
``--variant NAME``) prints one JSON line through ``answer_as_variant``."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def answer_as_variant(args, run_variant) -> bool:
    """In a child process (``args.variant`` set): run it, print its JSON line, return True."""
    if not args.variant:
        return False
    print(json.dumps(run_variant(args)))
    return True


def run_variants(
    script: str, names: list[str], *, keep_going: bool = False, deadline: float | None = None
) -> dict[str, dict]:
    """Each variant's result, run as ``script <this command's arguments> --variant NAME``.

    By default a failed variant ends the benchmark with its error output. With
    ``keep_going`` a failed variant's result is ``{"error": ...}`` and the others still run,
    each finished result is echoed on stderr as it comes (a log keeps it if the parent is
    killed), and ``deadline`` (a ``time.monotonic()`` value) stops the variant running when
    it passes and skips the ones not started."""
    results = {}
    for name in names:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            results[name] = {"error": "not run: the time budget was spent"}
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, script, *sys.argv[1:], "--variant", name]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"stopped after {left:.0f} s: the time budget was spent"}
            print(f"{name}: {results[name]['error']}", file=sys.stderr, flush=True)
            continue
        if out.returncode != 0:
            if not keep_going:
                sys.exit(f"{name} run failed:\n{out.stderr[-3000:]}")
            print(f"{name} run failed:\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
            last = out.stderr.strip().splitlines()[-1:] or [""]
            results[name] = {"error": f"exit {out.returncode}: {last[0][:300]}"}
            continue
        line = out.stdout.strip().splitlines()[-1]
        results[name] = json.loads(line)
        if keep_going:
            print(f"{name}: {line}", file=sys.stderr, flush=True)
    return results


def page_cache_bytes() -> int:
    """Cached + Buffers of /proc/meminfo (the whole machine's page cache)."""
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(("Cached:", "Buffers:")):
                total += int(line.split()[1]) * 1024
    return total


def add_model_arguments(ap) -> None:
    """The model and batch shape options the CPU step benchmarks share."""
    ap.add_argument("--model", default="gpt2", help="preset name or config.json path")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
