"""Checkpoints of runs in flight, so that a long run cut off (a stopped session, a killed worker) goes on
from its last checkpoint instead of from its first step.

A run of a family with `resumable = True` gets a `Checkpoint` from the runner: the family's `run` calls
`load()` once before training (its saved state, or None) and `save(state)` whenever `due()`; the runner
deletes the file once the run's record is written. The file sits beside the records,
`<runs_dir>/.partial/<name>-<key>.pt`, and holds the cell's key, so a state is only ever resumed by the run
it came from. Every stretch of a run says which code ran it: a resumed run's record lists the stretches
(`resumed`: the step each started from, its code version, CPU and vector instruction set), so a run
finished by newer code than it started with is visible, never silent. Resuming continues the same
computation: a run cut off and resumed ends with the record of a run never cut off (timings aside), which
the tests check.

A checkpoint is checked before it is used: it holds the sha256 of what it saved (`state_sha256`), so a file
whose bytes changed after it was written (a few floats, a tensor scaled) is refused even when it still parses,
and the run starts afresh, saying why. A checkpoint that loads but cannot be applied (a state that no longer
fits the code: `reject`), or whose run then fails (`discard`, called by the runner), is deleted with the reason
printed, so that it cannot fail every later attempt the same way. Files saved before checkpoints carried a
checksum are resumed unchecked, and say so.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import time
import zipfile
from pathlib import Path

import torch

from .records import atomic_write

__all__ = ["Checkpoint", "checkpoint_path", "file_sha256", "state_sha256", "why_unreadable"]


def checkpoint_path(runs_dir: str | Path, name: str, key: str) -> Path:
    """Where the run <name>-<key> of the records in runs_dir keeps its checkpoint."""
    return Path(runs_dir) / ".partial" / f"{name}-{key}.pt"


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def state_sha256(obj) -> str:
    """sha256 of a saved state's contents: dicts (in their order), lists, tuples, tensors (dtype, shape and values),
    numbers, strings, bytes and None. The same before `torch.save` and after `torch.load` of it, so a checkpoint
    can carry the checksum of what it holds."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"d{len(obj)}:".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'l' if isinstance(obj, list) else 't'}{len(obj)}:".encode())
        for v in obj:
            _feed(h, v)
    elif obj is None or isinstance(obj, bool):
        h.update(f"b{obj}:".encode())
    elif isinstance(obj, int):
        h.update(f"i{obj}:".encode())
    elif isinstance(obj, float):
        h.update(b"f" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        data = obj.encode()
        h.update(f"s{len(data)}:".encode() + data)
    elif isinstance(obj, bytes):
        h.update(f"y{len(obj)}:".encode() + obj)
    else:  # no such value in a state today; a new kind is hashed by its text (a mismatch then costs a resume)
        h.update(f"o{type(obj).__qualname__}:{obj!r}:".encode())


def why_unreadable(path: str | Path, err: BaseException) -> str:
    """What is wrong with a torch.save file that torch.load failed on, in words: torch's own message for a
    damaged file is often only `[Errno 22] Invalid argument`, or empty."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as stat_err:
        return f"it cannot be read ({stat_err.strerror or type(stat_err).__name__})"
    if size == 0:
        return "it is empty (0 bytes): its write never finished"
    if not zipfile.is_zipfile(path):
        return (
            f"it is not a complete torch.save archive ({size} bytes with no archive index at the end): "
            "truncated, or overwritten with something else"
        )
    detail = str(err).strip().splitlines()[0] if str(err).strip() else "no message"
    return f"it is a torch.save archive that does not load ({type(err).__name__}: {detail})"


class Checkpoint:
    """Where one run keeps its state while in flight; `every_s`: the least time between two saves."""

    def __init__(self, path: str | Path, key: str, stretch: dict, every_s: float = 300.0):
        self.path, self.key, self.every_s = Path(path), key, every_s
        self.stretches = [{"from": 0, **stretch}]  # the stretches so far, this one last
        self._stretch = stretch
        self._last = time.monotonic()
        self._warned = False
        self._resumed_from: int | None = None  # the step load() resumed from, while that state is in use

    def load(self) -> dict | None:
        """The state a cut-off run of this cell saved, or None (none saved, or not usable: start afresh, saying
        why). A file whose contents do not match the checksum saved with them is never used."""
        if not self.path.exists():
            return None
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as err:  # a stray or damaged file costs the progress it held, not the run
            return self._afresh(why_unreadable(self.path, err))
        problem = self._problem(saved)
        if problem is not None:
            return self._afresh(problem)
        if "sha256" not in saved:
            print(
                f"  note: {self.path.name} was saved before checkpoints carried a checksum: resumed unchecked",
                file=sys.stderr,
            )
        self.stretches = [*saved["stretches"], {"from": saved["step"], **self._stretch}]
        self._resumed_from = saved["step"]
        print(f"  resuming {self.path.stem} from step {saved['step']}", file=sys.stderr, flush=True)
        return saved["state"]

    def _problem(self, saved) -> str | None:
        """What makes a loaded file unusable as this run's checkpoint, or None."""
        if not isinstance(saved, dict) or not {"key", "step", "stretches", "state"} <= saved.keys():
            return "it is not a run checkpoint (it lacks the key, step, stretches and state one holds)"
        if saved["key"] != self.key:
            return f"it belongs to the run {saved['key']}, not {self.key}"
        if "sha256" in saved:
            found = state_sha256({k: saved[k] for k in ("key", "step", "stretches", "state")})
            if found != saved["sha256"]:
                return (
                    f"its contents do not match the checksum saved with them (sha256 {found[:12]}, saved "
                    f"{saved['sha256'][:12]}): the file was changed or damaged after it was written"
                )
        return None

    def _afresh(self, reason: str) -> None:
        print(f"warning: cannot resume from {self.path}: {reason}; starting the run afresh", file=sys.stderr)
        return None

    def reject(self, err: BaseException) -> None:
        """The state load() returned cannot be applied to this run (e.g. it no longer fits the code): delete the
        file, say why, and count the run as never resumed; the caller starts it afresh."""
        step, self._resumed_from = self._resumed_from, None
        self.stretches = [{"from": 0, **self._stretch}]
        self.path.unlink(missing_ok=True)
        print(
            f"warning: the checkpoint {self.path} (step {step}) does not fit this run ({type(err).__name__}: "
            f"{_first_line(err)}); deleted it, starting the run afresh",
            file=sys.stderr,
        )

    def discard(self, err: BaseException) -> None:
        """After the run failed: if it had resumed from this checkpoint, delete the file and say so, so that the
        next attempt starts afresh instead of failing the same way (the saved state may hold garbage that loads,
        or no longer suit the code). A run that started afresh keeps its checkpoint."""
        if self._resumed_from is None:
            return
        self.path.unlink(missing_ok=True)
        print(
            f"warning: the run failed after resuming from step {self._resumed_from} of {self.path} "
            f"({type(err).__name__}: {_first_line(err)}); the checkpoint may be what failed it, so it is deleted: "
            "the next attempt starts the run afresh",
            file=sys.stderr,
        )
        self._resumed_from = None

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_s

    def save(self, step: int, state: dict) -> None:
        """Write the state after `step` steps, atomically, with the sha256 of what it holds. A folder that cannot
        be written is warned about once and the run goes on without checkpoints."""
        self._last = time.monotonic()
        blob = {"key": self.key, "step": step, "stretches": self.stretches, "state": state}
        blob["sha256"] = state_sha256(blob)
        try:
            with atomic_write(self.path, binary=True) as f:
                torch.save(blob, f)
        except OSError as err:
            if not self._warned:
                print(f"warning: cannot write checkpoint {self.path} ({err}); going on without", file=sys.stderr)
                self._warned = True

    def resumed(self) -> list[dict] | None:
        """The stretches of a run that was resumed at least once (for its record), else None."""
        return self.stretches if len(self.stretches) > 1 else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
