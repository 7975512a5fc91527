"""Grokking: the modular-arithmetic data, the last-position fast path, collapse detection, the CLI."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from helpers import smoke_args
from stiefel_attention.bench import cli
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.grok.task import MODULAR_OPS, modular_table, modular_task
from stiefel_attention.bench.models import ModularTransformer


@pytest.mark.parametrize("op", MODULAR_OPS)
@pytest.mark.parametrize("p", [5, 13, 97])
def test_every_equation_is_correct_and_present(op, p):
    tokens, labels = modular_table(p, op)
    a, b, eq = tokens.unbind(1)
    assert torch.all(eq == p)  # the "=" token
    expected_count = p * (p - 1) if op == "/" else p * p
    assert len(labels) == expected_count
    assert len({(int(x), int(y)) for x, y in zip(a, b)}) == expected_count  # no duplicate pairs
    if op == "+":
        assert torch.equal(labels, (a + b) % p)
    elif op == "-":
        assert torch.equal(labels, (a - b) % p)
    elif op == "*":
        assert torch.equal(labels, (a * b) % p)
    else:
        assert torch.all(b != 0)  # division is defined only for b != 0
        assert torch.equal((labels * b) % p, a)  # c = a / b  <=>  c * b = a (mod p)
    assert int(labels.min()) >= 0 and int(labels.max()) < p


def test_split_is_disjoint_complete_and_seeded():
    t1 = modular_task(23, "+", 0.3, split_seed=1)
    t2 = modular_task(23, "+", 0.3, split_seed=1)
    t3 = modular_task(23, "+", 0.3, split_seed=2)
    pairs = lambda tok: {(int(a), int(b)) for a, b, _ in tok}  # noqa: E731
    assert torch.equal(t1.train_tokens, t2.train_tokens) and torch.equal(t1.val_labels, t2.val_labels)
    assert pairs(t1.train_tokens) != pairs(t3.train_tokens)
    assert not pairs(t1.train_tokens) & pairs(t1.val_tokens)
    assert len(pairs(t1.train_tokens) | pairs(t1.val_tokens)) == 23 * 23
    assert len(t1.train_labels) == round(0.3 * 529)


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="prime"):
        modular_table(12, "/")
    with pytest.raises(ValueError, match="op must be"):
        modular_table(7, "%")
    with pytest.raises(ValueError, match="train_fraction"):
        modular_task(7, "+", 1.5)


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("layernorm", [False, True])
@pytest.mark.parametrize("qk", ["stiefel", "euclidean"])
def test_fast_path_equals_plain_forward_and_its_gradients(n_layers, layernorm, qk):
    torch.manual_seed(0)
    model = ModularTransformer(
        23, d_model=32, n_heads=2, head_dim=16, d_mlp=64, n_layers=n_layers, layernorm=layernorm, qk=qk
    ).double()
    tokens = modular_task(23, "*", 0.5, 0).train_tokens
    fast, full = model(tokens), model.forward_full(tokens)
    assert (fast - full).abs().max() < 1e-12
    g_fast = torch.autograd.grad(fast.square().sum(), list(model.parameters()))
    g_full = torch.autograd.grad(full.square().sum(), list(model.parameters()))
    assert max(float((a - b).abs().max()) for a, b in zip(g_fast, g_full)) < 1e-10


@pytest.mark.parametrize("op", ["+", "/"])
def test_one_layer_qk_gradients_are_rank_one(op):
    """With one layer the query is read only at '=', whose input x_= (token + position embedding) is
    the same for every equation: q = W_Q^T x_= is one vector per head, so dL/dW_Q = x_= (dL/dq)^T and
    dL/dW_K = (sum over keys of dL/ds * x) q^T are both rank one. This is why the unconstrained
    arm's Q/K heads drift to parallel columns (report.py cites it). A second layer breaks it."""

    def grad_rank_ratios(n_layers):
        torch.manual_seed(0)
        model = ModularTransformer(
            23, d_model=32, n_heads=2, head_dim=8, d_mlp=64, n_layers=n_layers, qk="euclidean"
        ).double()
        task = modular_task(23, op, 0.5, 0)
        torch.nn.functional.cross_entropy(model(task.train_tokens), task.train_labels).backward()
        attn = model.blocks[-1].attn
        sv = [torch.linalg.svdvals(w.grad) for w in (attn.w_q, attn.w_k)]  # (H, r) each
        return torch.stack([s[:, 1] / s[:, 0] for s in sv])  # second / first singular value

    assert torch.all(grad_rank_ratios(1) < 1e-12)
    assert torch.all(grad_rank_ratios(2) > 1e-3)  # the last layer's query now depends on a, b


def test_find_collapses_counts_spikes_and_recovery():
    log = {
        "epoch": list(range(10)),
        "train_loss": [2, 0.5, 1e-3, 5e-4, 0.1, 0.2, 4e-4, 3e-4, 0.5, 0.4],
        "val_acc": [0.1, 0.5, 0.99, 0.99, 0.6, 0.5, 0.97, 0.98, 0.3, 0.2],
    }
    events = grok.find_collapses(log)
    assert [e["epoch"] for e in events] == [4, 8]
    assert events[0]["survived"] and not events[1]["survived"]
    assert events[0]["val_acc_min"] == 0.5 and events[0]["train_loss_peak"] == 0.2
    assert grok.find_collapses({"epoch": [1, 2], "train_loss": [1.0, 0.5], "val_acc": [0.1, 0.2]}) == []


