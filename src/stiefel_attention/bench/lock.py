"""Claims on runs, so that processes sharing a results folder split its work instead of repeating it.

A process claims a cell before it runs it: it creates `<runs>/.claims/<name>-<key>.claim` and holds
an exclusive `flock` on that file while the run is in flight. The kernel drops the lock when the
process exits, however it exits (kill -9 included), so a claim can never go stale: a claim file
whose lock can be taken is a leftover of a dead process, and whoever takes the lock owns the cell.
The file says who holds it (pid, host, profile, data, when), for the message of a process that
finds the cell taken.

`Claims.folder()` (a lock on `<runs>/.claims/folder.lock`, held for a moment) serialises checking
what a folder holds with claiming cells in it, so two commands started at once with different
profiles cannot both pass the check and mix their records. Locks are advisory and need a
filesystem with working `flock` (local disks; NFS v4); where `fcntl` does not exist (Windows),
claims are not taken and concurrent commands on one folder are not protected.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from .records import Cell

__all__ = ["Claims", "CLAIMS_DIR", "exclusive"]

CLAIMS_DIR = ".claims"


def _lock(fd: int, block: bool) -> bool:
    """Take an exclusive flock on fd; False if another process holds it and block is False."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """Hold an exclusive flock on path (created if missing) while the block runs; other processes wait.
    Without fcntl (Windows) nothing is locked."""
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _lock(fd, block=True)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class Claims:
    """The claims this process holds in one runs folder; release_all() (or exiting) gives them up."""

    def __init__(self, runs_dir: str | Path):
        self.dir = Path(runs_dir) / CLAIMS_DIR
        self.held: dict[str, tuple[int, Path]] = {}  # cell key -> (fd holding the lock, claim file)

    @property
    def enabled(self) -> bool:
        return fcntl is not None

    def _path(self, cell: Cell) -> Path:
        return self.dir / f"{cell.name}-{cell.key}.claim"

    @contextlib.contextmanager
    def folder(self) -> Iterator[None]:
        """Hold the folder lock: nobody else checks or claims in this folder meanwhile."""
        if not self.enabled:
            yield
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        with exclusive(self.dir / "folder.lock"):
            yield

    def claim(self, cell: Cell, about: dict) -> bool:
        """Claim cell for this process; False if a live process holds it."""
        if not self.enabled:
            return True
        if cell.key in self.held:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(cell)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            if not _lock(fd, block=False):
                os.close(fd)
                return False
            # Its previous holder may have removed the file between our open and our lock: then the
            # lock we hold is on a file nobody else will look at. Start again on the path's file.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), **about}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self.held[cell.key] = (fd, path)
        return True

    def release(self, cell: Cell) -> None:
        fd, path = self.held.pop(cell.key, (None, None))
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while the lock is held: nobody can be relying on this file
        os.close(fd)

    def release_all(self) -> None:
        for fd, path in self.held.values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            os.close(fd)
        self.held.clear()

    def others(self) -> list[dict]:
        """What the live claims of other processes in this folder say (pid, host, profile, ...).

        A leftover claim file (its process is gone) is removed on the way.
        """
        if not self.enabled or not self.dir.is_dir():
            return []
        mine = {path for _, path in self.held.values()}
        out = []
        for path in sorted(self.dir.glob("*.claim")):
            if path in mine:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                if _lock(fd, block=False):  # nobody holds it: a leftover
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
                try:
                    out.append(json.loads(Path(path).read_text() or "{}"))
                except (OSError, ValueError):
                    out.append({})
            finally:
                os.close(fd)
        return out
