"""Riemannian optimizers for frames on St(d, r), and `build_optimizer` for whole models.

The update, per frame W (d x r) at step t (StiefelAdam):

    g   = P_W(grad + wd * W)                  # the wd term is normal to St(d, r): it projects to 0
    m   = P_W(b1 * m + (1 - b1) * g)           # old m transported to W by projection
    v   = b2 * v + (1 - b2) * ||g||_F^2        # ONE scalar per frame
    xi  = -lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    xi *= min(1, max_step / ||xi||_F)          # trust region, when max_step is set
    W'  = (W + xi) ((W + xi)^T (W + xi))^(-1/2)   # polar retraction; r x r work only

The first moment is transported lazily: it is stored tangent at the frame where it was formed
and projected onto the new tangent space when the next gradient arrives. Since P_W is linear and
P_W(g) = g, this is exactly "transport m by projection after every retraction", one projection
cheaper. Scaling every gradient by c > 0 scales m and sqrt(v) by c, so xi does not change (as
eps -> 0): the step is scale free. StiefelSGD uses xi = -lr * m instead, degree one in the gradient.

As in torch.optim, thin stateful classes call pure functions on lists of tensors, with two paths
that the tests hold to each other:
- `_single_tensor_*` (reference): the rule exactly as written above, frame by frame through
  `manifold.py`; it also covers the ablations (no projector, coordinate-wise second moment).
- `_batched_*` (fast, the default where it applies): matrix products with d rows are issued per
  parameter tensor (each holds a batch of frames, e.g. one per head) and the r x r work is
  batched over all frames of one shape. A step costs five d-sized products per frame:
      A = W^T G,  B = W^T m,  m <- U - W sym(b1 B + (1-b1) A)  with U = b1 m + (1-b1) G,
      Gram(W + xi),  W' = (W + xi) Gram^(-1/2),
  with ||g||_F^2 = ||G||_F^2 - ||sym(A)||_F^2 (P_W is an orthogonal projection) instead of
  forming g (exact algebra; in float32 it loses relative accuracy only when a gradient is almost
  entirely normal, and then only in the scale v); the inverse square root is a truncated
  binomial series or a Newton-Schulz iteration whose length follows from a bound on the step,
  with eigh only as a fallback; one workspace per parameter replaces d-sized temporaries. The weight-decay term is dropped analytically there, because
  P_W(W) = W (I - W^T W) = 0 on St(d, r); the reference path adds it literally, and the tests
  check that both give the same trajectory, with and without decay.

The Gram matrix is always formed from W + xi itself (never assumed to be I + xi^T xi), so the
retraction also removes whatever round-off the frame carried: errors do not accumulate.

Non-finite gradients: the step is refused with `NonFiniteGradientError` before any frame or
optimizer state is written (all gradient norms are computed and checked first), so a caller can
catch it, skip the batch and carry on. `torch.amp.GradScaler` never calls `step` with
non-finite gradients, so it composes with this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .manifold import check_frames, inv_sqrt_spd, isometry_error, polar_retract, project_tangent, sym

__all__ = [
    "NonFiniteGradientError",
    "StiefelAdam",
    "StiefelSGD",
    "MixedOptimizer",
    "ARMS",
    "ArmSpec",
    "arm_spec",
    "build_optimizer",
    "stiefel_adam",
    "stiefel_sgd",
    "inv_sqrt_gram",
    "newton_schulz_iterations",
    "binomial_series_terms",
    "refuse_non_finite_grads",
]


class NonFiniteGradientError(FloatingPointError):
    """A frame's gradient had a NaN or inf entry; the step was refused and nothing was changed."""


# How far from orthonormal a starting frame may be. The check catches frames that were never
# orthonormalised (errors of order 1), not round-off: float32 frames cast to float64 carry ~1e-6,
# and the first retraction removes whatever is there.
_START_TOLERANCE = 1e-3