def test_qk_isometry_column_normalised_for_euclidean():
    torch.manual_seed(0)
    model = ModularTransformer(7, d_model=16, n_heads=2, head_dim=4, d_mlp=16, qk="euclidean", qk_init="orthonormal")
    with torch.no_grad():
        model.blocks[0].attn.w_q.mul_(3.0)  # scaling columns does not change the measure
    assert grok.qk_isometry(model) < 1e-5
    with torch.no_grad():
        model.blocks[0].attn.w_q[0, :, 1] = model.blocks[0].attn.w_q[0, :, 0]  # two equal columns
    assert grok.qk_isometry(model) == pytest.approx(2**0.5, rel=1e-4)  # two off-diagonal ones


def test_slingshot_pilots_differ_only_in_the_op_and_keep_the_division_keys():
    cells = grok.cells("slingshot", "cpu")
    assert [(c.config["op"], c.config["arm"]) for c in cells] == [
        ("/", "adamw"),
        ("/", "stiefel-adam"),
        ("+", "adamw"),
        ("+", "stiefel-adam"),
    ]
    for div, add in zip(cells[:2], cells[2:]):
        assert {k for k in div.config if div.config[k] != add.config[k]} == {"op"}
    # Adding the addition pilot must not re-key (and so re-run) the committed division records.
    assert [c.name for c in cells[:2]] == ["adamw-s0-div-slingshot", "stiefel-adam-s0-div-slingshot"]
    committed = Path(__file__).resolve().parents[1] / "results" / "grok" / "runs"
    if committed.is_dir():
        on_disk = {f.name for f in committed.glob("*-div-slingshot-*.json")}
        assert on_disk and on_disk <= {c.path(committed).name for c in cells}


def test_slingshot_regularises_everything_but_qk():
    cfg = grok.cells("slingshot", "smoke")[0].config
    assert cfg["arm"] == "adamw" and cfg["regularize"] == "non-qk" and cfg["weight_decay"] > 0
    torch.manual_seed(0)
    model = ModularTransformer(23, d_model=32, n_heads=2, head_dim=16, d_mlp=64, qk="euclidean")
    (opt,) = grok._build(cfg, model)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay[id(model.blocks[0].attn.w_q)] == 0.0 and decay[id(model.blocks[0].attn.w_k)] == 0.0
    assert (
        decay[id(model.unembed.weight)] == cfg["weight_decay"] and decay[id(model.embed.weight)] == cfg["weight_decay"]
    )


def test_cli_single_smoke(tmp_path, capsys):
    args = smoke_args("grok", "single", str(tmp_path))
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "single" / "summary.json").read_text())
    arms = {r["arm"]: r for r in summary["runs"]}
    assert set(arms) == {"adamw", "stiefel-adam"}
    assert arms["stiefel-adam"]["max_qk_isometry"] < 1e-5
    assert arms["adamw"]["max_qk_isometry"] > 1e-3
    assert (tmp_path / "single" / "curves.png").exists()
    assert "97.0%" in capsys.readouterr().out  # the paper's claim is printed beside the measurement


def test_slingshot_verdict_needs_grokking_and_every_later_collapse_survived():
    from stiefel_attention.bench.grok.report import _slingshot_verdict

    run = dict(epochs=40000, max_val_acc=1.7, epoch_val_acc_95=None, collapses=[{"epoch": 100, "survived": False}])
    assert _slingshot_verdict(run).startswith("does not replicate, the Stiefel arm never groks (best val acc 1.7%")
    collapses = [
        {"epoch": 500, "survived": False},
        {"epoch": 3000, "survived": True},
        {"epoch": 6000, "survived": False},
    ]
    run = dict(run, epoch_val_acc_95=2000, collapses=collapses)  # the collapse before grokking does not count
    assert _slingshot_verdict(run).endswith("loses it in 1 of 2 later collapses")
    run["collapses"] = collapses[:2]
    assert (
        _slingshot_verdict(run) == "replicates, the Stiefel arm groks at epoch 2000 and survives all 1 later collapses"
    )


