"""When does the geometry dominate? The controls and weight-decay experiments of every testbed.

Each family measures its runs with one number per run (CIFAR: test accuracy in percent; grokking:
epochs to 95% validation accuracy, censored at the budget) and hands the records here:

- `controls_summary`: per arm, the paired comparisons that separate the explanations: the
  testbed's sensitivity (adamw, trained Q/K, against frozen random orthonormal Q/K: a testbed where
  they tie cannot rank Q/K optimizers), stiefel-adam against every other arm, every control against
  adamw; and the mechanism metrics averaged over seeds.
- `decay_summary`: the stiefel-adam lead over adamw at each weight decay.
- `geometry_section`: the REPORT.md section, one row per testbed, with a verdict sentence computed
  from those numbers, and a plot of the lead against weight decay.

A difference is called significant here where its 95% CI excludes 0 (paired t); whether the
Wilcoxon test agrees is printed beside it (with 5 pairs it cannot go below 0.0625).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from ..arms import BOUNDED_ARMS, arm_spec
from .fmt import fmt_ci, fmt_num, fmt_p, fmt_seeds, open_arms, provisional, save_figure, undefined, unit_digits
from .stats import describe, paired_comparison
from .summaries import BoundedAnswer, MechanismFound, PlanProgress

__all__ = [
    "Measure",
    "all_censored",
    "time_to",
    "controls_summary",
    "decay_summary",
    "mechanism_curves",
    "sensitivity",
    "geometry_section",
    "verdicts_by_testbed",
    "bounded_standings",
    "mechanism_found",
    "mechanism_section",
    "GEOMETRY_ARMS",
]

SENSITIVITY = ("adamw", "frozen")  # trained against frozen Q/K
# Arms compared with stiefel-adam in every testbed, in the order the report lists them.
GEOMETRY_ARMS = (
    "adamw",
    "frozen",
    "adamw-qk-nodecay",
    "orthogonal-param",
    "qk-norm",
    "muon",
    "stiefel-adam-temp",
    *BOUNDED_ARMS,
)
PLOTTED_METRICS = ("entropy_frac", "stable_rank", "max_logit", "spectral_norm")
PRECONDITION_WORDS = {True: "met", False: "not met", None: "not yet checked"}  # an experiment's precondition


class Measure:
    """How a family scores a run: name, unit, value(record) and whether higher is better.

    A time to a threshold also says, by censored(record), whether the run never got there (its value is then
    the budget + 1, a bound), and names the fallback measure that still tells such runs apart.
    """

    def __init__(
        self,
        name: str,
        unit: str,
        value: Callable[[dict], float],
        higher_is_better: bool,
        censored: Callable[[dict], bool] | None = None,
        fallback: Measure | None = None,
    ):
        self.name, self.unit, self.value, self.higher_is_better = name, unit, value, higher_is_better
        self.censored, self.fallback = censored, fallback

    def describe(self) -> dict:
        return {"name": self.name, "unit": self.unit, "higher_is_better": self.higher_is_better}


def time_to(name: str, unit: str, first: str, budget: str, fallback: Measure) -> Measure:
    """A time to a threshold (lower is better): metrics[first], or, for a run that never got there (None),
    config[budget] + 1, a lower bound on its time. Such a run is censored; fallback still tells them apart."""

    def value(rec: dict) -> float:
        reached = rec["metrics"][first]
        return float(reached if reached is not None else rec["config"][budget] + 1)

    return Measure(name, unit, value, False, censored=lambda rec: rec["metrics"][first] is None, fallback=fallback)


def all_censored(records: list[dict], measure: Measure) -> bool:
    """Whether there are records and every one is censored on measure (never so for a measure without a budget)."""
    return measure.censored is not None and bool(records) and all(measure.censored(r) for r in records)


def _table(records: list[dict], measure: Measure, label=lambda c: c["arm"]) -> dict[str, dict[int, float]]:
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for rec in records:
        table[label(rec["config"])][rec["config"]["seed"]] = measure.value(rec)
    return table


def compare(table: dict[str, dict[int, float]], arm: str, baseline: str) -> dict | None:
    """Paired statistics of arm - baseline over the seeds both have, with the per-seed differences."""
    if arm not in table or baseline not in table:
        return None
    seeds = sorted(set(table[arm]) & set(table[baseline]))
    if not seeds:
        return None
    st = paired_comparison([table[arm][s] for s in seeds], [table[baseline][s] for s in seeds])
    st["seeds"] = seeds
    st["diffs"] = [table[arm][s] - table[baseline][s] for s in seeds]
    st["arm"], st["baseline"] = arm, baseline
    return st


def sensitivity(records: list[dict], measure: Measure) -> dict | None:
    """Trained (adamw) - frozen Q/K on `measure`, paired by seed; None where either arm has no record."""
    return compare(_table(records, measure), *SENSITIVITY)


def mechanism_curves(records: list[dict], label=lambda c: c["arm"]) -> dict[str, dict]:
    """Per arm: each mechanism metric over training, mean over seeds of the mean over layers (of the mean
    over heads), at the evaluation points all of its records share. Records without metrics are left out."""
    by_arm: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if rec["curves"].get("mechanism"):
            by_arm[label(rec["config"])].append(rec)
    out = {}
    for arm, recs in sorted(by_arm.items()):
        x_name = "epoch" if "epoch" in recs[0]["curves"] else "step"  # the families' evaluation clocks
        n = min(len(r["curves"][x_name]) for r in recs)
        curves: dict = {"x_name": x_name, "x": recs[0]["curves"][x_name][:n], "n_seeds": len(recs)}
        for name in PLOTTED_METRICS:
            per_seed = [
                [_mean_finite([layer[0] for layer in point]) for point in r["curves"]["mechanism"][name][:n]]
                for r in recs
            ]
            curves[name] = [_mean_finite([s[i] for s in per_seed]) for i in range(n)]
        out[arm] = curves
    return out


def _mean_finite(xs: list) -> float | None:
    """The mean of the finite values among xs (None where there is none)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def peak(rec: dict, name: str) -> float | None:
    """The largest value over training of a mechanism metric's largest head (max over layers), or None."""
    points = rec["curves"].get("mechanism", {}).get(name) or []
    vals = [layer[2] for point in points for layer in point if layer[2] is not None]
    return max(vals) if vals else None


