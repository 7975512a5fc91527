"""The arms of the experiments: how each one builds its attention and steps W_Q, W_K.

An arm is two choices, made on the library's public API only: the options of every
`StiefelAttention` in the model (`attention`), and the optimizers that train the model
(`optimizers(model, hp)`). Every arm trains all parameters other than W_Q, W_K (and the
query-key gains and temperatures some arms add) the same way: AdamW with nanoGPT's decay rule
(`stiefel_attention.param_groups`). Arms differ only in the query-key path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..nn import qk_parameters
from ..optim import LandingStiefelAdam, StiefelAdam, StiefelMuon, StiefelSGD, param_groups

__all__ = [
    "FACTORIAL_HELP",
    "ARMS",
    "BOUNDED_ARMS",
    "BOUNDED_MAX_TEMPERATURE",
    "Arm",
    "HyperParameters",
    "arm_spec",
    "build_optimizers",
    "attention_options",
]


@dataclass(frozen=True)
class HyperParameters:
    """What an experiment's config says about optimisation; each arm reads the part it needs."""

    lr: float
    weight_decay: float
    frame_lr: float | None = None  # learning rate of W_Q, W_K where the arm steps them apart (default: lr)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    frame_eps: float | None = None  # StiefelAdam's eps on frames (default: eps)
    max_step: float | None = None
    sgd_momentum: float = 0.9

    @property
    def qk_lr(self) -> float:
        return self.lr if self.frame_lr is None else self.frame_lr


Builder = Callable[[nn.Module, HyperParameters], list[Optimizer]]


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    attention: dict[str, Any]  # StiefelAttention options: qk, qk_init, qk_norm, qk_input_norm, temperature, ...
    optimizers: Builder
    swept: str = "lr"  # the learning rate its validation sweep chooses: "lr" (every parameter) or "frame_lr" (W_Q, W_K)
    trust_region: bool = False  # the frames' rule is the paper's Adam, which takes max_step
    decays_qk: bool = False  # weight decay acts on W_Q, W_K

    @property
    def qk(self) -> str:
        return self.attention["qk"]

    @property
    def orthonormal_qk(self) -> bool:
        """W_Q, W_K stay orthonormal frames throughout training (on St(d, r), frozen, or parametrized)."""
        return self.qk in ("stiefel", "frozen", "parametrized")


def _adamw(model: nn.Module, hp: HyperParameters, no_decay=()) -> Optimizer:
    """AdamW on every trainable parameter (StiefelAdam with no frame group is exactly torch's AdamW)."""
    return StiefelAdam(param_groups(model, hp.weight_decay, no_decay=no_decay), lr=hp.lr, betas=hp.betas, eps=hp.eps)


def _without_qk(model: nn.Module, hp: HyperParameters) -> tuple[list[dict], list[nn.Parameter]]:
    """(param_groups of everything but W_Q, W_K; the W_Q, W_K tensors)."""
    qk = [p for _, p in qk_parameters(model) if p.requires_grad]
    ids = {id(p) for p in qk}
    groups = param_groups(model, hp.weight_decay)
    for g in groups:
        g["params"] = [p for p in g["params"] if id(p) not in ids]
    return [g for g in groups if g["params"]], qk


def _qk_apart(model: nn.Module, hp: HyperParameters, lr: float) -> list[dict]:
    """param_groups with W_Q, W_K moved to a group of their own: no decay, learning rate `lr`."""
    groups, qk = _without_qk(model, hp)
    return groups + [{"params": qk, "weight_decay": 0.0, "lr": lr, "stiefel": False}]


