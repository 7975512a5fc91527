"""bench/report/geometry.py: controls and decay summaries, and the verdict of "When does the geometry dominate?"."""

from __future__ import annotations

import json

import pytest

from stiefel_attention.bench.report import geometry as geometry
from stiefel_attention.bench.report.geometry import (
    Measure,
    all_censored,
    controls_markdown,
    controls_summary,
    decay_markdown,
    decay_summary,
    geometry_section,
    lead_summary,
    lead_trend,
    significant,
    time_to,
    verdicts_by_testbed,
)

ACC = Measure("accuracy", "pp", lambda r: r["metrics"]["acc"], higher_is_better=True)
EPOCHS = Measure("epochs to grok", "epochs", lambda r: r["metrics"]["acc"], higher_is_better=False)


def _rec(arm, seed, value, wd=0.05):
    mech = {k: [[[v, v, v]] for v in (1.0, 0.5)] for k in ("entropy_frac", "stable_rank", "max_logit", "spectral_norm")}
    return {
        "config": {"arm": arm, "seed": seed, "weight_decay": wd},
        "metrics": {"acc": value},
        "curves": {"epoch": [1, 2], "mechanism": mech},
    }


def _controls(offsets: dict[str, float], n: int = 6) -> list[dict]:
    """Per arm, a constant offset plus seed noise shared by the arms; frozen alternates +-0.05 around its offset."""
    return [
        _rec(arm, s, 50.0 + off + (s % 3) * 0.1 + (0.05 * (-1) ** s if arm == "frozen" else 0.0))
        for arm, off in offsets.items()
        for s in range(n)
    ]


def test_controls_summary_pairs_every_comparison():
    recs = _controls({"adamw": 0.0, "frozen": -2.0, "stiefel-adam": 1.0, "orthogonal-param": 1.0})
    s = controls_summary(recs, ACC)
    roles = {(c["arm"], c["baseline"]): c for c in s["comparisons"]}
    assert roles[("adamw", "frozen")]["role"] == "sensitivity"
    assert roles[("stiefel-adam", "adamw")]["mean_diff"] == pytest.approx(1.0)
    assert roles[("stiefel-adam", "frozen")]["mean_diff"] == pytest.approx(3.0, abs=0.05)
    assert roles[("orthogonal-param", "adamw")]["role"] == "control vs adamw"
    assert (
        s["mechanism"]["adamw"]["stable_rank"] == [1.0, 0.5]
        and s["mechanism"]["adamw"]["x"] == [1, 2]
        and s["mechanism"]["adamw"]["n_seeds"] == 6
    )
    assert "predate" not in "\n".join(controls_markdown(s))
    for rec in recs:
        if rec["config"]["arm"] == "frozen":
            del rec["curves"]["mechanism"]  # a record made before the metrics existed
    md = "\n".join(controls_markdown(controls_summary(recs, ACC)))
    assert "| frozen (" not in md and "No mechanism metrics in the records of frozen: they predate" in md


def test_decay_summary_gives_one_lead_per_weight_decay():
    recs = [
        _rec(a, s, 50 + (wd * 10 if a == "stiefel-adam" else 0) + 0.1 * s, wd)
        for wd in (0.0, 0.5)
        for a in ("adamw", "stiefel-adam")
        for s in range(4)
    ]
    s = decay_summary(recs, ACC)
    assert [lead["weight_decay"] for lead in s["leads"]] == [0.0, 0.5]
    assert [lead["mean_diff"] for lead in s["leads"]] == pytest.approx([0.0, 5.0])


def _lead_records(leads: dict[float, float], noise: dict[float, float], n: int = 6) -> list[dict]:
    """adamw and stiefel-adam per number of steps: stiefel-adam - adamw is leads[steps] +- noise[steps] by seed."""
    return [
        {"config": {"arm": arm, "seed": s, "steps": x}, "metrics": {"acc": value}, "curves": {}}
        for x, lead in leads.items()
        for s in range(n)
        for arm, value in (("adamw", 1.0 + 0.01 * s), ("stiefel-adam", 1.0 + 0.01 * s + lead + noise[x] * (-1) ** s))
    ]


