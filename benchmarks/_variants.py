"""Benchmarks run each variant in a fresh process of the same script, so that peak memory
(RSS, GPU) is the variant's own: the parent calls ``run_variants``, the child (started with
``--variant NAME``) prints one JSON line through ``answer_as_variant``."""

from __future__ import annotations

import json
import subprocess
import sys


def answer_as_variant(args, run_variant) -> bool:
    """In a child process (``args.variant`` set): run it, print its JSON line, return True."""
    if not args.variant:
        return False
    print(json.dumps(run_variant(args)))
    return True


def run_variants(script: str, names: list[str]) -> dict[str, dict]:
    """Each variant's result, run as ``script <this command's arguments> --variant NAME``;
    a failed variant ends the benchmark with its error output."""
    results = {}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, script, *sys.argv[1:], "--variant", name]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{name} run failed:\n{out.stderr[-3000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results
