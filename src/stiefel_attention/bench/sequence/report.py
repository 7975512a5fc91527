"""What the sequence testbeds' reports share: the swept rate of an arm, curves over training, a header."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..arms import arm_spec
from ..report.fmt import fmt_runs

__all__ = ["curve_plot", "header", "swept"]


def swept(arm: str) -> str:
    return arm_spec(arm).swept


def curve_plot(records: list[dict], key: str, ylabel: str, out_dir: Path, made: list[str], name: str) -> None:
    """One curve per arm over training steps, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..report.fmt import save_figure

    by_arm: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by_arm[rec["config"]["arm"]].append(rec)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, recs in sorted(by_arm.items()):
        n = min(len(r["curves"][key]) for r in recs)
        steps = recs[0]["curves"]["step"][:n]
        mean = [sum(r["curves"][key][i] for r in recs) / len(recs) for i in range(n)]
        ax.plot(steps, mean, lw=1.2, label=f"{arm} ({len(recs)})")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    save_figure(fig, out_dir, name, made, dpi=110)


def header(title: str, summary: dict, profile: str, what: str) -> list[str]:
    return [
        f"# {title} — `{summary['experiment']}`, profile `{profile}`",
        "",
        f"{fmt_runs(summary)}. {what}",
        "",
    ]