def controls_summary(records: list[dict], measure: Measure) -> dict:
    """Arms, the sensitivity comparison, stiefel-adam against every arm, every control against adamw."""
    table = _table(records, measure)
    comps = []
    sens = compare(table, *SENSITIVITY)
    if sens is not None:
        comps.append({**sens, "role": "sensitivity"})
    for arm in sorted(table, key=_arm_order):
        if arm != "stiefel-adam":
            st = compare(table, "stiefel-adam", arm)
            if st is not None:
                comps.append({**st, "role": "stiefel-adam vs arm"})
    for arm in sorted(table, key=_arm_order):
        if arm not in ("adamw", "stiefel-adam", "frozen"):
            st = compare(table, arm, "adamw")
            if st is not None:
                comps.append({**st, "role": "control vs adamw"})
    return {
        "measure": measure.describe(),
        "arms": {a: describe(list(v.values())) for a, v in table.items()},
        "comparisons": comps,
        "mechanism": mechanism_curves(records),
    }


def lead_summary(records: list[dict], measure: Measure, key: str = "weight_decay") -> dict:
    """Per value of config[key] (weight decay, training steps, ...): both arms and the paired
    stiefel-adam - adamw lead.

    A value at which every run of both arms is censored has no lead on the measure (both sit at the budget):
    its lead is flagged all_censored and carries the paired comparison on the measure's fallback instead."""
    leads = []
    arms = {}
    for x in sorted({r["config"][key] for r in records}):
        at = [r for r in records if r["config"][key] == x]
        table = _table(at, measure)
        arms[f"{x:g}"] = {a: describe(list(v.values())) for a, v in table.items()}
        st = compare(table, "stiefel-adam", "adamw")
        if st is None:
            continue
        lead = {**st, key: x}
        pair = [r for r in at if r["config"]["arm"] in ("stiefel-adam", "adamw") and r["config"]["seed"] in st["seeds"]]
        if all_censored(pair, measure):
            lead["all_censored"] = True
            if measure.fallback is not None:
                fb = _table(pair, measure.fallback)
                lead["fallback"] = {
                    **compare(fb, "stiefel-adam", "adamw"),
                    "arms": {a: describe(list(v.values())) for a, v in fb.items()},
                }
        leads.append(lead)
    out = {"measure": measure.describe(), "key": key, "arms_by_value": arms, "leads": leads}
    if any("fallback" in lead for lead in leads):
        out["fallback_measure"] = measure.fallback.describe()
    return out


def decay_summary(records: list[dict], measure: Measure) -> dict:
    """lead_summary over weight decay."""
    return lead_summary(records, measure, "weight_decay")


def sweep_summary(records: list[dict], measure: Measure, swept=lambda arm: "lr") -> dict:
    """Mean of the measure per (arm, swept rate); the best per arm is the profile's choice. A choice at the
    edge of its grid is flagged: the protocol is to extend such a grid."""
    values: dict[tuple[str, float], list[float]] = defaultdict(list)
    for rec in records:
        c = rec["config"]
        values[(c["arm"], c[swept(c["arm"])])].append(measure.value(rec))
    grid = [{"arm": a, "lr": lr, "which_lr": swept(a), **describe(v)} for (a, lr), v in sorted(values.items())]
    best: dict[str, dict] = {}
    sign = 1 if measure.higher_is_better else -1
    for row in grid:
        if row["arm"] not in best or sign * row["mean"] > sign * best[row["arm"]]["mean"]:
            best[row["arm"]] = row
    chosen = {a: {"which_lr": r["which_lr"], "lr": r["lr"], "mean": r["mean"]} for a, r in best.items()}
    for arm, choice in chosen.items():
        rates = [row["lr"] for row in grid if row["arm"] == arm]
        if len(rates) > 2 and choice["lr"] in (min(rates), max(rates)):
            choice["on_grid_edge"] = True
    return {"measure": measure.describe(), "grid": grid, "chosen": chosen}


def sweep_markdown(summary: dict, digits: int = 3) -> list[str]:
    m = summary["measure"]
    lines = [
        f"Sweep measure: {m['name']} ({m['unit']}; {'higher' if m['higher_is_better'] else 'lower'} is better).",
        "",
        "| arm | rate | mean | n |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['arm']} | {r['which_lr']}={r['lr']:g} | {r['mean']:.{digits}f} | {r['n']} |" for r in summary["grid"]
    ]
    lines += ["", "Chosen: " + ", ".join(f"{a}: {r['which_lr']}={r['lr']:g}" for a, r in summary["chosen"].items()), ""]
    edge = [a for a, r in summary["chosen"].items() if r.get("on_grid_edge")]
    if edge:
        lines += [f"At the edge of its grid (the grid is to be extended): {', '.join(edge)}.", ""]
    return lines


def _arm_order(arm: str) -> tuple[int, str]:
    return (GEOMETRY_ARMS.index(arm) if arm in GEOMETRY_ARMS else len(GEOMETRY_ARMS), arm)


def significant(st: dict) -> bool:
    lo, hi = st["ci95"]
    return not (undefined(lo) or undefined(hi)) and (lo > 0 or hi < 0)