def _check_start(p: Tensor, where: str) -> None:
    try:
        check_frames(p, name=where)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{err}. Stiefel optimizers take frame tensors of shape (..., d, r).") from None
    if p.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"{where} has dtype {p.dtype}; Stiefel optimizers keep frames in float32 or float64 "
            "(one scalar second moment per frame overflows half precision). Keep W_Q, W_K in float32 "
            "as master weights; autocast still runs the attention matmuls in half precision."
        )
    err = float(isometry_error(p))
    tol = _START_TOLERANCE
    if not math.isfinite(err) or err > tol:
        raise ValueError(
            f"{where} is not on the Stiefel manifold: max ||W^T W - I||_F = {err:.3g} > {tol:g}. "
            "Start from orthonormal frames, e.g. stiefel_attention.manifold.random_frame(...) or "
            "polar_retract(W, torch.zeros_like(W)) to project an existing matrix."
        )


# ---------------------------------------------------------------------------------------------
# r x r inverse square root of a Gram matrix with a known spectral bound
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def _bias_corrections(step: float, beta1: float, beta2: float) -> tuple[float, float]:
    return 1.0 - beta1**step, 1.0 - beta2**step


def _raise_non_finite(bad: Sequence[int]) -> None:
    raise NonFiniteGradientError(
        f"non-finite gradient (NaN or inf) in frame parameter(s) {list(bad)} of this group; the step "
        "was refused and no frame or optimizer state was changed. Lower the learning rate, use a "
        "GradScaler, or catch NonFiniteGradientError to skip the batch."
    )


def _frames_view(t: Tensor) -> Tensor:
    """(..., d, r) -> (n, d, r) as a view: batched matmuls want one batch dimension."""
    return t.view(-1, t.shape[-2], t.shape[-1])


def _cap(xi: Tensor, max_step: float | None) -> Tensor:
    """Rescale each frame's step so that ||xi||_F <= max_step (the trust region)."""
    if max_step is None:
        return xi
    norm = torch.linalg.matrix_norm(xi, keepdim=True)  # (..., 1, 1)
    return xi * (max_step / norm.clamp_min(torch.finfo(xi.dtype).tiny)).clamp(max=1.0)


# ---------------------------------------------------------------------------------------------
# Functional StiefelAdam
# ---------------------------------------------------------------------------------------------


def stiefel_adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    workspaces: list[Tensor] | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    max_step: float | None,
    weight_decay: float,
    projector: bool = True,
    second_moment: str = "frame",
    batched: bool | None = None,
    precomputed: tuple[list[Tensor], list[Tensor]] | None = None,
) -> None:
    """One StiefelAdam step on lists of frame tensors, in place.

    exp_avg_sqs[i] has shape params[i].shape[:-2] (one scalar per frame) when
    second_moment == "frame", and params[i].shape when "coordinate". The batched path covers
    the paper's rule (projector on, one scalar per frame, contiguous frames); the ablations
    always take the single-tensor path. `precomputed` = (W^T G, ||P_W G||^2) per tensor, as
    returned by `_batched_tangent_sq_norms`, lets a caller check several batches before writing.
    """
    fast_ok = projector and second_moment == "frame" and all(p.is_contiguous() for p in params)
    if batched is None:
        batched = fast_ok
    if batched and not fast_ok:
        raise ValueError("the batched path needs projector=True, second_moment='frame' and contiguous frames")
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, max_step=max_step, weight_decay=weight_decay)
    if batched:
        _batched_stiefel_adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, workspaces, precomputed=precomputed, **kw)
    else:
        _single_tensor_stiefel_adam(
            params, grads, exp_avgs, exp_avg_sqs, state_steps, projector=projector, second_moment=second_moment, **kw
        )


