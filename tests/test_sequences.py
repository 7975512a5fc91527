"""The sequence testbeds: text loading and splits, MQAR generation, pairing and the run records."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from stiefel_attention.bench import cli, training
from stiefel_attention.bench.arms import arm_spec
from stiefel_attention.bench.errors import DataError
from stiefel_attention.bench.lm import run as lm
from stiefel_attention.bench.mqar import run as mqar
from stiefel_attention.bench.mqar.report import mqar_markdown, mqar_summary
from stiefel_attention.bench.mqar.task import IGNORE, max_pairs, mqar_batch
from stiefel_attention.bench.report import rebuild_all
from stiefel_attention.bench.report.fmt import fmt_runs
from stiefel_attention.bench.text import ENV_TEXT, fixed_windows, load_text, random_windows

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_text_split_vocabulary_and_round_trip(corpus_file):
    c = load_text(corpus_file)
    assert c.chars == "".join(sorted(set(TEXT))) and c.vocab_size == len(set(TEXT))
    assert len(c.train) == int(0.9 * len(TEXT)) and len(c.train) + len(c.val) == len(TEXT)
    assert c.decode(c.train) + c.decode(c.val) == TEXT  # the first 90% train, the last 10% validate
    x, y = random_windows(c.train, 5, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 16) and torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    a, b = fixed_windows(c.val, 4, 8, seed=0), fixed_windows(c.val, 4, 8, seed=0)
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize(
    "content,match", [(None, "is not a file"), (b"", "too few"), (b"\xff\xfe\x00bad" * 50, "not UTF-8")]
)
def test_bad_text_paths_are_one_clear_error(tmp_path, content, match):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        load_text(path)
    assert "expected a UTF-8 text file" in str(info.value)


def test_cli_bad_text_path_is_one_line(tmp_path, capsys):
    args = ["lm", "--experiment", "main", "--profile", "smoke", "--text", str(tmp_path / "none.txt")]
    rc = cli.main([*args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a file" in err and "Traceback" not in err


def test_text_from_the_environment(monkeypatch, corpus_file):
    monkeypatch.setenv(ENV_TEXT, str(corpus_file))
    assert load_text().source == str(corpus_file.resolve())


@pytest.mark.parametrize("n_pairs,n_queries,seq_len", [(4, 4, 12), (8, 3, 30), (1, 1, 3)])
def test_every_query_target_is_its_pairs_value(n_pairs, n_queries, seq_len):
    tokens, labels = mqar_batch(64, 32, n_pairs, n_queries, seq_len, torch.Generator().manual_seed(1))
    assert tokens.shape == labels.shape == (64, seq_len)
    n_keys = 32 // 2 - 1
    for t, lab in zip(tokens, labels):
        pairs = t[: 2 * n_pairs].view(n_pairs, 2)
        keys, values = pairs[:, 0].tolist(), pairs[:, 1].tolist()
        assert len(set(keys)) == n_pairs and all(k < n_keys for k in keys)
        assert all(n_keys <= v < 2 * n_keys for v in values)
        lookup = dict(zip(keys, values))
        asked = (lab != IGNORE).nonzero().flatten().tolist()
        assert asked == list(range(seq_len - n_queries, seq_len))
        for pos in asked:
            assert int(lab[pos]) == lookup[int(t[pos])]
        assert all(2 * n_keys <= int(f) < 2 * n_keys + 2 for f in t[2 * n_pairs : seq_len - n_queries])


def test_mqar_rejects_impossible_tasks():
    g = torch.Generator()
    with pytest.raises(ValueError, match="distinct keys"):
        mqar_batch(2, 16, 8, 4, 24, g)
    with pytest.raises(ValueError, match="seq_len"):
        mqar_batch(2, 32, 4, 4, 10, g)
    with pytest.raises(ValueError, match="n_queries"):
        mqar_batch(2, 32, 4, 5, 20, g)


def test_mqar_test_set_is_fixed_and_apart_from_the_validation_set():
    cfg = mqar.make_config("smoke", "adamw", 0)
    a = mqar._task(cfg, 8, torch.Generator().manual_seed(mqar.TEST_SEED))
    b = mqar._task(cfg, 8, torch.Generator().manual_seed(mqar.TEST_SEED))
    c = mqar._task(cfg, 8, torch.Generator().manual_seed(mqar.VAL_SEED))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


@pytest.mark.parametrize("family", [lm, mqar])
def test_arms_of_a_seed_share_init_and_order_and_differ_across_seeds(family, corpus_file):
    opts = {"data": str(corpus_file)} if family is lm else {}
    records = {}
    for arm, seed in (("adamw", 0), ("stiefel-adam", 0), ("orthogonal-param", 0), ("adamw", 1)):
        cfg = {**family.make_config("smoke", arm, seed, steps=4, eval_every=2), **family.FAMILY.data_key(opts)}
        records[(arm, seed)] = family.run(cfg, **opts)
    base = records[("adamw", 0)]["pairing"]
    for arm in ("stiefel-adam", "orthogonal-param"):
        assert records[(arm, 0)]["pairing"] == base, arm
    other = records[("adamw", 1)]["pairing"]
    assert other["init_sha256"] != base["init_sha256"] and other["order_sha256"] != base["order_sha256"]
    rec = records[("stiefel-adam", 0)]
    assert rec["curves"]["step"] == [2, 4] and len(rec["curves"]["mechanism"]["entropy"]) == 2
    assert json.dumps(rec, allow_nan=False)


def test_lm_record_has_a_readable_sample_and_its_metric(corpus_file):
    cfg = {
        **lm.make_config("smoke", "stiefel-adam", 0, steps=6, eval_every=3),
        **lm.FAMILY.data_key({"data": corpus_file}),
    }
    rec = lm.run(cfg, data=str(corpus_file))
    assert len(rec["sample"]) == 1 + lm.SAMPLE_CHARS and set(rec["sample"]) <= set(TEXT)
    assert rec["metrics"]["final_val_loss"] == rec["curves"]["val_loss"][-1] > 0


def test_mqar_steps_to_99_is_the_first_evaluation_at_99(monkeypatch):
    accs = iter([0.5, 0.995, 0.98, 1.0])
    monkeypatch.setattr(mqar, "accuracy", lambda *a, **k: next(accs))
    rec = mqar.run(mqar.make_config("smoke", "adamw", 0, steps=8, eval_every=2))
    assert rec["curves"]["step"] == [2, 4, 6, 8] and rec["metrics"]["step_eval_acc_99"] == 4
    assert rec["metrics"]["final_eval_acc"] == 1.0


@pytest.mark.parametrize("failure", ["eigh", "nonfinite gradient"])
def test_an_mqar_run_whose_frames_blow_up_is_recorded_as_never_solving_the_task(monkeypatch, failure):
    """A diverged run is an outcome (its rate is too high), not a failed run with no record: it is censored at the
    budget and counts as guessing in the final accuracy that breaks ties."""
    from stiefel_attention.bench.mqar.report import _SWEEP_SCORE, FINAL_ACC, STEPS_TO_SOLVE
    from stiefel_attention.optim import NonFiniteGradientError

    real, calls = training.Trainer.step, []

    def blows_up_at_the_fifth(self, loss):
        calls.append(1)
        if len(calls) == 5:
            if failure == "eigh":
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            raise NonFiniteGradientError("a gradient is not finite")
        return real(self, loss)

    monkeypatch.setattr(training.Trainer, "step", blows_up_at_the_fifth)
    cfg = mqar.make_config("smoke", "stiefel-adam", 0, steps=8, eval_every=2)
    rec = {"config": cfg, **mqar.run(cfg)}
    m = rec["metrics"]
    assert m["diverged_at_step"] == 5 and m["step_eval_acc_99"] is None and m["final_eval_acc"] is None
    assert m["best_eval_acc"] is not None and rec["curves"]["step"] == [2, 4]
    assert STEPS_TO_SOLVE.value(rec) == 9 and STEPS_TO_SOLVE.censored(rec)
    assert FINAL_ACC.value(rec) == pytest.approx(100 / cfg["vocab"])
    assert _SWEEP_SCORE.value(rec) == pytest.approx(9 - 1 / cfg["vocab"])
    summary = mqar_summary("main", [{**rec, "name": "x-s0"}])
    assert summary["diverged"] == [{"run": "x-s0", "step": 5}]
    assert "x-s0 at step 5." in mqar_markdown({**summary, "n_planned": 1, "n_planned_done": 1}, "smoke")


def test_untuned_arms_are_not_planned_on_the_cpu_profile(monkeypatch):
    tuned = {a: r for a, r in lm.PROFILES["cpu"]["tuned"].items() if a != "muon"}
    monkeypatch.setitem(lm.PROFILES["cpu"], "tuned", tuned)
    with pytest.raises(ValueError, match="no learning rate chosen for arm 'muon'"):
        lm.cells("main", "cpu", 2)
    assert lm.FAMILY.experiment_records("main", "cpu", {}) == []
    sweep = mqar.cells("lr-sweep", "cpu", 2)
    assert {c.config["split"] for c in sweep} == {"val"}
    assert [c.config["arm"] for c in sweep][:2] == ["adamw", "adamw"]  # rate-sweeping arms first


def test_a_sweep_grid_extension_adds_values_past_the_edge_once():
    base = training.sweep_points("cpu", anchor=3e-3)
    ext = training.sweep_points("cpu", {"frozen": (3e-2, 1e-2), "stiefel-sgd": (3e-2,)}, anchor=3e-3)
    assert [p for p in ext if p not in base] == [
        ("frozen", {"lr": 3e-2}),
        ("stiefel-sgd", {"lr": 3e-3, "frame_lr": 3e-2}),
    ]
    assert len(ext) == len(base) + 2  # a value already on the grid is not planned twice
    assert training.sweep_points("smoke", {"frozen": (3e-2,)}) == training.sweep_points("smoke")
    with pytest.raises(ValueError, match="do not sweep"):
        training.sweep_points("cpu", {"nonsense": (1.0,)})


@pytest.mark.parametrize("family", [lm, mqar])
def test_the_sweep_plans_the_frame_arms_at_adamws_lr_once_it_is_chosen(family, monkeypatch):
    lr_arms = {a for a in training.SWEPT_ARMS if arm_spec(a).swept == "lr"}
    monkeypatch.setitem(family.PROFILES["cpu"], "tuned", {})
    stage_one = family.cells("lr-sweep", "cpu", 1)
    assert {c.config["arm"] for c in stage_one} == lr_arms
    assert "adamw's lr" in family.FAMILY.plan_note("lr-sweep", "cpu")
    ext = family.SWEEP_EXTENSIONS.get("cpu", {})
    planned = {(c.config["arm"], c.config["lr"]) for c in stage_one}
    assert {(a, x) for a, xs in ext.items() if a in lr_arms for x in xs} <= planned

    monkeypatch.setitem(family.PROFILES["cpu"], "tuned", {"adamw": {"lr": 0.004}})
    both = family.cells("lr-sweep", "cpu", 1)
    assert family.FAMILY.plan_note("lr-sweep", "cpu") == ""
    assert [c.key for c in both[: len(stage_one)]] == [c.key for c in stage_one]  # stage one is unchanged
    frames = [c.config for c in both[len(stage_one) :]]
    assert {c["arm"] for c in frames} == set(training.SWEPT_ARMS) - lr_arms
    assert {c["lr"] for c in frames} == {0.004}  # every parameter but W_Q, W_K at adamw's choice
    swept = {(c["arm"], c["frame_lr"]) for c in frames}
    assert {(a, x) for a, grid in training.FRAME_LR_GRID.items() for x in grid} <= swept
    assert {(a, x) for a, xs in ext.items() if a not in lr_arms for x in xs} <= swept


def test_a_frame_arm_trains_its_other_parameters_at_adamws_chosen_lr(monkeypatch):
    monkeypatch.setitem(mqar.PROFILES["cpu"], "tuned", {"stiefel-adam": {"frame_lr": 0.05}})
    with pytest.raises(ValueError, match="no learning rate chosen for adamw, whose lr the frame arm 'stiefel-adam'"):
        mqar.make_config("cpu", "stiefel-adam", 0)  # adamw's lr is not chosen yet
    tuned = {"adamw": {"lr": 0.004}, "frozen": {"lr": 0.02}, "stiefel-adam": {"frame_lr": 0.05}}
    monkeypatch.setitem(mqar.PROFILES["cpu"], "tuned", tuned)
    cfg = mqar.make_config("cpu", "stiefel-adam", 0)
    assert (cfg["lr"], cfg["frame_lr"]) == (0.004, 0.05)
    assert mqar.make_config("cpu", "frozen", 0)["lr"] == 0.02  # an lr arm keeps its own choice


@pytest.mark.parametrize("family", ["lm", "mqar"])
def test_cli_smoke_main_writes_records_and_a_summary(family, corpus_file, tmp_path):
    args = [family, "--experiment", "main", "--profile", "smoke", "--out", str(tmp_path), "--jobs", "1"]
    args += ["--no-progress", *(["--text", str(corpus_file)] if family == "lm" else [])]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "main" / "summary.json").read_text())
    arms = {"lm": lm, "mqar": mqar}[family].MAIN_ARMS  # smoke: two seeds of every main arm
    assert summary["n_records"] == 2 * len(arms) and len(summary["controls"]["arms"]) == len(arms)
    roles = {c["role"] for c in summary["controls"]["comparisons"]}
    assert roles == {"sensitivity", "stiefel-adam vs arm", "control vs adamw"}
    assert (tmp_path / "main" / "mechanism.png").exists()
    if family == "lm":  # the model's size is stated, from the records
        model = dict(n_layers=1, d_model=32, n_heads=2, head_dim=16, context=32, batch=8, steps=[40])
        assert summary["model"] == [model]
        md = (tmp_path / "main" / "summary.md").read_text()
        assert "1 layer, width 32, 2 heads of 16, context 32; 40 steps of 8 windows." in md
    if family == "mqar":  # the task's size is stated, from the records
        assert summary["task"] == [dict(n_pairs=4, n_queries=4, vocab=32, seq_len=16, steps=60, batch=32)]
        assert "Task: 4 key-value pairs, 4 queries, vocabulary 32" in (tmp_path / "main" / "summary.md").read_text()


def test_cli_arms_runs_a_subset_and_the_summary_keeps_every_finished_run(tmp_path, capsys):
    out = tmp_path / "mqar"
    base = ["mqar", "--experiment", "main", "--profile", "smoke", "--out", str(out), "--jobs", "1", "--no-progress"]
    args = [*base, "--seeds", "1"]
    assert cli.main([*args, "--arms", "frozen,nonsense"]) == 2
    err = capsys.readouterr().err
    assert "has no arm nonsense" in err and "stiefel-adam-temp" in err and "Traceback" not in err
    assert not (out / "runs").exists()  # refused before anything ran
    assert cli.main([*args, "--arms", "frozen, adamw"]) == 0
    assert sorted(p.name.split("-s0")[0] for p in (out / "runs").glob("*.json")) == ["adamw", "frozen"]
    assert cli.main([*base, "--seeds", "2", "--arms", "stiefel-adam"]) == 0  # seeds 0 and 1
    assert cli.main([*args, "--arms", "frozen"]) == 0  # nothing left to run; the summary still holds seed 1
    written = {name: (out / "main" / name).read_bytes() for name in ("summary.json", "summary.md")}
    summary = json.loads(written["summary.json"])
    planned = len(mqar.FAMILY.cells("main", "smoke"))  # the protocol's plan, whatever --seeds this command had
    assert summary["n_records"] == 4 and (summary["n_planned"], summary["n_planned_done"]) == (planned, 4)
    seeds = planned // len(summary["planned_by_arm"])  # which arms ran, from the records: the protocol's seeds each
    assert summary["planned_by_arm"]["stiefel-adam"] == [2, seeds] and summary["planned_by_arm"]["muon"] == [0, seeds]
    rebuild_all(tmp_path)  # `report` writes the same summary from the records alone
    assert {name: (out / "main" / name).read_bytes() for name in written} == written
    md = written["summary.md"].decode()
    assert "| frozen (1 seed) |" in md and re.search(r"\| frozen \| \d+\.\d\d \| n/a \|", md)
    assert "1 seeds" not in md and "nan" not in md  # one seed: no spread, said as such
    ran = {"adamw": 1, "frozen": 1, "stiefel-adam": 2}
    order = dict.fromkeys(c.config["arm"] for c in mqar.FAMILY.cells("main", "smoke"))  # the plan's order
    per_arm = ", ".join(f"{arm} {ran[arm]}/{seeds}" for arm in order if arm in ran)
    idle = ", ".join(arm for arm in order if arm not in ran)
    assert f"4 finished runs of {planned} planned; finished of planned per arm: {per_arm}; not run yet: {idle}." in md


@pytest.mark.parametrize("profile", list(mqar.PROFILES))
def test_every_planned_mqar_level_fits_its_vocabulary(profile):
    prof = mqar.PROFILES[profile]
    for n_pairs in (prof["n_pairs"], *mqar.DIFFICULTY_PAIRS[profile]):
        assert n_pairs <= max_pairs(prof["vocab"]), n_pairs  # else mqar_batch refuses at run time
    with pytest.raises(ValueError, match="needs distinct keys"):
        mqar.make_config("cpu", "adamw", 0, n_pairs=32)


def test_plan_counts_planned_cells_not_records_of_extra_seeds():
    """A level shared with `main` holds more seeds than `difficulty` plans; 'k of n' must count planned cells."""
    planned = mqar.FAMILY.cells("difficulty", "smoke")
    extra = mqar.FAMILY.cells("difficulty", "smoke", seeds=1 + max(c.config["seed"] for c in planned) + 1)
    missing = planned[-1].key
    finished = [{"key": c.key} for c in extra if c.key != missing]
    plan = mqar.FAMILY.plan("difficulty", "smoke", finished)
    assert plan.total == len({c.key for c in planned}) and plan.done == plan.total - 1
    assert len(finished) > plan.total  # more records than the plan has cells, yet the plan is not complete
    summary = {"n_records": len(finished), "n_planned": plan.total, "n_planned_done": plan.done}
    text = fmt_runs(summary)
    assert f"{plan.done} of the {plan.total} planned" in text and f"of {plan.total} planned" not in text
    assert fmt_runs({**summary, "n_records": plan.done}) == f"{plan.done} finished runs of {plan.total} planned"
    assert fmt_runs({"n_records": 3, "n_planned": None}) == "3 finished runs"


def _mqar_record(pairs: int, arm: str, seed: int, step_99, acc: float) -> dict:
    config = {"n_pairs": pairs, "arm": arm, "seed": seed, "steps": 1000}
    return {"config": config, "metrics": {"step_eval_acc_99": step_99, "final_eval_acc": acc}, "curves": {}}


def test_difficulty_sensitivity_reports_final_accuracy_and_says_when_every_run_is_censored():
    records = [_mqar_record(8, "adamw", s, 300, 1.0) for s in range(3)]
    records += [_mqar_record(8, "frozen", s, 400 + 100 * s, 1.0) for s in range(3)]
    records += [_mqar_record(30, "adamw", s, None, 0.3 + 0.1 * s) for s in range(3)]
    records += [_mqar_record(30, "frozen", s, None, 0.1) for s in range(3)]
    summary = mqar_summary("difficulty", records)
    easy, hard = summary["sensitivity_by_pairs"]["8"], summary["sensitivity_by_pairs"]["30"]
    assert easy["steps"]["diffs"] == [-100, -200, -300] and not easy["all_censored"]
    assert hard["steps"]["diffs"] == [0, 0, 0] and hard["all_censored"]
    assert hard["final_acc"]["mean_diff"] == pytest.approx(30.0)  # (20 + 30 + 40) / 3 pp
    md = mqar_markdown({**summary, "n_planned": None}, "smoke")
    line = next(s for s in md.splitlines() if s.startswith("- 30 pairs"))
    assert "every run censored" in line and "final accuracy +30.0 pp" in line
    assert "censored" not in next(s for s in md.splitlines() if s.startswith("- 8 pairs"))


# --- lr-stability ------------------------------------------------------------------------------------------


def test_lr_stability_plans_every_rate_times_m_and_shares_main_at_m_1():
    planned = lm.cells("lr-stability", "cpu", 3)
    assert len(planned) == 3 * len(lm.LR_MULTIPLIERS["cpu"]) * len(lm.STABILITY_RUNS)
    main = {c.key for c in lm.cells("main", "cpu", 12)}
    at_one = [c for c in planned if "lr_multiplier" not in c.config]
    assert all((c.key in main) != ("qk_clip" in c.config) for c in at_one)  # plain arms at m = 1 are main's cells
    x64 = {c.name: c.config for c in planned if c.config.get("lr_multiplier") == 64.0 and c.config["seed"] == 0}
    base = lm.make_config("cpu", "stiefel-adam", 0)
    assert x64["stiefel-adam-s0-lrx64"]["lr"] == base["lr"] * 64 and x64["stiefel-adam-s0-lrx64"]["frame_lr"] == 6.4
    assert x64["adamw-s0-lrx64-clip50"]["qk_clip"] == lm.PROFILES["cpu"]["qk_clip_tau"]


def test_factorial_stability_plans_every_factorial_cell_times_m_sharing_the_factorial_and_lr_stability():
    from stiefel_attention.bench.arms import FACTORIAL_ARMS

    planned = lm.cells("factorial-stability", "smoke", 2)
    assert len(planned) == 2 * len(lm.LR_MULTIPLIERS["smoke"]) * len(FACTORIAL_ARMS)
    assert {c.config["arm"] for c in planned} == set(FACTORIAL_ARMS) and not any("qk_clip" in c.config for c in planned)
    keys = {c.key for c in planned}
    at_one = {c.key for c in planned if "lr_multiplier" not in c.config}
    assert at_one == {c.key for c in lm.cells("factorial", "smoke", 2)}  # m = 1: the factorial's own cells
    stability = {c.key: c.config["arm"] for c in lm.cells("lr-stability", "smoke", 2) if "qk_clip" not in c.config}
    shared = {arm for key, arm in stability.items() if key in keys}
    assert shared == set(FACTORIAL_ARMS) & {arm for arm, _ in lm.STABILITY_RUNS}  # lr-stability's runs are reused
    assert "factorial-stability" in lm.FAMILY.experiment_help and "factorial-stability" in lm.FAMILY.reproduce_order


def test_factorial_stability_tables_each_cells_learning_rate_sensitivity_per_seed():
    from stiefel_attention.bench.arms import FACTORIAL
    from stiefel_attention.bench.lm.report import lm_markdown, lm_summary

    recs = []
    for (geometry, _), arm in FACTORIAL.items():
        for s in range(3):
            worse = {"euclidean": 0.5, "qk-norm": 0.1, "frames": 0.3, "bounded frames": 0.1}[geometry]
            recs += [
                _stability_record(arm, s, 1, 1.70 + 0.01 * s, 10.0),
                _stability_record(arm, s, 16, 1.70 + worse + 0.002 * s * (arm == "sgd"), 10.0),
            ]
    for r in recs:
        r["config"].update(model={"n_layers": 1, "d_model": 16, "n_heads": 2, "head_dim": 8}, context=8, batch=4)
    summary = lm_summary("factorial-stability", recs)
    section = summary["factorial"]
    assert section["measure"]["name"] == "learning-rate sensitivity"
    cell = next(c for c in section["cells"] if c["arm"] == "adamw")
    assert cell["n"] == 3 and cell["mean"] == pytest.approx((1.70 + 2.20) / 2 - 1.70, abs=0.01)  # mean - best
    d = section["decomposition"]
    assert d["shares"]["geometry"] > 0.99 and tuple(d["best"])[0] in ("qk-norm", "bounded frames")
    assert "the geometry carries the most" in section["sentence"]
    assert summary["stability"]["multipliers"] == ["1", "16"]  # and every run's losses behind the table
    md = lm_markdown(summary, "smoke")
    assert md.index("share of the between-cell spread") < md.index("sensitivity |")


def test_an_lm_run_whose_frames_blow_up_is_recorded_as_diverged(monkeypatch, corpus_file):
    """The polar factor's eigh failing on frames far off the manifold is the run diverging, as a non-finite loss."""
    real, calls = training.Trainer.step, []

    def fails_at_the_fourth(self, loss):
        calls.append(1)
        if len(calls) == 4:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real(self, loss)

    monkeypatch.setattr(training.Trainer, "step", fails_at_the_fourth)
    cfg = {
        **lm.make_config("smoke", "stiefel-adam", 0, steps=8, eval_every=2),
        **lm.FAMILY.data_key({"data": corpus_file}),
    }
    m = lm.run(cfg, data=str(corpus_file), device="cpu")["metrics"]
    assert m["diverged_at_step"] == 4 and m["final_val_loss"] is None


def test_a_diverging_lm_run_is_recorded_with_its_step_not_raised(corpus_file):
    cfg = {
        **lm.make_config("smoke", "adamw", 0, steps=30, eval_every=10, lr=1e4),
        **lm.FAMILY.data_key({"data": corpus_file}),
    }
    rec = lm.run(cfg, data=str(corpus_file), device="cpu")
    m = rec["metrics"]
    assert m["diverged_at_step"] is not None and m["final_val_loss"] is None and rec["sample"] == ""
    from stiefel_attention.bench.lm.report import VAL_LOSS

    assert VAL_LOSS.value(rec) == m["uniform_loss"] == pytest.approx(math.log(len(set(TEXT))))
    assert json.dumps(rec, allow_nan=False)


def test_a_qk_clip_lm_run_keeps_its_attention_logits_near_tau(corpus_file):
    cfg = {**lm.make_config("smoke", "adamw", 0, steps=40, eval_every=20, lr=0.1), "qk_clip": 2.0}
    cfg.update(lm.FAMILY.data_key({"data": corpus_file}))
    rec = lm.run(cfg, data=str(corpus_file), device="cpu")
    assert rec["metrics"]["qk_clip_steps"] > 0
    assert max(layer[2] for layer in rec["curves"]["mechanism"]["max_logit"][-1]) < 3.0
    assert len(rec["curves"]["max_output_logit"]) == len(rec["curves"]["step"])


def _stability_record(arm, seed, m, loss, logit, clip=None, diverged=None):
    config = {"arm": arm, "seed": seed, "steps": 100}
    if m != 1:
        config["lr_multiplier"] = m
    if clip:
        config["qk_clip"] = clip
    mech = {"max_logit": [[[logit, logit, logit]]]}
    return {
        "config": config,
        "metrics": {"final_val_loss": loss, "uniform_loss": 4.0, "diverged_at_step": diverged},
        "curves": {"mechanism": mech, "max_output_logit": [10.0]},
    }


def test_stability_summary_computes_wortsmans_sensitivity_the_precondition_and_a_verdict():
    from stiefel_attention.bench.lm.report import stability_markdown, stability_summary

    recs = []
    for s in range(3):
        e = (0.01, -0.02, 0.015)[s]
        recs += [
            _stability_record("adamw", s, 1, 1.70 + e, 30.0),
            _stability_record("adamw", s, 4, 1.90 + e, 60.0),
            _stability_record("adamw", s, 16, None, 150.0, diverged=20),  # counts as the cap, 4.0
            _stability_record("qk-norm", s, 1, 1.69 + e, 12.0),
            _stability_record("qk-norm", s, 4, 1.72 - e, 12.5),
            _stability_record("qk-norm", s, 16, 1.85 + e, 13.0),
            _stability_record("stiefel-adam", s, 1, 1.71 + e, 12.0),
            _stability_record("stiefel-adam", s, 4, 1.70 - e, 12.0),
            _stability_record("stiefel-adam", s, 16, 1.80 + 2 * e, 12.5),
        ]
    summary = stability_summary(recs)
    assert summary["multipliers"] == ["1", "4", "16"] and summary["cap"] == 4.0
    adamw = [[1.70 + e, 1.90 + e, 4.0] for e in (0.01, -0.02, 0.015)]
    want = sum(sum(x) / 3 - min(x) for x in adamw) / 3
    assert summary["sensitivity"]["adamw"]["mean"] == pytest.approx(want, abs=1e-12)
    assert (
        summary["points"]["adamw"]["16"]["diverged"] == 3
        and summary["points"]["adamw"]["16"]["diverged_at"] == [20] * 3
    )
    pre = summary["precondition"]
    assert pre["met"] and pre["logit_growth"] == pytest.approx(5.0) and "3 of its runs diverged" in pre["text"]
    assert summary["verdict"].startswith("yes: stiefel-adam is significantly less sensitive")
    md = "\n".join(stability_markdown(summary))
    one = stability_summary([r for r in recs if r["config"]["seed"] == 0])
    assert one["verdict"].startswith("not yet testable")  # one seed: a sensitivity without a spread
    assert "4.000 (3 diverged)" in md and "Precondition (met)" in md


