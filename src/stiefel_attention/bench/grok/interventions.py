"""The grokking `interventions` experiment's report: is the attention-logit scale the mechanism?

Each intervention run is named by its arm and intervention (`adamw+clip2`, `stiefel-adam+scale16`, ...) and
compared, paired by seed and within its operation, with both plain arms: a bound on AdamW's logits should move
it towards stiefel-adam if bounded logits are what the frames buy; a raised logit scale on the frames should
move stiefel-adam towards AdamW. The verdicts are computed from those paired comparisons alone. The figure of
the mechanism puts every run of the controls and interventions experiments (those with mechanism metrics) on
one scatter: epochs to 95% validation accuracy (censored runs marked at the budget) against the run's largest
attention logit at its last evaluation.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..report.fmt import fmt_ci, fmt_num, fmt_p, fmt_seeds, save_figure
from ..report.geometry import Measure, compare, peak, standing
from ..report.stats import describe
from ..report.summaries import Answer, MechanismAnswer
from .config import INTERVENTION_KEYS, intervention_tag

__all__ = [
    "INTERVENTION_KEYS",
    "intervention_tag",
    "interventions_summary",
    "interventions_markdown",
    "mechanism_points",
    "mechanism_scatter",
    "variant",
]

BASELINES = ("adamw", "stiefel-adam")


def variant(config: dict) -> str:
    """The run's arm and intervention, e.g. 'adamw+clip2'; the plain arm's name for a plain run."""
    return config["arm"] + intervention_tag(config)


def _mechanism_at_end(rec: dict, name: str) -> float | None:
    """The metric at the last evaluation, mean over layers of the per-layer mean over heads (None if absent)."""
    points = rec["curves"].get("mechanism", {}).get(name) or []
    if not points:
        return None
    vals = [layer[0] for layer in points[-1] if layer[0] is not None]
    return sum(vals) / len(vals) if vals else None


def _mean_present(xs) -> float | None:
    """The mean of the values among xs that are not None (None where there is none)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _standing_or_fallback(c: dict | None) -> int | None:
    """+1 if the run is significantly better than the baseline, -1 worse, 0 level; None if not compared.

    On epochs to 95% (fewer is better), unless every run of both is censored there (all equal to the budget + 1):
    then on final validation accuracy (higher is better), the measure that still tells such runs apart."""
    if c is None:
        return None
    return standing(c["final_val_acc"], True) if c["all_censored"] else standing(c, False)


def _on(c: dict | None) -> str:
    """Said right after the comparison it qualifies: the measure that comparison was made on."""
    return " on final validation accuracy (every run of both censored)" if c is not None and c["all_censored"] else ""


def _verdict_bound(vs_adamw: dict | None, vs_stiefel: dict | None) -> str:
    """Does bounding AdamW's logits reproduce the frames' grokking?"""
    a, s = _standing_or_fallback(vs_adamw), _standing_or_fallback(vs_stiefel)
    if a is None or s is None:
        return "not yet testable (fewer than 2 paired seeds)"
    n = fmt_seeds(min(vs_adamw["n_seeds"], vs_stiefel["n_seeds"]))
    on_a, on_s = _on(vs_adamw), _on(vs_stiefel)
    if a == 0:
        return f"no significant gain over adamw{on_a} ({n})"
    if a < 0:
        return f"hurts AdamW (significantly behind adamw{on_a}, {n})"
    if s == 0:
        return f"reproduces the frames' result (better than adamw{on_a}, level with stiefel-adam{on_s}, {n})"
    if s < 0:
        return f"helps AdamW, but stays behind stiefel-adam (better than adamw{on_a}, behind stiefel-adam{on_s}, {n})"
    return f"better than both adamw{on_a} and stiefel-adam{on_s} ({n})"


def _verdict_raise(vs_stiefel: dict | None, vs_adamw: dict | None) -> str:
    """Does raising (or removing) the frames' logit scale take their advantage away?"""
    s, a = _standing_or_fallback(vs_stiefel), _standing_or_fallback(vs_adamw)
    if s is None or a is None:
        return "not yet testable (fewer than 2 paired seeds)"
    n = fmt_seeds(min(vs_adamw["n_seeds"], vs_stiefel["n_seeds"]))
    on_s, on_a = _on(vs_stiefel), _on(vs_adamw)
    if s == 0:
        return f"no significant loss against stiefel-adam{on_s} ({n})"
    if s > 0:
        return f"helps the frames (significantly ahead of stiefel-adam{on_s}, {n})"
    if a == 0:
        return f"removes the frames' advantage (behind stiefel-adam{on_s}, level with adamw{on_a}, {n})"
    if a > 0:
        return f"hurts the frames (behind stiefel-adam{on_s}, still ahead of adamw{on_a}, {n})"
    return f"makes the frames worse than adamw (behind stiefel-adam{on_s}, behind adamw{on_a}, {n})"


