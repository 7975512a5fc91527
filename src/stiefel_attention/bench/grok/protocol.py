"""The grokking testbed's protocol constants, which its runs, its config names and its reports share (they live
here so that the family imports no report module for them)."""

from __future__ import annotations

__all__ = ["GROK_THRESHOLD", "INTERVENTION_KEYS", "PROTOCOL_SEEDS", "SLINGSHOT_OPS", "intervention_tag"]

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
