"""The title's question as a two-way table: how much of a testbed's spread between cells comes from the geometry
of W_Q, W_K, how much from the optimizer that steps them, and how much from their interaction.

Input: per cell (geometry, optimizer) a value per seed, the seeds paired across cells (the same seed gives every
cell the same initialisation of everything else and the same data). The decomposition is the balanced two-way
one of the cell means m_go: with grand mean m, row means m_g. and column means m_.o,

    SS_geometry    = O * sum_g (m_g. - m)^2
    SS_optimizer   = G * sum_o (m_.o - m)^2
    SS_interaction = sum_go (m_go - m_g. - m_.o + m)^2

and each share is its SS over their sum, the between-cell spread. Intervals: a percentile bootstrap over seeds,
resampling whole seeds (all cells of a seed together, as they are paired). Seed noise is not taken out of the
shares: the cell means carry it, and with no effect at all each source would hold about its degrees of freedom's
part of the spread (3, 2 and 6 of 11 in a 4 x 3 table; the interaction the most). So each source is also tested
against that noise: a two-way ANOVA with the seeds as blocks (stats.block_two_way_anova), and a factor is said
to carry the most only where it has the largest share and its test rejects at 5%. The best cell is compared with
the second best on the paired seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .fmt import fmt_ci, fmt_p, unit_digits
from .stats import block_two_way_anova, interaction_residuals, paired_comparison
from .summaries import PlanProgress

__all__ = [
    "CellResult",
    "Decomposition",
    "FactorialSection",
    "TestbedFactorial",
    "decompose",
    "factorial_markdown",
    "factorial_plot",
    "factorial_report_section",
    "factorial_section",
    "suite_factorial",
    "testbed_factorials",
    "two_way_shares",
]

SOURCES = ("geometry", "optimizer", "interaction")


def two_way_shares(means: np.ndarray) -> dict[str, float]:
    """Shares of the between-cell sum of squares of a (G, O) table of cell means (NaN where every cell is equal)."""
    n_geometries, n_optimizers = means.shape
    grand = means.mean()
    rows, cols = means.mean(axis=1), means.mean(axis=0)
    ss = {
        "geometry": n_optimizers * float(((rows - grand) ** 2).sum()),
        "optimizer": n_geometries * float(((cols - grand) ** 2).sum()),
        "interaction": float((interaction_residuals(means) ** 2).sum()),
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
    p_values: dict[str, float]  # each source's ANOVA p against the seed noise, seeds as blocks

    def sentence(self, unit: str, higher_is_better: bool) -> str:
        """The answer in words, from the numbers (which factor carries the most of the spread, and the best cell)."""
        tests = ", ".join(f"{k} p={fmt_p(self.p_values[k])}" for k in SOURCES)
        st = self.best_vs_second
        lo, hi = st["ci95"]
        clear = not (math.isnan(lo) or math.isnan(hi)) and (lo > 0 or hi < 0)
        verdict = "ahead of" if clear else "not distinguishable from"
        digits = unit_digits(unit)
        return (
            f"of the spread between cells, {self.shares_phrase()} (95% bootstrap over {len(self.seeds)} seeds); "
            f"against the seed noise (ANOVA, seeds as blocks) {tests}: {self.carries()}. "
            f"Best cell: {self.best[0]} x {self.best[1]}, "
            f"{verdict} the second, {self.second[0]} x {self.second[1]} "
            f"({st['mean_diff']:+.{digits}f} {unit} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
            + (", higher is better)" if higher_is_better else ", lower is better)")
        )

    @classmethod
    def from_dict(cls, d: dict) -> Decomposition:
        """The decomposition `asdict` wrote to summary.json."""
        return cls(
            tuple(d["geometries"]),
            tuple(d["optimizers"]),
            tuple(d["seeds"]),
            tuple(tuple(row) for row in d["means"]),
            d["shares"],
            {k: tuple(v) for k, v in d["intervals"].items()},
            tuple(d["best"]),
            tuple(d["second"]),
            d["best_vs_second"],
            d["p_values"],
        )

    def largest(self) -> str:
        """The source with the largest share of the spread."""
        return max(SOURCES, key=lambda k: self.shares[k])

    def lead(self) -> str | None:
        """The source that carries the most: the largest share, where its test rejects at 5% (None otherwise)."""
        largest = self.largest()
        return largest if self.p_values[largest] < 0.05 else None

    def shares_phrase(self) -> str:
        return ", ".join(
            f"{k} {100 * self.shares[k]:.0f}% [{100 * self.intervals[k][0]:.0f}, {100 * self.intervals[k][1]:.0f}]"
            for k in SOURCES
        )

    def carries(self) -> str:
        """Which source carries the most, in words (where the interaction does, its largest cell)."""
        lead = self.largest()
        if self.lead() is None:
            return f"the {lead} has the largest share, but its effect does not stand out from the seed noise"
        said = f"the {lead} carries the most"
        if lead == "interaction":
            g, o, part = self.interaction_cells()[0]
            said += f" (its largest cell: {g} x {o}, {100 * part:.0f}% of the interaction's sum of squares)"
        return said

    def interaction_cells(self) -> list[tuple[str, str, float]]:
        """(geometry, optimizer, part) of every cell, largest first: its squared interaction residual
        (m_go - m_g. - m_.o + m) as a part of their sum, where the interaction is concentrated."""
        resid = interaction_residuals(np.array(self.means))
        total = float((resid**2).sum())
        cells = [
            (g, o, float(resid[i, j] ** 2) / total if total > 0 else math.nan)
            for i, g in enumerate(self.geometries)
            for j, o in enumerate(self.optimizers)
        ]
        return sorted(cells, key=lambda c: -c[2])


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
    if np.all(means == means.flat[0]):
        raise ValueError(f"every cell has the same mean over their {len(seeds)} seeds, so there is no spread to divide")
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
    tested = block_two_way_anova(values)
    p_values = {source: tested[k]["p"] for source, k in zip(SOURCES, ("a", "b", "interaction"))}
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
        p_values,
    )


# ---------------------------------------------------------------------------------------------
# A testbed's factorial section: the table of cells, what did not run, the decomposition, the variants
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellResult:
    """One cell of the table (or one variant beside it): its arm and the measure over its seeds."""

    geometry: str
    optimizer: str
    arm: str
    n: int
    mean: float
    std: float
    censored: int  # runs whose value is a bound (a time to a threshold never reached), 0 for other measures


@dataclass(frozen=True)
class FactorialSection:
    """What a testbed's `factorial` summary holds (summary.json's "factorial", read back by `from_dict`)."""

    measure: dict  # name, unit, higher_is_better
    cells: tuple[CellResult, ...]  # every cell of the table, in row-major order, n = 0 where it has no run
    variants: tuple[CellResult, ...]  # rules beside the table's cells (geometry: its cell's; optimizer: the arm)
    variants_vs: dict[str, dict]  # arm -> paired comparison with the cell it sits beside (variant - it)
    decomposition: dict | None  # asdict(Decomposition), None until every cell shares 2 seeds
    sentence: str
    not_yet: str  # why there is no decomposition ("" when there is one)
    note: str = ""  # the measure's fallback was used, and why
    # arm -> {"tied", "n", "same_runs"} for a variant with its cell's value in some seeds: in how many, of how
    # many shared, and in how many of those its recorded curves are the cell's too (the same run)
    ties: dict[str, dict] = field(default_factory=dict)
    beside: dict[str, tuple[str, str]] = field(default_factory=dict)  # variant arm -> (geometry, optimizer)
    # variant arm -> asdict(Decomposition) of the table with the variant's runs in its cell's place, once every
    # cell and the variant share 2 seeds: whether the answer rests on how that one cell was built
    substituted: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FactorialSection:
        return cls(
            d["measure"],
            tuple(CellResult(**c) for c in d["cells"]),
            tuple(CellResult(**c) for c in d["variants"]),
            d["variants_vs"],
            d["decomposition"],
            d["sentence"],
            d["not_yet"],
            d.get("note", ""),
            d.get("ties", {}),
            {a: tuple(c) for a, c in d.get("beside", {}).items()},
            d.get("substituted", {}),
        )

    def answer(self) -> str:
        """What REPORT and the README say: the decomposition's sentence (or why there is none yet), then how it moves
        with each variant in its cell's place."""
        said = self.sentence if self.decomposition is not None else self.not_yet
        return said + (f". {more}" if (more := self.substitutions_sentence()) else "")

    def substitutions_sentence(self) -> str:
        """How the answer moves with each variant in its cell's place ("" with none decomposed): the variants that
        leave every share within the table's bootstrap interval and the same source carrying the most, named
        together; each other one with its shares and what carries the most then."""
        if self.decomposition is None or not self.substituted:
            return ""
        base = Decomposition.from_dict(self.decomposition)
        kept, moved = [], []
        for arm, d in self.substituted.items():
            sub = Decomposition.from_dict(d)
            g, o = self.beside[arm]
            inside = all(base.intervals[k][0] <= sub.shares[k] <= base.intervals[k][1] for k in SOURCES)
            if inside and sub.lead() == base.lead():
                kept.append(f"{arm} ({g} x {o})")
            else:
                moved.append(f"{arm} ({g} x {o}) gives {sub.shares_phrase()}: {sub.carries()}")
        if kept:
            names = " and ".join([", ".join(kept[:-1]), kept[-1]] if len(kept) > 1 else kept)
            kept = [f"{names} {'leaves' if len(kept) == 1 else 'leave'} every share within the table's interval"]
        return "Each variant in its cell's place: " + "; ".join(kept + moved)