def fmt_diff(st: dict, unit: str, digits: int = 2) -> str:
    both = " (both tests)" if st.get("supported") else f", p_W={fmt_p(st['p_wilcoxon'])}"
    return f"{st['mean_diff']:+.{digits}f} {unit} {fmt_ci(st['ci95'], digits)}, {fmt_seeds(st['n_seeds'])}{both}"


# ---------------------------------------------------------------------------------------------
# Markdown and plots of one experiment
# ---------------------------------------------------------------------------------------------


def controls_markdown(summary: dict, digits: int = 2) -> list[str]:
    m = summary["measure"]
    better = "higher" if m["higher_is_better"] else "lower"
    lines = [
        f"Measure: {m['name']} ({m['unit']}; {better} is better). Differences are paired by seed.",
        "",
        "| arm | n seeds | mean | std |",
        "|---|---|---|---|",
    ]
    for arm in sorted(summary["arms"], key=_arm_order):
        d = summary["arms"][arm]
        lines.append(f"| {arm} | {d['n']} | {d['mean']:.{digits}f} | {fmt_num(d['std'], digits)} |")
    lines += [
        "",
        "| comparison | role | mean diff | 95% CI | p (t) | p (Wilcoxon) | wins |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in summary["comparisons"]:
        lines.append(
            f"| {c['arm']} − {c['baseline']} | {c['role']} | {c['mean_diff']:+.{digits}f} | "
            f"{fmt_ci(c['ci95'], digits)} | {fmt_p(c['p_t'])} | {fmt_p(c['p_wilcoxon'])} | "
            f"{c['wins']}/{c['n_seeds']} |"
        )
    lines.append("")
    if summary["mechanism"]:
        lines += [
            "Mechanism at the last evaluation (mean over seeds and layers of the mean over heads):",
            "",
            "| arm | attention entropy / log N | stable rank of W_Q W_K^T | largest logit | spectral norm |",
            "|---|---|---|---|---|",
        ]
        for arm in sorted(summary["mechanism"], key=_arm_order):
            c = summary["mechanism"][arm]
            lines.append(
                f"| {arm} ({fmt_seeds(c['n_seeds'])}) | "
                + " | ".join(fmt_num(c[k][-1], 3) for k in PLOTTED_METRICS)
                + " |"
            )
        lines.append("")
    missing = [a for a in sorted(summary["arms"], key=_arm_order) if a not in summary["mechanism"]]
    if missing:
        lines += [f"No mechanism metrics in the records of {', '.join(missing)}: they predate the metrics.", ""]
    return lines


def decay_markdown(summary: dict, digits: int = 2) -> list[str]:
    m, key = summary["measure"], summary["key"]
    lines = [
        f"Measure: {m['name']} ({m['unit']}). Lead: stiefel-adam − adamw, paired by seed.",
        "",
        f"| {key.replace('_', ' ')} | adamw mean | stiefel-adam mean | lead | 95% CI | p (t) | p (Wilcoxon) | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lead in summary["leads"]:
        arms = summary["arms_by_value"][f"{lead[key]:g}"]
        stats = (
            "every run censored | n/a | n/a | n/a"
            if lead.get("all_censored")
            else f"{lead['mean_diff']:+.{digits}f} | {fmt_ci(lead['ci95'], digits)} | {fmt_p(lead['p_t'])} | "
            f"{fmt_p(lead['p_wilcoxon'])}"
        )
        lines.append(
            f"| {lead[key]:g} | {arms['adamw']['mean']:.{digits}f} | "
            f"{arms['stiefel-adam']['mean']:.{digits}f} | {stats} | {lead['n_seeds']} |"
        )
    trend = lead_trend(summary, digits)
    return lines + ["", *([trend, ""] if trend else [])]


def mechanism_plot(summary: dict, out_dir: Path, made: list[str], log_x: bool = False) -> None:
    """Attention entropy and stable rank of W_Q W_K^T over training, a line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mech = summary.get("mechanism") or {}
    if not mech:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for arm in sorted(mech, key=_arm_order):
        c = mech[arm]
        for ax, key in zip(axes, ("entropy_frac", "stable_rank")):
            pts = [(e, v) for e, v in zip(c["x"], c[key]) if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=f"{arm} ({c['n_seeds']})")
    axes[0].set_ylabel("attention entropy / log N")
    axes[1].set_ylabel("stable rank of W_Q W_K^T")
    for ax in axes:
        ax.set_xlabel(next(iter(mech.values()))["x_name"])
        if log_x:
            ax.set_xscale("log")
    axes[1].legend(fontsize=7)
    save_figure(fig, out_dir, "mechanism.png", made, dpi=110)


def lead_plot(summary: dict, out_dir: Path, made: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summary["leads"]:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    _draw_leads(ax, summary)
    save_figure(fig, out_dir, f"lead_vs_{summary['key']}.png", made)


def _draw_leads(ax, summary: dict, title: str | None = None) -> None:
    every = [lead[summary["key"]] for lead in summary["leads"]]
    leads = [lead for lead in summary["leads"] if not lead.get("all_censored")]
    censored = [x for x in every if x not in {lead[summary["key"]] for lead in leads}]
    xs = [lead[summary["key"]] for lead in leads]
    means = [lead["mean_diff"] for lead in leads]
    # one seed leaves the interval undefined (NaN, or null once through strict JSON): no bar then
    errs = [
        [0.0 if undefined(lead["ci95"][0]) else m - lead["ci95"][0] for m, lead in zip(means, leads)],
        [0.0 if undefined(lead["ci95"][1]) else lead["ci95"][1] - m for m, lead in zip(means, leads)],
    ]
    if leads:
        ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3)
    if censored:  # no lead there: both arms sit at the budget
        ax.plot(censored, [0.0] * len(censored), "x", color="grey", label="every run censored: no lead")
        ax.legend(fontsize=7)
    if min(every) > 0 and max(every) >= 4 * min(every):  # e.g. doubling training steps: equal spacing per doubling
        ax.set_xscale("log", base=2)
        ax.set_xticks(every, [f"{x:g}" for x in every])
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel(summary["key"].replace("_", " "))
    m = summary["measure"]
    side = "above" if m["higher_is_better"] else "below"  # panels of both kinds sit side by side in REPORT
    what = textwrap.fill(f"({m['name']}, {m['unit']})", 36)
    ax.set_ylabel(f"stiefel-adam − adamw\n{what}\n{side} 0: stiefel-adam better", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)


# ---------------------------------------------------------------------------------------------
# REPORT.md: one row per testbed
# ---------------------------------------------------------------------------------------------


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def geometry_section(
    results_dir: Path, testbeds: list[tuple[str, str, str | None, str | None]], beside: Sequence[Path] = ()
) -> list[str]:
    """REPORT.md lines of "When does the geometry dominate?" from each testbed's controls and decay summaries.

    testbeds: (family folder, testbed title, its controls experiment, its decay experiment or None), in order.
    beside: other results folders (other profiles): a testbed's row there follows this folder's row of it (testbeds
    this folder has not run are left out), each labelled with its profile, and a list per testbed compares every
    standing of this folder's controls with theirs.
    """
    roots = [results_dir, *beside]
    found = {root: _testbeds(root, testbeds, results_dir, label=bool(beside)) for root in roots}
    rows = [found[root][t][1] for t in found[results_dir] for root in roots if t in found[root]]  # own testbeds
    panels = [(title, decay) for title, _, decay, _ in found[results_dir].values() if decay and decay.get("leads")]
    if not rows:
        return []
    lines = [
        "## When does the geometry dominate?",
        "",
        "One row per testbed, from its controls experiment (every arm, paired seeds) and its weight-decay "
        "experiment. Sensitivity: trained (adamw) − frozen random orthonormal W_Q, W_K; a testbed whose CI "
        "includes 0 cannot rank Q/K optimizers. A difference counts as significant where its 95% CI excludes 0.",
        "",
        "| testbed | measure | sensitivity (adamw − frozen) | stiefel-adam − each arm | lead vs weight decay | "
        "verdict |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for family, title, *_ in testbeds:
        for root in beside:
            pair = [found[r][family][3] if family in found[r] else None for r in (results_dir, root)]
            if all(s and s.get("controls") for s in pair):
                lines += ["", *across_profiles(title, *pair)]
                if name := across_profiles_plot(results_dir, f"{family}_across_profiles.png", title, *pair):
                    lines += ["", f"![each comparison at both profiles]({name})"]
    if panels:
        _geometry_plot(results_dir, panels)
        lines += ["", "![lead against weight decay](geometry_decay.png)"]
    return lines + [""]


# A comparison's standing: the arm ahead of, level with, or behind its baseline (95% CI).
STANDING_WORDS = {1: "ahead of", 0: "level with", -1: "behind"}


def standing(c: dict | None, higher_is_better: bool) -> int | None:
    """+1, 0, -1 where a comparison (arm − baseline) has the arm significantly ahead, level, behind (95% CI) on a
    measure where higher (or lower) is better; None where it is missing or has fewer than 2 seeds."""
    if c is None or c["n_seeds"] < 2:
        return None
    return (1 if (c["mean_diff"] > 0) == higher_is_better else -1) if significant(c) else 0


def across_profiles(title: str, mine: dict, theirs: dict) -> list[str]:
    """Markdown lines: each comparison of one testbed's controls (sensitivity, stiefel-adam against each arm) at
    this folder's profile beside another's, with whether the standings agree. mine, theirs: controls summary.json
    files. A standing is final once both of its arms have every planned run; before that it holds 'so far'."""
    me, other = mine.get("profile", "this folder's"), theirs.get("profile", "the other folder's")
    m = mine["controls"]["measure"]
    if (paired := _rankings(mine, theirs)) is None:
        return [
            f"Across profiles, {title}: profile {other} measures {theirs['controls']['measure']['name']}, "
            f"profile {me} {m['name']}; not compared."
        ]
    unit, digits = m["unit"], DIGITS.get(m["unit"], 2)
    ours, then = paired
    lines = [
        f"Across profiles, {title}: each comparison at profile {me} beside profile {other} (ahead, level or behind "
        "by the 95% CI; untested with fewer than 2 seeds):",
        "",
    ]
    for (arm, baseline), c in ours.items():
        if (o := then.get((arm, baseline))) is None:
            continue
        here, there = standing(c, m["higher_is_better"]), standing(o, m["higher_is_better"])
        final = not any(open_arms(s, (arm, baseline)) for s in (mine, theirs))
        if here is None or there is None:
            agree = "not yet comparable"
        else:
            agree = ("the same" if here == there else "different") + ("" if final else " so far")
        said = [f"{_standing_words(cmp, at)} ({fmt_diff(cmp, unit, digits)})" for cmp, at in ((c, here), (o, there))]
        lines.append(f"- {arm} − {baseline}: {agree}. Profile {me}: {said[0]}; profile {other}: {said[1]}.")
    for who, one, two in ((other, ours, then), (me, then, ours)):
        if missing := [f"{arm} − {baseline}" for arm, baseline in one if (arm, baseline) not in two]:
            lines.append(f"- Not run at profile {who}: {', '.join(missing)}.")
    return lines


def across_profiles_plot(out_dir: Path, name: str, title: str, mine: dict, theirs: dict) -> str | None:
    """The comparisons across_profiles lists, drawn: per comparison run at both profiles, each profile's mean
    difference with its 95% CI (a hollow marker without a bar: one seed). Returns the file's name, None if none."""
    m = mine["controls"]["measure"]
    ours, then = _rankings(mine, theirs) or ({}, {})
    if not (both := [pair for pair in ours if pair in then]):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 1.4 + 0.55 * len(both)))
    for shift, summary, table, color in ((-0.12, mine, ours, "C0"), (0.12, theirs, then, "C1")):
        for row, pair in enumerate(both):
            c = table[pair]
            tested = c["n_seeds"] >= 2 and not any(undefined(x) for x in c["ci95"])
            err = [[c["mean_diff"] - c["ci95"][0]], [c["ci95"][1] - c["mean_diff"]]] if tested else None
            label = None if row else f"profile {summary.get('profile', '?')}"
            face = color if tested else "none"
            ax.errorbar(
                c["mean_diff"], row + shift, xerr=err, marker="o", capsize=3, color=color, mfc=face, label=label
            )
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(both)), [f"{arm} − {baseline}" for arm, baseline in both], fontsize=8)
    ax.invert_yaxis()
    better = "right" if m["higher_is_better"] else "left"
    ax.set_xlabel(
        textwrap.fill(f"{m['name']} ({m['unit']})", 80) + f"\n{better} of 0: the first arm better", fontsize=8
    )
    ax.set_title(textwrap.fill(f"{title}: mean paired difference, 95% CI (hollow: one seed)", 90), fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, out_dir, name, [])
    return name


