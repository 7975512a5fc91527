"""Pure tensor functions on the Stiefel manifold St(d, r) = {W in R^(d x r) : W^T W = I_r}.

Every function takes batched frames: a tensor of shape (..., d, r) with d >= r, where each
trailing (d, r) matrix is one frame. There is no state here and no nn.Module; the optimizers
in `optim.py` are built from these functions.

Half-precision inputs (float16, bfloat16) are computed in float32 and cast back: the
eigendecomposition and QR kernels have no half-precision path, and orthonormality to half
precision would be lost in one step anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "sym",
    "skew",
    "check_frames",
    "project_tangent",
    "polar_retract",
    "inv_sqrt_spd",
    "random_frame",
    "isometry_error",
    "tangent_error",
]

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def sym(A: Tensor) -> Tensor:
    """Symmetric part (A + A^T) / 2 of each trailing square matrix."""
    return 0.5 * (A + A.mT)


def skew(A: Tensor) -> Tensor:
    """Skew-symmetric part (A - A^T) / 2 of each trailing square matrix."""
    return 0.5 * (A - A.mT)


def check_frames(W: Tensor, name: str = "W") -> tuple[int, int]:
    """Validate the shape of a batch of frames and return (d, r); raise ValueError otherwise."""
    if not isinstance(W, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(W).__name__}")
    if W.dim() < 2:
        raise ValueError(f"{name} must have shape (..., d, r) with d >= r >= 1, got shape {tuple(W.shape)}")
    d, r = W.shape[-2], W.shape[-1]
    if r < 1 or d < r:
        raise ValueError(
            f"{name} has trailing shape (d, r) = ({d}, {r}); a Stiefel frame needs d >= r >= 1 "
            "(r orthonormal columns in R^d)"
        )
    if not (W.is_floating_point()):
        raise TypeError(f"{name} must be a floating-point tensor, got {W.dtype}")
    return d, r


def project_tangent(W: Tensor, G: Tensor) -> Tensor:
    """Orthogonal projection of G onto the tangent space at W in the embedded metric.

    P_W(G) = G - W sym(W^T G). Its kernel is the normal space {W S : S symmetric}, which is why
    weight decay (G = lambda * W = W (lambda I)) projects to exactly zero (Proposition 5).
    """
    check_frames(W)
    if G.shape[-2:] != W.shape[-2:]:
        raise ValueError(f"G has trailing shape {tuple(G.shape[-2:])}, frames have {tuple(W.shape[-2:])}")
    out_dtype = torch.promote_types(W.dtype, G.dtype)
    cd = _compute_dtype(out_dtype)
    W_, G_ = W.to(cd), G.to(cd)
    return (G_ - W_ @ sym(W_.mT @ G_)).to(out_dtype)


def inv_sqrt_spd(A: Tensor) -> Tensor:
    """A^(-1/2) for symmetric positive-definite (..., r, r) matrices, by eigendecomposition.

    Exact to round-off for any conditioning that float arithmetic can represent; this is the
    general-purpose path. The optimizers use a cheaper iteration when a trust region bounds
    the spectrum (see `optim.py`).
    """
    evals, evecs = torch.linalg.eigh(A)
    # Clamp guards only against round-off below zero; a genuinely singular A is the caller's bug.
    tiny = torch.finfo(A.dtype).tiny
    return (evecs * evals.clamp_min(tiny).rsqrt().unsqueeze(-2)) @ evecs.mT


def polar_retract(W: Tensor, xi: Tensor) -> Tensor:
    """Polar retraction R_W(xi) = (W + xi) ((W + xi)^T (W + xi))^(-1/2).

    Returns the orthonormal polar factor of Y = W + xi, the frame nearest to Y in Frobenius
    norm. Only r x r matrices are decomposed (one batched eigh call for all frames), never a
    d x d one. The Gram matrix is formed from Y itself rather than as I + xi^T xi, so the result
    is exact for a non-tangent xi (the no-projector ablation) and also corrects whatever
    round-off W had accumulated: the output is orthonormal to working precision.
    """
    check_frames(W)
    if xi.shape[-2:] != W.shape[-2:]:
        raise ValueError(f"xi has trailing shape {tuple(xi.shape[-2:])}, frames have {tuple(W.shape[-2:])}")
    out_dtype = torch.promote_types(W.dtype, xi.dtype)
    cd = _compute_dtype(out_dtype)
    Y = W.to(cd) + xi.to(cd)  # (..., d, r)
    return (Y @ inv_sqrt_spd(Y.mT @ Y)).to(out_dtype)


def random_frame(
    *batch: int,
    d: int,
    r: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Haar-distributed random frames of shape (*batch, d, r).

    QR of a Gaussian matrix is Haar only after fixing the signs of R's diagonal (otherwise the
    distribution depends on the QR implementation's sign convention).
    """
    if r < 1 or d < r:
        raise ValueError(f"random_frame needs d >= r >= 1, got d={d}, r={r}")
    dtype = dtype or torch.get_default_dtype()
    cd = _compute_dtype(dtype)
    # Sample in float64 on the CPU so a seed gives the same frames whatever dtype or device is
    # asked for, then cast: float32 frames are then orthonormal to float32 round-off.
    gen_device = generator.device if generator is not None else "cpu"
    X = torch.randn(*batch, d, r, generator=generator, dtype=torch.float64, device=gen_device)
    Q, R = torch.linalg.qr(X)  # (..., d, r), (..., r, r)
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    Q = Q * signs.unsqueeze(-2)
    return Q.to(dtype=cd, device=device).to(dtype).contiguous()


def isometry_error(W: Tensor) -> Tensor:
    """max over frames of ||W^T W - I_r||_F, as a 0-dim tensor (in float64 for float64 input)."""
    check_frames(W)
    cd = _compute_dtype(W.dtype)
    W_ = W.detach().to(cd)
    eye = torch.eye(W.shape[-1], dtype=cd, device=W.device)
    return torch.linalg.matrix_norm(W_.mT @ W_ - eye).max()


def tangent_error(W: Tensor, xi: Tensor) -> Tensor:
    """max over frames of ||sym(W^T xi)||_F: zero iff every xi lies in the tangent space at W."""
    check_frames(W)
    cd = _compute_dtype(torch.promote_types(W.dtype, xi.dtype))
    return torch.linalg.matrix_norm(sym(W.detach().to(cd).mT @ xi.detach().to(cd))).max()
