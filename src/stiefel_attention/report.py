"""Records -> summary.json -> summary.md + PNG plots, beside the paper's claimed numbers.

Everything here is computed from run records alone (the JSON files under runs/), so a report
can be rebuilt at any time, and partially finished experiments report what they have.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from . import claims
from .experiments.grok import GROK_THRESHOLD
from .runner import read_record, write_json_atomic
from .stats import describe, paired_comparison

__all__ = ["cifar_summary", "write_cifar_report", "verdict", "load_records"]


def load_records(runs_dir: str | Path, family: str | None = None) -> list[dict]:
    out = []
    for path in sorted(Path(runs_dir).glob("*.json")):
        rec = read_record(path)  # an unreadable file is left out with a warning, never silently
        if rec is not None and (family is None or rec.get("family") == family):
            out.append(rec)
    return out


def profiles_in(runs_dir: str | Path) -> set[str]:
    """The profiles of the run records in runs_dir (empty if none)."""
    return {r["config"].get("profile", "?") for r in load_records(runs_dir)}


def verdict(kind: str, paper: float | None, st: dict) -> str:
    """A plain-words verdict: what both tests support, and whether the paper's size is inside the CI."""
    if kind == "control" or paper is None:
        return "control (no paper number)"
    if st["n_seeds"] < 2 or math.isnan(st.get("p_t", math.nan)) and math.isnan(st.get("p_wilcoxon", math.nan)):
        return "too few seeds to test"
    lo, hi = st["ci95"]
    if kind == "null":
        if st["supported"]:
            return f"does not replicate: significant difference {st['mean_diff']:+.2f} pp (both tests p<0.05)"
        return "replicates: no significant difference"
    if not st["supported"]:
        return "does not replicate: no significant difference by both tests"
    if (st["mean_diff"] > 0) != (paper > 0):
        return "does not replicate: significant effect of the opposite sign"
    if lo <= paper <= hi:
        return "replicates: significant, and the paper's size lies in the 95% CI"
    return f"direction replicates, size does not: paper {paper:+.2f} pp outside the 95% CI [{lo:+.2f}, {hi:+.2f}]"


def _acc_pp(rec: dict) -> float:
    return 100.0 * rec["metrics"]["final_eval_acc"]


def _by_arm_seed(records: list[dict], label) -> dict[str, dict[int, float]]:
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for rec in records:
        table[label(rec["config"])][rec["config"]["seed"]] = _acc_pp(rec)
    return table


def _compare(table: dict[str, dict[int, float]], arm: str, baseline: str) -> dict | None:
    if arm not in table or baseline not in table:
        return None
    seeds = sorted(set(table[arm]) & set(table[baseline]))
    st = paired_comparison([table[arm][s] for s in seeds], [table[baseline][s] for s in seeds])
    st["seeds"] = seeds
    st["diffs"] = [table[arm][s] - table[baseline][s] for s in seeds]
    return st


def cifar_summary(experiment: str, records: list[dict]) -> dict:
    """Per-arm accuracy and paired comparisons (percentage points) for one CIFAR experiment."""
    summary: dict = {"experiment": experiment, "n_records": len(records), "comparisons": [], "arms": {}}
    if experiment in ("main", "ablation", "eps"):
        label = (lambda c: f"eps={c['frame_eps']:g}") if experiment == "eps" else (lambda c: c["arm"])
        table = _by_arm_seed(records, label)
        summary["arms"] = {arm: describe(list(v.values())) for arm, v in sorted(table.items())}
        comps = list(claims.CIFAR_COMPARISONS[experiment])
        if experiment == "eps":  # every eps value against 1e-8, the paper's targeted point flagged
            comps = [c for c in comps] + [
                dict(arm=a, baseline="eps=1e-08", kind="control", paper=None, text="eps sweep point")
                for a in sorted(table) if a not in ("eps=1e-08", "eps=0.1")
            ]
        for comp in comps:
            st = _compare(table, comp["arm"], comp["baseline"])
            if st is not None:
                summary["comparisons"].append({**comp, **st, "verdict": verdict(comp["kind"], comp["paper"], st)})
    elif experiment == "scaling":
        by_n: dict[int, list[dict]] = defaultdict(list)
        for rec in records:
            by_n[rec["config"]["n_train"]].append(rec)
        for n in sorted(by_n):
            table = _by_arm_seed(by_n[n], lambda c: c["arm"])
            summary["arms"][str(n)] = {arm: describe(list(v.values())) for arm, v in sorted(table.items())}
            st = _compare(table, "stiefel-adam", "adamw")
            if st is not None:
                paper = claims.CIFAR_SCALING_PAPER.get(n)
                kind = "effect" if paper is not None else "control"
                said = verdict(kind, paper, st) if paper is not None else "measured only: the paper gives no number at this n"
                summary["comparisons"].append(dict(arm="stiefel-adam", baseline="adamw", n_train=n, kind=kind,
                                                   paper=paper, text=claims.CIFAR_SCALING_TEXT, **st, verdict=said))
        leads = [(c["n_train"], c["mean_diff"]) for c in summary["comparisons"]]
        if len(leads) >= 2:
            summary["lead_grows_with_n"] = all(b[1] > a[1] for a, b in zip(leads, leads[1:]))
    elif experiment == "movement":
        summary.update(_movement_summary(records))
    elif experiment == "lr-sweep":
        summary.update(_lr_sweep_summary(records))
    else:
        raise ValueError(f"unknown experiment {experiment!r}")
    return summary


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def movement_vs_lr(sweep_records: list[dict]) -> list[dict]:
    """From the lr-sweep runs: AdamW (at its chosen lr) / fixed-step SGD movement, per SGD lr.

    A fixed-step update moves lr x ||m|| per step, so the ratio the paper reports depends on the
    learning rate it was run at; the sweep shows that dependence on the same seeds.
    """
    if not sweep_records:
        return []
    chosen = _lr_sweep_summary(sweep_records)["chosen"].get("adamw", {}).get("lr")
    base = {r["config"]["seed"]: r["curves"]["movement_median"] for r in sweep_records
            if r["config"]["arm"] == "adamw" and r["config"]["lr"] == chosen}
    rows = []
    for lr in sorted({r["config"]["frame_lr"] for r in sweep_records if r["config"]["arm"] == "stiefel-sgd"}):
        ratios = [b / a for r in sweep_records if r["config"]["arm"] == "stiefel-sgd" and r["config"]["frame_lr"] == lr
                  and r["config"]["seed"] in base for a, b in zip(r["curves"]["movement_median"], base[r["config"]["seed"]]) if a > 0]
        if ratios:
            rows.append({"sgd_frame_lr": lr, "adamw_lr": chosen, "median_ratio": _median(ratios)})
    return rows


