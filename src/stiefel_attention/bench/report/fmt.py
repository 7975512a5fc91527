"""Number formatting and figure saving shared by every report."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["fmt_ci", "fmt_p", "fmt_runs", "fmt_t", "open_arms", "provisional", "save_figure", "undefined"]


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
    """'N finished runs', and how many of the experiment's planned cells they cover when it has a plan.

    The records can outnumber the finished planned cells (seeds of a cell shared with another experiment);
    the sentence then says so instead of reading as a complete plan.
    """
    n, total = summary["n_records"], summary.get("n_planned")
    runs = f"{n} finished run" + ("" if n == 1 else "s")
    if not total:
        return runs
    done = summary.get("n_planned_done", n)
    text = (
        f"{runs} of {total} planned"
        if done == n
        else f"{runs} ({done} of the {total} planned cells, {n - done} beyond the plan)"
    )
    if by_arm := summary.get("planned_by_arm"):
        ran = [f"{arm} {k}/{of}" for arm, (k, of) in by_arm.items() if k]
        idle = [arm for arm, (k, _) in by_arm.items() if not k]
        text += "; finished of planned per arm: " + ", ".join(ran)
        text += f"; not run yet: {', '.join(idle)}" if idle else ""
    return text


def open_arms(summary: dict, arms) -> list[str]:
    """'arm done/total', in the plan's order, for each of `arms` whose planned runs have not all finished
    ('done/total' for a plan of one arm); empty where a comparison of these arms is final. An arm the plan does
    not hold has nothing to wait for."""
    if by_arm := summary.get("planned_by_arm"):
        return [f"{arm} {done}/{total}" for arm, (done, total) in by_arm.items() if arm in arms and done < total]
    done, total = summary.get("n_planned_done"), summary.get("n_planned")
    return [f"{done}/{total}"] if total and done < total else []


def provisional(verdict: str, waiting: list[str], decided: bool) -> str:
    """A verdict of a comparison whose arms still lack planned runs (waiting: open_arms): an effect found holds
    'so far'; the absence of one decides nothing yet. Unchanged where nothing is waiting."""
    if not waiting:
        return verdict
    runs = f"{', '.join(waiting)} runs"
    return f"so far ({runs}): {verdict}" if decided else f"not decided yet ({runs}); at these seeds: {verdict}"


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