def test_lead_trend_says_where_the_stiefel_arm_stands_and_how_its_standing_changes_paired_by_seed():
    loss = Measure("validation loss", "nats/char", lambda r: r["metrics"]["acc"], higher_is_better=False)
    recs = _lead_records({4800: 0.0097, 1200: 0.045, 2400: 0.010}, {1200: 0.002, 2400: 0.002, 4800: 0.02})
    text = lead_trend(lead_summary(recs, loss, "steps"), digits=3)
    assert text.startswith(
        "stiefel-adam is behind adamw at steps 1200, 2400; level with adamw at steps 4800 (ahead or behind: "
    )
    # lower loss is better: the lead falling from +0.045 to +0.010 is an improvement of +0.035
    assert "steps 1200 → 2400 improves (+0.035 nats/char [" in text
    assert "steps 2400 → 4800 no significant change (+0.000 nats/char [" in text  # 0.0003 against +-0.02 noise
    acc = _lead_records({0.0: 1.0, 0.5: -1.0}, {0.0: 0.1, 0.5: 0.1})  # higher is better: the standing falls
    text = lead_trend(lead_summary(acc, ACC, "steps"))
    assert "ahead of adamw at steps 0; behind adamw at steps 0.5" in text and "steps 0 → 0.5 worsens (-2.00 pp" in text
    one = lead_trend(lead_summary(_lead_records({1: 1.0}, {1: 0.1}), ACC, "steps"))
    assert one.startswith("stiefel-adam is ahead of adamw at steps 1") and "standing" not in one
    assert lead_trend({"measure": ACC.describe(), "key": "steps", "leads": []}) == ""
    recs = [
        _rec(a, s, 50 + (wd * 10 if a == "stiefel-adam" else 0) + 0.1 * s * (1 + wd), wd)
        for wd in (0.0, 0.5)
        for a in ("adamw", "stiefel-adam")
        for s in range(4)
    ]
    assert "weight decay 0 → 0.5 improves (+5.00 pp" in "\n".join(decay_markdown(decay_summary(recs, ACC)))


def _write(tmp_path, family, controls=None, decay=None):
    for exp, body in (("controls", controls), ("decay", decay)):
        if body is not None:
            (tmp_path / family / exp).mkdir(parents=True)
            (tmp_path / family / exp / "summary.json").write_text(json.dumps({exp: body}))


def test_verdict_an_insensitive_testbed_cannot_rank(tmp_path):
    recs = _controls({"adamw": 0.0, "frozen": 0.0, "stiefel-adam": 0.0})
    _write(tmp_path, "cifar", controls=controls_summary(recs, ACC))
    text = "\n".join(geometry_section(tmp_path, [("cifar", "CIFAR", "controls", "decay")]))
    assert "cannot rank Q/K optimizers" in text and "no significant difference from adamw, frozen" in text
    ((title, verdict),) = verdicts_by_testbed(tmp_path, [("cifar", "CIFAR", "controls", "decay")])
    assert title == "CIFAR" and verdict.startswith("cannot rank Q/K optimizers") and verdict in text


def test_verdict_explains_no_mechanism_where_the_stiefel_arm_has_no_lead_over_adamw(tmp_path):
    # CIFAR-like: the decay exemption ties the Stiefel arm, which ties adamw and is ahead of a weaker arm
    arms = {"adamw": 0.0, "frozen": 0.0, "stiefel-adam": 0.0, "adamw-qk-nodecay": 0.0, "orthogonal-param": 0.0}
    recs = _controls({**arms, "muon": -2.0})
    _write(tmp_path, "cifar", controls=controls_summary(recs, ACC))
    text = "\n".join(geometry_section(tmp_path, [("cifar", "CIFAR", "controls", "decay")]))
    assert "stiefel-adam is ahead of muon" in text
    assert "mechanism: no lead over adamw to explain" in text
    assert "suffices to explain" not in text and "what carries its lead" not in text


