"""Misuse and accidents, each reproduced: what a run record's key covers, output folders that cannot take records,
concurrent commands on one folder, signals, files that are not records, bad data and devices; and in the library,
foreign state dicts, bad param groups, models built on the meta device and half-converted models."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import smoke_args
from stiefel_attention import (
    Block,
    StiefelAdam,
    StiefelAttention,
    StiefelSGD,
    frames,
    isometry_error,
    param_groups,
    random_frame,
    reset_frames,
    stiefelize,
)
from stiefel_attention.bench import cli
from stiefel_attention.bench import family as family_module
from stiefel_attention.bench import runner as runner_module
from stiefel_attention.bench.errors import DataError, NotReady, UserError
from stiefel_attention.bench.family import with_data
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.lm import run as lm
from stiefel_attention.bench.lock import Claims
from stiefel_attention.bench.records import Cell, ensure_writable, read_record, write_json_atomic
from stiefel_attention.bench.report import load_records
from stiefel_attention.bench.runner import InlineExecutor, check_folder, run_cells
from stiefel_attention.bench.text import DEFAULT_TEXT_SHA256, load_text
from stiefel_attention.convert import StiefelizeError

SHARED_TEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "tinyshakespeare.txt"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _text(tmp_path: Path, name: str, line: str, repeat: int = 60) -> Path:
    path = tmp_path / name
    path.write_text(line * repeat, encoding="utf-8")
    return path


def _lm_args(out: Path, text: Path, *extra: str) -> list[str]:
    return smoke_args("lm", "main", out, "--text", str(text), "--seeds", "1", "--arms", "adamw", *extra)


def _grok_cell(seed: int = 0, epochs: int = 2) -> Cell:
    cell = grok.cells("single", "smoke")[0]
    return Cell("grok", f"{cell.name}-t{seed}", dict(cell.config, seed=seed, epochs=epochs), {"device": "cpu"})


# --- 1. what the record key covers ------------------------------------------------------------


def test_the_default_corpus_adds_nothing_to_the_key_and_other_text_does(tmp_path):
    other = _text(tmp_path, "other.txt", "To be, or not to be, that is the question.\n")
    corpus = load_text(other)
    assert lm.FAMILY.data_key({"data": str(other)}) == {"data_sha256": corpus.sha256}
    assert corpus.sha256 != DEFAULT_TEXT_SHA256
    plain = lm.FAMILY.cells("main", "smoke", 1)
    keyed = with_data(plain, lm.FAMILY.data_key({"data": str(other)}))
    assert all(a.key != b.key and a.name == b.name for a, b in zip(plain, keyed))
    assert with_data(plain, {}) is plain  # default data: the committed records keep their keys
    if SHARED_TEXT.is_file():
        assert load_text(SHARED_TEXT).sha256 == DEFAULT_TEXT_SHA256
        assert lm.FAMILY.data_key({"data": str(SHARED_TEXT)}) == {}


def test_a_run_refuses_data_other_than_its_key_names(tmp_path):
    first = _text(tmp_path, "a.txt", "Now is the winter of our discontent\n")
    second = _text(tmp_path, "b.txt", "Made glorious summer by this sun of York;\n")
    [cell] = with_data(lm.FAMILY.cells("main", "smoke", 1)[:1], lm.FAMILY.data_key({"data": str(first)}))
    with pytest.raises(DataError, match="is keyed to data with sha256"):
        lm.run(cell.config, data=str(second), device="cpu")
    with pytest.raises(DataError, match="is keyed to data with sha256"):  # a default-data cell, other text
        lm.run(lm.FAMILY.cells("main", "smoke", 1)[0].config, data=str(second), device="cpu")


def test_other_data_into_the_same_folder_is_refused_naming_both(tmp_path, capsys):
    first = _text(tmp_path, "first.txt", "Now is the winter of our discontent\n")
    second = _text(tmp_path, "second.txt", "Made glorious summer by this sun of York;\n")
    out = tmp_path / "out"
    assert cli.main(_lm_args(out, first)) == 0
    [record] = load_records(out / "runs")
    assert record["config"]["data_sha256"] == load_text(first).sha256 == record["data_sha256"]
    capsys.readouterr()
    assert cli.main(_lm_args(out, second)) == 2
    err = capsys.readouterr().err
    assert "first.txt" in err and "second.txt" in err and "holds one dataset" in err
    assert len(list((out / "runs").glob("*.json"))) == 1  # nothing trained, nothing reused
    assert cli.main(_lm_args(tmp_path / "out2", second)) == 0  # its own folder: runs


# --- 2. output folders that cannot take records -------------------------------------------------


def test_an_out_that_cannot_take_records_is_refused_before_training(tmp_path, capsys, monkeypatch):
    text = _text(tmp_path, "t.txt", "Now is the winter of our discontent\n")
    trained = []
    monkeypatch.setattr(lm, "run", lambda *a, **k: trained.append(1) or {})
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "below"):
        assert cli.main(_lm_args(out, text)) == 2
        err = capsys.readouterr().err
        assert "cannot write run records to" in err and "Traceback" not in err
    assert trained == []

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)  # a read-only folder (root may write anywhere)
    with pytest.raises(UserError, match="cannot write run records to .*Permission denied"):
        ensure_writable(tmp_path / "ro")


# --- 3. concurrent commands on one folder --------------------------------------------------------

_HOLD = """
import sys, time
sys.path.insert(0, {src!r})
from stiefel_attention.bench.lock import Claims
from stiefel_attention.bench.records import Cell
claims = Claims({runs!r})
with claims.folder():
    ok = claims.claim(Cell("grok", {name!r}, {config!r}), {about!r})
