"""Typed records that carry one module's results to another, so that no module reads another's dict keys.

A family's summary.json is written and read by the family's own report module. What the report layer needs of it
for REPORT.md comes through the family's hooks as one of these records (`Family.mechanism_answer` returns a
`MechanismAnswer`); the geometry x optimizer table is its own record (factorial.FactorialSection).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Answer", "BoundedAnswer", "MechanismAnswer", "MechanismFound"]


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