def test_verdict_names_the_constraint_when_the_decay_exemption_does_not_reproduce_the_gain(tmp_path):
    # grokking-like: lower is better; frozen and adamw-qk-nodecay never grok, the parametrized constraint does
    recs = _controls(
        {"adamw": 20000, "frozen": 20000.5, "adamw-qk-nodecay": 20000, "stiefel-adam": 5000, "orthogonal-param": 5000}
    )
    decay = decay_summary(
        [
            _rec(a, s, (5000 if a == "stiefel-adam" else 20000) + s, wd)
            for wd in (0.1, 1.0)
            for a in ("adamw", "stiefel-adam")
            for s in range(5)
        ],
        EPOCHS,
    )
    _write(tmp_path, "grok", controls=controls_summary(recs, EPOCHS), decay=decay)
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "learning Q/K matters here" in text
    assert "stiefel-adam is ahead of adamw, frozen, adamw-qk-nodecay" in text
    assert "no significant difference from orthogonal-param" in text
    assert "the constraint suffices for it without the Riemannian Adam, and the decay exemption does not" in text
    assert "frozen random frames do as well" not in text  # frozen never groks here
    assert "as weight decay grows (paired by seed): 0.1 → 1 no significant change" in text  # the same lead
    assert (tmp_path / "geometry_decay.png").exists()


def test_verdict_says_when_training_qk_hurts_and_frozen_frames_match_the_stiefel_arm(tmp_path):
    # the grokking pattern as measured: frozen random frames grok like the Stiefel arm, adamw never does
    recs = _controls({"adamw": 20000, "frozen": 6000, "stiefel-adam": 6000, "adamw-qk-nodecay": 20000})
    _write(tmp_path, "grok", controls=controls_summary(recs, EPOCHS))
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "training them with adamw hurts: frozen random frames do better (trained − frozen +14000" in text
    assert "learning Q/K matters here" not in text
    assert "stiefel-adam is ahead of adamw, adamw-qk-nodecay" in text
    assert "frozen random frames do as well as the Stiefel arm" in text


def test_too_few_seeds_are_said_and_never_called_a_tie(tmp_path):
    recs = _controls({"adamw": 0.0, "frozen": -3.0, "stiefel-adam": 1.0}) + [_rec("muon", 0, 49.0)]
    _write(tmp_path, "cifar", controls=controls_summary(recs, ACC))
    text = "\n".join(geometry_section(tmp_path, [("cifar", "CIFAR", "controls", "decay")]))
    assert "too few seeds yet for muon" in text and "no significant difference from muon" not in text


def test_significance_is_a_ci_that_excludes_zero():
    assert significant({"ci95": [0.1, 0.3]}) and significant({"ci95": [-0.3, -0.1]})
    assert not significant({"ci95": [-0.1, 0.3]}) and not significant({"ci95": [float("nan")] * 2})


def _with_logit(recs: list[dict], final: dict[str, float]) -> list[dict]:
    """Set each arm's largest attention logit at the last evaluation; an arm not in final loses its metrics."""
    for rec in recs:
        arm = rec["config"]["arm"]
        if arm in final:
            mech = rec["curves"]["mechanism"]
            mech["max_logit"] = [mech["max_logit"][0], [[final[arm]] * 3]]
        else:
            del rec["curves"]["mechanism"]
    return recs