def _single_tensor_stiefel_adam(
    params, grads, exp_avgs, exp_avg_sqs, state_steps, *,
    lr, beta1, beta2, eps, max_step, weight_decay, projector, second_moment,
) -> None:
    # Phase 1: every tangent gradient, then one finiteness check, so a refused step changes nothing.
    tangent = []
    for W, G in zip(params, grads):
        if weight_decay != 0.0:
            G = G + weight_decay * W
        tangent.append(project_tangent(W, G) if projector else G)
    bad = [i for i, g in enumerate(tangent) if not bool(torch.isfinite(g).all())]
    if bad:
        _raise_non_finite(bad)

    # Phase 2: moments, step, retraction.
    for W, g, m, v, step_t in zip(params, tangent, exp_avgs, exp_avg_sqs, state_steps):
        step_t += 1
        bc1, bc2 = _bias_corrections(float(step_t), beta1, beta2)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        if projector:
            m.copy_(project_tangent(W, m))  # transport the old moment to W
        if second_moment == "frame":
            v.mul_(beta2).add_(g.square().sum(dim=(-2, -1)), alpha=1.0 - beta2)
            denom = (v / bc2).sqrt().add_(eps).clamp_min_(torch.finfo(v.dtype).tiny)[..., None, None]  # (..., 1, 1)
        else:  # "coordinate": Adam's elementwise v, an ablation that breaks O(d)-equivariance
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (v / bc2).sqrt().add_(eps).clamp_min_(torch.finfo(v.dtype).tiny)  # (..., d, r)
        xi = _cap(-lr * (m / bc1) / denom, max_step)
        W.copy_(polar_retract(W, xi))


def _batched_tangent_sq_norms(params: list[Tensor], grads: list[Tensor], check: bool = True) -> tuple[list[Tensor], list[Tensor]]:
    """Per parameter: A = W^T G, shape (n, r, r), and ||P_W(G)||_F^2 per frame, shape (n,).

    ||P_W G||^2 = ||G||^2 - ||sym(W^T G)||^2 because P_W is the orthogonal projection whose
    complement is G -> W sym(W^T G). Raises NonFiniteGradientError (before anything is written)
    if a norm is not finite: a NaN or inf anywhere in a frame's gradient reaches that norm.
    """
    As, sq_norms = [], []
    for W, G in zip(params, grads):
        W3 = _frames_view(W)
        G3 = G.reshape(W3.shape)
        A = torch.bmm(W3.mT, G3)  # (n, r, r)
        sq = torch.linalg.vector_norm(G3, dim=(-2, -1)).square() - torch.linalg.matrix_norm(sym(A)).square()
        As.append(A)
        sq_norms.append(sq.clamp_min_(0.0))  # round-off can push an all-normal gradient below 0
    if check:
        finite = torch.stack([torch.isfinite(sq).all() for sq in sq_norms])
        if not bool(finite.all()):
            _raise_non_finite(torch.nonzero(~finite).flatten().tolist())
    return As, sq_norms


def _batched_moment_update(W: Tensor, G: Tensor, m: Tensor, A: Tensor, beta: float, dampening: float) -> None:
    """m <- P_W(beta * m + dampening * G) in place, given A = W^T G (two d-sized products)."""
    W3, m3 = _frames_view(W), _frames_view(m)
    B = torch.bmm(W3.mT, m3)  # (n, r, r); the old m is tangent at the previous frame, not at W
    if dampening == 1.0:  # SGD momentum: m <- G + beta m, in one pass
        torch.add(G.view_as(m), m, alpha=beta, out=m)
    else:  # Adam, dampening = 1 - beta: m <- m + dampening (G - m), in one pass
        m.lerp_(G.view_as(m), dampening)
    S = sym(B.mul_(beta).add_(A, alpha=dampening))
    m3.baddbmm_(W3, S, alpha=-1.0)


