"""Records -> summary.json -> summary.md + PNG plots -> REPORT.md: the parts every family shares.

Everything here is computed from run records alone (the JSON files under runs/), so a report
can be rebuilt at any time, and partially finished experiments report what they have. Each
family's own summary, markdown and plots live beside it (`cifar_report.py`, `grok_report.py`);
this module writes them, rebuilds every family's summaries, and gathers the claim rows into
REPORT.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from .family import Plan, all_families, get_family
from .fmt import fmt_ci, fmt_p, fmt_t
from .geometry import geometry_section, mechanism_section, verdicts_by_testbed
from .records import read_record, write_json_atomic

__all__ = [
    "load_records",
    "profiles_in",
    "verdict",
    "write_experiment",
    "rebuild_all",
    "rebuild_family",
    "claim_rows",
    "comparison_rows",
    "write_claims_report",
]


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


def write_experiment(
    out_dir, experiment: str, summary: dict, make_plots, to_markdown, profile: str, plan: Plan | None = None
) -> dict:
    """summary.json, summary.md and plots for one experiment, under out_dir/<experiment>/."""
    exp_dir = Path(out_dir) / experiment
    exp_dir.mkdir(parents=True, exist_ok=True)
    summary["profile"] = profile
    summary["n_planned"] = plan.total if plan else None
    summary["n_planned_done"] = plan.done if plan else None
    if plan and plan.done < plan.total and len(plan.by_arm) > 1:  # which arms have run, while the plan is open
        summary["planned_by_arm"] = {arm: [done, total] for arm, done, total in plan.by_arm}
    summary["plots"] = make_plots(summary, exp_dir) if summary["n_records"] else []
    write_json_atomic(exp_dir / "summary.json", summary)
    (exp_dir / "summary.md").write_text(to_markdown(summary, profile))
    return summary


def rebuild_family(family_dir: str | Path, family) -> list[Path]:
    """Recompute every summary of one family's folder (<family_dir>/runs/*.json) from its records alone."""
    family_dir = Path(family_dir)
    runs = family_dir / "runs"
    by_key = {r["key"]: r for r in load_records(runs, family.name)}
    signatures = sorted({(r["config"]["profile"], r["config"].get("data_sha256") or "") for r in by_key.values()})
    profiles = sorted({p for p, _ in signatures})
    if len(profiles) > 1:  # their summaries would overwrite each other
        raise ValueError(
            f"{runs} mixes records of profiles {', '.join(profiles)}; "
            "keep one profile per results folder (move one set of records out) and report each folder"
        )
    if len(signatures) > 1:
        raise ValueError(
            f"{runs} mixes records made from {len(signatures)} different datasets; keep one dataset per results "
            "folder (move one set of records out) and report each folder"
        )
    written = []
    for profile in profiles:
        for exp in family.experiments:
            finished = family.experiment_records(exp, profile, by_key)
            if not finished:
                continue
            family.write_summary(family_dir, exp, finished, profile, family.plan(exp, profile, finished), by_key)
            written.append(family_dir / exp / "summary.json")
    return written


def rebuild_all(results_dir: str | Path, beside: Sequence[str | Path] = ()) -> list[Path]:
    """Recompute every experiment's summary from results_dir/<family>/runs/*.json alone, then REPORT.md (with the
    summaries of the results folders `beside`, as they are, set against this folder's where it compares them)."""
    results_dir = Path(results_dir)
    written = []
    for family in all_families():
        written += rebuild_family(results_dir / family.name, family)
    written += write_claims_report(results_dir, beside)
    return written


def fmt_comparison(c: dict) -> str:
    return (
        f"{c['mean_diff']:+.2f} pp {fmt_ci(c['ci95'])}, t={fmt_t(c['t'])}, p_t={fmt_p(c['p_t'])}, "
        f"p_W={fmt_p(c['p_wilcoxon'])}, {c['wins']}/{c['n_seeds']} wins"
    )


def claim_rows(results_dir: str | Path) -> list[tuple[str, str, str, str, str, str]]:
    """(experiment link, profile, claim, measured, verdict, plot links), one row per claim, from the
    summary.json files under results_dir/<family>/<experiment>/."""
    results_dir = Path(results_dir)
    rows = []
    for path in sorted(results_dir.glob("*/*/summary.json")):
        s = json.loads(path.read_text())
        family, exp = path.parent.parent.name, path.parent.name
        done = f" ({s['n_planned_done']}/{s['n_planned']} runs)" if s.get("n_planned") else ""
        link = f"[{family}/{exp}]({family}/{exp}/summary.md){done}"
        prof = s.get("profile", "?")
        plots = ", ".join(f"[{Path(p).stem}]({family}/{exp}/{Path(p).name})" for p in s.get("plots", [])) or "—"
        mine = get_family(family).claim_rows(exp, s, link, prof)
        rows += [(*row, plots) for row in mine]
    return rows