def test_verdict_says_orthonormality_is_not_necessary_and_which_logits_separate_the_arms(tmp_path):
    # the grokking pattern with muon: frozen frames and muon (not orthonormal) grok like the Stiefel arm
    offsets = {"adamw": 20000, "frozen": 6000, "stiefel-adam": 6000, "adamw-qk-nodecay": 20000, "muon": 6000}
    recs = _with_logit(_controls(offsets), {"frozen": 1.3, "muon": 1.8, "adamw-qk-nodecay": 33.6})
    _write(tmp_path, "grok", controls=controls_summary(recs, EPOCHS))
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "how W_Q, W_K are learned does not carry its lead" in text and "that they stay orthonormal" not in text
    assert "muon, whose W_Q, W_K are not held orthonormal, does as well too" in text
    assert "keeps its largest attention logit at or below 1.8 at the end, every arm behind reaches 33.6" in text

    # without a tying free arm, orthonormality is what is left; overlapping logits earn no clause
    del offsets["muon"]
    recs = _with_logit(_controls(offsets), {"frozen": 40.0, "adamw-qk-nodecay": 33.6})
    (tmp_path / "grok" / "controls" / "summary.json").unlink()
    (tmp_path / "grok" / "controls").rmdir()
    _write(tmp_path, "grok", controls=controls_summary(recs, EPOCHS))
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "; that they stay orthonormal does" in text and "not held orthonormal" not in text
    assert "largest attention logit" not in text


def _grok_decay_records() -> list[dict]:
    """adamw and stiefel-adam at three weight decays. The metric 'first' is the epoch of grokking (None: never,
    the value is then the budget + 1); 'final' the final accuracy. At 0.1 and 0.3 no run groks and stiefel-adam
    ends 6 and 10 pp higher by seed; at 1 stiefel-adam groks, adamw does not."""
    recs = []
    for wd, gap in ((0.1, 6.0), (0.3, 10.0), (1.0, None)):
        for s in range(5):
            for arm in ("adamw", "stiefel-adam"):
                first = 4000 + 100 * s if (gap is None and arm == "stiefel-adam") else None
                final = 20.0 + s + (0.0 if arm == "adamw" else gap if gap is not None else 80.0 - s)
                final += 0.5 * (-1) ** s * (arm == "stiefel-adam")  # seed noise on the differences
                recs.append(
                    {
                        "config": {"arm": arm, "seed": s, "weight_decay": wd, "epochs": 20000},
                        "metrics": {"first": first, "final": final},
                        "curves": {},
                    }
                )
    return recs


FINAL = Measure("final acc", "pp", lambda r: r["metrics"]["final"], higher_is_better=True)
TO_GROK = time_to("epochs to grok", "epochs", "first", "epochs", FINAL)  # never: 20000 + 1


def test_a_weight_decay_where_every_run_is_censored_has_no_lead_and_is_compared_on_the_fallback():
    recs = _grok_decay_records()
    s = decay_summary(recs, TO_GROK)
    by = {lead["weight_decay"]: lead for lead in s["leads"]}
    assert by[0.1]["all_censored"] and by[0.3]["all_censored"] and "all_censored" not in by[1.0]
    assert "fallback" not in by[1.0] and s["fallback_measure"] == FINAL.describe()
    assert by[0.1]["fallback"]["mean_diff"] == pytest.approx(6.0 + 0.5 / 5)  # seeds 0, 2, 4 get +0.5, 1 and 3 -0.5
    assert by[0.1]["fallback"]["arms"]["adamw"]["mean"] == pytest.approx(22.0)
    assert by[1.0]["mean_diff"] == pytest.approx(4200 - 20001)
    text = lead_trend(s, digits=0)
    assert text.startswith("stiefel-adam is ahead of adamw at weight decay 1 (")
    assert "level with" not in text.split("Where every run is censored")[0]  # a censored 0 is no tie
    assert "At weight decay 0.1, 0.3 every run of both arms is censored at the budget, so there is no lead" in text
    assert "weight decay 0.1 → 0.3 not measured (every run at 0.1, 0.3 censored)" in text
    assert "weight decay 0.3 → 1 not measured (every run at 0.3 censored)" in text
    assert "stiefel-adam − adamw at weight decay 0.1 +6.10 pp [" in text and "(adamw 22.00, stiefel-adam 28.10)" in text
    assert "its standing on it, paired by seed: weight decay 0.1 → 0.3 improves (+4.00 pp [" in text
    row = next(line for line in decay_markdown(s, digits=0) if line.startswith("| 0.1 |"))
    assert row == "| 0.1 | 20001 | 20001 | every run censored | n/a | n/a | n/a | 5 |"
    # a measure without a budget never censors, and one run that groks is enough to measure a lead
    assert not all_censored(recs, FINAL) and not all_censored(recs[-10:], TO_GROK) and all_censored(recs[:10], TO_GROK)
    assert "fallback_measure" not in decay_summary(recs, FINAL)