def _rankings(mine: dict, theirs: dict) -> tuple[dict, dict] | None:
    """Both controls summaries' ranking comparisons by (arm, baseline); None where they measure different things."""
    if theirs["controls"]["measure"]["name"] != mine["controls"]["measure"]["name"]:
        return None
    return tuple({(c["arm"], c["baseline"]): c for c in _ranking(s)} for s in (mine, theirs))


def _ranking(summary: dict) -> list[dict]:
    """The comparisons of a controls summary.json that rank the arms: the sensitivity, stiefel-adam against each."""
    return [c for c in summary["controls"]["comparisons"] if c["role"] in ("sensitivity", "stiefel-adam vs arm")]


def _standing_words(c: dict, at: int | None) -> str:
    return "untested" if at is None else f"{c['arm']} {STANDING_WORDS[at]} {c['baseline']}"


def mechanism_found(results_dir: Path, families: Sequence) -> list[MechanismFound]:
    """Each family's answer from its mechanism experiment's summary under results_dir (its hook reads the summary
    its own report wrote), placed: where the summary is and how many of its planned runs finished."""
    found = []
    for family in families:
        experiment = family.mechanism_experiment
        summary = _load(results_dir / family.name / str(experiment) / "summary.json") if experiment else None
        answer = family.mechanism_answer(experiment, summary) if summary else None
        if answer is not None:
            runs = PlanProgress.of(summary).runs()
            found.append(MechanismFound(f"{family.name}/{experiment}", runs, family.title, answer))
    return found