def write_claims_report(results_dir: str | Path, beside: Sequence[str | Path] = ()) -> list[Path]:
    """<dir>/REPORT.md (each claim: paper, measured with CI, verdict, plots) and a short <dir>/README.md.
    beside: results folders of other profiles whose rows "When does the geometry dominate?" sets beside this one's."""
    results_dir = Path(results_dir)
    beside = [Path(b) for b in beside]
    rows = claim_rows(results_dir)
    profiles = sorted({r[1] for r in rows})
    cmd = f"stiefel-attention report {results_dir.as_posix()}" + "".join(f" --beside {b.as_posix()}" for b in beside)
    missing = [
        f"{f.name}/{e}"
        for f in all_families()
        for e in f.claimed
        if not (results_dir / f.name / e / "summary.json").exists()
    ]
    unfinished = ("Not yet run (no records): " + ", ".join(missing) + ". ") if missing else ""
    profile = profiles[0] if profiles else "cpu"
    finish = (
        unfinished + "An experiment with fewer runs than planned completes with its own command, e.g. "
        f"`stiefel-attention grok --experiment study --profile {profile} --out {(results_dir / 'grok').as_posix()}` "
        f"(finished runs are skipped), or with `stiefel-attention reproduce --profile {profile}`; then `{cmd}`."
    )
    lines = [
        "# The paper's claims, measured",
        "",
        f"Generated by `{cmd}` from the run records under `*/runs/` alone; every number below comes "
        "from those files. CIFAR-10 is the JPEG mirror of the full dataset; the profile column says "
        "which model size ran (`cpu`: a small model, so absolute accuracies are a small model's). Each "
        "comparison is paired over seeds: mean difference, t-based 95% CI, paired t and Wilcoxon p, "
        "wins. A claim is called replicated only where both tests support it.",
        "",
        "| experiment | profile | claim (paper) | measured | verdict | plots |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", finish]
    testbeds = [(f.name, f.title, f.controls_experiment, f.decay_experiment) for f in all_families()]
    geometry = geometry_section(results_dir, testbeds, beside)
    lines += ["", *geometry] if geometry else []
    mechanism = mechanism_section(results_dir, [(f.name, f.title, f.mechanism_experiment) for f in all_families()])
    lines += mechanism
    report = results_dir / "REPORT.md"
    report.write_text("\n".join(lines) + "\n")
    runs = ", ".join(f"`{f.name}/runs`" for f in all_families() if (results_dir / f.name / "runs").is_dir())
    glance = [
        "# Results",
        "",
        f"Run records ({runs or 'none yet'}: one JSON per finished run, with its resolved config and "
        f"code version), per-experiment `summary.json`/`summary.md`/plots, and [`REPORT.md`](REPORT.md): "
        f"every claim of the paper beside what we measured, with confidence intervals and plots. All of it is "
        f"rebuilt from the records by `{cmd}`.",
        "",
        "Verdicts at a glance (numbers in REPORT.md):",
        "",
    ]
    glance += [f"- {claim} — **{verdict_}**" for _, _, claim, _, verdict_, _ in rows if verdict_ != "—"]
    verdicts = verdicts_by_testbed(results_dir, testbeds)
    if verdicts:
        glance += ["", "When does the geometry dominate? One verdict per testbed (the section of REPORT.md):", ""]
        glance += [f"- {title}: {verdict_}" for title, verdict_ in verdicts]
    glance += ["", finish]
    readme = results_dir / "README.md"
    readme.write_text("\n".join(glance) + "\n")
    return [report, readme]


def comparison_rows(s: dict, link: str, prof: str) -> list[tuple[str, ...]]:
    """REPORT rows of a summary's paired comparisons (controls without a paper number are left out,
    except per-n rows of a scaling experiment, where every n is shown)."""
    rows = []
    for c in s.get("comparisons", []):
        if c.get("kind") == "control" and "n_train" not in c:
            continue
        name = f"{c['arm']} vs {c['baseline']}" + (f", n={c['n_train']}" if "n_train" in c else "")
        rows.append((link, prof, f"{name}: {c['text']}", fmt_comparison(c), c["verdict"]))
    return rows