def test_study_verdict_names_the_wilcoxon_floor_of_five_pairs():
    from stiefel_attention.bench.grok.report import _study_verdict
    from stiefel_attention.bench.report.stats import paired_comparison

    never, stiefel = [20001] * 5, [5020, 11780, 10260, 3700, 6380]  # baseline censored: never reached 95%
    st = paired_comparison(stiefel, never)
    assert st["p_wilcoxon"] == pytest.approx(0.0625) and st["p_t"] < 0.01 and not st["supported"]
    verdict = _study_verdict(st, st)
    assert verdict.startswith("does not replicate: the Stiefel arm groks faster in every seed (5/5")
    assert "smallest 5 pairs allow" in verdict
    st = paired_comparison(never[:2] + [3000, 9000, 20001], stiefel)  # mixed signs: no clear winner
    assert _study_verdict(st, st).startswith("partly replicates")
    baseline_wins = paired_comparison([a + 4000 + 100 * i for i, a in enumerate(stiefel * 2)], stiefel * 2)
    assert _study_verdict(baseline_wins, baseline_wins).startswith(
        "replicates: the baseline groks significantly faster (both tests, 10/10"
    )
    # below the planned seeds: no difference decides nothing yet; an effect found is reported 'so far'
    two = paired_comparison([20001, 15480], [5080, 5670])
    level = paired_comparison([100.0, 100.0], [100.0, 100.0])
    assert _study_verdict(two, level, None, 5) == (
        "not decided yet (2 of 5 paired seeds): no significant difference in epochs to 95% "
        "(the paper reports a significant baseline win)"
    )
    # censored pairs and the final accuracy are said beside it: the epoch test sees only a lower bound of the gap
    ends = paired_comparison([100.0, 93.0, 100.0, 46.8, 100.0], [0.4, 0.4, 0.2, 0.2, 0.3])
    st = paired_comparison([20001, 20001, 14560, 20001, 10450], [20001] * 5)
    assert _study_verdict(st, ends, {"adamw": 5, "stiefel-adam": 2}, 5) == (
        "partly replicates: no significant difference in epochs to 95% (the paper reports a significant baseline "
        "win); never reaching 95%: the baseline in 5/5 seeds, the Stiefel arm in 2/5 (entered as the budget + 1, "
        "so the gap is understated); final val acc: the Stiefel arm ahead in 5/5 seeds, +87.7 pp, p_t=0.0011"
    )
    assert _study_verdict(two, two).startswith("partly replicates")  # what it reads once the seeds are planned
    assert _study_verdict(baseline_wins, baseline_wins, None, 12).startswith(
        "so far (10 of 12 paired seeds): replicates: the baseline groks significantly faster"
    )
    assert _study_verdict(baseline_wins, baseline_wins, None, 10).startswith("replicates: ")


def test_study_verdict_when_neither_arm_groks():
    from stiefel_attention.bench.grok.report import _study_verdict
    from stiefel_attention.bench.report.stats import paired_comparison

    st = paired_comparison([20001.0] * 3, [20001.0] * 3)
    assert (
        _study_verdict(st, st, {"adamw": 3, "stiefel-adam": 3})
        == "untestable here: neither arm reaches 95% validation accuracy in any of 3 seeds"
    )
    # Final accuracy (pp, stiefel − adamw) still names the arm ahead, as the subtraction study needs.
    acc = paired_comparison([3.2, 1.0, 3.1, 1.9, 1.4], [0.5, 0.5, 0.5, 0.4, 0.4])
    st5 = paired_comparison([20001.0] * 5, [20001.0] * 5)
    verdict = _study_verdict(st5, acc, {"adamw": 5, "stiefel-adam": 5})
    assert verdict.endswith("; final val acc: the Stiefel arm ahead in 5/5 seeds, +1.7 pp, p_t=0.019")
    one = paired_comparison([20001.0], [20001.0])  # the single run alone: no study to test yet
    assert _study_verdict(one, one, {"adamw": 1, "stiefel-adam": 1}) == "too few seeds to test"
    behind = paired_comparison([0.5, 0.5, 0.5, 0.4, 0.4], [3.2, 1.0, 3.1, 1.9, 1.4])
    assert "the baseline ahead in 5/5 seeds, -1.7 pp" in _study_verdict(st5, behind, {"adamw": 5, "stiefel-adam": 5})


def _fake_grok_record(op, arm, seed, grok_epoch, final_acc, weight_decay=1.0):
    return {
        "config": {"op": op, "arm": arm, "seed": seed, "epochs": 20000, "weight_decay": weight_decay},
        "metrics": {
            "final_val_acc": final_acc,
            "epoch_val_acc_95": grok_epoch,
            "max_qk_isometry": 1e-6,
            "collapses": [],
        },
        "curves": {"val_acc": [final_acc]},
        "timings": {"epochs_per_s": 30.0},
    }


def test_decay_markdown_names_each_runs_weight_decay_and_compares_final_accuracy_where_every_run_is_censored():
    from stiefel_attention.bench.grok.report import grok_markdown, grok_summary

    records = [
        _fake_grok_record("+", a, s, None, acc, 0.1)
        for a, acc in (("adamw", 0.2), ("stiefel-adam", 0.3))
        for s in range(3)
    ]
    records += [_fake_grok_record("+", "adamw", s, None, 0.25) for s in range(3)]
    records += [_fake_grok_record("+", "stiefel-adam", s, 5000 + s, 1.0) for s in range(3)]
    md = grok_markdown(grok_summary("decay", records), "cpu")
    assert "| op | weight decay | arm | seed |" in md
    assert "| + | 0.1 | stiefel-adam | 2 | 20000 | 30.0 |" in md
    assert "| + | 1 | stiefel-adam | 0 | 20000 | 100.0 |" in md
    # at 0.1 no run groks: no lead on epochs, the final validation accuracy (constant per arm here) compares them
    assert "| 0.1 | 20001 | 20001 | every run censored | n/a | n/a | n/a | 3 |" in md
    assert "At weight decay 0.1 every run of both arms is censored at the budget, so there is no lead" in md
    assert "weight decay 0.1 → 1 not measured (every run at 0.1 censored)" in md
    assert (
        "final validation accuracy tells the arms apart: stiefel-adam − adamw at weight decay 0.1 +10.00 pp "
        "[+10.00, +10.00], 3 seeds, p_W=0.25 (adamw 20.00, stiefel-adam 30.00)."
    ) in md
    assert "ahead of adamw at weight decay 1 (" in md and "at weight decay 1 every run" not in md
    assert "weight decay |" not in grok_markdown(grok_summary("study", records[6:]), "cpu")  # one decay: no column