def _cell_result(geometry: str, optimizer: str, arm: str, values: dict[int, float], censored: int) -> CellResult:
    x = np.array(list(values.values()), dtype=float)
    mean = float(x.mean()) if x.size else math.nan
    return CellResult(
        geometry, optimizer, arm, int(x.size), mean, float(x.std(ddof=1)) if x.size > 1 else math.nan, censored
    )


def factorial_section(
    records: Sequence[dict],
    measure,
    table_arms: dict[tuple[str, str], str],
    geometries: Sequence[str],
    optimizers: Sequence[str],
    variants: Mapping[str, tuple[str, str]] | None = None,
) -> FactorialSection:
    """The factorial section of a summary from one testbed's records. measure: value(record), name, unit,
    higher_is_better and censored(record) or None (geometry.Measure). table_arms: (geometry, optimizer) -> arm;
    variants: arm -> the (geometry, optimizer) cell it is compared with, paired by seed, and substituted for."""
    variants = dict(variants or {})
    note = ""
    if measure.censored and records and all(measure.censored(r) for r in records) and measure.fallback:
        note = f"every run is censored on {measure.name}, so the table is of {measure.fallback.name}"
        measure = measure.fallback  # only the fallback tells runs apart that all stop at the budget
    values: dict[str, dict[int, float]] = {}
    censored: dict[str, int] = {}
    curves: dict[tuple[str, int], dict | None] = {}
    for rec in records:
        arm = rec["config"]["arm"]
        values.setdefault(arm, {})[rec["config"]["seed"]] = measure.value(rec)
        curves[(arm, rec["config"]["seed"])] = rec.get("curves")
        censored[arm] = censored.get(arm, 0) + bool(measure.censored and measure.censored(rec))
    cells = tuple(
        _cell_result(g, o, table_arms[(g, o)], values.get(table_arms[(g, o)], {}), censored.get(table_arms[(g, o)], 0))
        for g in geometries
        for o in optimizers
    )
    side = tuple(_cell_result(c[0], a, a, values.get(a, {}), censored.get(a, 0)) for a, c in variants.items())
    vs, ties = {}, {}
    for a, cell in variants.items():
        ref = values.get(table_arms[cell], {})
        shared = sorted(set(values.get(a, {})) & set(ref))
        if len(shared) >= 2:
            vs[a] = paired_comparison([values[a][s] for s in shared], [ref[s] for s in shared])
        tied = [s for s in shared if values[a][s] == ref[s]]
        if tied:
            same = [s for s in tied if curves[(a, s)] is not None and curves[(a, s)] == curves[(table_arms[cell], s)]]
            ties[a] = {"tied": len(tied), "n": len(shared), "same_runs": len(same)}
    table = {(g, o): values[table_arms[(g, o)]] for g in geometries for o in optimizers if table_arms[(g, o)] in values}
    unit, better = measure.unit, measure.higher_is_better
    try:
        d = decompose(table, geometries, optimizers, higher_is_better=better)
    except ValueError as err:
        no = f"no decomposition: {err}"
        return FactorialSection(measure.describe(), cells, side, vs, None, "", no, note, ties, variants)
    substituted = {}
    for a, cell in variants.items():
        if a in values:
            try:
                substituted[a] = asdict(
                    decompose({**table, cell: values[a]}, geometries, optimizers, higher_is_better=better)
                )
            except ValueError:  # too few seeds shared with the variant: no substitute table yet
                pass
    sentence = d.sentence(unit, better)
    return FactorialSection(
        measure.describe(), cells, side, vs, asdict(d), sentence, "", note, ties, variants, substituted
    )


