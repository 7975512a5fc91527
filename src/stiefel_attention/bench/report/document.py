"""Records -> summary.json -> summary.md + PNG plots -> REPORT.md: the parts every family shares.

Everything here is computed from run records alone (the JSON files under runs/), so a report
can be rebuilt at any time, and partially finished experiments report what they have. Each
family's own summary, markdown and plots live beside it (each family package's report.py);
this module writes them, rebuilds every family's summaries, and gathers the claim rows into
REPORT.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..family import Family, Plan, all_families, get_family
from ..records import Cell, read_record, write_json_atomic
from .factorial import factorial_report_section, testbed_factorials
from .fmt import fmt_ci, fmt_p, fmt_t, open_arms, provisional
from .geometry import (
    bounded_standings,
    geometry_section,
    mechanism_found,
    mechanism_section,
    standings_sentence,
    verdicts_by_testbed,
)
from .summaries import PlanProgress

__all__ = [
    "load_records",
    "profiles_in",
    "verdict",
    "write_experiment",
    "rebuild_all",
    "rebuild_family",
    "Placement",
    "place_records",
    "check_placed",
    "check_current",
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


@dataclass(frozen=True)
class Placement:
    """Which of one family folder's records each experiment's summary takes, and what nothing takes.

    unplaced: records that are cells of no experiment this code plans (an earlier protocol's, or a non-default
    option's such as cifar's --n); stale: summaries under the folder that no experiment would write now. A report
    that wrote past either would drop records or reread an old summary without saying so.
    """

    family: Family
    family_dir: Path
    profile: str | None
    by_key: dict[str, dict]
    experiments: dict[str, list[dict]]
    unplaced: list[dict]
    stale: list[Path]


def place_records(family_dir: str | Path, family: Family, to_come: Sequence[Cell] = ()) -> Placement:
    """Every record of one family's folder (<family_dir>/runs/*.json) sorted into the experiments that take it.
    to_come: cells a command is about to run, placed as if their records were there."""
    family_dir = Path(family_dir)
    runs = family_dir / "runs"
    by_key = {r["key"]: r for r in [*(c.planned_record() for c in to_come), *load_records(runs, family.name)]}
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
    profile = profiles[0] if profiles else None
    experiments = {}
    for exp in family.experiments if profile else ():
        if finished := family.experiment_records(exp, profile, by_key):
            experiments[exp] = finished
    taken = {r["key"] for finished in experiments.values() for r in finished}
    unplaced = [r for key, r in sorted(by_key.items()) if key not in taken]
    stale = [s for s in sorted(family_dir.glob("*/summary.json")) if s.parent.name not in experiments]
    return Placement(family, family_dir, profile, by_key, experiments, unplaced, stale)


def _code_versions(records: list[dict]) -> str:
    return ", ".join(sorted({str(r.get("code_version", "?"))[:7] for r in records}))


def unplaced_line(p: Placement) -> str:
    """One line naming the records of p that no summary takes: how many, which code made them, two examples."""
    names = ", ".join(f"`{r['name']}`" for r in p.unplaced[:2])
    return (
        f"{(p.family_dir / 'runs').as_posix()}: {len(p.unplaced)} of its {len(p.by_key)} records are cells no "
        f"experiment of this code plans at profile {p.profile} (made by code {_code_versions(p.unplaced)}; "
        f"e.g. {names})"
    )


def check_placed(placements: Sequence[Placement], leave_out_unplanned: bool = False) -> None:
    """Refuse (UserError, before anything is written) a report that would drop records or reread an old summary."""
    problems = [
        f"{s.as_posix()}: this code writes no summary there (no experiment it plans takes a record of "
        f"{(p.family_dir / 'runs').as_posix()} for it), so a report would show that file unchanged; delete its "
        "folder or move it out with its records"
        for p in placements
        for s in p.stale
    ]
    unplaced = [p for p in placements if p.unplaced]
    if unplaced and not leave_out_unplanned:
        problems += [
            "; ".join(unplaced_line(p) for p in unplaced) + ". A report would leave them out of every summary: "
            "move them to a results folder of their own, or pass --leave-out-unplanned (REPORT.md then names them)"
        ]
    if problems:
        raise UserError(
            "; ".join(problems) + ". A folder made by an earlier protocol is reported with the code that made it "
            "(git worktree add DIR COMMIT)"
        )


def check_current(results_dir: str | Path) -> None:
    """Refuse (UserError) a results folder whose summaries are not those of its records as they are now: a folder
    read as it is (--beside) must have been rebuilt since its last record, or its rows would be old ones."""
    results_dir = Path(results_dir)
    behind = []
    for family in all_families():
        p = place_records(results_dir / family.name, family)
        behind += [s.relative_to(results_dir).as_posix() + " (no experiment writes it now)" for s in p.stale]
        for exp, finished in p.experiments.items():
            path = p.family_dir / exp / "summary.json"
            n = json.loads(path.read_text()).get("n_records") if path.exists() else None
            if n != len(finished):
                said = "no summary" if n is None else f"its summary covers {n}"
                behind.append(f"{family.name}/{exp} ({len(finished)} records, {said})")
    if behind:
        raise UserError(
            f"--beside {results_dir.as_posix()}: its summaries are behind its records: {', '.join(behind)}; "
            f"rebuild them first (stiefel-attention report {results_dir.as_posix()})"
        )


def write_placed(p: Placement) -> list[Path]:
    """Recompute each summary of one placed family folder from its records alone."""
    written = []
    for exp, finished in p.experiments.items():
        p.family.write_summary(
            p.family_dir, exp, finished, p.profile, p.family.plan(exp, p.profile, finished), p.by_key
        )
        written.append(p.family_dir / exp / "summary.json")
    return written


def rebuild_family(family_dir: str | Path, family: Family, leave_out_unplanned: bool = False) -> list[Path]:
    """Recompute every summary of one family's folder (<family_dir>/runs/*.json) from its records alone."""
    placement = place_records(family_dir, family)
    check_placed([placement], leave_out_unplanned)
    return write_placed(placement)


