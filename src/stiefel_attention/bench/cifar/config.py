"""The CIFAR-10 testbed's configuration: its profiles, the arms and grids of each experiment, fixed before their
runs (the learning rates chosen by `lr-sweep` on a validation split)."""

from __future__ import annotations

from ..arms import BOUNDED_ARMS, FACTORIAL_ARMS

__all__ = [
    "ABLATION_ARMS",
    "CONTROL_ARMS",
    "CONTROL_LR_GRID",
    "DECAY_VALUES",
    "DEFAULT_SEEDS",
    "DOWNLOAD_DIR",
    "EPS_VALUES",
    "EXPERIMENTS",
    "FACTORIAL_NEW_ARMS",
    "FRAME_LR_GRID",
    "LR_GRID",
    "MAIN_ARMS",
    "PROFILES",
    "SCALING_NS",
    "SCALING_SEEDS",
]

# Learning rates were chosen once per profile by the `lr-sweep` experiment on a validation
# split carved from train (results/cifar/lr-sweep/summary.md): for `cpu`, AdamW lr 2e-3 (of
# 5e-4..4e-3), StiefelAdam frame lr 1e-2 (of 3e-3..1e-1), fixed-step SGD frame lr 10 (of
# 0.03..30). They are then fixed for every experiment. `smoke` only has to run.
PROFILES: dict[str, dict] = {
    "smoke": dict(
        model=dict(patch_size=8, d_model=32, depth=1, n_heads=2, head_dim=8, mlp_ratio=2),
        n_main=500,
        epochs=2,
        batch_size=64,
        eval_every=1,
        n_val=200,
        lr=2e-3,
        frame_lr=1e-2,
        tuned={"stiefel-sgd": {"frame_lr": 0.3}},
        weight_decay=0.05,
        max_step=0.1,
        warmup_epochs=0,
        n_test=1000,
    ),
    # One n=10k run: 20 epochs x ~2 s + 10 evaluations x ~1.3 s on one thread (measured): ~1 min.
    # Patch 8 gives 16 tokens, enough for attention to matter while keeping 2 cores busy for an hour
    # per 60 runs rather than a day.
    "cpu": dict(
        model=dict(patch_size=8, d_model=64, depth=2, n_heads=4, head_dim=16, mlp_ratio=2),
        n_main=10000,
        epochs=20,
        batch_size=128,
        eval_every=2,
        n_val=5000,
        lr=2e-3,
        frame_lr=1e-2,
        # the lr-sweep's choices (results/cifar/lr-sweep, 2 seeds on the validation split); adamw and
        # stiefel-adam chose the profile's lr and frame_lr
        tuned={
            "stiefel-sgd": {"frame_lr": 10.0},
            "adamw-qk-nodecay": {"lr": 4e-3},
            "qk-norm": {"lr": 2e-3},
            "orthogonal-param": {"frame_lr": 3.2e-2},
            "muon": {"frame_lr": 5e-4},
            "stiefel-adam-temp": {"frame_lr": 1e-2},
            "adamw-bounded": {"lr": 2e-3},
            "stiefel-adam-bounded": {"frame_lr": 1e-3},
            "stiefel-adam-bounded-temp": {"frame_lr": 3e-4},
            # the factorial's arms (their grids extended once where the best sat on the upper edge)
            "sgd": {"frame_lr": 3.0},
            "qk-norm-sgd": {"frame_lr": 1.0},
            "qk-norm-muon": {"frame_lr": 2.5e-4},
            "stiefel-muon": {"frame_lr": 0.3},
            "stiefel-muon-bounded": {"frame_lr": 0.3},
            "stiefel-sgd-bounded": {"frame_lr": 3.0},
            "kong-stiefel-adam": {"frame_lr": 3e-2},
            "landing-stiefel-adam": {"frame_lr": 1e-2},
            "sgd-nodecay": {"frame_lr": 1e-2},
        },
        weight_decay=0.05,
        max_step=0.1,
        warmup_epochs=1,
        n_test=None,
    ),
}
# For a GPU; its learning rates have not been swept (they are the cpu profile's).
PROFILES["paper"] = dict(
    PROFILES["cpu"],
    model=dict(patch_size=4, d_model=256, depth=6, n_heads=8, head_dim=32, mlp_ratio=2),
    epochs=100,
    batch_size=256,
    eval_every=5,
    warmup_epochs=5,
)

