"""What the two sequence testbeds (lm, mqar) share: the experiments in which every arm runs (main, the two-stage
lr-sweep, the geometry x optimizer factorial), planned one way, and the Family shell around them. Each testbed
supplies its profiles, its config and cell names, its own experiments, how a cell runs and its report."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..arms import FACTORIAL_ARMS, arm_spec
from ..family import Family
from ..records import Cell
from ..training import anchor_lr, default_seeds, sweep_note, sweep_points, tuned_rates

__all__ = ["SequenceFamily", "sequence_config", "window_loss"]


def sequence_config(
    family: str,
    profiles: dict[str, dict],
    profile: str,
    arm: str,
    seed: int,
    split: str,
    result_split: str,
    settings: tuple[str, ...],
    overrides: dict[str, Any],
) -> dict:
    """One cell's config of a sequence testbed: the profile's model, then its `settings` (the testbed's data and
    training sizes, in this order), the arm's rates (tuned on the sweep's split, or the sweep's own where split
    is not result_split), the optimizer's other settings, then overrides (refused for keys it does not have)."""
    if profile not in profiles:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(profiles)}")
    spec = arm_spec(arm)  # an unknown arm is refused first, with the arms named
    prof = copy.deepcopy(profiles[profile])
    cfg = dict(
        profile=profile,
        arm=arm,
        seed=seed,
        split=split,
        model=prof["model"],
        **{key: prof[key] for key in settings},
        **tuned_rates(family, profiles, profile, arm, result_split, split),
        weight_decay=prof["weight_decay"],
        betas=prof["betas"],
        max_step=prof["max_step"] if spec.trust_region else None,
    )
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def window_loss(model, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean cross-entropy over every position of the windows, in nats per character. model: any callable from a
    batch of token windows to their logits (B, N, vocab), e.g. a CharGPT."""
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i : i + batch].reshape(-1), reduction="sum")
        )
    return total / y.numel()


class SequenceFamily(Family):
    """A sequence testbed. Besides Family's attributes a subclass sets:

    main_arms: the arms of `main` (12 paired seeds by default);
    default_seeds: each experiment's paired seeds at the cpu and paper profiles;
    sweep_extensions: per profile, arm -> values its sweep adds past an edge of the arm's grid;
    sweep_split: the split a sweep run scores on (never the result's);
    config: make_config(profile, arm, seed, split, **overrides) -> config;
    cell: config -> Cell (its readable name).

    and may plan experiments of its own in `own_cells`."""

    factorial_experiments: tuple[str, ...] = ("factorial",)

    main_arms: tuple[str, ...] = ()
    default_seeds: dict[str, int] = {}
    sweep_extensions: dict[str, dict[str, tuple[float, ...]]] = {}
    sweep_split: str = "val"
    config: Callable[..., dict]
    cell: Callable[[dict], Cell]

    def own_cells(self, experiment: str, profile: str, seeds: range) -> list[Cell] | None:
        """The cells of an experiment only this testbed has; None for an experiment it does not know."""
        return None

    def cells(self, experiment: str, profile: str, seeds: int | None = None, **options: Any) -> list[Cell]:
        seeds = default_seeds(self.default_seeds, experiment, profile) if seeds is None else seeds
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        S = range(seeds)
        if experiment == "main":
            return [self.cell(self.config(profile, a, s)) for s in S for a in self.main_arms]
        if experiment == "factorial":  # the cells of main's arms are main's
            return [self.cell(self.config(profile, a, s)) for s in S for a in FACTORIAL_ARMS]
        if experiment == "lr-sweep":
            points = sweep_points(profile, self.sweep_extensions.get(profile), anchor_lr(self.profiles, profile))
            split = self.sweep_split
            return [self.cell(self.config(profile, arm, s, split, **rates)) for arm, rates in points for s in S]
        own = self.own_cells(experiment, profile, S)
        if own is None:
            raise ValueError(f"unknown experiment {experiment!r}; choose one of {', '.join(self.experiments)}")
        return own

    def plan_note(self, experiment: str, profile: str) -> str:
        return sweep_note(self.name, self.profiles, profile) if experiment == "lr-sweep" else ""