def _batched_stiefel_adam(
    params, grads, exp_avgs, exp_avg_sqs, state_steps, workspaces, *,
    lr, beta1, beta2, eps, max_step, weight_decay, precomputed=None,
) -> None:
    # weight_decay is not used here: P_W(weight_decay * W) = 0 on St(d, r) (see module docstring).
    if not params:
        return
    if workspaces is None:
        workspaces = [torch.empty_like(p) for p in params]
    As, sq_norms = precomputed if precomputed is not None else _batched_tangent_sq_norms(params, grads)
    coefs = []  # per frame: xi = -coef * m
    for W, G, m, v, step_t, A, sq in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, As, sq_norms):
        step_t += 1
        bc1, bc2 = _bias_corrections(float(step_t), beta1, beta2)
        _batched_moment_update(W, G, m, A, beta1, 1.0 - beta1)
        v.mul_(beta2).add_(sq.view_as(v), alpha=1.0 - beta2)
        # clamp: with eps = 0 and an all-zero gradient history, m = 0 too and the step is 0, not 0/0
        coefs.append((lr / bc1) / (v.reshape(-1) / bc2).sqrt().add_(eps).clamp_min_(torch.finfo(v.dtype).tiny))  # (n,)
    _batched_retract(params, exp_avgs, coefs, workspaces, max_step)


def _batched_retract(
    params: list[Tensor], directions: list[Tensor], coefs: list[Tensor], workspaces: list[Tensor],
    max_step: float | None,
) -> None:
    """W <- polar(W - c * direction) for every frame, c per frame after the trust region.

    The r x r inverse square roots of all frames of this shape are computed in one batch. For
    W orthonormal and xi tangent, Gram(W + xi) = I + xi^T xi has eigenvalues in
    [1, 1 + ||xi||_F^2]; the margin covers round-off in W and in xi's tangency.
    """
    grams, step_norms = [], []
    for W, D, c, buf in zip(params, directions, coefs, workspaces):
        D3 = _frames_view(D)
        step_norm = c * torch.linalg.vector_norm(D3, dim=(-2, -1))  # (n,) = ||xi||_F before the cap
        if max_step is not None:
            c = c * (max_step / step_norm.clamp_min(torch.finfo(c.dtype).tiny)).clamp(max=1.0)
            step_norm = step_norm.clamp(max=max_step)
        step_norms.append(step_norm.max())
        Y = _frames_view(buf)
        torch.addcmul(_frames_view(W), D3, c.view(-1, 1, 1), value=-1.0, out=Y)  # Y = W + xi
        grams.append(torch.bmm(Y.mT, Y))  # (n, r, r)
    # The largest actual step (<= max_step) sets how much r x r work the inverse root needs.
    step_bound = float(torch.stack(step_norms).max())
    # ||W^T W - I|| stays ~1e-6 in float32 (the retraction corrects it every step): 100x headroom.
    margin = 1e-8 if params[0].dtype == torch.float64 else 1e-4
    inv_roots = inv_sqrt_gram(torch.cat(grams), 1.0 - margin, 1.0 + step_bound**2 + margin)
    for W, buf, M in zip(params, workspaces, inv_roots.split([g.shape[0] for g in grams])):
        torch.bmm(_frames_view(buf), M, out=_frames_view(W))  # W' = Y (Y^T Y)^(-1/2)


# ---------------------------------------------------------------------------------------------
# Functional StiefelSGD
# ---------------------------------------------------------------------------------------------


