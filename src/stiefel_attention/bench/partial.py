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
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .records import atomic_write

__all__ = ["Checkpoint", "checkpoint_path"]


def checkpoint_path(runs_dir: str | Path, name: str, key: str) -> Path:
    """Where the run <name>-<key> of the records in runs_dir keeps its checkpoint."""
    return Path(runs_dir) / ".partial" / f"{name}-{key}.pt"


class Checkpoint:
    """Where one run keeps its state while in flight; `every_s`: the least time between two saves."""

    def __init__(self, path: str | Path, key: str, stretch: dict, every_s: float = 300.0):
        self.path, self.key, self.every_s = Path(path), key, every_s
        self.stretches = [{"from": 0, **stretch}]  # the stretches so far, this one last
        self._stretch = stretch
        self._last = time.monotonic()
        self._warned = False

    def load(self) -> dict | None:
        """The state a cut-off run of this cell saved, or None (none saved, or unreadable: start afresh)."""
        if not self.path.exists():
            return None
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
            if saved.get("key") != self.key:
                raise ValueError(f"it belongs to the run {saved.get('key')}, not {self.key}")
        except Exception as err:  # a stray or damaged file costs the progress it held, not the run
            print(f"warning: cannot resume from {self.path} ({err}); starting the run afresh", file=sys.stderr)
            return None
        self.stretches = [*saved["stretches"], {"from": saved["step"], **self._stretch}]
        print(f"  resuming {self.path.stem} from step {saved['step']}", file=sys.stderr, flush=True)
        return saved["state"]

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_s

    def save(self, step: int, state: dict) -> None:
        """Write the state after `step` steps, atomically. A folder that cannot be written is warned about
        once and the run goes on without checkpoints."""
        self._last = time.monotonic()
        blob = {"key": self.key, "step": step, "stretches": self.stretches, "state": state}
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
