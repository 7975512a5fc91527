"""Run records: one training run (a cell) -> one JSON file, named by a hash of its resolved config.

A cell is one training run: (family, readable name, resolved config). Its key is a hash of the
resolved config, so two experiments that need the same run share one record
`<runs_dir>/<name>-<key>.json`. Records are written atomically (temp file + rename), so a reader
never sees a partial one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cell", "code_version", "read_record", "strict", "write_json_atomic"]


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


def strict(obj):
    """obj with every NaN or infinite float replaced by None, so that any JSON reader can load it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj) -> None:
    """Write strict JSON (NaN and infinities become null) so that a reader never sees a partial file,
    even if we are killed mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(strict(obj), f, indent=1, sort_keys=False, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_record(path: str | Path) -> dict | None:
    """The run record at path, or None when there is none. An unparsable file (a crash mid-write
    cannot leave one, but a hand-edited or truncated copy can) counts as missing, with a warning,
    so the run is made again."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        print(f"warning: unreadable record {path}; treating the run as not done", file=sys.stderr)
        return None


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
