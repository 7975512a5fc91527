"""Number formatting and figure saving shared by every report."""

from __future__ import annotations

import math
from pathlib import Path

from .summaries import PlanProgress

__all__ = [
    "diverged_lines",
    "diverged_runs",
    "fmt_ci",
    "fmt_p",
    "fmt_runs",
    "fmt_t",
    "open_arms",
    "provisional",
    "save_figure",
    "undefined",
]


def undefined(x) -> bool:
    """NaN in memory, null (None) once a summary has been through strict JSON."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_ci(ci: list[float], digits: int = 2) -> str:
    """[lo, hi] with a sign, or n/a when one seed leaves the interval undefined."""
    lo, hi = ci
    if undefined(lo) or undefined(hi):
        return "n/a"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"


def fmt_num(x, digits: int) -> str:
    """x to `digits` decimals, or n/a where it is undefined (a spread over one seed, a missing metric)."""
    return "n/a" if undefined(x) else f"{x:.{digits}f}"


def fmt_seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def fmt_runs(summary: dict) -> str:
    """'N finished runs', and how many of the experiment's planned cells they cover (PlanProgress.sentence)."""
    return PlanProgress.of(summary).sentence()


def open_arms(summary: dict, arms) -> list[str]:
    """The arms among `arms` whose planned runs have not all finished (PlanProgress.open_arms)."""
    return PlanProgress.of(summary).open_arms(arms)


def provisional(verdict: str, waiting: list[str], decided: bool) -> str:
    """A verdict of a comparison whose arms still lack planned runs (waiting: open_arms): an effect found holds
    'so far'; the absence of one decides nothing yet. Unchanged where nothing is waiting."""
    if not waiting:
        return verdict
    runs = f"{', '.join(waiting)} runs"
    return f"so far ({runs}): {verdict}" if decided else f"not decided yet ({runs}); at these seeds: {verdict}"


def diverged_runs(records: list[dict], unit: str) -> list[dict]:
    """Every run that diverged, as {"run": name, unit: when} in name order, from metrics.diverged_at_<unit>
    (unit "step" or "epoch"); a summary says this only where it happened."""
    key = f"diverged_at_{unit}"
    found = [r for r in records if r["metrics"].get(key)]
    return [{"run": r["name"], unit: r["metrics"][key]} for r in sorted(found, key=lambda r: r["name"])]


def diverged_lines(diverged: list[dict], unit: str, counts_as: str) -> list[str]:
    """A summary's paragraph on its diverged runs (diverged_runs), saying what each counts as; [] for none."""
    if not diverged:
        return []
    runs = "; ".join(f"{d['run']} at {unit} {d[unit]}" for d in diverged)
    return [
        f"Diverged ({len(diverged)} runs: a loss or gradient stopped being finite, or a frame's polar factor "
        f"failed; each counts as {counts_as}): {runs}.",
        "",
    ]


def unit_digits(unit: str) -> int:
    """Decimals of a difference in unit: none for counts (steps, epochs), three for nats, two otherwise (pp)."""
    return 0 if unit in ("steps", "epochs") else 3 if unit.startswith("nats") else 2


def fmt_p(p: float) -> str:
    return "n/a" if p is None or math.isnan(p) else (f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}")


def fmt_t(t: float) -> str:
    """A t statistic; undefined (n/a) when every paired difference is the same, e.g. all zero."""
    return "n/a" if t is None or math.isnan(t) else f"{t:.2f}"


def save_figure(fig, out_dir: Path, name: str, made: list[str], dpi: int = 120) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=dpi)
    plt.close(fig)
    made.append(name)
