"""examples/fsdp_lm.py as a user runs it, with torchrun on CPU (gloo): two processes follow one process on the
same global batches, and a rank killed mid-run loses no more than the steps since the last DCP checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_lm.py"
SMALL = ["--steps", "12", "--batch", "8", "--context", "16", "--width", "32", "--layers", "1", "--heads", "4"]
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 60


def _run(tmp_path, name, processes, *extra, check=True):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    log = tmp_path / f"{name}.jsonl"
    args = [*SMALL, "--text", str(text), "--loss-log", str(log), "--ckpt-dir", str(tmp_path / f"ckpt-{name}"), *extra]
    if processes == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
               "--master-port", str(free_port()), str(EXAMPLE), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.slow
def test_two_processes_follow_one_and_a_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    _, one = _run(tmp_path, "one", 1, "--ckpt-every", "0")
    _, two = _run(tmp_path, "two", 2, "--ckpt-every", "4")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 13))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two)) < 1e-5
    crashed, before = _run(tmp_path, "crash", 2, "--ckpt-every", "4", "--crash-at-step", "10", check=False)
    assert crashed.returncode != 0 and [r["step"] for r in before] == list(range(1, 11))
    resumed, after = _run(tmp_path, "crash", 2, "--ckpt-every", "4", "--resume")
    assert "at step 8" in resumed.stdout  # the last checkpoint before the crash: 2 steps lost, fewer than 4
    tail = {r["step"]: r["loss"] for r in after[len(before) :]}
    assert sorted(tail) == list(range(9, 13))
    assert max(abs(tail[r["step"]] - r["loss"]) for r in one if r["step"] in tail) < 1e-5
    # the finished 2-process run's last checkpoint, continued on one process, follows one process throughout
    more, log = _run(tmp_path, "crash", 1, "--ckpt-every", "4", "--resume", "--steps", "16")
    assert "at step 12 on 1 process(es)" in more.stdout
    _, one16 = _run(tmp_path, "one16", 1, "--ckpt-every", "0", "--steps", "16")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(log[-4:], one16[-4:])) < 1e-5
    assert [r["step"] for r in log[-4:]] == [13, 14, 15, 16]