def rebuild_all(
    results_dir: str | Path, beside: Sequence[str | Path] = (), leave_out_unplanned: bool = False
) -> list[Path]:
    """Recompute every experiment's summary from results_dir/<family>/runs/*.json alone, then REPORT.md (with the
    summaries of the results folders `beside`, as they are, set against this folder's where it compares them).
    Every record is taken by some summary, or the report is refused before anything is written (check_placed)."""
    results_dir = Path(results_dir)
    placements = [place_records(results_dir / family.name, family) for family in all_families()]
    check_placed(placements, leave_out_unplanned)
    for other in beside:
        check_current(other)
    written = [path for p in placements for path in write_placed(p)]
    left_out = [unplaced_line(p) for p in placements if p.unplaced]
    return written + write_claims_report(results_dir, beside, left_out)


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
        progress = PlanProgress.of(s)
        done = f" ({progress.runs()})" if progress.n_planned else ""
        link = f"[{family}/{exp}]({family}/{exp}/summary.md){done}"
        prof = s.get("profile", "?")
        plots = ", ".join(f"[{Path(p).stem}]({family}/{exp}/{Path(p).name})" for p in s.get("plots", [])) or "—"
        mine = get_family(family).claim_rows(exp, s, link, prof)
        rows += [(*row, plots) for row in mine]
    return rows