def mechanism_section(
    results_dir: Path, found: Sequence[MechanismFound], controls: list[tuple[str, str, str | None]] = ()
) -> list[str]:
    """REPORT.md lines of "The mechanism, by intervention": first one paragraph with each testbed's computed
    answers (is the logit scale the mechanism; do the frames buy high-learning-rate stability), then per testbed
    its section: the link to its summary, its lead and verdicts, the bounded arms' answers and the figure.
    found: mechanism_found's records; controls: (family folder, title, its controls experiment or None), whose
    comparisons say where the bounded frames stand at their tuned rates."""
    lines, answers = [], []
    for placed in found:
        a = placed.answer
        answers += [f"{q.question} {q.verdict}" for q in a.answers]
        lines += [
            f"### {a.heading}: {placed.title}",
            "",
            f"[{placed.where}]({placed.where}/summary.md) ({placed.runs}). {a.lead}",
            "",
            *([f"- {v}" for v in a.bullets] + [""] if a.bullets else []),
        ]
        if a.bounded is not None:
            lines += _bounded_lines(a.bounded, bounded_standings(results_dir, controls))
        if a.figure is not None:
            lines += [f"![{a.figure[0]}]({placed.where}/{a.figure[1]})", ""]
    if not answers:
        return lines
    return ["The mechanism in one paragraph, from the computed verdicts below: " + "; ".join(answers) + ".", "", *lines]


BOUNDED_FRAMES = "stiefel-adam-bounded"


def standings(results_dir: Path, controls: list[tuple[str, str, str | None]], arm: str, baseline: str) -> list[str]:
    """Where arm stands against baseline in each testbed whose controls summary compares them (either way round,
    stated as arm - baseline): "title: standing words baseline (paired difference)", testbed by testbed."""
    said = []
    for family, title, experiment in controls:
        summary = (_load(results_dir / family / str(experiment) / "summary.json") or {}).get("controls")
        if not summary:
            continue
        m = summary["measure"]
        for c in summary["comparisons"]:
            if (c["arm"], c["baseline"]) not in ((arm, baseline), (baseline, arm)) or c["n_seeds"] < 2:
                continue
            if c["arm"] == baseline:  # stated as arm - baseline
                c = {**c, "mean_diff": 0.0 - c["mean_diff"], "ci95": [0.0 - c["ci95"][1], 0.0 - c["ci95"][0]]}
            at = standing(c, m["higher_is_better"])
            said.append(f"{title}: {STANDING_WORDS[at]} {baseline} ({fmt_diff(c, m['unit'], unit_digits(m['unit']))})")
    return said


