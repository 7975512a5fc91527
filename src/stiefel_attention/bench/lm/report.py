"""The lm report: records -> summary (every arm against stiefel-adam, sweeps, lr-stability with the bounded
arms, the factorial), markdown and plots."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..arms import BOUNDED_ARMS, arm_spec
from ..family import Plan
from ..report.document import write_experiment
from ..report.factorial import FactorialSection, factorial_markdown, factorial_plot, suite_factorial
from ..report.fmt import fmt_ci, fmt_num, fmt_seeds
from ..report.geometry import (
    PRECONDITION_WORDS,
    Measure,
    compare,
    controls_markdown,
    controls_summary,
    decay_markdown,
    fmt_diff,
    lead_plot,
    lead_summary,
    mechanism_plot,
    peak,
    sweep_markdown,
    sweep_summary,
)
from ..report.stats import describe
from ..report.summaries import Answer, BoundedAnswer, MechanismAnswer
from ..sequence.report import curve_plot, header, swept

__all__ = ["VAL_LOSS", "write_lm_report"]


def _final_loss(rec: dict) -> float:
    """Final validation loss; a run that diverged counts as a uniform prediction's loss (its cap, as in Wortsman
    et al.'s learning-rate sensitivity), and says so in metrics.diverged_at_step."""
    loss = rec["metrics"]["final_val_loss"]
    return rec["metrics"]["uniform_loss"] if loss is None else loss


VAL_LOSS = Measure("validation loss", "nats/char", _final_loss, higher_is_better=False)


_LM_CPU_SIZE = (
    " Sized for the sensitivity line: an unrecorded pilot (seed 0, sweep split; commit c009f98 gives its numbers) "
    "found adamw − frozen too small at 800 steps, near the bigram regime, so the profile trains for 2400; the arms "
    "were not changed. The sensitivity measured at 2400 steps is in the comparison table below."
)
_MODEL = ("n_layers", "d_model", "n_heads", "head_dim")


def _lm_models(records: list[dict]) -> list[dict]:
    """The model sizes among the records, each with its context, batch and every number of training steps."""
    steps: dict[tuple, set[int]] = defaultdict(set)
    for rec in records:
        c = rec["config"]
        steps[(*(c["model"][k] for k in _MODEL), c["context"], c["batch"])].add(c["steps"])
    return [dict(zip((*_MODEL, "context", "batch"), k), steps=sorted(v)) for k, v in sorted(steps.items())]


def lm_summary(experiment: str, records: list[dict]) -> dict:
    summary: dict = {"experiment": experiment, "n_records": len(records), "model": _lm_models(records)}
    if experiment == "main":
        summary["controls"] = controls_summary(records, VAL_LOSS)
        summary["samples"] = {r["config"]["arm"]: r.get("sample", "") for r in records if r["config"]["seed"] == 0}
    elif experiment == "lr-sweep":
        summary["sweep"] = sweep_summary(records, VAL_LOSS, swept)
    elif experiment == "scaling":
        summary["scaling"] = lead_summary(records, VAL_LOSS, "steps")
    elif experiment == "lr-stability":
        summary["stability"] = stability_summary(records)
    elif experiment == "factorial":
        summary["factorial"] = suite_factorial(records, VAL_LOSS)
    elif experiment == "factorial-stability":  # the table of sensitivities, then every run's losses behind it
        losses = LossTable.of(records)
        summary["factorial"] = sensitivity_factorial(losses)
        summary["stability"] = stability_summary(records, losses)
    else:
        raise ValueError(f"unknown experiment {experiment!r}")
    return summary


# --- lr-stability -------------------------------------------------------------------------------------------


def _stability_label(config: dict) -> str:
    return config["arm"] + (f"+clip{config['qk_clip']:g}" if "qk_clip" in config else "")