def _stiefel(rule: str, **frame_options) -> Builder:
    def build(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
        eps = hp.eps if hp.frame_eps is None else hp.frame_eps
        if rule == "adam":
            groups = param_groups(model, hp.weight_decay, frame_lr=hp.qk_lr, eps=eps, **frame_options)
            return [
                StiefelAdam(
                    groups, lr=hp.lr, betas=hp.betas, eps=hp.eps, max_step=hp.max_step, weight_decay=hp.weight_decay
                )
            ]
        groups = param_groups(model, hp.weight_decay, frame_lr=hp.qk_lr)
        return [
            StiefelSGD(
                groups,
                lr=hp.lr,
                momentum=hp.sgd_momentum,
                max_step=hp.max_step,
                weight_decay=hp.weight_decay,
                betas=hp.betas,
                eps=hp.eps,
            )
        ]

    return build


def _muon(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
    """torch.optim.Muon on W_Q, W_K, each projection one nn.Linear-shaped (H*r, d_model) matrix; AdamW elsewhere.

    `adjust_lr_fn="match_rms_adamw"` scales Muon's step to AdamW's update RMS (0.2 sqrt(max(A, B))),
    so the arm's learning rate is on AdamW's scale. Decay on W_Q, W_K is Muon's decoupled decay
    with the model's weight_decay, as AdamW applies it to the other matrices.
    """
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        raise RuntimeError(f"the muon arm needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    groups, qk = _without_qk(model, hp)
    rest = StiefelAdam(groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)
    return [rest, muon_cls(qk, lr=hp.qk_lr, weight_decay=hp.weight_decay, adjust_lr_fn="match_rms_adamw")]


def _sgd(model: nn.Module, hp: HyperParameters, qk_decay: bool = True) -> list[Optimizer]:
    """SGD with momentum (hp.sgd_momentum) on W_Q, W_K at frame_lr, with the model's weight decay or none; AdamW
    elsewhere: the SGD column's Euclidean cells of the geometry x optimizer table, and their decay-free control.

    torch's SGD adds the decay to the gradient: a fixed L2 penalty (weight_decay / 2) |W|^2 whatever the learning
    rate, where AdamW's and Muon's decoupled decay shrinks by lr * weight_decay per step."""
    groups, qk = _without_qk(model, hp)
    rest = StiefelAdam(groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)
    decay = hp.weight_decay if qk_decay else 0.0
    return [rest, torch.optim.SGD(qk, lr=hp.qk_lr, momentum=hp.sgd_momentum, weight_decay=decay)]


def _stiefel_muon(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
    """StiefelMuon (manifold Muon) on the frames at frame_lr, its defaults otherwise; AdamW elsewhere."""
    groups = param_groups(model, hp.weight_decay, frame_lr=hp.qk_lr)
    return [StiefelMuon(groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)]


def _landing(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
    """LandingStiefelAdam (no retraction; frames within 2 max_step^2 of the manifold) at frame_lr; AdamW elsewhere."""
    groups = param_groups(model, hp.weight_decay, frame_lr=hp.qk_lr)
    return [LandingStiefelAdam(groups, lr=hp.lr, betas=hp.betas, eps=hp.eps, max_step=hp.max_step)]


def _kong(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
    """Kong, Wang & Tao's Stiefel Adam on the frames (their paper's settings: betas (0.9, 0.99), eps 1e-5) at
    frame_lr; AdamW with nanoGPT's decay rule on everything else, as every arm."""
    from .kong import KongStiefelAdam

    groups, qk = _without_qk(model, hp)
    rest = StiefelAdam(groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)
    return [rest, KongStiefelAdam(qk, lr=hp.qk_lr, betas=(0.9, 0.99), eps=1e-5)]


def _frozen(model: nn.Module, hp: HyperParameters) -> list[Optimizer]:
    return [_adamw(model, hp)]  # frozen W_Q, W_K do not require a gradient, so param_groups leaves them out


_EUCLID = dict(qk="euclidean", qk_init="standard")
_FRAMES = dict(qk="stiefel", qk_init="orthonormal")
# The cap of the bounded arm's learnable temperature, fixed before its runs: with it the bound is 4 d_model/sqrt(r),
# 64 at the lm cpu widths, above the largest attention logit of adamw's lm runs at their tuned rate (32.5-46.7), so
# the cap binds only where logits grow past normal training (as lm's QK-Clip threshold, 50, was chosen).
BOUNDED_MAX_TEMPERATURE = 4.0

ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm(
            "adamw",
            "baseline: Q/K ordinary matrices, usual init, AdamW",
            _EUCLID,
            lambda m, hp: [_adamw(m, hp)],
            decays_qk=True,
        ),
        Arm(
            "adamw-orthoinit",
            "control: AdamW from the Stiefel arm's frames",
            dict(qk="euclidean", qk_init="orthonormal"),
            lambda m, hp: [_adamw(m, hp)],
            decays_qk=True,
        ),
        Arm(
            "stiefel-adam", "StiefelAdam on Q/K frames", _FRAMES, _stiefel("adam"), swept="frame_lr", trust_region=True
        ),
        Arm("stiefel-sgd", "fixed-step Riemannian SGD on Q/K frames", _FRAMES, _stiefel("sgd"), swept="frame_lr"),
        Arm("frozen", "orthonormal Q/K, never updated", dict(qk="frozen", qk_init="orthonormal"), _frozen),
        Arm(
            "no-projector",
            "ablation: StiefelAdam without the tangent projection",
            _FRAMES,
            _stiefel("adam", projector=False),
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "coordinate-moment",
            "ablation: elementwise second moment (breaks O(d)-equivariance)",
            _FRAMES,
            _stiefel("adam", second_moment="coordinate"),
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "adamw-qk-nodecay",
            "control: AdamW, usual init, no weight decay on W_Q, W_K",
            _EUCLID,
            lambda m, hp: [StiefelAdam(_qk_apart(m, hp, hp.lr), lr=hp.lr, betas=hp.betas, eps=hp.eps)],
        ),
        Arm(
            "orthogonal-param",
            "control: orthonormal Q/K by torch's orthogonal parametrization, AdamW, no decay on them",
            dict(qk="parametrized", qk_init="orthonormal"),
            lambda m, hp: [StiefelAdam(_qk_apart(m, hp, hp.qk_lr), lr=hp.lr, betas=hp.betas, eps=hp.eps)],
            swept="frame_lr",
        ),
        Arm(
            "qk-norm",
            "baseline: per-head RMSNorm on q and k (learnable gains), AdamW",
            dict(_EUCLID, qk_norm=True),
            lambda m, hp: [_adamw(m, hp)],
            decays_qk=True,
        ),
        Arm(
            "muon",
            "baseline: torch.optim.Muon on W_Q, W_K (nn.Linear layout), AdamW elsewhere",
            dict(_EUCLID, qk_layout="linear"),
            _muon,
            swept="frame_lr",
            decays_qk=True,
        ),
        Arm(
            "stiefel-adam-temp",
            "StiefelAdam frames plus a learnable log-temperature per head",
            dict(_FRAMES, temperature=True),
            _stiefel("adam"),
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "kong-stiefel-adam",
            "baseline: Kong, Wang & Tao's momentum Stiefel Adam (ICLR 2023) on Q/K frames, AdamW elsewhere",
            _FRAMES,
            _kong,
            swept="frame_lr",
        ),
        Arm(
            "sgd",
            "baseline: SGD with momentum on ordinary Q/K, AdamW elsewhere",
            _EUCLID,
            _sgd,
            swept="frame_lr",
            decays_qk=True,
        ),
        Arm(
            "sgd-nodecay",
            "control: SGD with momentum on ordinary Q/K without their weight decay, AdamW elsewhere",
            _EUCLID,
            lambda m, hp: _sgd(m, hp, qk_decay=False),
            swept="frame_lr",
        ),
        Arm(
            "qk-norm-muon",
            "QK-norm with torch's Muon on W_Q, W_K (nn.Linear layout), AdamW elsewhere",
            dict(_EUCLID, qk_norm=True, qk_layout="linear"),
            _muon,
            swept="frame_lr",
            decays_qk=True,
        ),
        Arm(
            "qk-norm-sgd",
            "QK-norm with SGD and momentum on W_Q, W_K, AdamW elsewhere",
            dict(_EUCLID, qk_norm=True),
            _sgd,
            swept="frame_lr",
            decays_qk=True,
        ),
        Arm("stiefel-muon", "manifold Muon (StiefelMuon) on Q/K frames", _FRAMES, _stiefel_muon, swept="frame_lr"),
        Arm(
            "landing-stiefel-adam",
            "StiefelAdam without a retraction (the landing method) on Q/K frames",
            _FRAMES,
            _landing,
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "stiefel-adam-bounded",
            "StiefelAdam frames reading a gain-free RMS-normalised input: every logit bounded by d/sqrt(r)",
            dict(_FRAMES, qk_input_norm=True),
            _stiefel("adam"),
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "adamw-bounded",
            "control: the bounded arm's input norm on ordinary Q/K, AdamW (the norm without the frames)",
            dict(_EUCLID, qk_input_norm=True),
            lambda m, hp: [_adamw(m, hp)],
            decays_qk=True,
        ),
        Arm(
            "stiefel-adam-bounded-temp",
            "the bounded frames plus a learnable temperature per head capped at 4 (bound 4 d/sqrt(r))",
            dict(_FRAMES, qk_input_norm=True, temperature=True, max_temperature=BOUNDED_MAX_TEMPERATURE),
            _stiefel("adam"),
            swept="frame_lr",
            trust_region=True,
        ),
        Arm(
            "stiefel-muon-bounded",
            "manifold Muon on bounded frames (qk_input_norm)",
            dict(_FRAMES, qk_input_norm=True),
            _stiefel_muon,
            swept="frame_lr",
        ),
        Arm(
            "stiefel-sgd-bounded",
            "fixed-step Riemannian SGD on bounded frames (qk_input_norm)",
            dict(_FRAMES, qk_input_norm=True),
            _stiefel("sgd"),
            swept="frame_lr",
        ),
    )
}
# The bounded-logit arms: frames whose logit is bounded by construction, and their controls.
BOUNDED_ARMS = ("stiefel-adam-bounded", "adamw-bounded", "stiefel-adam-bounded-temp")
# The title's question as a table: rows, the geometry of W_Q, W_K; columns, the optimizer family that steps them
# (everything else AdamW in every cell); each cell an arm.
FACTORIAL_GEOMETRIES = ("euclidean", "qk-norm", "frames", "bounded frames")
FACTORIAL_OPTIMIZERS = ("adam", "muon", "sgd")
# what a testbed's `factorial` experiment answers (its line in `list` and --help)
FACTORIAL_HELP = "geometry x optimizer on W_Q, W_K (12 cells, 3 variants), 12 paired seeds: which factor matters"
FACTORIAL: dict[tuple[str, str], str] = {
    ("euclidean", "adam"): "adamw",
    ("euclidean", "muon"): "muon",
    ("euclidean", "sgd"): "sgd",
    ("qk-norm", "adam"): "qk-norm",
    ("qk-norm", "muon"): "qk-norm-muon",
    ("qk-norm", "sgd"): "qk-norm-sgd",
    ("frames", "adam"): "stiefel-adam",
    ("frames", "muon"): "stiefel-muon",
    ("frames", "sgd"): "stiefel-sgd",
    ("bounded frames", "adam"): "stiefel-adam-bounded",
    ("bounded frames", "muon"): "stiefel-muon-bounded",
    ("bounded frames", "sgd"): "stiefel-sgd-bounded",
}
# Rules beside the table's cells, each compared, paired by seed, with the cell it sits beside (geometry, optimizer):
# Adam-type prior art and a retraction-free rule on frames; the Euclidean SGD cell without the decay on W_Q, W_K
# (torch's SGD turns the decay into a fixed L2 penalty, unlike the other columns' decoupled decay)
FACTORIAL_VARIANTS: dict[str, tuple[str, str]] = {
    "kong-stiefel-adam": ("frames", "adam"),
    "landing-stiefel-adam": ("frames", "adam"),
    "sgd-nodecay": ("euclidean", "sgd"),
}
# Every arm of a testbed's `factorial` experiment: the table's cells, then the variants
FACTORIAL_ARMS = (*FACTORIAL.values(), *FACTORIAL_VARIANTS)


def arm_spec(arm: str) -> Arm:
    """The Arm of a name; a clear error naming the valid arms otherwise."""
    try:
        return ARMS[arm]
    except KeyError:
        raise ValueError(f"unknown arm {arm!r}; choose one of: {', '.join(ARMS)}") from None


def attention_options(arm: str) -> dict[str, Any]:
    """The StiefelAttention options of an arm, for a model constructor's keyword arguments."""
    return dict(arm_spec(arm).attention)


def build_optimizers(model: nn.Module, arm: str, hp: HyperParameters) -> list[Optimizer]:
    """The arm's optimizers for a model built with `attention_options(arm)`; together they step every parameter."""
    spec = arm_spec(arm)
    modes = {getattr(m, "qk", None) for m in model.modules() if hasattr(m, "routing_parameters")}
    if modes and modes != {spec.qk}:
        raise ValueError(f"arm {arm!r} needs a model built with qk={spec.qk!r}; this model has qk={sorted(modes)}")
    return spec.optimizers(model, hp)