def test_report_row_and_verdict_use_the_fallback_where_every_run_is_censored(tmp_path):
    _write(tmp_path, "grok", decay=decay_summary(_grok_decay_records(), TO_GROK))
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "wd 0.1: every run censored; final acc +6.10 pp [" in text and "wd 1: -15801 [" in text
    assert "0.1 → 0.3 not measured (every run at 0.1, 0.3 censored), 0.3 → 1 not measured" in text
    assert "where every run is censored, on final acc stiefel-adam is ahead of adamw at weight decay 0.1, 0.3" in text
    assert (tmp_path / "geometry_decay.png").exists()
    one = [r for r in _grok_decay_records() if r["config"]["weight_decay"] != 0.3 or r["config"]["seed"] == 0]
    (tmp_path / "grok" / "decay" / "summary.json").write_text(json.dumps({"decay": decay_summary(one, TO_GROK)}))
    text = "\n".join(geometry_section(tmp_path, [("grok", "grokking", "controls", "decay")]))
    assert "ahead of adamw at weight decay 0.1; one seed only against adamw at weight decay 0.3" in text


def test_the_mechanism_section_opens_with_one_paragraph_of_both_computed_answers(tmp_path):
    import json

    (tmp_path / "grok" / "interventions").mkdir(parents=True)
    (tmp_path / "lm" / "lr-stability").mkdir(parents=True)
    interventions = {"mechanism_verdict": "the attention-logit scale is causal in both directions", "verdicts": []}
    (tmp_path / "grok" / "interventions" / "summary.json").write_text(json.dumps({"interventions": interventions}))
    stability = {
        "labels": ["adamw"], "sensitivity": {"adamw": {"mean": 0.5}}, "sensitivity_vs_adamw": [],
        "precondition": {"met": True, "text": "adamw's logits grow"}, "verdict": "partly: less sensitive than adamw",
    }  # fmt: skip
    (tmp_path / "lm" / "lr-stability" / "summary.json").write_text(json.dumps({"stability": stability}))
    lines = _mechanism(tmp_path, "grok", "lm")
    assert lines[0] == (
        "The mechanism in one paragraph, from the computed verdicts below: is the attention-logit scale the "
        "mechanism in modular addition (grokking)? the attention-logit scale is causal in both directions; do the "
        "frames buy high-learning-rate stability in character-level LM (tiny Shakespeare)? partly: less sensitive "
        "than adamw."
    )
    assert "### The mechanism, by intervention: modular addition (grokking)" in lines
    assert (
        "[lm/lr-stability](lm/lr-stability/summary.md) (runs). Precondition (met): adamw's logits grow."
        in lines[lines.index("### High learning rates: character-level LM (tiny Shakespeare)") + 2]
    )
    assert _mechanism(tmp_path, "cifar") == []  # no mechanism experiment: no paragraph


def _mechanism(root, *families, controls=()):
    """REPORT's mechanism lines from the summaries under root, each family answering through its own hook."""
    from stiefel_attention.bench.family import get_family
    from stiefel_attention.bench.report.geometry import mechanism_found, mechanism_section

    return mechanism_section(root, mechanism_found(root, [get_family(f) for f in families]), controls)