def standings_sentence(results_dir: Path, controls: list[tuple[str, str, str | None]], arm: str, baseline: str):
    """One sentence of `standings` (None where no testbed compares them)."""
    said = standings(results_dir, controls, arm, baseline)
    if not said:
        return None
    return (
        f"{arm} against {baseline}, each testbed at its own rates (tuned where it has a sweep), paired by "
        f"seed: {'; '.join(said)}"
    )


def bounded_standings(results_dir: Path, controls: list[tuple[str, str, str | None]]) -> list[str]:
    """Where the bounded frames stand, one sentence against adamw and one against the plain frames, each listing
    every testbed whose controls summary has them (standing words and the paired difference). Each testbed runs
    each arm at its own rate for it: the one its sweep chose, or its protocol's where it has no sweep."""
    found = [standings_sentence(results_dir, controls, BOUNDED_FRAMES, other) for other in ("adamw", "stiefel-adam")]
    return [sentence for sentence in found if sentence]


def _bounded_lines(bounded: BoundedAnswer, standings: Sequence[str] = ()) -> list[str]:
    """REPORT's answers for the bounded-logit arms: three computed verdicts, the largest logit of each against its
    bound by construction, and where the bounded frames stand in each testbed's controls (`bounded_standings`)."""
    at_rate = [f"- {sentence}." for sentence in standings]
    largest = "; ".join(
        f"{label} {bounded.largest[label]:.1f} ({'no bound' if bound is None else f'bound {bound:.1f}'})"
        for label, bound in sorted(bounded.bounds.items())
    )
    return [
        "Frames whose logit is bounded by construction (`qk_input_norm`: the query and key projections read their "
        "input through an RMS norm without a gain, so |logit| <= max_temperature x d_model / sqrt(head_dim)):",
        "",
        f"- Does the bound buy qk-norm's stability? **{bounded.buys_qk_norm_stability}**.",
        f"- Does it make the frames more stable? **{bounded.steadies_the_frames}**.",
        f"- Does it need the frames? **{bounded.needs_the_frames}**.",
        f"- The largest attention logit over every multiplier, against the bound: {largest or 'not measured'}.",
        *at_rate,
        "",
    ]


def verdicts_by_testbed(results_dir: Path, testbeds: list[tuple[str, str, str | None, str | None]]) -> list[tuple]:
    """(testbed title, verdict sentence) per testbed with results, as in geometry_section."""
    return [(title, row[-1]) for title, row, *_ in _testbeds(results_dir, testbeds).values()]


def _testbeds(
    root: Path, testbeds: list[tuple[str, str, str | None, str | None]], report_dir: Path | None = None, label=False
) -> dict[str, tuple]:
    """{family: (title, table row, decay summary or None, controls summary.json or None)} per testbed of the results
    folder root with a controls or decay summary; links relative to report_dir (default root); label: the row's
    testbed names its profile."""
    found = {}
    prefix = Path(os.path.relpath(root, report_dir)) if report_dir is not None else Path(".")
    for family, title, controls_exp, decay_exp in testbeds:
        whole = _load(root / family / str(controls_exp) / "summary.json") or {}
        controls = whole.get("controls")
        decay_whole = _load(root / family / str(decay_exp) / "summary.json") or {}
        decay = decay_whole.get("decay")
        if controls is not None or decay is not None:
            profile = whole.get("profile") or decay_whole.get("profile")
            named = f"{title}, profile {profile}" if label and profile else title
            where = (prefix / family / str(controls_exp)).as_posix()
            begun = PlanProgress.of(whole).begun() if whole else []
            row = _testbed_row(where, named, controls, decay, begun)
            found[family] = (title, row, decay, whole or None)
    return found


DIGITS = {"epochs": 0, "steps": 0, "nats/char": 3}  # decimals per unit; 2 otherwise


def _testbed_row(
    where: str, title: str, controls: dict | None, decay: dict | None, begun: list[str] = ()
) -> tuple[str, ...]:
    """One row of the table; its verdict holds 'so far' while an arm the controls have begun lacks planned runs
    (begun: 'arm done/total' of each, PlanProgress.begun)."""
    summary = controls or decay
    m = summary["measure"]
    unit = m["unit"]
    digits = DIGITS.get(unit, 2)
    link = f"[{title}]({where}/summary.md)" if controls else title
    sens = next((c for c in (controls or {}).get("comparisons", []) if c["role"] == "sensitivity"), None)
    vs = [c for c in (controls or {}).get("comparisons", []) if c["role"] == "stiefel-adam vs arm"]
    sens_txt = fmt_diff(sens, unit, digits) if sens else "not run"
    vs_txt = "; ".join(f"{c['baseline']}: {fmt_diff(c, unit, digits)}" for c in vs) or "not run"
    leads = (decay or {}).get("leads", [])
    lead_txt = "; ".join(f"wd {lead['weight_decay']:g}: {_lead_cell(lead, decay, digits)}" for lead in leads)
    mech = (controls or {}).get("mechanism", {})
    verdict = _verdict(sens, vs, leads, m, digits, mech, (decay or {}).get("fallback_measure"))
    verdict = provisional(verdict, begun, decided=True)
    return (link, f"{m['name']} ({unit})", sens_txt, vs_txt, lead_txt or "not run", verdict)


def _lead_cell(lead: dict, decay: dict, digits: int) -> str:
    """One lead of a decay summary: mean and CI, or, where every run is censored, its fallback comparison."""
    if not lead.get("all_censored"):
        return f"{lead['mean_diff']:+.{digits}f} {fmt_ci(lead['ci95'], digits)}"
    if "fallback" not in lead:
        return "every run censored"
    fb = decay["fallback_measure"]
    fb_digits = DIGITS.get(fb["unit"], 2)
    return (
        f"every run censored; {fb['name']} {lead['fallback']['mean_diff']:+.{fb_digits}f} {fb['unit']} "
        f"{fmt_ci(lead['fallback']['ci95'], fb_digits)}"
    )


