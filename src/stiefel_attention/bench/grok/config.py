"""The grokking testbed's configuration: its profiles, the arms and operations of each experiment, and the
protocol constants that its runs, its config names and its reports share (the report reads them here)."""

from __future__ import annotations

from ..arms import BOUNDED_ARMS

__all__ = [
    "ARMS",
    "BASE",
    "CONTROL_ARMS",
    "DECAY_VALUES",
    "DEFAULT_SEEDS",
    "EXPERIMENTS",
    "GROK_THRESHOLD",
    "INTERVENTIONS",
    "INTERVENTION_KEYS",
    "PROFILES",
    "PROTOCOL_SEEDS",
    "SLINGSHOT",
    "SLINGSHOT_OPS",
    "STUDY_OPS",
    "intervention_tag",
]

GROK_THRESHOLD = 0.95  # validation accuracy that counts as grokked, in runs and in their reports
# The slingshot pilots, in the order they were planned. Division is the slingshot paper's task. Addition
# was added after the division pilot of the `cpu` profile never generalised in either arm (best
# validation accuracy < 2%): with nothing grokked, "stable grokking" is untestable there, while addition
# is the task on which this profile's Stiefel arm demonstrably groks (the `study`).
SLINGSHOT_OPS = ("/", "+")
PROTOCOL_SEEDS = 5  # paired seeds of the interventions experiment (grok.DEFAULT_SEEDS)

INTERVENTION_KEYS = ("qk_clip", "logit_softcap", "logit_scale")  # config keys, present only when set
_TAGS = {"qk_clip": "clip", "logit_softcap": "softcap", "logit_scale": "scale"}


def intervention_tag(config: dict) -> str:
    """'' for a plain run; e.g. '+clip2', '+softcap8', '+scale0' for an intervention's."""
    return "".join(f"+{_TAGS[k]}{config[k]:g}" for k in INTERVENTION_KEYS if k in config)


_REFERENCE = dict(p=113, d_model=128, n_heads=4, head_dim=32, d_mlp=512, n_layers=1, layernorm=False)
PROFILES: dict[str, dict] = {
    "smoke": dict(
        model=dict(p=23, d_model=32, n_heads=2, head_dim=16, d_mlp=64, n_layers=1, layernorm=False),
        epochs=300,
        eval_every=10,
        slingshot_epochs=400,
    ),
    # The reference widths do not fit 15 min per 20,000 epochs on one core (benchmarks/grok_speed.py
    # measures both profiles; README). Halving every width and using p=97 (the prime of the original
    # grokking paper) does; the `single` experiment shows whether this model still groks.
    "cpu": dict(
        model=dict(p=97, d_model=64, n_heads=4, head_dim=16, d_mlp=256, n_layers=1, layernorm=False),
        epochs=20000,
        eval_every=20,
        slingshot_epochs=40000,
    ),
    "paper": dict(model=_REFERENCE, epochs=20000, eval_every=10, slingshot_epochs=100000),
}
# The usual reference optimisation (Nanda et al.'s setup): AdamW lr 1e-3, betas (0.9, 0.98),
# weight decay 1.0, 10-step linear warm-up, full batch.
BASE = dict(
    lr=1e-3,
    frame_lr=1e-3,
    betas=[0.9, 0.98],
    weight_decay=1.0,
    warmup_steps=10,
    train_fraction=0.3,
    max_step=0.1,
    regularize="all",
)
ARMS = ("adamw", "stiefel-adam")
# The controls on a+b, mechanism-deciding arms first (they run first): no decay on Q/K, the constraint
# by parametrization, frozen frames; then the modern baselines and the learnable temperature.
# Every arm runs at the reference optimisation (lr 1e-3 for every parameter, W_Q and W_K included),
# as the two original arms do: the grokking protocol has no learning-rate sweep. Muon's rate is on
# AdamW's scale through adjust_lr_fn="match_rms_adamw".
CONTROL_ARMS = ("adamw-qk-nodecay", "orthogonal-param", "frozen", "qk-norm", "muon", "stiefel-adam-temp", *BOUNDED_ARMS)
DECAY_VALUES = (0.1, 0.3)  # weight decay of the `decay` experiment; 1.0 is the study's
EXPERIMENTS = ("single", "study", "slingshot", "controls", "decay", "interventions")
DEFAULT_SEEDS = {"single": 1, "study": 5, "slingshot": 1, "controls": 5, "decay": 5, "interventions": PROTOCOL_SEEDS}
STUDY_OPS = ("+", "-")


# The interventions on the attention-logit scale, run at the controls' optimisation (a+b, weight decay 1.0):
# bound the logits of the arm that does not grok (QK-Clip, soft-cap) and raise those of the arm that does (a fixed
# logit scale); a scale of 0 is uniform attention, which cannot route, on a+b and on a-b. A config holds an
# intervention's key only when it has one, so the plain arms' cells (and records) are those of the controls/study.
INTERVENTIONS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("adamw", "+", {"qk_clip": 2.0}),
    ("adamw", "+", {"qk_clip": 8.0}),
    ("adamw", "+", {"logit_softcap": 2.0}),
    ("adamw", "+", {"logit_softcap": 8.0}),
    ("stiefel-adam", "+", {"logit_scale": 4.0}),
    ("stiefel-adam", "+", {"logit_scale": 16.0}),
    ("stiefel-adam", "+", {"logit_scale": 0.0}),
    ("stiefel-adam", "-", {"logit_scale": 0.0}),
)

# Slingshot conditions (Thilak et al. 2022): Adam with NO weight decay on the model as a whole and
# long training make the last layer's norm grow until the loss spikes and the network re-learns,
# cycle after cycle. The pilot keeps those conditions for the routing frames and the unconstrained
# Q/K alike and regularises only the rest of the circuit (embeddings, W_V, W_O, MLP, unembedding)
# with a weak decay, the same in both arms: the arms differ only in whether Q/K are frames.
SLINGSHOT = dict(weight_decay=0.1, regularize="non-qk", betas=[0.9, 0.98], eps=1e-8)  # pilots: SLINGSHOT_OPS