def stiefel_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    workspaces: list[Tensor] | None = None,
    *,
    lr: float,
    momentum: float,
    max_step: float | None,
    weight_decay: float,
    batched: bool | None = None,
    precomputed: tuple[list[Tensor], list[Tensor]] | None = None,
) -> None:
    """One fixed-step Riemannian SGD step: xi = -lr * m, m = P_W(momentum * m + grad)."""
    if not params:
        return
    if batched is None:
        batched = all(p.is_contiguous() for p in params)
    if not batched:
        tangent = [project_tangent(W, G + weight_decay * W if weight_decay else G) for W, G in zip(params, grads)]
        bad = [i for i, g in enumerate(tangent) if not bool(torch.isfinite(g).all())]
        if bad:
            _raise_non_finite(bad)
        for W, g, buf in zip(params, tangent, momentum_buffers):
            if momentum != 0.0:
                buf.mul_(momentum).add_(g).copy_(project_tangent(W, buf))
                g = buf
            W.copy_(polar_retract(W, _cap(-lr * g, max_step)))
        return
    if workspaces is None:
        workspaces = [torch.empty_like(p) for p in params]
    As, _ = precomputed if precomputed is not None else _batched_tangent_sq_norms(params, grads)  # norms: finiteness check
    if momentum != 0.0:
        for W, G, buf, A in zip(params, grads, momentum_buffers, As):
            _batched_moment_update(W, G, buf, A, momentum, 1.0)
        directions = momentum_buffers
    else:
        # The direction is g itself, held in the workspace; the retraction then overwrites it
        # elementwise with W + xi in the same pass that reads it.
        for W, G, A, buf in zip(params, grads, As, workspaces):
            torch.baddbmm(G.reshape(_frames_view(W).shape), _frames_view(W), sym(A), alpha=-1.0, out=_frames_view(buf))
        directions = workspaces
    coefs = [torch.full((_frames_view(W).shape[0],), lr, dtype=W.dtype, device=W.device) for W in params]
    _batched_retract(params, directions, coefs, workspaces, max_step)


# ---------------------------------------------------------------------------------------------
# Optimizer classes
# ---------------------------------------------------------------------------------------------


def _non_finite_error(names: list[str]) -> NonFiniteGradientError:
    return NonFiniteGradientError(
        f"non-finite gradient (NaN or inf) in {', '.join(names)}; the step was refused and no parameter "
        "or optimizer state was changed. Lower the learning rate, use a GradScaler, or catch "
        "NonFiniteGradientError to skip the batch."
    )


def refuse_non_finite_grads(param_groups: list[dict]) -> None:
    """Raise NonFiniteGradientError, naming the parameters, if any gradient has a NaN or inf.

    Called before an optimizer writes anything, so a refused step leaves every parameter and
    every state tensor as it was. One fused norm per group and one host sync: a non-finite
    entry makes its tensor's norm non-finite.
    """
    bad = []
    for gi, group in enumerate(param_groups):
        with_grad = [(i, p.grad) for i, p in enumerate(group["params"]) if p.grad is not None]
        if any(g.is_sparse for _, g in with_grad):
            raise RuntimeError("sparse gradients are not supported (Stiefel optimizers and AdamW need dense ones)")
        if not with_grad:
            continue
        norms = torch._foreach_norm([g for _, g in with_grad])
        finite = torch.isfinite(torch.stack([n.float() for n in norms]))
        if not bool(finite.all()):
            bad += [f"param_groups[{gi}]['params'][{with_grad[k][0]}]" for k in torch.nonzero(~finite).flatten().tolist()]
    if bad:
        raise _non_finite_error(bad)