def interventions_summary(records: list[dict], measure: Measure, fallback: Measure, seeds: int = 1) -> dict:
    """Per operation: each variant's outcomes and mechanism, its paired comparisons with both plain arms, and
    a verdict; then the verdicts of the experiment. `seeds`: the protocol's paired seeds, which every comparison
    needs before the experiment's conclusions are drawn (each variant's own verdict needs 2)."""
    by_op: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by_op[rec["config"]["op"]].append(rec)
    out: dict = {"measure": measure.describe(), "fallback": fallback.describe(), "ops": {}}
    for op in sorted(by_op):
        recs = by_op[op]
        table: dict[str, dict[int, float]] = defaultdict(dict)
        fall: dict[str, dict[int, float]] = defaultdict(dict)
        groups: dict[str, list[dict]] = defaultdict(list)
        for rec in recs:
            label, seed = variant(rec["config"]), rec["config"]["seed"]
            table[label][seed] = measure.value(rec)
            fall[label][seed] = fallback.value(rec)
            groups[label].append(rec)
        variants = {}
        for label, rs in sorted(groups.items()):
            config = rs[0]["config"]
            clip = [r["metrics"].get("qk_clip_steps") for r in rs if "qk_clip_steps" in r["metrics"]]
            variants[label] = {
                "arm": config["arm"],
                "intervention": {k: config[k] for k in INTERVENTION_KEYS if k in config},
                "epochs": describe(list(table[label].values())),
                "grokked": sum(not measure.censored(r) for r in rs),
                "n": len(rs),
                "final_val_acc": describe(list(fall[label].values())),
                "max_logit_end": _mean_present(_mechanism_at_end(r, "max_logit") for r in rs),
                "max_logit_peak": _mean_present(peak(r, "max_logit") for r in rs),
                "stable_rank_end": _mean_present(_mechanism_at_end(r, "stable_rank") for r in rs),
                "entropy_frac_end": _mean_present(_mechanism_at_end(r, "entropy_frac") for r in rs),
                "qk_clip_steps": _mean_present(clip) if clip else None,
            }
        comparisons = []
        for label in variants:
            if label in BASELINES:
                continue
            for base in BASELINES:
                st = compare(table, label, base)
                if st is None:
                    continue
                censored = all(
                    measure.censored(r) for r in groups[label] + groups[base] if r["config"]["seed"] in st["seeds"]
                )
                comparisons.append({**st, "final_val_acc": compare(fall, label, base), "all_censored": censored})
            pair = {c["baseline"]: c for c in comparisons if c["arm"] == label}
            arm = variants[label]["arm"]
            if arm == "adamw":
                variants[label]["verdict"] = _verdict_bound(pair.get("adamw"), pair.get("stiefel-adam"))
            else:
                variants[label]["verdict"] = _verdict_raise(pair.get("stiefel-adam"), pair.get("adamw"))
        out["ops"][op] = {"variants": variants, "comparisons": comparisons}
    fewest = min((c["n_seeds"] for op in out["ops"].values() for c in op["comparisons"]), default=0)
    out["protocol_seeds"], out["fewest_paired_seeds"] = seeds, fewest
    complete = fewest >= seeds
    out["verdicts"] = _experiment_verdicts(out["ops"], complete)
    out["mechanism_verdict"] = (
        _mechanism_verdict(out["ops"].get("+", {}).get("variants", {}))
        if complete
        else f"not yet measured with the protocol's {seeds} paired seeds (fewest so far: {fewest})"
    )
    return out


