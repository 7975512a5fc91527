"""The title's question as a two-way table: how much of a testbed's spread between cells comes from the geometry
of W_Q, W_K, how much from the optimizer that steps them, and how much from their interaction.

Input: per cell (geometry, optimizer) a value per seed, the seeds paired across cells (the same seed gives every
cell the same initialisation of everything else and the same data). The decomposition is the balanced two-way
one of the cell means m_go: with grand mean m, row means m_g. and column means m_.o,

    SS_geometry    = O * sum_g (m_g. - m)^2
    SS_optimizer   = G * sum_o (m_.o - m)^2
    SS_interaction = sum_go (m_go - m_g. - m_.o + m)^2

and each share is its SS over their sum, the between-cell spread (seed noise is not part of it: the cell means
average over the same seeds). Intervals: a percentile bootstrap over seeds, resampling whole seeds (all cells of a
seed together, as they are paired). The best cell is compared with the second best on the paired seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .stats import paired_comparison

__all__ = ["Decomposition", "decompose", "two_way_shares"]

SOURCES = ("geometry", "optimizer", "interaction")


def two_way_shares(means: np.ndarray) -> dict[str, float]:
    """Shares of the between-cell sum of squares of a (G, O) table of cell means (NaN where every cell is equal)."""
    n_geometries, n_optimizers = means.shape
    grand = means.mean()
    rows, cols = means.mean(axis=1), means.mean(axis=0)
    ss = {
        "geometry": n_optimizers * float(((rows - grand) ** 2).sum()),
        "optimizer": n_geometries * float(((cols - grand) ** 2).sum()),
        "interaction": float(((means - rows[:, None] - cols[None, :] + grand) ** 2).sum()),
    }
    total = sum(ss.values())
    return {k: (v / total if total > 0 else math.nan) for k, v in ss.items()}


@dataclass(frozen=True)
class Decomposition:
    """What `decompose` finds: shares with bootstrap intervals, the cell means, and the two best cells compared."""

    geometries: tuple[str, ...]
    optimizers: tuple[str, ...]
    seeds: tuple[int, ...]
    means: tuple[tuple[float, ...], ...]  # (G, O)
    shares: dict[str, float]
    intervals: dict[str, tuple[float, float]]  # 95% percentile bootstrap over seeds
    best: tuple[str, str]
    second: tuple[str, str]
    best_vs_second: dict  # paired_comparison of best - second (in the measure's units)

    def sentence(self, unit: str, higher_is_better: bool) -> str:
        """The answer in words, from the numbers (which factor carries the most of the spread, and the best cell)."""
        lead = max(SOURCES, key=lambda k: self.shares[k])
        parts = ", ".join(
            f"{k} {100 * self.shares[k]:.0f}% [{100 * self.intervals[k][0]:.0f}, {100 * self.intervals[k][1]:.0f}]"
            for k in SOURCES
        )
        st = self.best_vs_second
        lo, hi = st["ci95"]
        clear = not (math.isnan(lo) or math.isnan(hi)) and (lo > 0 or hi < 0)
        verdict = "ahead" if clear else "not distinguishable from it"
        return (
            f"of the spread between cells, {parts} (95% bootstrap over {len(self.seeds)} seeds): the {lead} carries "
            f"the most. Best cell: {self.best[0]} x {self.best[1]}, {verdict} the second, {self.second[0]} x "
            f"{self.second[1]} ({st['mean_diff']:+.3f} {unit} [{lo:+.3f}, {hi:+.3f}]"
            + (", higher is better)" if higher_is_better else ", lower is better)")
        )


def decompose(
    table: dict[tuple[str, str], dict[int, float]],
    geometries: Sequence[str],
    optimizers: Sequence[str],
    higher_is_better: bool,
    n_boot: int = 2000,
    seed: int = 0,
) -> Decomposition:
    """Two-way decomposition of table[(geometry, optimizer)][seed] over the seeds every cell has.

    Every (geometry, optimizer) pair must be in the table (a full factorial); ValueError naming the missing cells
    otherwise, and when fewer than 2 seeds are shared by all cells."""
    missing = [(g, o) for g in geometries for o in optimizers if (g, o) not in table]
    if missing:
        raise ValueError(f"the factorial misses {len(missing)} cells: {', '.join(f'{g} x {o}' for g, o in missing)}")
    seeds = sorted(set.intersection(*(set(table[(g, o)]) for g in geometries for o in optimizers)))
    if len(seeds) < 2:
        raise ValueError(f"the cells share {len(seeds)} seeds; the decomposition needs at least 2")
    values = np.array([[[table[(g, o)][s] for s in seeds] for o in optimizers] for g in geometries])  # (G, O, S)
    means = values.mean(axis=2)
    shares = two_way_shares(means)
    rng = np.random.default_rng(seed)
    boot = {k: [] for k in SOURCES}
    for _ in range(n_boot):
        pick = rng.integers(0, len(seeds), len(seeds))
        for k, v in two_way_shares(values[:, :, pick].mean(axis=2)).items():
            boot[k].append(v)
    intervals = {k: (float(np.nanpercentile(v, 2.5)), float(np.nanpercentile(v, 97.5))) for k, v in boot.items()}
    order = sorted(
        ((g, o) for g in geometries for o in optimizers),
        key=lambda c: means[geometries.index(c[0]), optimizers.index(c[1])],
        reverse=higher_is_better,
    )
    best, second = order[0], order[1]
    st = paired_comparison([table[best][s] for s in seeds], [table[second][s] for s in seeds])
    return Decomposition(
        tuple(geometries),
        tuple(optimizers),
        tuple(seeds),
        tuple(tuple(float(x) for x in row) for row in means),
        shares,
        intervals,
        best,
        second,
        st,
    )
