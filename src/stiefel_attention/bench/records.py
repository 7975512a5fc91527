"""Run records: one training run (a cell) -> one JSON file, named by a hash of its resolved config.

A cell is one training run: (family, readable name, resolved config). Its key is a hash of the
resolved config, so two experiments that need the same run share one record
`<runs_dir>/<name>-<key>.json`. Records are written atomically (temp file + rename), so a reader
never sees a partial one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .errors import UserError

__all__ = [
    "Cell",
    "atomic_write",
    "code_version",
    "ensure_writable",
    "is_record",
    "read_record",
    "strict",
    "write_json_atomic",
]

# What every run record holds (runner.execute_cell writes them); a JSON file without them is not a record.
_RECORD_FIELDS = {"name": str, "key": str, "family": str, "config": dict, "metrics": dict}


@dataclass(frozen=True)
class Cell:
    family: str  # a registered experiment family (bench.family)
    name: str  # readable, e.g. "stiefel-adam-s3-n10000"
    config: dict = field(hash=False)  # everything that determines the result; hashed into the key
    options: dict = field(default_factory=dict, hash=False)  # where to run, not what: data path, device

    @property
    def key(self) -> str:
        blob = json.dumps({"family": self.family, **self.config}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def path(self, runs_dir: str | Path) -> Path:
        return Path(runs_dir) / f"{self.name}-{self.key}.json"

    def planned_record(self) -> dict:
        """What the record this cell will write holds of its identity (name, key, family, config), before it runs:
        enough to place it among an experiment's records (report.place_records)."""
        return {"name": self.name, "key": self.key, "family": self.family, "config": self.config}


def strict(obj):
    """obj with every NaN or infinite float replaced by None, so that any JSON reader can load it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


@contextlib.contextmanager
def atomic_write(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """A file to write path's new content to: it replaces path (fsynced, by rename) when the block ends, and is
    removed if the block raises, so that a reader never sees a partial file, even if we are killed mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make shared result folders unreadable
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | Path, obj) -> None:
    """Write strict JSON (NaN and infinities become null) atomically (`atomic_write`)."""
    with atomic_write(path) as f:
        json.dump(strict(obj), f, indent=1, sort_keys=False, allow_nan=False)
        f.write("\n")


def ensure_writable(folder: str | Path) -> Path:
    """Create folder (and its parents) and check that files can be written in it, before any run
    trains: a run whose record cannot be saved is lost work. Raises UserError naming the folder."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(f"cannot write run records to {folder}: {err.strerror or err}") from None
    return folder


def _umask() -> int:
    """The process umask (Python < 3.13 can only read it by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_record(obj) -> bool:
    """Whether a parsed JSON value has the fields of a run record."""
    return isinstance(obj, dict) and all(isinstance(obj.get(k), t) for k, t in _RECORD_FIELDS.items())


def read_record(path: str | Path, warn: bool = True) -> dict | None:
    """The run record at path, or None when there is none. A file that is not a record (truncated or
    invalid JSON, not UTF-8, a JSON value without a record's fields, a folder; a crash mid-write cannot
    leave one, but a hand-edited or stray file can) counts as missing, with a warning naming it, so the
    run is made again and its record replaces the file."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        if warn:
            why = err.strerror if isinstance(err, OSError) else type(err).__name__
            print(f"warning: unreadable record {path} ({why}); treating the run as not done", file=sys.stderr)
        return None
    if not is_record(record):
        if not warn:
            return None
        missing = sorted(_RECORD_FIELDS) if not isinstance(record, dict) else sorted(set(_RECORD_FIELDS) - set(record))
        print(
            f"warning: {path} is not a run record (no {', '.join(missing) or 'well-typed fields'}); "
            "treating the run as not done",
            file=sys.stderr,
        )
        return None
    return record


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """git commit of the code that ran (with '-dirty' if src/ had changes), else the package version.

    Cached at the first call, which execute_cell makes before training: a commit made while a
    run is in flight must not be credited with it.
    """
    from .. import __version__

    package = Path(__file__).resolve().parents[1]  # the stiefel_attention package
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, timeout=5)
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--", "."],
                cwd=package.parent,
                capture_output=True,
                text=True,
                timeout=5,
            )
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"stiefel-attention {__version__}"