def write_claims_report(
    results_dir: str | Path, beside: Sequence[str | Path] = (), left_out: Sequence[str] = ()
) -> list[Path]:
    """<dir>/REPORT.md (each claim: paper, measured with CI, verdict, plots) and a short <dir>/README.md.
    beside: results folders of other profiles whose rows "When does the geometry dominate?" sets beside this one's.
    left_out: one line per family folder whose records no summary takes (unplaced_line), said in both files."""
    results_dir = Path(results_dir)
    beside = [Path(b) for b in beside]
    rows = claim_rows(results_dir)
    profiles = sorted({r[1] for r in rows})
    cmd = f"stiefel-attention report {results_dir.as_posix()}" + "".join(f" --beside {b.as_posix()}" for b in beside)
    cmd += " --leave-out-unplanned" if left_out else ""
    left = ["", "Left out of every summary (records of cells this code does not plan):", ""] if left_out else []
    left += [f"- {line}" for line in left_out]
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
    lines += ["", finish, *left]
    testbeds = [(f.name, f.title, f.controls_experiment, f.decay_experiment) for f in all_families()]
    geometry = geometry_section(results_dir, testbeds, beside)
    lines += ["", *geometry] if geometry else []
    mechanism = mechanism_section(
        results_dir,
        mechanism_found(results_dir, all_families()),
        [(f.name, f.title, f.controls_experiment) for f in all_families()],
    )
    lines += mechanism
    tables = [(f.name, f.title, f.factorial_experiments) for f in all_families()]
    factorial = factorial_report_section(results_dir, tables)
    lines += ([""] if lines[-1] else []) + factorial if factorial else []
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
    glance += ["", finish, *left]
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
        said = c["verdict"]
        if c.get("kind") != "control" and c["n_seeds"] >= 2:  # a verdict wants every planned run of both arms
            said = provisional(said, open_arms(s, (c["arm"], c["baseline"])), c["supported"])
        rows.append((link, prof, f"{name}: {c['text']}", fmt_comparison(c), said))
    return rows


# --- the README's "what we found" block --------------------------------------------------------------------------
FINDINGS_START, FINDINGS_END = "<!-- findings:start -->", "<!-- findings:end -->"
# The claims the README names one by one: (experiment folder, the start of its claim text).
HEADLINE_CLAIMS = (("cifar/main", "stiefel-adam vs adamw"), ("grok/single", ""), ("grok/study", "op +"))


def verdict_kind(verdict_text: str) -> str:
    """A claim's verdict in one word: 'replicates', 'direction' (direction replicates, size does not), 'not'
    (does not replicate) or 'other' (untestable, measured only, a partial answer, not decided yet)."""
    text = verdict_text.lstrip("*").lower()
    if text.startswith("does not replicate"):
        return "not"
    if text.startswith("direction replicates"):
        return "direction"
    if text.startswith(("replicates", "ordering replicates")):
        return "replicates"
    return "other"


FOLD_START = "<details><summary>Each testbed's verdict on every arm, and the bounded frames (computed)</summary>"
FOLD_END = "</details>"


def findings_lines(results_dir: str | Path, prefix: str = "results") -> list[str]:
    """The README's block of what was found, computed from the summaries under results_dir (links start with
    prefix, the folder as the README sees it): the claims tallied by verdict, the headline claims, each
    testbed's answer to "when does the geometry dominate?", the mechanism, and each factorial with every cell run.
    A headline claim's verdict is said in its first words (the kind, e.g. "does not replicate"); its reasons are in
    REPORT.md beside it."""
    results_dir = Path(results_dir)
    rows = [r for r in claim_rows(results_dir) if r[4] != "—"]
    paper = [r for r in rows if not r[2].startswith("(not the paper's")]
    kinds = [verdict_kind(r[4]) for r in paper]
    report = f"{prefix}/REPORT.md"
    lines = [
        f"Of the paper's claims measured here ({len(paper)} rows of [the claims table]({report}), "
        f"profile {', '.join(sorted({r[1] for r in paper})) or '?'}): {kinds.count('replicates')} replicate, "
        f"{kinds.count('direction')} replicate in direction but not in size, {kinds.count('not')} do not replicate, "
        f"{kinds.count('other')} are untestable here or measured only.",
        "",
    ]
    for folder, start in HEADLINE_CLAIMS:
        for link, _, claim, measured, said, _ in rows:
            if link.startswith(f"[{folder}]") and claim.startswith(start):
                where = link.replace("](", f"]({prefix}/", 1)
                lines.append(f"- {where}: {claim} — measured {measured}: **{said.split(': ', 1)[0]}**")
                break
    for link, _, claim, _, said, _ in rows:
        if claim.startswith("(not the paper's"):
            where = link.replace("](", f"]({prefix}/", 1)
            lines.append(f"- {where}: {claim.split(') ', 1)[-1]}: **{said}**")
    anchor = f"{report}#when-does-the-geometry-dominate"
    controls = [(f.name, f.title, f.controls_experiment) for f in all_families()]
    for baseline in ("adamw", "qk-norm", "frozen"):  # where the frames help and cost, and whether learning them does
        if said := standings_sentence(results_dir, controls, "stiefel-adam", baseline):
            lines.append(f"- [Where the frames stand]({anchor}): {said}.")
    mechanism = mechanism_section(results_dir, mechanism_found(results_dir, all_families()), controls)
    bounded = []
    if mechanism:
        answers = mechanism[0].split(": ", 1)[-1]
        lines.append(f"- [The mechanism]({anchor.split('#')[0]}#the-mechanism-by-intervention-{_slug(mechanism)}): "
                     f"{answers}")  # fmt: skip
        high = f"{anchor.split('#')[0]}#high-learning-rates-{_slug(mechanism, '### High learning rates: ')}"
        bounded = [f"- [Bounded frames]({high}): {said}." for said in bounded_standings(results_dir, controls)]
    tables = [(f.name, f.title, f.factorial_experiments) for f in all_families()]
    for t in testbed_factorials(results_dir, tables):
        if t.section.decomposition is not None:  # a testbed still running its cells has no answer to give yet
            link = f"[{t.where}]({prefix}/{t.where}/summary.md)"
            lines.append(
                f"- [Geometry or optimizer?]({report}#geometry-or-optimizer-the-factorial) {t.title}, "
                f"{t.section.measure['name']} ({link}, {t.progress.runs()}): {t.section.answer()}."
            )
    testbeds = [(f.name, f.title, f.controls_experiment, f.decay_experiment) for f in all_families()]
    each = [
        f"- [When does the geometry dominate?]({anchor}) {title}: "
        + "; ".join([c for c in said.split("; ") if not c.startswith("mechanism:")][:4])
        for title, said in verdicts_by_testbed(results_dir, testbeds)
    ]
    if each or bounded:  # the longer verdicts, folded: the lines above are what a reader needs first
        lines += ["", FOLD_START, "", *each, *bounded, "", FOLD_END]
    return lines


def _slug(mechanism: list[str], prefix: str = "### The mechanism, by intervention: ") -> str:
    """The GitHub anchor's tail of the first heading that starts with prefix (default: "### The mechanism, by
    intervention: TITLE")."""
    heading = next((ln for ln in mechanism if ln.startswith(prefix)), "")
    title = heading.split(": ", 1)[-1].lower()
    return "".join(ch if ch.isalnum() or ch in " -" else "" for ch in title).replace(" ", "-")


def write_findings(readme: str | Path, results_dir: str | Path) -> Path:
    """Put findings_lines(results_dir) between the README's findings markers (refused without them)."""
    readme = Path(readme)
    text = readme.read_text()
    if FINDINGS_START not in text or FINDINGS_END not in text:
        raise UserError(f"{readme} has no {FINDINGS_START} ... {FINDINGS_END} block to write the findings into")
    prefix = Path(os.path.relpath(Path(results_dir).resolve(), readme.resolve().parent)).as_posix()
    head, rest = text.split(FINDINGS_START, 1)
    tail = rest.split(FINDINGS_END, 1)[1]
    readme.write_text(
        f"{head}{FINDINGS_START}\n" + "\n".join(findings_lines(results_dir, prefix)) + f"\n{FINDINGS_END}{tail}"
    )
    return readme
