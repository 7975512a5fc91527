"""`--executor ray` on a real local Ray cluster: a smoke sweep in which one worker is killed mid-run
(SIGKILL from outside, as a preempted node would be), the retry, and records equal to those of the
local executor. Deselect locally with `-m "not ray"`; CI installs Ray and runs it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("CI"):
    import ray  # CI must run this test, never skip it
else:
    ray = pytest.importorskip("ray")

from stiefel_attention.bench import cli  # noqa: E402
from stiefel_attention.bench.family import FAMILY_MODULES  # noqa: E402

pytestmark = pytest.mark.ray

TASK_TITLE = "ray::_run_cell_task"  # Ray sets a worker's process title to the task it runs


def _task_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(TASK_TITLE):
                pids.append(int(entry))
    return pids


class KillOneTaskMidRun(threading.Thread):
    """SIGKILL the first Ray worker seen running a training task for `after_s` seconds."""

    def __init__(self, after_s: float = 0.3, timeout_s: float = 240.0):
        super().__init__(daemon=True)
        self.after_s, self.timeout_s = after_s, timeout_s
        self.killed: int | None = None
        self.stop = threading.Event()

    def run(self):
        first_seen: dict[int, float] = {}
        end = time.monotonic() + self.timeout_s
        while not self.stop.is_set() and time.monotonic() < end:
            now = time.monotonic()
            for pid in _task_pids():
                first_seen.setdefault(pid, now)
                if now - first_seen[pid] >= self.after_s:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed = pid
                    return
            time.sleep(0.02)


@pytest.fixture(scope="module")
def local_ray_cluster():
    saved = {k: os.environ.pop(k, None) for k in ("RAY_ADDRESS",)}
    # Ray nices its workers (15 by default); on a machine busy with other work they would crawl.
    os.environ["RAY_worker_niceness"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.pop("RAY_worker_niceness", None)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v


def _records(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}


def test_ray_sweep_retries_a_killed_worker_and_equals_local(local_ray_cluster, tmp_path, capsys):
    sweep = ["grok", "--experiment", "study", "--profile", "smoke", "--seeds", "2", "--no-progress"]
    killer = KillOneTaskMidRun()
    killer.start()
    rc = cli.main([*sweep, "--executor", "ray", "--retries", "2", "--out", str(tmp_path / "ray")])
    killer.stop.set()
    err = capsys.readouterr().err
    assert rc == 0, err
    assert killer.killed is not None, "no training task was seen running"
    assert "failed on attempt 1" in err and "retrying (1/2)" in err  # the retry is reported
    assert "FAILED" not in err

    assert cli.main([*sweep, "--jobs", "1", "--out", str(tmp_path / "local")]) == 0
    by_ray, by_local = _records(tmp_path / "ray"), _records(tmp_path / "local")
    assert len(by_ray) == 2 * 2 * 2  # 2 ops x 2 seeds x 2 arms, each exactly once despite the retry
    assert not list((tmp_path / "ray" / "runs").glob(".*.tmp"))  # no partial file left by the killed run
    assert by_ray.keys() == by_local.keys()
    for name, rec in by_ray.items():
        assert rec["config"] == by_local[name]["config"]
        assert rec["metrics"] == by_local[name]["metrics"], name  # bit-identical: same seeds, one thread each
        assert rec["curves"] == by_local[name]["curves"], name

    # resume: everything is on disk, so a second ray sweep submits nothing
    assert cli.main([*sweep, "--executor", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert _records(tmp_path / "ray") == by_ray


def test_ray_reports_a_run_that_keeps_failing_after_its_retries(local_ray_cluster, tmp_path, capsys):
    from stiefel_attention.bench.records import Cell
    from stiefel_attention.bench.runner import RayExecutor, run_cells

    bad = Cell("no-such-family", "bad-s0", {"seed": 0})  # execute_cell raises ValueError in the worker
    executor = RayExecutor(retries=1)
    records, failures = run_cells([bad], tmp_path, executor, progress=False)
    assert records == {} and len(failures) == 1
    cell, err = failures[0]
    assert cell.key == bad.key and isinstance(err, ValueError) and "unknown experiment family" in str(err)
    registered = ", ".join(FAMILY_MODULES)
    assert executor.retried == [
        ("bad-s0", 1, f"ValueError: unknown experiment family 'no-such-family'; registered: {registered}")
    ]
    assert "retrying (1/1)" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("family", ["lm", "mqar"])
def test_sequence_families_run_on_ray_as_locally(local_ray_cluster, tmp_path, family):
    arms = ["adamw", "stiefel-adam"]
    args = [
        family,
        "--experiment",
        "main",
        "--profile",
        "smoke",
        "--seeds",
        "1",
        "--arms",
        ",".join(arms),
        "--no-progress",
    ]
    if family == "lm":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 30)
        args += ["--text", str(corpus)]
    assert cli.main([*args, "--executor", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert cli.main([*args, "--jobs", "1", "--out", str(tmp_path / "local")]) == 0
    by_ray, by_local = _records(tmp_path / "ray"), _records(tmp_path / "local")
    assert sorted(rec["config"]["arm"] for rec in by_ray.values()) == sorted(arms)
    assert by_ray.keys() == by_local.keys()
    for name, rec in by_ray.items():
        assert rec["metrics"] == by_local[name]["metrics"] and rec["curves"] == by_local[name]["curves"], name