def _sign(m: dict) -> int:
    """+1 where a higher value of measure m (a Measure.describe()) is better, -1 where a lower one is."""
    return 1 if m["higher_is_better"] else -1


def _favours_arm(m: dict) -> Callable[[dict], bool]:
    """Whether a comparison (arm − baseline on measure m) has its mean on the arm's side."""
    sign = _sign(m)
    return lambda c: sign * c["mean_diff"] > 0


def _verdict(
    sens: dict | None, vs: list[dict], leads: list[dict], m: dict, digits: int, mech: dict, fallback: dict | None = None
) -> str:
    """A sentence computed from the numbers: can the testbed rank Q/K optimizers, whom does the Stiefel
    arm beat, tie or trail, what the controls and the mechanism metrics say about why, and how the lead
    moves with decay."""
    unit = m["unit"]
    better = _favours_arm(m)
    if sens is None:
        parts = ["sensitivity not measured yet"]
    elif sens["n_seeds"] < 2:
        parts = ["too few seeds yet to tell whether learning Q/K matters"]
    else:
        gap = f"trained − frozen {sens['mean_diff']:+.{digits}f} {unit} {fmt_ci(sens['ci95'], digits)}"
        if not significant(sens):
            parts = [f"cannot rank Q/K optimizers: frozen Q/K score like trained ones ({gap})"]
        elif better(sens):
            parts = [f"learning Q/K matters here: adamw's trained W_Q, W_K beat frozen random frames ({gap})"]
        else:
            parts = [
                f"W_Q, W_K matter here, but training them with adamw hurts: frozen random frames do better ({gap})"
            ]
    testable = [c for c in vs if c["n_seeds"] >= 2]
    standings = [(c["baseline"], standing(c, m["higher_is_better"])) for c in vs]
    ahead, tied, behind, few = ([b for b, at in standings if at == which] for which in (1, 0, -1, None))
    for names, words in (
        (ahead, "stiefel-adam is ahead of"),
        (tied, "no significant difference from"),
        (behind, "stiefel-adam trails"),
        (few, "too few seeds yet for"),
    ):
        if names:
            parts.append(f"{words} {', '.join(names)}")
    by = {c["baseline"]: c for c in testable}
    lead = "adamw" in by and by["adamw"]["baseline"] in ahead  # the gain the controls are there to explain
    if not lead and ("adamw-qk-nodecay" in by or "orthogonal-param" in by):
        parts.append("mechanism: no lead over adamw to explain")
    elif "adamw-qk-nodecay" in by and "orthogonal-param" in by:
        nodecay, param = by["adamw-qk-nodecay"], by["orthogonal-param"]
        if significant(nodecay) and better(nodecay) and not significant(param):
            parts.append(
                "mechanism: exempting W_Q, W_K from decay does not reproduce the gain, the constraint "
                "by parametrization does, so the constraint suffices for it without the Riemannian Adam, "
                "and the decay exemption does not"
            )
        elif not significant(nodecay):
            parts.append(
                "mechanism: exempting W_Q, W_K from decay matches the Stiefel arm, so the decay "
                "exemption suffices to explain it"
            )
    if lead:
        free = [a for a in tied if not arm_spec(a).orthonormal_qk]
        if "frozen" in tied:
            parts.append(
                "frozen random frames do as well as the Stiefel arm, so how W_Q, W_K are learned does not carry "
                "its lead" + ("" if free else "; that they stay orthonormal does")
            )
        if free:
            parts.append(
                f"{', '.join(free)}, whose W_Q, W_K are not held orthonormal, "
                f"{'does' if len(free) == 1 else 'do'} as well too, so orthonormality is not necessary for it"
            )
        parts += _logit_separation(["stiefel-adam", *tied], ahead, mech)
    if len(leads) >= 2:
        steps = ", ".join(
            f"{c['from']:g} → {c['to']:g} {_change_words(c)}"
            for c in lead_changes({"measure": m, "key": "weight_decay", "leads": leads})
        )
        parts.append(f"stiefel-adam's standing against adamw as weight decay grows (paired by seed): {steps}")
    fallbacks = {lead["weight_decay"]: lead["fallback"] for lead in leads if "fallback" in lead}
    where = _standings_by_value(fallbacks, fallback or {})
    if where:
        parts.append(
            f"where every run is censored, on {fallback['name']} stiefel-adam is "
            + "; ".join(f"{s} adamw at weight decay {', '.join(v)}" for s, v in where.items())
        )
    return "; ".join(parts)


_CHANGE_WORDS = {1: "improves", -1: "worsens", 0: "no significant change"}


def _change_words(change: dict) -> str:
    if "censored_at" in change:
        return f"not measured (every run at {', '.join(f'{x:g}' for x in change['censored_at'])} censored)"
    return _CHANGE_WORDS[change_direction(change)]


def _standings_by_value(leads: dict, m: dict) -> dict[str, list[str]]:
    """{'ahead of' | 'level with' | 'behind' | 'one seed only against': [values]} from {value: stiefel-adam -
    adamw comparison}, in the order of the values."""
    where: dict[str, list[str]] = {}
    for x, lead in sorted(leads.items()):
        if lead["n_seeds"] < 2:
            status = "one seed only against"
        else:
            status = "level with" if not significant(lead) else "ahead of" if _favours_arm(m)(lead) else "behind"
        where.setdefault(status, []).append(f"{x:g}")
    return where


