"""Paired statistics over seeds: one function, one comparison, both tests.

With 12 pairs the smallest two-sided Wilcoxon p is 2/4096 = 0.00049 (all pairs of one sign),
so the t-test alone can suggest more certainty than the data hold; we report both and the
number of wins, and a claim is "supported" only where both tests agree at the chosen level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

__all__ = ["block_two_way_anova", "describe", "interaction_residuals", "paired_comparison"]


def describe(values: Sequence[float]) -> dict:
    """Mean, sample std and count of a list of accuracies (in the units given)."""
    x = np.asarray(values, dtype=float)
    return {
        "n": int(x.size),
        "mean": float(x.mean()) if x.size else math.nan,
        "std": float(x.std(ddof=1)) if x.size > 1 else math.nan,
    }


def paired_comparison(arm: Sequence[float], baseline: Sequence[float], alpha: float = 0.05) -> dict:
    """Compare paired samples (same seeds, same order), e.g. test accuracies in percent.

    Returns mean difference (arm - baseline), its t-based 95% CI, the paired t statistic and
    two-sided p (scipy.stats.ttest_rel), the two-sided exact Wilcoxon signed-rank p
    (scipy.stats.wilcoxon; NaN when every difference is zero), wins k of N (arm > baseline),
    and whether both tests reject at `alpha`.
    """
    a = np.asarray(arm, dtype=float)
    b = np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples need equal 1-D shapes, got {a.shape} and {b.shape}")
    n = int(a.size)
    diff = a - b
    out: dict = {
        "n_seeds": n,
        "mean_diff": float(diff.mean()) if n else math.nan,
        "wins": int((diff > 0).sum()),
        "losses": int((diff < 0).sum()),
    }
    if n < 2:
        out.update(ci95=[math.nan, math.nan], t=math.nan, p_t=math.nan, p_wilcoxon=math.nan, supported=False)
        return out
    sd = float(diff.std(ddof=1))
    half = float(sps.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    out["ci95"] = [out["mean_diff"] - half, out["mean_diff"] + half]
    if sd == 0.0:
        # ttest_rel is undefined for identical differences; say so rather than report inf.
        out["t"], out["p_t"] = (math.nan, math.nan)
    else:
        t = sps.ttest_rel(a, b)
        out["t"], out["p_t"] = float(t.statistic), float(t.pvalue)
    if np.all(diff == 0):
        out["p_wilcoxon"] = math.nan
    else:
        out["p_wilcoxon"] = float(sps.wilcoxon(a, b, zero_method="wilcox", alternative="two-sided").pvalue)
    out["supported"] = (
        bool(out["p_t"] < alpha and out["p_wilcoxon"] < alpha)
        if not math.isnan(out["p_t"]) and not math.isnan(out["p_wilcoxon"])
        else False
    )
    return out


def interaction_residuals(means: np.ndarray) -> np.ndarray:
    """m_ab - m_a. - m_.b + m of a two-way table of means: what the row and column effects leave."""
    return means - means.mean(axis=1, keepdims=True) - means.mean(axis=0, keepdims=True) + means.mean()


def block_two_way_anova(values: np.ndarray) -> dict[str, dict]:
    """Tests of the two factors and their interaction in a (A, B, S) table whose S seeds are blocks: each seed
    runs every cell (the same initialisation and data), so a seed's own level is taken out, and the error term is
    the cell x seed interaction, with (A B - 1)(S - 1) degrees of freedom.

    Returns per source ("a", "b", "interaction") its sum of squares (in the values' units squared, over every
    run), degrees of freedom, F and p (F infinite and p 0 where the runs have no noise but the source spreads them;
    NaN where neither, or where the source has no degrees of freedom)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 3 or x.shape[2] < 2:
        raise ValueError(f"the table needs shape (A, B, seeds >= 2), got {x.shape}")
    n_a, n_b, n_s = x.shape
    grand = x.mean()
    cells = x.mean(axis=2)
    rows, cols, seeds = cells.mean(axis=1), cells.mean(axis=0), x.mean(axis=(0, 1))
    ss = {
        "a": n_b * n_s * float(((rows - grand) ** 2).sum()),
        "b": n_a * n_s * float(((cols - grand) ** 2).sum()),
        "interaction": n_s * float((interaction_residuals(cells) ** 2).sum()),
    }
    df = {"a": n_a - 1, "b": n_b - 1, "interaction": (n_a - 1) * (n_b - 1)}
    error = x - cells[:, :, None] - seeds[None, None, :] + grand
    df_error = (n_a * n_b - 1) * (n_s - 1)
    ms_error = float((error**2).sum()) / df_error
    out = {}
    for k in ss:
        if not df[k] or (ms_error == 0 and ss[k] == 0):
            f = math.nan
        else:  # no noise at all: any spread is an effect
            f = (ss[k] / df[k]) / ms_error if ms_error > 0 else math.inf
        p = float(sps.f.sf(f, df[k], df_error)) if not math.isnan(f) else math.nan
        out[k] = {"ss": ss[k], "df": df[k], "f": f, "p": p}
    out["error"] = {"ss": ms_error * df_error, "df": df_error}
    return out
