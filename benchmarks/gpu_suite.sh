#!/usr/bin/env bash
# The GPU suite of issue 32 (item 7): one command for a fresh, bare GPU machine (H100/H200,
# 16 cores) that installs what is missing, builds zerotune's C++ ops and runs, each step under
# its own `timeout`, writing into OUTDIR as it goes (a step that fails or runs out of time
# leaves the others' files):
#
#   setup.log         wheels installed from .whl, zerotune installed (editable), ops built
#   env.json          `zerotune env --build --json`: versions, the GPU, each C++ op's state
#   zero_trainer.log  tests/test_gpu.py's ZeroTrainer case (stage 3, optimizer on the CPU,
#                     against the plain Trainer on the GPU), run first and on its own
#   test_gpu.log      the rest of tests/test_gpu.py (pytest -v)
#   paired_step.log   benchmarks/paired_step.py on the GPU, gpt2-medium fp32: plain and
#                     zerotune (stage 3, no offload) stepping in turn in one process
#   paired_step.json  its last JSON line (step_time_ratio: issue 32's item 3 on the GPU)
#   cpu_adam.log      benchmarks/cpu_adam.py on the host's cores with --sweep-prefetch: the
#   cpu_adam.json     CPU Adam against torch's fused step at each prefetch distance (the
#                     kernel picks one per CPU vendor), and its last JSON line
#   gpu_step.log      benchmarks/gpu_step.py, gpt2-xl bf16: plain, zerotune, zerotune with
#                     the optimizer on the CPU, FSDP2 + CPUOffloadPolicy, zerotune with
#                     parameters and optimizer on the CPU, and last (if time is left) the
#                     optimizer on the CPU with the overlapped step (its Adam on the
#                     update thread), clipped without and with overlap, and the
#                     overlapped step with its Adam on the launching thread
#   gpu_step.json     its last JSON line (tokens/s, GPU peak and peak RSS per variant, ratios)
#   summary.json      every step's exit status, seconds and limit; passed / failed / skipped
#                     counts and failing test ids of both pytest steps; the op states, the
#                     host's CPU model and Adam prefetch; the paired_step, cpu_adam, gpu_step JSON
#                     (rewritten after each step)
#
#   bash benchmarks/gpu_suite.sh OUTDIR           # on the GPU machine, from the repo root
#   bash benchmarks/gpu_suite.sh --cpu OUTDIR     # the same steps on a CPU machine, tiny model
#
# Exit status 0 when every step exited 0. With the device tool:
#   run(command="bash benchmarks/gpu_suite.sh $OUT", carry=[".whl"], timeout_s=540)
#
# Wheels. The machine has torch, transformers, accelerate, safetensors, click, pyyaml, psutil,
# ninja, pytest, numpy, pandas, pyarrow, xxhash, fsspec and huggingface-hub (KINDS.md), and no
# registry. Missing are datasets (the ZeroTrainer case's dataset) with dill and multiprocess,
# jsonschema (checkpoint manifests, the round-trip test) with jsonschema-specifications,
# referencing and rpds-py, and bitsandbytes (the two 8-bit cases; 43 MB: leave it out if the
# tree must stay small, and those two cases fail). Fetch them once, in the repo root of the
# checkout the device tool sends (`.whl/` is in .gitignore, so it travels only when carried):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 jsonschema==4.26.0 \
#       jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 \
#       bitsandbytes==0.50.2
#
# Only wheels whose distribution is not installed there are installed (into /tmp/site, put on
# PYTHONPATH), so nothing already on the machine is replaced. ZEROTUNE_WHEELS names another
# folder.
#
# Time. All of it fits in ~8 minutes on an H100 (SUITE_BUDGET_S, default 480 s: each step's
# limit is its own cap or what is left of the budget, whichever is less). Expected: setup ~1
# min (the op build is most of it; cap 150 s), the ZeroTrainer case ~20 s (cap 90), the rest
# of tests/test_gpu.py ~30-60 s (~30 s for 28 checks on the last H100 run; cap 150, and 90 s
# per test where pytest-timeout is there), paired_step.py ~30 s (cap 60), cpu_adam.py ~10 s
# (cap 40), gpu_step.py ~3-4
# min (the rest of the budget).
# gpu_step.py runs 2 warm-up and 3 timed steps of 2 x 8 x 1024 tokens per variant: the shape
# of the last H100 measurement (0.70x, RESULTS.md), so the ratios compare with it; the second
# warm-up step lets the carried updates and pinned buffers settle; 3 timed steps give a
# median where a GPU step varies by a few percent. Estimated step times, H100: plain ~0.6 s,
# zerotune ~0.8 s, optimizer on the CPU ~1.1 s, FSDP2 with CPU offload and zerotune with both
# on the CPU ~2-4 s (host Adam over 1.6B fp32 parameters, 6 GB of copies each way per
# micro-batch), plus ~15-30 s per variant for the process, the model and the pinned buffers.
# The variants run in the order above, so the two ratios of the issue come first (the
# overlapped one, ~1 s a step, only where time is left); gpu_step's
# own --time-budget stops the variant running when the step's limit nears and the JSON line
# still comes.

