"""The paper's claimed numbers, in one table that the reports read (see shared/paper/abstract.md).

Each comparison names an arm and a baseline run on the same seeds; `paper` is the claimed
mean difference in percentage points (arm - baseline) where the paper gives one, `kind` says
whether the paper claims an effect or the absence of one, and `text` quotes the claim.
"""

from __future__ import annotations

CIFAR_COMPARISONS: dict[str, list[dict]] = {
    "main": [
        dict(
            arm="stiefel-adam",
            baseline="adamw",
            kind="effect",
            paper=6.79,
            text="+6.79 pp over AdamW at n=10k, 12 paired starts, t=38.33, 12/12 (v2); v1: +8.98 pp, t=60.6",
        ),
        dict(
            arm="stiefel-sgd",
            baseline="adamw",
            kind="effect",
            paper=1.97,
            text="fixed-step Riemannian SGD gains +1.97 pp (v2)",
        ),
        dict(
            arm="frozen",
            baseline="adamw",
            kind="effect",
            paper=1.69,
            text="+1.69 pp of that comes from frozen orthonormal initialization alone (v2)",
        ),
        dict(
            arm="frozen",
            baseline="stiefel-sgd",
            kind="effect",
            paper=-0.28,
            text="freezing the fixed-step frames outright costs only 0.28 pp (v1)",
        ),
        dict(
            arm="adamw-orthoinit",
            baseline="adamw",
            kind="control",
            paper=None,
            text="control: orthonormal start, Euclidean AdamW (separates initialisation from optimisation)",
        ),
        dict(
            arm="stiefel-adam",
            baseline="adamw-orthoinit",
            kind="control",
            paper=None,
            text="control: same start, Stiefel vs Euclidean optimisation",
        ),
    ],
    "ablation": [
        dict(
            arm="stiefel-adam",
            baseline="stiefel-sgd",
            kind="effect",
            paper=4.63,
            text="the scale-free step earns the gain: +4.63 pp, 12/12 (v2)",
            note=(
                "our fixed-step arm runs at the frame lr its validation sweep chose (10); see the movement "
                "summary for how far that moves the frames compared with the paper's description"
            ),
        ),
        dict(
            arm="no-projector",
            baseline="stiefel-adam",
            kind="null",
            paper=0.0,
            text="nothing measurable to the projector",
        ),
        dict(
            arm="coordinate-moment",
            baseline="stiefel-adam",
            kind="null",
            paper=0.0,
            text="nothing measurable to equivariance (coordinate-wise second moment)",
            note=(
                "at the same frame lr an elementwise second moment moves every entry by ~lr, so its step is "
                "~sqrt(d r) times longer (here up to the 0.1 trust region) than the per-frame rule's ~lr: "
                "step length and equivariance change together in this arm"
            ),
        ),
        dict(
            arm="stiefel-adam",
            baseline="adamw",
            kind="effect",
            paper=6.79,
            text="reference: the main comparison on the same seeds",
        ),
    ],
    "eps": [
        dict(
            arm="eps=0.1",
            baseline="eps=1e-08",
            kind="effect",
            paper=-2.6,
            text="eps-sweep: -2.6 pp at eps=0.1, p<0.001 (v2)",
        ),
    ],
}

# Lead of stiefel-adam over adamw by training-set size (v2: +1.9 pp at 1k, +6.7 pp at 50k).
CIFAR_SCALING_PAPER = {1000: 1.9, 50000: 6.7}
CIFAR_SCALING_TEXT = "the lead grows with data: +1.9 pp at n=1k to +6.7 pp at n=50k (v2; v1: 'widens with data')"

# Per-step movement: a fixed-step Riemannian update moves 24-40x less than an AdamW matrix (v1).
CIFAR_MOVEMENT_PAPER = (24.0, 40.0)
CIFAR_MOVEMENT_TEXT = (
    "a fixed-step Riemannian update moves 24-40x less per step than an identically shaped AdamW matrix (v1)"
)

# Grokking (modular arithmetic).
GROK_SINGLE = dict(
    paper={"stiefel-adam": 97.0, "adamw": 61.1},
    text="a single run holds 97.0% validation accuracy at epoch 20,000 against the baseline's 61.1% (v1)",
)
GROK_STUDY_TEXT = (
    "two five-seed studies: the constrained arm does not grok better than the baseline (p=0.019, baseline wins) (v2)"
)
# v2 reads the study as "the weight-decay exemption has no grokking consequence"; measured directly by the
# controls' adamw-qk-nodecay (AdamW with W_Q, W_K exempt from decay) against adamw.
GROK_NODECAY_TEXT = "the weight-decay exemption has no grokking consequence (v2): adamw-qk-nodecay vs adamw, a+b"
GROK_SLINGSHOT = dict(
    ratio=1e6,
    text=(
        "single-seed slingshot pilot: Stiefel + targeted regularization keeps routing-frame "
        "isometry error 10^6 x lower than the unconstrained ablation through every collapse (v2)"
    ),
)
