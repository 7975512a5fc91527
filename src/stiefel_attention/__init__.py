"""stiefel-attention: attention with W_Q, W_K as frames on St(d, r), trained by a Riemannian Adam."""

from .manifold import isometry_error, polar_retract, project_tangent, random_frame
from .nn import ModularTransformer, PatchViT, StiefelAttention, frames, qk_matrices
from .optim import ARMS, MixedOptimizer, NonFiniteGradientError, StiefelAdam, StiefelSGD, arm_spec, build_optimizer

__version__ = "0.1.0"

__all__ = [
    "isometry_error", "polar_retract", "project_tangent", "random_frame",
    "ModularTransformer", "PatchViT", "StiefelAttention", "frames", "qk_matrices",
    "ARMS", "MixedOptimizer", "NonFiniteGradientError", "StiefelAdam", "StiefelSGD", "arm_spec", "build_optimizer",
]
