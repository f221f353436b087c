"""Build the C++ ops in ``csrc/`` on first use, cache them per user, fall back when impossible.

[Note: op cache]
An op is compiled with ``torch.utils.cpp_extension.load`` into
``$ZEROTUNE_CACHE/ops/<op>-<key>`` (default ``~/.cache/zerotune/ops/<op>-<key>``), where ``key``
hashes everything that changes the binary: the op's source files, the torch and Python
versions, the flags, the compiler (``$CXX``) and the machine type. A finished build leaves a
``BUILD_OK`` marker; later processes import the ``.so`` directly without running ninja or the
compiler. When several ranks start at once, an ``fcntl`` lock on ``<op>-<key>.lock`` lets one
of them build while the others wait and then import its result.

When the build is impossible (no compiler, a broken one, no ninja) ``load_op`` returns None,
logs one warning naming the cause and the fix, and callers use their pure-PyTorch fallback.
``ZEROTUNE_DISABLE_OPS=1`` forces that fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no inter-process lock, builds may race
    fcntl = None

logger = logging.getLogger(__name__)

OPS: tuple[str, ...] = ("adam", "aio")

# Folder of each op under csrc/; every .cpp in it is compiled, .cpp and .h are hashed.
_OP_DIRS = {"adam": "adam", "aio": "aio"}
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
_LDFLAGS = ("-fopenmp",)
_FORMAT = "1"  # bump to invalidate every cached build
_MARKER = "BUILD_OK"
_TAIL_LINES = 25
DISABLE_ENV = "ZEROTUNE_DISABLE_OPS"
CACHE_ENV = "ZEROTUNE_CACHE"


@dataclass(frozen=True)
class OpStatus:
    """Where an op stands in this process.

    state: "loaded" (imported here), "built" (cached on disk, not imported yet),
    "not built", or "fallback" (unavailable here: the PyTorch fallback runs; see reason).
    """

    name: str
    state: str
    reason: str = ""
    path: str = ""


class _OpBuildError(Exception):
    def __init__(self, cause: str, fix: str, output: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.fix = fix
        self.output = output


_lock = threading.Lock()
_results: dict[str, tuple[types.ModuleType | None, OpStatus]] = {}


def load_op(name: str) -> types.ModuleType | None:
    """Return the compiled op ``name`` (building it on first use), or None to use the fallback.

    The result is cached for the process; a failure is logged once as a warning.
    """
    _check_name(name)
    with _lock:
        if name not in _results:
            _results[name] = _load(name)
        return _results[name][0]


def op_status(name: str) -> OpStatus:
    """Report whether ``name`` is loaded, built on disk, not built, or unavailable."""
    _check_name(name)
    with _lock:
        if name in _results:
            return _results[name][1]
    if _disabled():
        return OpStatus(name, "fallback", f"disabled by {DISABLE_ENV}=1")
    try:
        build_dir = _build_dir(name, _read_sources(name))
    except _OpBuildError as err:
        return OpStatus(name, "fallback", err.cause)
    if (build_dir / _MARKER).exists():
        return OpStatus(name, "built", "", str(_library_path(name, build_dir)))
    return OpStatus(name, "not built", "", str(build_dir))


def build_all() -> dict[str, OpStatus]:
    """Build (or load from the cache) every op now, e.g. for ``zerotune env --build``."""
    for name in OPS:
        load_op(name)
    return {name: op_status(name) for name in OPS}


def cpu_simd_level() -> str:
    """SIMD level of this CPU as the ops use it: "avx512", "avx2", "neon" or "scalar".

    Asks the adam op when it is already loaded, else reads the CPU flags.
    """
    loaded = _loaded("adam")
    if loaded is not None:
        return loaded.simd_level()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    flags = set((_cpuinfo("flags") or "").split())
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "scalar"


def cpu_model() -> str | None:
    """This CPU's model name (``model name`` in /proc/cpuinfo), or None where not told."""
    return _cpuinfo("model name") or platform.processor() or None