def test_the_mechanism_section_reads_a_testbed_only_through_its_hook(tmp_path):
    """A testbed of its own (no summary keys the report layer knows) answers with the typed record."""
    import json
    from types import SimpleNamespace

    from stiefel_attention.bench.report.geometry import mechanism_found, mechanism_section
    from stiefel_attention.bench.report.summaries import Answer, MechanismAnswer

    (tmp_path / "toy" / "probe").mkdir(parents=True)
    (tmp_path / "toy" / "probe" / "summary.json").write_text(json.dumps({"n_planned": 4, "n_planned_done": 3}))
    seen = []

    def hook(experiment, summary):
        seen.append((experiment, summary))
        return MechanismAnswer("Probing", (Answer("does it probe?", "yes"),), "It probes.", ("one bullet",))

    toy = SimpleNamespace(name="toy", title="a toy", mechanism_experiment="probe", mechanism_answer=hook)
    lines = mechanism_section(tmp_path, mechanism_found(tmp_path, [toy]))
    assert seen == [("probe", {"n_planned": 4, "n_planned_done": 3})]
    assert lines == [
        "The mechanism in one paragraph, from the computed verdicts below: does it probe? yes.",
        "",
        "### Probing: a toy",
        "",
        "[toy/probe](toy/probe/summary.md) (3/4 runs). It probes.",
        "",
        "- one bullet",
        "",
    ]


def _profile_root(root, profile: str, offsets: dict[str, float], n: int, by_arm=None, family="grok"):
    """A results folder holding one controls summary.json of the given profile (planned_by_arm: open plan)."""
    summary = {"controls": controls_summary(_controls(offsets, n), EPOCHS), "profile": profile}
    summary |= {"n_planned": 10, "n_planned_done": 10 if by_arm is None else sum(k for k, _ in by_arm.values())}
    summary |= {"planned_by_arm": by_arm} if by_arm else {}
    (root / family / "controls").mkdir(parents=True)
    (root / family / "controls" / "summary.json").write_text(json.dumps(summary))
    return root


