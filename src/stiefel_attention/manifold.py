"""Pure tensor functions on the Stiefel manifold St(d, r) = {W in R^(d x r) : W^T W = I_r}.

Every function takes batched frames: a tensor of shape (..., d, r) with d >= r, where each
trailing (d, r) matrix is one frame. There is no state here and no nn.Module; the optimizers
in `optim.py` are built from these functions.

Half-precision inputs (float16, bfloat16) are computed in float32 and cast back: the
eigendecomposition and QR kernels have no half-precision path, and orthonormality to half
precision would be lost in one step anyway.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "sym",
    "skew",
    "check_frames",
    "project_tangent",
    "polar_retract",
    "inv_sqrt_spd",
    "inv_sqrt_gram",
    "newton_schulz_iterations",
    "binomial_series_terms",
    "random_frame",
    "isometry_error",
    "msign",
    "spectral_tangent_direction",
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
    general-purpose path. The optimizers use `inv_sqrt_gram`, cheaper when a bound on the
    spectrum is known.
    """
    evals, evecs = torch.linalg.eigh(A)
    # Clamp guards only against round-off below zero; a genuinely singular A is the caller's bug.
    tiny = torch.finfo(A.dtype).tiny
    return (evecs * evals.clamp_min(tiny).rsqrt().unsqueeze(-2)) @ evecs.mT


def newton_schulz_iterations(lo: float, hi: float, dtype: torch.dtype, max_iters: int = 30) -> int | None:
    """Iterations of coupled Newton-Schulz that bring every eigenvalue in [lo, hi] to round-off.

    After scaling A by mu = (lo + hi) / 2, all iterates are polynomials in A, so each eigenvalue
    lambda evolves independently through z -> z (3 - z)^2 / 4 with z_0 = lambda / mu, and
    z -> 1 means the iterate has converged to (A / mu)^(-1/2) on that eigenvector. After the
    first step every z is <= 1, where the map is increasing, so tracking the two endpoints of
    the interval bounds every eigenvalue in it. Returns None if it does not converge within
    max_iters (the caller then uses an eigendecomposition).
    """
    if not (0.0 < lo <= hi) or not math.isfinite(hi):
        return None
    tol = 4.0 * torch.finfo(dtype).eps
    mu = 0.5 * (lo + hi)
    zs = (lo / mu, hi / mu)
    if max(zs) >= 3.0:
        return None
    for k in range(1, max_iters + 1):
        zs = tuple(z * (3.0 - z) ** 2 / 4.0 for z in zs)
        if max(abs(1.0 - z) for z in zs) <= tol:
            return k + 1  # one more step absorbs the round-off of the iteration itself
    return None


def binomial_series_terms(rho: float, dtype: torch.dtype, max_terms: int = 12) -> int | None:
    """Degree K at which the series of (I + E)^(-1/2) is exact to round-off when ||E||_2 <= rho.

    (1 + x)^(-1/2) = sum_k c_k x^k with |c_k| <= 1, so the tail after degree K is at most
    rho^(K+1) / (1 - rho). Returns None if more than max_terms would be needed.
    """
    if not 0.0 <= rho < 1.0:
        return None
    tol = 4.0 * torch.finfo(dtype).eps
    for K in range(1, max_terms + 1):
        if rho ** (K + 1) / (1.0 - rho) <= tol:
            return K
    return None


