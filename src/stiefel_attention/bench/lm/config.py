"""The lm testbed's configuration: its profiles (model, data, training and each arm's tuned rates) and the
constants of its experiments, fixed before their runs."""

from __future__ import annotations

from ..arms import BOUNDED_ARMS
from ..training import SEQUENCE_ARMS

__all__ = [
    "DEFAULT_SEEDS",
    "EXPERIMENTS",
    "LR_MULTIPLIERS",
    "MAIN_ARMS",
    "PROFILES",
    "SAMPLE_CHARS",
    "SCALING_STEPS",
    "STABILITY_RUNS",
    "SWEEP_EXTENSIONS",
]

_NANOGPT = dict(lr=1e-3, frame_lr=1e-2, weight_decay=0.1, betas=[0.9, 0.99], max_step=0.1, sgd_frame_lr=1.0)
PROFILES: dict[str, dict] = {
    "smoke": dict(
        model=dict(d_model=32, n_layers=1, n_heads=2, head_dim=16, mlp_ratio=2),
        context=32,
        batch=8,
        steps=40,
        eval_every=10,
        n_eval=32,
        warmup=5,
        tuned={},
        qk_clip_tau=4.0,
        **_NANOGPT,
    ),
    # About 3 min of one core per run. The number of steps is sized so that trained Q/K beat frozen ones (the
    # sensitivity line of REPORT.md), chosen on the sweep split as commit c009f98 describes; results/lm/main
    # measures that sensitivity at this size.
    "cpu": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, head_dim=16, mlp_ratio=4),
        context=64,
        batch=32,
        steps=2400,
        eval_every=200,
        n_eval=256,
        warmup=50,
        # the lr-sweep's choices (results/lm/lr-sweep, 2 seeds, scored on held-out training text); the frame
        # arms' other parameters train at adamw's lr (training.anchor_lr)
        tuned={
            "adamw": {"lr": 1e-2},
            "adamw-orthoinit": {"lr": 1e-2},
            "adamw-qk-nodecay": {"lr": 1e-2},
            "qk-norm": {"lr": 1e-2},
            "frozen": {"lr": 3e-2},
            "stiefel-sgd": {"frame_lr": 3.0},
            "stiefel-adam": {"frame_lr": 0.1},
            "orthogonal-param": {"frame_lr": 1e-2},
            "muon": {"frame_lr": 3e-2},
            "stiefel-adam-temp": {"frame_lr": 0.3},
            "adamw-bounded": {"lr": 1e-2},
            "stiefel-adam-bounded": {"frame_lr": 0.3},
            "stiefel-adam-bounded-temp": {"frame_lr": 0.3},
            "stiefel-muon": {"frame_lr": 1e-2},
            "stiefel-muon-bounded": {"frame_lr": 3e-2},
            "qk-norm-muon": {"frame_lr": 0.3},
            "qk-norm-sgd": {"frame_lr": 1e-2},
            "sgd": {"frame_lr": 1e-5},
            "stiefel-sgd-bounded": {"frame_lr": 1.0},
            "kong-stiefel-adam": {"frame_lr": 1e-2},
            "landing-stiefel-adam": {"frame_lr": 1.0},
            "sgd-nodecay": {"frame_lr": 1.0},
        },
        # lr-stability's QK-Clip threshold, fixed before its runs: above the largest attention logit of every
        # adamw run of `main` (m = 1; 12 seeds, largest head at the end 32.5-44.7), so that it binds only where
        # logits grow past normal training, as QK-Clip is used
        qk_clip_tau=50.0,
        **_NANOGPT,
    ),
    # nanoGPT's shakespeare_char size (6 layers, 384 wide, 6 heads, context 256), for a GPU; no dropout here
    "paper": dict(
        model=dict(d_model=384, n_layers=6, n_heads=6, head_dim=64, mlp_ratio=4),
        context=256,
        batch=64,
        steps=5000,
        eval_every=250,
        n_eval=500,
        warmup=100,
        tuned={},
        qk_clip_tau=None,  # fixed from this profile's adamw runs of `main` before its lr-stability runs
        **_NANOGPT,
    ),
}
MAIN_ARMS = SEQUENCE_ARMS + BOUNDED_ARMS
SCALING_STEPS = (0.5, 1.0, 2.0)  # training steps, as multiples of the profile's
# lr-stability (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities"):
# every rate an arm has (its tuned rates) times m; adamw also with QK-Clip at the profile's qk_clip_tau. At m = 1
# the plain arms' cells are main's.
STABILITY_RUNS = (
    ("adamw", False),
    ("qk-norm", False),
    ("adamw", True),
    ("stiefel-adam", False),
    ("stiefel-adam-temp", False),
    ("frozen", False),
    *((arm, False) for arm in BOUNDED_ARMS),
)
LR_MULTIPLIERS = {"smoke": (1.0, 64.0), "cpu": (0.25, 1.0, 4.0, 16.0, 64.0), "paper": (0.25, 1.0, 4.0, 16.0, 64.0)}
EXPERIMENTS = ("main", "lr-sweep", "scaling", "lr-stability", "factorial", "factorial-stability")
DEFAULT_SEEDS = {"main": 12, "lr-sweep": 2, "scaling": 6, "lr-stability": 3, "factorial": 12, "factorial-stability": 3}
# Values an arm's sweep adds past the edge of its grid (training.LR_GRID, FRAME_LR_GRID), entered when the
# best value sat on that edge: results/lm/lr-sweep/summary.md flags such arms.
SWEEP_EXTENSIONS: dict[str, dict[str, tuple[float, ...]]] = {
    "cpu": {
        **{arm: (3e-2,) for arm in ("adamw", "adamw-orthoinit", "adamw-qk-nodecay", "qk-norm", "adamw-bounded")},
        "frozen": (3e-2, 1e-1),
        "muon": (3e-2, 1e-1),
        "orthogonal-param": (3e-2,),
        "stiefel-adam": (0.3,),
        "stiefel-adam-temp": (0.3, 1.0),
        "stiefel-adam-bounded": (1.0,),
        "stiefel-adam-bounded-temp": (1.0,),
        "qk-norm-sgd": (1e-3, 3e-3),
        "qk-norm-muon": (0.3, 1.0),
        # sgd (the model's weight decay coupled into the gradient) improves as its rate falls down to a plateau,
        # 1e-5 to 1e-4 within 0.004 nats/char, where W_Q, W_K barely leave their initialisation: its grid stops there
        "sgd": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3),
        "sgd-nodecay": (3.0, 10.0),
        "landing-stiefel-adam": (1.0, 3.0),
    },
}
SAMPLE_CHARS = 300
