"""Time training steps of an HF GPT-2 config: plain PyTorch vs zerotune, in one invocation.

Each variant runs in a fresh subprocess (so peak RSS is its own): plain PyTorch with
``torch.optim.AdamW(fused=True)``, then zerotune at world size 1 with the chosen stage and
offload. Prints a table (forward, backward, optimizer, total, peak RSS, disk bytes) and, last,
one JSON line with ``step_time_ratio`` and ``peak_rss_ratio`` (zerotune / plain),
``step_time_s``, ``peak_rss_gib``, and for NVMe offload the bytes read and written per step
(counted by the kernel for this process: /proc/self/io) and the bandwidth they took.

    python benchmarks/train_step.py                      # gpt2 (124M), seq 128, batch 1, fp32
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp
    python benchmarks/train_step.py --model gpt2-xl --offload nvme --steps 3 --no-baseline
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --optim adamw_8bit                      # + nvme_bytes_ratio (8-bit / fp32 states)
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --overlap-step                          # optimizer I/O during backward
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --overlap-step --compare-carry          # + the same without carrying into forward
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --compare-master-copy                   # + the master copied, not updated in place
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --overlap-step --max-grad-norm 1.0 --compare-unclipped --compare-sequential
                                                # clipping (ZeroTrainer's default path)
    python benchmarks/train_step.py --model gpt2-medium --offload nvme --nvme-path /tmp \
        --optim adafactor                       # torch Adafactor, plain and ZeroOptimizer
    python benchmarks/train_step.py --offload-activations nvme --nvme-path /tmp \
        --batch 8 --seq 512                     # checkpoints offloaded vs kept, both checkpointed
    python benchmarks/train_step.py --model gpt2-xl --offload nvme --nvme-path /tmp \
        --no-baseline --squeeze-to 6GiB --compare-unsqueezed   # page cache squeezed out
    python benchmarks/train_step.py --compile --compare-eager   # torch.compile, both sides

With ``--optim adamw_8bit`` zerotune runs twice in the same invocation, with fp32 Adam states
and with 8-bit ones (``optim_state_bits: 8``); the summary describes the 8-bit run and adds
``nvme_bytes_ratio`` (disk bytes read + written per step, 8-bit / fp32) and the other
ratios against the fp32-state run. With ``--compare-master-copy`` zerotune also runs with
the fp32 master read into staging and written back instead of updated in the parameter
file's pages (``NvmeStore.in_place`` off; the way before session 16). With
``--compare-carry`` (and ``--overlap-step``)
zerotune also runs with ``overlapped(carry=False)``: every update finished in ``step()``
instead of the last ones going on during the next forward. With ``--offload-activations``
zerotune runs with activation checkpointing on, once keeping the checkpoints and once
offloading them; the summary describes the offloaded run and adds its ratios against the
kept one. ``--max-grad-norm`` clips both sides (plain: ``torch.nn.utils.clip_grad_norm_``);
with ``--overlap-step`` zerotune then runs ``overlapped(clipping=True)``, ZeroTrainer's
default with the optimizer on NVMe. ``--compare-unclipped`` adds the same overlapped step
without clipping, ``--compare-sequential`` the same clipping with the step after backward.
``--squeeze-to 6GiB`` runs every zerotune variant while a second process holds host memory
so that only 6 GiB stay available (the machine has no swap, so the kernel can give up only
page cache: the buffered swap files no longer stay cached); ``--compare-unsqueezed`` adds
the same run without it, for the ratio. ``--compare-read-params`` adds zerotune reading the
parameter file into buffers (``map_param_file: false``) instead of mapping it.
``--compare-flat-grads`` adds zerotune copying the gradients into flat shards at world size
1 instead of leaving them in the parameters (the way before). ``--compare-host-cache
1280MiB`` adds zerotune with that ``host_cache_bytes`` budget (freed tensors kept for reuse:
page faults against peak RSS); every variant reports its minor page faults a step
(``minflt_per_step``). ``--io-floor`` measures the disk's O_DIRECT write and read rates at
the end of the invocation and reports each step
against the time its bytes need at those rates (``step_vs_io_floor``), counting the bytes
the block device under ``--nvme-path`` moved during the step (``device_*_gb_per_step``: also
the writeback of mapped pages that the kernel's threads do, which a process's own I/O
counters miss; anything else using that disk counts too). With ``--nvme-path`` every
zerotune variant also reports the share of its forward and of its backward during which
that disk had I/O in flight (``disk_busy_forward``, ``disk_busy_backward``: medians).

With ``--optim adafactor`` (or ``sgd``) both sides run that ``torch.optim`` class: plain
over the model, zerotune through ``ZeroOptimizer`` (with ``--offload nvme`` its state
streams through NVMe unit by unit; ``optimizer_layout`` in the JSON says whether each rank
updated slices or whole parameters); ``--overlap-step`` and the comparisons of the
overlapped step work for them too.

On a machine whose speed drifts (a shared VM), ``--rounds R`` runs all the variants R
times in turn (plain, zerotune, plain, zerotune, ...): the table shows each variant's median
round, ``step_time_ratio`` is the median of the R ratios of the same round, and the JSON
adds every round's step times and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from _variants import add_model_arguments, answer_as_variant, page_cache_bytes, run_variants

# Optimizers run through zerotune.ZeroOptimizer: (torch.optim class name, kwargs).
GENERIC = {"adafactor": ("Adafactor", {"lr": 1e-3}), "sgd": ("SGD", {"lr": 1e-3, "momentum": 0.9})}


def _size(text: str) -> int:
    """A byte count as zerotune's config writes it (268435456, 256MiB, 6GiB): a bad one is
    argparse's one-line error, before any variant starts."""
    from zerotune.config import ConfigError, parse_bytes

    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(ap)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument(
        "--offload",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="parameters and optimizer state both on this tier",
    )
    ap.add_argument("--nvme-path", default=None, help="folder for swap files (--offload nvme)")
    ap.add_argument(
        "--staging",
        type=_size,
        default=None,
        help="NVMe staging buffers (zerotune's default if not given)",
    )
    ap.add_argument(
        "--optim",
        default="adamw",
        choices=["adamw", "adamw_8bit", *GENERIC],
        help="adamw / adamw_8bit: ZeroAdamW; the others: that torch optimizer through "
        "zerotune.ZeroOptimizer against the same optimizer on the plain model",
    )
    ap.add_argument(
        "--offload-activations",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="checkpoint every block and move its saved inputs to this tier",
    )
    ap.add_argument(
        "--overlap-step",
        action="store_true",
        help="zerotune: update each unit during backward (the optimizer's overlapped())",
    )
    ap.add_argument(
        "--compare-carry",
        action="store_true",
        help="with --overlap-step: also run zerotune with overlapped(carry=False)",
    )
    ap.add_argument(
        "--compare-master-copy",
        action="store_true",
        help="also run zerotune copying the fp32 master through staging (not in place)",
    )
    ap.add_argument(
        "--grad-host",
        type=_size,
        default=None,
        help="zerotune's grad_host_bytes (its default if not given)",
    )
    ap.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        help="clip the global gradient norm to this (both sides; 0: no clipping)",
    )
    ap.add_argument(
        "--compare-unclipped",
        action="store_true",
        help="with --max-grad-norm: also run zerotune's overlapped step without clipping",
    )
    ap.add_argument(
        "--compare-sequential",
        action="store_true",
        help="also run zerotune without --overlap-step (the step after backward)",
    )
    ap.add_argument(
        "--squeeze-to",
        type=_size,
        default=None,
        help="zerotune runs while another process holds host memory so that only this much "
        "stays available (6GiB): the page cache cannot keep the swap files",
    )
    ap.add_argument(
        "--compare-unsqueezed",
        action="store_true",
        help="with --squeeze-to: also run zerotune with all host memory available",
    )
    ap.add_argument(
        "--compare-read-params",
        action="store_true",
        help="with --offload nvme: also run zerotune reading the parameter file into buffers "
        "(map_param_file: false) instead of mapping it",
    )
    ap.add_argument(
        "--compare-flat-grads",
        action="store_true",
        help="also run zerotune copying world size 1's gradients into flat shards instead "
        "of leaving them in the parameters",
    )
    ap.add_argument(
        "--compare-host-cache",
        metavar="BYTES",
        type=_size,
        default=None,
        help="also run zerotune with this host_cache_bytes budget (1280MiB) instead of the "
        "default: freed tensors kept for reuse, page faults against peak RSS",
    )
    ap.add_argument(
        "--io-floor",
        action="store_true",
        help="with --offload nvme: measure the disk's O_DIRECT write and read rates in this "
        "invocation and report each step against the time its device bytes need at them",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: plain compiles the model (as the Trainer's --torch_compile does), "
        "zerotune its units (engine.compile()); the warmup steps hold the compilation",
    )
    ap.add_argument(
        "--compare-eager",
        action="store_true",
        help="with --compile: also run zerotune without it",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--no-baseline", action="store_true", help="skip plain PyTorch")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run all variants this many times in turn; report the median round",
    )
    ap.add_argument(
        "--variant",
        choices=[
            "plain",
            "zerotune",
            "zerotune-fp32-states",
            "zerotune-kept-checkpoints",
            "zerotune-no-carry",
            "zerotune-master-copied",
            "zerotune-unclipped",
            "zerotune-sequential",
            "zerotune-unsqueezed",
            "zerotune-read-params",
            "zerotune-flat-grads",
            "zerotune-host-cache",
            "zerotune-eager",
        ],
        help=argparse.SUPPRESS,
    )
    return ap.parse_args()


def run_variant(args: argparse.Namespace) -> dict:
    """One variant in this process; returns median phase times and peak RSS."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from zerotune.hf import model_config

    squeezer = None
    if args.squeeze_to is not None and args.variant not in ("plain", "zerotune-unsqueezed"):
        squeezer = squeeze_host_memory(args.squeeze_to)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or os.cpu_count())
    config = model_config(args.model)
    if args.compile:
        config.use_cache = False  # as the Trainer sets it: a KV cache keeps the blocks eager
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    checkpointed = args.offload_activations != "none"
    if args.variant == "plain":
        model = AutoModelForCausalLM.from_config(config)
        model.to(dtype)
        if args.optim in GENERIC:
            name, kwargs = GENERIC[args.optim]
            opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        runner = torch.compile(model) if args.compile else model
    else:
        import zerotune

        zcfg = {"stage": args.stage, "dtype": args.dtype}
        if args.offload != "none":
            zcfg.update(offload_param=args.offload, offload_optimizer=args.offload)
        if args.optim == "adamw_8bit" and args.variant != "zerotune-fp32-states":
            zcfg["optim_state_bits"] = 8
        if checkpointed and args.variant != "zerotune-kept-checkpoints":
            zcfg["offload_activations"] = args.offload_activations
        if "nvme" in (args.offload, zcfg.get("offload_activations")):
            zcfg.update(nvme_path=args.nvme_path)
            if args.staging is not None:
                zcfg.update(staging_bytes=args.staging)
        if args.grad_host is not None:
            zcfg.update(grad_host_bytes=args.grad_host)
        if args.variant == "zerotune-read-params":
            zcfg.update(map_param_file=False)
        if args.variant == "zerotune-host-cache":
            zcfg.update(host_cache_bytes=args.compare_host_cache)
        # zero-init: the model is never whole in this process (it could not be, offloaded)
        runner = zerotune.zero_init(config, zcfg)
        model = runner.module
        if checkpointed:
            model.gradient_checkpointing_enable()
            model.train()
        if args.optim in GENERIC:
            name, kwargs = GENERIC[args.optim]
            opt = zerotune.ZeroOptimizer(runner, getattr(torch.optim, name), **kwargs)
        else:
            opt = zerotune.ZeroAdamW(runner, lr=1e-5)
        if args.variant == "zerotune-flat-grads":
            for unit in runner.units:  # [Note: gradients left in the parameters] off
                unit.grads.in_params = False
        if args.variant == "zerotune-master-copied":
            opt.store.in_place = False  # [Note: the master updated in the page cache]
        if args.compile and args.variant != "zerotune-eager":
            runner.compile()  # [Note: compiled units]
    # --compare-unclipped: the same overlapped step without clipping; --compare-sequential:
    # the same clipping without overlap (the step after backward).
    clip = 0.0 if args.variant == "zerotune-unclipped" else args.max_grad_norm
    overlap = (
        args.overlap_step and args.variant not in ("plain", "zerotune-sequential")
    ) or args.variant == "zerotune-unclipped"
    io = psutil.Process().io_counters
    device = busy = None
    if args.nvme_path:
        from nvme_io import block_device_stat, device_busy_ms, device_sectors

        stat = block_device_stat(Path(args.nvme_path))
        device = lambda: device_sectors(stat)  # noqa: E731
        busy = lambda: device_busy_ms(stat) / 1e3  # noqa: E731
    dev_read, dev_written = [], []
    cached0 = page_cache_bytes()
    cached_peak = 0
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    times = {"forward": [], "backward": [], "optimizer": [], "total": [], "cpu": [], "faults": []}
    # Share of each phase the disk under --nvme-path had I/O in flight.
    disk_busy: dict[str, list[float]] = {"forward": [], "backward": []}
    losses, read, written = [], [], []
    for step in range(args.warmup + args.steps):
        before = io()
        dev0 = device() if device else (0, 0)
        c0 = time.process_time()  # CPU time of every thread (aio's too): steal does not count
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b0 = busy() if busy else 0.0
        t0 = time.perf_counter()
        loss = runner(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        b1 = busy() if busy else 0.0
        if overlap:
            carry = args.variant != "zerotune-no-carry"
            with opt.overlapped(carry=carry, clipping=clip > 0):
                loss.backward()
        else:
            loss.backward()
        t2 = time.perf_counter()
        b2 = busy() if busy else 0.0
        if clip > 0 and args.variant == "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elif clip > 0:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        c3 = time.process_time()
        f3 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        after = io()
        dev1 = device() if device else (0, 0)
        cached_peak = max(cached_peak, page_cache_bytes() - cached0)
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0, f3 - f0)):
                times[k].append(v)
            disk_busy["forward"].append((b1 - b0) / (t1 - t0))
            disk_busy["backward"].append((b2 - b1) / (t2 - t1))
            read.append(after.read_bytes - before.read_bytes)
            written.append(after.write_bytes - before.write_bytes)
            # The block device's own count: also the writeback of mapped pages, which the
            # kernel's flusher threads do (not this process's io counters).
            dev_read.append((dev1[0] - dev0[0]) * 512)
            dev_written.append((dev1[1] - dev0[1]) * 512)
    result = {k: statistics.median(v) for k, v in times.items()}
    if busy:
        result["disk_busy"] = {k: statistics.median(v) for k, v in disk_busy.items()}
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["losses"] = losses
    result["read_bytes_per_step"] = statistics.median(read)
    result["written_bytes_per_step"] = statistics.median(written)
    result["device_read_bytes_per_step"] = statistics.median(dev_read)
    result["device_written_bytes_per_step"] = statistics.median(dev_written)
    # The machine's page cache grew by this much while the variant ran (swap files written
    # with buffered I/O stay there until the kernel needs the room: not process RSS, but
    # RAM in use while there is RAM to spare).
    result["page_cache_growth_gib"] = cached_peak / 2**30
    if args.variant != "plain":
        result["master_in_place"] = bool(getattr(getattr(opt, "store", None), "in_place", False))
        result["offload_optimizer"] = runner.config.offload_optimizer
        result["optimizer_layout"] = getattr(opt, "layout", None)
        result["memory_report"] = runner.memory_report()
        if runner.swap is not None:
            files = runner.swap.files
            result["buffered_swap_gib"] = (
                sum(f.size for f in files.values() if not f.direct) / 2**30
            )
        runner.close()
    if squeezer is not None:
        result["available_gib_squeezed"] = squeezer.available_gib
        squeezer.release()
    return result


SQUEEZER = r"""
import sys
import numpy as np

def available():
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))