def suite_factorial(records: Sequence[dict], measure) -> dict:
    """summary["factorial"] of a testbed: the suite's table (arms.FACTORIAL) and the variants beside its cells."""
    from ..arms import FACTORIAL, FACTORIAL_GEOMETRIES, FACTORIAL_OPTIMIZERS, FACTORIAL_VARIANTS

    table = factorial_section(
        records, measure, FACTORIAL, FACTORIAL_GEOMETRIES, FACTORIAL_OPTIMIZERS, FACTORIAL_VARIANTS
    )
    return table.to_dict()


def factorial_markdown(section: FactorialSection, digits: int = 3) -> list[str]:
    """The table of cell means (rows: geometry; columns: optimizer), the decomposition, and the variants."""
    m = section.measure
    if section.note:  # a fallback measure: an accuracy in pp, not a count of steps
        digits = max(digits, 2)
    optimizers = list(dict.fromkeys(c.optimizer for c in section.cells))
    geometries = list(dict.fromkeys(c.geometry for c in section.cells))
    by = {(c.geometry, c.optimizer): c for c in section.cells}

    def show(c: CellResult) -> str:
        if not c.n:
            return f"not run (`{c.arm}`)"
        bound = f", {c.censored} censored" if c.censored else ""
        return f"{c.mean:.{digits}f} ± {fmt_std(c.std, digits)} (`{c.arm}`, {c.n}{bound})"

    better = "higher" if m["higher_is_better"] else "lower"
    lines = [
        f"Geometry of W_Q, W_K (rows) x the optimizer family that steps them (columns); everything else AdamW. "
        f"Cell: mean ± std of {m['name']} ({m['unit']}; {better} is better) over seeds (arm, seeds).",
        "",
        "| geometry | " + " | ".join(optimizers) + " |",
        "|---" * (len(optimizers) + 1) + "|",
    ]
    if section.note:
        lines[0:0] = [section.note[:1].upper() + section.note[1:] + ".", ""]
    lines += ["| " + g + " | " + " | ".join(show(by[(g, o)]) for o in optimizers) + " |" for g in geometries]
    lines.append("")
    missing = [c.arm for c in section.cells if not c.n]
    if missing:
        lines += [f"Cells not run yet: {', '.join(missing)}.", ""]
    if section.decomposition is None:
        lines += [section.not_yet[:1].upper() + section.not_yet[1:] + ".", ""]
    else:
        d = section.decomposition
        lines += [
            "| source | share of the between-cell spread | 95% bootstrap interval | p (ANOVA, seeds as blocks) |",
            "|---|---|---|---|",
            *(
                f"| {k} | {100 * d['shares'][k]:.0f}% | [{100 * d['intervals'][k][0]:.0f}%, "
                f"{100 * d['intervals'][k][1]:.0f}%] | {fmt_p(d['p_values'][k])} |"
                for k in SOURCES
            ),
            "",
            f"Over the {len(d['seeds'])} seeds every cell has: {section.sentence}.",
            "",
        ]
    if section.variants:
        lines += [
            "Rules beside the table's cells (each against the cell it sits beside, paired by seed):",
            "",
            f"| rule | beside | mean ± std ({m['unit']}) | seeds | − the cell | 95% CI |",
            "|---|---|---|---|---|---|",
        ]
        for c in section.variants:
            st = section.variants_vs.get(c.arm)
            diff = f"{st['mean_diff']:+.{digits}f} | {fmt_ci(st['ci95'], digits)}" if st else "n/a | n/a"
            mean = f"{c.mean:.{digits}f} ± {fmt_std(c.std, digits)}" if c.n else "not run"
            g, o = section.beside[c.arm]
            lines.append(f"| {c.arm} | {g} x {o} | {mean} | {c.n} | {diff} |")
        lines.append("")
        for arm, t in section.ties.items():
            runs = (
                "its runs are not the cell's: their recorded curves differ in each of those seeds"
                if not t["same_runs"]
                else f"in {t['same_runs']} of them its recorded curves are the cell's too: the same run twice"
            )
            g, o = section.beside[arm]
            lines += [f"{arm} has the {g} x {o} cell's {m['name']} in {t['tied']} of {t['n']} seeds; {runs}.", ""]
    if section.substituted:
        lines += [
            "The decomposition with each rule's runs in its cell's place (the seeds every cell and the rule share):",
            "",
            "| in the cell's place | " + " | ".join(SOURCES) + " |",
            "|---" * (len(SOURCES) + 1) + "|",
        ]
        for arm, d in section.substituted.items():
            g, o = section.beside[arm]
            shares = " | ".join(
                f"{100 * d['shares'][k]:.0f}% [{100 * d['intervals'][k][0]:.0f}%, {100 * d['intervals'][k][1]:.0f}%], "
                f"p={fmt_p(d['p_values'][k])}"
                for k in SOURCES
            )
            lines.append(f"| {arm} for {g} x {o} ({len(d['seeds'])} seeds) | {shares} |")
        lines.append("")
    return lines


