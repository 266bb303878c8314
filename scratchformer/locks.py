"""Lock files: a process holds one while it writes an output (a run folder, an evaluation, a
predictions file), so that a second process writing the same output is refused, not mixed in.
The lock is an flock on the file, which the system drops when the process ends, a kill included."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

PROBE_TRIES = 5  # a `hold` finding the lock held tries this many times, 10 ms apart (see `holder`)


class Held(RuntimeError):
    """A lock file another process holds (`hold`); `pid` is the holder's, as it wrote it."""

    def __init__(self, path: Path, pid: str):
        super().__init__(f"{path} is held by another process (pid {pid})")
        self.path, self.pid = path, pid


def hold(lock: Path) -> int:
    """Hold `lock` (an exclusive flock on the file, created if missing, which then says this pid) until
    the returned descriptor is closed; the system drops it when the process ends, a kill included.
    Raises `Held` when another process holds it. A descriptor that locked a name since unlinked
    (`release`, between our open and our flock) is let go and the name opened again, so two
    processes never both hold one name. A lock found held is tried again for a few tens of milliseconds
    first: a `holder` probe holds it for an instant."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        for tries in range(PROBE_TRIES):  # another command's `holder` probe holds it for an instant
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if tries == PROBE_TRIES - 1:
                    pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise Held(lock, pid) from None
                time.sleep(0.01)
        try:
            same = os.path.samestat(os.stat(lock), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return fd
        os.close(fd)


def holder(lock: Path) -> str | None:
    """The pid `lock` says when another process holds it (`hold`), else None: a probe that neither makes
    nor removes the file, and holds it only for that instant (a `hold` in that instant tries again)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # none (or one this process cannot read: it names no holder)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 32).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


def release(lock: Path, fd: int) -> None:
    """End a `hold` and remove its file (unlinked first, while still held: see `hold`)."""
    try:
        lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def make_folders(folder: Path) -> list[Path]:
    """Make `folder` and its missing parents, for an output's lock; returns the folders made, the
    deepest first, for `remove_made` when the command ends before writing into them."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the folders `make_folders` made that are still empty, the deepest first: nothing of a
    command that failed before writing is left behind."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # written into (or not ours to remove)
            break