target, held = int(sys.argv[1]), []
while available() > target + 2**28:
    held.append(np.ones(min(2**30, available() - target), dtype=np.uint8))  # touched pages
print(available(), flush=True)
sys.stdin.read()
"""


class Squeezer:
    """A process holding host memory (touched pages: with no swap the kernel can only give
    up page cache) until ``release``."""

    def __init__(self, target: int) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-c", SQUEEZER, str(target)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.available_gib = int(self.proc.stdout.readline()) / 2**30

    def release(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def disk_rates(folder: str, size: int = 2 << 30, rounds: int = 2) -> tuple[float, float]:
    """The disk's O_DIRECT sequential write and read rates under ``folder`` in GB/s (median
    of ``rounds``), through zerotune's swap files as benchmarks/nvme_io.py measures them."""
    import tempfile

    from nvme_io import Zerotune, drop_page_cache

    ns = argparse.Namespace(size=size, threads=16, block=1 << 20, depth=16, buffer=1 << 30)
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        f = Zerotune(Path(tmp) / "rate.swap", ns)
        try:
            for _ in range(rounds):
                writes.append(f.size / f.write() / 1e9)
                drop_page_cache()
                reads.append(f.size / f.read() / 1e9)
        finally:
            f.close()
    return statistics.median(writes), statistics.median(reads)