def _movement_summary(records: list[dict]) -> dict:
    """Ratio of AdamW's per-step Q/K movement to each Stiefel arm's, per epoch, over paired seeds."""
    curves: dict[str, dict[int, list[float]]] = defaultdict(dict)
    curves_lr: dict[str, float] = {}
    for rec in records:
        curves[rec["config"]["arm"]][rec["config"]["seed"]] = rec["curves"]["movement_median"]
        curves_lr[rec["config"]["arm"]] = rec["config"]["lr"] if rec["config"]["arm"].startswith("adamw") else rec["config"]["frame_lr"]
    out: dict = {"ratios": {}, "paper": list(claims.CIFAR_MOVEMENT_PAPER), "text": claims.CIFAR_MOVEMENT_TEXT}
    base = curves.get("adamw", {})
    for arm in ("stiefel-sgd", "stiefel-adam"):
        seeds = sorted(set(base) & set(curves.get(arm, {})))
        if not seeds:
            continue
        per_seed = [[b / a if a > 0 else math.inf for a, b in zip(curves[arm][s], base[s])] for s in seeds]
        flat = sorted(r for seq in per_seed for r in seq)
        median = _median(flat)
        lo, hi = claims.CIFAR_MOVEMENT_PAPER
        out["ratios"][arm] = {
            "seeds": seeds, "per_epoch": per_seed, "median": median, "min": flat[0], "max": flat[-1],
            "lr": curves_lr.get(arm),
            "verdict": (f"replicates: median {median:.3g}x within the paper's {lo:g}-{hi:g}x" if lo <= median <= hi
                        else f"does not replicate: median {median:.3g}x (range {flat[0]:.3g}-{flat[-1]:.3g}x) vs the paper's {lo:g}-{hi:g}x")
            if arm == "stiefel-sgd" else "for reference (the paper's claim is about the fixed-step rule)",
        }
    return out


def _lr_sweep_summary(records: list[dict]) -> dict:
    """Mean validation accuracy per (arm, learning rate); the best per arm is the profile's choice."""
    acc: dict[tuple[str, float], list[float]] = defaultdict(list)
    for rec in records:
        c = rec["config"]
        lr = c["lr"] if c["arm"] == "adamw" else c["frame_lr"]
        acc[(c["arm"], lr)].append(_acc_pp(rec))
    grid = [{"arm": a, "lr": lr, "which_lr": "lr" if a == "adamw" else "frame_lr", **describe(v)}
            for (a, lr), v in sorted(acc.items())]
    best = {}
    for row in grid:
        if row["arm"] not in best or row["mean"] > best[row["arm"]]["mean"]:
            best[row["arm"]] = row
    return {"grid": grid, "chosen": {a: {"which_lr": r["which_lr"], "lr": r["lr"], "val_acc_mean": r["mean"]} for a, r in best.items()}}


# ---------------------------------------------------------------------------------------------
# Markdown and plots
# ---------------------------------------------------------------------------------------------


def _fmt_ci(ci: list[float], digits: int = 2) -> str:
    """[lo, hi] with a sign, or n/a when one seed leaves the interval undefined."""
    lo, hi = ci
    if math.isnan(lo) or math.isnan(hi):
        return "n/a"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"


def _fmt_p(p: float) -> str:
    return "n/a" if p is None or math.isnan(p) else (f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}")


def _fmt_t(t: float) -> str:
    """A t statistic; undefined (n/a) when every paired difference is the same, e.g. all zero."""
    return "n/a" if t is None or math.isnan(t) else f"{t:.2f}"