def test_beside_sets_another_profile_beside_and_compares_each_standing(tmp_path, monkeypatch):
    testbeds = [("grok", "grokking", "controls", "decay")]
    cpu = _profile_root(tmp_path / "results", "cpu", {"adamw": 20000, "frozen": 6000, "stiefel-adam": 6000}, 5)
    # paper: frozen behind stiefel-adam (cpu: level), adamw level with it at 2 seeds (cpu: ahead), one arm at 1 seed
    arms = {"adamw": 6000, "frozen": 9000, "stiefel-adam": 6000}
    paper = _profile_root(tmp_path / "results-paper", "paper", arms, 5)
    text = "\n".join(geometry_section(paper, testbeds, [cpu]))
    assert "| [grokking, profile paper](grok/controls/summary.md) |" in text
    assert "| [grokking, profile cpu](../results/grok/controls/summary.md) |" in text
    assert text.index("profile paper](") < text.index("profile cpu](")  # this folder's row first
    assert "- stiefel-adam − frozen: different. Profile paper: stiefel-adam ahead of frozen (" in text
    assert "; profile cpu: stiefel-adam level with frozen (" in text
    assert "- stiefel-adam − adamw: different. Profile paper: stiefel-adam level with adamw (" in text
    assert "- adamw − frozen: different. Profile paper: adamw ahead of frozen" in text  # cpu: behind frozen
    assert "![each comparison at both profiles](grok_across_profiles.png)" in text
    assert (paper / "grok_across_profiles.png").stat().st_size > 0
    alone = "\n".join(geometry_section(paper, testbeds))  # without --beside: as before, no profile, no comparison
    assert "Across profiles" not in alone and "profile paper" not in alone and "[grokking](grok/controls" in alone
    _profile_root(tmp_path / "results", "cpu", {"adamw": 0.5, "frozen": 0.0, "stiefel-adam": 0.0}, 5, family="lm")
    lm = [*testbeds, ("lm", "char LM", "controls", None)]
    assert "char LM" in "\n".join(geometry_section(cpu, lm, [paper]))
    assert "char LM" not in "\n".join(geometry_section(paper, lm, [cpu]))  # a testbed paper has not run
    _profile_root(tmp_path / "wide", "cpu", {"adamw": 20000, "frozen": 6000, "stiefel-adam": 6000, "muon": 6000}, 5)
    text = "\n".join(geometry_section(tmp_path / "wide", testbeds, [paper]))
    assert "- Not run at profile paper: stiefel-adam − muon." in text and "- stiefel-adam − muon" not in text

    # an open plan: comparisons hold 'so far' until both arms have every planned run; 1 seed is not comparable
    open_plan = {"adamw": [2, 5], "frozen": [1, 5], "stiefel-adam": [2, 5]}
    early = _profile_root(tmp_path / "early", "paper", {"adamw": 20000, "frozen": 6000, "stiefel-adam": 6000}, 2)
    summary = json.loads((early / "grok" / "controls" / "summary.json").read_text())
    frozen_at_one = {**summary, "planned_by_arm": open_plan}
    frozen_at_one["controls"]["comparisons"] = [
        {**c, "n_seeds": 1, "ci95": [None, None]} if "frozen" in (c["arm"], c["baseline"]) else c
        for c in summary["controls"]["comparisons"]
    ]
    (early / "grok" / "controls" / "summary.json").write_text(json.dumps(frozen_at_one))
    text = "\n".join(geometry_section(early, testbeds, [cpu]))
    assert "- stiefel-adam − adamw: the same so far. Profile paper: stiefel-adam ahead of adamw (" in text
    assert "- stiefel-adam − frozen: not yet comparable. Profile paper: untested (" in text
    assert "1 seed, p_W=1); profile cpu: stiefel-adam level with frozen (" in text
    # the row's verdict holds 'so far' too, naming the arms begun and their runs; the complete folder's does not
    assert "| so far (adamw 2/5, frozen 1/5, stiefel-adam 2/5 runs): " in text
    assert text.count("| so far (") == 1 and "| so far" not in "\n".join(geometry_section(cpu, testbeds))
    # the figure draws what the list says: per comparison both profiles, a CI bar where there is one
    drawn = []
    monkeypatch.setattr(geometry, "save_figure", lambda fig, *args: drawn.append(fig))
    mine, theirs = (json.loads((r / "grok" / "controls" / "summary.json").read_text()) for r in (early, cpu))
    assert geometry.across_profiles_plot(early, "x.png", "grokking", mine, theirs) == "x.png"
    [ax] = drawn[0].axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["adamw − frozen", "stiefel-adam − adamw", "stiefel-adam − frozen"]
    points = {(bar.lines[0].get_xdata()[0], bar.lines[0].get_markerfacecolor() == "none") for bar in ax.containers}
    by_pair = {(c["arm"], c["baseline"]): c for c in mine["controls"]["comparisons"]}
    assert len(ax.containers) == 2 * len(labels)
    assert (by_pair[("stiefel-adam", "frozen")]["mean_diff"], True) in points  # one seed: hollow, no bar
    assert (by_pair[("stiefel-adam", "adamw")]["mean_diff"], False) in points
    muon = json.loads((tmp_path / "wide" / "grok" / "controls" / "summary.json").read_text())
    muon["controls"]["measure"] = {**muon["controls"]["measure"], "name": "something else"}
    assert geometry.across_profiles_plot(early, "y.png", "grokking", mine, muon) is None  # not comparable: no plot


def test_the_high_learning_rate_section_answers_the_bounded_logit_questions_with_the_largest_logit_and_bound(tmp_path):
    import json

    (tmp_path / "lm" / "lr-stability").mkdir(parents=True)
    bounded = {
        "verdict": {"qk-norm": "yes: as stable as qk-norm", "frames": "yes: less sensitive", "needs frames": "no"},
        "bounds": {"stiefel-adam-bounded": 16.0, "adamw-bounded": 16.0},
        "largest": {"stiefel-adam-bounded": 9.25, "adamw-bounded": 31.5},
    }
    stability = {
        "labels": ["adamw"], "sensitivity": {"adamw": {"mean": 0.5}}, "sensitivity_vs_adamw": [],
        "precondition": {"met": True, "text": "adamw's logits grow"}, "verdict": "partly", "bounded": bounded,
    }  # fmt: skip
    (tmp_path / "lm" / "lr-stability" / "summary.json").write_text(json.dumps({"stability": stability}))
    lines = _mechanism(tmp_path, "lm")
    assert lines[0].endswith("does bounding the whole logit buy qk-norm's stability? yes: as stable as qk-norm.")
    assert "- Does the bound buy qk-norm's stability? **yes: as stable as qk-norm**." in lines
    assert "- Does it need the frames? **no**." in lines
    largest = "adamw-bounded 31.5 (bound 16.0); stiefel-adam-bounded 9.2 (bound 16.0)"
    assert f"- The largest attention logit over every multiplier, against the bound: {largest}." in lines