def _mechanism_verdict(variants: dict) -> str:
    """Whether the logit scale is the mechanism, in both directions, from the a+b variants' verdicts."""
    bounds = [v["verdict"] for v in variants.values() if v["arm"] == "adamw" and v["intervention"]]
    raises = [
        v["verdict"]
        for v in variants.values()
        if v["arm"] == "stiefel-adam" and v["intervention"].get("logit_scale", 0) > 0
    ]
    if not bounds or not raises or any(v.startswith("not yet") for v in bounds + raises):
        return "not yet measured in both directions"
    helps = any(v.startswith(("reproduces", "helps", "better")) for v in bounds)
    hurts = any(v.startswith(("removes", "hurts", "makes")) for v in raises)
    if helps and hurts:
        return (
            "the attention-logit scale is causal in both directions: bounding AdamW's logits helps it grok, and "
            "raising the frames' logits takes their advantage away"
        )
    if helps:
        return (
            "bounding AdamW's logits helps it grok, but raising the frames' logits does not take their advantage "
            "away: small logits suffice for AdamW, and the frames' advantage does not rest on them alone"
        )
    if hurts:
        return (
            "raising the frames' logits takes their advantage away, but bounding AdamW's logits does not make it "
            "grok: small logits are necessary for the frames, not sufficient for AdamW"
        )
    return (
        "neither bounding AdamW's logits nor raising the frames' changes the outcome: the logit scale is not the "
        "mechanism, only a correlate"
    )


def _experiment_verdicts(ops: dict, complete: bool = True) -> list[str]:
    """Sentences from the variants' verdicts: bounding AdamW's logits, raising the frames', uniform attention.
    Each variant's verdict is given with its seeds; the conclusions wait for every comparison to have the
    protocol's seeds (complete): with 2 or 3 pairs a t-interval can exclude 0 by chance of the spread."""
    plus = ops.get("+", {}).get("variants", {})
    lines = []
    wait = "not yet testable: too few paired seeds so far"
    bounds = {k: v for k, v in plus.items() if v["arm"] == "adamw" and v["intervention"]}
    if bounds:
        same = [k for k, v in bounds.items() if v["verdict"].startswith(("reproduces", "better"))]
        helped = [k for k, v in bounds.items() if v["verdict"].startswith("helps")]
        if not complete:
            conclusion = wait
        elif same:
            conclusion = f"reproduces the frames' grokking with {', '.join(same)}"
        elif helped:
            conclusion = f"helps AdamW grok ({', '.join(helped)}) without reaching the frames"
        else:
            conclusion = "does not reproduce the frames' grokking"
        lines.append(
            "Bounding AdamW's logits (a+b): "
            + "; ".join(f"{k}: {v['verdict']} ({v['grokked']}/{v['n']} grok)" for k, v in bounds.items())
            + f". So bounding the logits alone: {conclusion}."
        )
    raises = {
        k: v for k, v in plus.items() if v["arm"] == "stiefel-adam" and v["intervention"].get("logit_scale", 0) > 0
    }
    if raises:
        slowed = sorted(
            (v["intervention"]["logit_scale"], k)
            for k, v in raises.items()
            if v["verdict"].startswith(("removes", "hurts", "makes"))
        )
        largest = max(v["intervention"]["logit_scale"] for v in raises.values())
        switch = (
            wait
            if not complete
            else f"the smallest scale that does is {slowed[0][0]:g}"
            if slowed
            else f"none of the scales tried (up to {largest:g}) does"
        )
        lines.append(
            "Raising the frames' logit scale (a+b): "
            + "; ".join(f"{k}: {v['verdict']} ({v['grokked']}/{v['n']} grok)" for k, v in raises.items())
            + f". Whether a larger logit scale takes the frames' grokking away: {switch}."
        )
    uniform = [
        (op, v) for op in ops for k, v in ops[op]["variants"].items() if v["intervention"].get("logit_scale") == 0
    ]
    if uniform:
        lines.append(
            "Uniform attention (logit scale 0, no routing): "
            + "; ".join(f"a {op} b: {v['grokked']}/{v['n']} grok, {v['verdict']}" for op, v in uniform)
            + "."
        )
    return lines


