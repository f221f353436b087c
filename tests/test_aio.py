"""Swap-file I/O (zerotune.memory.aio): round trips, alignment rules, errors, the fallback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import Started

from zerotune.memory import aio
from zerotune.memory.aio import ALIGN, AioError, SwapFile, aligned_empty

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture(params=["cpp", "python"])
def impl(request, monkeypatch):
    """Run a test on the C++ op and on the Python fallback (forced by hiding the op)."""
    if request.param == "cpp":
        if aio.load_aio_op() is None:
            pytest.skip("the C++ aio op cannot be built here (its fallback is tested)")
    else:
        monkeypatch.setattr(aio, "load_aio_op", lambda: None)
    return request.param


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """An aligned tensor of random bits (every byte pattern, NaN payloads included)."""
    t = aligned_empty(numel, dtype)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * t.element_size(),), dtype=torch.uint8, generator=g)
    _bits(t).copy_(raw)
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _start_python(code: str, **env_over: str) -> Started:
    env = dict(os.environ)
    env.pop("ZEROTUNE_DISABLE_OPS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(env_over)
    return Started([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env)


def _report(child: Started) -> dict:
    proc = child.result(timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The child processes of the tests that need one (a resource limit, or the ops disabled
    at import), all started with the first of those tests. Yields their folder and them."""
    tmp = tmp_path_factory.mktemp("children")
    started = {
        **{
            f"fsize-{disable}": _start_python(
                FSIZE_CHILD.replace("sys.argv[1]", repr(str(tmp / f"swap-{disable}"))),
                ZEROTUNE_DISABLE_OPS=disable,
            )
            for disable in ("0", "1")
        },
        "disabled": _start_python(
            DISABLED_CHILD.replace("SWAP", repr(str(tmp / "disabled"))), ZEROTUNE_DISABLE_OPS="1"
        ),
    }
    yield tmp, started
    for child in started.values():
        child.stop()


