"""What the training loops of the families share: building an arm's model and optimizers, the
warm-up + cosine schedule, pairing fingerprints, and the mechanism metrics of one evaluation."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from ..metrics import attention_metrics
from ..nn import routing_parameters
from ..optim import NonFiniteGradientError
from .arms import BOUNDED_ARMS, FACTORIAL_ARMS, HyperParameters, arm_spec, attention_options, build_optimizers
from .errors import NotReady

# What an optimizer step raises when training has blown up, not when the code is wrong: a gradient that is not
# finite (StiefelAdam refuses it), or frames so far from the manifold that the polar factor's eigh fails. The
# sequence testbeds record either as the run diverging at that step.
BLOWN_UP = (NonFiniteGradientError, torch.linalg.LinAlgError)

__all__ = [
    "BLOWN_UP",
    "step_optimizers",
    "run_timings",
    "Trainer",
    "warmup_cosine",
    "init_fingerprint",
    "hyperparameters",
    "log_mechanism",
    "SEQUENCE_ARMS",
    "SWEPT_ARMS",
    "anchor_lr",
    "sweep_points",
    "sweep_note",
    "tuned_rates",
    "default_seeds",
]


def step_optimizers(opts, scheds) -> bool:
    """One step of every optimizer, each followed by its schedule's; False if a step raised BLOWN_UP (training
    has blown up: the caller records the run as diverging), True otherwise."""
    try:
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    except BLOWN_UP:
        return False
    return True


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up over warmup_steps, then a cosine decay to 0 at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def hyperparameters(cfg: dict) -> HyperParameters:
    """The optimisation part of a resolved config."""
    return HyperParameters(
        lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        frame_lr=cfg["frame_lr"],
        betas=tuple(cfg["betas"]),
        eps=cfg.get("eps", 1e-8),
        frame_eps=cfg.get("frame_eps"),
        max_step=cfg["max_step"],
        sgd_momentum=cfg.get("sgd_momentum", 0.9),
    )


def init_fingerprint(model: nn.Module) -> str:
    """Hash of the initial values of every parameter except the query-key path (the part arms share)."""
    routing = {id(p) for _, p in routing_parameters(model)}
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if id(p) not in routing:
            h.update(name.encode())
            h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Trainer:
    """An arm's model, optimizers and schedules, built from a resolved config; `step(loss)` trains."""

    def __init__(self, cfg: dict, make_model: Callable[..., nn.Module], device, total_steps: int, warmup_steps: int):
        torch.manual_seed(cfg["seed"])  # the model init: identical in every arm (pairing)
        self.model = make_model(**attention_options(cfg["arm"])).to(device)
        self.fingerprint = init_fingerprint(self.model)
        self.opts = build_optimizers(self.model, cfg["arm"], hyperparameters(cfg))
        schedule = warmup_cosine(total_steps, warmup_steps)
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.opts]

    def step(self, loss: torch.Tensor) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o, s in zip(self.opts, self.scheds):
            o.step()
            s.step()

    def step_unless_blown_up(self, loss: torch.Tensor) -> float | None:
        """The loss's value after one step on it, or None if training has blown up: the loss is not finite (no
        step is taken), or the step raised BLOWN_UP. The sequence testbeds record None as the run diverging."""
        value = float(loss.detach())
        if not math.isfinite(value):
            return None
        try:
            self.step(loss)
        except BLOWN_UP:
            return None
        return value


def log_mechanism(log: dict[str, list], model: nn.Module, forward: Callable[[], object], queries=None) -> None:
    """Append one evaluation point of the attention metrics to log (metric -> list over evaluations)."""
    was_training = model.training
    model.eval()
    for name, per_layer in attention_metrics(model, forward, queries=queries).items():
        log.setdefault(name, []).append(per_layer)
    model.train(was_training)


# ---------------------------------------------------------------------------------------------
# The sweep protocol of the sequence testbeds (lm, mqar): every arm of the suite but the ablations
# ---------------------------------------------------------------------------------------------