def test_study_markdown_censors_never_grokked_runs_and_prints_undefined_t_as_na():
    from stiefel_attention.bench.grok.report import grok_markdown, grok_summary

    records = [_fake_grok_record("+", "adamw", s, None, 0.25) for s in range(3)]
    records += [_fake_grok_record("+", "stiefel-adam", s, e, 1.0) for s, e in zip(range(3), (4000, 6000, 9000))]
    records += [_fake_grok_record("-", arm, s, None, 0.01) for arm in ("adamw", "stiefel-adam") for s in range(3)]
    summary = grok_summary("study", records)
    # Never reaching 95% counts as budget + 1 = 20001, so the paired gap is exactly mean(4000, 6000, 9000) - 20001.
    assert summary["studies"]["+"]["epoch_to_95"]["mean_diff"] == pytest.approx(19000 / 3 - 20001)
    assert summary["studies"]["+"]["never_grokked"] == {"adamw": 3, "stiefel-adam": 0}
    md = grok_markdown(summary, "cpu")
    assert "its epoch budget + 1, a lower bound" in md
    minus_epochs = next(line for line in md.splitlines() if line.startswith("| - | epochs to 95%"))
    assert "| n/a | n/a | n/a |" in minus_epochs and "nan" not in minus_epochs  # t, p_t, p_W all undefined
    assert "untestable here" in minus_epochs


def test_the_family_summary_holds_a_study_verdict_until_the_planned_seeds(tmp_path):
    records = [_fake_grok_record("+", "adamw", s, e, 1.0) for s, e in ((0, None), (1, 15480))]
    records += [_fake_grok_record("+", "stiefel-adam", s, e, 1.0) for s, e in ((0, 5080), (1, 5670))]
    for rec in records:  # what the curves plot needs
        rec["curves"] |= {"epoch": [20000], "qk_isometry": [1e-6]}
    for profile, seeds in (("paper", 5), ("smoke", 2)):  # the smoke profile plans 2 seeds: decided at 2
        summary = grok.FAMILY.write_summary(tmp_path / profile, "study", records, profile, None, {})
        verdict = summary["studies"]["+"]["verdict"]
        assert verdict.startswith("not decided yet (2 of 5 paired seeds)" if seeds == 5 else "partly replicates")


def test_single_verdict_reports_the_ordering_and_each_arm_against_the_paper():
    from stiefel_attention.bench.claims import GROK_SINGLE
    from stiefel_attention.bench.grok.report import _single_verdict

    runs = [{"arm": "adamw", "final_val_acc": 24.0}, {"arm": "stiefel-adam", "final_val_acc": 100.0}]
    assert _single_verdict(runs, GROK_SINGLE["paper"]) == (
        "ordering replicates (one seed, no test; the study is the test): stiefel-adam 100.0% vs paper 97.0%, "
        "adamw 24.0% vs paper 61.1%"
    )
    runs[1]["final_val_acc"] = 50.0
    assert _single_verdict(runs, GROK_SINGLE["paper"]).startswith(
        "ordering replicates, but the Stiefel arm does not hold >= 95%"
    )
    runs[0]["final_val_acc"] = 99.0
    assert _single_verdict(runs, GROK_SINGLE["paper"]).startswith("does not replicate: the baseline ends ahead")
    assert _single_verdict(runs[:1], GROK_SINGLE["paper"]) == "incomplete: needs both arms"


def test_slingshot_summary_gives_each_pilot_its_conditions_ratio_and_verdict():
    from stiefel_attention.bench.grok.report import grok_markdown, grok_summary

    records = []
    for op, grok_epoch in (("/", None), ("+", 3000)):
        for arm, iso in (("adamw", 15.0), ("stiefel-adam", 1e-6)):
            rec = _fake_grok_record(
                op,
                arm,
                0,
                grok_epoch if arm == "stiefel-adam" else None,
                0.99 if grok_epoch and arm == "stiefel-adam" else 0.02,
            )
            cfg = grok.cells("slingshot", "cpu")[0].config
            rec["config"] = dict(cfg, op=op, arm=arm, epochs=40000)
            rec["metrics"]["max_qk_isometry"] = iso
            if arm == "stiefel-adam" and grok_epoch:
                rec["metrics"]["collapses"] = [
                    {
                        "epoch": 5000,
                        "survived": True,
                        "train_loss_before": 1e-7,
                        "train_loss_peak": 1e-1,
                        "val_acc_before": 0.99,
                        "val_acc_min": 0.5,
                    }
                ]
            records.append(rec)
    summary = grok_summary("slingshot", records)
    assert list(summary["pilots"]) == ["/", "+"]  # the order of grok.SLINGSHOT_OPS
    div, add = summary["pilots"]["/"], summary["pilots"]["+"]
    assert div["conditions"].startswith("(a / b) mod 97, train fraction 0.3, 40000 full-batch epochs")
    assert div["isometry_ratio"] == pytest.approx(1.5e7) and add["isometry_ratio"] == pytest.approx(1.5e7)
    assert div["verdict"].startswith("stable grokking does not replicate, the Stiefel arm never groks")
    assert add["verdict"].startswith(
        "stable grokking replicates, the Stiefel arm groks at epoch 3000 and survives all 1 later collapses"
    )
    md = grok_markdown(summary, "cpu")
    assert md.index("### Pilot (a / b)") < md.index("### Pilot (a + b)")
    assert "- stiefel-adam: collapse at epoch 5000" in md.split("### Pilot (a + b)")[1]


