"""examples/fsdp_lm.py as a user runs it, with torchrun on CPU (gloo): two processes follow one process on the
same global batches, a rank killed mid-run loses no more than the steps since the last DCP checkpoint, and a resume
that would not continue the run (other options, a checkpoint past --steps, a damaged checkpoint) says so."""

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


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A one-process run of 4 steps with its checkpoint at step 4: the folder _run reuses under the name "run"."""
    base = tmp_path_factory.mktemp("fsdp_resume")
    _run(base, "run", 1, "--steps", "4", "--ckpt-every", "4")
    return base


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes,change,said",
    [
        (2, ["--lr", "0.01", "--seed", "1"], "this command has --seed 1, --lr 0.01; the run had --seed 0 --lr 0.003."),
        (1, ["--frame-lr", "0.1"], "this command has --frame-lr 0.1; the run had --frame-lr 0.03."),
        (1, ["--batch", "4"], "this command has --batch 4; the run had --batch 8."),
        (1, ["--text", "other"], "this command has --text of sha256 "),
        (1, ["--steps", "2"], "step-4 is at step 4, beyond --steps 2: pass --steps 4 or more to continue it"),
    ],
    ids=["lr-seed", "frame-lr", "batch", "text", "steps-behind"],
)
def test_a_resume_that_would_not_continue_the_run_is_refused_naming_each_change(saved_run, processes, change, said):
    """The old script kept the checkpoint's rates without a word (the optimizer and schedule states hold them),
    switched to another data stream on a new --seed, --batch or --text, and went on from a checkpoint past --steps."""
    if change[0] == "--text":
        other = saved_run / "other.txt"
        other.write_text(TEXT.replace("Citizen", "Senator"))
        change = ["--text", str(other)]
    done, _ = _run(saved_run, "run", processes, "--steps", "8", "--resume", *change, check=False)
    assert done.returncode != 0 and f"--resume: {saved_run / 'ckpt-run' / 'step-4'}" in done.stderr, done.stderr
    assert said in done.stderr, done.stderr[-3000:]
    assert f'File "{EXAMPLE}"' not in done.stderr  # one line, no traceback of the script
    if change[0] != "--steps":
        assert (
            "A resume cannot change them" in done.stderr and "or start a new run with another --ckpt-dir" in done.stderr
        )


@pytest.mark.slow
def test_a_resume_from_a_checkpoint_at_steps_says_there_is_nothing_to_train(saved_run):
    done, _ = _run(saved_run, "run", 1, "--steps", "4", "--resume")
    step4 = saved_run / "ckpt-run" / "step-4"
    assert f"{step4} is at step 4 already: --steps 4 leaves nothing to train (pass a larger --steps" in done.stdout


@pytest.mark.slow
def test_a_damaged_dcp_checkpoint_is_named_and_a_resume_falls_back_to_the_one_before(tmp_path):
    """A truncated shard made every rank fail with a bare EOFError: the file is named and the resume continues from
    the checkpoint before it, as the run did; damage at full length stops with the file and the way out."""
    _, first = _run(tmp_path, "dcp", 2, "--steps", "8", "--ckpt-every", "4")
    step4, step8 = tmp_path / "ckpt-dcp" / "step-4", tmp_path / "ckpt-dcp" / "step-8"
    shard = step8 / "__1_0.distcp"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    resumed, log = _run(tmp_path, "dcp", 2, "--steps", "8", "--ckpt-every", "4", "--resume")
    said = f"{shard} is truncated ({len(raw) // 2} bytes; the checkpoint's index needs {len(raw)})"
    assert said in resumed.stderr and f"resuming from {step4}, the latest complete one" in resumed.stderr
    assert f"resumed from {step4} at step 4 on 2 process(es)" in resumed.stdout
    again = {r["step"]: r["loss"] for r in log[len(first) :]}
    assert sorted(again) == [5, 6, 7, 8]
    assert max(abs(again[r["step"]] - r["loss"]) for r in first if r["step"] in again) < 1e-5
    # step 8 saved again over the damaged one; now damaged at full length (the file's length intact)
    shard = step8 / "__0_0.distcp"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:64] + bytes(len(raw) - 64))
    failed, _ = _run(tmp_path, "dcp", 2, "--steps", "8", "--resume", check=False)
    assert failed.returncode != 0 and f"--resume: cannot load {step8} (rank 0: " in failed.stderr, failed.stderr[-3000:]
    assert f"{shard} (its item " in failed.stderr and f"move it aside to resume from {step4}" in failed.stderr
    assert f'File "{EXAMPLE}"' not in failed.stderr
    # no complete checkpoint left: stop, saying so and what to do
    for where in (step4, step8):
        (where / "__0_0.distcp").write_bytes(b"")
    stopped, _ = _run(tmp_path, "dcp", 1, "--steps", "8", "--resume", check=False)
    assert (
        stopped.returncode != 0 and f"--resume: no complete checkpoint in {tmp_path / 'ckpt-dcp'}: " in stopped.stderr
    )
    assert f"{step8 / '__0_0.distcp'} is truncated (0 bytes; " in stopped.stderr
    assert "start afresh without --resume (with another --ckpt-dir to keep these files)" in stopped.stderr