DOWNLOAD_DIR = "data"  # where a missing CIFAR-10 is downloaded (the first place resolve_cifar_source looks)
MAIN_ARMS = ("adamw", "adamw-orthoinit", "stiefel-adam", "stiefel-sgd", "frozen")
# The controls and modern baselines (issue: when does the geometry dominate?), each at the learning
# rate its own validation sweep chose; run beside adamw, frozen and stiefel-adam.
CONTROL_ARMS = ("adamw-qk-nodecay", "orthogonal-param", "qk-norm", "muon", "stiefel-adam-temp", *BOUNDED_ARMS)
DECAY_VALUES = (0.0, 0.5)  # weight decay of the `decay` experiment, beside the profile's 0.05
ABLATION_ARMS = ("stiefel-adam", "no-projector", "coordinate-moment", "stiefel-sgd", "adamw")
SCALING_NS = (1000, 5000, 10000, 50000)
# Paired seeds per n in the scaling experiment when --seeds is not given: 12 where runs are cheap
# (n=10k is shared with `main`), 5 at n=50k (a run there costs ~4 min of one core). With 5 pairs
# the smallest two-sided Wilcoxon p is 1/16, so only the t-test can reach p < 0.05 at n=50k.
SCALING_SEEDS = {1000: 12, 5000: 12, 10000: 12, 50000: 5}
# Largest first after the baseline: eps=0.1 is the paper's targeted point (-2.6 pp), so a partial run has it.
EPS_VALUES = (1e-8, 0.1, 1e-2, 1e-3, 1e-4)
# The geometry x optimizer table's arms that no other experiment runs; each at the rate its own sweep chose
FACTORIAL_NEW_ARMS = tuple(a for a in FACTORIAL_ARMS if a not in (*MAIN_ARMS, *CONTROL_ARMS))
EXPERIMENTS = ("main", "scaling", "ablation", "eps", "movement", "lr-sweep", "controls", "decay", "factorial")
# Paired seeds per experiment in our protocol (the CLI's defaults for the cpu and paper profiles).
DEFAULT_SEEDS = {
    "main": 12,
    "scaling": 12,
    "ablation": 12,
    "eps": 12,
    "movement": 12,
    "lr-sweep": 2,
    "controls": 12,
    "decay": 12,
    "factorial": 12,
}

# Grids of the learning-rate sweep (validation split, 2 seeds): AdamW's lr for the adamw arm,
# then the frames' lr for each Stiefel rule with the non-frame parameters at the profile's lr. The
# fixed-step grid was extended twice because its best value sat on the edge (1.0, then 3.0).
LR_GRID = (5e-4, 1e-3, 2e-3, 4e-3)
FRAME_LR_GRID = {"stiefel-adam": (3e-3, 1e-2, 3e-2, 1e-1), "stiefel-sgd": (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)}
# The control arms' grids: the rate their arm sweeps (`Arm.swept`), every other rate at the profile's.
# AdamW-scale rates for AdamW on the parametrization's originals and for Muon (match_rms_adamw).
CONTROL_LR_GRID = {
    "adamw-qk-nodecay": (*LR_GRID, 8e-3),  # its best value sat on LR_GRID's upper edge
    "qk-norm": LR_GRID,
    "orthogonal-param": (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2),  # best sat on the upper edge twice
    "muon": (1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3),  # best sat on the 5e-4 edge
    "stiefel-adam-temp": FRAME_LR_GRID["stiefel-adam"],
    # the bounded frames' best sat on the grid's lower edge twice (3e-3, then 1e-3): the second time the grid
    # took two values below it at once
    "stiefel-adam-bounded": (1e-4, 3e-4, 1e-3, *FRAME_LR_GRID["stiefel-adam"]),
    "adamw-bounded": LR_GRID,
    "stiefel-adam-bounded-temp": (1e-4, 3e-4, 1e-3, *FRAME_LR_GRID["stiefel-adam"]),
    # The factorial's arms, fixed before their sweeps: SGD with momentum on ordinary W_Q, W_K (its decay shrinks
    # them by lr * weight_decay per step); Muon on QK-norm's W_Q, W_K at Muon's grid around its choice; manifold
    # Muon (a step of spectral norm lr) around stiefel-adam's; the fixed-step rule's grid on bounded frames;
    # Kong et al.'s elementwise Adam on AdamW's scale; landing on stiefel-adam's.
    # sgd, qk-norm-sgd, both manifold Muons and Kong's best sat on the grid's upper edge: each grid took two
    # values above it at once
    "sgd": (1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0),
    "qk-norm-sgd": (1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0),
    # sgd's extended grid, fixed before its runs; its best sat on the lower edge: two values below it at once
    "sgd-nodecay": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0),
    "qk-norm-muon": (1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3),
    "stiefel-muon": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "stiefel-muon-bounded": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "stiefel-sgd-bounded": FRAME_LR_GRID["stiefel-sgd"][1:],
    "kong-stiefel-adam": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
    "landing-stiefel-adam": (1e-3, *FRAME_LR_GRID["stiefel-adam"]),
}
