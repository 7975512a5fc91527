"""Typed records that carry one module's results to another, so that no module reads another's dict keys.

Every summary.json starts with what document.write_experiment adds to it (`PlanProgress`: the runs and how far
the plan is); the rest is written and read by the family's own report module. What the report layer needs of it
for REPORT.md comes through the family's hooks as one of these records (`Family.mechanism_answer` returns a
`MechanismAnswer`); the geometry x optimizer table is its own record (factorial.FactorialSection).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Answer", "BoundedAnswer", "MechanismAnswer", "MechanismFound", "PlanProgress"]


@dataclass(frozen=True)
class Answer:
    """One question REPORT's mechanism paragraph asks of a testbed, and its computed answer."""

    question: str  # e.g. "is the attention-logit scale the mechanism in grokking?"
    verdict: str


@dataclass(frozen=True)
class BoundedAnswer:
    """What an lr-stability summary found of the bounded-logit arms (lm.report's "bounded" part)."""

    buys_qk_norm_stability: str  # does the bound buy qk-norm's stability?
    steadies_the_frames: str  # does it make the frames less sensitive to the learning rate?
    needs_the_frames: str  # the same norm on Euclidean W_Q, W_K: does the bound need the frames?
    bounds: dict[str, float | None]  # arm or label -> its logit bound by construction (None: no bound)
    largest: dict[str, float]  # arm or label -> the largest attention logit over every multiplier


@dataclass(frozen=True)
class MechanismAnswer:
    """A testbed's part of REPORT's "The mechanism" section, built by its family from its own summary."""

    heading: str  # "The mechanism, by intervention" or "High learning rates"
    answers: tuple[Answer, ...]  # for the opening paragraph, in order
    lead: str  # the section's first sentence(s), after the link to the summary
    bullets: tuple[str, ...] = ()
    bounded: BoundedAnswer | None = None
    figure: tuple[str, str] | None = None  # (alt text, file name beside the summary)


@dataclass(frozen=True)
class MechanismFound:
    """A MechanismAnswer placed in a results folder: where its summary is and how many of its runs finished."""

    where: str  # "<family>/<experiment>", relative to the results folder
    runs: str  # "k/n runs", or "runs" when the summary has no plan
    title: str  # the testbed in words
    answer: MechanismAnswer


@dataclass(frozen=True)
class PlanProgress:
    """How far an experiment's summary has got: its records and, where it has a plan, the planned cells finished
    (in all and per arm while the plan is open). Written into every summary by document.write_experiment."""

    n_records: int
    n_planned: int | None = None
    n_planned_done: int | None = None
    by_arm: dict[str, tuple[int, int]] | None = None  # arm -> (finished, planned), only while the plan is open

    @classmethod
    def of(cls, summary: dict) -> PlanProgress:
        by_arm = summary.get("planned_by_arm")
        return cls(
            summary.get("n_records", 0),
            summary.get("n_planned"),
            summary.get("n_planned_done"),
            {arm: (done, total) for arm, (done, total) in by_arm.items()} if by_arm else None,
        )

    def runs(self) -> str:
        """'k/n runs' of the plan, or 'runs' for a summary without one."""
        return f"{self.n_planned_done}/{self.n_planned} runs" if self.n_planned else "runs"

    def open_arms(self, arms) -> list[str]:
        """'arm done/total', in the plan's order, for each of arms whose planned runs have not all finished
        ('done/total' for a plan of one arm); empty where a comparison of these arms is final."""
        if self.by_arm:
            return [
                f"{arm} {done}/{total}" for arm, (done, total) in self.by_arm.items() if arm in arms and done < total
            ]
        done, total = self.n_planned_done, self.n_planned
        return [f"{done}/{total}"] if total and done < total else []

    def begun(self) -> list[str]:
        """'arm done/total' for each arm that has begun but not finished its planned runs."""
        return [f"{arm} {done}/{total}" for arm, (done, total) in (self.by_arm or {}).items() if 0 < done < total]

    def sentence(self) -> str:
        """'N finished runs', and how many of the planned cells they cover when there is a plan. The records can
        outnumber the finished planned cells (seeds of a cell shared with another experiment); it then says so."""
        n, total = self.n_records, self.n_planned
        runs = f"{n} finished run" + ("" if n == 1 else "s")
        if not total:
            return runs
        done = n if self.n_planned_done is None else self.n_planned_done
        text = (
            f"{runs} of {total} planned"
            if done == n
            else f"{runs} ({done} of the {total} planned cells, {n - done} beyond the plan)"
        )
        if self.by_arm:
            ran = [f"{arm} {k}/{of}" for arm, (k, of) in self.by_arm.items() if k]
            idle = [arm for arm, (k, _) in self.by_arm.items() if not k]
            text += "; finished of planned per arm: " + ", ".join(ran)
            text += f"; not run yet: {', '.join(idle)}" if idle else ""
        return text