def test_the_bounded_frames_are_placed_against_adamw_and_the_plain_frames_at_their_tuned_rates(tmp_path):
    import json

    (tmp_path / "lm" / "lr-stability").mkdir(parents=True)
    (tmp_path / "mqar" / "main").mkdir(parents=True)
    bounded = {"verdict": {"qk-norm": "yes", "frames": "yes", "needs frames": "yes"}, "bounds": {}, "largest": {}}
    stability = {
        "labels": [], "sensitivity": {}, "sensitivity_vs_adamw": [], "verdict": "partly", "bounded": bounded,
        "precondition": {"met": True, "text": "grows"},
    }  # fmt: skip
    (tmp_path / "lm" / "lr-stability" / "summary.json").write_text(json.dumps({"stability": stability}))

    def comparison(arm, baseline, diffs):
        from stiefel_attention.bench.report.stats import paired_comparison

        return {**paired_comparison(diffs, [0.0] * len(diffs)), "arm": arm, "baseline": baseline}

    controls = {
        "measure": {"name": "steps to 99%", "unit": "steps", "higher_is_better": False},
        "comparisons": [
            comparison("stiefel-adam-bounded", "adamw", [100.0, 120.0, 90.0, 110.0]),  # behind: more steps
            comparison("stiefel-adam", "stiefel-adam-bounded", [10.0, -6.0, 5.0, -5.0]),  # level, stated reversed
        ],
    }
    (tmp_path / "mqar" / "main" / "summary.json").write_text(json.dumps({"controls": controls}))
    lines = _mechanism(tmp_path, "lm", controls=[("mqar", "recall", "main")])
    adamw = [line for line in lines if "stiefel-adam-bounded against adamw" in line]
    frames = [line for line in lines if "stiefel-adam-bounded against stiefel-adam" in line]
    rates = "each testbed at its own rates (tuned where it has a sweep), paired by seed"
    behind = "recall: behind adamw (+105 steps [+84, +126], 4 seeds, p_W=0.12)"
    assert adamw == [f"- stiefel-adam-bounded against adamw, {rates}: {behind}."]
    assert frames[0].startswith(f"- stiefel-adam-bounded against stiefel-adam, {rates}: recall: level with")
    assert _mechanism(tmp_path, "lm") == [
        line for line in lines if "each testbed at its own rates" not in line
    ]  # without controls, no such line


def test_plan_progress_reads_what_write_experiment_adds_to_every_summary():
    from stiefel_attention.bench.report.summaries import PlanProgress

    summary = {"n_records": 7, "n_planned": 8, "n_planned_done": 6, "planned_by_arm": {"a": [4, 4], "b": [2, 4]}}
    progress = PlanProgress.of(summary)
    assert progress.runs() == "6/8 runs" and progress.begun() == ["b 2/4"]
    assert progress.open_arms(("a", "b")) == ["b 2/4"] and progress.open_arms(("a",)) == []
    assert progress.sentence() == (
        "7 finished runs (6 of the 8 planned cells, 1 beyond the plan); finished of planned per arm: a 4/4, b 2/4"
    )
    assert PlanProgress.of({"n_records": 1}).runs() == "runs" and PlanProgress.of({"n_records": 1}).sentence() == (
        "1 finished run"
    )