def interventions_markdown(summary: dict) -> list[str]:
    lines = [
        f"Measure: {summary['measure']['name']} (lower is better; a run that never reaches 95% counts as the "
        "budget + 1, so a gap involving such runs is understated); beside it the final validation accuracy. "
        "Every comparison is paired by seed, within one operation.",
        "",
    ]
    for op, block in summary["ops"].items():
        lines += [
            f"### a {op} b",
            "",
            "| run | grokked | epochs to 95% (mean) | final val acc (%) | largest logit, end | largest logit, peak | "
            "stable rank W_Q W_K^T | entropy / log N | steps clipped | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, v in block["variants"].items():
            clip = "—" if v["qk_clip_steps"] is None else f"{v['qk_clip_steps']:.0f}"
            lines.append(
                f"| {label} | {v['grokked']}/{v['n']} | {v['epochs']['mean']:.0f} | {v['final_val_acc']['mean']:.1f} | "
                f"{fmt_num(v['max_logit_end'], 3)} | {fmt_num(v['max_logit_peak'], 3)} | "
                f"{fmt_num(v['stable_rank_end'], 3)} | {fmt_num(v['entropy_frac_end'], 3)} | {clip} | "
                f"{v.get('verdict', 'baseline')} |"
            )
        lines += [
            "",
            "| comparison | epochs, mean diff | 95% CI | p (t) | p (Wilcoxon) | final val acc, mean diff (pp) "
            "| 95% CI |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in block["comparisons"]:
            acc = c["final_val_acc"]
            lines.append(
                f"| {c['arm']} − {c['baseline']} ({fmt_seeds(c['n_seeds'])}) | {c['mean_diff']:+.0f} | "
                f"{fmt_ci(c['ci95'], 0)} | {fmt_p(c['p_t'])} | {fmt_p(c['p_wilcoxon'])} | "
                f"{acc['mean_diff']:+.1f} | {fmt_ci(acc['ci95'], 1)} |"
            )
        lines.append("")
    if summary["verdicts"]:
        lines += ["Verdicts (computed from the paired comparisons above):", ""]
        lines += [f"- {v}" for v in summary["verdicts"]]
        lines.append("")
    return lines


def mechanism_points(records: list[dict], measure: Measure) -> list[dict]:
    """One point per run with mechanism metrics: its variant, op, seed, largest logit at the end, epochs."""
    points = []
    for rec in records:
        logit = _mechanism_at_end(rec, "max_logit")
        if logit is None:
            continue
        c = rec["config"]
        points.append(
            {
                "variant": variant(c),
                "op": c["op"],
                "seed": c["seed"],
                "max_logit_end": logit,
                "epochs": measure.value(rec),
                "censored": measure.censored(rec),
                "budget": c["epochs"],
            }
        )
    return points


def mechanism_scatter(points: list[dict], out_dir: Path, made: list[str], name: str = "mechanism_scatter.png"):
    """Epochs to 95% (censored runs as open markers at the budget) against the largest logit, coloured by run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not points:
        return
    labels = sorted({(p["op"], p["variant"]) for p in points})
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for i, (op, label) in enumerate(labels):
        mine = [p for p in points if (p["op"], p["variant"]) == (op, label)]
        color = cmap(i % 20)
        done = [p for p in mine if not p["censored"]]
        never = [p for p in mine if p["censored"]]
        marker = "o" if op == "+" else "s"
        ax.scatter(
            [p["max_logit_end"] for p in done],
            [p["epochs"] for p in done],
            color=color,
            marker=marker,
            s=28,
            label=f"{label} (a {op} b)",
        )
        ax.scatter(
            [p["max_logit_end"] for p in never],
            [p["epochs"] for p in never],
            facecolors="none",
            edgecolors=color,
            marker=marker,
            s=28,
        )
    budget = max(p["budget"] for p in points)
    ax.axhline(budget, color="gray", lw=0.8, ls=":")
    ax.text(0.01, budget, "budget: open markers never reached 95%", va="bottom", fontsize=7,
            transform=ax.get_yaxis_transform())  # fmt: skip
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=0.0)
    ax.set_xlabel("largest attention logit at the end of training ('=' query, mean over layers)")
    ax.set_ylabel("epochs to 95% validation accuracy")
    ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_figure(fig, out_dir, name, made, dpi=110)


def mechanism_answer(summary: dict, title: str) -> MechanismAnswer | None:
    """REPORT's mechanism section for this testbed, from an interventions summary (None without its part)."""
    found = summary.get("interventions")
    if not found:
        return None
    scatter = "mechanism_scatter.png" in summary.get("plots", [])
    return MechanismAnswer(
        heading="The mechanism, by intervention",
        answers=(Answer(f"is the attention-logit scale the mechanism in {title}?", found["mechanism_verdict"]),),
        lead=f"In one sentence: **{found['mechanism_verdict']}**.",
        bullets=tuple(found["verdicts"]),
        figure=("epochs to 95% against the largest attention logit", "mechanism_scatter.png") if scatter else None,
    )
