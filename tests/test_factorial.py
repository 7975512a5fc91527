"""The two-way decomposition of the geometry x optimizer table: shares that add to one, each factor found when it
alone moves the cells, intervals that shrink with seeds, and the best cell against the second."""

from __future__ import annotations

import numpy as np
import pytest

from stiefel_attention.bench.report.factorial import decompose, two_way_shares

GEOMETRIES = ("euclidean", "qk-norm", "frames")
OPTIMIZERS = ("adam", "muon", "sgd")


def _table(effect, n_seeds=12, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    seed_effect = rng.normal(0, 0.05, n_seeds)  # shared by every cell of a seed: pairing removes it
    return {
        (g, o): {s: effect(i, j) + seed_effect[s] + rng.normal(0, noise) for s in range(n_seeds)}
        for i, g in enumerate(GEOMETRIES)
        for j, o in enumerate(OPTIMIZERS)
    }


@pytest.mark.parametrize(
    "effect, dominant",
    [
        (lambda i, j: 1.0 * i, "geometry"),
        (lambda i, j: 1.0 * j, "optimizer"),
        (lambda i, j: 1.0 * ((i == j) - 1 / 3), "interaction"),  # a diagonal pattern, no main effects
    ],
)
def test_the_factor_that_moves_the_cells_carries_the_spread(effect, dominant):
    d = decompose(_table(effect), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    assert sum(d.shares.values()) == pytest.approx(1.0)
    assert d.shares[dominant] > 0.95
    lo, hi = d.intervals[dominant]
    assert lo <= d.shares[dominant] <= hi and lo > 0.9


def test_the_shares_are_the_textbook_two_way_sums_of_squares():
    means = np.array([[1.0, 2.0, 4.0], [2.0, 2.0, 2.0]])
    grand = means.mean()
    rows, cols = means.mean(1), means.mean(0)
    ss_g = 3 * ((rows - grand) ** 2).sum()
    ss_o = 2 * ((cols - grand) ** 2).sum()
    total = ((means - grand) ** 2).sum()  # balanced: the three parts add to the total
    shares = two_way_shares(means)
    assert shares["geometry"] == pytest.approx(ss_g / total) and shares["optimizer"] == pytest.approx(ss_o / total)
    assert shares["interaction"] == pytest.approx(1 - (ss_g + ss_o) / total)


def test_intervals_shrink_with_more_seeds_and_the_best_cell_is_compared_with_the_second():
    effect = lambda i, j: 0.3 * i + 0.1 * j  # noqa: E731
    few = decompose(_table(effect, n_seeds=4, noise=0.2), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    many = decompose(_table(effect, n_seeds=40, noise=0.2), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    width = lambda d: d.intervals["geometry"][1] - d.intervals["geometry"][0]  # noqa: E731
    assert width(many) < width(few)
    assert many.best == ("euclidean", "adam") and many.second == ("euclidean", "muon")
    assert many.best_vs_second["mean_diff"] < 0 and many.best_vs_second["n_seeds"] == 40
    text = many.sentence("nats/char", higher_is_better=False)
    assert "the geometry carries the most" in text and "Best cell: euclidean x adam" in text


def test_a_missing_cell_or_too_few_shared_seeds_is_refused():
    table = _table(lambda i, j: 0.0)
    del table[("frames", "sgd")]
    with pytest.raises(ValueError, match="misses 1 cells: frames x sgd"):
        decompose(table, GEOMETRIES, OPTIMIZERS, higher_is_better=True)
    table = _table(lambda i, j: 0.0, n_seeds=1)
    with pytest.raises(ValueError, match="share 1 seeds"):
        decompose(table, GEOMETRIES, OPTIMIZERS, higher_is_better=True)


def test_every_cell_of_the_table_is_an_arm_of_its_geometry_and_its_optimizer_family():
    import torch

    from stiefel_attention import StiefelAdam, StiefelMuon, StiefelSGD, qk_parameters
    from stiefel_attention.bench.arms import (
        FACTORIAL,
        FACTORIAL_GEOMETRIES,
        FACTORIAL_OPTIMIZERS,
        HyperParameters,
        arm_spec,
        attention_options,
        build_optimizers,
    )
    from stiefel_attention.bench.models import CharGPT

    assert set(FACTORIAL) == {(g, o) for g in FACTORIAL_GEOMETRIES for o in FACTORIAL_OPTIMIZERS}
    families = {"adam": (StiefelAdam,), "muon": (torch.optim.Muon, StiefelMuon), "sgd": (torch.optim.SGD, StiefelSGD)}
    for (geometry, family), arm in FACTORIAL.items():
        att = arm_spec(arm).attention
        is_geometry = {
            "euclidean": att["qk"] == "euclidean" and not att.get("qk_norm") and not att.get("qk_input_norm"),
            "qk-norm": att["qk"] == "euclidean" and att.get("qk_norm", False),
            "frames": att["qk"] == "stiefel" and not att.get("qk_input_norm"),
            "bounded frames": att["qk"] == "stiefel" and att.get("qk_input_norm", False),
        }[geometry]
        assert is_geometry and "temperature" not in att, arm
        torch.manual_seed(0)
        model = CharGPT(20, 8, d_model=16, n_layers=1, n_heads=2, head_dim=4, mlp_ratio=2, **attention_options(arm))
        opts = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=1e-2, max_step=0.1))
        qk = {id(p) for _, p in qk_parameters(model)}
        stepping = {type(o) for o in opts for g in o.param_groups for p in g["params"] if id(p) in qk}
        assert len(stepping) == 1 and issubclass(stepping.pop(), families[family]), arm


def test_each_variant_has_its_cells_geometry_and_optimizer_family_and_sgd_nodecay_differs_only_in_the_decay():
    import torch

    from stiefel_attention import qk_parameters
    from stiefel_attention.bench.arms import (
        FACTORIAL,
        FACTORIAL_VARIANTS,
        HyperParameters,
        attention_options,
        build_optimizers,
    )
    from stiefel_attention.bench.models import CharGPT

    hp = HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=1e-2, max_step=0.1)

    def qk_groups(arm):
        torch.manual_seed(0)
        model = CharGPT(20, 8, d_model=16, n_layers=1, n_heads=2, head_dim=4, mlp_ratio=2, **attention_options(arm))
        qk = {id(p) for _, p in qk_parameters(model)}
        return [
            (type(o), g) for o in build_optimizers(model, arm, hp) for g in o.param_groups if id(g["params"][0]) in qk
        ]

    for variant, cell in FACTORIAL_VARIANTS.items():
        assert cell in FACTORIAL, variant
        assert attention_options(variant) == attention_options(FACTORIAL[cell]), variant
    (plain,) = qk_groups("sgd")
    (free,) = qk_groups("sgd-nodecay")
    assert plain[0] is free[0] is torch.optim.SGD
    assert plain[1]["weight_decay"] == 0.1 and free[1]["weight_decay"] == 0.0
    assert {k: v for k, v in plain[1].items() if k not in ("params", "weight_decay")} == {
        k: v for k, v in free[1].items() if k not in ("params", "weight_decay")
    }


def test_a_variant_in_its_cells_place_gives_the_decomposition_of_that_table():
    """A lone outlying cell makes the interaction carry the most; its variant without the outlier, put in its place,
    leaves the geometry's effect alone: the substituted decomposition says so, and the summary shows it."""
    from stiefel_attention.bench.report.factorial import FactorialSection, factorial_markdown, factorial_section

    value = {"a": 0.0, "b": 5.0, "c": 1.0, "d": 1.0, "w": 0.0}  # b: the outlier; w: b's cell without it
    recs = _records(lambda a, s: value[a] + 0.01 * ((s * 7 + ord(a)) % 5), arms=("a", "b", "c", "d", "w"))
    section = factorial_section(recs, _Measure(), _ARMS, _G, _O, {"w": ("euclidean", "sgd")})
    assert max(section.decomposition["shares"], key=section.decomposition["shares"].get) != "geometry"
    sub = section.substituted["w"]["shares"]
    assert sub["geometry"] > 0.95 and sub == FactorialSection.from_dict(section.to_dict()).substituted["w"]["shares"]
    text = "\n".join(factorial_markdown(section))
    assert "| w | euclidean x sgd |" in text and "| w for euclidean x sgd (4 seeds) | 100% [" in text
    said = section.substitutions_sentence()
    assert said.startswith("Each variant in its cell's place: w (euclidean x sgd) gives geometry 100% [")
    assert said.endswith(": the geometry carries the most")
    recs += [
        {"config": {"arm": "u", "seed": r["config"]["seed"]}, "metrics": dict(r["metrics"])}
        for r in recs
        if r["config"]["arm"] == "b"
    ]  # u: a variant with b's values: the table's answer unchanged
    both = factorial_section(recs, _Measure(), _ARMS, _G, _O, {"w": ("euclidean", "sgd"), "u": ("euclidean", "sgd")})
    assert both.substitutions_sentence().startswith(
        "Each variant in its cell's place: u (euclidean x sgd) leaves every share within the table's interval; "
        "w (euclidean x sgd) gives geometry 100%"
    )
    alone = factorial_section(recs[:8] + [r for r in recs if r["config"]["arm"] in "bcd"], _Measure(), _ARMS, _G, _O,
                              {"w": ("euclidean", "sgd")})  # fmt: skip
    assert alone.substituted == {} and alone.substitutions_sentence() == ""  # w has no runs: no substitute table


# --- the testbed's factorial section -------------------------------------------------------------------------


class _Measure:
    """A stand-in for geometry.Measure: the value is metrics["v"]; censored when metrics["c"]."""

    def __init__(self, name="loss", higher=False, censored=None, fallback=None):
        self.name, self.unit, self.higher_is_better = name, "u", higher
        self.censored, self.fallback = censored, fallback

    def value(self, rec):
        return rec["metrics"]["v"]

    def describe(self):
        return {"name": self.name, "unit": self.unit, "higher_is_better": self.higher_is_better}


_G, _O = ("euclidean", "frames"), ("adam", "sgd")
_ARMS = {("euclidean", "adam"): "a", ("euclidean", "sgd"): "b", ("frames", "adam"): "c", ("frames", "sgd"): "d"}


def _records(value, arms=("a", "b", "c", "d", "v"), seeds=range(4)):
    return [{"config": {"arm": a, "seed": s}, "metrics": {"v": value(a, s), "c": False}} for a in arms for s in seeds]


def test_the_section_holds_every_cell_decomposes_and_compares_each_variant_with_the_reference_cell():
    from stiefel_attention.bench.report.factorial import FactorialSection, factorial_markdown, factorial_section

    geometry_effect = {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0, "v": 1.5}
    recs = _records(lambda a, s: geometry_effect[a] + 0.01 * s + 0.001 * (a == "b") + 0.001 * (a == "v" and s == 0))
    section = factorial_section(recs, _Measure(), _ARMS, _G, _O, variants={"v": ("frames", "adam")})
    assert [(c.arm, c.n) for c in section.cells] == [("a", 4), ("b", 4), ("c", 4), ("d", 4)]
    assert section.decomposition["shares"]["geometry"] > 0.99 and section.not_yet == ""
    assert "the geometry carries the most" in section.sentence
    assert section.variants_vs["v"]["mean_diff"] == pytest.approx(0.50025)  # v - the frames x adam cell ("c")
    again = FactorialSection.from_dict(section.to_dict())  # what summary.json holds reads back as the same section
    assert again == section
    text = "\n".join(factorial_markdown(again))
    assert (
        "| euclidean | 0.015 ± 0.013 (`a`, 4) |" in text
        and "| v | frames x adam | 1.515 ± 0.013 | 4 | +0.500 |" in text
    )


def test_a_cell_without_runs_is_shown_as_not_run_and_leaves_no_decomposition():
    from stiefel_attention.bench.report.factorial import factorial_markdown, factorial_section

    section = factorial_section(_records(lambda a, s: float(s), arms=("a", "b", "c")), _Measure(), _ARMS, _G, _O)
    assert section.decomposition is None and "misses 1 cells: frames x sgd" in section.not_yet
    text = "\n".join(factorial_markdown(section))
    assert "not run (`d`)" in text and "Cells not run yet: d." in text and "share of the between-cell" not in text


def test_equal_cells_have_no_spread_to_divide_and_all_censored_runs_fall_back_to_the_second_measure():
    from stiefel_attention.bench.report.factorial import factorial_section

    flat = factorial_section(_records(lambda a, s: 1.0), _Measure(), _ARMS, _G, _O)
    assert flat.decomposition is None and "no spread to divide" in flat.not_yet
    fallback = _Measure("accuracy", higher=True)
    fallback.value = lambda rec: rec["metrics"]["acc"]
    recs = _records(lambda a, s: 61.0)
    for r in recs:
        r["metrics"].update(
            c=True, acc={"a": 1.0, "b": 2.0, "c": 5.0, "d": 6.0, "v": 0.0}[r["config"]["arm"]] + r["config"]["seed"]
        )
    steps = _Measure("steps", censored=lambda rec: rec["metrics"]["c"], fallback=fallback)
    section = factorial_section(recs, steps, _ARMS, _G, _O)
    assert section.measure["name"] == "accuracy" and "every run is censored on steps" in section.note
    assert tuple(section.decomposition["best"]) == ("frames", "sgd") and section.cells[0].censored == 0
    partly = factorial_section(recs[:4] + _records(lambda a, s: 10.0 + s, arms=("b", "c", "d")), steps, _ARMS, _G, _O)
    assert partly.measure["name"] == "steps" and partly.cells[0].censored == 4  # not all censored: steps, flagged


@pytest.mark.parametrize("family", ["lm", "mqar", "cifar"])
def test_the_factorial_plans_every_cell_and_variant_and_reuses_the_other_experiments_cells(family):
    from stiefel_attention.bench import family as family_module
    from stiefel_attention.bench.arms import FACTORIAL_ARMS

    fam = family_module.get_family(family)
    plan = fam.cells("factorial", "smoke")
    assert sorted({c.config["arm"] for c in plan}) == sorted(FACTORIAL_ARMS) and len(plan) == 2 * len(FACTORIAL_ARMS)
    shared = fam.cells("main" if family != "cifar" else "controls", "smoke")
    both = {c.key for c in plan} & {c.key for c in shared}
    assert {c.config["arm"] for c in plan if c.key in both} >= {"adamw", "stiefel-adam", "qk-norm"}


def test_report_answers_the_title_per_testbed_from_its_factorial_summary(tmp_path):
    """REPORT's factorial section: the decomposition's sentence where every cell ran, else why not, with the runs."""
    import json

    from stiefel_attention.bench.report.factorial import factorial_report_section, factorial_section

    full = factorial_section(_records(lambda a, s: (a in "cd") + 0.01 * s), _Measure(), _ARMS, _G, _O)
    part = factorial_section(_records(lambda a, s: float(s), arms=("a", "b", "c")), _Measure(), _ARMS, _G, _O)
    for family, section, plots in (("one", full, ["factorial.png"]), ("two", part, [])):
        (tmp_path / family / "factorial").mkdir(parents=True)
        summary = {"factorial": section.to_dict(), "n_planned": 16, "n_planned_done": 12, "plots": plots}
        (tmp_path / family / "factorial" / "summary.json").write_text(json.dumps(summary))
    testbeds = [("one", "first", ("factorial",)), ("two", "second", ("factorial",)), ("three", "third", ())]
    lines = factorial_report_section(tmp_path, testbeds)
    assert lines[0] == "## Geometry or optimizer? The factorial"
    first = next(line for line in lines if line.startswith("- first"))
    assert first.startswith("- first, loss: [one/factorial](one/factorial/summary.md) (12/16 runs): of the spread")
    assert "the geometry carries the most" in first
    assert "  ![first: the cell means of loss](one/factorial/factorial.png)" in lines
    second = next(line for line in lines if line.startswith("- second"))
    assert second.endswith("no decomposition: the factorial misses 1 cells: frames x sgd.")
    assert not any("third" in line for line in lines)
    assert factorial_report_section(tmp_path, [("three", "third", ())]) == []  # no factorial: no section


def _rss(x: np.ndarray, design: np.ndarray) -> float:
    coef, *_ = np.linalg.lstsq(design, x, rcond=None)
    return float(((x - design @ coef) ** 2).sum())


def test_the_block_anova_matches_nested_least_squares_fits_over_every_run():
    """An independent computation: each source's F from the residual sums of squares of two nested linear models
    (dummy columns) fitted to all A x B x S runs, the seeds as blocks."""
    from scipy import stats as sps

    from stiefel_attention.bench.report.stats import block_two_way_anova

    rng = np.random.default_rng(3)
    n_a, n_b, n_s = 4, 3, 6
    x = rng.normal(size=(n_a, n_b, n_s)) + rng.normal(size=n_s) + 0.4 * np.arange(n_a)[:, None, None]
    a, b, s = (m.ravel() for m in np.meshgrid(range(n_a), range(n_b), range(n_s), indexing="ij"))
    # sum-to-zero coding: each level but the first a column, the first -1 in every column (balanced, so dropping
    # a main effect's columns with the interaction's kept gives that effect's textbook sum of squares)
    dummies = lambda idx, n: np.eye(n)[idx][:, 1:] - (idx == 0)[:, None]  # noqa: E731
    one, da, db, ds = np.ones((x.size, 1)), dummies(a, n_a), dummies(b, n_b), dummies(s, n_s)
    dab = np.einsum("ni,nj->nij", da, db).reshape(x.size, -1)
    full = np.hstack([one, da, db, dab, ds])
    rss_full = _rss(x.ravel(), full)
    df_error = x.size - full.shape[1]
    got = block_two_way_anova(x)
    assert got["error"]["df"] == df_error == (n_a * n_b - 1) * (n_s - 1)
    assert got["error"]["ss"] == pytest.approx(rss_full)
    for source, reduced, df in (
        ("interaction", np.hstack([one, da, db, ds]), (n_a - 1) * (n_b - 1)),
        ("a", np.hstack([one, db, dab, ds]), n_a - 1),
        ("b", np.hstack([one, da, dab, ds]), n_b - 1),
    ):
        f = ((_rss(x.ravel(), reduced) - rss_full) / df) / (rss_full / df_error)
        assert got[source]["df"] == df and got[source]["f"] == pytest.approx(f, rel=1e-9)
        assert got[source]["p"] == pytest.approx(float(sps.f.sf(f, df, df_error)), rel=1e-9)


def test_with_no_effect_each_source_is_rejected_about_one_time_in_twenty_however_strong_the_seeds():
    """The seeds as blocks: a seed's own level (here 10x the noise) is taken out; an error term that kept it would
    almost never reject."""
    from stiefel_attention.bench.report.stats import block_two_way_anova

    rng = np.random.default_rng(0)
    rejected = {"a": 0, "b": 0, "interaction": 0}
    n = 600
    for _ in range(n):
        x = rng.normal(size=(4, 3, 12)) + 10 * rng.normal(size=12)
        for k, v in block_two_way_anova(x).items():
            if k != "error":
                rejected[k] += v["p"] < 0.05
    for k, count in rejected.items():
        assert 0.02 < count / n < 0.09, (k, count)


def test_a_factor_is_said_to_carry_the_most_only_when_its_effect_stands_out_from_the_seed_noise():
    strong = decompose(_table(lambda i, j: 1.0 * i), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    assert strong.p_values["geometry"] < 1e-6 and strong.p_values["interaction"] > 1e-3
    assert "the geometry carries the most" in strong.sentence("u", False)
    assert "geometry p=" in strong.sentence("u", False)
    # no effect at all: the seed noise alone spreads the cells, the interaction (4 of 8 degrees of freedom) most
    noise = decompose(_table(lambda i, j: 0.0, noise=0.1, seed=2), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    lead = max(noise.shares, key=noise.shares.get)
    assert noise.p_values[lead] >= 0.05
    assert f"the {lead} has the largest share, but its effect does not stand out from the seed noise" in (
        noise.sentence("u", False)
    )


def test_without_noise_any_spread_is_an_effect_and_no_spread_is_undefined():
    from stiefel_attention.bench.report.stats import block_two_way_anova

    additive = np.arange(2)[:, None, None] + np.zeros((2, 2, 3)) + np.arange(3)  # geometry and seed effects only
    got = block_two_way_anova(additive)
    assert got["a"]["p"] == 0.0 and got["a"]["f"] == float("inf")
    assert np.isnan(got["b"]["p"]) and np.isnan(got["interaction"]["f"])


def test_the_readme_findings_give_each_factorial_answer_once_every_cell_has_run(tmp_path):
    import json

    from stiefel_attention.bench.report import findings_lines
    from stiefel_attention.bench.report.factorial import factorial_section

    full = factorial_section(_records(lambda a, s: (a in "cd") + 0.01 * s), _Measure(), _ARMS, _G, _O)
    part = factorial_section(_records(lambda a, s: float(s), arms=("a", "b", "c")), _Measure(), _ARMS, _G, _O)
    for family, section in (("mqar", full), ("lm", part)):
        (tmp_path / family / "factorial").mkdir(parents=True)
        summary = {"factorial": section.to_dict(), "n_planned": 168, "n_planned_done": 168}
        (tmp_path / family / "factorial" / "summary.json").write_text(json.dumps(summary))
    said = [line for line in findings_lines(tmp_path, "results") if "Geometry or optimizer?" in line]
    assert said == [
        "- [Geometry or optimizer?](results/REPORT.md#geometry-or-optimizer-the-factorial) multi-query associative "
        f"recall, loss ([mqar/factorial](results/mqar/factorial/summary.md), 168/168 runs): {full.sentence}."
    ]


def test_an_interaction_in_one_cell_is_named_and_a_difference_in_steps_has_no_decimals():
    """One cell failing alone (as a rule that never solves a task in one geometry) is an interaction: the sentence
    names that cell and its part of the interaction's sum of squares."""
    fails = lambda i, j: 900.0 if (i, j) == (0, 2) else 400.0 + 25.0 * j + 30.0 * i  # noqa: E731  (euclidean x sgd)
    d = decompose(_table(fails, noise=5.0), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    g, o, part = d.interaction_cells()[0]
    assert (g, o) == ("euclidean", "sgd") and 0.4 < part < 0.5  # 4/9 of it for a lone cell of a 3 x 3 table
    assert sum(c[2] for c in d.interaction_cells()) == pytest.approx(1.0)
    text = d.sentence("steps", higher_is_better=False)
    assert "the interaction carries the most (its largest cell: euclidean x sgd, 4" in text
    lo, hi = d.best_vs_second["ci95"]
    assert f"({d.best_vs_second['mean_diff']:+.0f} steps [{lo:+.0f}, {hi:+.0f}], lower is better)" in text
    small = decompose(_table(lambda i, j: 0.3 * i), GEOMETRIES, OPTIMIZERS, higher_is_better=False)
    assert "its largest cell" not in small.sentence("nats/char", False)  # the geometry leads: no cell to name
    assert f"{small.best_vs_second['mean_diff']:+.3f} nats/char" in small.sentence("nats/char", False)


def test_the_heat_map_labels_each_cell_with_its_mean_its_censored_runs_and_a_readable_colour(tmp_path, monkeypatch):
    import matplotlib.axes

    from stiefel_attention.bench.report.factorial import factorial_plot, factorial_section

    recs = _records(lambda a, s: {"a": 400.0, "b": 1201.0, "c": 455.0}[a] + s, arms=("a", "b", "c"))
    for r in recs:
        r["metrics"]["c"] = r["config"]["arm"] == "b"
    section = factorial_section(recs, _Measure("steps", censored=lambda rec: rec["metrics"]["c"]), _ARMS, _G, _O)
    labels = {}
    real = matplotlib.axes.Axes.text

    def text(self, x, y, s, **kw):
        labels[s] = kw.get("color")
        return real(self, x, y, s, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    made: list[str] = []
    factorial_plot(section, tmp_path, made)
    assert made == ["factorial.png"] and (tmp_path / "factorial.png").stat().st_size > 0
    # lower is better: viridis_r puts the best (400) on light yellow, the never-solving cell on dark purple
    assert labels == {"402": "black", "1202\n4 of 4 never": "white", "456": "black", "not run": "black"}


def test_a_variant_that_ties_the_reference_cell_says_in_how_many_seeds_and_whether_the_runs_differ():
    """A threshold read at evaluations can give two close rules the same value in every seed (landing against
    the polar retraction on mqar); the summary says so, and tells that from the same run recorded twice."""
    from stiefel_attention.bench.report.factorial import FactorialSection, factorial_markdown, factorial_section

    recs = _records(lambda a, s: 500.0 if a in "cv" else 400.0 + s)
    for r in recs:
        a, s = r["config"]["arm"], r["config"]["seed"]
        r["curves"] = {"loss": [1.0, 0.5 + 1e-6 * (a == "v" and s != 3)]}  # seed 3: v's curve is c's
    section = FactorialSection.from_dict(
        factorial_section(recs, _Measure(), _ARMS, _G, _O, {"v": ("frames", "adam")}).to_dict()
    )
    assert section.ties == {"v": {"tied": 4, "n": 4, "same_runs": 1}}
    assert section.variants_vs["v"]["mean_diff"] == 0.0
    text = "\n".join(factorial_markdown(section))
    said = "v has the frames x adam cell's loss in 4 of 4 seeds; in 1 of them its recorded curves are the cell's"
    assert said in text
    for r in recs:
        r["curves"]["loss"][1] += 1e-6 * (r["config"]["arm"] == "v")
    text = "\n".join(factorial_markdown(factorial_section(recs, _Measure(), _ARMS, _G, _O, {"v": ("frames", "adam")})))
    assert "4 of 4 seeds; its runs are not the cell's: their recorded curves differ in each of those seeds." in text
    apart = factorial_section(
        _records(lambda a, s: float(s) + (a == "v")), _Measure(), _ARMS, _G, _O, {"v": ("frames", "adam")}
    )
    assert apart.ties == {} and "frames x adam cell's" not in "\n".join(factorial_markdown(apart))