print("claimed" if ok else "busy", flush=True)
time.sleep(120)
"""


def _hold_claim(runs: Path, cell: Cell, about: dict) -> subprocess.Popen:
    script = _HOLD.format(src=SRC, runs=str(runs), name=cell.name, config=cell.config, about=about)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_cell_claimed_by_a_live_process_is_left_to_it_and_taken_over_after_it_dies(tmp_path, capsys):
    runs = tmp_path / "runs"
    held, free = _grok_cell(0), _grok_cell(1)
    proc = _hold_claim(runs, held, {"profile": "smoke"})
    try:
        assert not Claims(runs).claim(held, {"profile": "smoke"})
        records, failures = run_cells([held, free], runs, InlineExecutor(), progress=False)
        assert set(records) == {free.key} and failures == []
        assert "in flight in another process" in capsys.readouterr().err
        assert read_record(held.path(runs)) is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
    # the kernel dropped the dead process's lock: its claim file is a leftover, and the cell is free
    records, _ = run_cells([held, free], runs, InlineExecutor(), progress=False)
    assert set(records) == {held.key, free.key} and read_record(held.path(runs)) is not None
    assert list((runs / ".claims").glob("*.claim")) == []  # released on the way out


def test_a_live_claim_of_another_profile_keeps_the_folder_to_that_profile(tmp_path):
    runs = tmp_path / "runs"
    cpu_cell = Cell("grok", "x-cpu", dict(_grok_cell(0).config, profile="cpu"), {})
    proc = _hold_claim(runs, cpu_cell, {"profile": "cpu"})
    try:
        with pytest.raises(UserError, match="holds runs of profile cpu .*in flight: pid"):
            run_cells([_grok_cell(0)], runs, InlineExecutor(), progress=False)
        with pytest.raises(UserError, match="holds runs of profile cpu"):
            check_folder(runs, "smoke", claims=Claims(runs))
    finally:
        proc.kill()
        proc.wait(timeout=10)
    check_folder(runs, "smoke", claims=Claims(runs))  # its process is gone: nothing of cpu is left


def test_a_claim_taken_after_the_record_was_written_does_not_run_again(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    cell = _grok_cell(0)
    done = {"name": cell.name, "key": cell.key, "family": "grok", "config": cell.config, "metrics": {"x": 1}}
    real_claim = Claims.claim

    def finish_first(self, c, about):  # another process finishes the cell between our look and our claim
        write_json_atomic(c.path(runs), done)
        return real_claim(self, c, about)

    monkeypatch.setattr(Claims, "claim", finish_first)
    records, _ = run_cells([cell], runs, InlineExecutor(), progress=False)
    assert records[cell.key] == done


# --- 4. SIGINT to the parent only -----------------------------------------------------------------

_PARENT = """
import sys
sys.path.insert(0, {src!r})
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.records import Cell
from stiefel_attention.bench.runner import LocalExecutor, run_cells
base = grok.cells("single", "smoke")[0]
cells = [Cell("grok", f"long-{{s}}", dict(base.config, seed=s, epochs=10**6), {{"device": "cpu"}}) for s in range(2)]
run_cells(cells, {runs!r}, LocalExecutor(2), progress=False)
"""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads worker processes from /proc")
def test_sigint_to_the_parent_alone_stops_its_workers_promptly(tmp_path):
    # SIGINT as a terminal or scheduler delivers it: a shell starts background jobs (pytest under `cmd &`)
    # with SIGINT ignored, which the child would inherit and Python then leaves ignored
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT.format(src=SRC, runs=str(tmp_path / "runs"))], preexec_fn=restore
    )
    try:
        deadline = time.monotonic() + 90
        workers: list[int] = []
        while time.monotonic() < deadline and len(workers) < 2:  # the pool's two workers, training
            workers = [c for c in _children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
            time.sleep(0.5)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(3)
        os.kill(proc.pid, signal.SIGINT)  # the parent only, as a job scheduler sends it
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "workers train on after the parent was interrupted"
    finally:
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)


# --- 5. files that parse but are not records ----------------------------------------------------


@pytest.mark.parametrize(
    "content, why",
    [
        (b"[]", "not a run record"),
        (b'{"name": "a", "key": "b", "family": "grok", "config": {}}', "no metrics"),
        (b'{"notes": "to self"}', "not a run record"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "UnicodeDecodeError"),
    ],
)
def test_a_file_that_is_not_a_record_is_named_skipped_and_the_run_redone(tmp_path, capsys, content, why):
    runs = tmp_path / "runs"
    cell = _grok_cell(0)
    runs.mkdir()
    cell.path(runs).write_bytes(content)
    (runs / "notes.json").write_bytes(content)
    assert load_records(runs) == []
    err = capsys.readouterr().err
    assert cell.path(runs).name in err and "notes.json" in err and why in err
    records, _ = run_cells([cell], runs, InlineExecutor(), progress=False)
    assert read_record(cell.path(runs)) == records[cell.key]  # redone; its record replaced the file
    # report reads the folder without a traceback (the cell is a test's, no experiment's: it is left out, by request)
    assert cli.main(["report", str(tmp_path), "--leave-out-unplanned"]) == 0


# --- 6. report on one family's folder -------------------------------------------------------------


def test_report_on_a_family_folder_rebuilds_its_summaries(tmp_path, capsys):
    out = tmp_path / "grok"
    assert cli.main(smoke_args("grok", "single", out)) == 0
    summary = (out / "single" / "summary.json").read_bytes()
    (out / "single" / "summary.json").unlink()
    capsys.readouterr()
    assert cli.main(["report", str(out)]) == 0
    assert (out / "single" / "summary.json").read_bytes() == summary
    assert not (out / "REPORT.md").exists() and "stiefel-attention report" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(empty)]) == 2
    assert "holds no run records" in capsys.readouterr().err and not (empty / "REPORT.md").exists()


def _old_protocol_record(runs: Path) -> Cell:
    """Beside a finished record, one of a cell the current code does not plan (its lr changed since)."""
    rec = read_record(sorted(runs.glob("*.json"))[0])
    config = {**rec["config"], "lr": rec["config"]["lr"] * 3}
    cell = Cell(rec["family"], rec["name"] + "-earlier", config)
    old = {**rec, "name": cell.name, "key": cell.key, "config": config, "code_version": "0ld0ld0"}
    write_json_atomic(cell.path(runs), old)
    return cell


def test_report_never_leaves_a_record_out_or_shows_an_old_summary_without_saying_so(tmp_path, capsys, monkeypatch):
    out = tmp_path / "results"
    grok_dir = out / "grok"
    assert cli.main(smoke_args("grok", "single", grok_dir)) == 0
    n_runs = len(list((grok_dir / "runs").glob("*.json")))
    earlier = _old_protocol_record(grok_dir / "runs")
    summaries = {path: path.read_bytes() for path in out.rglob("summary.*")}
    capsys.readouterr()
    for where in (out, grok_dir):  # a whole results folder, or one family's
        assert cli.main(["report", str(where)]) == 2
        err = capsys.readouterr().err
        assert f"1 of its {n_runs + 1} records are cells no experiment of this code plans at profile smoke" in err
        assert "made by code 0ld0ld0" in err and f"`{earlier.name}`" in err and "--leave-out-unplanned" in err
        assert "Traceback" not in err and err.count("\n") == 1
        assert not (out / "REPORT.md").exists() and {p: p.read_bytes() for p in out.rglob("summary.*")} == summaries
    # asked to, it reports without it, and REPORT.md and README.md name what was left out and the flag
    assert cli.main(["report", str(out), "--leave-out-unplanned"]) == 0
    assert json.loads((grok_dir / "single" / "summary.json").read_text())["n_records"] == n_runs
    for name in ("REPORT.md", "README.md"):
        text = (out / name).read_text()
        assert f"`stiefel-attention report {out.as_posix()} --leave-out-unplanned`" in text
        assert "Left out of every summary" in text and f"`{earlier.name}`" in text
    # a summary no experiment would write now (an experiment since renamed): refused, flag or not
    stale = grok_dir / "renamed" / "summary.json"
    stale.parent.mkdir()
    stale.write_bytes(summaries[grok_dir / "single" / "summary.json"])
    assert cli.main(["report", str(out), "--leave-out-unplanned"]) == 2
    assert f"{stale.as_posix()}: this code writes no summary there" in capsys.readouterr().err
    # reproduce says so before certifying or running anything
    monkeypatch.setattr(family_module, "FAMILY_MODULES", ("grok",))  # no dataset needed to get that far
    argv = ["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1", "--no-progress"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "this code writes no summary there" in captured.err and "== certify" not in captured.out


def test_a_folder_read_beside_must_have_its_summaries_rebuilt_since_its_last_record(tmp_path, capsys):
    here, there = tmp_path / "results", tmp_path / "results-other"
    for root in (here, there):
        assert cli.main(smoke_args("grok", "single", root / "grok")) == 0
    capsys.readouterr()
    assert cli.main(["report", str(here), "--beside", str(there)]) == 2  # made by a command, never reported
    assert "grok/study (2 records, no summary)" in capsys.readouterr().err
    assert cli.main(["report", str(there)]) == 0
    # a record lands there (seed 1 of a study cell) and its summaries are not rebuilt
    rec = read_record(sorted((there / "grok" / "runs").glob("*.json"))[0])
    cell = Cell("grok", rec["name"].replace("-s0", "-s1"), {**rec["config"], "seed": 1, "split_seed": 1})
    write_json_atomic(
        cell.path(there / "grok" / "runs"), {**rec, "name": cell.name, "key": cell.key, "config": cell.config}
    )
    capsys.readouterr()
    assert cli.main(["report", str(here), "--beside", str(there)]) == 2
    err = capsys.readouterr().err
    assert f"--beside {there.as_posix()}: its summaries are behind its records: grok/" in err
    assert "grok/study (3 records, its summary covers 2)" in err and "Traceback" not in err
    assert (
        f"rebuild them first (stiefel-attention report {there.as_posix()})" in err and not (here / "REPORT.md").exists()
    )
    assert cli.main(["report", str(there)]) == 0
    assert cli.main(["report", str(here), "--beside", str(there)]) == 0
    assert (here / "REPORT.md").exists()


# --- 7, 8. a text too short, a device that is not there -------------------------------------------


def test_a_text_too_short_for_the_context_is_one_clear_error_up_front(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("x" * 150)
    assert cli.main(_lm_args(tmp_path / "out", short)) == 2
    err = capsys.readouterr().err
    assert "too short for a context of 32" in err and "validation part" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "main").exists()  # no empty summary either


@pytest.mark.parametrize("device", ["bogus", "cuda:7" if torch.cuda.is_available() else "cuda"])
def test_a_device_that_is_not_there_is_refused_once_before_any_run(tmp_path, capsys, device):
    assert cli.main([*smoke_args("grok", "single", tmp_path / "out"), "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device '{device}' cannot be used here" in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "runs").exists()


# --- 9. record files take the umask's mode ---------------------------------------------------------


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_records_are_written_with_the_umasks_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == mode


# --- 10, 11. the optimizer's state dicts and param groups ------------------------------------------


def test_a_foreign_state_dict_is_refused_at_load_time():
    w = nn.Parameter(random_frame(2, d=8, r=3))
    w.grad = torch.randn_like(w)
    adamw = torch.optim.AdamW([nn.Parameter(w.detach().clone())], lr=0.1)
    adamw.param_groups[0]["params"][0].grad = w.grad.clone()
    adamw.step()
    opt = StiefelAdam([w], lr=0.1)
    with pytest.raises(ValueError, match="not saved by StiefelAdam \\(a torch.optim optimizer's state dict"):
        opt.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="not saved by StiefelAdam"):
        opt.load_state_dict(StiefelSGD([w], lr=0.1).state_dict())
    mixed = StiefelAdam([{"params": [w], "stiefel": False}], lr=0.1)
    with pytest.raises(ValueError, match="holds frames \\(stiefel=True\\) here but AdamW parameters"):
        opt.load_state_dict(mixed.state_dict())
    opt.step()
    again = StiefelAdam([w], lr=0.1)
    again.load_state_dict(state_dict=opt.state_dict())  # its own kind, by keyword as DCP calls it
    assert torch.equal(again.state[w]["exp_avg"], opt.state[w]["exp_avg"])


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lr": -1.0}, "invalid learning rate"),
        ({"max_step": -1.0}, "invalid max_step"),
        ({"weight_decay": -0.1}, "invalid weight_decay"),
        ({"betas": (1.0, 0.9)}, "invalid betas"),
        ({"eps": -1.0}, "invalid eps"),
        ({"second_moment": "row"}, "second_moment must be"),
    ],
)
def test_an_added_param_group_is_checked_like_the_constructors(bad, match):
    opt = StiefelAdam([nn.Parameter(random_frame(1, d=6, r=2))], lr=0.1)
    with pytest.raises(ValueError, match=f"param_groups\\[1\\]: {match}"):
        opt.add_param_group({"params": [nn.Parameter(random_frame(1, d=6, r=2))], **bad})
    assert len(opt.param_groups) == 1
    sgd = StiefelSGD([nn.Parameter(random_frame(1, d=6, r=2))], lr=0.1)
    with pytest.raises(ValueError, match="param_groups\\[1\\]: invalid momentum"):
        sgd.add_param_group({"params": [nn.Parameter(random_frame(1, d=6, r=2))], "momentum": 1.5})


# --- 12. the meta device ------------------------------------------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, 2, 8, 32, causal=True) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


@pytest.mark.parametrize("qk", ["stiefel", "frozen", "parametrized", "euclidean"])
def test_an_attention_built_on_meta_and_reset_equals_one_built_directly(qk):
    torch.manual_seed(3)
    direct = StiefelAttention(16, 2, 4, qk=qk, qk_norm=True, temperature=True)
    with torch.device("meta"):
        lazy = StiefelAttention(16, 2, 4, qk=qk, qk_norm=True, temperature=True)
    assert {p.device.type for p in lazy.parameters()} == {"meta"}  # W_Q, W_K too
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.reset_parameters()
    for (name, a), b in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_model_built_on_meta_trains_after_to_empty_and_reset_parameters():
    with torch.device("meta"):
        model = _TinyLM()
        opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=1e-2, max_step=0.1)
    assert {p.device.type for _, p in frames(model)} == {"meta"} and opt.param_groups[-1]["stiefel"]
    model.to_empty(device="cpu")  # uninitialised memory
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert max(float(isometry_error(p)) for _, p in frames(model)) < 1e-5
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=1e-2, max_step=0.1)
    x = torch.randint(0, 11, (8, 12))
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5
    assert max(float(isometry_error(p)) for _, p in frames(model)) < 1e-5


def test_the_optimizer_takes_empty_frames_and_steps_around_them():
    empty = nn.Parameter(torch.empty(0, 8, 3))
    frame = nn.Parameter(random_frame(2, d=8, r=3))
    for opt in (
        StiefelAdam([empty, frame], lr=0.05, max_step=0.1),
        StiefelAdam([empty, frame], lr=0.05, batched=False),
        StiefelAdam([empty, frame], lr=0.05, max_step=0.1, nonfinite="skip"),
        StiefelSGD([empty, frame], lr=0.05, momentum=0.9),
    ):
        before = frame.detach().clone()
        empty.grad, frame.grad = torch.zeros_like(empty), torch.randn_like(frame)
        opt.step()
        assert not torch.equal(frame, before) and float(isometry_error(frame)) < 1e-5


def test_a_stiefelized_model_built_on_meta_trains_after_reset_frames():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50,
    )  # fmt: skip
    with torch.device("meta"):
        model = stiefelize(transformers.AutoModelForCausalLM.from_config(config))
    model.to_empty(device="cpu")
    model.init_weights()  # the model's own initialisation for everything but the frames
    reset_frames(model)
    assert max(float(isometry_error(p)) for _, p in frames(model)) < 1e-5
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=1e-2), lr=3e-3, max_step=0.1)
    batch = torch.randint(0, 50, (2, 12))
    first = float(model(input_ids=batch, labels=batch).loss)
    for _ in range(5):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(model(input_ids=batch, labels=batch).loss) < first
    assert max(float(isometry_error(p)) for _, p in frames(model)) < 1e-5


# --- 13. stiefelize is all or nothing -------------------------------------------------------------------


def test_stiefelize_refuses_a_half_converted_model_without_converting_anything():
    layers = nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(3)])
    stiefelize(layers[2])
    before = {k: v.clone() for k, v in layers[0].state_dict().items()}
    with pytest.raises(StiefelizeError, match="already stiefelized, in part .*nothing was converted"):
        stiefelize(layers)
    assert frames(layers[0]) == [] and frames(layers[1]) == []
    assert all(torch.equal(before[k], v) for k, v in layers[0].state_dict().items())


def test_cells_are_claimed_one_at_a_time_so_a_second_command_can_take_the_rest(tmp_path, monkeypatch):
    """A command claims each cell only when it is about to run it: another process that starts meanwhile finds
    the later cells free, takes one, and this command leaves it to that process and goes on with the others."""
    runs = tmp_path / "runs"
    cells = [_grok_cell(s) for s in range(3)]
    other: list[subprocess.Popen] = []
    real = runner_module.execute_cell

    def run_and_meanwhile_start_another(cell, threads=None):
        if not other:  # while the first cell runs, a second command claims the second cell
            other.append(_hold_claim(runs, cells[1], {"profile": "smoke"}))
        return real(cell, threads)

    monkeypatch.setattr(runner_module, "execute_cell", run_and_meanwhile_start_another)
    try:
        records, failures = run_cells(cells, runs, InlineExecutor(), progress=False)
        assert failures == [] and set(records) == {cells[0].key, cells[2].key}
    finally:
        for proc in other:
            proc.kill()
            proc.wait(timeout=10)


def test_the_heartbeat_of_a_long_run_counts_in_its_familys_unit(capsys):
    from stiefel_attention.bench.family import get_family
    from stiefel_attention.bench.runner import Heartbeat

    assert get_family("grok").progress_unit == "epoch" and get_family("lm").progress_unit == "step"
    Heartbeat("lm-cell", 60.0, get_family("lm").progress_unit)(600, 600)  # the last call always prints
    assert capsys.readouterr().err.strip() == "lm-cell: step 600/600 (100%)"
    # a run resumed at epoch 1000: its rate counts from there; a line at most every 60 s
    now = [0.0]
    beat = Heartbeat("grok-cell", 60.0, "epoch", clock=lambda: now[0])
    for t, epoch in ((0.0, 1000), (30.0, 1200), (100.0, 1700)):
        now[0] = t
        beat(epoch, 20000)
    assert capsys.readouterr().err.strip() == "grok-cell: epoch 1700/20000 (8%), 7 epochs/s, about 44 min left"


def test_without_a_bar_each_finished_run_is_a_line_of_the_log(tmp_path, capsys):
    cells = [_grok_cell(s) for s in range(2)]
    run_cells(cells, tmp_path / "runs", InlineExecutor(), progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("finished ")]
    assert lines == [f"finished {c.name}: {c.path(tmp_path / 'runs')}" for c in cells]


def test_the_folder_is_checked_again_only_while_nothing_of_ours_marks_it(tmp_path, monkeypatch):
    """check_folder reads every record in the folder (seconds in a large one): it runs at the start and before a
    claim only while the folder holds neither a claim of this command nor a record of its cells."""
    calls = []
    real = runner_module.check_folder
    monkeypatch.setattr(runner_module, "check_folder", lambda *a, **k: calls.append(1) or real(*a, **k))
    cells = [_grok_cell(s) for s in range(3)]
    records, failures = run_cells(cells, tmp_path / "runs", InlineExecutor(), progress=False)
    assert failures == [] and len(records) == 3
    assert len(calls) == 2  # at the start, and before the first claim; then our first record marks the folder


def test_reproduce_goes_on_past_an_experiment_it_cannot_plan_and_says_so(tmp_path, monkeypatch, capsys):
    # an experiment that cannot be planned (e.g. controls after a failed sweep run) stops only itself
    monkeypatch.setattr(family_module, "FAMILY_MODULES", ("grok",))
    monkeypatch.setattr(type(grok.FAMILY), "reproduce_order", ("decay", "single"))
    planned = type(grok.FAMILY).cells

    def cells(self, experiment, profile, seeds=None, **options):
        if experiment == "decay":
            raise NotReady("decay awaits the sweep's rates (stand-in)")
        return planned(self, experiment, profile, seeds, **options)

    monkeypatch.setattr(type(grok.FAMILY), "cells", cells)
    out = tmp_path / "repro"
    assert cli.main(["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "not run: grok decay: decay awaits the sweep's rates (stand-in)" in captured.err
    assert "the same command resumes after the fix" in captured.err and "Traceback" not in captured.err
    assert len(list((out / "grok" / "runs").glob("*.json"))) == 2  # the experiment after it ran
    assert "[grok/single](grok/single/summary.md) (2/2 runs) | smoke" in (out / "REPORT.md").read_text()