class _StiefelOptimizer(Optimizer):
    """Shared plumbing: frame validation, the non-finite check, workspaces kept out of the state_dict."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        # Scratch buffers, one per parameter: derived data, so never saved in state_dict.
        self._workspaces: dict[Tensor, Tensor] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        for i, p in enumerate(self.param_groups[-1]["params"]):
            _check_start(p.detach(), f"param_groups[{group_index}]['params'][{i}]")

    def _workspace(self, p: Tensor) -> Tensor:
        buf = self._workspaces.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = torch.empty_like(p, memory_format=torch.contiguous_format)
            self._workspaces[p] = buf
        return buf

    @staticmethod
    def _grad_of(p: Tensor) -> Tensor:
        if p.grad.is_sparse:
            raise RuntimeError("Stiefel optimizers do not support sparse gradients")
        return p.grad

    def _batches(self, n_lists: int, fill) -> list[tuple[dict, list[list], list[str]]]:
        """Group the parameters with gradients by frame shape, within each param group.

        fill(group, p, state) -> the per-parameter items after (p, grad). Returns
        (group, lists, names) per batch; lists[0] are the frames and lists[1] their gradients.
        """
        batches = []
        for gi, group in enumerate(self.param_groups):
            per_key: dict[tuple, tuple[list[list], list[str]]] = {}
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                key = (p.shape[-2], p.shape[-1], p.dtype, p.device)  # frames of one shape: one batch
                lists, names = per_key.setdefault(key, ([[] for _ in range(n_lists)], []))
                for lst, item in zip(lists, (p, self._grad_of(p), *fill(group, p, self.state[p]))):
                    lst.append(item)
                names.append(f"param_groups[{gi}]['params'][{i}]")
            batches += [(group, lists, names) for lists, names in per_key.values()]
        return batches

    @staticmethod
    def _check_all(batches: list, fast: list[bool]) -> list:
        """Tangent quantities of every fast batch and one finiteness check over ALL batches.

        Nothing is written before every gradient of every group and shape has been checked, so
        a refused step leaves frames and state exactly as they were.
        """
        pre, finite, names = [], [], []
        for (group, lists, batch_names), is_fast in zip(batches, fast):
            params, grads = lists[0], lists[1]
            if is_fast:
                As, sq = _batched_tangent_sq_norms(params, grads, check=False)
                pre.append((As, sq))
                finite += [torch.isfinite(x).all() for x in sq]
            else:
                pre.append(None)
                finite += [torch.isfinite(g).all() for g in grads]
            names += batch_names
        if finite:
            ok = torch.stack(finite)
            if not bool(ok.all()):
                raise _non_finite_error([names[i] for i in torch.nonzero(~ok).flatten().tolist()])
        return pre


class StiefelAdam(_StiefelOptimizer):
    """Riemannian Adam on St(d, r) with one scalar second moment per frame.

    Args:
        params: frame tensors of shape (..., d, r), d >= r, each trailing (d, r) matrix with
            orthonormal columns (checked at construction), or param-group dicts of them.
        lr: step size. The step is scale free: each frame moves by about lr in Frobenius norm
            per step, whatever the gradient's scale.
        betas: decay rates of the first moment (a tangent matrix) and the second moment (a
            scalar per frame).
        eps: added to sqrt(v_hat); as eps grows the rule turns into SGD with step lr/eps.
        max_step: trust region: each frame's step is rescaled to ||xi||_F <= max_step.
        weight_decay: adds weight_decay * W to the gradient before the projection, as in SGD
            or Adam. On St(d, r) this is an exact no-op: lambda W = W (lambda I) lies in the
            normal space, so P_W removes it (Proposition 5). It is accepted so that a model's
            global decay setting can be passed through unchanged, and it is certified to have
            no effect rather than silently dropped.
        projector: False is an ablation: the raw gradient is used (no tangent projection, no
            transport); the polar retraction still returns to the manifold.
        second_moment: "frame" (the rule) or "coordinate", an ablation with Adam's elementwise
            v, which breaks O(d)-equivariance.
        batched: None picks the fast batched path whenever it applies (projector on, frame
            second moment); False forces the frame-by-frame reference path.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_step: float | None = None,
        weight_decay: float = 0.0,
        projector: bool = True,
        second_moment: str = "frame",
        batched: bool | None = None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}; both must lie in [0, 1)")
        if max_step is not None and not max_step > 0.0:
            raise ValueError(f"invalid max_step: {max_step}; use None for no trust region")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if second_moment not in ("frame", "coordinate"):
            raise ValueError(f"second_moment must be 'frame' or 'coordinate', got {second_moment!r}")
        if batched and not (projector and second_moment == "frame"):
            raise ValueError("batched=True needs projector=True and second_moment='frame'; the ablations use the reference path")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, max_step=max_step, weight_decay=weight_decay,
            projector=projector, second_moment=second_moment, batched=batched,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        def state_items(group, p, state):
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                v_shape = p.shape[:-2] if group["second_moment"] == "frame" else p.shape
                state["exp_avg_sq"] = torch.zeros(v_shape, dtype=p.dtype, device=p.device)
            return state["exp_avg"], state["exp_avg_sq"], state["step"], self._workspace(p)

        batches = self._batches(6, state_items)
        fast = [g["batched"] is not False and g["projector"] and g["second_moment"] == "frame"
                and all(p.is_contiguous() for p in lists[0]) for g, lists, _ in batches]
        precomputed = self._check_all(batches, fast)
        for (group, lists, _), is_fast, pre in zip(batches, fast, precomputed):
            beta1, beta2 = group["betas"]
            stiefel_adam(
                *lists, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                max_step=group["max_step"], weight_decay=group["weight_decay"],
                projector=group["projector"], second_moment=group["second_moment"],
                batched=is_fast, precomputed=pre,
            )
        return loss


