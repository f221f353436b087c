"""One run per output folder: an advisory lock that the run writing a folder holds.

A second run (or a ``--resume`` started while the ranks of a killed launcher still live)
asks ``holder`` first, or fails to ``acquire``, and is refused in one line that names the
process holding the folder. The lock is ``flock`` on ``<folder>/.zerotune.lock`` (private,
holding the holder's pid): the kernel drops it when the holder exits, however it exits, so
a lock file left by a crash does not block the next run.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .manifest import CheckpointError

__all__ = ["FolderLock"]

NAME = ".zerotune.lock"


class FolderLock:
    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / NAME
        self._fd: int | None = None
        self._made_folder = False

    @staticmethod
    def holder(folder: str | os.PathLike) -> int | None:
        """The pid of the process holding ``folder``, or None when nobody does."""
        path = Path(folder) / NAME
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _pid_in(fd) or -1
        finally:
            os.close(fd)  # closing drops a lock taken just now
        return None

    @staticmethod
    def check_free(folder: str | os.PathLike) -> None:
        """Raise CheckpointError naming the holder when another process holds ``folder``."""
        pid = FolderLock.holder(folder)
        if pid is not None:
            raise _in_use(folder, pid)

    def acquire(self) -> None:
        """Hold the folder (made if missing) or raise CheckpointError naming its holder."""
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            self._made_folder = True
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _pid_in(fd)
                os.close(fd)
                raise _in_use(self.folder, pid) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file meanwhile: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Let go of the folder (the lock file goes; a folder ``acquire`` made and nothing
        else filled goes too)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if self._made_folder:
            try:
                self.folder.rmdir()  # only when empty: a run that wrote nothing
            except OSError:
                pass

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _in_use(folder, pid: int | None) -> CheckpointError:
    who = f"pid {pid}" if pid and pid > 0 else "another process"
    return CheckpointError(
        f"{folder} is in use by another zerotune run ({who}); wait for it to end or stop it, "
        "or choose another --output-dir"
    )


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