def _md_comparisons(summary: dict) -> list[str]:
    lines = ["| comparison | paper claim | measured mean diff (pp) | 95% CI | t | p (t) | p (Wilcoxon) | wins | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in summary["comparisons"]:
        name = f"{c['arm']} vs {c['baseline']}" + (f" (n={c['n_train']})" if "n_train" in c else "")
        paper = c["text"] if c.get("paper") is None else f"{c['paper']:+.2f} pp — {c['text']}"
        lines.append(f"| {name} | {paper} | {c['mean_diff']:+.2f} | {_fmt_ci(c['ci95'])} | "
                     f"{_fmt_t(c['t'])} | {_fmt_p(c['p_t'])} | {_fmt_p(c['p_wilcoxon'])} | {c['wins']}/{c['n_seeds']} | {c['verdict']} |")
    return lines


def summary_markdown(summary: dict, profile: str) -> str:
    exp = summary["experiment"]
    planned = f" of {summary['n_planned']} planned" if summary.get("n_planned") else ""
    lines = [f"# CIFAR-10 (JPEG mirror) — `{exp}`, profile `{profile}`", "",
             f"{summary['n_records']} finished runs{planned}. Accuracies are final test accuracy in percent "
             "(the lr sweep alone uses a validation split carved from train). Differences are paired by seed.", ""]
    if summary.get("arms"):
        lines += ["| arm | n seeds | mean acc (%) | std |", "|---|---|---|---|"]
        for arm, d in summary["arms"].items():
            if "mean" in d:
                lines.append(f"| {arm} | {d['n']} | {d['mean']:.2f} | {d['std']:.2f} |")
            else:  # scaling: per n
                for a, dd in d.items():
                    lines.append(f"| {a} (n={arm}) | {dd['n']} | {dd['mean']:.2f} | {dd['std']:.2f} |")
        lines.append("")
    if summary.get("comparisons"):
        lines += _md_comparisons(summary) + [""]
        lines += [f"Note on {c['arm']} vs {c['baseline']}: {c['note']}." for c in summary["comparisons"] if c.get("note")]
        lines += [""] if any(c.get("note") for c in summary["comparisons"]) else []
    if "lead_grows_with_n" in summary:
        lines += [f"Lead of stiefel-adam over adamw increases monotonically with n: **{summary['lead_grows_with_n']}** "
                  f"(paper: {claims.CIFAR_SCALING_TEXT}).", ""]
    if exp == "movement":
        lines += [f"Paper: {summary['text']}.", "", "| arm | adamw / arm per-step movement: median | min | max | verdict |", "|---|---|---|---|---|"]
        for arm, r in summary["ratios"].items():
            lines.append(f"| {arm} (frame lr {r.get('lr')}) | {r['median']:.3g}x | {r['min']:.3g}x | {r['max']:.3g}x | {r['verdict']} |")
        lines.append("")
        if summary.get("vs_lr"):
            lines += ["The ratio is set by the fixed-step learning rate (a step moves lr x ||m||). From the lr-sweep runs "
                      "(validation split, seeds 0-1), AdamW at its chosen lr over fixed-step SGD:", "",
                      "| SGD frame lr | adamw / stiefel-sgd movement (median) |", "|---|---|"]
            lines += [f"| {row['sgd_frame_lr']:g} | {row['median_ratio']:.3g}x |" for row in summary["vs_lr"]]
            lines.append("")
    if exp == "lr-sweep":
        lines += ["| arm | learning rate | mean val acc (%) | n |", "|---|---|---|---|"]
        for row in summary["grid"]:
            lines.append(f"| {row['arm']} | {row['which_lr']}={row['lr']:g} | {row['mean']:.2f} | {row['n']} |")
        lines += ["", "Chosen (highest mean validation accuracy): " + ", ".join(
            f"{a}: {r['which_lr']}={r['lr']:g}" for a, r in summary["chosen"].items()), ""]
    for plot in summary.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"


def _save(fig, out_dir: Path, name: str, made: list[str], dpi: int = 120) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=dpi)
    plt.close(fig)
    made.append(name)