def inv_sqrt_gram(gram: Tensor, lo: float, hi: float) -> Tensor:
    """gram^(-1/2) for SPD (n, r, r) matrices whose eigenvalues all lie in [lo, hi].

    The Gram matrix of W + xi for a tangent step is I + xi^T xi, with spectrum in
    [1, 1 + ||xi||^2] up to round-off. Three exact methods, cheapest first:
    - steps of a few percent (the usual case): the binomial series of (I + E)^(-1/2) in E = gram - I,
      by Horner's rule, truncated where the bound on ||E|| puts the tail below round-off
      (K - 1 r x r products for degree K: 2 for ||xi|| <= 0.1 in float32);
    - larger steps: coupled Newton-Schulz (Y -> (A/mu)^(1/2), Z -> (A/mu)^(-1/2)), its
      iteration count derived from [lo, hi] (see `newton_schulz_iterations`);
    - otherwise, or for a bound too wide to trust: eigendecomposition.
    Each is several times cheaper than the next for r of a few dozen.
    """
    rho = max(1.0 - lo, hi - 1.0)
    degree = binomial_series_terms(rho, gram.dtype)
    if degree is not None:
        coefs = [1.0]
        for k in range(1, degree + 1):  # c_k = binom(-1/2, k)
            coefs.append(coefs[-1] * -(2 * k - 1) / (2 * k))
        E = gram.clone()
        E.diagonal(dim1=-2, dim2=-1).sub_(1.0)
        P = E * coefs[degree]
        P.diagonal(dim1=-2, dim2=-1).add_(coefs[degree - 1])
        for c in reversed(coefs[: degree - 1]):
            P = torch.bmm(P, E)
            P.diagonal(dim1=-2, dim2=-1).add_(c)
        return P
    iters = newton_schulz_iterations(lo, hi, gram.dtype, max_iters=12)
    if iters is None:
        return inv_sqrt_spd(gram)
    mu = 0.5 * (lo + hi)

    def half_three_minus(X: Tensor) -> Tensor:  # (3 I - X) / 2, in place on X
        X.mul_(-0.5).diagonal(dim1=-2, dim2=-1).add_(1.5)
        return X

    Y = gram * (1.0 / mu)
    Z = half_three_minus(Y.clone())  # first step from Z = I: T = (3I - Y)/2, so Z = T
    Y = torch.bmm(Y, Z)  # and Y = Y T
    for k in range(1, iters):
        T = half_three_minus(torch.bmm(Z, Y))
        Z = torch.bmm(T, Z)
        if k < iters - 1:  # the last Y is never used
            Y = torch.bmm(Y, T)
    return Z.mul_(1.0 / math.sqrt(mu))


def polar_retract(W: Tensor, xi: Tensor) -> Tensor:
    """Polar retraction R_W(xi) = (W + xi) ((W + xi)^T (W + xi))^(-1/2).

    Returns the orthonormal polar factor of Y = W + xi, the frame nearest to Y in Frobenius
    norm. Only r x r matrices are decomposed (one batched eigh call for all frames), never a
    d x d one. The Gram matrix is formed from Y itself rather than as I + xi^T xi, so the result
    is exact for a non-tangent xi (the no-projector ablation) and also corrects whatever
    round-off W had accumulated: the output is orthonormal to working precision.

    A Y whose columns are (numerically) dependent has no polar factor: ValueError, rather than a result that is
    not a frame. A tangent xi never gives one (Y^T Y = I + xi^T xi); the optimizers call `_polar_factor`.
    """
    check_frames(W)
    if xi.shape[-2:] != W.shape[-2:]:
        raise ValueError(f"xi has trailing shape {tuple(xi.shape[-2:])}, frames have {tuple(W.shape[-2:])}")
    out_dtype = torch.promote_types(W.dtype, xi.dtype)
    cd = _compute_dtype(out_dtype)
    Y = W.to(cd) + xi.to(cd)  # (..., d, r)
    gram = Y.mT @ Y  # (..., r, r)
    evals = torch.linalg.eigvalsh(gram)  # ascending
    floor = 100 * Y.shape[-1] * torch.finfo(cd).eps * evals[..., -1]  # sigma_min^2 / sigma_max^2 below ~ r eps
    bad = ~torch.isfinite(evals).all(dim=-1) | (evals[..., 0] <= floor)
    if bool(bad.any()):
        ratio = float((evals[..., 0].clamp_min(0) / evals[..., -1]).sqrt().nan_to_num(0.0).min())
        raise ValueError(
            f"W + xi is rank-deficient or not finite in {int(bad.sum())} of {bad.numel()} frames (smallest "
            f"singular value / largest = {ratio:.3g}): its columns are not independent, so it has no polar factor "
            "and no nearest frame. A zero or repeated column is the usual cause."
        )
    return _polar_factor(Y).to(out_dtype)


def _polar_factor(Y: Tensor) -> Tensor:
    """Y (Y^T Y)^(-1/2), unchecked: for Y whose columns are known to be independent (W + a tangent step)."""
    return Y @ inv_sqrt_spd(Y.mT @ Y)


def msign(X: Tensor) -> tuple[Tensor, Tensor]:
    """(msign(X), ||X||_*) for tall (..., d, r) matrices: U V^T from X = U S V^T (zero for zero singular values, so
    of lower rank where X is), and the nuclear norm sum(S), from one r x r eigendecomposition of X^T X."""
    cd = _compute_dtype(X.dtype)
    X_ = X.to(cd)
    evals, V = torch.linalg.eigh(X_.mT @ X_)  # X^T X = V S^2 V^T
    s = evals.clamp_min(0.0).sqrt()  # (..., r)
    floor = s.amax(dim=-1, keepdim=True) * (X.shape[-1] * torch.finfo(cd).eps)
    inv = torch.where(s > floor, 1.0 / s.clamp_min(torch.finfo(cd).tiny), torch.zeros_like(s))
    return ((X_ @ (V * inv.unsqueeze(-2))) @ V.mT).to(X.dtype), s.sum(dim=-1).to(X.dtype)