set -u -o pipefail

mode=gpu
if [[ ${1:-} == --cpu ]]; then
    mode=cpu
    shift
fi
if [[ $# -ne 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu_suite.sh [--cpu] OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUTDIR=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

PY=${PYTHON:-python3}
SITE=/tmp/zerotune-suite-site
WHEELS=${ZEROTUNE_WHEELS:-$REPO/.whl}
BUDGET=${SUITE_BUDGET_S:-480}
[[ $mode == cpu ]] && BUDGET=${SUITE_BUDGET_S:-900}
DEADLINE=$((SECONDS + BUDGET))
TRAINER_CASE=tests/test_gpu.py::test_zero_trainer_on_the_device_logs_the_plain_trainers_losses

export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
# The worktree's code first; wheels the machine lacked next.
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

STEP_VARIANTS=plain,zerotune,zerotune-optim-cpu,fsdp2-cpu-offload,zerotune-both-cpu
STEP_VARIANTS+=,zerotune-optim-cpu-overlap,zerotune-optim-cpu-clipped
STEP_VARIANTS+=,zerotune-optim-cpu-clipped-overlap,zerotune-optim-cpu-overlap-inline
if [[ $mode == gpu ]]; then
    STEP_ARGS=(--model gpt2-xl --dtype bf16 --seq 1024 --batch 8 --accum 2 --warmup 2 --steps 3
        --variants "$STEP_VARIANTS")
    PAIRED_ARGS=(--device cuda --model gpt2-medium --dtype fp32 --seq 1024 --batch 4
        --warmup 3 --pairs 20)
    ADAM_ARGS=(--no-foreach --sweep-prefetch --iters 10)
else
    PAIRED_ARGS=(--device cpu --model tiny-gpt2 --warmup 1 --pairs 4)
    ADAM_ARGS=(--no-foreach --sweep-prefetch --iters 2 --numel 1000000)
    STEP_ARGS=(--device cpu --model tiny-gpt2 --dtype bf16 --seq 64 --batch 2 --accum 2
        --warmup 1 --steps 2 --variants "$STEP_VARIANTS")
fi

setup() {
    echo "== machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB RAM, $("$PY" -V 2>&1)"
    echo "== wheels from $WHEELS"
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl) missing
    if ((${#wheels[@]})); then
        missing=$("$PY" - "${wheels[@]}" <<'PY'
import importlib.metadata as md
import os
import sys

for path in sys.argv[1:]:
    name = os.path.basename(path).split("-")[0]
    try:
        print(f"have {name} {md.version(name)}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(path)
PY
        ) || return 1
        if [[ -n $missing ]]; then
            mapfile -t missing <<<"$missing"
            echo "installing ${missing[*]##*/}"
            "$PY" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --target "$SITE" "${missing[@]}" || return 1
        fi
    else
        echo "none"
    fi
    echo "== zerotune"
    # The package maps zerotune._configs / _csrc / cli onto the repo's folders: installed
    # (editable) it finds them. A CPU check uses the install it has (never reinstalled here).
    if ! (cd / && "$PY" -c "import zerotune._configs") 2>/dev/null; then
        if [[ $mode == cpu ]]; then
            echo "zerotune is not installed here; --cpu does not install it" >&2
            return 1
        fi
        "$PY" -m pip install -q --root-user-action=ignore --no-index --no-deps \
            --no-build-isolation -e "$REPO" || return 1
    fi
    "$PY" -c "import zerotune; print('zerotune from', zerotune.__file__)" || return 1
    echo "== C++ ops"
    "$PY" -c "from zerotune.cli import main; main()" env --build --json >"$OUTDIR/env.json"
}

# summarize STEP RC SECONDS LIMIT: add the step to summary.json, parse what it wrote.
summarize() {
    "$PY" - "$OUTDIR" "$mode" "$@" <<'PY'
import json
import os
import re
import sys

out, mode, step, rc, seconds, limit = sys.argv[1:7]
path = os.path.join(out, "summary.json")
summary = {"mode": mode, "steps": {}}
if os.path.exists(path):
    with open(path) as f:
        summary = json.load(f)
summary["steps"][step] = {
    "rc": int(rc),
    "seconds": int(seconds),
    "limit_s": int(limit),
    "timed_out": int(rc) in (124, 137),
}


def lines(name):
    try:
        with open(os.path.join(out, name), errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def pytest_counts(log):
    """Counts from pytest -v's per-test lines (there even when pytest was killed)."""
    status = re.compile(r"^(tests/\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfail": 0, "xpass": 0}
    failed, unfinished = [], None
    for line in lines(log):
        m = status.match(line)
        if m:
            counts[m.group(2).lower()] += 1
            if m.group(2) in ("FAILED", "ERROR"):
                failed.append(m.group(1))
            unfinished = None
        elif line.startswith("tests/") and "::" in line:
            unfinished = line.strip()
    final = [x for x in lines(log) if re.match(r"^=+ .* in [\d.]+s", x)]
    counts["failed_tests"] = failed
    counts["running_when_stopped"] = unfinished
    counts["final_line"] = final[-1].strip("= ") if final else None
    return counts


if step == "setup" and os.path.exists(os.path.join(out, "env.json")):
    try:
        with open(os.path.join(out, "env.json")) as f:
            env = json.load(f)
        summary["ops"] = {k: v["state"] for k, v in env["ops"].items()}
        summary["versions"] = env["versions"]
        summary["accelerator"] = env["accelerator"]["devices"]
        summary["cpu"] = {k: env["cpu"].get(k) for k in ("model", "cores", "adam_prefetch")}
    except (ValueError, KeyError):
        summary["ops"] = "env.json unreadable"
if step in ("zero_trainer", "test_gpu"):
    summary[step] = pytest_counts(step + ".log")
if step in ("paired_step", "cpu_adam", "gpu_step"):
    found = None
    for line in lines(step + ".log"):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                pass
    summary[step] = found
    if found is not None:
        with open(os.path.join(out, step + ".json"), "w") as f:
            f.write(json.dumps(found) + "\n")
with open(path, "w") as f:
    json.dump(summary, f, indent=1)
    f.write("\n")
PY
}

failures=0
# step NAME CAP_S COMMAND...: run under `timeout` (the cap or what is left of the budget),
# output to NAME.log, then summarize.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    local limit=$((cap < left ? cap : left))
    local start=$SECONDS rc
    if ((limit < 10)); then
        echo "$name: not run, the suite's $BUDGET s are spent" | tee "$OUTDIR/$name.log"
        rc=124 limit=0
    else
        echo "== $name (limit $limit s)"
        timeout -k 10 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
        rc=$?
    fi
    echo "   $name: exit $rc after $((SECONDS - start)) s"
    ((rc == 0)) || failures=$((failures + 1))
    summarize "$name" "$rc" "$((SECONDS - start))" "$limit" || echo "   (summary not updated)"
}

if [[ ${SUITE_INTERNAL_STEP:-} == setup ]]; then
    setup
    exit
fi

PYTEST=("$PY" -m pytest -v -rfE -p no:cacheprovider)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout 90)
fi

echo "gpu_suite ($mode): $OUTDIR, budget $BUDGET s"
rm -f "$OUTDIR"/{summary,gpu_step,paired_step,cpu_adam,env}.json
self=(bash "${BASH_SOURCE[0]}")
[[ $mode == cpu ]] && self+=(--cpu)
step setup 150 env SUITE_INTERNAL_STEP=setup "${self[@]}" "$OUTDIR"
step zero_trainer 90 "${PYTEST[@]}" "$TRAINER_CASE"
step test_gpu 150 "${PYTEST[@]}" tests/test_gpu.py --deselect "$TRAINER_CASE"
step paired_step 60 "$PY" benchmarks/paired_step.py "${PAIRED_ARGS[@]}"
step cpu_adam 40 "$PY" benchmarks/cpu_adam.py "${ADAM_ARGS[@]}"
left=$((DEADLINE - SECONDS))
step gpu_step "$left" "$PY" benchmarks/gpu_step.py "${STEP_ARGS[@]}" --time-budget $((left > 45 ? left - 15 : left * 2 / 3))

echo "== gpu_step table"
grep -v '^running \|^[a-z0-9-]*: {' "$OUTDIR/gpu_step.log" | tail -n 12
echo "== summary.json"
"$PY" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$OUTDIR/summary.json"
exit $((failures > 0))