def lead_changes(summary: dict) -> list[dict]:
    """Between consecutive values of summary['key'] (a lead_summary): the paired change in stiefel-adam's
    standing against adamw, i.e. in the lead signed so that positive is better, over the seeds both values
    have ('from' and 'to' name the values). Where every run at either value is censored there is no lead to
    change: the entry lists such values as censored_at instead."""
    key = summary["key"]
    sign = _sign(summary["measure"])
    leads = sorted(summary["leads"], key=lambda lead: lead[key])
    changes = []
    for a, b in zip(leads, leads[1:]):
        if a.get("all_censored") or b.get("all_censored"):
            censored_at = [lead[key] for lead in (a, b) if lead.get("all_censored")]
            changes.append({"from": a[key], "to": b[key], "censored_at": censored_at})
            continue
        da, db = dict(zip(a["seeds"], a["diffs"])), dict(zip(b["seeds"], b["diffs"]))
        seeds = sorted(set(da) & set(db))
        st = paired_comparison([sign * db[s] for s in seeds], [sign * da[s] for s in seeds])
        changes.append({"from": a[key], "to": b[key], **st})
    return changes


def change_direction(change: dict) -> int:
    """+1 / -1 where the standing improves / worsens significantly (the 95% CI excludes 0), else 0 (also where
    it was not measured)."""
    return 0 if "ci95" not in change or not significant(change) else 1 if change["mean_diff"] > 0 else -1


def lead_trend(summary: dict, digits: int = 2) -> str:
    """Sentences computed from a lead_summary: where stiefel-adam is significantly ahead of, level with or
    behind adamw, and how its standing changes from each value of summary['key'] to the next, paired by seed.
    Values where every run is censored have no lead; where the measure has a fallback, the same is said of it."""
    m, key = summary["measure"], summary["key"]
    leads = sorted(summary["leads"], key=lambda lead: lead[key])
    if not leads:
        return ""
    name = key.replace("_", " ")
    sentences = []
    where = _standings_by_value({lead[key]: lead for lead in leads if not lead.get("all_censored")}, m)
    if where:
        sentences.append(
            "stiefel-adam is "
            + "; ".join(f"{s} adamw at {name} {', '.join(v)}" for s, v in where.items())
            + " (ahead or behind: the paired 95% CI excludes 0)."
        )
    censored = [lead for lead in leads if lead.get("all_censored")]
    if censored:
        sentences.append(
            f"At {name} {', '.join(f'{lead[key]:g}' for lead in censored)} every run of both arms is censored at "
            "the budget, so there is no lead to measure."
        )
    steps = [
        f"{name} {c['from']:g} → {c['to']:g} {_change_words(c)}" + _change_stats(c, m, digits)
        for c in lead_changes(summary)
    ]
    if steps:
        sentences.append(
            "Its standing against adamw (the lead signed so that + is better), paired by seed: "
            + "; ".join(steps)
            + "."
        )
    if "fallback_measure" in summary:
        sentences.append(_fallback_trend(summary, leads))
    return " ".join(sentences)


def _change_stats(change: dict, m: dict, digits: int) -> str:
    if "censored_at" in change:
        return ""
    ci = fmt_ci(change["ci95"], digits)
    return f" ({change['mean_diff']:+.{digits}f} {m['unit']} {ci}, {fmt_seeds(change['n_seeds'])})"


def _fallback_trend(summary: dict, leads: list[dict]) -> str:
    """The fallback measure's stiefel-adam - adamw comparison at the values where every run is censored, and
    its paired change between such values that are neighbours."""
    fb, key = summary["fallback_measure"], summary["key"]
    name = key.replace("_", " ")
    digits = DIGITS.get(fb["unit"], 2)
    fb_leads = [{**lead["fallback"], key: lead[key]} for lead in leads if "fallback" in lead]
    parts = []
    for lead in fb_leads:
        means = ", ".join(f"{a} {lead['arms'][a]['mean']:.{digits}f}" for a in ("adamw", "stiefel-adam"))
        parts.append(f"at {name} {lead[key]:g} {fmt_diff(lead, fb['unit'], digits)} ({means})")
    text = f"Where every run is censored, {fb['name']} tells the arms apart: stiefel-adam − adamw " + "; ".join(parts)
    neighbours = {(a[key], b[key]) for a, b in zip(leads, leads[1:])}
    changes = [
        f"{name} {c['from']:g} → {c['to']:g} {_change_words(c)}" + _change_stats(c, fb, digits)
        for c in lead_changes({"measure": fb, "key": key, "leads": fb_leads})
        if (c["from"], c["to"]) in neighbours
    ]
    return text + (f"; its standing on it, paired by seed: {'; '.join(changes)}." if changes else ".")


def _logit_separation(level: list[str], behind: list[str], mech: dict) -> list[str]:
    """A clause when the largest attention logit at the last evaluation (mean over seeds) separates the arms
    that do as well as the Stiefel arm from those behind it; arms whose records lack the metric are left out."""

    def final(arm):
        curve = mech.get(arm, {}).get("max_logit") or [None]
        return curve[-1]

    ok = [x for x in map(final, level) if x is not None]
    bad = [x for x in map(final, behind) if x is not None]
    if not ok or not bad or max(ok) >= min(bad):
        return []
    return [
        f"mechanism metrics: every arm that does as well keeps its largest attention logit at or below "
        f"{max(ok):.1f} at the end, every arm behind reaches {min(bad):.1f} or more"
    ]


def _geometry_plot(results_dir: Path, panels: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, decay) in zip(axes[0], panels):
        _draw_leads(ax, decay, title)
    save_figure(fig, results_dir, "geometry_decay.png", [])
