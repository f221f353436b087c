"""Acceptance run: transformers' own Trainer tests, plain and with ZeroTrainer at stages 1, 2, 3.

    HF_HUB_OFFLINE=1 python benchmarks/trainer_tests.py /path/to/transformers   # a checkout
    HF_HUB_OFFLINE=1 python benchmarks/trainer_tests.py /path/to/transformers/tests
    python benchmarks/trainer_tests.py DIR --stages 3 -k "Callback"     # a subset

The test files are not part of this repository: point the script at a transformers checkout
(or its ``tests/`` folder) of the installed version. It runs pytest in a subprocess on
``tests/trainer/test_trainer.py``, ``test_trainer_callback.py`` and ``test_training_args.py``
(``--files`` for others): once plain, then once per stage with the pytest plugin
``benchmarks/_zero_swap.py``, which swaps ``transformers.Trainer`` / ``TrainingArguments`` for
ZeroTrainer and a ZeroTrainingArguments whose ``zero_stage`` defaults to that stage before the
test modules import them. Runs go one after another (memory), each under ``timeout``. The
zerotune imported is the one of this checkout (it goes first on ``PYTHONPATH``).

Only tests that pass in the plain run are compared: tests skipped there (no GPU, optional
packages missing), xfailed, or failing there (hub downloads under ``HF_HUB_OFFLINE=1``) are
left out and counted. For each stage it prints the counts, the tests that pass plain but not
with ZeroTrainer with the first line of their error, and checks that the swap took: a test that
built a Trainer in the plain run must have built a ZeroTrainer, and none a plain one. The last
line is one JSON object: plain_passed, stageN_passed, compared.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FILES = (
    "tests/trainer/test_trainer.py",
    "tests/trainer/test_trainer_callback.py",
    "tests/trainer/test_training_args.py",
)


def find_root(path: Path) -> Path:
    """The folder holding ``tests/trainer`` (a checkout), from a checkout or its tests/."""
    path = path.resolve()
    for root in (path, path.parent):
        if (root / "tests" / "trainer").is_dir():
            return root
    sys.exit(f"no tests/trainer folder in {path} or its parent")


def run_pytest(root: Path, files, stage, work: Path, timeout: int, extra) -> dict:
    """One pytest run; returns {nodeid: record} from the plugin's JSON lines."""
    label = "plain" if stage is None else f"stage{stage}"
    record = work / f"{label}.jsonl"
    log = work / f"{label}.log"
    record.unlink(missing_ok=True)
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")  # ignore the checkout's own pytest settings
    cwd = work / f"{label}-cwd"  # tests write relative paths (./regression, ...)
    cwd.mkdir(exist_ok=True)
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["ZEROTUNE_SWAP_RECORD"] = str(record)
    env.pop("ZEROTUNE_SWAP_STAGE", None)
    if stage is not None:
        env["ZEROTUNE_SWAP_STAGE"] = str(stage)
    cmd = [
        "timeout", "--kill-after=30", str(timeout),
        sys.executable, "-m", "pytest",
        "-p", "no:cacheprovider", "-p", "_zero_swap",
        "--noconftest",  # the checkout's conftest puts its src/ before the installed transformers
        "-c", str(ini), "--rootdir", str(root),
        "-q", "-rA", "--junitxml", str(work / f"{label}.xml"),
        *extra,
        *[str(root / f) for f in files],
    ]  # fmt: skip
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    took = time.monotonic() - start
    results = {}
    if record.exists():
        for line in record.read_text().splitlines():
            rec = json.loads(line)
            results[rec["test"]] = rec
    note = " (timed out)" if rc in (124, 137) else ""
    print(
        f"[{label}] {len(results)} tests in {took:.0f} s, pytest exit {rc}{note}; log {log}",
        flush=True,
    )
    return {"results": results, "rc": rc, "seconds": took, "timed_out": rc in (124, 137)}


def short(nodeid: str) -> str:
    return nodeid.split("tests/trainer/", 1)[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a transformers checkout or its tests/ folder")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                    help="test files, relative to the checkout")  # fmt: skip
    ap.add_argument("-k", dest="keyword", help="pytest -k expression (a subset)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per pytest run")
    ap.add_argument("--work", type=Path, help="folder for logs and records (default: a temp dir)")
    opts = ap.parse_args()

    root = find_root(opts.path)
    for f in opts.files:
        if not (root / f).is_file():
            sys.exit(f"missing {root / f}")
    work = opts.work or Path(tempfile.mkdtemp(prefix="zerotune-trainer-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    extra = ["-k", opts.keyword] if opts.keyword else []
    import transformers

    print(
        f"transformers {transformers.__version__}; tests from {root}; work folder {work}",
        flush=True,
    )

    plain = run_pytest(root, opts.files, None, work, opts.timeout, extra)
    pres = plain["results"]
    by_outcome = collections.defaultdict(list)
    for name, rec in pres.items():
        by_outcome[rec["outcome"]].append(name)
    compared = sorted(by_outcome["passed"])
    print(
        "plain run: "
        + ", ".join(f"{k} {len(v)}" for k, v in sorted(by_outcome.items()))
        + f"; compared: the {len(compared)} that passed"
    )
    reasons = collections.Counter(
        (rec["error"] or "")[:110]
        for rec in pres.values()
        if rec["outcome"] in ("failed", "skipped")
    )
    print("left out (plain run skipped or failed them), by first line:")
    for why, n in reasons.most_common():
        print(f"  {n:3d}  {why}")
    with_trainer = [t for t in compared if pres[t]["plain"] > 0]
    with_args = [t for t in compared if pres[t]["plain"] == 0 and pres[t]["args"] > 0]
    print(
        f"of the compared: {len(with_trainer)} build a Trainer, {len(with_args)} only "
        f"TrainingArguments, {len(compared) - len(with_trainer) - len(with_args)} neither"
    )

    summary = {"plain_passed": len(compared)}
    for stage in opts.stages:
        run = run_pytest(root, opts.files, stage, work, opts.timeout, extra)
        res = run["results"]
        passed = [t for t in compared if res.get(t, {}).get("outcome") == "passed"]
        failed = [t for t in compared if t not in passed]
        leaked = [t for t in res if res[t]["plain"] > 0]
        # A test that fails before its Trainer exists (arguments refused) built none: only a
        # pass without a ZeroTrainer would mean the swap missed it.
        no_zero = [t for t in passed if t in with_trainer and res[t]["zero"] == 0]
        wrong_stage = [t for t in res if res[t]["stages"] and res[t]["stages"] != [stage]]
        print()
        n_trainer = sum(t in passed for t in with_trainer)
        n_args = sum(t in passed for t in with_args)
        n_plain = len(compared)
        print(f"passed with plain: {n_plain}, passed with ZeroTrainer stage {stage}: {len(passed)}")
        print(
            f"  of them: build a Trainer {n_trainer}/{len(with_trainer)}, "
            f"only TrainingArguments {n_args}/{len(with_args)}"
        )
        print(
            f"  swap check: {sum(1 for t in with_trainer if res.get(t, {}).get('zero', 0) > 0)}"
            f"/{len(with_trainer)} Trainer-building tests built a ZeroTrainer, passed without "
            f"one {len(no_zero)}; "
            f"plain Trainer built in {len(leaked)} test(s); other stage in {len(wrong_stage)}"
        )
        for t in leaked + no_zero + wrong_stage:
            print(f"    swap problem: {short(t)}")
        if run["timed_out"]:
            missing = sum(1 for t in compared if t not in res)
            print(f"  the run timed out: {missing} compared test(s) did not run")
        print(f"  pass plain, fail with ZeroTrainer stage {stage}: {len(failed)}")
        for t in failed:
            rec = res.get(t)
            if rec is None:
                print(f"    {short(t)}: did not run (timeout or crash)")
            else:
                where = f"  [{rec['where']}]" if rec.get("where") else ""
                print(f"    {short(t)}: {rec['outcome']}: {rec['error']}{where}")
        summary[f"stage{stage}_passed"] = len(passed)
    summary["compared"] = len(compared)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