SEQUENCE_ARMS = (
    "adamw",
    "adamw-orthoinit",
    "frozen",
    "stiefel-adam",
    "stiefel-sgd",
    "adamw-qk-nodecay",
    "orthogonal-param",
    "qk-norm",
    "muon",
    "stiefel-adam-temp",
)
# The arms each sequence testbed's sweep tunes: its main arms, the bounded-logit arms, and the factorial's others
SWEPT_ARMS = tuple(dict.fromkeys(SEQUENCE_ARMS + BOUNDED_ARMS + FACTORIAL_ARMS))
# By the rate each arm sweeps (`Arm.swept`): every parameter's lr, or W_Q, W_K's frame_lr.
LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2)
FRAME_LR_GRID = {
    "stiefel-adam": (3e-3, 1e-2, 3e-2, 1e-1),
    "stiefel-adam-temp": (3e-3, 1e-2, 3e-2, 1e-1),
    "stiefel-sgd": (0.1, 0.3, 1.0, 3.0, 10.0),
    "orthogonal-param": (3e-4, 1e-3, 3e-3, 1e-2),
    "muon": (3e-4, 1e-3, 3e-3, 1e-2),
    # stiefel-adam's grid with the value its lm sweep had to add past the edge (0.3), fixed before their sweeps
    "stiefel-adam-bounded": (3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
    "stiefel-adam-bounded-temp": (3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
    # The factorial's arms, fixed before their sweeps. SGD with momentum on ordinary W_Q, W_K: its decay shrinks
    # them by lr * weight_decay per step, so the grid stops at 1. Manifold Muon's step has spectral norm lr, about
    # sqrt(r) times StiefelAdam's Frobenius-normalised step per unit rate: stiefel-adam's grid and one below it.
    # Kong et al.'s Adam is elementwise (a step of about lr per entry): AdamW's scale. Landing: StiefelAdam's.
    "sgd": (1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "qk-norm-sgd": (1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "sgd-nodecay": (1e-2, 3e-2, 1e-1, 3e-1, 1.0),  # sgd's grid, fixed before its runs
    "qk-norm-muon": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "stiefel-muon": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "stiefel-muon-bounded": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "stiefel-sgd-bounded": (0.1, 0.3, 1.0, 3.0, 10.0),
    "kong-stiefel-adam": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    "landing-stiefel-adam": (3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
}


def anchor_lr(profiles: dict, profile: str) -> float | None:
    """The lr of a frame arm's other parameters (everything but W_Q, W_K): adamw's swept choice, so that
    frame arms differ from adamw in the query-key path only. The smoke profile's own lr; None until the
    sweep's first stage has chosen adamw's."""
    prof = profiles[profile]
    if profile == "smoke":
        return prof["lr"]
    return prof["tuned"].get("adamw", {}).get("lr")


def sweep_points(
    profile: str, extended: dict[str, tuple[float, ...]] | None = None, anchor: float | None = None
) -> list[tuple[str, dict[str, float]]]:
    """(arm, rates) of a sequence testbed's sweep, in two stages. First the arms that sweep every
    parameter's lr; then, once adamw's choice `anchor` is known (None: not yet planned), the frame arms'
    frame_lr with their other parameters at lr=anchor. extended: arm -> values a family's sweep adds past
    an edge of the arm's grid (the protocol, when the best value sits on that edge). The smoke profile
    takes two values per arm: it only has to run."""
    extended = extended or {}
    unknown = set(extended) - set(SWEPT_ARMS)
    if unknown:
        raise ValueError(f"grid extensions for arms that do not sweep: {sorted(unknown)}")
    points = []
    for arm in sorted(SWEPT_ARMS, key=lambda a: arm_spec(a).swept != "lr"):
        which = arm_spec(arm).swept
        if which != "lr" and anchor is None:
            continue
        grid = LR_GRID if which == "lr" else FRAME_LR_GRID[arm]
        if profile == "smoke":
            grid = grid[1:3]
        else:
            grid = tuple(grid) + tuple(x for x in extended.get(arm, ()) if x not in grid)
        points += [(arm, {which: x} if which == "lr" else {"lr": anchor, which: x}) for x in grid]
    return points


def sweep_note(family: str, profiles: dict, profile: str) -> str:
    """What the CLI says about a sweep whose second stage is not planned yet ("" when it is)."""
    if anchor_lr(profiles, profile) is not None:
        return ""
    return (
        f"stage one of two: the frame arms' frame_lr is swept once adamw's lr is entered in "
        f"{family}.PROFILES[{profile!r}]['tuned'] (their other parameters train at that lr); then run this again"
    )


def tuned_rates(family: str, profiles: dict, profile: str, arm: str, result_split: str, split: str) -> dict:
    """The rates the profile's sweep chose for arm: {"lr": ..., "frame_lr": ...}; a frame arm's lr is
    adamw's choice (`anchor_lr`). The profile's own rates for the sweep itself and the smoke profile. An
    untuned arm of a result run is NotReady."""
    tuned = profiles[profile]["tuned"].get(arm, {})
    frame_arm = arm_spec(arm).swept != "lr"
    anchor = anchor_lr(profiles, profile)
    if split == result_split and profile != "smoke" and (not tuned or (frame_arm and anchor is None)):
        missing = f"adamw, whose lr the frame arm {arm!r} trains its other parameters at," if tuned else f"arm {arm!r}"
        raise NotReady(
            f"{family} profile {profile!r} has no learning rate chosen for {missing} yet: run "
            f"`stiefel-attention {family} --experiment lr-sweep --profile {profile}` and enter the best "
            f"rates in {family}.PROFILES[{profile!r}]['tuned']"
        )
    prof = profiles[profile]
    frame_lr = prof["sgd_frame_lr"] if arm == "stiefel-sgd" else prof["frame_lr"]
    lr = anchor if frame_arm and anchor is not None else prof["lr"]
    return {"lr": tuned.get("lr", lr), "frame_lr": tuned.get("frame_lr", frame_lr)}


def default_seeds(defaults: dict[str, int], experiment: str, profile: str) -> int:
    """The protocol's seeds; the smoke profile only has to run (one seed for a sweep, two otherwise)."""
    if profile == "smoke":
        return 1 if experiment == "lr-sweep" else 2
    return defaults[experiment]


def run_timings(t_start: float, t_train: float, device) -> dict:
    """A record's timings: seconds training, seconds in all (since t_start, a perf_counter reading), where it ran
    and on how many threads."""
    return {
        "train_s": t_train,
        "total_s": time.perf_counter() - t_start,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }
