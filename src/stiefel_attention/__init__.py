"""stiefel-attention: attention with W_Q, W_K as frames on St(d, r), trained by a Riemannian Adam."""

from .convert import register_adapter, reset_frames, stiefelize, unstiefelize
from .manifold import isometry_error, polar_retract, project_tangent, random_frame
from .nn import Block, StiefelAttention, frames, qk_clip, qk_matrices, qk_parameters, reset_logit_stats
from .optim import (
    FrameStepError,
    LandingStiefelAdam,
    NonFiniteGradientError,
    StiefelAdam,
    StiefelMuon,
    StiefelSGD,
    param_groups,
)

__version__ = "0.1.0"

__all__ = [
    "isometry_error",
    "polar_retract",
    "project_tangent",
    "random_frame",
    "Block",
    "StiefelAttention",
    "frames",
    "qk_clip",
    "qk_matrices",
    "qk_parameters",
    "reset_logit_stats",
    "FrameStepError",
    "LandingStiefelAdam",
    "NonFiniteGradientError",
    "StiefelAdam",
    "StiefelMuon",
    "StiefelSGD",
    "param_groups",
    "register_adapter",
    "reset_frames",
    "stiefelize",
    "unstiefelize",
]
