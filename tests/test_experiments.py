"""CIFAR harness: pairing, resume, atomic records, statistics, reports and the command line.

Runs use a generated canonical-layout dataset (class-balanced, random pixels) so they take
seconds; one test runs the real smoke experiment on the shared JPEG archive when it is present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as sps

from helpers import make_tar, smoke_args, write_pickle_batches
from stiefel_attention.bench import cli
from stiefel_attention.bench import family as family_module
from stiefel_attention.bench.cifar import run as cifar
from stiefel_attention.bench.cifar.data import ENV_CACHE, ENV_CIFAR10
from stiefel_attention.bench.cifar.report import cifar_summary, write_cifar_report
from stiefel_attention.bench.family import with_data
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.records import Cell, write_json_atomic
from stiefel_attention.bench.report import rebuild_all, verdict
from stiefel_attention.bench.report.stats import paired_comparison
from stiefel_attention.bench.runner import InlineExecutor, LocalExecutor, run_cells

REAL_ARCHIVE = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "cifar10-jpeg.tar.gz"
N_TRAIN = 100  # per run; the fake set has 30 images per class


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, tmp_path_factory):
    monkeypatch.delenv(ENV_CIFAR10, raising=False)
    monkeypatch.setenv(ENV_CACHE, str(tmp_path_factory.getbasetemp() / "cifar-cache"))
    cifar.cached_dataset.cache_clear()


@pytest.fixture(scope="module")
def fake_cifar(tmp_path_factory) -> str:
    """cifar-10-batches-py with 30 train and 10 test images per class."""
    root = tmp_path_factory.mktemp("fake") / "cifar-10-batches-py"
    train_labels = np.repeat(np.arange(10), 30)
    np.random.default_rng(0).shuffle(train_labels)
    write_pickle_batches(root, train_labels, np.repeat(np.arange(10), 10))
    return str(root)


def _smoke_cells(experiment: str, data: str, seeds: int = 2) -> list[Cell]:
    cells = with_data(cifar.cells(experiment, "smoke", seeds, n=N_TRAIN), cifar.FAMILY.data_key({"data": data}))
    out = []
    for c in cells:
        cfg = dict(c.config, n_test=None, epochs=1)
        out.append(Cell(c.family, c.name, cfg, {"data": data, "device": "cpu"}))
    return out


# --- statistics ------------------------------------------------------------------------------


def test_paired_comparison_matches_scipy_and_formulas():
    rng = np.random.default_rng(1)
    base = rng.normal(60, 2, size=12)
    arm = base + rng.normal(1.5, 1.0, size=12)
    st = paired_comparison(arm, base)
    d = arm - base
    assert st["n_seeds"] == 12
    assert st["mean_diff"] == pytest.approx(d.mean(), abs=1e-12)
    half = sps.t.ppf(0.975, 11) * d.std(ddof=1) / math.sqrt(12)
    assert st["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], abs=1e-12)
    assert st["t"] == pytest.approx(d.mean() / (d.std(ddof=1) / math.sqrt(12)), rel=1e-10)
    assert st["p_t"] == pytest.approx(sps.ttest_rel(arm, base).pvalue, rel=1e-10)
    assert st["p_wilcoxon"] == pytest.approx(sps.wilcoxon(arm, base).pvalue, rel=1e-10)
    assert st["wins"] == int((d > 0).sum()) and st["losses"] == int((d < 0).sum())


def test_wilcoxon_floor_with_twelve_pairs_of_one_sign():
    # all 12 differences positive and distinct: exact two-sided p = 2 / 2^12
    st = paired_comparison(np.arange(1, 13) + 50.0, np.full(12, 50.0))
    assert st["p_wilcoxon"] == pytest.approx(2 / 4096, rel=1e-9)
    assert st["wins"] == 12 and st["supported"]


def test_paired_comparison_degenerate_inputs():
    same = paired_comparison([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert math.isnan(same["p_wilcoxon"]) and math.isnan(same["t"]) and not same["supported"]
    one = paired_comparison([1.0], [0.0])
    assert one["mean_diff"] == 1.0 and not one["supported"]
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        paired_comparison([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    "kind, paper, mean, ci, supported, expected",
    [
        ("effect", 6.79, 6.5, [6.0, 7.0], True, "replicates"),
        ("effect", 6.79, 2.0, [1.5, 2.5], True, "direction replicates, size does not"),
        ("effect", 6.79, -2.0, [-2.5, -1.5], True, "opposite sign"),
        ("effect", 6.79, 0.5, [-1.0, 2.0], False, "no significant difference"),
        ("null", 0.0, 0.1, [-0.5, 0.7], False, "replicates: no significant"),
        ("null", 0.0, 1.5, [1.0, 2.0], True, "does not replicate: significant"),
        ("control", None, 1.0, [0.5, 1.5], True, "control"),
    ],
)
def test_verdicts(kind, paper, mean, ci, supported, expected):
    st = {"n_seeds": 12, "mean_diff": mean, "ci95": ci, "supported": supported, "p_t": 0.01, "p_wilcoxon": 0.01}
    assert expected in verdict(kind, paper, st)


# --- pairing ---------------------------------------------------------------------------------


def test_split_indices_are_balanced_seeded_and_never_touch_test():
    labels = torch.arange(10).repeat_interleave(600)
    cfg = cifar.make_config("cpu", "adamw", 0, 1000)
    a, none = cifar.split_indices(labels, cfg, cifar._generators(0)[0])
    b, _ = cifar.split_indices(labels, cfg, cifar._generators(0)[0])
    c, _ = cifar.split_indices(labels, cfg, cifar._generators(1)[0])
    assert none is None and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.bincount(labels[a], minlength=10).tolist() == [100] * 10
    val_cfg = cifar.make_config("cpu", "adamw", 0, 1000, split="val", n_val=500)
    train_idx, val_idx = cifar.split_indices(labels, val_cfg, cifar._generators(0)[0])
    assert len(set(train_idx.tolist()) & set(val_idx.tolist())) == 0
    assert torch.bincount(labels[val_idx], minlength=10).tolist() == [50] * 10
    # the validation split does not depend on the run's seed
    _, val_idx_1 = cifar.split_indices(labels, val_cfg, cifar._generators(1)[0])
    assert torch.equal(val_idx, val_idx_1)


def test_arms_of_a_seed_share_subset_init_and_order(fake_cifar):
    cells = _smoke_cells("main", fake_cifar)
    records, failures = run_cells(cells, Path(fake_cifar).parent / "runs-pairing", InlineExecutor(), progress=False)
    assert not failures
    by_seed: dict[int, set] = {}
    for rec in records.values():
        fp = rec["pairing"]
        by_seed.setdefault(rec["config"]["seed"], set()).add(
            (fp["train_subset_sha256"], fp["init_sha256"], fp["order_sha256"])
        )
    assert set(by_seed) == {0, 1}
    assert all(len(v) == 1 for v in by_seed.values()), by_seed  # identical across the 5 arms
    assert by_seed[0] != by_seed[1]
    for rec in records.values():
        assert rec["config"]["arm"] in cifar.MAIN_ARMS
        if rec["config"]["arm"].startswith("stiefel") or rec["config"]["arm"] == "frozen":
            assert rec["metrics"]["qk_isometry_error"] < 1e-5


# --- runner: records, resume, sharing --------------------------------------------------------


def test_run_cells_writes_records_and_resumes(fake_cifar, tmp_path, monkeypatch):
    cells = _smoke_cells("eps", fake_cifar, seeds=1)[:2]
    records, failures = run_cells(cells, tmp_path, InlineExecutor(), progress=False)
    assert not failures and len(records) == 2
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == sorted(c.path(tmp_path).name for c in cells)
    rec = json.loads(cells[0].path(tmp_path).read_text())
    assert rec["config"] == cells[0].config and rec["key"] == cells[0].key
    assert {"final_eval_acc", "best_eval_acc", "qk_isometry_error", "movement_median"} <= set(rec["metrics"])
    assert len(rec["curves"]["eval_acc"]) == len(rec["curves"]["epoch"]) >= 1
    assert rec["code_version"] and rec["timings"]["total_s"] > 0

    def boom(*a, **k):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(cifar, "run", boom)
    again, failures = run_cells(cells, tmp_path, InlineExecutor(), progress=False)
    assert not failures and again.keys() == records.keys()


def test_experiments_share_identical_runs():
    main = {c.key for c in cifar.cells("main", "cpu", 12)}
    ablation = {c.key for c in cifar.cells("ablation", "cpu", 12)}
    movement = {c.key for c in cifar.cells("movement", "cpu", 12)}
    assert len(main) == 60 and len(ablation) == 60
    assert len(main & ablation) == 36  # adamw, stiefel-adam, stiefel-sgd x 12 seeds
    assert movement <= main
    eps = cifar.cells("eps", "cpu", 12)
    assert {c.key for c in eps if c.config["frame_eps"] == 1e-8} <= main


def test_a_failing_run_is_reported_and_others_are_kept(fake_cifar, tmp_path, monkeypatch):
    cells = _smoke_cells("movement", fake_cifar, seeds=1)
    real_run = cifar.run

    def flaky(cfg, **kw):
        if cfg["arm"] == "stiefel-sgd":
            raise FloatingPointError("diverged")
        return real_run(cfg, **kw)

    monkeypatch.setattr(cifar, "run", flaky)
    records, failures = run_cells(cells, tmp_path, InlineExecutor(), progress=False)
    assert [c.config["arm"] for c, _ in failures] == ["stiefel-sgd"]
    assert len(records) == 2 and len(list(tmp_path.glob("*.json"))) == 2


def test_write_json_atomic_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "r.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}  # the old record is intact
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # and no temp file is left


def test_local_executor_runs_in_worker_processes(fake_cifar, tmp_path, monkeypatch):
    from stiefel_attention.bench import runner

    cells = _smoke_cells("movement", fake_cifar, seeds=1)[:2]
    inline, _ = run_cells(cells, tmp_path / "a", InlineExecutor(threads=1), progress=False)

    def not_here(*args, **kwargs):
        raise AssertionError("ran in the parent process")

    monkeypatch.setattr(runner, "execute_cell", not_here)  # the spawned workers import their own, unpatched
    pooled, failures = run_cells(cells, tmp_path / "b", LocalExecutor(jobs=2), progress=False)
    assert not failures and set(pooled) == set(inline)
    for key in inline:  # same seeds, same code: same numbers, whichever executor
        assert pooled[key]["metrics"]["final_eval_acc"] == inline[key]["metrics"]["final_eval_acc"]
        assert pooled[key]["curves"]["train_loss"] == pytest.approx(inline[key]["curves"]["train_loss"], rel=1e-6)


# --- reports ---------------------------------------------------------------------------------


def _fake_record(arm, seed, acc, **cfg):
    config = dict(
        arm=arm,
        seed=seed,
        n_train=cfg.get("n_train", 10000),
        frame_eps=cfg.get("frame_eps", 1e-8),
        lr=1e-3,
        frame_lr=1e-2,
        split="test",
    )
    return {
        "config": config,
        "metrics": {"final_eval_acc": acc},
        "curves": {"movement_median": cfg.get("movement", [1.0, 1.0])},
    }


def test_summary_and_report_files(tmp_path):
    rng = np.random.default_rng(0)
    recs = []
    for s in range(12):
        base = 0.55 + 0.01 * rng.standard_normal()
        recs += [
            _fake_record("adamw", s, base),
            _fake_record("stiefel-adam", s, base + 0.02 + 0.002 * rng.standard_normal()),
            _fake_record("stiefel-sgd", s, base + 0.005),
            _fake_record("frozen", s, base + 0.004),
            _fake_record("adamw-orthoinit", s, base + 0.001 * rng.standard_normal()),
        ]
    summary = write_cifar_report(tmp_path, "main", recs, "cpu")
    first = summary["comparisons"][0]
    assert (first["arm"], first["baseline"]) == ("stiefel-adam", "adamw")
    assert first["n_seeds"] == 12 and first["wins"] == 12
    assert first["mean_diff"] == pytest.approx(2.0, abs=0.3)
    assert "size does not" in first["verdict"]  # +2 pp vs the paper's +6.79 pp
    assert json.loads((tmp_path / "main" / "summary.json").read_text())["comparisons"][0]["wins"] == 12
    md = (tmp_path / "main" / "summary.md").read_text()
    assert "stiefel-adam vs adamw" in md and "+6.79" in md
    assert (tmp_path / "main" / "paired_differences.png").stat().st_size > 1000


def test_scaling_and_movement_summaries():
    recs = []
    for n, lead in ((1000, 0.01), (5000, 0.02), (10000, 0.03)):
        for s in range(5):
            recs += [
                _fake_record("adamw", s, 0.5 + 0.001 * s, n_train=n),
                _fake_record("stiefel-adam", s, 0.5 + lead + 0.002 * (s % 2), n_train=n),
            ]
    summary = cifar_summary("scaling", recs)
    assert [c["n_train"] for c in summary["comparisons"]] == [1000, 5000, 10000]
    assert summary["lead_grows_with_n"] is True
    mv = [_fake_record("adamw", s, 0.5, movement=[30.0, 60.0]) for s in range(2)]
    mv += [_fake_record("stiefel-sgd", s, 0.5, movement=[1.0, 2.0]) for s in range(2)]
    out = cifar_summary("movement", mv)
    assert out["ratios"]["stiefel-sgd"]["median"] == pytest.approx(30.0)
    assert out["ratios"]["stiefel-sgd"]["verdict"].startswith("replicates")


def test_claim_rows_wait_for_every_planned_run_of_their_arms():
    from stiefel_attention.bench.cifar.report import claim_rows

    def verdicts(exp, recs, by_arm=None, **plan):
        summary = {**cifar_summary(exp, recs), **plan}
        if by_arm:
            summary["planned_by_arm"] = by_arm
        return [row[4] for row in claim_rows(exp, summary, "link", "cpu")]

    ahead = [_fake_record(a, s, 0.5 + (0.02 + 0.001 * (s % 3)) * (a != "adamw")) for s in range(6) for a in ARMS2]
    [final] = verdicts("main", ahead)  # stiefel-adam +2 pp in every seed: an effect, not the paper's size
    assert final.startswith("direction replicates, size does not")
    open_plan = {"adamw": [6, 8], "stiefel-adam": [6, 8], "stiefel-sgd": [0, 8]}  # an arm not compared: not named
    assert verdicts("main", ahead, open_plan) == [f"so far (adamw 6/8, stiefel-adam 6/8 runs): {final}"]
    level = [_fake_record(a, s, 0.5 + 0.01 * (s % 2) * (a == "adamw")) for s in range(3) for a in ARMS2]
    [none] = verdicts("main", level, {"adamw": [5, 5], "stiefel-adam": [3, 5]})
    assert none.startswith("not decided yet (stiefel-adam 3/5 runs); at these seeds: does not replicate: no signif")
    [done] = verdicts("main", level, {"adamw": [5, 5], "stiefel-adam": [5, 5]})  # every planned run finished
    assert done.startswith("does not replicate: no signif")
    # the monotone-lead row of scaling and the movement ratio wait too
    grows = [
        r
        for s in range(3)
        for a in ARMS2
        for r in [_fake_record(a, s, 0.5 + 0.01 * k * (a != "adamw"), n_train=n) for k, n in ((1, 1000), (2, 50000))]
    ]
    assert verdicts("scaling", grows)[-1] == "replicates"
    assert (
        verdicts("scaling", grows, {"adamw": [6, 8], "stiefel-adam": [6, 8]})[-1]
        == "so far (adamw 6/8, stiefel-adam 6/8 runs): replicates"
    )
    mv = [
        _fake_record(a, s, 0.5, movement=[30.0 if a == "adamw" else 1.0])
        for s in range(2)
        for a in ("adamw", "stiefel-sgd")
    ]
    assert verdicts("movement", mv)[0].startswith("replicates: median 30x")
    assert verdicts("movement", mv, {"adamw": [2, 3], "stiefel-sgd": [2, 3]})[0].startswith(
        "so far (adamw 2/3, stiefel-sgd 2/3 runs): replicates"
    )
    # a plan without arms to tell apart says how many of its runs have finished; a complete one is final
    assert verdicts("movement", mv, n_planned_done=4, n_planned=6)[0].startswith("so far (4/6 runs): replicates")
    assert verdicts("movement", mv, n_planned_done=6, n_planned=6)[0].startswith("replicates")


ARMS2 = ("adamw", "stiefel-adam")


# --- command line ----------------------------------------------------------------------------


def test_cli_bad_data_path_is_one_clear_line(tmp_path, capsys):
    rc = cli.main(
        [
            "cifar",
            "--experiment",
            "main",
            "--profile",
            "smoke",
            "--data",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "error:" in err and "--data" in err and ENV_CIFAR10 in err
    assert "Traceback" not in err


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["cifar", "--experiment", "nonsense"])
    assert exc.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # refused while the arguments are read
        cli.main(["cifar", "--experiment", "main", "--profile", "smoke", "--seeds", "0"])
    assert exc.value.code == 2
    assert "argument --seeds: a count of seeds must be >= 1, got 0" in capsys.readouterr().err


def test_cli_executor_ray_without_ray_says_how_to_install(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    rc = cli.main(["grok", "--experiment", "single", "--profile", "smoke", "--executor", "ray", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'stiefel-attention[ray]'" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything ran


def test_reproduce_certifies_runs_every_step_and_writes_the_report(fake_cifar, tmp_path, monkeypatch, capsys):
    # the real step list takes ~2 min at the smoke size; two steps (one per family) check the wiring
    monkeypatch.setattr(family_module, "FAMILY_MODULES", ("cifar", "grok"))  # the other families: their own tests
    monkeypatch.setattr(type(cifar.FAMILY), "reproduce_order", ("main",))
    monkeypatch.setattr(type(grok.FAMILY), "reproduce_order", ("single",))
    for key, value in (("n_main", 100), ("n_test", None), ("n_val", 50), ("epochs", 1)):
        monkeypatch.setitem(cifar.PROFILES["smoke"], key, value)
    out = tmp_path / "repro"
    assert (
        cli.main(
            ["reproduce", "--profile", "smoke", "--data", fake_cifar, "--out", str(out), "--jobs", "1", "--no-progress"]
        )
        == 0
    )
    checks = json.loads((out / "certify.json").read_text())["checks"]
    # every property's checks ran (an empty list passes all())
    assert {c["property"].split()[0] for c in checks} == {"1", "2", "3", "4", "5", "6", "7"}
    assert all(c["passed"] for c in checks)
    assert (
        len(list((out / "cifar" / "runs").glob("*.json"))) == 10
        and len(list((out / "grok" / "runs").glob("*.json"))) == 2
    )
    report = (out / "REPORT.md").read_text()
    assert "[cifar/main](cifar/main/summary.md) (10/10 runs) | smoke" in report
    assert "[grok/single](grok/single/summary.md) (2/2 runs) | smoke" in report
    assert "claim by claim:" in capsys.readouterr().out
    # a results folder of another profile is refused before anything runs
    assert cli.main(["reproduce", "--profile", "cpu", "--data", fake_cifar, "--out", str(out), "--no-progress"]) == 2
    assert "holds runs of profile smoke (records)" in capsys.readouterr().err


def test_cli_smoke_on_generated_data(fake_cifar, tmp_path, capsys):
    args = smoke_args("cifar", "movement", str(tmp_path), "--seeds", "2", "--n", str(N_TRAIN), "--data", fake_cifar)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "adamw / arm per-step movement" in out
    assert len(list((tmp_path / "runs").glob("*.json"))) == 6
    summary = json.loads((tmp_path / "movement" / "summary.json").read_text())
    assert set(summary["ratios"]) == {"stiefel-sgd", "stiefel-adam"}
    assert cli.main(args) == 0  # resume: nothing left to run, same report


@pytest.mark.slow
@pytest.mark.skipif(not REAL_ARCHIVE.exists(), reason="shared CIFAR-10 archive not present")
def test_real_smoke_experiment_on_shared_data(tmp_path):
    args = smoke_args("cifar", "main", str(tmp_path), "--data", str(REAL_ARCHIVE))
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "main" / "summary.json").read_text())
    assert summary["n_records"] == 10
    accs = [d["mean"] for d in summary["arms"].values()]
    assert all(10.0 < a < 60.0 for a in accs)  # above chance (10%) after 2 short epochs


def test_report_rebuilds_summaries_from_records_alone(fake_cifar, tmp_path, capsys):
    args = smoke_args(
        "cifar", "movement", str(tmp_path / "cifar"), "--seeds", "2", "--n", str(N_TRAIN), "--data", fake_cifar
    )
    assert cli.main(args) == 0
    first = json.loads((tmp_path / "cifar" / "movement" / "summary.json").read_text())
    for p in (tmp_path / "cifar" / "movement").iterdir():
        p.unlink()  # only the run records remain
    assert cli.main(["report", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "cifar" / "movement" / "summary.json").read_text())
    assert again["ratios"] == first["ratios"]
    report = (tmp_path / "REPORT.md").read_text()
    assert "24-40x" in report and "cifar/movement" in report
    assert "(cifar/movement/movement_ratio.png)" in report  # the plot is linked beside the claim
    assert "Not yet run" in report and "grok/study" in report
    readme = (tmp_path / "README.md").read_text()
    assert "[`REPORT.md`](REPORT.md)" in readme and "Run records (`cifar/runs`:" in readme
    assert "One verdict per testbed (the section of REPORT.md):\n\n- CIFAR-10 patches (PatchViT): " in readme
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    capsys.readouterr()
    for other in (tmp_path / "missing", tmp_path):  # --beside: another existing folder, never this one
        assert cli.main(["report", str(tmp_path), "--beside", str(other)]) == 2
        assert "--beside" in capsys.readouterr().err
    other = tmp_path.parent / f"{tmp_path.name}-other"
    other.mkdir()
    assert cli.main(["report", str(tmp_path), "--beside", str(other)]) == 0
    assert (
        f"Generated by `stiefel-attention report {tmp_path.as_posix()} --beside {other.as_posix()}`"
        in (tmp_path / "REPORT.md").read_text()
    )


def _cell_record(cell, acc: float) -> dict:
    return {
        "name": cell.name,
        "key": cell.key,
        "family": cell.family,
        "config": cell.config,
        "metrics": {"final_eval_acc": acc},
        "curves": {"movement_median": [1.0]},
    }


def test_report_never_pools_scaling_runs_into_main(tmp_path):
    # The n=1k scaling runs share arm and seed with main's n=10k runs; a rebuilt main summary must
    # hold the n=10k runs only (a pooled one once reported +3.3 pp where the truth was -0.1 pp).
    runs = tmp_path / "cifar" / "runs"
    lead = {1000: 0.05, 5000: 0.03, 10000: 0.01, 50000: 0.02}
    for exp in ("main", "scaling"):
        for cell in cifar.cells(exp, "cpu", 3):
            n, arm = cell.config["n_train"], cell.config["arm"]
            seed = cell.config["seed"]  # per-seed noise in the difference that averages to zero over 3 seeds
            acc = 0.5 + 0.001 * seed + (lead.get(n, 0.0) + 0.0005 * (seed - 1) if arm == "stiefel-adam" else 0.0)
            write_json_atomic(cell.path(runs), _cell_record(cell, acc))
    rebuild_all(tmp_path)
    main = json.loads((tmp_path / "cifar" / "main" / "summary.json").read_text())
    assert main["n_records"] == 5 * 3
    [vs_adamw] = [c for c in main["comparisons"] if (c["arm"], c["baseline"]) == ("stiefel-adam", "adamw")]
    assert vs_adamw["mean_diff"] == pytest.approx(1.0) and vs_adamw["n_seeds"] == 3
    scaling = json.loads((tmp_path / "cifar" / "scaling" / "summary.json").read_text())
    assert {c["n_train"]: round(c["mean_diff"], 6) for c in scaling["comparisons"]} == {
        1000: 5.0,
        5000: 3.0,
        10000: 1.0,
        50000: 2.0,
    }


def test_runs_that_no_report_of_the_folder_would_take_are_refused_before_they_run(
    tmp_path, fake_cifar, capsys, monkeypatch
):
    # main at the profile's n is in the folder; main at another --n there would be left out of every summary
    for key, value in (("n_test", None), ("n_val", 50)):  # within the fake set
        monkeypatch.setitem(cifar.PROFILES["smoke"], key, value)
    out = tmp_path / "cifar"
    data = cifar.FAMILY.data_key({"data": fake_cifar})
    for cell in with_data(cifar.cells("main", "smoke", 2), data):
        write_json_atomic(cell.path(out / "runs"), _cell_record(cell, 0.5))
    before = sorted(p.name for p in (out / "runs").glob("*.json"))
    argv = ["cifar", "--experiment", "main", "--profile", "smoke", "--data", fake_cifar, "--no-progress", "--jobs", "1"]
    n_other = 50
    assert cli.main([*argv, "--n", str(n_other), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"would be records that no summary of {out} takes" in err and "--out DIR" in err and "Traceback" not in err
    assert sorted(p.name for p in (out / "runs").glob("*.json")) == before and not (out / "main").exists()
    # in a folder of their own they are that experiment, and report takes every record
    assert cli.main([*argv, "--n", str(n_other), "--out", str(tmp_path / "other" / "cifar"), "--seeds", "1"]) == 0
    assert json.loads((tmp_path / "other" / "cifar" / "main" / "summary.json").read_text())["n_records"] == 5
    assert cli.main(["report", str(tmp_path / "other")]) == 0


def test_report_refuses_mixed_profiles_and_cli_keeps_smoke_out_of_results(tmp_path, fake_cifar, monkeypatch):
    runs = tmp_path / "cifar" / "runs"
    for profile in ("cpu", "smoke"):
        cell = cifar.cells("main", profile, 1)[0]
        write_json_atomic(cell.path(runs), _cell_record(cell, 0.5))
    with pytest.raises(ValueError, match="mixes records of profiles cpu, smoke"):
        rebuild_all(tmp_path)
    # the experiment commands refuse to add records of one profile to a folder of another
    assert (
        cli.main(
            [
                "cifar",
                "--experiment",
                "main",
                "--profile",
                "paper",
                "--data",
                fake_cifar,
                "--out",
                str(tmp_path / "cifar"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert cli.default_results_dir("cpu").as_posix() == "results"
    assert cli.default_results_dir("smoke").as_posix() == "results-smoke"


def test_an_unreadable_record_is_skipped_with_a_warning(tmp_path, capsys):
    from stiefel_attention.bench.records import read_record
    from stiefel_attention.bench.report import load_records

    good = {"family": "grok", "name": "a", "key": "k", "config": {"profile": "smoke"}, "metrics": {}}
    (tmp_path / "a.json").write_text(json.dumps(good))
    (tmp_path / "b.json").write_text('{"family": "grok", "name": "b", "conf')  # a truncated copy
    assert read_record(tmp_path / "missing.json") is None and capsys.readouterr().err == ""
    assert load_records(tmp_path) == [good]
    err = capsys.readouterr().err
    assert "unreadable record" in err and "b.json" in err and "a.json" not in err
    assert load_records(tmp_path, family="cifar") == []


def test_without_the_bench_extra_the_suite_commands_say_what_to_install(monkeypatch, capsys):
    def missing():
        raise ImportError("No module named 'scipy'", name="scipy")

    monkeypatch.setattr(cli, "all_families", missing)
    assert cli.main(["grok", "--experiment", "single", "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert "needs scipy: pip install 'stiefel-attention[bench]'" in err and "Traceback" not in err
    assert cli.main(["report", "results"]) == 2
    parser = cli.build_parser()  # certify and demo stay available: they need the library alone
    assert parser.parse_args(["certify", "--seed", "3"]).func is cli._cmd_certify


def test_cifar_downloads_itself_when_no_source_is_found(fake_cifar, tmp_path, monkeypatch, capsys):
    """A fresh machine with network and no CIFAR-10: the canonical archive is fetched into data/ (a fake server)."""
    import hashlib
    import io
    import urllib.request

    from stiefel_attention.bench.cifar import data as cifar10

    payload = make_tar(Path(fake_cifar).parent, tmp_path / "served.tar.gz").read_bytes()
    requested = []
    monkeypatch.setattr(
        urllib.request, "urlopen", lambda url, timeout=None: requested.append(url) or io.BytesIO(payload)
    )
    monkeypatch.setattr(cifar10, "CIFAR10_MD5", hashlib.md5(payload).hexdigest())
    work = tmp_path / "fresh" / "machine"  # nothing at ../shared/... either
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    args = ["cifar", "--experiment", "main", "--profile", "smoke", "--seeds", "1", "--out", str(tmp_path / "out")]
    assert cli.main([*args, "--no-download", "--jobs", "1", "--no-progress"]) == 2
    assert "No CIFAR-10 source found" in capsys.readouterr().err and not requested
    for key, value in (("n_main", 100), ("n_test", None), ("epochs", 1)):
        monkeypatch.setitem(cifar.PROFILES["smoke"], key, value)
    assert cli.main([*args, "--jobs", "1", "--no-progress"]) == 0
    assert requested == [cifar10.CIFAR10_URL] and (work / "data" / "cifar-10-batches-py" / "test_batch").is_file()
    assert "downloading the canonical archive" in capsys.readouterr().err
    cifar.cached_dataset.cache_clear()
    assert cli.main([*args, "--jobs", "1", "--no-progress"]) == 0 and len(requested) == 1  # found in data/ now


def test_cifar_download_without_network_says_what_to_do(tmp_path, monkeypatch, capsys):
    import urllib.error
    import urllib.request

    def offline(url, timeout=None):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    work = tmp_path / "fresh" / "machine"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert cli.main(["cifar", "--experiment", "main", "--profile", "smoke", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no network" in err and "--data" in err and "Traceback" not in err


@pytest.mark.parametrize("folder", ["results", "results-paper"])
def test_every_committed_record_is_still_part_of_an_experiment(folder):
    """A change that re-keys a cell (its resolved config) would orphan its committed record, run it again, and make
    `report` refuse the folder; records of a superseded protocol belong in results-pilot/, not here."""
    from stiefel_attention.bench.report import check_placed, place_records

    committed = Path(__file__).resolve().parents[1] / folder
    if not committed.is_dir():
        pytest.skip(f"no {folder}/ in this checkout")
    placements = [place_records(committed / fam.name, fam) for fam in family_module.all_families()]
    assert {p.family.name: [r["name"] for r in p.unplaced] for p in placements if p.unplaced} == {}
    assert [s for p in placements for s in p.stale] == []
    check_placed(placements)
    assert sum(len(p.by_key) for p in placements) > 0


@pytest.mark.parametrize("profile", ["smoke", "cpu", "paper"])
def test_every_run_an_experiment_plans_is_one_that_report_takes(profile, tmp_path):
    """What reproduce runs (every experiment's default command) and what report summarises are the same cells: a run
    the first makes and the second leaves out would stop reproduce (the commands refuse such runs up front)."""
    from stiefel_attention.bench.errors import NotReady
    from stiefel_attention.bench.report import place_records

    for fam in family_module.all_families():
        to_come = []
        for experiment in fam.experiments:
            try:
                planned = fam.cells(experiment, profile)
            except NotReady:  # not planned yet at this profile: its command refuses too
                continue
            to_come += planned
        placement = place_records(tmp_path / fam.name, fam, to_come)
        assert [r["name"] for r in placement.unplaced] == [], fam.name


def test_the_committed_results_regenerate_byte_for_byte(tmp_path, monkeypatch):
    """Every summary, plot and REPORT.md of results/ and results-paper/ is what `report` makes of the committed
    records with this code: a change that alters any of them must regenerate and commit them. Tracked files only,
    so records of runs still in flight in this checkout do not count."""
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "results", "results-paper"], cwd=repo, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    tracked = [name for name in listed.decode().split("\0") if name]
    if not tracked:
        pytest.skip("no committed results in this checkout")
    for name in tracked:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)  # REPORT.md quotes the command as run, with these relative paths
    assert cli.main(["report", "results-paper", "--beside", "results"]) == 0
    assert cli.main(["report", "results", "--beside", "results-paper"]) == 0
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert [name for name in made if name not in tracked] == []  # nothing the commit lacks
    assert [name for name in tracked if (tmp_path / name).read_bytes() != (repo / name).read_bytes()] == []


def test_the_pilot_folder_is_refused_by_this_code_rather_than_reported_without_its_records():
    """results-pilot/ holds an earlier protocol's cells; this code plans 4 of its 135 records, so a report by it would
    shrink the pilot's summaries. It is reported with the code that made it (DEVELOPERS.md)."""
    from stiefel_attention.bench.errors import UserError
    from stiefel_attention.bench.report import check_placed, place_records

    pilot = Path(__file__).resolve().parents[1] / "results-pilot"
    if not pilot.is_dir():
        pytest.skip("no results-pilot/ in this checkout")
    placements = [place_records(pilot / fam.name, fam) for fam in family_module.all_families()]
    with pytest.raises(UserError, match=r"mqar/runs: 112 of its 116 records are cells no experiment") as refused:
        check_placed(placements, leave_out_unplanned=False)
    assert "lm/runs: 19 of its 19 records" in str(refused.value)
    assert "results-pilot/mqar/lr-sweep/summary.json: this code writes no summary there" in str(refused.value)


@pytest.mark.parametrize("failure", ["eigh", "nonfinite gradient", "nonfinite loss"])
def test_a_cifar_run_that_blows_up_is_recorded_as_diverged_and_counts_as_guessing(fake_cifar, monkeypatch, failure):
    """A rate too high for an arm is an outcome of the sweep, not a run with no record."""
    import types

    from stiefel_attention.bench.cifar.report import TEST_ACCURACY, summary_markdown
    from stiefel_attention.optim import NonFiniteGradientError

    calls = []
    if failure == "nonfinite loss":
        real_forward = cifar.PatchViT.forward

        def forward(self, x):
            out = real_forward(self, x)
            if self.training:
                calls.append(1)
                return out * float("nan") if len(calls) == 2 else out
            return out

        monkeypatch.setattr(cifar.PatchViT, "forward", forward)
    else:
        real_build = cifar.build_optimizers

        def build(*args, **kwargs):
            opts = real_build(*args, **kwargs)
            first, real_step = opts[0], opts[0].step

            def step(self, *a, **k):
                calls.append(1)
                if len(calls) == 2:
                    if failure == "eigh":
                        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
                    raise NonFiniteGradientError("a gradient is not finite")
                return real_step(*a, **k)

            first.step = types.MethodType(step, first)  # bound, as the LR scheduler expects
            return opts

        monkeypatch.setattr(cifar, "build_optimizers", build)
    cfg = cifar.make_config("smoke", "stiefel-adam", 0, N_TRAIN, epochs=3, eval_every=1, n_test=None)
    cfg.update(cifar.FAMILY.data_key({"data": fake_cifar}))
    steps_per_epoch = max(1, N_TRAIN // cfg["batch_size"])
    rec = {"config": cfg, **cifar.run(cfg, data=fake_cifar, device="cpu")}
    m = rec["metrics"]
    assert m["diverged_at_epoch"] == 1 + 1 // steps_per_epoch  # the second training step's epoch
    assert m["final_eval_acc"] is None and m["qk_isometry_error"] is None and m["final_train_loss"] is None
    assert TEST_ACCURACY.value(rec) == pytest.approx(10.0)
    summary = cifar_summary("main", [{**rec, "name": "x-s0"}, {**_fake_record("adamw", 0, 0.5), "name": "y-s0"}])
    assert summary["diverged"] == [{"run": "x-s0", "epoch": m["diverged_at_epoch"]}]  # listed, by name
    assert f"x-s0 at epoch {m['diverged_at_epoch']}." in summary_markdown({**summary, "n_runs": 2}, "smoke")