class StiefelSGD(_StiefelOptimizer):
    """Fixed-step Riemannian SGD on St(d, r): xi = -lr * m, m the (transported) momentum of P_W(grad).

    Degree one in the gradient: scaling the loss by c scales every step by c. Weight decay is a
    no-op on frames, as for StiefelAdam.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        max_step: float | None = None,
        weight_decay: float = 0.0,
        batched: bool | None = None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum: {momentum}")
        if max_step is not None and not max_step > 0.0:
            raise ValueError(f"invalid max_step: {max_step}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, max_step=max_step, weight_decay=weight_decay, batched=batched))

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        def state_items(group, p, state):
            if group["momentum"] != 0.0 and "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            return state.get("momentum_buffer"), self._workspace(p)

        batches = self._batches(4, state_items)
        fast = [g["batched"] is not False and all(p.is_contiguous() for p in lists[0]) for g, lists, _ in batches]
        precomputed = self._check_all(batches, fast)
        for (group, lists, _), is_fast, pre in zip(batches, fast, precomputed):
            stiefel_sgd(
                *lists, lr=group["lr"], momentum=group["momentum"], max_step=group["max_step"],
                weight_decay=group["weight_decay"], batched=is_fast, precomputed=pre,
            )
        return loss


class MixedOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, presented as one torch Optimizer.

    `param_groups` is the concatenation of the inner optimizers' groups (the same dict objects),
    so learning-rate schedulers and `zero_grad` work as usual; `state_dict` holds each inner
    optimizer's state under its name and round-trips exactly.
    """

    def __init__(self, optimizers: dict[str, Optimizer]):
        if not optimizers:
            raise ValueError("MixedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        super().__init__([g for opt in self.optimizers.values() for g in opt.param_groups], defaults={})

    def _relink_groups(self) -> None:
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Nothing may be written before every gradient is known to be finite: check the plain
        # optimizers' gradients here, then step the Stiefel ones first (they check their own
        # before writing, without an extra pass), then the rest.
        checks_itself = {name: isinstance(opt, _StiefelOptimizer) for name, opt in self.optimizers.items()}
        refuse_non_finite_grads([g for name, opt in self.optimizers.items() if not checks_itself[name] for g in opt.param_groups])
        for name in sorted(self.optimizers, key=lambda n: not checks_itself[n]):
            self.optimizers[name].step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"state_dict has optimizers {sorted(state_dict)}, expected {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])
        self._relink_groups()  # load_state_dict replaces each inner optimizer's group dicts

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={type(opt).__name__}" for name, opt in self.optimizers.items())
        return f"MixedOptimizer({inner})"


# ---------------------------------------------------------------------------------------------
# Arms: how an experiment parametrises and steps W_Q, W_K
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmSpec:
    """What an arm changes: Q/K mode and initialisation (model side) and the frames' rule."""

    qk: str  # "stiefel" | "euclidean" | "frozen"
    qk_init: str  # "standard" | "orthonormal"
    frame_rule: str | None = None  # "adam" | "sgd" | None (frames, if any, are not stepped)
    projector: bool = True
    second_moment: str = "frame"
    description: str = ""


ARMS: dict[str, ArmSpec] = {
    "adamw": ArmSpec("euclidean", "standard", description="baseline: Q/K ordinary matrices, usual init, AdamW"),
    "adamw-orthoinit": ArmSpec("euclidean", "orthonormal", description="control: AdamW from the Stiefel arm's frames"),
    "stiefel-adam": ArmSpec("stiefel", "orthonormal", "adam", description="StiefelAdam on Q/K frames"),
    "stiefel-sgd": ArmSpec("stiefel", "orthonormal", "sgd", description="fixed-step Riemannian SGD on Q/K frames"),
    "frozen": ArmSpec("frozen", "orthonormal", description="orthonormal Q/K, never updated"),
    "no-projector": ArmSpec("stiefel", "orthonormal", "adam", projector=False,
                            description="ablation: StiefelAdam without the tangent projection"),
    "coordinate-moment": ArmSpec("stiefel", "orthonormal", "adam", second_moment="coordinate",
                                 description="ablation: elementwise second moment (breaks O(d)-equivariance)"),
}


def arm_spec(arm: str) -> ArmSpec:
    """The ArmSpec of a named arm; a clear error naming the valid arms otherwise."""
    try:
        return ARMS[arm]
    except KeyError:
        raise ValueError(f"unknown arm {arm!r}; choose one of: {', '.join(ARMS)}") from None


def build_optimizer(
    model: nn.Module,
    arm: str,
    lr: float,
    weight_decay: float,
    *,
    frame_lr: float | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    frame_eps: float | None = None,
    max_step: float | None = None,
    sgd_momentum: float = 0.9,
) -> MixedOptimizer:
    """One optimizer for a whole model: the arm's rule on W_Q/W_K frames, AdamW on the rest.

    AdamW applies weight decay to matrices and embeddings, not to biases and norm gains
    (parameters with fewer than two dimensions). In the Euclidean arms W_Q, W_K are ordinary
    matrices and get exactly that treatment. In the Stiefel arms the frames get the arm's rule
    with `frame_lr` (default: lr), `frame_eps` (default: eps) and the same weight_decay, which
    is a no-op on frames (Proposition 5). The model must have been built with the arm's qk mode.
    """
    from .nn import frames, qk_matrices  # optim sits below nn; only this factory needs models

    spec = arm_spec(arm)
    modes = {getattr(m, "qk", None) for m in model.modules() if hasattr(m, "frame_parameters")}
    if modes and modes != {spec.qk}:
        raise ValueError(f"arm {arm!r} needs a model built with qk={spec.qk!r}; this model has qk={sorted(modes)}")
    frame_params = [p for _, p in frames(model)]
    frame_ids = {id(p) for p in frame_params}
    frozen_ids = {id(p) for _, p in qk_matrices(model)} if spec.qk == "frozen" else set()
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in frame_ids or id(p) in frozen_ids:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizers: dict[str, Optimizer] = {}
    if groups:
        optimizers["adamw"] = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    if spec.frame_rule is not None and frame_params:
        flr = lr if frame_lr is None else frame_lr
        if spec.frame_rule == "adam":
            optimizers["frames"] = StiefelAdam(
                frame_params, lr=flr, betas=betas, eps=eps if frame_eps is None else frame_eps,
                max_step=max_step, weight_decay=weight_decay, projector=spec.projector,
                second_moment=spec.second_moment,
            )
        else:
            optimizers["frames"] = StiefelSGD(frame_params, lr=flr, momentum=sgd_momentum, max_step=max_step, weight_decay=weight_decay)
    return MixedOptimizer(optimizers)