def test_rerun_reproduces_a_record_exactly_and_flags_a_changed_one(tmp_path, capsys):
    args = smoke_args("grok", "single", str(tmp_path))
    assert cli.main(args) == 0
    path = next((tmp_path / "runs").glob("stiefel-adam-*.json"))
    capsys.readouterr()
    assert cli.main(["rerun", str(path), "--json", str(tmp_path / "rerun.json")]) == 0
    assert "identical" in capsys.readouterr().out
    [same] = json.loads((tmp_path / "rerun.json").read_text())["reruns"]  # what it printed, kept as a file
    record = json.loads(path.read_text())
    assert same["identical"] and same["differences"] == [] and same["record"] == path.as_posix()
    assert same["rerun"]["curves"] == record["curves"] and same["recorded"]["host"] == record["host"]
    assert cli.main(["rerun", str(path), "--json", "/proc/no/rerun.json"]) == 2
    assert "cannot write --json /proc/no/rerun.json" in capsys.readouterr().err
    made = dict(record["metrics"])
    record["curves"]["val_acc"][3] += 1e-9
    path.write_text(json.dumps(record))
    assert cli.main(["rerun", str(path), "--json", str(tmp_path / "rerun.json")]) == 1
    out = capsys.readouterr().out
    [changed] = json.loads((tmp_path / "rerun.json").read_text())["reruns"]
    assert not changed["identical"] and changed["differences"][0].startswith("curves.val_acc (relative")
    assert "DIFFERENT" in out and "differ: curves.val_acc (relative" in out
    epoch = record["curves"]["epoch"][3]
    assert f"first differs at epoch {epoch} by" in out
    assert f"re-run on {record['host']['cpu']} ({record['host']['isa']}), the same" in out
    record["metrics"] |= {"final_val_acc": 0.25, "epoch_val_acc_95": None if made["epoch_val_acc_95"] else 123}
    path.write_text(json.dumps(record))
    assert cli.main(["rerun", str(path)]) == 1
    out = capsys.readouterr().out  # each changed metric: the recorded value, then the re-run's (None: never)
    assert f"metrics.final_val_acc (0.25 → {made['final_val_acc']:.6g}; relative" in out
    grokked = made["epoch_val_acc_95"]
    assert f"metrics.epoch_val_acc_95 ({'never → ' + str(grokked) if grokked else '123 → never'})" in out
    capsys.readouterr()
    assert cli.main(["rerun", str(tmp_path / "nothing.json")]) == 2
    assert "nothing.json: no such file" in capsys.readouterr().err
    (tmp_path / "notes.json").write_text('{"metrics": {}}')
    assert cli.main(["rerun", str(tmp_path / "notes.json")]) == 2
    err = capsys.readouterr().err  # one line, and no talk of a run to redo
    assert "notes.json: not a run record" in err and err.count("\n") == 1 and "not done" not in err


# --- the interventions on the logit scale --------------------------------------------------------


def test_interventions_plan_each_variant_per_seed_and_share_the_plain_runs():
    planned = grok.cells("interventions", "cpu", 5)
    assert len(planned) == 5 * (len(grok.INTERVENTIONS) + 4)
    names = [c.name for c in planned[: len(grok.INTERVENTIONS)]]
    assert names[:2] == ["adamw-s0-add-clip2", "adamw-s0-add-clip8"] and "stiefel-adam-s0-sub-scale0" in names
    shared = {c.key for c in grok.cells("controls", "cpu", 5)} | {c.key for c in grok.cells("study", "cpu", 5)}
    plain = [c for c in planned if not any(k in c.config for k in grok.INTERVENTION_KEYS)]
    assert len(plain) == 20 and all(c.key in shared for c in plain)  # the controls' and study's own records
    with pytest.raises(ValueError, match="qk_clip needs Euclidean W_Q, W_K"):
        grok.make_config("cpu", "stiefel-adam", 0, qk_clip=2.0)
    with pytest.raises(ValueError, match="unknown config keys"):
        grok.make_config("cpu", "adamw", 0, logit_cap=2.0)


@pytest.mark.parametrize(
    "extra, arm",
    [({"qk_clip": 1.0}, "adamw"), ({"logit_softcap": 1.0}, "adamw"), ({"logit_scale": 0.0}, "stiefel-adam")],
)
def test_an_intervention_run_bounds_or_removes_its_logits(extra, arm):
    cfg = grok.make_config("smoke", arm, 0, "+", epochs=60, eval_every=20, **extra)
    rec = grok.run(cfg, device="cpu")
    end = max(layer[2] for layer in rec["curves"]["mechanism"]["max_logit"][-1])  # largest head, last evaluation
    if "qk_clip" in extra:
        assert (
            rec["metrics"]["qk_clip_steps"] > 0 and rec["metrics"]["qk_clip_heads"] >= rec["metrics"]["qk_clip_steps"]
        )
        assert rec["curves"]["qk_clip_heads"][-1] == rec["metrics"]["qk_clip_heads"]
        assert end < 1.5  # clipped to 1 after every step; the next step moves it a little
    if "logit_softcap" in extra:
        assert end < 1.0 and "qk_clip_steps" not in rec["metrics"]
    if "logit_scale" in extra:
        assert end == 0.0 and rec["curves"]["mechanism"]["entropy_frac"][-1][0][0] == 1.0  # uniform attention
    plain = grok.run(grok.make_config("smoke", arm, 0, "+", epochs=60, eval_every=20), device="cpu")
    assert max(layer[2] for layer in plain["curves"]["mechanism"]["max_logit"][-1]) > 2 * max(end, 0.5)


def _iv_record(arm, seed, op, epoch, acc, **extra):
    rec = _fake_grok_record(op, arm, seed, epoch, acc)
    rec["config"].update(extra)
    rec["key"] = f"{arm}{extra}{seed}{op}"
    return rec


def test_intervention_verdicts_follow_the_paired_comparisons():
    from stiefel_attention.bench.grok.interventions import interventions_summary
    from stiefel_attention.bench.grok.report import EPOCHS_TO_GROK, FINAL_VAL_ACC

    recs = []
    for s in range(5):
        recs += [
            _iv_record("adamw", s, "+", None, 0.25 + 0.01 * s),
            _iv_record("stiefel-adam", s, "+", 5000 + 100 * s, 1.0),
            _iv_record("adamw", s, "+", 5000 + 100 * s + (150, -120, 80, -60, -40)[s], 1.0, qk_clip=2.0),  # as frames
            _iv_record("adamw", s, "+", None, 0.25 + 0.01 * s + (2, -1.5, 1, -2, 0.5)[s] / 100, logit_softcap=8.0),
            _iv_record(
                "stiefel-adam", s, "+", None, 0.25 + 0.01 * s + (1, -2, 1.5, -1, 0.5)[s] / 100, logit_scale=16.0
            ),
            _iv_record("stiefel-adam", s, "-", None, 0.01 + 0.001 * s, logit_scale=0.0),
            _iv_record("stiefel-adam", s, "-", 9000 + 50 * s, 1.0),
            _iv_record("adamw", s, "-", None, 0.05 + 0.002 * s),
        ]
    summary = interventions_summary(recs, EPOCHS_TO_GROK, FINAL_VAL_ACC, seeds=5)
    v = summary["ops"]["+"]["variants"]
    assert v["adamw+clip2"]["verdict"].startswith("reproduces the frames' result")
    censored = " on final validation accuracy (every run of both censored)"  # said of the comparison it qualifies
    assert v["adamw+softcap8"]["verdict"] == f"no significant gain over adamw{censored} (5 seeds)"
    assert v["stiefel-adam+scale16"]["verdict"] == (
        f"removes the frames' advantage (behind stiefel-adam, level with adamw{censored}, 5 seeds)"
    )
    assert summary["ops"]["-"]["variants"]["stiefel-adam+scale0"]["verdict"].startswith("makes the frames worse")
    text = " ".join(summary["verdicts"])
    assert "reproduces the frames' grokking with adamw+clip2" in text and "the smallest scale that does is 16" in text
    assert "a - b: 0/5 grok" in text
    assert summary["mechanism_verdict"].startswith("the attention-logit scale is causal in both directions")
    one = interventions_summary([r for r in recs if r["config"]["seed"] == 0], EPOCHS_TO_GROK, FINAL_VAL_ACC, 5)
    assert one["ops"]["+"]["variants"]["adamw+clip2"]["verdict"].startswith("not yet testable")  # 1 seed: no test
    assert one["mechanism_verdict"].startswith("not yet measured with the protocol's 5 paired seeds")
    # 2 seeds: each variant has a verdict, but the absence of an effect is not concluded before the protocol's 5
    no_effect = [r for r in recs if r["config"]["seed"] < 2 and "qk_clip" not in r["config"]]
    two = interventions_summary(no_effect, EPOCHS_TO_GROK, FINAL_VAL_ACC, 5)
    assert two["ops"]["+"]["variants"]["adamw+softcap8"]["verdict"].endswith("censored) (2 seeds)")
    assert "So bounding the logits alone: not yet testable" in " ".join(two["verdicts"])
    assert two["mechanism_verdict"] == "not yet measured with the protocol's 5 paired seeds (fewest so far: 2)"
    early = interventions_summary([r for r in recs if r["config"]["seed"] < 3], EPOCHS_TO_GROK, FINAL_VAL_ACC, 5)
    assert early["ops"]["+"]["variants"]["adamw+clip2"]["verdict"].startswith("reproduces the frames' result")
    assert "3 seeds" in early["ops"]["+"]["variants"]["adamw+clip2"]["verdict"]
    assert "So bounding the logits alone: not yet testable" in " ".join(early["verdicts"])  # an effect waits too
    done = interventions_summary([r for r in recs if "qk_clip" not in r["config"]], EPOCHS_TO_GROK, FINAL_VAL_ACC, 5)
    assert "So bounding the logits alone: does not reproduce the frames' grokking." in " ".join(done["verdicts"])


def test_the_no_decay_claim_row_reads_the_controls_comparison():
    from stiefel_attention.bench.grok.report import _null_verdict, claim_rows, grok_summary
    from stiefel_attention.bench.report.stats import paired_comparison

    def row(nodecay_epochs, nodecay_acc, by_arm=None):
        recs = []
        for s in range(len(nodecay_epochs)):
            recs += [
                _fake_grok_record("+", "adamw", s, None, 0.25 + (0.01, -0.02, 0.0, 0.015, -0.01)[s]),
                _fake_grok_record("+", "adamw-qk-nodecay", s, nodecay_epochs[s], nodecay_acc),
            ]
        summary = grok_summary("controls", recs)
        if by_arm:  # as write_experiment records an open plan
            summary["planned_by_arm"] = by_arm
        [(_, _, claim, got, verdict)] = claim_rows("controls", summary, "link", "cpu")
        assert "weight-decay exemption has no grokking consequence" in claim
        return got, verdict

    got, verdict = row((None, None, 19000, None, None), 0.3)  # one seed groks, late: no significant difference
    assert "adamw-qk-nodecay − adamw epochs to 95% val acc" in got
    assert verdict.startswith("replicates: no significant difference")
    got, verdict = row((None,) * 5, 0.3)  # no run groks: compared on final accuracy, and said so
    assert got.startswith("neither arm reaches 95% in any seed; final val acc: +5.1 pp [+3.3, +6.9]")
    assert verdict.startswith("untestable on grokking (no run of either arm groks); on final val acc: does not")
    _, verdict = row((6000, 6100, 6200, 6300, 6400), 1.0)
    assert verdict == (
        "does not replicate: exempting W_Q, W_K from decay makes AdamW grok significantly sooner (95% CI, "
        "p_t=4.1e-09; the Wilcoxon p 0.062 is the smallest 5 pairs of one sign allow)"
    )
    # as at the paper's widths: one pair tied (both never grok), four one way; the Wilcoxon floor rises to 2/2^4
    _, verdict = row((None, 18650, 18770, 19070, 18000), 1.0)
    assert verdict.endswith(
        "sooner (95% CI, p_t=0.028; the Wilcoxon p 0.12 is the smallest 4 pairs of one sign allow, 1 tied)"
    )
    mixed = paired_comparison([6000.0, 6100.0, 6200.0, 6300.0, 9000.0], [9000.0, 9500.0, 9200.0, 9400.0, 8800.0])
    assert _null_verdict(mixed, "epochs", "makes AdamW grok").endswith(  # one pair the other way
        "sooner (95% CI, p_t=0.021; not the Wilcoxon test, p=0.12)"
    )
    # below the planned runs of either arm: no difference decides nothing yet; an effect found holds 'so far'
    plan = {"adamw": [3, 5], "adamw-qk-nodecay": [3, 5], "frozen": [3, 5], "stiefel-adam": [5, 5]}
    _, verdict = row((None, 19000, None), 0.3, plan)
    assert verdict.startswith(
        "not decided yet (adamw 3/5, adamw-qk-nodecay 3/5 runs); at these seeds: replicates: no significant difference"
    )
    _, verdict = row((6000, 6100, 6200), 1.0, plan)
    assert verdict.startswith(
        "so far (adamw 3/5, adamw-qk-nodecay 3/5 runs): does not replicate: exempting W_Q, W_K from decay makes AdamW "
        "grok significantly sooner ("
    )
    _, verdict = row((None,) * 3, 0.3, plan)  # compared on final accuracy: the same rule
    assert verdict.startswith("so far (adamw 3/5, adamw-qk-nodecay 3/5 runs): untestable on grokking")
    plan["frozen"] = [1, 5]  # an arm the row does not compare is not waited for
    _, verdict = row((6000, 6100, 6200), 1.0, {**plan, "adamw": [5, 5], "adamw-qk-nodecay": [5, 5]})
    assert verdict.startswith("does not replicate")


class _CutOff(Exception):
    """Stands for the end of a session: the run stops mid-way, its process gone."""


def _cut_at(epoch: int):
    def progress(done, total):
        if done == epoch:
            raise _CutOff

    return progress


@pytest.mark.parametrize("arm,extra", [("stiefel-adam", {}), ("adamw", {"qk_clip": 2.0})])
def test_a_run_cut_off_and_resumed_from_its_checkpoint_ends_as_one_never_cut_off(tmp_path, arm, extra):
    from stiefel_attention.bench.partial import Checkpoint

    cfg = grok.make_config("smoke", arm, 0, "+", epochs=60, eval_every=10, **extra)
    whole = grok.run(cfg, device="cpu")
    path, stretch = tmp_path / "run.pt", {"code_version": "abc"}
    with pytest.raises(_CutOff):  # a checkpoint after every epoch; cut off after the one of epoch 38
        grok.run(cfg, device="cpu", progress=_cut_at(38), checkpoint=Checkpoint(path, "k", stretch, every_s=0))
    again = Checkpoint(path, "k", {"code_version": "def"}, every_s=1e9)
    resumed = grok.run(cfg, device="cpu", checkpoint=again)
    assert resumed["metrics"] == whole["metrics"] and resumed["curves"] == whole["curves"]
    assert again.resumed() == [{"from": 0, "code_version": "abc"}, {"from": 38, "code_version": "def"}]
    wrong = Checkpoint(path, "another run", stretch)  # a checkpoint is resumed only by the run it came from
    assert wrong.load() is None and wrong.resumed() is None
    walls = resumed["timings"]["walls"]  # the wall-clock of every stretch, the earlier ones to their checkpoint
    assert "walls" not in whole["timings"] and len(walls) == 2 and all(w > 0 for w in walls)
    assert resumed["timings"]["total_s"] == pytest.approx(sum(walls))


def test_a_resumed_run_whose_earlier_stretches_were_not_timed_has_no_wall_clock(tmp_path):
    """A checkpoint saved before stretches were timed: the record cannot know the run's wall-clock, and says so."""
    import torch

    from stiefel_attention.bench.grok.report import grok_markdown, grok_summary
    from stiefel_attention.bench.partial import Checkpoint

    cfg = grok.make_config("smoke", "stiefel-adam", 0, "+", epochs=30, eval_every=10)
    path = tmp_path / "run.pt"
    with pytest.raises(_CutOff):
        grok.run(cfg, device="cpu", progress=_cut_at(12), checkpoint=Checkpoint(path, "k", {}, every_s=0))
    blob = torch.load(path, weights_only=True)
    del blob["state"]["walls"]  # as the checkpoints of the code before this one (which had no checksum either)
    del blob["sha256"]
    torch.save(blob, path)
    again = Checkpoint(path, "k", {}, every_s=1e9)
    result = grok.run(cfg, device="cpu", checkpoint=again)
    assert result["timings"]["total_s"] is None and result["timings"]["walls"][0] is None
    whole = grok.run(cfg, device="cpu")
    records = [
        {"config": cfg, **whole},
        {"config": {**cfg, "seed": 1}, **result, "resumed": again.resumed()},
        {"config": {**cfg, "seed": 2}, **whole, "resumed": again.resumed()},  # a record of that code: the last stretch
    ]
    summary = grok_summary("single", records)
    assert [r["total_s"] is None for r in summary["runs"]] == [False, True, True]
    assert "; 2 resumed runs left out (not every stretch timed)." in grok_markdown(summary, "smoke")


def test_the_runner_resumes_a_cut_off_run_names_its_stretches_and_removes_the_checkpoint(tmp_path, capsys):
    from dataclasses import replace

    from stiefel_attention.bench.partial import Checkpoint, checkpoint_path
    from stiefel_attention.bench.runner import InlineExecutor, run_cells

    cell = grok.FAMILY.cells("single", "smoke", seeds=1)[0]
    cell = replace(cell, config={**cell.config, "epochs": 40})
    whole, _ = run_cells([cell], tmp_path / "whole", InlineExecutor(), progress=False)
    assert not checkpoint_path(tmp_path / "whole", cell.name, cell.key).exists()  # removed with the record
    assert "resumed" not in whole[cell.key]  # a run never cut off: its record as before checkpoints existed
    runs = tmp_path / "runs"
    path = checkpoint_path(runs, cell.name, cell.key)
    with pytest.raises(_CutOff):
        grok.run(cell.config, progress=_cut_at(25), checkpoint=Checkpoint(path, cell.key, {"code_version": "old"}, 0))
    assert path.exists()
    records, failures = run_cells([cell], runs, InlineExecutor(), progress=False)
    record = records[cell.key]
    assert failures == [] and not path.exists() and "resuming" in capsys.readouterr().err
    assert record["metrics"] == whole[cell.key]["metrics"] and record["curves"] == whole[cell.key]["curves"]
    assert [s["from"] for s in record["resumed"]] == [0, 25] and record["resumed"][0]["code_version"] == "old"
    assert record["resumed"][1]["code_version"] == record["code_version"]
    assert {k: record["resumed"][1][k] for k in ("cpu", "isa")} == record["host"]  # the kernels a stretch ran
    assert json.loads(cell.path(runs).read_text())["resumed"] == record["resumed"]


@pytest.mark.parametrize("failure", ["nan loss", "nonfinite gradient"])
def test_a_grok_run_that_blows_up_is_recorded_as_never_grokking_at_chance(monkeypatch, failure):
    """A diverged run is an outcome, as in the other testbeds: recorded with its epoch, censored in epochs to 95%
    and guessing (one in p) in the final accuracy, not a failed run with no record."""
    from stiefel_attention.bench.grok.report import EPOCHS_TO_GROK, FINAL_VAL_ACC, grok_markdown, grok_summary
    from stiefel_attention.optim import NonFiniteGradientError

    calls = []
    if failure == "nan loss":
        real_forward = ModularTransformer.forward

        def forward(self, x):
            out = real_forward(self, x)
            if torch.is_grad_enabled():  # a training forward (the evaluations run under no_grad)
                calls.append(1)
                return out * float("nan") if len(calls) == 25 else out
            return out

        monkeypatch.setattr(ModularTransformer, "forward", forward)
    else:
        real_build = grok._build

        def build(cfg, model):
            opts = real_build(cfg, model)
            first, real_step = opts[-1], opts[-1].step

            def step(self, *a, **k):
                calls.append(1)
                if len(calls) == 25:
                    raise NonFiniteGradientError("a gradient is not finite")
                return real_step(*a, **k)

            first.step = types.MethodType(step, first)  # bound, as the LR scheduler expects
            return opts

        monkeypatch.setattr(grok, "_build", build)
    cfg = grok.make_config("smoke", "stiefel-adam", 0, "+", epochs=40, eval_every=10)
    rec = {"config": cfg, "name": "stiefel-adam-s0", **grok.run(cfg, device="cpu")}
    m = rec["metrics"]
    assert m["diverged_at_epoch"] == 25 and m["final_val_acc"] is None and m["final_train_acc"] is None
    assert m["epoch_val_acc_95"] is None and rec["curves"]["epoch"] == [1, 10, 20]
    assert FINAL_VAL_ACC.value(rec) == pytest.approx(100 / cfg["model"]["p"])
    assert EPOCHS_TO_GROK.censored(rec)
    md = grok_markdown(grok_summary("single", [rec]), "smoke")
    assert f"{100 / cfg['model']['p']:.1f} (diverged at epoch 25: chance) |" in md