@dataclass(frozen=True)
class LossTable:
    """The losses behind the learning-rate sensitivity: cap (a uniform prediction's loss; None when no record
    has it), table[m][label][seed] (the final loss capped at it) and the records of each (label, m)."""

    cap: float | None
    table: dict[float, dict[str, dict[int, float]]]
    cells: dict[tuple[str, float], list[dict]]

    @classmethod
    def of(cls, records: list[dict]) -> LossTable:
        cap = next((r["metrics"]["uniform_loss"] for r in records if "uniform_loss" in r["metrics"]), None)
        table: dict[float, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
        cells: dict[tuple[str, float], list[dict]] = defaultdict(list)
        for rec in records:
            c = rec["config"]
            m, label = c.get("lr_multiplier", 1.0), _stability_label(c)
            loss = _final_loss(rec) if cap is None else min(_final_loss(rec), cap)
            table[m][label][c["seed"]] = loss
            cells[(label, m)].append(rec)
        return cls(cap, table, cells)


def _sensitivities(table, labels: list[str], multipliers: list[float]) -> dict[str, dict[int, float]]:
    """Learning-rate sensitivity per label and seed (Wortsman et al.: the mean over the sweep of the capped loss
    minus its best over the sweep), over the multipliers every run of that seed has; none for one multiplier."""
    sens: dict[str, dict[int, float]] = defaultdict(dict)
    for label in labels if len(multipliers) > 1 else ():  # one multiplier is no sweep
        seeds = set.intersection(*(set(table[m][label]) for m in multipliers))
        for seed in seeds:
            losses = [table[m][label][seed] for m in multipliers]
            sens[label][seed] = sum(losses) / len(losses) - min(losses)
    return sens


SENSITIVITY = Measure(
    "learning-rate sensitivity", "nats/char", lambda rec: rec["metrics"]["sensitivity"], higher_is_better=False
)


def sensitivity_factorial(losses: LossTable) -> dict:
    """The factorial section (suite_factorial) of each arm's learning-rate sensitivity per seed."""
    table, cells = losses.table, losses.cells
    labels = sorted({label for label, _ in cells})
    sens = _sensitivities(table, labels, sorted(table))
    per_seed = [
        {"config": {"arm": label, "seed": seed}, "metrics": {"sensitivity": value}}
        for label, seeds in sens.items()
        for seed, value in sorted(seeds.items())
    ]
    return suite_factorial(per_seed, SENSITIVITY)


def stability_summary(records: list[dict], losses: LossTable | None = None) -> dict:
    """Per run (arm, with QK-Clip or not) and learning-rate multiplier m: the final validation loss capped at a
    uniform prediction's (a diverged run counts as that), how many diverged, the largest attention and output
    logits over training; paired comparisons with adamw at every m; each run's learning-rate sensitivity
    (_sensitivities) with its paired difference from adamw's; the precondition and a verdict. `losses`: the
    records' LossTable where the caller has built it."""
    losses = losses or LossTable.of(records)
    cap, table, cells = losses.cap, losses.table, losses.cells
    multipliers = sorted(table)
    labels = sorted({label for label, _ in cells}, key=lambda a: (a.split("+")[0] != "adamw", "+" in a, a))
    points = {}
    for (label, m), recs in sorted(cells.items()):
        peaks = [x for x in (peak(r, "max_logit") for r in recs) if x is not None]
        outs = [max(r["curves"]["max_output_logit"]) for r in recs if r["curves"].get("max_output_logit")]
        points.setdefault(label, {})[f"{m:g}"] = {
            "loss": describe(list(table[m][label].values())),
            "diverged": sum(r["metrics"].get("diverged_at_step") is not None for r in recs),
            "diverged_at": sorted(
                r["metrics"]["diverged_at_step"] for r in recs if r["metrics"].get("diverged_at_step")
            ),
            "max_attention_logit": max(peaks) if peaks else None,
            "max_output_logit": max(outs) if outs else None,
        }
    vs_adamw = {
        f"{m:g}": [st for label in labels if label != "adamw" and (st := compare(table[m], label, "adamw"))]
        for m in multipliers
    }
    sens = _sensitivities(table, labels, multipliers)
    sensitivity = {label: describe(list(v.values())) for label, v in sens.items()}
    sens_vs = [st for label in labels if label != "adamw" and (st := compare(sens, label, "adamw"))]
    out = {
        "cap": cap,
        "multipliers": [f"{m:g}" for m in multipliers],
        "labels": labels,
        "points": points,
        "vs_adamw": vs_adamw,
        "sensitivity": sensitivity,
        "sensitivity_vs_adamw": sens_vs,
        "precondition": _stability_precondition(points, table, multipliers),
        "verdict": _stability_verdict(sens_vs, sensitivity),
    }
    if any(arm in labels for arm in BOUNDED_ARMS):  # summaries without the bounded arms stay as they were
        out["bounded"] = _bounded_summary(records, table, sens, points, multipliers)
    return out


# The questions of the bounded-logit arms, each a paired comparison (arm - baseline) of the learning-rate
# sensitivity and of the capped loss at the two largest multipliers: does the bound buy QK-norm's stability, what
# does it add to the plain frames, and does it need the frames at all (the same norm on ordinary W_Q, W_K)?
BOUNDED_PAIRS = (
    ("stiefel-adam-bounded", "qk-norm"),
    ("stiefel-adam-bounded", "stiefel-adam"),
    ("stiefel-adam-bounded", "adamw-bounded"),
    ("stiefel-adam-bounded-temp", "qk-norm"),
    ("stiefel-adam-bounded-temp", "stiefel-adam-bounded"),
)


def logit_bound(config: dict) -> float | None:
    """The bound of an arm's logits by construction (StiefelAttention.logit_bound), from its config; None without
    one."""
    attention = arm_spec(config["arm"]).attention
    if not attention.get("qk_input_norm") or attention["qk"] not in ("stiefel", "frozen", "parametrized"):
        return None
    model = config["model"]
    return attention.get("max_temperature", 1.0) * model["d_model"] / model["head_dim"] ** 0.5


def _bounded_summary(records, table, sens, points, multipliers) -> dict:
    top = [m for m in multipliers if m > 1][-2:]  # the two largest multipliers, e.g. 16 and 64
    pairs = []
    for arm, base in BOUNDED_PAIRS:
        row = {"arm": arm, "baseline": base, "sensitivity": compare(sens, arm, base)}
        row["loss"] = {f"{m:g}": compare(table[m], arm, base) for m in top}
        if row["sensitivity"] is not None or any(row["loss"].values()):
            pairs.append(row)
    bounds = {}
    for rec in records:
        if rec["config"]["arm"] in BOUNDED_ARMS:
            bounds[_stability_label(rec["config"])] = logit_bound(rec["config"])  # None: no bound (adamw-bounded)
    largest = {arm: max((p["max_attention_logit"] or 0.0) for p in points[arm].values()) for arm in bounds}
    return {"top_multipliers": [f"{m:g}" for m in top], "pairs": pairs, "bounds": bounds, "largest": largest,
            "verdict": _bounded_verdict(pairs)}  # fmt: skip


def _standing_of(st: dict | None) -> str | None:
    """'below', 'above' or 'level' from a paired comparison's 95% CI (None: not testable)."""
    if st is None or st["n_seeds"] < 2:
        return None
    lo, hi = st["ci95"]
    return "below" if hi < 0 else "above" if lo > 0 else "level"


def _bounded_verdict(pairs: list[dict]) -> dict[str, str]:
    """A sentence per question, from the sensitivity comparisons' 95% CIs."""
    by = {(p["arm"], p["baseline"]): p for p in pairs}

    def says(arm: str, base: str, below: str, level: str, above: str) -> str:
        st = by.get((arm, base), {}).get("sensitivity")
        standing = _standing_of(st)
        if standing is None:
            return "not measured yet (needs 2 paired seeds with the whole sweep)"
        word = {"below": below, "level": level, "above": above}[standing]
        return f"{word} ({arm} − {base} sensitivity {st['mean_diff']:+.3f} nats/char {fmt_ci(st['ci95'], 3)})"

    return {
        "qk-norm": says(
            "stiefel-adam-bounded",
            "qk-norm",
            "yes, and more: the bounded frames are significantly less sensitive to the learning rate than qk-norm",
            "yes: the bounded frames are as stable as qk-norm (no significant difference)",
            "no: the bounded frames are significantly more sensitive to the learning rate than qk-norm",
        ),
        "frames": says(
            "stiefel-adam-bounded",
            "stiefel-adam",
            "yes: bounding the whole logit makes the frames significantly less sensitive",
            "no: the bound does not change the frames' sensitivity significantly",
            "no: the bounded frames are significantly more sensitive than the plain ones",
        ),
        "needs frames": says(
            "stiefel-adam-bounded",
            "adamw-bounded",
            "yes: the same norm on ordinary W_Q, W_K is significantly more sensitive",
            "no: the same norm on ordinary W_Q, W_K is as stable",
            "no: the norm on ordinary W_Q, W_K is even less sensitive than with frames",
        ),
    }


def _stability_precondition(points: dict, table, multipliers: list[float]) -> dict:
    """At the largest multiplier with adamw runs: do adamw's attention logits grow (at least 3x their m = 1 value)
    and does adamw trail qk-norm clearly (by 0.1 nats/char or more, and significantly where seeds allow)?"""
    adamw = points.get("adamw", {})
    ms = [m for m in multipliers if f"{m:g}" in adamw]
    if "1" not in adamw or len(ms) < 2:
        return {"met": None, "text": "not measured (needs adamw at m = 1 and a larger m)"}
    top = max(ms)
    base, high = adamw["1"]["max_attention_logit"], adamw[f"{top:g}"]["max_attention_logit"]
    growth = high / base if base and high is not None else None
    gap = compare(table[top], "adamw", "qk-norm")
    trails = gap is not None and gap["mean_diff"] >= 0.1 and (gap["n_seeds"] < 2 or gap["ci95"][0] > 0)
    grows = growth is not None and growth >= 3.0
    diverged = adamw[f"{top:g}"]["diverged"]
    text = (
        f"at m = {top:g}, adamw's largest attention logit over training is "
        + (f"{growth:.1f}x its m = 1 value ({high:.1f} vs {base:.1f})" if growth is not None else "not measured")
        + (f"; {diverged} of its runs diverged" if diverged else "")
        + (
            f"; adamw − qk-norm final loss {gap['mean_diff']:+.3f} nats/char "
            + (f"{fmt_ci(gap['ci95'], 3)}" if gap["n_seeds"] > 1 else "(1 seed)")
            if gap
            else "; qk-norm not run there"
        )
    )
    return {"met": bool(grows and trails), "logit_growth": growth, "text": text}


def _stability_verdict(sens_vs: list[dict], sensitivity: dict) -> str:
    """Do the frames buy high-learning-rate stability? stiefel-adam's sensitivity against adamw's and qk-norm's."""
    by = {c["arm"]: c for c in sens_vs}
    st = by.get("stiefel-adam")
    if st is None:
        return "not measured"
    if st["n_seeds"] < 2:
        return "not yet testable (fewer than 2 paired seeds with the whole sweep)"
    lo, hi = st["ci95"]
    if not (hi < 0):
        return (
            "no: stiefel-adam's learning-rate sensitivity is not significantly below adamw's "
            f"({st['mean_diff']:+.3f} nats/char {fmt_ci(st['ci95'], 3)})"
        )
    qk = sensitivity.get("qk-norm")
    ours = sensitivity.get("stiefel-adam")
    less = "stiefel-adam is significantly less sensitive to the learning rate than adamw"
    if qk and ours and ours["mean"] <= qk["mean"]:
        return f"yes: {less}, and no more than qk-norm"
    return f"partly: {less}, but more than qk-norm"


def stability_markdown(summary: dict) -> list[str]:
    ms = summary["multipliers"]
    lines = [
        "Every rate of an arm (its tuned rates) times m; adamw+clip is adamw with QK-Clip at the profile's threshold. "
        f"Loss: final validation loss in nats/char, capped at a uniform prediction's ({fmt_num(summary['cap'], 3)}), "
        "which is what a diverged run counts as. Sensitivity (Wortsman et al. 2023): per seed, the mean over m of the "
        "capped loss minus the seed's best over m; lower is more stable.",
        "",
        f"Precondition ({PRECONDITION_WORDS[summary['precondition']['met']]}): {summary['precondition']['text']}.",
        "",
        "| run | " + " | ".join(f"m = {m}" for m in ms) + " | sensitivity |",
        "|---|" + "---|" * len(ms) + "---|",
    ]
    for label in summary["labels"]:
        row = []
        for m in ms:
            pt = summary["points"][label].get(m)
            if pt is None:
                row.append("—")
                continue
            div = f" ({pt['diverged']} diverged)" if pt["diverged"] else ""
            row.append(f"{pt['loss']['mean']:.3f}{div}")
        sens = summary["sensitivity"].get(label)
        row.append(f"{sens['mean']:.3f} ({fmt_seeds(sens['n'])})" if sens else "—")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Largest attention logit over training (largest head of any layer, any seed; n/a where every run diverged "
        "before its first evaluation):",
        "",
        "| run | " + " | ".join(f"m = {m}" for m in ms) + " |",
        "|---|" + "---|" * len(ms),
    ]
    for label in summary["labels"]:
        pts = summary["points"][label]
        lines.append(
            f"| {label} | "
            + " | ".join(fmt_num(pts[m]["max_attention_logit"], 3) if m in pts else "—" for m in ms)
            + " |"
        )
    lines += ["", "| comparison | m | mean diff (nats/char) | 95% CI | seeds |", "|---|---|---|---|---|"]
    for m in ms:
        for st in summary["vs_adamw"][m]:
            lines.append(
                f"| {st['arm']} − adamw | {m} | {st['mean_diff']:+.3f} | {fmt_ci(st['ci95'], 3)} | {st['n_seeds']} |"
            )
    for st in summary["sensitivity_vs_adamw"]:
        lines.append(
            f"| {st['arm']} − adamw, sensitivity | all | {st['mean_diff']:+.3f} | {fmt_ci(st['ci95'], 3)} | "
            f"{st['n_seeds']} |"
        )
    lines += ["", f"Do the frames buy high-learning-rate stability? **{summary['verdict']}**.", ""]
    if "bounded" in summary:
        lines += bounded_markdown(summary["bounded"])
    return lines


def bounded_markdown(bounded: dict) -> list[str]:
    ms = bounded["top_multipliers"]
    lines = [
        "Frames whose logit is bounded by construction (`qk_input_norm`: queries and keys read x/rms(x) with no "
        "gain, so every logit is at most T·d/√r), against qk-norm, the plain frames and the same norm on ordinary "
        "W_Q, W_K (paired by seed; negative: the first arm is more stable or reaches a lower loss):",
        "",
        "| comparison | sensitivity | 95% CI | " + " | ".join(f"loss at m = {m} | 95% CI" for m in ms) + " | seeds |",
        "|---|---|---|" + "---|---|" * len(ms) + "---|",
    ]
    for p in bounded["pairs"]:
        cells = []
        for st in (p["sensitivity"], *(p["loss"][m] for m in ms)):
            cells += [f"{st['mean_diff']:+.3f}", fmt_ci(st["ci95"], 3)] if st else ["—", "—"]
        seeds = (
            p["sensitivity"]["n_seeds"]
            if p["sensitivity"]
            else max((st["n_seeds"] for st in p["loss"].values() if st), default=0)
        )
        lines.append(f"| {p['arm']} − {p['baseline']} | " + " | ".join(cells) + f" | {seeds} |")
    lines += ["", "Largest attention logit over training against the bound:", ""]
    lines += ["| run | bound | largest logit | largest / bound |", "|---|---|---|---|"]
    for arm, bound in sorted(bounded["bounds"].items()):
        top = bounded["largest"][arm]
        ratio = "n/a" if bound is None else f"{top / bound:.3f}"
        lines.append(f"| {arm} | {'none' if bound is None else fmt_num(bound, 3)} | {fmt_num(top, 3)} | {ratio} |")
    v = bounded["verdict"]
    lines += [
        "",
        f"Does the bound buy qk-norm's stability? **{v['qk-norm']}**.",
        f"Does it add to the plain frames? **{v['frames']}**.",
        f"Does it need the frames? **{v['needs frames']}**.",
        "",
    ]
    return lines


def stability_plot(summary: dict, out_dir: Path, made: list[str]) -> None:
    """Capped final loss and the largest attention logit against the learning-rate multiplier, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..report.fmt import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label in summary["labels"]:
        pts = summary["points"][label]
        ms = sorted(pts, key=float)
        axes[0].plot([float(m) for m in ms], [pts[m]["loss"]["mean"] for m in ms], marker="o", lw=1.2, label=label)
        logit = [(float(m), pts[m]["max_attention_logit"]) for m in ms if pts[m]["max_attention_logit"] is not None]
        (line,) = axes[1].plot([x for x, _ in logit], [y for _, y in logit], marker="o", lw=1.2, label=label)
        bound = summary.get("bounded", {}).get("bounds", {}).get(label)
        if bound is not None:  # the bounded arms' bound by construction, in their colour
            axes[1].axhline(bound, color=line.get_color(), ls="--", lw=0.8, label=f"{label}: bound {bound:g}")
    if summary["cap"] is not None:
        axes[0].axhline(summary["cap"], color="gray", ls=":", lw=0.8, label="uniform prediction (cap)")
    axes[0].set_ylabel("final validation loss, capped (nats/char)")
    axes[1].set_ylabel("largest attention logit over training")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning-rate multiplier m")
    axes[0].legend(fontsize=7)
    save_figure(fig, out_dir, "lr_stability.png", made, dpi=110)


def lm_markdown(summary: dict, profile: str) -> str:
    lines = header(
        "Character-level LM (tiny Shakespeare)",
        summary,
        profile,
        "Validation loss in nats per character on a fixed, seeded set of validation windows (the "
        "sweep: on held-out training text).",
    )
    for m in summary.get("model", []):
        lines += [
            f"Model: CharGPT (pre-norm, learned positions, untied output head), {m['n_layers']} "
            f"layer{'s' * (m['n_layers'] != 1)}, width {m['d_model']}, {m['n_heads']} heads of {m['head_dim']}, "
            f"context {m['context']}; {', '.join(map(str, m['steps']))} steps of {m['batch']} windows."
            + (_LM_CPU_SIZE if profile == "cpu" and summary["experiment"] == "main" else ""),
            "",
        ]
    if "controls" in summary:
        lines += controls_markdown(summary["controls"], digits=3)
    if "sweep" in summary:
        lines += sweep_markdown(summary["sweep"])
    if "scaling" in summary:
        lines += decay_markdown(summary["scaling"], digits=3)
    if "factorial" in summary:
        lines += factorial_markdown(FactorialSection.from_dict(summary["factorial"]), digits=3)
    if "stability" in summary:
        lines += stability_markdown(summary["stability"])
    for arm, text in sorted(summary.get("samples", {}).items()):
        lines += [f"Sample, {arm}, seed 0 (300 characters at a fixed sampling seed):", "", "```", text, "```", ""]
    lines += [f"![{p}]({p})" for p in summary.get("plots", [])]
    return "\n".join(lines) + "\n"


def write_lm_report(out_dir, experiment: str, records: list[dict], profile: str, plan: Plan | None) -> dict:
    def plots(summary: dict, exp_dir: Path) -> list[str]:
        made: list[str] = []
        if "controls" in summary:
            curve_plot(records, "val_loss", "validation loss (nats/char)", exp_dir, made, "val_loss.png")
            mechanism_plot(summary["controls"], exp_dir, made)
        if "scaling" in summary:
            lead_plot(summary["scaling"], exp_dir, made)
        if "factorial" in summary:
            factorial_plot(FactorialSection.from_dict(summary["factorial"]), exp_dir, made)
        if "stability" in summary:
            stability_plot(summary["stability"], exp_dir, made)
        return made

    return write_experiment(out_dir, experiment, lm_summary(experiment, records), plots, lm_markdown, profile, plan)


def stability_answer(summary: dict, title: str) -> MechanismAnswer | None:
    """REPORT's high-learning-rate section for this testbed, from an lr-stability summary (None without its part):
    the sensitivity of each arm, against adamw, the verdict, and the bounded arms' answers."""
    found = summary.get("stability")
    if not found:
        return None
    sens = "; ".join(
        f"{label} {found['sensitivity'][label]['mean']:.3f}"
        for label in found["labels"]
        if label in found["sensitivity"]
    )
    vs = "; ".join(f"{c['arm']} {fmt_diff(c, 'nats/char', 3)}" for c in found["sensitivity_vs_adamw"])
    answers = [Answer(f"do the frames buy high-learning-rate stability in {title}?", found["verdict"])]
    bounded = None
    if b := found.get("bounded"):
        verdict = b["verdict"]
        answers.append(Answer("does bounding the whole logit buy qk-norm's stability?", verdict["qk-norm"]))
        bounded = BoundedAnswer(
            verdict["qk-norm"], verdict["frames"], verdict["needs frames"], b["bounds"], b["largest"]
        )
    figure = "lr_stability.png" in summary.get("plots", [])
    return MechanismAnswer(
        heading="High learning rates",
        answers=tuple(answers),
        lead=f"Precondition ({PRECONDITION_WORDS[found['precondition']['met']]}): {found['precondition']['text']}. "
        f"Learning-rate sensitivity (nats/char, lower is more stable): {sens or 'not measured'}; against adamw: "
        f"{vs or 'not measured'}. Do the frames buy high-learning-rate stability? **{found['verdict']}**.",
        bounded=bounded,
        figure=("loss and largest attention logit against the learning rate", "lr_stability.png") if figure else None,
    )
