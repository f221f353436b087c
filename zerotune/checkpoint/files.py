"""Atomic files and streaming safetensors: write a header, then append tensor data.

[Note: streaming safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor:
dtype, shape and byte offsets into the data section; ``__metadata__``: strings) and the raw
data. ``safetensors.torch.save_file`` needs every tensor in memory at once; here the header is
computed from the tensors' names, dtypes and shapes alone, and data is appended in header
order, in pieces of any size, so a writer never holds more than the piece it is given.
Every file is written under a temporary name in its final folder, hashed (sha256) while it is
written, fsynced, and renamed into place; the folder is fsynced after the rename.
Reading reuses the header parser of ``zerotune/init/pretrained.py`` and reads element ranges
straight into the caller's tensor (no intermediate buffer).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..init.pretrained import (
    SAFETENSORS_DTYPES,
    ModelLoadError,
    check_safetensors_header,
    parse_safetensors_header,
    read_safetensors_header,
)
from .manifest import CheckpointError

__all__ = [
    "TensorSpec",
    "TensorFileReader",
    "TensorFileWriter",
    "atomic_write_bytes",
    "cannot_create",
    "fsync_dir",
    "sha256_file",
    "st_dtype",
]

_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_BLOCK = 8 * 2**20  # read size when hashing whole files


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cannot_create(folder: Path) -> str | None:
    """Why ``folder`` (missing, to be made with its parents) could not be made, or None: the
    nearest existing ancestor is not a folder, or this user may not write in it."""
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"no permission to write in {ancestor}"
    return None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # renameat2 flag (linux/fs.h)


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or filesystem cannot."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` through a temporary name, fsync and rename; returns its sha256."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _raw(t: torch.Tensor):
    """The bytes of ``t`` without a copy (for contiguous CPU tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize(self.dtype)


class TensorFileWriter:
    """A safetensors file whose tensors are known up front; data is appended in order.

    See [Note: streaming safetensors]. ``append`` takes any number of pieces per tensor;
    ``commit`` checks every byte arrived, fsyncs and renames, and returns (sha256, size).
    """

    def __init__(
        self, path: str | os.PathLike, specs: list[TensorSpec], metadata: dict | None = None
    ):
        self.path = Path(path)
        self.specs = specs
        header: dict = {}
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        self._ends: list[int] = []
        pos = 0
        for s in specs:
            if s.name in header:
                raise ValueError(f"tensor {s.name!r} appears twice")
            header[s.name] = {
                "dtype": st_dtype(s.dtype),
                "shape": list(s.shape),
                "data_offsets": [pos, pos + s.nbytes],
            }
            pos += s.nbytes
            self._ends.append(pos)
        self.data_bytes = pos
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._tmp = _temp_name(self.path)
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._hash = hashlib.sha256()
        self._written = 0
        self._index = 0
        self._put(struct.pack("<Q", len(raw)) + raw)
        self.size = 8 + len(raw) + self.data_bytes

    def _put(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)

    @property
    def full(self) -> bool:
        """Every data byte the header announced has been appended."""
        return self._written == self.data_bytes

    def append(self, piece: torch.Tensor) -> None:
        """The next bytes of the current tensor (``piece`` must have the tensor's dtype)."""
        while self._index < len(self._ends) and self._written == self._ends[self._index]:
            self._index += 1
        if self._index == len(self.specs):
            raise ValueError(f"{self.path}: more data than the header announced")
        spec = self.specs[self._index]
        if piece.dtype != spec.dtype:
            raise ValueError(f"{spec.name}: got {piece.dtype}, the header says {spec.dtype}")
        raw = _raw(piece)
        if self._written + raw.nbytes > self._ends[self._index]:
            raise ValueError(f"{spec.name}: more data than its shape {spec.shape}")
        self._put(raw)
        self._written += raw.nbytes

    def commit(self) -> tuple[str, int]:
        if self._written != self.data_bytes:
            self.abort()
            raise ValueError(f"{self.path}: {self._written} of {self.data_bytes} bytes written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)
        return self._hash.hexdigest(), self.size

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` strings of a safetensors file (its tensors are read elsewhere),
    from a header checked as ``read_safetensors_header`` checks it."""
    path = Path(path)
    try:
        header, _, data_bytes = parse_safetensors_header(path, CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    check_safetensors_header(header, data_bytes, path, CheckpointError)
    return header.get("__metadata__") or {}


class TensorFileReader:
    """Element ranges of the tensors of one safetensors file, read into given tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.entries = read_safetensors_header(self.path)
        except ModelLoadError as exc:
            raise CheckpointError(str(exc)) from None
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot be read ({exc.strerror})") from None
        self._f = None

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def read(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of tensor ``key`` (flattened) into ``out`` (contiguous,
        of the tensor's dtype, ``stop - start`` elements)."""
        e = self.entries.get(key)
        if e is None:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}")
        if out.dtype != e.dtype or out.numel() != stop - start or not out.is_contiguous():
            raise ValueError(f"read of {key!r}: wrong destination {out.dtype} {out.shape}")
        size = itemsize(e.dtype)
        if start < 0 or stop * size > e.nbytes:
            raise CheckpointError(f"{self.path}: {key!r} has no elements [{start}, {stop})")
        if stop == start:
            return
        if self._f is None:
            self._f = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        dest = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        self._f.seek(e.offset + start * size)
        got = self._f.readinto(_raw(dest))
        if got != (stop - start) * size:
            raise CheckpointError(
                f"{self.path}: short read of {key!r} ({got} of {(stop - start) * size} bytes): "
                "the file is truncated"
            )
        if dest is not out:
            out.copy_(dest)

    def whole(self, key: str) -> torch.Tensor:
        """Tensor ``key``, whole, with its shape."""
        e = self.entries.get(key)
        if e is None:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}")
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read(key, 0, out.numel(), out.view(-1))
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