def adam_prefetch() -> int | None:
    """Elements ahead the CPU Adam kernel prefetches on this CPU (its vendor's distance, see
    [Note: prefetch] in csrc/adam/cpu_adam.cpp); None while the adam op is not loaded."""
    loaded = _loaded("adam")
    return loaded.prefetch_distance() if loaded is not None else None


def _loaded(name: str) -> types.ModuleType | None:
    """The op's module if it is loaded already (nothing is built or loaded here)."""
    with _lock:
        return _results.get(name, (None, None))[0]


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of /proc/cpuinfo (None without one)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    return None


def cache_root() -> Path:
    """Folder holding the op builds: ``$ZEROTUNE_CACHE/ops`` or ``~/.cache/zerotune/ops``."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "zerotune"
    return root / "ops"


# ---------------------------------------------------------------------------------------------
# Internals


def _check_name(name: str) -> None:
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}")


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _load(name: str) -> tuple[types.ModuleType | None, OpStatus]:
    if _disabled():
        reason = f"disabled by {DISABLE_ENV}=1"
        logger.info("zerotune op %r: %s, using the PyTorch fallback", name, reason)
        return None, OpStatus(name, "fallback", reason)
    build_dir: Path | None = None
    try:
        sources = _read_sources(name)
        build_dir = _build_dir(name, sources)
        module = _load_or_build(name, sources, build_dir)
    except _OpBuildError as err:
        _warn_fallback(name, err)
        return None, OpStatus(name, "fallback", err.cause, str(build_dir or ""))
    return module, OpStatus(name, "loaded", "", str(_library_path(name, build_dir)))


def _warn_fallback(name: str, err: _OpBuildError) -> None:
    msg = (
        f"zerotune C++ op {name!r} is unavailable, using the slower PyTorch fallback. "
        f"Cause: {err.cause}. Fix: {err.fix}."
    )
    if err.output:
        msg += f"\nBuild output (last lines):\n{err.output}"
    # One warning per node is enough; other local ranks log it at debug level.
    level = logging.WARNING if os.environ.get("LOCAL_RANK", "0") == "0" else logging.DEBUG
    logger.log(level, msg)


def _csrc_root() -> Path:
    """The csrc/ folder, packaged as ``zerotune._csrc`` (or next to a source checkout)."""
    try:
        import importlib.resources as resources

        root = resources.files("zerotune._csrc")
        path = Path(str(root))
        if path.is_dir():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "csrc"


def _read_sources(name: str) -> dict[str, bytes]:
    op_dir = _csrc_root() / _OP_DIRS[name]
    files = sorted(p for p in op_dir.glob("*") if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in files):
        raise _OpBuildError(
            f"no C++ sources found in {op_dir}",
            "reinstall zerotune so that its csrc/ files are present",
        )
    return {p.name: p.read_bytes() for p in files}


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _build_key(name: str, sources: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for part in (
        _FORMAT,
        name,
        torch.__version__,
        sys.version,
        importlib.machinery.EXTENSION_SUFFIXES[0],
        platform.machine(),
        _compiler(),
        *_CFLAGS,
        *_LDFLAGS,
    ):
        h.update(part.encode() + b"\0")
    for fname, data in sources.items():
        h.update(fname.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def _build_dir(name: str, sources: dict[str, bytes]) -> Path:
    return cache_root() / f"{name}-{_build_key(name, sources)}"


def _module_name(name: str, build_dir: Path) -> str:
    # Unique per key, so torch's per-process extension versioning never renames it.
    return f"zerotune_{name}_{build_dir.name.rsplit('-', 1)[1]}"


def _library_path(name: str, build_dir: Path) -> Path:
    return build_dir / f"{_module_name(name, build_dir)}.so"


def _load_or_build(name: str, sources: dict[str, bytes], build_dir: Path) -> types.ModuleType:
    if (build_dir / _MARKER).exists():
        return _import_library(name, build_dir)
    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _OpBuildError(
            f"cannot create the op cache folder {build_dir.parent} ({err})",
            f"set {CACHE_ENV} to a writable folder",
        ) from err
    with _file_lock(build_dir.parent / f"{build_dir.name}.lock"):
        if not (build_dir / _MARKER).exists():  # another process may have built it meanwhile
            _build(name, sources, build_dir)
    return _import_library(name, build_dir)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building %s", path.stem)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _preflight() -> None:
    """Fail early, with a cause and a fix, when no working compiler or ninja is present."""
    cxx = _compiler()
    source = "$CXX" if "CXX" in os.environ else "the default 'c++'"
    if shutil.which(cxx) is None:
        raise _OpBuildError(
            f"no C++ compiler found ({source} = {cxx!r} is not on PATH)",
            "install g++ (e.g. `apt-get install g++`) or set CXX to a C++17 compiler",
        )
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        proc = None
        detail = str(err)
    else:
        detail = (proc.stdout + proc.stderr).strip()
    if proc is None or proc.returncode != 0:
        raise _OpBuildError(
            f"the C++ compiler {cxx!r} ({source}) does not run: `{cxx} --version` "
            f"failed{f' with status {proc.returncode}' if proc else ''}",
            "install g++ (e.g. `apt-get install g++`) or set CXX to a working C++17 compiler",
            _tail(detail),
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise _OpBuildError(
            "ninja is not installed (torch needs it to build C++ extensions)",
            "`pip install ninja`",
        )


def _build(name: str, sources: dict[str, bytes], build_dir: Path) -> None:
    _preflight()
    from torch.utils import cpp_extension

    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    # torch's own build lock, left behind by a build that was killed, would make load()
    # wait forever; we hold the real lock (released by the OS if we die), so drop it.
    (build_dir / "lock").unlink(missing_ok=True)
    for fname, data in sources.items():
        (src_dir / fname).write_bytes(data)
    cpp_files = [str(src_dir / f) for f in sources if f.endswith(".cpp")]
    start = time.perf_counter()
    with _captured_torch_logs() as torch_logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cpp_extension.load(
                name=_module_name(name, build_dir),
                sources=cpp_files,
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as err:  # any failure at all means "use the fallback"
            notes = torch_logs.getvalue() + "".join(f"{w.message}\n" for w in caught)
            raise _classify_failure(err, notes) from err
    info = {
        "op": name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cxx": _compiler(),
        "cflags": list(_CFLAGS),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (build_dir / _MARKER).write_text(json.dumps(info, indent=1) + "\n")
    logger.info("built zerotune op %r in %.1f s into %s", name, info["seconds"], build_dir)


class _MessageOnly(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()  # no tracebacks: the compiler output says more


@contextlib.contextmanager
def _captured_torch_logs() -> Iterator[io.StringIO]:
    """Keep torch.utils.cpp_extension's log lines out of the console while building."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(_MessageOnly())
    old_propagate = torch_logger.propagate
    torch_logger.addHandler(handler)
    torch_logger.propagate = False
    try:
        yield buf
    finally:
        torch_logger.removeHandler(handler)
        torch_logger.propagate = old_propagate