def fmt_std(x: float, digits: int) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def factorial_plot(section: FactorialSection, out_dir, made: list[str]) -> None:
    """A heat map of the cell means, rows geometry and columns optimizer, each cell labelled with its mean and
    how many of its runs are censored (never reached the threshold), in a colour readable on its background."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .fmt import save_figure

    optimizers = list(dict.fromkeys(c.optimizer for c in section.cells))
    geometries = list(dict.fromkeys(c.geometry for c in section.cells))
    by = {(c.geometry, c.optimizer): c for c in section.cells}
    grid = np.array([[by[(g, o)].mean if by[(g, o)].n else math.nan for o in optimizers] for g in geometries])
    m = section.measure
    fig, ax = plt.subplots(figsize=(1.6 * len(optimizers) + 2.5, 0.7 * len(geometries) + 1.5))
    image = ax.imshow(grid, cmap="viridis" if m["higher_is_better"] else "viridis_r", aspect="auto")
    ax.set_xticks(range(len(optimizers)), optimizers)
    ax.set_yticks(range(len(geometries)), geometries)
    for i, g in enumerate(geometries):
        for j, o in enumerate(optimizers):
            cell = by[(g, o)]
            if not cell.n:
                label, background = "not run", (1.0, 1.0, 1.0)
            else:
                label = f"{cell.mean:.0f}" if abs(cell.mean) >= 100 else f"{cell.mean:.3g}"
                label += f"\n{cell.censored} of {cell.n} never" if cell.censored else ""
                background = image.cmap(image.norm(cell.mean))[:3]
            light = 0.299 * background[0] + 0.587 * background[1] + 0.114 * background[2] > 0.5
            ax.text(j, i, label, ha="center", va="center", fontsize=8, color="black" if light else "white")
    fig.colorbar(image, ax=ax, label=f"{m['name']} ({m['unit']})")
    ax.set_xlabel("optimizer family on W_Q, W_K")
    ax.set_ylabel("geometry of W_Q, W_K")
    save_figure(fig, out_dir, "factorial.png", made, dpi=110)


@dataclass(frozen=True)
class TestbedFactorial:
    """One factorial summary of a testbed, as REPORT and the README findings read it."""

    __test__ = False  # not a pytest class, whatever its name

    title: str  # the testbed's
    where: str  # "family/experiment", the summary's folder under the results
    progress: PlanProgress
    section: FactorialSection
    plots: tuple[str, ...]


def testbed_factorials(results_dir, testbeds: Sequence[tuple[str, str, Sequence[str]]]):
    """Each factorial summary under results_dir (a TestbedFactorial), testbed by testbed. testbeds: (family
    folder, title, its factorial experiments)."""
    import json
    from pathlib import Path

    for family, title, experiments in testbeds:
        for experiment in experiments:
            path = Path(results_dir) / family / experiment / "summary.json"
            if not path.exists():
                continue
            summary = json.loads(path.read_text())
            yield TestbedFactorial(
                title,
                f"{family}/{experiment}",
                PlanProgress.of(summary),
                FactorialSection.from_dict(summary["factorial"]),
                tuple(summary.get("plots", [])),
            )


def factorial_report_section(results_dir, testbeds: Sequence[tuple[str, str, Sequence[str]]]) -> list[str]:
    """REPORT.md lines of "Geometry or optimizer? The factorial": per factorial summary under results_dir, its
    measure, its runs, its answer (the decomposition's sentence, or why there is none yet) and its heat map.
    testbeds: (family folder, title, its factorial experiments)."""
    rows = []
    for t in testbed_factorials(results_dir, testbeds):
        measure = t.section.measure["name"]
        rows += [
            f"- {t.title}, {measure}: [{t.where}]({t.where}/summary.md) ({t.progress.runs()}): {t.section.answer()}."
        ]
        if "factorial.png" in t.plots:
            rows += ["", f"  ![{t.title}: the cell means of {measure}]({t.where}/factorial.png)"]
        rows.append("")
    if not rows:
        return []
    return [
        "## Geometry or optimizer? The factorial",
        "",
        "The title's question as a two-way table per testbed: rows the geometry of W_Q, W_K, columns the optimizer "
        "family that steps them, every cell at its own tuned rate and everything else AdamW; the share of the "
        "spread between cells that the geometry, the optimizer and their interaction carry, once every cell has "
        "run (grokking has none: docs/benchmarks.md says why).",
        "",
        *rows,
    ]