# ---------------------------------------------------------------------------------------------
# Buffers


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]
)
@pytest.mark.parametrize("numel", [0, 1, 7, 1024, 1025, 300_001])
def test_aligned_empty(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
    assert t.data_ptr() % ALIGN == 0
    nbytes = numel * t.element_size()
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert room >= max(-(-nbytes // ALIGN) * ALIGN, ALIGN)


# ---------------------------------------------------------------------------------------------
# Round trips


CASES = [  # dtype, numel: aligned and unaligned byte counts, one and many blocks
    (torch.float32, 1024),
    (torch.float32, 3 * 4096 + 5),
    (torch.bfloat16, 2048),
    (torch.bfloat16, 70_001),
    (torch.float16, 1),
    (torch.int8, 4095),
    (torch.int64, 20_000),
    (torch.float64, 33_333),
    (torch.bool, 4097),
    (torch.complex64, 1000),
]


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_dtypes_sizes_offsets(tmp_path, impl, direct):
    block = 16 * 1024  # small blocks: most requests are cut into several
    with SwapFile(tmp_path / "swap", 8 * MiB, block_bytes=block, threads=3) as f:
        assert f.size == 8 * MiB and f.path == tmp_path / "swap"
        if impl == "python":
            assert not f.direct
        offset = 0
        written = []
        for i, (dtype, numel) in enumerate(CASES):
            t = _random(numel, dtype, seed=i)
            f.write(t, offset).wait()
            written.append((t, offset))
            offset += -(-numel * t.element_size() // ALIGN) * ALIGN + ALIGN * (i % 3)
        # Read back in a different order, into fresh buffers.
        for t, off in reversed(written):
            out = aligned_empty(t.numel(), t.dtype)
            _bits(out).fill_(0xAB)
            f.read(out, off).wait()
            assert torch.equal(_bits(out), _bits(t)), (t.dtype, t.numel(), off)


def test_many_requests_in_flight(tmp_path, impl):
    n, numel = 48, 50_000  # 200 000 bytes each: not a multiple of 4096
    stride = -(-numel * 4 // ALIGN) * ALIGN
    with SwapFile(tmp_path / "swap", n * stride, block_bytes=ALIGN * 8, queue_depth=6) as f:
        src = [_random(numel, torch.float32, seed=i) for i in range(n)]
        writes = [f.write(t, i * stride) for i, t in enumerate(src)]
        for h in writes:
            h.wait()
            assert h.done()
        dst = [aligned_empty(numel, torch.float32) for _ in range(n)]
        reads = [f.read(t, i * stride) for i, t in reversed(list(enumerate(dst)))]
        for h in reads:
            h.wait()
        for a, b in zip(src, dst):
            assert torch.equal(_bits(a), _bits(b))


def test_waits_from_several_threads(tmp_path, impl):
    with SwapFile(tmp_path / "swap", 16 * MiB, threads=4) as f:
        src = [_random(MiB // 4, torch.float32, seed=i) for i in range(4)]
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                f.write(src[i], i * 4 * MiB).wait()
                out = aligned_empty(MiB // 4, torch.float32)
                f.read(out, i * 4 * MiB).wait()
                assert torch.equal(_bits(out), _bits(src[i]))
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_wait_releases_the_gil(tmp_path, impl):
    """While one thread waits, another keeps running Python code: no gap as long as the wait."""
    with SwapFile(tmp_path / "swap", 256 * MiB, threads=2) as f:
        t = aligned_empty(256 * MiB, torch.uint8).fill_(1)
        finished, span = threading.Event(), []

        def waiter() -> None:
            h = f.write(t, 0)
            start = time.perf_counter()
            h.wait()
            span.extend([start, time.perf_counter()])
            finished.set()

        ticks = [time.perf_counter()]
        thread = threading.Thread(target=waiter)
        thread.start()
        while not finished.is_set():
            ticks.append(time.perf_counter())
        ticks.append(time.perf_counter())
        thread.join()
    start, end = span
    if end - start < 0.05:
        pytest.skip(f"the write took {(end - start) * 1e3:.0f} ms: too fast to tell")
    # Gaps between this thread's ticks that overlap the wait: holding the GIL would make one
    # of them as long as the wait itself.
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b >= start and a <= end]
    assert max(gaps) < (end - start) / 2, (max(gaps), end - start)


def _urgent_round(
    f: SwapFile, value: int, urgent_bytes: int
) -> tuple[dict[str, torch.Tensor], bool]:
    """One round of test_urgent_requests_go_ahead_of_queued_ones on a one-worker file: what
    each read saw, and whether the first (long) write was still running when the last
    request went in (else the order cannot be told from the bytes)."""
    plain_at, urgent_at = 64 * MiB, 128 * MiB
    # Every buffer is filled before the first request: the requests go in back to back.
    big = aligned_empty(64 * MiB, torch.uint8).fill_(7)
    page = aligned_empty(ALIGN, torch.uint8).fill_(value)
    # Many urgent blocks: a worker that did not count them off would misplace the next round's
    urgent = aligned_empty(urgent_bytes, torch.uint8).fill_(value + 1)
    seen = {name: aligned_empty(ALIGN, torch.uint8) for name in ("plain", "early", "urgent")}
    handles = [f.write(big, 0)]  # 64 blocks: the one worker is busy for a while
    handles.append(f.write(page, plain_at))
    handles.append(f.read(seen["plain"], plain_at))  # behind the write: sees it
    handles.append(f.write(urgent, urgent_at, urgent=True))
    last_page = urgent_at + urgent_bytes - ALIGN
    handles.append(f.read(seen["urgent"], last_page, urgent=True))  # behind that write
    handles.append(f.read(seen["early"], plain_at, urgent=True))  # ahead of the plain write
    busy = not handles[0].done()
    for h in handles:
        h.wait()
    return seen, busy


def test_urgent_requests_go_ahead_of_queued_ones(tmp_path, impl):
    """An urgent request is served before the queued requests that have not started, and
    after the urgent ones queued before it; a plain request keeps its place. Two rounds on
    one file: the second finds the queue as the first left it."""
    with SwapFile(tmp_path / "swap", 192 * MiB, threads=1, block_bytes=MiB, direct=False) as f:
        told = 0
        for attempt in range(6):
            value = 1 + 2 * (attempt % 2)  # 1, then 3: each round's bytes differ
            before = 0 if attempt == 0 else (1 + 2 * ((attempt - 1) % 2))
            # The Python fallback does an urgent transfer on the calling thread: a long one
            # would outlast the 64 MiB write it is meant to overtake.
            seen, busy = _urgent_round(f, value, 64 * MiB if impl == "cpp" else ALIGN)
            assert torch.equal(seen["plain"], torch.full_like(seen["plain"], value))
            assert torch.equal(seen["urgent"], torch.full_like(seen["urgent"], value + 1))
            if busy:  # the plain write had not started when the urgent read went in
                assert torch.equal(seen["early"], torch.full_like(seen["early"], before))
                told += 1
            if told == 2 and attempt >= 1:
                break
    if told == 0:
        pytest.skip("every 64 MiB write ended before the next requests went in: too fast")


def test_unaligned_length_touches_only_the_tensor(tmp_path, impl):
    """A read of an unaligned length fills the tensor's bytes and not one byte more."""
    with SwapFile(tmp_path / "swap", MiB) as f:
        src = _random(5000, torch.uint8, seed=1)
        f.write(src, ALIGN).wait()
        big = aligned_empty(3 * ALIGN, torch.uint8).fill_(0x5A)
        f.read(big[:5000], ALIGN).wait()
        assert torch.equal(big[:5000], src)
        assert bool((big[5000:] == 0x5A).all())


def test_dropped_handles_and_close_wait_for_io(tmp_path, impl):
    f = SwapFile(tmp_path / "swap", 32 * MiB)
    t = _random(8 * MiB, torch.uint8, seed=3)
    for i in range(4):
        f.write(t, i * 8 * MiB)  # handles dropped: the file keeps the tensor alive
    del t
    f.close()
    f.close()  # idempotent
    assert f.closed
    with pytest.raises(ValueError, match="closed swap file"):
        f.write(aligned_empty(1024, torch.uint8), 0)
    data = (tmp_path / "swap").read_bytes()
    assert data[: 8 * MiB] == data[8 * MiB : 16 * MiB] == data[24 * MiB :]


def test_empty_tensor(tmp_path, impl):
    with SwapFile(tmp_path / "swap", ALIGN) as f:
        h = f.write(aligned_empty(0, torch.float32), 0)
        assert h.done()
        h.wait()


# ---------------------------------------------------------------------------------------------
# Files: permissions, preallocation, O_DIRECT


def test_permissions_and_preallocation(tmp_path, impl):
    path = tmp_path / "swap"
    path.write_bytes(b"old contents")
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        with SwapFile(path, 3 * MiB + 1) as f:
            st = os.stat(path)
            assert st.st_mode & 0o777 == 0o600
            assert f.size == 3 * MiB + ALIGN == st.st_size
            assert st.st_blocks * 512 >= f.size  # really allocated, not sparse
    finally:
        os.umask(old_umask)
    assert path.exists()  # removing it is the caller's job


def test_missing_folder_names_the_path(tmp_path, impl):
    path = tmp_path / "no" / "such" / "swap"
    with pytest.raises(FileNotFoundError) as info:
        SwapFile(path, MiB)
    assert info.value.filename == str(path)


def test_direct_mode_reported(tmp_path):
    if aio.load_aio_op() is None:
        pytest.skip("the C++ aio op cannot be built here")
    with SwapFile(tmp_path / "swap", MiB, direct=False) as f:
        assert not f.direct and f.mode == "buffered"
    with SwapFile(tmp_path / "swap", MiB, direct=True) as f:
        flags = int(Path(f"/proc/self/fdinfo/{f._fd}").read_text().split("flags:")[1].split()[0], 8)
        assert f.direct == bool(flags & os.O_DIRECT)
        assert f.mode == ("O_DIRECT" if f.direct else "buffered")


def test_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    if aio.load_aio_op() is None:
        pytest.skip("the C++ aio op cannot be built here")
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(aio.os, "open", no_direct)
    with SwapFile(tmp_path / "swap", MiB) as f:
        assert not f.direct and f.mode == "buffered"
        t = _random(1000, torch.float32, seed=0)
        f.write(t, 0).wait()
        out = aligned_empty(1000, torch.float32)
        f.read(out, 0).wait()
        assert torch.equal(_bits(out), _bits(t))


# ---------------------------------------------------------------------------------------------
# Misuse


def test_misuse_raises_value_error(tmp_path, impl):
    with SwapFile(tmp_path / "swap", MiB) as f:
        t = aligned_empty(2048, torch.float32)
        with pytest.raises(ValueError, match="offsets must be non-negative multiples of 4096"):
            f.write(t, 100)
        with pytest.raises(ValueError, match="not 4096-aligned.*aligned_empty"):
            f.read(t[1:], 0)
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            f.write(t.view(2, 1024).t(), 0)
        with pytest.raises(TypeError):
            f.write(t, 4096.0)
        with pytest.raises(ValueError, match=rf"offset {MiB - ALIGN} is past the end of {f.path}"):
            f.read(t, MiB - ALIGN)  # 8192 bytes at MiB - 4096
        with pytest.raises(ValueError, match="block_bytes must be a multiple of 4096"):
            SwapFile(tmp_path / "other", MiB, block_bytes=5000)
        with pytest.raises(ValueError, match="threads must be >= 1"):
            SwapFile(tmp_path / "other", MiB, threads=0)


# ---------------------------------------------------------------------------------------------
# I/O errors


def test_truncated_file_read_names_file_and_offset(tmp_path, impl):
    path = tmp_path / "swap"
    with SwapFile(path, 4 * MiB, block_bytes=64 * 1024) as f:
        t = _random(MiB, torch.uint8, seed=0)
        f.write(t, MiB).wait()
        os.truncate(path, MiB + 200_000)  # a corrupt swap file: it ends inside the extent
        out = aligned_empty(MiB, torch.uint8)
        h = f.read(out, MiB)
        with pytest.raises(AioError) as info:
            h.wait()
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.EIO
        assert err.filename == str(path)
        assert MiB + 196_608 == err.offset  # the 64 KiB block that holds the end of the file
        assert "unexpected end of file" in str(err) and f"offset {err.offset}" in str(err)
        assert str(path) in str(err)
        with pytest.raises(AioError):
            h.wait()  # raised again
        assert h.done()


FSIZE_CHILD = """
    import json, resource, signal, sys, torch
    from zerotune.memory.aio import AioError, SwapFile, aligned_empty, backend
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, not a signal
    path, limit = sys.argv[1], 1 << 20
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    out = {"backend": backend()}
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # the soft limit only
    try:
        SwapFile(path + ".big", 4 << 20)
    except OSError as err:
        out["create"] = [err.errno, err.filename, str(err)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    f = SwapFile(path, 4 << 20, block_bytes=1 << 18)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    t = aligned_empty(1 << 20, torch.uint8).fill_(7)
    f.write(t, 0).wait()  # inside the limit: fine
    try:
        f.write(t, 1 << 21).wait()
    except AioError as err:
        out["write"] = [err.errno, err.filename, err.offset, str(err)]
    f.close()
    print(json.dumps(out))
"""


@pytest.mark.parametrize("disable_ops", ["0", "1"])
def test_file_size_limit_errors(children, disable_ops):
    """RLIMIT_FSIZE makes the disk refuse, as a full one would: at creation and in a worker."""
    tmp, started = children
    path = tmp / f"swap-{disable_ops}"
    rep = _report(started[f"fsize-{disable_ops}"])
    if disable_ops == "1":
        assert rep["backend"] == "python-threads"
    code, filename, text = rep["create"]
    assert code == errno.EFBIG and filename == f"{path}.big"
    assert "cannot preallocate" in text and f"{path}.big" in text
    assert not Path(f"{path}.big").exists()  # a failed creation leaves nothing behind
    code, filename, offset, text = rep["write"]
    assert code == errno.EFBIG and filename == str(path) and offset == 2 * MiB
    assert f"offset {2 * MiB}" in text and str(path) in text


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, if this process may mount one (root in a sandbox); skipped otherwise."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_file_size_limit_errors covers the path")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({proc.stderr.strip()}); RLIMIT_FSIZE test covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_filesystem_gives_a_clear_error(tiny_tmpfs, impl):
    path = tiny_tmpfs / f"swap-{uuid.uuid4().hex}"
    with pytest.raises(OSError) as info:
        SwapFile(path, 4 * MiB)
    err = info.value
    assert err.errno == errno.ENOSPC and err.filename == str(path)
    assert "disk is full" in str(err) and str(path) in str(err)
    assert not path.exists()
    with SwapFile(path, 256 * 1024) as f:  # what fits still works
        t = _random(256 * 1024, torch.uint8, seed=0)
        f.write(t, 0).wait()
        out = aligned_empty(t.numel(), torch.uint8)
        f.read(out, 0).wait()
        assert torch.equal(out, t)


# ---------------------------------------------------------------------------------------------
# The fallback, as a process without the C++ ops sees it


DISABLED_CHILD = """
        import json, logging, torch
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("zerotune").addHandler(Keep())
        logging.getLogger("zerotune").setLevel(logging.INFO)
        from zerotune.memory.aio import SwapFile, aligned_empty, backend
        equal = []
        for i in range(2):
            with SwapFile(SWAP, 1 << 20, block_bytes=8192) as f:
                t = aligned_empty(10_001, torch.float32).normal_()
                f.write(t, 4096).wait()
                out = aligned_empty(10_001, torch.float32)
                f.read(out, 4096).wait()
                equal.append(torch.equal(out.view(torch.int32), t.view(torch.int32)))
                direct = f.direct
        print(json.dumps({"backend": backend(), "equal": equal, "direct": direct,
                          "logs": [r for r in records if "Python threads" in r]}))
"""


def test_disabled_ops_use_the_python_fallback(children):
    rep = _report(children[1]["disabled"])
    assert rep["backend"] == "python-threads"
    assert rep["equal"] == [True, True] and rep["direct"] is False
    assert len(rep["logs"]) == 1, rep["logs"]  # logged once


def _resident_bytes(fd: int, offset: int, nbytes: int) -> int:
    """Bytes of the file's range that are in the page cache (``mincore`` on a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    view = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, offset=offset)
    try:
        pages = (ctypes.c_ubyte * (nbytes // mmap.PAGESIZE))()
        buf = (ctypes.c_char * nbytes).from_buffer(view)
        try:
            rc = libc.mincore(
                ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(nbytes), pages
            )
        finally:
            del buf
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(p & 1 for p in pages) * mmap.PAGESIZE
    finally:
        view.close()


def test_will_need_reads_the_whole_range_into_the_page_cache(tmp_path):
    """One readahead advice reads at most the device's window; ``will_need`` asks for a
    range of several windows one window at a time, so all of it comes into the page cache
    (and the pages of a mapped gather with it)."""
    folder = os.open(tmp_path, os.O_RDONLY)
    window = aio.readahead_bytes(folder)  # the device's, as for a file in the folder
    os.close(folder)
    assert window >= 128 << 10 and window % 4096 == 0
    nbytes = max(32 * MiB, 4 * window)
    with SwapFile(tmp_path / "f.swap", 2 * nbytes, direct=False) as f:
        fd = os.open(f.path, os.O_RDONLY)  # the same file's pages
        f.write(aligned_empty(2 * nbytes // 4, torch.float32).fill_(1), 0).wait()
        os.fsync(fd)

        def asked(call, settle: float = 10) -> int:
            os.posix_fadvise(fd, 0, 2 * nbytes, os.POSIX_FADV_DONTNEED)
            if _resident_bytes(fd, 0, 2 * nbytes) > nbytes // 8:
                pytest.skip("this filesystem keeps its pages (tmpfs?): nothing to read ahead")
            call()
            deadline = time.monotonic() + settle
            while _resident_bytes(fd, 0, 2 * nbytes) < nbytes and time.monotonic() < deadline:
                time.sleep(0.05)
            return _resident_bytes(fd, 0, 2 * nbytes)

        # One advice for the whole range: one window of it. The kernel may skip a few pages
        # of a range it was asked for (memory pressure from other work): 1% is allowed;
        # nothing past the range may come in.
        one = asked(lambda: os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_WILLNEED), 1)
        assert one < nbytes // 2
        assert 0.99 * nbytes <= asked(lambda: f.will_need(0, nbytes)) <= nbytes
        held = []
        assert 0.99 * nbytes <= asked(lambda: held.append(f.map(nbytes, nbytes))) <= nbytes
        assert torch.equal(held[0].view(torch.float32)[:4], torch.ones(4))
        held.clear()
        os.close(fd)


def test_will_need_is_advice_a_filesystem_may_refuse(tmp_path, monkeypatch):
    """A filesystem that refuses readahead advice: ``will_need`` and mapped gathers go on,
    the pages read on use; misuse still raises."""

    def refuse(fd, offset, nbytes, advice):
        raise OSError(errno.EINVAL, "Invalid argument")

    with SwapFile(tmp_path / "f.swap", 1 * MiB, direct=False) as f:
        f.write(aligned_empty(MiB // 4, torch.float32).fill_(2), 0).wait()
        monkeypatch.setattr(os, "posix_fadvise", refuse)
        f.will_need(0, MiB)
        assert torch.equal(f.map(0, MiB).view(torch.float32)[-2:], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="closed"):
        f.will_need(0, MiB)