def io_floor_s(result: dict, rates: tuple[float, float]) -> float:
    """Seconds the variant's device bytes of a step need at the disk's write and read rates,
    one after the other."""
    write_gbps, read_gbps = rates
    return result["device_written_bytes_per_step"] / (write_gbps * 1e9) + result[
        "device_read_bytes_per_step"
    ] / (read_gbps * 1e9)


def squeeze_host_memory(target: int) -> Squeezer:
    squeezer = Squeezer(target)
    print(f"host memory squeezed: {squeezer.available_gib:.2f} GiB available", file=sys.stderr)
    return squeezer


def median_round(rounds: list[dict[str, dict]], order: list[str]) -> dict[str, dict]:
    """Per variant (in ``order``), the result of its round with the median step time (the
    lower middle one of an even count), its peak RSS replaced by the largest of all
    rounds."""
    out = {}
    for name in order:
        runs = sorted((r[name] for r in rounds), key=lambda r: r["total"])
        out[name] = dict(runs[(len(runs) - 1) // 2])
        out[name]["peak_rss_gib"] = max(r["peak_rss_gib"] for r in runs)
    return out


def main() -> None:
    args = parse()
    if answer_as_variant(args, run_variant):
        return
    if "nvme" in (args.offload, args.offload_activations) and not args.nvme_path:
        sys.exit("--offload nvme / --offload-activations nvme need --nvme-path (a local folder)")
    variants = [] if args.no_baseline else ["plain"]
    if args.optim == "adamw_8bit":
        variants.append("zerotune-fp32-states")
    if args.offload_activations != "none":
        variants.append("zerotune-kept-checkpoints")
    if args.compare_carry:
        if not args.overlap_step:
            sys.exit("--compare-carry needs --overlap-step")
        variants.append("zerotune-no-carry")
    if args.compare_master_copy:
        variants.append("zerotune-master-copied")
    if args.compare_unclipped:
        if not args.max_grad_norm > 0:
            sys.exit("--compare-unclipped needs --max-grad-norm")
        variants.append("zerotune-unclipped")
    if args.compare_sequential:
        if not args.overlap_step:
            sys.exit("--compare-sequential needs --overlap-step")
        variants.append("zerotune-sequential")
    if args.compare_unsqueezed:
        if args.squeeze_to is None:
            sys.exit("--compare-unsqueezed needs --squeeze-to")
        variants.append("zerotune-unsqueezed")
    if args.io_floor and args.offload != "nvme":
        sys.exit("--io-floor needs --offload nvme")
    if args.compare_flat_grads:
        variants.append("zerotune-flat-grads")
    if args.compare_read_params:
        if args.offload != "nvme":
            sys.exit("--compare-read-params needs --offload nvme")
        variants.append("zerotune-read-params")
    if args.compare_eager:
        if not args.compile:
            sys.exit("--compare-eager needs --compile")
        variants.append("zerotune-eager")
    if args.compare_host_cache is not None:
        if args.offload == "none":
            sys.exit("--compare-host-cache needs --offload cpu or nvme (the cache serves offload)")
        variants.append("zerotune-host-cache")
    variants.append("zerotune")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    if args.optim in GENERIC and args.compare_master_copy:
        sys.exit("--compare-master-copy is ZeroAdamW's")
    # Each round starts one variant later: a variant's place in the round (after which
    # others, how long into the run) would otherwise count in its time.
    n = len(variants)
    rounds = [
        run_variants(__file__, variants[r % n :] + variants[: r % n]) for r in range(args.rounds)
    ]
    results = median_round(rounds, variants)
    rates = disk_rates(args.nvme_path) if args.io_floor else None

    print(
        f"model {args.model}, seq {args.seq}, batch {args.batch}, {args.dtype}, "
        f"stage {args.stage}, optim {args.optim}{' overlapped' if args.overlap_step else ''}, "
        f"offload {args.offload}, activations "
        f"{args.offload_activations}, median of {args.steps} steps after {args.warmup} "
        f"warm-up, {args.threads or os.cpu_count()} threads"
        + (f", median of {args.rounds} rounds" if args.rounds > 1 else "")
    )
    header = ("forward s", 11), ("backward s", 12), ("optim s", 10), ("total s", 10)
    print(
        f"{'variant':<26}"
        + "".join(f"{h:>{w}}" for h, w in header)
        + f"{'peak RSS GiB':>14}{'disk GB/step':>14}"
    )
    for name, r in results.items():
        disk = (r["read_bytes_per_step"] + r["written_bytes_per_step"]) / 1e9
        print(
            f"{name:<26}{r['forward']:>11.3f}{r['backward']:>12.3f}{r['optimizer']:>10.3f}"
            f"{r['total']:>10.3f}{r['peak_rss_gib']:>14.2f}{disk:>14.2f}"
        )
    zt = results["zerotune"]
    gb = 1e9
    moved = zt["read_bytes_per_step"] + zt["written_bytes_per_step"]
    if args.offload == "nvme":
        print(
            f"zerotune disk traffic per step: read {zt['read_bytes_per_step'] / gb:.2f} GB, "
            f"written {zt['written_bytes_per_step'] / gb:.2f} GB, "
            f"{moved / gb / zt['total']:.2f} GB/s averaged over the step"
        )
        print(
            f"zerotune buffered swap files (parameters, gradients) {zt['buffered_swap_gib']:.2f}"
            f" GiB; page cache grew by {zt['page_cache_growth_gib']:.2f} GiB at most"
        )
    if rates is not None:
        floor = io_floor_s(zt, rates)
        print(
            f"disk (O_DIRECT, this invocation): write {rates[0]:.2f} GB/s, read "
            f"{rates[1]:.2f} GB/s; zerotune's device bytes per step (read "
            f"{zt['device_read_bytes_per_step'] / gb:.2f} GB, written "
            f"{zt['device_written_bytes_per_step'] / gb:.2f} GB) need {floor:.2f} s at those "
            f"rates: the step is {zt['total'] / floor:.2f}x that floor"
        )
    report = zt.get("memory_report", {})
    mib = {k: round(v / 2**20) for k, v in report.items() if isinstance(v, int) and v >= 2**20}
    print(f"zerotune memory report at the end (MiB): {mib}")
    summary = {
        "model": args.model,
        "stage": args.stage,
        "dtype": args.dtype,
        "offload": args.offload,
        "optim": args.optim,
        "overlap_step": args.overlap_step,
        "max_grad_norm": args.max_grad_norm,
        "step_time_s": round(zt["total"], 4),
        "peak_rss_gib": round(zt["peak_rss_gib"], 3),
        "read_gb_per_step": round(zt["read_bytes_per_step"] / gb, 3),
        "written_gb_per_step": round(zt["written_bytes_per_step"] / gb, 3),
        "io_gbps": round(moved / gb / zt["total"], 3),
        "page_cache_growth_gib": round(zt["page_cache_growth_gib"], 3),
        "master_in_place": zt.get("master_in_place"),
        "offload_optimizer": zt.get("offload_optimizer"),
        "optimizer_layout": zt.get("optimizer_layout"),
    }
    if "buffered_swap_gib" in zt:
        summary["buffered_swap_gib"] = round(zt["buffered_swap_gib"], 3)
    for name, r in results.items():
        if "disk_busy" in r and name != "plain":
            tag = "" if name == "zerotune" else f"{name}_"
            for phase, share in r["disk_busy"].items():
                summary[f"{tag}disk_busy_{phase}"] = round(share, 3)
    if rates is not None:
        summary["disk_write_gbps"], summary["disk_read_gbps"] = (round(x, 3) for x in rates)
        summary["device_read_gb_per_step"] = round(zt["device_read_bytes_per_step"] / gb, 3)
        summary["device_written_gb_per_step"] = round(zt["device_written_bytes_per_step"] / gb, 3)
        summary["io_floor_s"] = round(io_floor_s(zt, rates), 4)
        summary["step_vs_io_floor"] = round(zt["total"] / io_floor_s(zt, rates), 4)
        for name, r in results.items():
            if name.startswith("zerotune-"):
                summary[f"{name}_step_vs_io_floor"] = round(r["total"] / io_floor_s(r, rates), 4)
                summary[f"{name}_device_read_written_gb_per_step"] = [
                    round(r["device_read_bytes_per_step"] / gb, 3),
                    round(r["device_written_bytes_per_step"] / gb, 3),
                ]
    for other, key in (
        ("zerotune-fp32-states", "nvme_bytes_ratio"),
        ("zerotune-kept-checkpoints", "moved_bytes_ratio"),
        ("zerotune-no-carry", "moved_bytes_ratio_vs_no_carry"),
        ("zerotune-master-copied", "moved_bytes_ratio_vs_master_copied"),
        ("zerotune-unclipped", "moved_bytes_ratio_vs_unclipped"),
        ("zerotune-sequential", "moved_bytes_ratio_vs_sequential"),
        ("zerotune-unsqueezed", "moved_bytes_ratio_vs_unsqueezed"),
        ("zerotune-read-params", "moved_bytes_ratio_vs_read_params"),
        ("zerotune-flat-grads", "moved_bytes_ratio_vs_flat_grads"),
        ("zerotune-host-cache", "moved_bytes_ratio_vs_host_cache"),
        ("zerotune-eager", "moved_bytes_ratio_vs_eager"),
    ):
        if other in results:
            o = results[other]
            o_moved = o["read_bytes_per_step"] + o["written_bytes_per_step"]
            summary[key] = round(moved / o_moved, 4) if o_moved else None
            summary[f"step_time_ratio_vs_{other}"] = round(zt["total"] / o["total"], 4)
            summary[f"peak_rss_ratio_vs_{other}"] = round(zt["peak_rss_gib"] / o["peak_rss_gib"], 4)
            summary[f"{other}_step_time_s"] = round(o["total"], 4)
            summary[f"{other}_peak_rss_gib"] = round(o["peak_rss_gib"], 3)
            summary[f"{other}_disk_gb_per_step"] = round(o_moved / gb, 3)
            summary[f"{other}_losses"] = [round(x, 4) for x in o["losses"]]
            summary[f"{other}_minflt_per_step"] = round(o["faults"])
            if len(rounds) > 1:  # each round's own ratio (the line above: the median rounds')
                summary[f"step_time_ratio_vs_{other}_rounds"] = [
                    round(r["zerotune"]["total"] / r[other]["total"], 4) for r in rounds
                ]
    summary["losses"] = [round(x, 4) for x in zt["losses"]]
    summary["minflt_per_step"] = round(zt["faults"])
    summary["cpu_s"] = round(zt["cpu"], 4)  # CPU seconds a step, every thread
    for name, r in results.items():
        if name.startswith("zerotune-"):
            summary[f"{name}_cpu_s"] = round(r["cpu"], 4)
    if "available_gib_squeezed" in zt:
        summary["available_gib_squeezed"] = round(zt["available_gib_squeezed"], 2)
    for key in ("checkpoints_device_peak", "checkpoints_offloaded_peak"):
        if key in zt.get("memory_report", {}):
            summary[key] = zt["memory_report"][key]
    if len(rounds) > 1:
        summary["rounds"] = len(rounds)
        for name in variants:
            tag = "" if name == "zerotune" else f"{name}_"
            summary[f"{tag}step_time_s_rounds"] = [round(r[name]["total"], 4) for r in rounds]
    if "plain" in results:
        plain = results["plain"]
        ratios = [r["zerotune"]["total"] / r["plain"]["total"] for r in rounds]
        summary["step_time_ratio"] = round(statistics.median(ratios), 4)
        if len(rounds) > 1:
            summary["step_time_ratio_rounds"] = [round(x, 4) for x in ratios]
        summary["peak_rss_ratio"] = round(zt["peak_rss_gib"] / plain["peak_rss_gib"], 4)
        # CPU seconds a step, all threads: less moved by other tenants than wall time.
        summary["cpu_time_ratio"] = round(zt["cpu"] / plain["cpu"], 4)
        summary["plain_cpu_s"] = round(plain["cpu"], 4)
        summary["plain_step_time_s"] = round(plain["total"], 4)
        summary["plain_peak_rss_gib"] = round(plain["peak_rss_gib"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