def test_the_bounded_arms_are_compared_with_qk_norm_the_plain_frames_and_the_norm_alone():
    from stiefel_attention.bench.lm.report import logit_bound, stability_markdown, stability_summary

    model = {"d_model": 64, "head_dim": 16}
    losses = {  # m = 1, 16, 64; the bounded frames level with qk-norm, far ahead of the plain frames at m = 64
        "adamw": (1.70, 2.8, 3.3),
        "qk-norm": (1.70, 1.80, 2.05),
        "stiefel-adam": (1.70, 1.82, 2.65),
        "stiefel-adam-bounded": (1.70, 1.80, 2.06),
        "adamw-bounded": (1.70, 2.3, 3.0),
    }
    recs = []
    for s in range(3):
        e = (0.01, -0.02, 0.015)[s]
        for arm, row in losses.items():
            for m, loss in zip((1, 16, 64), row):
                rec = _stability_record(arm, s, m, loss + e * (1 + (m == 64) * (arm == "qk-norm")), 10.0 * m)
                rec["config"]["model"] = model
                recs.append(rec)
    summary = stability_summary(recs)
    bounded = summary["bounded"]
    assert bounded["top_multipliers"] == ["16", "64"]
    assert bounded["bounds"] == {"stiefel-adam-bounded": pytest.approx(16.0), "adamw-bounded": None}
    assert bounded["largest"]["stiefel-adam-bounded"] == 640.0  # the fake records' logits are not bounded
    pairs = {(p["arm"], p["baseline"]): p for p in bounded["pairs"]}
    assert set(pairs) == {
        ("stiefel-adam-bounded", "qk-norm"),
        ("stiefel-adam-bounded", "stiefel-adam"),
        ("stiefel-adam-bounded", "adamw-bounded"),
    }  # the capped-temperature arm did not run
    vs_plain = pairs[("stiefel-adam-bounded", "stiefel-adam")]
    assert vs_plain["loss"]["64"]["mean_diff"] == pytest.approx(2.06 - 2.65)
    v = bounded["verdict"]
    assert v["qk-norm"].startswith("yes: the bounded frames are as stable as qk-norm")
    assert v["frames"].startswith("yes: bounding the whole logit makes the frames significantly less sensitive")
    assert v["needs frames"].startswith("yes: the same norm on ordinary W_Q, W_K is significantly more sensitive")
    md = "\n".join(stability_markdown(summary))
    assert "| adamw-bounded | none | 640.000 | n/a |" in md
    assert "| stiefel-adam-bounded | 16.000 | 640.000 | 40.000 |" in md and "Does it need the frames? **yes" in md
    # without the bounded arms the summary is what it was
    assert "bounded" not in stability_summary([r for r in recs if "bounded" not in r["config"]["arm"]])
    assert logit_bound({"arm": "stiefel-adam-bounded-temp", "model": model}) == pytest.approx(64.0)
    assert logit_bound({"arm": "adamw-bounded", "model": model}) is None