def spectral_tangent_direction(
    W: Tensor, G: Tensor, tol: float = 1e-3, max_iters: int = 30
) -> tuple[Tensor, Tensor, Tensor]:
    """The tangent direction of steepest descent under the spectral norm (manifold Muon's), per frame.

    Solves  min <G, A>  over tangent A (sym(W^T A) = 0) with ||A||_2 <= 1  through its dual: with a symmetric
    multiplier L, min over ||A||_2 <= 1 of <G + W L, A> is -||G + W L||_* at A = -msign(G + W L), and the dual
    max over L of -||G + W L||_* is climbed by steps along sym(W^T A), its supergradient, from L = -sym(W^T G)
    (which gives msign of the projected gradient, and is exact for square frames), with a step length per frame
    that grows by 1.5 after a step that raises the dual and halves (the step undone) after one that does not. The
    returned A is the last msign projected onto the tangent space and rescaled to spectral norm 1: tangent and of
    unit spectral norm to round-off, whatever the iterations reached. Its optimality is certified by weak duality:
    gap = (<G, A> + ||G + W L||_*) / ||G + W L||_* >= 0, and the iteration stops when every frame's gap is at or
    below tol (a host read per iteration) or after max_iters. Frames whose G is zero get A = 0.

    Returns (A, gap, iterations), A of W's shape, gap of shape (...,), iterations a 0-d tensor. The duality gap
    reaches 1e-3 within a few iterations for frames with d >= 2r (tests); near-square frames with d > r can stop
    at max_iters with a gap of order 0.1 (the dual is not smooth there), still tangent and of unit norm.
    """
    check_frames(W)
    if G.shape != W.shape:
        raise ValueError(f"G has shape {tuple(G.shape)}, frames have {tuple(W.shape)}")
    if not (tol > 0 and max_iters >= 1):
        raise ValueError(f"tol must be > 0 and max_iters >= 1, got tol={tol!r}, max_iters={max_iters!r}")
    cd = _compute_dtype(torch.promote_types(W.dtype, G.dtype))
    W_, G_ = W.to(cd), G.to(cd)
    L = -sym(W_.mT @ G_)  # (..., r, r)
    M, nuc = msign(G_ + W_ @ L)
    scale = (nuc / W.shape[-1]).clamp_min(torch.finfo(cd).tiny)  # mean singular value of P_W(G): steps are O(1)
    L = L / scale[..., None, None]
    G_ = G_ / scale[..., None, None]
    best = nuc / scale  # the dual's value (negated) at L
    alpha = torch.full_like(best, 0.5)[..., None, None]
    it = torch.zeros((), dtype=torch.int64)
    for it_ in range(1, max_iters + 1):
        it = torch.tensor(it_)
        A = _unit_spectral(project_tangent(W_, -M))
        gap = ((G_ * A).sum(dim=(-2, -1)) + best) / best.clamp_min(torch.finfo(cd).tiny)
        if it_ == max_iters or bool((gap <= tol).all()):
            break
        trial = L + alpha * sym(W_.mT @ -M)
        M_t, nuc_t = msign(G_ + W_ @ trial)
        up = nuc_t < best  # the dual (-nuc) rose
        L = torch.where(up[..., None, None], trial, L)
        M = torch.where(up[..., None, None], M_t, M)
        best = torch.where(up, nuc_t, best)
        alpha = torch.where(up[..., None, None], 1.5 * alpha, 0.5 * alpha)
    zero = (nuc == 0)[..., None, None]
    A = torch.where(zero, torch.zeros_like(A), A)
    gap = torch.where(nuc == 0, torch.zeros_like(gap), gap)
    return A.to(W.dtype), gap.to(W.dtype), it


def _unit_spectral(A: Tensor) -> Tensor:
    """A / ||A||_2 per matrix (0 stays 0), the spectral norm from the r x r Gram matrix."""
    top = torch.linalg.eigvalsh(A.mT @ A)[..., -1].clamp_min(0.0).sqrt()
    return A / top.clamp_min(torch.finfo(A.dtype).tiny)[..., None, None]


def random_frame(
    *batch: int,
    d: int,
    r: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Haar-distributed random frames of shape (*batch, d, r), on `device` (default: torch's default device).

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
    # device None: the default device (`with torch.device("meta"):` included), as torch's factories do
    device = device if device is not None else torch.get_default_device()
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
