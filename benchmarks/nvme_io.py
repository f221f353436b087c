"""Swap-file throughput: zerotune's aio against fio (O_DIRECT) and DeepSpeed's aio, in one run.

Run: ``python benchmarks/nvme_io.py --dir PATH [--size 4GiB] [--block 1MiB] [--depth 16]``

Each contender writes a file of ``--size`` sequentially, then reads it back, ``--rounds``
times; the table shows the median GB/s (1 GB = 1e9 bytes) and every round. Contenders take
turns inside a round (the order alternates between rounds) so that slow drifts of the disk
hit all of them alike; the page cache is dropped before each phase when this process may
(root), though O_DIRECT does not use it anyway.

- zerotune:   ``SwapFile`` (threads = ``--threads``, default ``--depth``, so that ``--depth``
  blocks are in flight), the whole file as requests of ``--buffer`` bytes, all submitted at
  once, from one aligned buffer; the read is checked against what was written.
- fio:        ``--direct=1 --bs=BLOCK --iodepth=DEPTH`` with libaio, else io_uring, else psync
  with DEPTH jobs; only when ``fio`` is installed.
- DeepSpeed:  ``AsyncIOBuilder().load().aio_handle(...)`` with the same block, depth and
  threads, whole-file ``sync_pwrite``/``sync_pread``; only when deepspeed is importable.

"disk/asked" is the least, over the rounds, of the bytes the block device under ``--dir``
moved per byte asked for (write/read), from /sys/dev/block: about 1.00 shows that the data
really went to and came from the disk rather than a cache.

The files are deleted at the end. The last line is one JSON object with ``write_gbps``,
``read_gbps``, ``write_vs_fio``, ``read_vs_fio`` (null without fio) and the details.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerotune.memory.aio import ALIGN, SwapFile, aligned_empty, backend


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512MiB", "1M" (fio's convention: powers of 1024) or "4GB" (1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?b?|b))?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1048576)")
    number, prefix, suffix = m.group(1), (m.group(2) or "").lower(), (m.group(3) or "").lower()
    base = 1000 if suffix == "b" else 1024
    return int(float(number) * base ** ("kmgt".index(prefix) + 1 if prefix else 0))


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def block_device_stat(folder: Path) -> Path | None:
    """The sysfs ``stat`` file of the block device holding ``folder`` (None on tmpfs etc.)."""
    st = os.stat(folder)
    path = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return path if path.exists() else None


def device_busy_ms(stat: Path | None) -> int:
    """Milliseconds the device has spent with I/O in flight so far (0 when unknown)."""
    return int(stat.read_text().split()[9]) if stat is not None else 0


def device_sectors(stat: Path | None) -> tuple[int, int]:
    """512-byte sectors read and written so far by the device (0, 0 when unknown)."""
    if stat is None:
        return 0, 0
    fields = stat.read_text().split()
    return int(fields[2]), int(fields[6])


# ---------------------------------------------------------------------------------------------
# Contenders: each is (write(), read()) returning seconds.


class Zerotune:
    name = "zerotune"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.file = SwapFile(
            path,
            args.size,
            threads=args.threads,
            block_bytes=args.block,
            queue_depth=args.depth,
        )
        self.size = self.file.size
        self.chunk = min(args.buffer, self.size)
        self.buf = aligned_empty(self.chunk, torch.uint8)
        self.buf.copy_(torch.randint(0, 256, (self.chunk,), dtype=torch.uint8))
        self.checksum = self._checksum()
        self.note = f"{backend()}, {self.file.mode}, threads={args.threads}"

    def _checksum(self) -> int:
        return int(self.buf.view(torch.int32).sum(dtype=torch.int64))

    def _run(self, write: bool) -> float:
        submit = self.file.write if write else self.file.read
        start = time.perf_counter()
        handles = []
        for off in range(0, self.size, self.chunk):
            n = min(self.chunk, self.size - off)
            handles.append(submit(self.buf[:n], off))
        for h in handles:
            h.wait()
        return time.perf_counter() - start

    def write(self) -> float:
        return self._run(True)

    def read(self) -> float:
        self.buf.zero_()
        seconds = self._run(False)
        if self._checksum() != self.checksum:
            raise RuntimeError("zerotune read back different data than it wrote")
        return seconds

    def close(self) -> None:
        self.file.close()


class Fio:
    name = "fio"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        engines = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
        available = {line.strip() for line in engines.splitlines()}
        self.engine = next((e for e in ("libaio", "io_uring") if e in available), "psync")
        size, jobs = args.size, []
        if self.engine == "psync":  # no async engine: one job per queue slot instead
            size = args.size // args.depth // args.block * args.block
            jobs = [f"--numjobs={args.depth}", f"--offset_increment={size}", "--group_reporting"]
        else:
            jobs = [f"--iodepth={args.depth}"]
        self.command = [
            "fio",
            "--name=zerotune-bench",
            f"--filename={path}",
            f"--size={size}",
            f"--bs={args.block}",
            "--direct=1",
            f"--ioengine={self.engine}",
            "--output-format=json",
            *jobs,
        ]
        self.size = args.size
        self.note = f"{self.engine}, O_DIRECT, iodepth={args.depth}"

    def _run(self, rw: str) -> float:
        proc = subprocess.run([*self.command, f"--rw={rw}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed: {proc.stderr.strip() or proc.stdout.strip()}")
        report = json.loads(proc.stdout[proc.stdout.index("{") :])
        job = report["jobs"][0]["read" if rw == "read" else "write"]
        return job["io_bytes"] / job["bw_bytes"]  # seconds, as fio measured them

    def write(self) -> float:
        return self._run("write")

    def read(self) -> float:
        return self._run("read")

    def close(self) -> None:
        pass


class DeepSpeed:
    name = "deepspeed aio"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.path = str(path)
        self.handle = (
            AsyncIOBuilder().load().aio_handle(args.block, args.depth, False, True, args.threads)
        )
        self.size = args.size
        self.buf = self.handle.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
        self.buf.random_(0, 256)
        self.note = f"locked buffer, threads={args.threads}"

    def write(self) -> float:
        start = time.perf_counter()
        self.handle.sync_pwrite(self.buf, self.path)
        return time.perf_counter() - start

    def read(self) -> float:
        start = time.perf_counter()
        self.handle.sync_pread(self.buf, self.path)
        return time.perf_counter() - start

    def close(self) -> None:
        self.handle.free_cpu_locked_tensor(self.buf)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, type=Path, help="folder on the disk to measure")
    p.add_argument("--size", type=parse_size, default=4 << 30, help="file size (4GiB)")
    p.add_argument("--block", type=parse_size, default=1 << 20, help="I/O block size (1MiB)")
    p.add_argument("--depth", type=int, default=16, help="blocks in flight (16)")
    p.add_argument("--threads", type=int, default=None, help="zerotune/DeepSpeed threads")
    p.add_argument("--buffer", type=parse_size, default=1 << 30, help="zerotune request size")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.threads = args.threads or args.depth
    if args.size % ALIGN or args.block % ALIGN or args.buffer % ALIGN:
        p.error(f"--size, --block and --buffer must be multiples of {ALIGN}")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a folder")

    free = shutil.disk_usage(args.dir).free
    work = Path(tempfile.mkdtemp(prefix="zerotune-nvme-io-", dir=args.dir))
    contenders: list = []
    missing: dict[str, str] = {}
    try:
        makers: list[tuple[str, Callable]] = [("zerotune", Zerotune)]
        if shutil.which("fio"):
            makers.append(("fio", Fio))
        else:
            missing["fio"] = "not installed (apt-get install fio)"
        try:
            import deepspeed  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any import failure means "skip it"
            missing["deepspeed aio"] = f"not importable ({type(err).__name__})"
        else:
            makers.append(("deepspeed", DeepSpeed))
        if free < args.size * len(makers) + (1 << 30):
            raise SystemExit(
                f"{args.dir} has {free / 2**30:.1f} GiB free; this run needs "
                f"{args.size * len(makers) / 2**30:.1f} GiB plus 1 GiB spare"
            )
        for tag, make in makers:
            try:
                contenders.append(make(work / f"{tag}.dat", args))
            except Exception as err:  # noqa: BLE001 - report it, measure the others
                missing[tag] = f"failed to start: {err}"

        dropped = True
        stat = block_device_stat(work)
        results: dict[str, dict[str, list[float]]] = {
            c.name: {"write": [], "read": []} for c in contenders
        }
        # Bytes the block device moved per byte asked for: ~1.0 shows the data really went
        # to the disk (not to a cache); other processes' I/O adds to it.
        device: dict[str, dict[str, list[float]]] = {
            c.name: {"write": [], "read": []} for c in contenders
        }
        for r in range(args.rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            for phase in ("write", "read"):
                for c in order:
                    dropped &= drop_page_cache()
                    before = device_sectors(stat)
                    try:
                        seconds = getattr(c, phase)()
                    except Exception as err:  # noqa: BLE001 - one contender failing is data
                        missing[c.name] = f"{phase} failed: {err}"
                        continue
                    moved = device_sectors(stat)[phase == "write"] - before[phase == "write"]
                    results[c.name][phase].append(c.size / seconds / 1e9)
                    device[c.name][phase].append(moved * 512 / c.size)
    finally:
        for c in contenders:
            c.close()
        shutil.rmtree(work, ignore_errors=True)

    def median(name: str, phase: str) -> float | None:
        runs = results.get(name, {}).get(phase)
        return statistics.median(runs) if runs else None

    print(
        f"sequential I/O on {args.dir}: {args.size / 2**30:g} GiB file, "
        f"{args.block / 2**20:g} MiB blocks, depth {args.depth}, {args.rounds} rounds, "
        f"page cache {'dropped before each phase' if dropped else 'NOT dropped (needs root)'}"
    )
    print(
        f"{'contender':<16}{'write GB/s':>12}{'read GB/s':>12}{'disk/asked':>12}"
        "  rounds (write | read); notes"
    )
    for c in contenders:
        w, rd = median(c.name, "write"), median(c.name, "read")
        rounds = " ".join(f"{x:.2f}" for x in results[c.name]["write"])
        rounds += " | " + " ".join(f"{x:.2f}" for x in results[c.name]["read"])
        moved = "-"
        if stat is not None and device[c.name]["write"] and device[c.name]["read"]:
            moved = f"{min(device[c.name]['write']):.2f}/{min(device[c.name]['read']):.2f}"
        print(f"{c.name:<16}{_fmt(w):>12}{_fmt(rd):>12}{moved:>12}  {rounds}; {c.note}")
    for name, why in missing.items():
        print(f"{name:<16}{'-':>12}{'-':>12}  {why}")

    zw, zr = median("zerotune", "write"), median("zerotune", "read")
    fw, fr = median("fio", "write"), median("fio", "read")
    zt = next(c for c in contenders if c.name == "zerotune") if contenders else None
    fio = next((c for c in contenders if c.name == "fio"), None)
    summary = {
        "write_gbps": _round(zw),
        "read_gbps": _round(zr),
        "write_vs_fio": _round(zw / fw) if zw and fw else None,
        "read_vs_fio": _round(zr / fr) if zr and fr else None,
        "fio_write_gbps": _round(fw),
        "fio_read_gbps": _round(fr),
        "fio_engine": fio.engine if fio else None,
        "deepspeed_write_gbps": _round(median("deepspeed aio", "write")),
        "deepspeed_read_gbps": _round(median("deepspeed aio", "read")),
        "backend": backend(),
        "mode": zt.file.mode if zt else None,
        "size_bytes": args.size,
        "block_bytes": args.block,
        "depth": args.depth,
        "threads": args.threads,
        "rounds": args.rounds,
        "page_cache_dropped": dropped,
        "missing": missing,
    }
    print(json.dumps(summary))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


if __name__ == "__main__":
    main()