def _classify_failure(err: Exception, notes: str) -> _OpBuildError:
    text = str(err)
    output = getattr(err, "output", None)
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    if output:
        text += "\n" + output
    text = (notes + "\n" + text).strip()
    if "Python.h" in text:
        return _OpBuildError(
            "the Python development headers are missing (Python.h not found)",
            "install them (e.g. `apt-get install python3-dev`)",
            _tail(text),
        )
    if "Ninja is required" in text:
        return _OpBuildError("ninja is not installed", "`pip install ninja`")
    return _OpBuildError(
        f"compiling with {_compiler()!r} failed ({type(err).__name__})",
        "install g++ >= 9 (e.g. `apt-get install g++`) or set CXX to a working C++17 compiler; "
        f"set {DISABLE_ENV}=1 to use the fallback silently",
        _tail(text),
    )


def _import_library(name: str, build_dir: Path) -> types.ModuleType:
    path = _library_path(name, build_dir)
    module_name = _module_name(name, build_dir)
    if module_name in sys.modules:
        return sys.modules[module_name]
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loadable library at {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as err:
        raise _OpBuildError(
            f"the built library {path} could not be loaded ({err})",
            f"delete {build_dir} to rebuild it",
        ) from err
    sys.modules[module_name] = module
    return module


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])