def _plots(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []
    exp = summary["experiment"]
    comps = summary.get("comparisons", [])
    if exp in ("main", "ablation", "eps") and comps:
        fig, ax = plt.subplots(figsize=(7, 0.6 * len(comps) + 1.5))
        for i, c in enumerate(comps):
            ax.scatter(c["diffs"], [i] * len(c["diffs"]), s=14, alpha=0.7, color="tab:blue")
            lo, hi = c["ci95"]
            ax.plot([lo, hi], [i, i], color="black", lw=2)
            ax.plot([c["mean_diff"]], [i], "k|", ms=14)
            if c.get("paper") is not None:
                ax.plot([c["paper"]], [i], "r*", ms=10, label="paper" if i == 0 else None)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set_yticks(range(len(comps)), [f"{c['arm']} − {c['baseline']}" for c in comps])
        ax.set_xlabel("paired test-accuracy difference (pp)\ndots: seeds; bar: mean and 95% CI; red star: paper")
        ax.invert_yaxis()
        _save(fig, out_dir, "paired_differences.png", made)
    if exp == "eps" and summary.get("arms"):
        pts = sorted((float(k.split("=")[1]), v) for k, v in summary["arms"].items())
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.errorbar([p[0] for p in pts], [p[1]["mean"] for p in pts], yerr=[p[1]["std"] for p in pts], marker="o", capsize=3)
        ax.set_xscale("log")
        ax.set_xlabel("StiefelAdam eps")
        ax.set_ylabel("test accuracy (%), mean ± std over seeds")
        _save(fig, out_dir, "accuracy_vs_eps.png", made)
    if exp == "scaling" and summary.get("arms"):
        fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 3.8))
        for arm in ("adamw", "stiefel-adam"):
            pts = [(int(n), d[arm]) for n, d in summary["arms"].items() if arm in d]
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1]["mean"] for p in pts], yerr=[p[1]["std"] for p in pts], marker="o", capsize=3, label=arm)
        ax.set_xscale("log")
        ax.set_xlabel("training images n")
        ax.set_ylabel("test accuracy (%), mean ± std")
        ax.legend()
        # the claim is about the paired lead, which the absolute curves hide at this scale
        comps = sorted(summary["comparisons"], key=lambda c: c["n_train"])
        ns = [c["n_train"] for c in comps]
        means = [c["mean_diff"] for c in comps]
        errs = [[m - c["ci95"][0] for m, c in zip(means, comps)], [c["ci95"][1] - m for m, c in zip(means, comps)]]
        dx.errorbar(ns, means, yerr=errs, marker="o", capsize=3, label="measured (95% CI)")
        for n_seeds, c in ((c["n_seeds"], c) for c in comps):
            dx.annotate(f"{n_seeds} seeds", (c["n_train"], c["mean_diff"]), textcoords="offset points", xytext=(6, -12), fontsize=7)
        paper = sorted(claims.CIFAR_SCALING_PAPER.items())
        dx.plot([n for n, _ in paper], [v for _, v in paper], "r^--", label="paper")
        dx.axhline(0.0, color="grey", lw=0.8)
        dx.set_xscale("log")
        dx.set_xlabel("training images n")
        dx.set_ylabel("stiefel-adam − adamw (pp), paired")
        dx.legend()
        fig.tight_layout()
        _save(fig, out_dir, "accuracy_vs_n.png", made)
    if exp == "movement" and summary.get("ratios"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for arm, r in summary["ratios"].items():
            per = r["per_epoch"]
            k = min(len(s) for s in per)
            xs = list(range(1, k + 1))
            med = [sorted(s[i] for s in per)[len(per) // 2] for i in range(k)]
            ax.fill_between(xs, [min(s[i] for s in per) for i in range(k)], [max(s[i] for s in per) for i in range(k)], alpha=0.25)
            ax.plot(xs, med, marker="o", label=f"adamw / {arm}")
        lo, hi = claims.CIFAR_MOVEMENT_PAPER
        ax.axhspan(lo, hi, color="red", alpha=0.1, label="paper 24–40x")
        ax.set_yscale("log")
        ax.set_xlabel("evaluation point (every eval_every epochs)")
        ax.set_ylabel("per-step Q/K movement ratio")
        ax.legend()
        _save(fig, out_dir, "movement_ratio.png", made)
    return made


def _write_report(out_dir, experiment: str, summary: dict, make_plots, to_markdown, profile: str,
                  n_planned: int | None = None) -> dict:
    """summary.json, summary.md and plots for one experiment, under out_dir/<experiment>/."""
    exp_dir = Path(out_dir) / experiment
    exp_dir.mkdir(parents=True, exist_ok=True)
    summary["profile"] = profile
    summary["n_planned"] = n_planned
    summary["plots"] = make_plots(summary, exp_dir) if summary["n_records"] else []
    write_json_atomic(exp_dir / "summary.json", summary)
    (exp_dir / "summary.md").write_text(to_markdown(summary, profile))
    return summary


def write_cifar_report(out_dir: str | Path, experiment: str, records: list[dict], profile: str,
                       n_planned: int | None = None, sweep_records: list[dict] | None = None) -> dict:
    summary = cifar_summary(experiment, records)
    if experiment == "movement":
        summary["vs_lr"] = movement_vs_lr(sweep_records or [])
    return _write_report(out_dir, experiment, summary, _plots, summary_markdown, profile, n_planned)


# ---------------------------------------------------------------------------------------------
# Grokking
# ---------------------------------------------------------------------------------------------


def grok_summary(experiment: str, records: list[dict]) -> dict:
    """Per-arm outcomes and, for the study, paired tests (stiefel-adam - adamw) per operation."""
    summary: dict = {"experiment": experiment, "n_records": len(records), "runs": []}
    for rec in sorted(records, key=lambda r: (r["config"]["op"], r["config"]["arm"], r["config"]["seed"])):
        c, m = rec["config"], rec["metrics"]
        summary["runs"].append({"arm": c["arm"], "seed": c["seed"], "op": c["op"], "epochs": c["epochs"],
                                "final_val_acc": 100 * m["final_val_acc"], "epoch_val_acc_95": m["epoch_val_acc_95"],
                                "max_val_acc": 100 * max(rec["curves"]["val_acc"], default=0.0),
                                "max_qk_isometry": m["max_qk_isometry"], "collapses": m["collapses"],
                                "epochs_per_s": rec["timings"]["epochs_per_s"], "total_s": rec["timings"].get("total_s")})
    if experiment == "single":
        summary["paper"] = claims.GROK_SINGLE
    elif experiment == "study":
        summary["paper_text"] = claims.GROK_STUDY_TEXT
        summary["studies"] = {}
        for op in sorted({r["op"] for r in summary["runs"]}):
            table = {arm: {r["seed"]: r for r in summary["runs"] if r["op"] == op and r["arm"] == arm} for arm in ("adamw", "stiefel-adam")}
            seeds = sorted(set(table["adamw"]) & set(table["stiefel-adam"]))
            if not seeds:
                continue
            # A run that never reaches 95% is censored at its last epoch (+1): the comparison then
            # understates how much slower it was, which we report alongside.
            def grok_epoch(r):
                return r["epoch_val_acc_95"] if r["epoch_val_acc_95"] is not None else r["epochs"] + 1
            st_epoch = paired_comparison([grok_epoch(table["stiefel-adam"][s]) for s in seeds], [grok_epoch(table["adamw"][s]) for s in seeds])
            st_acc = paired_comparison([table["stiefel-adam"][s]["final_val_acc"] for s in seeds], [table["adamw"][s]["final_val_acc"] for s in seeds])
            never = {arm: sum(table[arm][s]["epoch_val_acc_95"] is None for s in seeds) for arm in table}
            summary["studies"][op] = {"seeds": seeds, "never_grokked": never, "epoch_to_95": st_epoch, "final_val_acc": st_acc,
                                      "verdict": _study_verdict(st_epoch, st_acc, never)}
    elif experiment == "slingshot":
        summary["paper"] = claims.GROK_SLINGSHOT
        summary["pilots"] = {}
        for op in sorted({r["op"] for r in summary["runs"]}, key=_slingshot_order):
            config = next(rec["config"] for rec in records if rec["config"]["op"] == op)
            summary["pilots"][op] = _slingshot_pilot([r for r in summary["runs"] if r["op"] == op], config)
    return summary


def _single_verdict(runs: list[dict], paper: dict) -> str:
    """One seed gives an ordering and two endpoints, not an effect size: say whether the ordering and
    the Stiefel arm's endpoint (>= GROK_THRESHOLD) match the paper's, and how far each arm is from its number."""
    acc = {r["arm"]: r["final_val_acc"] for r in runs}
    if set(acc) != {"adamw", "stiefel-adam"}:
        return "incomplete: needs both arms"
    same_order = (acc["stiefel-adam"] > acc["adamw"]) == (paper["stiefel-adam"] > paper["adamw"])
    holds = acc["stiefel-adam"] >= 100 * GROK_THRESHOLD
    gaps = ", ".join(f"{arm} {acc[arm]:.1f}% vs paper {paper[arm]:.1f}%" for arm in ("stiefel-adam", "adamw"))
    if same_order and holds:
        head = "ordering replicates (one seed, no test; the study is the test)"
    elif same_order:
        head = "ordering replicates, but the Stiefel arm does not hold >= 95%"
    else:
        head = "does not replicate: the baseline ends ahead"
    return f"{head}: {gaps}"


def _slingshot_order(op: str) -> int:
    from .experiments.grok import SLINGSHOT_OPS

    return SLINGSHOT_OPS.index(op) if op in SLINGSHOT_OPS else len(SLINGSHOT_OPS)


def _slingshot_pilot(runs: list[dict], c: dict) -> dict:
    """One pilot (one op): its conditions, the isometry ratio and the two-part verdict."""
    pilot: dict = {"conditions": (f"(a {c['op']} b) mod {c['model']['p']}, train fraction {c['train_fraction']}, "
                                  f"{c['epochs']} full-batch epochs, lr {c['lr']:g} (frames {c['frame_lr']:g}), betas {tuple(c['betas'])}, "
                                  f"weight decay {c['weight_decay']:g} on "
                                  f"{'every parameter except W_Q, W_K' if c['regularize'] == 'non-qk' else c['regularize']}")}
    iso = {r["arm"]: r["max_qk_isometry"] for r in runs}
    if "adamw" in iso and "stiefel-adam" in iso and iso["stiefel-adam"] > 0:
        pilot["isometry_ratio"] = iso["adamw"] / iso["stiefel-adam"]
    if "adamw" in iso:
        # ||W^T W - I||_F of r unit columns is largest, sqrt(r(r-1)), when they are all parallel.
        r = c["model"]["head_dim"]
        pilot["parallel_columns_error"] = math.sqrt(r * (r - 1))
        pilot["unconstrained_isometry"] = iso["adamw"]
    stiefel = [r for r in runs if r["arm"] == "stiefel-adam"]
    if stiefel:
        pilot["verdict"] = "stable grokking " + _slingshot_verdict(stiefel[0])
        if "isometry_ratio" in pilot:
            ratio = pilot["isometry_ratio"]
            pilot["verdict"] += (f"; isometry error >= 10^6 x lower: {'holds' if ratio >= 1e6 else 'does not hold'} "
                                 f"(ratio {ratio:.1e}; the constraint guarantees it)")
    return pilot


def _slingshot_verdict(run: dict) -> str:
    """'Stable grokking': the Stiefel arm reaches 95% validation accuracy and every collapse after
    that is survived (validation accuracy back at >= 95% before the next one)."""
    if run["epoch_val_acc_95"] is None:
        return (f"does not replicate, the Stiefel arm never groks (best val acc {run['max_val_acc']:.1f}% in "
                f"{run['epochs']} epochs), so there is no grokked state for a collapse to spare")
    after = [c for c in run["collapses"] if c["epoch"] > run["epoch_val_acc_95"]]
    lost = sum(not c["survived"] for c in after)
    if lost:
        return f"does not replicate, the Stiefel arm groks at epoch {run['epoch_val_acc_95']} but loses it in {lost} of {len(after)} later collapses"
    return f"replicates, the Stiefel arm groks at epoch {run['epoch_val_acc_95']} and survives all {len(after)} later collapses"


def _study_verdict(st_epoch: dict, st_acc: dict, never: dict | None = None) -> str:
    """The paper's claim: the constrained arm does NOT grok better; the baseline wins (p=0.019).

    With n pairs the exact two-sided Wilcoxon p cannot go below 2 / 2^n (0.0625 for 5 pairs), so a
    5-seed study where every pair goes one way and the t-test is significant is reported as such,
    with that floor named, rather than as "no difference".
    """
    n = st_epoch["n_seeds"]
    if n < 2:
        return "too few seeds to test"
    if never and all(v == n for v in never.values()):
        # Epochs-to-95% carries no information; final accuracy still says which arm is ahead.
        said = f"untestable here: neither arm reaches 95% validation accuracy in any of {n} seeds"
        if st_acc["mean_diff"] != 0:
            ahead, wins = ("the Stiefel arm", st_acc["wins"]) if st_acc["mean_diff"] > 0 else ("the baseline", st_acc["losses"])
            said += (f"; final val acc: {ahead} ahead in {wins}/{n} seeds, "
                     f"{st_acc['mean_diff']:+.1f} pp, p_t={_fmt_p(st_acc['p_t'])}")
        return said
    faster = st_epoch["mean_diff"] < 0  # stiefel reaches 95% in fewer epochs
    who = "the Stiefel arm" if faster else "the baseline"
    wins = st_epoch["losses"] if faster else st_epoch["wins"]  # fewer epochs is a win
    if st_epoch["supported"]:
        said = f"{who} groks significantly faster (both tests, {wins}/{n} seeds)"
    elif wins == n and st_epoch["p_t"] < 0.05:
        said = (f"{who} groks faster in every seed ({n}/{n}, p_t={_fmt_p(st_epoch['p_t'])}; the Wilcoxon p "
                f"{_fmt_p(st_epoch['p_wilcoxon'])} is the smallest {n} pairs allow)")
    else:
        return "partly replicates: no significant difference in epochs to 95% (the paper reports a significant baseline win)"
    return ("does not replicate: " if faster else "replicates: ") + said


def grok_markdown(summary: dict, profile: str) -> str:
    exp = summary["experiment"]
    lines = [f"# Grokking (modular arithmetic) — `{exp}`, profile `{profile}`", "",
             f"{summary['n_records']} finished runs" + (f" of {summary['n_planned']} planned." if summary.get("n_planned") else "."), "",
             "| op | arm | seed | epochs | final val acc (%) | best val acc (%) | epoch val acc >= 95% | max Q/K isometry error | collapses (survived) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        cols = r["collapses"]
        lines.append(f"| {r['op']} | {r['arm']} | {r['seed']} | {r['epochs']} | {r['final_val_acc']:.1f} | {r.get('max_val_acc', math.nan):.1f} | "
                     f"{r['epoch_val_acc_95'] if r['epoch_val_acc_95'] is not None else 'never'} | {r['max_qk_isometry']:.1e} | "
                     f"{len(cols)} ({sum(c['survived'] for c in cols)}) |")
    lines.append("")
    rates = [r["epochs_per_s"] for r in summary["runs"] if r.get("epochs_per_s")]
    walls = [r["total_s"] for r in summary["runs"] if r.get("total_s")]
    if rates and walls:
        lines += [f"Speed as run (the records' own timings): median {statistics.median(rates):.1f} training epochs/s per run; "
                  f"wall-clock per run, evaluation included, median {statistics.median(walls) / 60:.1f} min "
                  f"(range {min(walls) / 60:.1f}-{max(walls) / 60:.1f}).", ""]
    if exp == "single":
        p = summary["paper"]
        lines += [f"Paper: {p['text']}.", ""]
    if exp == "study":
        lines += [f"Paper: {summary['paper_text']}.", "",
                  "| op | measure | stiefel-adam − adamw (mean) | 95% CI | t | p (t) | p (Wilcoxon) | stiefel wins | never reached 95% (adamw / stiefel) | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for op, st in summary["studies"].items():
            ng = st["never_grokked"]
            for name, s in (("epochs to 95% val acc", st["epoch_to_95"]), ("final val acc (pp)", st["final_val_acc"])):
                wins = (s["losses"] if name.startswith("epochs") else s["wins"])  # fewer epochs is a win
                lines.append(f"| {op} | {name} | {s['mean_diff']:+.1f} | {_fmt_ci(s['ci95'], 1)} | {_fmt_t(s['t'])} | {_fmt_p(s['p_t'])} | "
                             f"{_fmt_p(s['p_wilcoxon'])} | {wins}/{s['n_seeds']} | {ng['adamw']} / {ng['stiefel-adam']} | "
                             f"{st['verdict'] if name.startswith('epochs') else ''} |")
        lines += ["", "A run that never reaches 95% enters the epoch comparison as its epoch budget + 1, a lower bound on "
                  "its true time, so a gap involving such runs is understated.", ""]
    if exp == "slingshot":
        lines += [f"Paper: {summary['paper']['text']}.", "",
                  "Stable grokking: reach 95% validation accuracy and get back to it after every later collapse. "
                  "Collapse: a train-loss spike > 10x its running minimum after the training set is fitted. "
                  "Survived: validation accuracy back at >= 95% before the next collapse, so in a run that never "
                  "reaches 95% no collapse can be survived.", ""]
        for op, pilot in summary["pilots"].items():
            lines += [f"### Pilot (a {op} b)", "", f"Conditions: {pilot['conditions']}.", ""]
            if pilot.get("verdict"):
                lines += [f"Verdict: **{pilot['verdict']}**.", ""]
            if "isometry_ratio" in pilot:
                lines += [f"Measured: max Q/K isometry error, unconstrained / Stiefel = {pilot['isometry_ratio']:.1e} "
                          "(frames are orthonormal to float32 round-off by construction, so a ratio of this order is expected "
                          "whenever the unconstrained Q/K drift at all).", ""]
            if "unconstrained_isometry" in pilot:
                lines += [f"The unconstrained value, {pilot['unconstrained_isometry']:.2f}, is "
                          f"{100 * pilot['unconstrained_isometry'] / pilot['parallel_columns_error']:.1f}% of sqrt(r(r-1)) = "
                          f"{pilot['parallel_columns_error']:.2f}, the error of a head whose r columns are all parallel: "
                          "its Q/K heads are close to rank one. In a 1-layer model the query is read only at the '=' position, "
                          "whose input is the same for every equation, so every gradient of W_Q and of W_K is rank one "
                          "(tests/test_grok.py checks this). The ratio measures that drift, which the unconstrained arm "
                          "shows from its first few hundred epochs, before any slingshot cycle (curves.png).", ""]
            runs = [r for r in summary["runs"] if r["op"] == op]
            for r in runs:
                for c in r["collapses"]:
                    lines.append(f"- {r['arm']}: collapse at epoch {c['epoch']}: train loss {c['train_loss_before']:.1e} -> "
                                 f"{c['train_loss_peak']:.1e}, val acc {100 * (c['val_acc_before'] or 0):.1f}% -> "
                                 f"{100 * c['val_acc_min']:.1f}%, survived: {c['survived']}")
            if not any(r["collapses"] for r in runs):
                lines.append("No collapse occurred in these runs.")
            lines.append("")
    for plot in summary.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"


def _grok_plots(summary: dict, records: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:orange", "stiefel-adam": "tab:blue"}
    ops = sorted({r["config"]["op"] for r in records})
    fig, axes = plt.subplots(2, len(ops), figsize=(5.5 * len(ops), 6.5), squeeze=False, sharex=True)
    for j, op in enumerate(ops):
        for rec in records:
            if rec["config"]["op"] != op:
                continue
            c, arm = rec["curves"], rec["config"]["arm"]
            kw = dict(color=colors.get(arm, "gray"), alpha=0.8, lw=1)
            axes[0][j].plot(c["epoch"], [100 * v for v in c["val_acc"]], **kw, label=f"{arm} s{rec['config']['seed']}")
            axes[1][j].plot(c["epoch"], [max(v, 1e-12) for v in c["qk_isometry"]], **kw)
        axes[0][j].set_title(f"(a {op} b) mod p")
        axes[0][j].set_ylabel("validation accuracy (%)")
        axes[1][j].set_ylabel("Q/K isometry error")
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("epoch")
        axes[0][j].set_xscale("log")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(handles) <= 12:
        axes[0][0].legend(fontsize=7)
    made: list[str] = []
    _save(fig, out_dir, "curves.png", made, dpi=110)
    if summary["experiment"] == "slingshot":
        fig, axes = plt.subplots(1, len(ops), figsize=(7 * len(ops), 3.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            for rec in records:
                if rec["config"]["op"] == op:
                    c = rec["curves"]
                    ax.plot(c["epoch"], c["train_loss"], color=colors.get(rec["config"]["arm"]), label=rec["config"]["arm"], lw=1)
            ax.set_title(f"(a {op} b) mod p")
            ax.set_yscale("log")
            ax.set_xlabel("epoch")
            ax.set_ylabel("train loss (spikes = slingshot collapses)")
            ax.legend()
        _save(fig, out_dir, "train_loss.png", made, dpi=110)
    return made


def write_grok_report(out_dir: str | Path, experiment: str, records: list[dict], profile: str,
                      n_planned: int | None = None) -> dict:
    plots = lambda summary, exp_dir: _grok_plots(summary, records, exp_dir)  # noqa: E731 - needs the curves
    return _write_report(out_dir, experiment, grok_summary(experiment, records), plots, grok_markdown, profile, n_planned)


# ---------------------------------------------------------------------------------------------
# Everything at once: rebuild every summary from the run records, and the claim-by-claim README
# ---------------------------------------------------------------------------------------------


def _experiment_records(family: str, exp: str, profile: str, seeds: int, by_key: dict[str, dict]) -> list[dict]:
    """The records of one experiment, by the keys of the cells it plans.

    A CIFAR experiment other than `scaling` compares arms at ONE n (the profile's, or another one
    chosen with --n): the records of each n are a separate experiment and must never be pooled
    (the scaling runs at n=1k share arms and seeds with `main`). The profile's n wins; failing
    that, the n with the most records.
    """
    from .experiments import cifar, grok

    if family == "grok":
        return [by_key[c.key] for c in grok.cells(exp, profile, seeds) if c.key in by_key]
    if exp == "scaling":
        return [by_key[c.key] for c in cifar.cells(exp, profile, seeds) if c.key in by_key]
    sizes = sorted({r["config"]["n_train"] for r in by_key.values() if r["config"]["profile"] == profile})
    groups = {n: [by_key[c.key] for c in cifar.cells(exp, profile, seeds, n=n) if c.key in by_key] for n in sizes}
    n_main = cifar.PROFILES[profile]["n_main"]
    if groups.get(n_main):
        return groups[n_main]
    return max(groups.values(), key=len, default=[])


def rebuild_all(results_dir: str | Path) -> list[Path]:
    """Recompute every experiment's summary from results_dir/{cifar,grok}/runs/*.json alone."""
    from .experiments import cifar, grok

    results_dir = Path(results_dir)
    written = []
    for family, module, writer in (("cifar", cifar, write_cifar_report), ("grok", grok, write_grok_report)):
        by_key = {r["key"]: r for r in load_records(results_dir / family / "runs", family)}
        profiles = sorted({r["config"]["profile"] for r in by_key.values()})
        if len(profiles) > 1:  # their summaries would overwrite each other
            raise ValueError(f"{results_dir / family / 'runs'} mixes records of profiles {', '.join(profiles)}; "
                             "keep one profile per results folder (move one set of records out) and report each folder")
        for profile in profiles:
            mine = [r for r in by_key.values() if r["config"]["profile"] == profile]
            seeds = 1 + max(r["config"]["seed"] for r in mine)
            for exp in module.EXPERIMENTS:
                finished = _experiment_records(family, exp, profile, seeds, by_key)
                if not finished:
                    continue
                default = (cifar.cells(exp, profile, cifar.default_seeds(exp, profile), per_n_seeds=True) if family == "cifar"
                           else module.cells(exp, profile, module.DEFAULT_SEEDS[exp]))
                planned = len({c.key for c in default})
                if family == "cifar" and exp == "movement":
                    sweep = [by_key[c.key] for c in cifar.cells("lr-sweep", profile, seeds) if c.key in by_key]
                    writer(results_dir / family, exp, finished, profile, planned, sweep_records=sweep)
                else:
                    writer(results_dir / family, exp, finished, profile, planned)
                written.append(results_dir / family / exp / "summary.json")
    written += write_claims_report(results_dir)
    return written


def _ci(c: dict) -> str:
    return f"{c['mean_diff']:+.2f} pp {_fmt_ci(c['ci95'])}, t={_fmt_t(c['t'])}, p_t={_fmt_p(c['p_t'])}, p_W={_fmt_p(c['p_wilcoxon'])}, {c['wins']}/{c['n_seeds']} wins"


def claim_rows(results_dir: str | Path) -> list[tuple[str, str, str, str, str, str]]:
    """(experiment link, profile, claim, measured, verdict, plot links), one row per claim, from the
    summary.json files under results_dir/<family>/<experiment>/."""
    results_dir = Path(results_dir)
    rows = []
    for path in sorted(results_dir.glob("*/*/summary.json")):
        s = json.loads(path.read_text())
        family, exp = path.parent.parent.name, path.parent.name
        done = f" ({s['n_records']}/{s['n_planned']} runs)" if s.get("n_planned") else ""
        link = f"[{family}/{exp}]({family}/{exp}/summary.md){done}"
        prof = s.get("profile", "?")
        plots = ", ".join(f"[{Path(p).stem}]({family}/{exp}/{Path(p).name})" for p in s.get("plots", [])) or "—"
        rows_before = len(rows)
        if family == "cifar" and exp == "lr-sweep":
            chosen = ", ".join(f"{a}: {r['which_lr']}={r['lr']:g}" for a, r in s["chosen"].items())
            rows.append((link, prof, "(learning-rate choice, validation split)", chosen, "—"))
        for c in s.get("comparisons", []):
            if c.get("kind") == "control" and "n_train" not in c:  # scaling: every n is shown
                continue
            name = f"{c['arm']} vs {c['baseline']}" + (f", n={c['n_train']}" if "n_train" in c else "")
            rows.append((link, prof, f"{name}: {c['text']}", _ci(c), c["verdict"]))
        if "lead_grows_with_n" in s:
            rows.append((link, prof, claims.CIFAR_SCALING_TEXT, f"lead increases monotonically with n: {s['lead_grows_with_n']}",
                         "replicates" if s["lead_grows_with_n"] else "does not replicate"))
        for arm, r in s.get("ratios", {}).items():
            if arm == "stiefel-sgd":
                rows.append((link, prof, s["text"], f"median {r['median']:.3g}x (range {r['min']:.3g}-{r['max']:.3g}x) at SGD frame lr {r.get('lr')}", r["verdict"]))
        if family == "grok" and exp == "single" and s["runs"]:
            got = ", ".join(f"{r['arm']} {r['final_val_acc']:.1f}% at epoch {r['epochs']}" for r in s["runs"])
            rows.append((link, prof, s["paper"]["text"], got, _single_verdict(s["runs"], s["paper"]["paper"])))
        for op, st in s.get("studies", {}).items():
            e = st["epoch_to_95"]
            got = (f"stiefel-adam − adamw epochs to 95% val acc: {e['mean_diff']:+.0f} {_fmt_ci(e['ci95'], 0)}, p_t={_fmt_p(e['p_t'])}, "
                   f"p_W={_fmt_p(e['p_wilcoxon'])}, stiefel faster in {e['losses']}/{e['n_seeds']}; never reached 95%: "
                   f"adamw {st['never_grokked']['adamw']}, stiefel {st['never_grokked']['stiefel-adam']}")
            rows.append((link, prof, f"op {op}: {s['paper_text']}", got, st["verdict"]))
        for op, pilot in s.get("pilots", {}).items():
            runs = [r for r in s["runs"] if r["op"] == op]
            got = "; ".join(f"{r['arm']}: {len(r['collapses'])} collapses, {sum(c['survived'] for c in r['collapses'])} survived"
                            for r in runs)
            if "isometry_ratio" in pilot:
                got += f"; isometry ratio {pilot['isometry_ratio']:.1e}"
            best = ", ".join(f"{r['arm']} best val acc {r['max_val_acc']:.1f}%" for r in runs)
            rows.append((link, prof, f"op {op}: {s['paper']['text']}", f"{got}; {best}", pilot.get("verdict", "pilot: see summary")))
        rows[rows_before:] = [(*row, plots) for row in rows[rows_before:]]
    return rows


CLAIMED_EXPERIMENTS = (("cifar", ("main", "scaling", "ablation", "eps", "movement")), ("grok", ("single", "study", "slingshot")))


def write_claims_report(results_dir: str | Path) -> list[Path]:
    """<dir>/REPORT.md (each claim: paper, measured with CI, verdict, plots) and a short <dir>/README.md."""
    results_dir = Path(results_dir)
    rows = claim_rows(results_dir)
    profiles = sorted({r[1] for r in rows})
    cmd = f"stiefel-attention report {results_dir.as_posix()}"
    missing = [f"{f}/{e}" for f, exps in CLAIMED_EXPERIMENTS for e in exps if not (results_dir / f / e / "summary.json").exists()]
    unfinished = ("Not yet run (no records): " + ", ".join(missing) + ". ") if missing else ""
    profile = profiles[0] if profiles else "cpu"
    finish = (unfinished + "An experiment with fewer runs than planned completes with its own command, e.g. "
              f"`stiefel-attention grok --experiment study --profile {profile} --out {(results_dir / 'grok').as_posix()}` "
              f"(finished runs are skipped), or with `stiefel-attention reproduce --profile {profile}`; then `{cmd}`.")
    lines = ["# The paper's claims, measured", "",
             f"Generated by `{cmd}` from the run records under `*/runs/` alone; every number below comes "
             "from those files. CIFAR-10 is the JPEG mirror of the full dataset; the profile column says "
             "which model size ran (`cpu`: a small model, so absolute accuracies are a small model's). Each "
             "comparison is paired over seeds: mean difference, t-based 95% CI, paired t and Wilcoxon p, "
             "wins. A claim is called replicated only where both tests support it.", "",
             "| experiment | profile | claim (paper) | measured | verdict | plots |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", finish]
    report = results_dir / "REPORT.md"
    report.write_text("\n".join(lines) + "\n")
    glance = ["# Results", "",
              f"Run records (`cifar/runs`, `grok/runs`: one JSON per finished run, with its resolved config and "
              f"code version), per-experiment `summary.json`/`summary.md`/plots, and [`REPORT.md`](REPORT.md): "
              f"every claim of the paper beside what we measured, with confidence intervals and plots. All of it is "
              f"rebuilt from the records by `{cmd}`.", "", "Verdicts at a glance (numbers in REPORT.md):", ""]
    glance += [f"- {claim} — **{verdict_}**" for _, _, claim, _, verdict_, _ in rows if verdict_ != "—"]
    glance += ["", finish]
    readme = results_dir / "README.md"
    readme.write_text("\n".join(glance) + "\n")
    return [report, readme]
