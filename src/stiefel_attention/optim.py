"""Riemannian optimizers for frames on St(d, r), with AdamW for every other parameter.

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

One optimizer, two rules. `StiefelAdam` and `StiefelSGD` are torch Optimizers whose param groups
say which rule applies: a group with `stiefel=True` (the default for bare tensors) holds frames
and gets the Riemannian rule; a group with `stiefel=False` gets AdamW, by torch's own functional
`torch.optim.adamw.adamw` with that group's lr, betas, eps, weight_decay and foreach/fused flags.
`param_groups(model, ...)` builds the groups of a whole model. State, `state_dict`, LR schedulers,
hooks and `zero_grad` are torch's.

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
  entirely normal, and then only in the scale v); the inverse square root is
  `manifold.inv_sqrt_gram`, whose cost follows from a bound on the step; one workspace per
  parameter replaces d-sized temporaries. The weight-decay term is dropped analytically there,
  because P_W(W) = W (I - W^T W) = 0 on St(d, r); the reference path adds it literally, and the
  tests check that both give the same trajectory, with and without decay.

The Gram matrix is always formed from W + xi itself (never assumed to be I + xi^T xi), so the
retraction also removes whatever round-off the frame carried: errors do not accumulate.

Non-finite gradients, `nonfinite=`:
- "raise" (default): the step is refused with `NonFiniteGradientError` before any parameter or
  state is written, so a caller can catch it, skip the batch and carry on. Raising needs one
  device-to-host synchronisation per step (a single check over every gradient); this mode also
  reads the largest actual step back to pick the cheapest exact inverse root.
- "skip": frames whose gradient is not finite are left as they were, with their moments, by
  masks on the device (GradScaler-style); the other frames step. With `max_step` set, the frame
  step then performs no device-to-host synchronisation at all: bias corrections are computed on
  the device and the inverse root's degree follows from max_step on the host, so the step can be
  captured in a CUDA graph or compiled whole. The step count used for the bias correction is
  kept per tensor, as in torch's Adam, and advances with its tensor even for a skipped frame.
  AdamW groups: with `fused=True` a group whose gradients are not all finite is skipped on the
  device (found_inf, as GradScaler does); otherwise that check costs one synchronisation.
`torch.amp.GradScaler` never calls `step` with non-finite gradients, so it composes with both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _torch_adamw

from . import _guard
from ._dtensor import GATHER, all_reduce_over_mesh, frame_layout, is_dtensor, like_frames_batch
from .manifold import (
    _compute_dtype,
    _polar_factor,
    check_frames,
    inv_sqrt_gram,
    isometry_error,
    project_tangent,
    spectral_tangent_direction,
    sym,
)

__all__ = [
    "FrameStepError",
    "LandingStiefelAdam",
    "NonFiniteGradientError",
    "StiefelAdam",
    "StiefelMuon",
    "StiefelSGD",
    "param_groups",
    "landing_stiefel_adam",
    "stiefel_adam",
    "stiefel_muon",
    "stiefel_sgd",
]

NONFINITE_MODES = ("raise", "skip")
FrameStepError = _guard.FrameStepError
_FRAME_DTYPES = (torch.float32, torch.float64)


class NonFiniteGradientError(FloatingPointError):
    """A gradient had a NaN or inf entry; the step was refused and nothing was changed."""


def _non_finite_error(where: Sequence[str]) -> NonFiniteGradientError:
    """The one message for a refused step, naming the offending parameters."""
    return NonFiniteGradientError(
        f"non-finite gradient (NaN or inf) in {', '.join(where)}; the step was refused and no parameter "
        "or optimizer state was changed. Lower the learning rate, use a GradScaler, pass nonfinite='skip', "
        "or catch NonFiniteGradientError to skip the batch."
    )


# How far from orthonormal a starting frame may be. The check catches frames that were never
# orthonormalised (errors of order 1), not round-off: float32 frames cast to float64 carry ~1e-6,
# and the first retraction removes whatever is there.
_START_TOLERANCE = 1e-3


def _check_start(p: Tensor, where: str, tol: float = _START_TOLERANCE) -> None:
    if is_dtensor(p):  # every rank checks what it holds; the verdict is the whole mesh's
        layout = frame_layout(p, where)
        local = p.to_local()
        if local.is_meta:
            return
        whole = p.full_tensor() if layout == GATHER else local
        _check_values(whole, where, mesh=p.device_mesh, tol=tol)
        return
    _check_values(p, where, tol=tol)


def _retract(W: Tensor, xi: Tensor) -> Tensor:
    """The polar retraction of the reference path, without polar_retract's rank check (a host read per call):
    W + xi for a step of a frame has independent columns."""
    cd = _compute_dtype(torch.promote_types(W.dtype, xi.dtype))
    return _polar_factor(W.to(cd) + xi.to(cd))


def _version(p: Tensor) -> int:
    """The version counter of p's values (a DTensor's local part), bumped by every in-place write."""
    return (p.to_local() if is_dtensor(p) else p)._version


def _dtype_message(where: str, dtype: torch.dtype) -> str:
    return (
        f"{where} has dtype {dtype}; Stiefel optimizers keep frames in float32 or float64 "
        "(one scalar second moment per frame overflows half precision). Keep W_Q, W_K in float32 "
        "as master weights (cast the model back, or cast only the other parameters); autocast still runs the "
        "attention matmuls in half precision."
    )


def _check_values(p: Tensor, where: str, mesh=None, tol: float = _START_TOLERANCE) -> None:
    try:
        check_frames(p, name=where)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{err}. Frame groups take tensors of shape (..., d, r); put other parameters in a "
            "group with stiefel=False (param_groups(model) does this)."
        ) from None
    if p.dtype not in _FRAME_DTYPES:
        raise ValueError(_dtype_message(where, p.dtype))
    if p.is_meta or (p.numel() == 0 and mesh is None):
        # No values to check: a model built on the meta device (frames drawn later, by reset_parameters
        # after to_empty) or an empty shard of a sharded parameter. The first step retracts whatever is
        # there, but it cannot make uninitialised memory a sensible frame: initialise before training.
        return
    err = isometry_error(p).double().reshape(1) if p.numel() else torch.zeros(1, dtype=torch.float64)
    if mesh is not None:  # an empty shard still takes part in the mesh's verdict
        err = all_reduce_over_mesh(err.nan_to_num(nan=math.inf).to(p.device), torch.distributed.ReduceOp.MAX, mesh)
    err = float(err)
    if not math.isfinite(err) or err > tol:
        raise ValueError(
            f"{where} is not on the Stiefel manifold: max ||W^T W - I||_F = {err:.3g} > {tol:g}. "
            "Start from orthonormal frames, e.g. stiefel_attention.manifold.random_frame(...) or "
            "polar_retract(W, torch.zeros_like(W)) to project an existing matrix; a parameter that is "
            "not a frame belongs in a group with stiefel=False."
        )


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.0,
    *,
    frame_lr: float | None = None,
    no_decay: Iterable[Tensor] = (),
    **frame_options: Any,
) -> list[dict[str, Any]]:
    """Param groups for a whole model: its frames get the Riemannian rule, the rest AdamW.

    nanoGPT's decay rule for the rest: tensors with two or more dimensions (matrices, embeddings,
    convolution kernels) decay by `weight_decay`; biases and norm gains do not; tensors listed
    in `no_decay` do not either. Frames (`stiefel_attention.nn.frames(model)`: W_Q, W_K of every
    StiefelAttention with qk="stiefel") form one group with `stiefel=True`, `lr=frame_lr` when given
    and any other frame hyper-parameter (eps, max_step, ...) from `frame_options`; decay is exempt
    there because it has no effect on a frame (Proposition 5). Parameters that do not require a
    gradient are left out. Empty groups are dropped. So

        StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=1e-2), lr=1e-3, max_step=0.1)

    trains a model with AdamW everywhere except its frames.
    """
    from .nn import frames  # nn builds on optim's siblings; only this helper needs models

    _guard.remember_names(model)  # so that errors name parameters as the model does
    frame_list = [p for _, p in frames(model)]
    frame_ids = {id(p) for p in frame_list}
    exempt = {id(p) for p in no_decay}
    decay, plain = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in frame_ids:
            continue
        (decay if p.dim() >= 2 and id(p) not in exempt else plain).append(p)
    frame_group: dict[str, Any] = {"params": frame_list, "stiefel": True, **frame_options}
    if frame_lr is not None:
        frame_group["lr"] = frame_lr
    groups = [
        {"params": decay, "weight_decay": weight_decay, "stiefel": False},
        {"params": plain, "weight_decay": 0.0, "stiefel": False},
        frame_group,
    ]
    return [g for g in groups if g["params"]]


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def _bias_corrections(step: float, beta1: float, beta2: float) -> tuple[float, float]:
    return 1.0 - beta1**step, 1.0 - beta2**step


def _frames_view(t: Tensor) -> Tensor:
    """(..., d, r) -> (n, d, r) as a view: batched matmuls want one batch dimension."""
    return t.view(-1, t.shape[-2], t.shape[-1])


def _cap(xi: Tensor, max_step: float | None) -> Tensor:
    """Rescale each frame's step so that ||xi||_F <= max_step (the trust region)."""
    if max_step is None:
        return xi
    norm = torch.linalg.matrix_norm(xi, keepdim=True)  # (..., 1, 1)
    return xi * (max_step / norm.clamp_min(torch.finfo(xi.dtype).tiny)).clamp(max=1.0)


def _keep_where(keep: Tensor | None, new: Tensor, old: Tensor) -> None:
    """new <- old where keep is False, in place; keep (on the device) has new's leading (batch) shape."""
    if keep is not None:
        torch.where(keep.view(keep.shape + (1,) * (new.dim() - keep.dim())), new, old, out=new)


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
    keep: list[Tensor] | None = None,
) -> None:
    """One StiefelAdam step on lists of frame tensors, in place.

    exp_avg_sqs[i] has shape params[i].shape[:-2] (one scalar per frame) when
    second_moment == "frame", and params[i].shape when "coordinate". The batched path covers
    the paper's rule (projector on, one scalar per frame, contiguous frames); the ablations
    always take the single-tensor path. `precomputed` = (W^T G, ||P_W G||^2) per tensor, as
    returned by `_batched_tangent_sq_norms`, lets a caller check several batches before writing.
    `keep` (one bool tensor of shape (n_frames,) per parameter) selects the skip mode: frames
    marked False keep their value and moments, and the batched path runs without host syncs when
    max_step is set. Without `keep`, a non-finite gradient raises NonFiniteGradientError.
    """
    fast_ok = projector and second_moment == "frame" and all(p.is_contiguous() for p in params)
    if batched is None:
        batched = fast_ok
    if batched and not fast_ok:
        raise ValueError("the batched path needs projector=True, second_moment='frame' and contiguous frames")
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, max_step=max_step, weight_decay=weight_decay, keep=keep)
    if batched:
        _batched_stiefel_adam(
            params, grads, exp_avgs, exp_avg_sqs, state_steps, workspaces, precomputed=precomputed, **kw
        )
    else:
        _single_tensor_stiefel_adam(
            params, grads, exp_avgs, exp_avg_sqs, state_steps, projector=projector, second_moment=second_moment, **kw
        )


def _tangent_or_refuse(params, grads, weight_decay: float, projector: bool, keep) -> list[Tensor]:
    """Reference path, phase 1: every (projected) gradient; refuse before writing unless skipping. A gradient is
    usable when its squared norm per frame is finite, as the batched path judges it (a finite gradient whose
    squared norm overflows would make the second moment infinite): refused, or in skip mode masked in keep."""
    tangent = []
    for W, G in zip(params, grads):
        if weight_decay != 0.0:
            G = G + weight_decay * W
        tangent.append(project_tangent(W, G) if projector else G)
    usable = [g.square().sum(dim=(-2, -1)).isfinite().reshape(-1) for g in tangent]
    if keep is None:
        bad = [f"frame parameter {i} of this group" for i, ok in enumerate(usable) if not bool(ok.all())]
        if bad:
            raise _non_finite_error(bad)
    else:
        for k, ok in zip(keep, usable):
            k &= ok
    return tangent


def _single_tensor_stiefel_adam(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    state_steps,
    *,
    lr,
    beta1,
    beta2,
    eps,
    max_step,
    weight_decay,
    projector,
    second_moment,
    keep,
) -> None:
    tangent = _tangent_or_refuse(params, grads, weight_decay, projector, keep)
    for i, (W, g, m, v, step_t) in enumerate(zip(params, tangent, exp_avgs, exp_avg_sqs, state_steps)):
        k = None if keep is None else keep[i].view(W.shape[:-2])
        old = None if k is None else (W.clone(), m.clone(), v.clone())
        if k is not None:
            g = torch.where(k[..., None, None], g, torch.zeros_like(g))
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
        W.copy_(_retract(W, xi))
        if old is not None:
            for new, before in zip((W, m, v), old):
                _keep_where(k, new, before)


def _batched_tangent_sq_norms(params: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Per parameter: A = W^T G, shape (n, r, r), and ||P_W(G)||_F^2 per frame, shape (n,).

    ||P_W G||^2 = ||G||^2 - ||sym(W^T G)||^2 because P_W is the orthogonal projection whose
    complement is G -> W sym(W^T G). A NaN or inf anywhere in a frame's gradient makes its norm
    non-finite, so the norms double as the finiteness check (the caller's).
    """
    As, sq_norms = [], []
    for W, G in zip(params, grads):
        W3 = _frames_view(W)
        G3 = G.reshape(W3.shape)
        A = torch.bmm(W3.mT, G3)  # (n, r, r)
        sq = torch.linalg.vector_norm(G3, dim=(-2, -1)).square() - torch.linalg.matrix_norm(sym(A)).square()
        As.append(A)
        sq_norms.append(sq.clamp_min_(0.0))  # round-off can push an all-normal gradient below 0
    return As, sq_norms


def _batched_moment_update(
    W: Tensor,
    G: Tensor,
    m: Tensor,
    A: Tensor,
    beta: float,
    dampening: float,
    keep: Tensor | None = None,
    scratch: Tensor | None = None,
) -> None:
    """m <- P_W(beta * m + dampening * G) in place, given A = W^T G (two d-sized products).

    With keep (skip mode), the new moment is formed in scratch and copied into m only for the frames
    marked True: the others keep theirs exactly, at the cost of one extra pass instead of a clone.
    """
    W3, m3 = _frames_view(W), _frames_view(m)
    B = torch.bmm(W3.mT, m3)  # (n, r, r); the old m is tangent at the previous frame, not at W
    out = m if keep is None else scratch.view_as(m)
    if dampening == 1.0:  # SGD momentum: m <- G + beta m, in one pass
        torch.add(G.view_as(m), m, alpha=beta, out=out)
    else:  # Adam, dampening = 1 - beta: m <- m + dampening (G - m), in one pass
        torch.lerp(m, G.view_as(m), dampening, out=out)
    S = sym(B.mul_(beta).add_(A, alpha=dampening))
    _frames_view(out).baddbmm_(W3, S, alpha=-1.0)
    if keep is not None:
        torch.where(keep.view(-1, 1, 1), _frames_view(out), m3, out=m3)


def _batched_stiefel_adam(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    state_steps,
    workspaces,
    *,
    lr,
    beta1,
    beta2,
    eps,
    max_step,
    weight_decay,
    precomputed=None,
    keep=None,
) -> None:
    # weight_decay is not used here: P_W(weight_decay * W) = 0 on St(d, r) (see module docstring).
    if not params:
        return
    if workspaces is None:
        workspaces = [torch.empty_like(p) for p in params]
    if precomputed is None:
        precomputed = _batched_tangent_sq_norms(params, grads)
        if keep is None:
            _refuse_if_non_finite(precomputed[1], [f"frame parameter {i} of this group" for i in range(len(params))])
    As, sq_norms = precomputed
    coefs = []  # per frame: xi = -coef * m
    for i, (W, G, m, v, step_t, A, sq, ws) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, As, sq_norms, workspaces)
    ):
        tiny = torch.finfo(v.dtype).tiny
        old_v = None if keep is None else v.clone()  # one scalar per frame
        step_t += 1
        _batched_moment_update(W, G, m, A, beta1, 1.0 - beta1, None if keep is None else keep[i], ws)
        v.mul_(beta2).add_(sq.view_as(v), alpha=1.0 - beta2)
        if keep is None:  # host bias corrections (the step count is read back: one sync per tensor)
            bc1, bc2 = _bias_corrections(float(step_t), beta1, beta2)
            # clamp: with eps = 0 and an all-zero gradient history, m = 0 too and the step is 0, not 0/0
            coefs.append((lr / bc1) / (v.reshape(-1) / bc2).sqrt().add_(eps).clamp_min_(tiny))  # (n,)
            continue
        # skip mode: everything on the device; skipped frames keep their moments and take a zero step
        _keep_where(keep[i], v.view(-1), old_v.view(-1))
        t = step_t.to(device=v.device, dtype=v.dtype)  # the count is float32: correct in the frames' precision
        bc1 = 1.0 - torch.pow(beta1, t)
        bc2 = 1.0 - torch.pow(beta2, t)
        coef = (lr / bc1) / (v.reshape(-1) / bc2).sqrt().add_(eps).clamp_min_(tiny)
        coefs.append(torch.where(keep[i], coef, torch.zeros_like(coef)))
    _batched_retract(params, exp_avgs, coefs, workspaces, max_step, keep)


def _batched_retract(
    params: list[Tensor],
    directions: list[Tensor],
    coefs: list[Tensor],
    workspaces: list[Tensor],
    max_step: float | None,
    keep: list[Tensor] | None = None,
    finite_directions: bool = True,
) -> None:
    """W <- polar(W - c * direction) for every frame, c per frame after the trust region.

    The r x r inverse square roots of all frames of this shape are computed in one batch. For
    W orthonormal and xi tangent, Gram(W + xi) = I + xi^T xi has eigenvalues in
    [1, 1 + ||xi||_F^2]; the margin covers round-off in W and in xi's tangency. Without `keep`
    the bound is the largest actual step, read back from the device (often well below max_step,
    which allows a cheaper series); with `keep` it is max_step itself (no sync), and frames
    marked False are left exactly as they were.
    """
    grams, step_norms = [], []
    for i, (W, D, c, buf) in enumerate(zip(params, directions, coefs, workspaces)):
        D3 = _frames_view(D)
        if keep is not None:  # a skipped frame takes a zero step: Y = W exactly when its direction is finite
            c = torch.where(keep[i], c, torch.zeros_like(c))
        step_norm = c * torch.linalg.vector_norm(D3, dim=(-2, -1))  # (n,) = ||xi||_F before the cap
        if max_step is not None:
            c = c * (max_step / step_norm.clamp_min(torch.finfo(c.dtype).tiny)).clamp(max=1.0)
            step_norm = step_norm.clamp(max=max_step)
        step_norms.append(step_norm)
        Y = _frames_view(buf)
        torch.addcmul(_frames_view(W), D3, c.view(-1, 1, 1), value=-1.0, out=Y)  # Y = W + xi
        if keep is not None and not finite_directions:  # a skipped frame's direction may hold NaN
            _keep_where(keep[i], Y, _frames_view(W))
        grams.append(torch.bmm(Y.mT, Y))  # (n, r, r)
    if keep is not None and max_step is not None:
        step_bound = max_step
    else:  # the largest actual step (<= max_step) sets how much r x r work the inverse root needs
        # (a zero for frame tensors that hold no frames: an empty shard)
        step_bound = float(torch.cat([*step_norms, step_norms[0].new_zeros(1)]).max())
    # ||W^T W - I|| stays ~1e-6 in float32 (the retraction corrects it every step): 100x headroom.
    margin = 1e-8 if params[0].dtype == torch.float64 else 1e-4
    inv_roots = inv_sqrt_gram(torch.cat(grams), 1.0 - margin, 1.0 + step_bound**2 + margin)
    for i, (W, buf, M) in enumerate(zip(params, workspaces, inv_roots.split([g.shape[0] for g in grams]))):
        torch.bmm(_frames_view(buf), M, out=_frames_view(W))  # W' = Y (Y^T Y)^(-1/2)
        if keep is not None:
            _keep_where(keep[i], _frames_view(W), _frames_view(buf))  # Y = W exactly where skipped


def _refuse_if_non_finite(values: list[Tensor], names: Sequence[str], meshes: Sequence = ()) -> None:
    """One host sync: raise NonFiniteGradientError naming every entry of `values` that is not all finite.

    With meshes (some values are a rank's part of DTensors), the flags are combined over every rank of each
    mesh first, so that all ranks refuse, or all step, together."""
    if not values:
        return
    ok = torch.stack([torch.isfinite(x).all() for x in values])
    for mesh in meshes:
        ok = all_reduce_over_mesh(ok.to(torch.float32), torch.distributed.ReduceOp.MIN, mesh).bool()
    if not bool(ok.all()):
        raise _non_finite_error([names[i] for i in torch.nonzero(~ok).flatten().tolist()])


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
    keep: list[Tensor] | None = None,
) -> None:
    """One fixed-step Riemannian SGD step: xi = -lr * m, m = P_W(momentum * m + grad). `keep` as in stiefel_adam."""
    if not params:
        return
    if batched is None:
        batched = all(p.is_contiguous() for p in params)
    if not batched:
        tangent = _tangent_or_refuse(params, grads, weight_decay, True, keep)
        for i, (W, g, buf) in enumerate(zip(params, tangent, momentum_buffers)):
            k = None if keep is None else keep[i].view(W.shape[:-2])
            old = None if k is None else (W.clone(), None if buf is None else buf.clone())
            if k is not None:
                g = torch.where(k[..., None, None], g, torch.zeros_like(g))
            if momentum != 0.0:
                buf.mul_(momentum).add_(g).copy_(project_tangent(W, buf))
                g = buf
            W.copy_(_retract(W, _cap(-lr * g, max_step)))
            if old is not None:
                _keep_where(k, W, old[0])
                if buf is not None:
                    _keep_where(k, buf, old[1])
        return
    if workspaces is None:
        workspaces = [torch.empty_like(p) for p in params]
    if precomputed is None:
        precomputed = _batched_tangent_sq_norms(params, grads)  # the norms: finiteness check only
        if keep is None:
            _refuse_if_non_finite(precomputed[1], [f"frame parameter {i} of this group" for i in range(len(params))])
    As = precomputed[0]
    if momentum != 0.0:
        for i, (W, G, buf, A) in enumerate(zip(params, grads, momentum_buffers, As)):
            _batched_moment_update(W, G, buf, A, momentum, 1.0, None if keep is None else keep[i], workspaces[i])
        directions = momentum_buffers
    else:
        # The direction is g itself, held in the workspace; the retraction then overwrites it
        # elementwise with W + xi in the same pass that reads it.
        for W, G, A, buf in zip(params, grads, As, workspaces):
            torch.baddbmm(G.reshape(_frames_view(W).shape), _frames_view(W), sym(A), alpha=-1.0, out=_frames_view(buf))
        directions = workspaces
    coefs = [torch.full((_frames_view(W).shape[0],), lr, dtype=W.dtype, device=W.device) for W in params]
    # with momentum the directions are the (restored, finite) buffers; without, the raw tangent gradients
    _batched_retract(params, directions, coefs, workspaces, max_step, keep, finite_directions=momentum != 0.0)


# ---------------------------------------------------------------------------------------------
# Functional StiefelMuon (manifold Muon)
# ---------------------------------------------------------------------------------------------


def stiefel_muon(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    workspaces: list[Tensor] | None = None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    tol: float,
    max_iters: int,
    keep: list[Tensor] | None = None,
) -> Tensor:
    """One manifold-Muon step per frame; returns the largest duality gap of the inner solves (0-d tensor).

    b = momentum * b + grad (ambient, as torch's Muon; transport is unnecessary, the solve projects);
    U = grad + momentum * b with nesterov, else b; A = lr * the tangent direction of steepest descent under the
    spectral norm for U (`manifold.spectral_tangent_direction`: tangent, ||A||_2 = lr); W <- polar(W + A), whose
    Gram matrix I + A^T A has its spectrum in [1, 1 + lr^2]. weight_decay has no effect on frames: its Riemannian
    gradient P_W(wd W) is zero (Proposition 5), so it is not added (added to an ambient momentum, the decay of past
    frames would not be normal at the current one).
    """
    worst = torch.zeros(())
    for i, (W, G, buf) in enumerate(zip(params, grads, momentum_buffers)):
        k = None if keep is None else keep[i].view(W.shape[:-2])
        g = G
        if k is not None:
            old = (W.clone(), buf.clone())
            g = torch.where(k[..., None, None], g, torch.zeros_like(g))
        buf.mul_(momentum).add_(g)
        U = g + momentum * buf if nesterov else buf
        A, gap, _ = spectral_tangent_direction(W, U, tol=tol, max_iters=max_iters)
        Y = W + lr * A  # (..., d, r)
        gram = (Y.mT @ Y).reshape(-1, W.shape[-1], W.shape[-1])
        slack = 1e-3  # the frame's own round-off (the start check allows 1e-3) and the gram's
        W.copy_(Y @ inv_sqrt_gram(gram, 1.0 - slack, 1.0 + lr * lr + slack).view(W.shape[:-2] + gram.shape[-2:]))
        if k is not None:
            _keep_where(k, W, old[0])
            _keep_where(k, buf, old[1])
            gap = torch.where(k, gap, torch.zeros_like(gap))
        worst = torch.maximum(worst, gap.max().to(worst.dtype)) if gap.numel() else worst
    return worst


# ---------------------------------------------------------------------------------------------
# Functional landing StiefelAdam (retraction-free)
# ---------------------------------------------------------------------------------------------


def landing_drift_bound(max_step: float) -> float:
    """The bound on max ||W^T W - I||_2 that `landing_stiefel_adam` keeps for every frame, step after step."""
    return 2.0 * max_step * max_step


def landing_stiefel_adam(
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
    max_step: float,
    keep: list[Tensor] | None = None,
) -> None:
    """StiefelAdam's moments and step D, then a landing update in place of the polar retraction:

        xi = psi W,  psi = (I - W W^T / 2) D W^T - W D^T (I - W W^T / 2)   (skew: W^T xi is skew for any W)
        xi *= min(1, max_step / ||xi||_F)
        W <- W + xi - W (W^T W - I) / 2                                    (one Newton-Schulz step towards St)

    For orthonormal W and tangent D, xi = D. With E = W^T W - I, the new E is
    xi^T xi - 3/4 E^2 + 1/4 E^3 - (xi^T W E + E W^T xi) / 2, so ||E||_2 <= 2 max_step^2 holds for every later
    step once it holds (max_step <= 1/4; `landing_drift_bound`): the frames stay within that distance of the
    manifold, never on it, with no eigendecomposition or inverse root. Gradients and moments are projected with
    P_W's formula G - W sym(W^T G) at the current, nearly orthonormal, W. One scalar second moment per frame.
    """
    for i, (W, G, m, v, step_t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        k = None if keep is None else keep[i].view(W.shape[:-2])
        old = None if k is None else (W.clone(), m.clone(), v.clone())
        g = G - W @ sym(W.mT @ G)
        if k is not None:
            g = torch.where(k[..., None, None], g, torch.zeros_like(g))
        step_t += 1
        bc1, bc2 = _bias_corrections(float(step_t), beta1, beta2)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        m.sub_(W @ sym(W.mT @ m))  # transport to the current W
        v.mul_(beta2).add_(g.square().sum(dim=(-2, -1)), alpha=1.0 - beta2)
        D = -lr * (m / bc1) / (v / bc2).sqrt().add_(eps).clamp_min_(torch.finfo(v.dtype).tiny)[..., None, None]
        WtW = W.mT @ W  # (..., r, r)
        DtW = D.mT @ W
        xi = D @ WtW - 0.5 * (W @ ((W.mT @ D) @ WtW)) - W @ DtW + 0.5 * (W @ (DtW @ WtW))
        xi = _cap(xi, max_step)
        E = WtW - torch.eye(W.shape[-1], dtype=W.dtype, device=W.device)
        W.add_(xi - 0.5 * (W @ E))
        if old is not None:
            for new, before in zip((W, m, v), old):
                _keep_where(k, new, before)


# ---------------------------------------------------------------------------------------------
# Optimizer classes
# ---------------------------------------------------------------------------------------------

# Every group, frame or not, carries these; the AdamW groups read them (torch's AdamW defaults).
_ADAMW_DEFAULTS = dict(betas=(0.9, 0.999), eps=1e-8, foreach=None, fused=None, capturable=False)


class FrameBatch(NamedTuple):
    """The frames of one shape in one frame group, ready for a rule's functional step: plain tensors (a DTensor's
    local part, whole frames, or its gathered frames, which `_write_back` returns to each rank's slice)."""

    group: dict
    params: list[Tensor]  # (..., d, r) each
    grads: list[Tensor]
    state: tuple[list, ...]  # the rule's state items per parameter, in the order its _frame_state returns them
    workspaces: list[Tensor]  # one scratch buffer per parameter, shaped like it (never saved)
    names: list[str]  # for messages


class AdamWBatch(NamedTuple):
    """The parameters of one AdamW group with a gradient, and their state in torch.optim.AdamW's layout."""

    group: dict
    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    names: list[str]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) or (isinstance(x, Tensor) and x.numel() == 1)


def _check_common(lr: float, weight_decay: float, max_step: float | None, nonfinite: str) -> None:
    if not (_is_number(lr) and 0.0 <= lr < math.inf):
        raise ValueError(f"invalid learning rate: {lr!r}; a finite number >= 0")
    if not (_is_number(weight_decay) and 0.0 <= weight_decay < math.inf):
        raise ValueError(f"invalid weight_decay: {weight_decay!r}; a finite number >= 0")
    if max_step is not None and not (_is_number(max_step) and 0.0 < max_step < math.inf):
        raise ValueError(f"invalid max_step: {max_step!r}; a finite number > 0, or None for no trust region")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")


def _check_betas_eps(betas, eps) -> None:
    if not (_is_number(eps) and 0.0 <= eps < math.inf):
        raise ValueError(f"invalid eps: {eps!r}; a finite number >= 0")
    pair = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) for b in betas)
    if not (pair and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas: {betas!r}; a pair (beta1, beta2), both in [0, 1)")


class _RiemannianOptimizer(Optimizer):
    """Shared plumbing: groups by rule, one finiteness check, AdamW groups, workspaces kept out of state.

    Subclasses define `_frame_state(group, p, state)` (the rule's state items of one parameter) and
    `_frame_step(batch, fast, precomputed, keep)` (the rule's functional step on one FrameBatch).
    """

    def __init__(self, params, defaults: dict[str, Any], nonfinite: str):
        self.nonfinite = nonfinite
        defaults = {**_ADAMW_DEFAULTS, "stiefel": True, **defaults}
        self._group_keys = frozenset(defaults)  # what every group of ours holds (torch may add defaults later)
        # What the frames were after our last step (tensor version counters), so that a frame written since (the
        # model's load_state_dict, an in-place edit) is checked again before it is stepped; and after this
        # optimizer's own load_state_dict, every frame is.
        self._versions: dict[Tensor, int] = {}
        self._recheck = False
        super().__init__(params, defaults)
        # Scratch buffers, one per parameter: derived data, so never saved in state_dict.
        self._workspaces: dict[Tensor, Tensor] = {}

    def _start_tolerance(self, group: dict[str, Any], p: Tensor) -> float:
        """How far from orthonormal (max ||W^T W - I||_F) a frame of this group may be when it is checked."""
        return _START_TOLERANCE

    def keeps_frames_on_manifold(self, group: dict[str, Any]) -> bool:
        """The groups whose rule keeps frames on St(d, r) (`_guard`): those with stiefel=True."""
        return bool(group["stiefel"])

    def _name(self, gi: int, i: int, p: Tensor) -> str:
        """How messages name parameter i of group gi: by its name in the model where known."""
        names = self.param_groups[gi].get("param_names")
        where = f"param_groups[{gi}]['params'][{i}]"
        if names:
            return f"{names[i]} ({where})"
        return where if torch.compiler.is_compiling() else _guard.name_of(p, where)  # no lookup in a traced step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        gi = len(self.param_groups)
        # every group's values are checked as the constructor's are, before the group is added
        self._check_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}, gi)
        super().add_param_group(param_group)
        _guard.check_optimizer(self)  # a frame in a stiefel=False group, a parameter a conversion replaced
        group = self.param_groups[-1]
        if not group["stiefel"]:
            return
        for i, p in enumerate(group["params"]):
            _check_start(p.detach(), self._name(gi, i, p), self._start_tolerance(group, p))
            self._versions[p] = _version(p)

    def _check_frames_now(self) -> None:
        """Before a step: refuse a frame cast to half precision since the optimizer was built, and check again the
        start point of every frame written to since our last step (or of every frame after load_state_dict)."""
        for gi, group in enumerate(self.param_groups):
            if not group["stiefel"]:
                continue
            for i, p in enumerate(group["params"]):
                if p.dtype not in _FRAME_DTYPES:
                    raise ValueError(_dtype_message(self._name(gi, i, p), p.dtype) + " The step was refused.")
                # a DTensor's start check is collective: only after load_state_dict, which every rank calls
                if self._recheck or (not is_dtensor(p) and self._versions.get(p) != _version(p)):
                    _check_start(p.detach(), self._name(gi, i, p), self._start_tolerance(group, p))
        self._recheck = False

    def _remember_versions(self) -> None:
        for group in self.param_groups:
            if group["stiefel"]:
                for p in group["params"]:
                    self._versions[p] = _version(p)

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        """Raise ValueError, naming the group, for a hyper-parameter outside its range."""
        try:
            _check_common(group["lr"], group["weight_decay"], group.get("max_step"), self.nonfinite)
            _check_betas_eps(group["betas"], group["eps"])
            self._check_rule(group)
        except ValueError as err:
            raise ValueError(f"param_groups[{gi}]: {err}") from None

    def _check_rule(self, group: dict[str, Any]) -> None:
        """The subclass's own hyper-parameters of one group."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, after checking that state_dict was saved by this kind of optimizer with
        the same frame / AdamW split of its groups (a torch.optim.AdamW state dict, say, is refused here
        rather than failing at the next step)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects an optimizer state dict "
                "({'state': ..., 'param_groups': [...]}), as state_dict() returns"
            )
        needed = set(self._group_keys)
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            missing = sorted(needed - set(saved))
            if missing:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param group {gi} of this state dict has no "
                    f"{', '.join(repr(k) for k in missing)}, so it was not saved by {type(self).__name__} "
                    f"({'a torch.optim' if 'stiefel' in missing else 'another'} optimizer's state dict?). "
                    f"Expected the state_dict() of a {type(self).__name__} with the same param groups."
                )
            if saved["stiefel"] != mine["stiefel"]:
                kind = {True: "frames (stiefel=True)", False: "AdamW parameters (stiefel=False)"}
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param group {gi} holds {kind[mine['stiefel']]} here "
                    f"but {kind[saved['stiefel']]} in the state dict: the groups are not the same"
                )
            self._check_saved_state(gi, saved, mine, state_dict["state"])
        super().load_state_dict(state_dict)
        self._recheck = True  # the frames, too, may have been loaded from elsewhere: check them at the next step

    def _check_saved_state(self, gi: int, saved: dict, mine: dict, state: dict) -> None:
        """Refuse state saved for parameters of other shapes or placements (other heads, head_dim, d_model, another
        sharding), naming the parameter, before anything is loaded."""
        for i, (index, p) in enumerate(zip(saved["params"], mine["params"])):
            for key, t in (state.get(index) or {}).items():
                if key == "step" or not isinstance(t, Tensor):
                    continue
                per_frame = key == "exp_avg_sq" and mine["stiefel"] and mine.get("second_moment") == "frame"
                want = tuple(p.shape[:-2]) if per_frame else tuple(p.shape)
                problem = None
                if tuple(t.shape) != want:
                    problem = f"has shape {tuple(t.shape)} where this parameter needs {want}"
                elif is_dtensor(t) != is_dtensor(p):
                    problem = "is sharded" if is_dtensor(t) else "is a plain tensor, and the parameter is sharded"
                elif is_dtensor(p) and (t.placements != p.placements or t.device_mesh.shape != p.device_mesh.shape):
                    problem = (
                        f"is placed {t.placements} on a mesh of shape {tuple(t.device_mesh.shape)}, the parameter "
                        f"{p.placements} on {tuple(p.device_mesh.shape)}"
                    )
                if problem is not None:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the saved {key!r} of {self._name(gi, i, p)} "
                        f"{problem}: the state dict was saved for another model (other heads, head_dim or d_model) "
                        "or another sharding (load sharded state with torch.distributed.checkpoint, which reshards "
                        "it). Nothing was loaded."
                    )

    def _workspace(self, p: Tensor, like: Tensor) -> Tensor:
        """p's scratch buffer, shaped like the tensor its step works on (p itself, or a DTensor's frames)."""
        buf = self._workspaces.get(p)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty_like(like, memory_format=torch.contiguous_format)
            self._workspaces[p] = buf
        return buf

    @staticmethod
    def _grad_of(p: Tensor) -> Tensor:
        if p.grad.is_sparse:
            raise RuntimeError(
                "sparse gradients are not supported (the Riemannian rule and AdamW here need dense ones)"
            )
        return p.grad

    def _frame_batches(self) -> tuple[list[FrameBatch], list[list], list]:
        """The frames with gradients, one FrameBatch per shape within each frame group; the write-backs of gathered
        DTensor frames; the device meshes of DTensor frames."""
        batches, write_backs, meshes = [], [], []
        for gi, group in enumerate(self.param_groups):
            if not group["stiefel"]:
                continue
            per_shape: dict[tuple, FrameBatch] = {}
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = self._name(gi, i, p)
                items = (p, self._grad_of(p), *self._frame_state(group, p, self.state[p]))
                if is_dtensor(p):
                    if all(p.device_mesh is not m for m in meshes):
                        meshes.append(p.device_mesh)
                    if frame_layout(p, name) == GATHER:
                        whole = [t.full_tensor() if is_dtensor(t) else t for t in items]
                        write_backs.append([(t, w) for t, w in zip(items, whole) if is_dtensor(t)])
                        items = tuple(whole)
                    else:
                        items = tuple(t.to_local() if is_dtensor(t) else t for t in items)
                W, G, *state = items
                key = (W.shape[-2], W.shape[-1], W.dtype, W.device)  # frames of one shape: one batch
                batch = per_shape.setdefault(key, FrameBatch(group, [], [], tuple([] for _ in state), [], []))
                batch.params.append(W)
                batch.grads.append(G)
                for lst, item in zip(batch.state, state):
                    lst.append(item)
                batch.workspaces.append(self._workspace(p, W))
                batch.names.append(name)
            batches += per_shape.values()
        return batches, write_backs, meshes

    @staticmethod
    def _write_back(write_backs: list) -> None:
        """Each rank keeps its slice of the gathered frames (and moments) the step updated; no communication."""
        from torch.distributed.tensor import DTensor, Replicate

        for pairs in write_backs:
            for dt, whole in pairs:
                everywhere = DTensor.from_local(whole, dt.device_mesh, [Replicate()] * dt.device_mesh.ndim)
                dt.to_local().copy_(everywhere.redistribute(dt.device_mesh, dt.placements).to_local())

    def _adamw_batches(self) -> list[AdamWBatch]:
        """The AdamW groups' parameters with gradients and their torch-layout state, one AdamWBatch per group."""
        out = []
        for gi, group in enumerate(self.param_groups):
            if group["stiefel"]:
                continue
            batch = AdamWBatch(group, [], [], [], [], [], [])
            on_device = group["fused"] or group["capturable"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:  # as torch.optim.AdamW lays it out
                    state["step"] = (
                        torch.zeros((), dtype=torch.float32, device=p.device)
                        if on_device
                        else torch.tensor(0.0, dtype=torch.float32)
                    )
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                batch.params.append(p)
                batch.grads.append(self._grad_of(p))
                batch.exp_avgs.append(state["exp_avg"])
                batch.exp_avg_sqs.append(state["exp_avg_sq"])
                batch.steps.append(state["step"])
                batch.names.append(self._name(gi, i, p))
            if batch.params:
                out.append(batch)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not torch.compiler.is_compiling():
            self._check_frames_now()  # half-precision frames; frames written since our last step
        frames, write_backs, meshes = self._frame_batches()  # by shape; sharded frames gathered where needed
        adamw = self._adamw_batches()
        meshes += [p.device_mesh for b in adamw for p in b.params if is_dtensor(p)]
        meshes = [m for i, m in enumerate(meshes) if all(m is not n for n in meshes[:i])]
        fast = [self._fast(b) for b in frames]
        # (W^T G, ||P_W(G)||^2) of the fast path: a NaN or inf anywhere in a gradient reaches its tangent norm
        pre = [_batched_tangent_sq_norms(b.params, b.grads) if f else None for b, f in zip(frames, fast)]
        keeps = self._refuse_or_mask(frames, pre, adamw, meshes)
        for batch, is_fast, p, keep in zip(frames, fast, pre, keeps):
            self._frame_step(batch, is_fast, p, keep)
        if write_backs:
            self._write_back(write_backs)
        for batch in adamw:
            self._adamw_step(batch, meshes)
        if not torch.compiler.is_compiling():
            self._remember_versions()
        return loss

    def _refuse_or_mask(self, frames: list[FrameBatch], pre: list, adamw: list[AdamWBatch], meshes: list) -> list:
        """nonfinite="raise": refuse the step (one host read for everything) if any gradient is not finite, and
        return no masks; "skip": per frame batch, which frames have finite gradients (on the device)."""
        if self.nonfinite == "raise":
            values, names = [], []
            for batch, p in zip(frames, pre):
                values += p[1] if p is not None else batch.grads
                names += batch.names
            for batch in adamw:
                values += [g.to_local() if is_dtensor(g) else g for g in batch.grads]
                names += batch.names
            _refuse_if_non_finite(values, names, meshes)
            return [None] * len(frames)
        return [
            [sq.isfinite() for sq in p[1]]
            if p is not None
            else [g.isfinite().all(dim=(-2, -1)).reshape(-1) for g in batch.grads]
            for batch, p in zip(frames, pre)
        ]

    def _adamw_step(self, batch: AdamWBatch, meshes=()) -> None:
        """torch's functional AdamW on one group. In skip mode a group with a non-finite gradient keeps its
        parameters and moments, with no host synchronisation: the fused kernel skips on the device (found_inf);
        otherwise the update runs and is masked back (a copy of the group's parameters and moments per step),
        and the step count advances, as the frames' does (torch's fused kernel does not advance it)."""
        group, params, grads, exp_avgs, exp_avg_sqs, steps, _ = batch
        found_inf, kept = None, None
        if self.nonfinite == "skip":
            bad = torch.stack([~(g.to_local() if is_dtensor(g) else g).isfinite().all() for g in grads]).any()
            for mesh in meshes:  # every rank of a sharded group decides alike
                bad = all_reduce_over_mesh(bad.to(torch.float32), torch.distributed.ReduceOp.MAX, mesh).bool()
            if group["fused"]:
                found_inf = bad.to(torch.float32)  # the fused kernel skips the update on the device
            else:
                tensors = [t.to_local() if is_dtensor(t) else t for t in (*params, *exp_avgs, *exp_avg_sqs)]
                kept = (bad, tensors, [t.clone() for t in tensors])
        beta1, beta2 = group["betas"]
        _torch_adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=False,
            fused=group["fused"],
            grad_scale=None,
            found_inf=found_inf,
            has_complex=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if kept is not None:
            bad, tensors, before = kept
            for now, old in zip(tensors, before):
                torch.where(bad, old, now, out=now)

    def _fast(self, batch: FrameBatch) -> bool:
        return batch.group["batched"] is not False and all(p.is_contiguous() for p in batch.params)

    def _frame_state(self, group: dict, p: Tensor, state: dict) -> tuple:
        raise NotImplementedError

    def _frame_step(self, batch: FrameBatch, fast: bool, precomputed, keep) -> None:
        raise NotImplementedError


class StiefelAdam(_RiemannianOptimizer):
    """Riemannian Adam on St(d, r) with one scalar second moment per frame; AdamW on other groups.

    Args:
        params: frame tensors of shape (..., d, r), d >= r, each trailing (d, r) matrix with
            orthonormal columns (checked at construction), or param-group dicts; a group with
            `stiefel=False` holds ordinary parameters and gets AdamW (see `param_groups`).
        lr: step size. For frames the step is scale free: each frame moves by about lr in
            Frobenius norm per step, whatever the gradient's scale.
        betas: decay rates of the first moment (a tangent matrix) and the second moment (a
            scalar per frame); AdamW's betas in AdamW groups.
        eps: added to sqrt(v_hat); as eps grows the frame rule turns into SGD with step lr/eps.
        max_step: trust region: each frame's step is rescaled to ||xi||_F <= max_step.
        weight_decay: for frames, adds weight_decay * W to the gradient before the projection, an
            exact no-op on St(d, r) (lambda W = W (lambda I) lies in the normal space, so P_W
            removes it: Proposition 5); accepted so that a global decay setting passes through,
            and certified to have no effect rather than silently dropped. AdamW's decoupled decay
            in AdamW groups.
        projector: False is an ablation: the raw gradient is used (no tangent projection, no
            transport); the polar retraction still returns to the manifold.
        second_moment: "frame" (the rule) or "coordinate", an ablation with Adam's elementwise
            v, which breaks O(d)-equivariance.
        batched: None picks the fast batched path whenever it applies (projector on, frame
            second moment); False forces the frame-by-frame reference path.
        nonfinite: "raise" or "skip" (see the module docstring); "skip" with max_step set gives a
            frame step with no device-to-host synchronisation.
        foreach: passed to torch's AdamW for AdamW groups (None: torch's choice).
        fused: passed to torch's AdamW for AdamW groups (None: torch's choice); with
            nonfinite="skip", fused AdamW groups skip a non-finite step on the device.
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
        *,
        nonfinite: str = "raise",
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        _check_common(lr, weight_decay, max_step, nonfinite)
        _check_betas_eps(betas, eps)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            max_step=max_step,
            weight_decay=weight_decay,
            projector=projector,
            second_moment=second_moment,
            batched=batched,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults, nonfinite)

    def _check_rule(self, group: dict[str, Any]) -> None:
        if group["second_moment"] not in ("frame", "coordinate"):
            raise ValueError(f"second_moment must be 'frame' or 'coordinate', got {group['second_moment']!r}")
        if group["batched"] and not (group["projector"] and group["second_moment"] == "frame"):
            raise ValueError(
                "batched=True needs projector=True and second_moment='frame'; the ablations use the reference path"
            )

    def _fast(self, batch: FrameBatch) -> bool:
        g = batch.group
        return g["projector"] and g["second_moment"] == "frame" and super()._fast(batch)

    def _frame_state(self, group: dict, p: Tensor, state: dict) -> tuple:
        if len(state) == 0:
            # on the device in skip mode (the bias correction is computed there, and a CUDA graph can capture
            # the step), on the host otherwise (read back once per step for the bias correction)
            device = (p.to_local() if is_dtensor(p) else p).device if self.nonfinite == "skip" else "cpu"
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if group["second_moment"] != "frame":
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif is_dtensor(p):  # one scalar per frame, placed like the frames (checkpoints reshard it with them)
                state["exp_avg_sq"] = like_frames_batch(p, p.dtype)
            else:
                state["exp_avg_sq"] = torch.zeros(p.shape[:-2], dtype=p.dtype, device=p.device)
        return state["exp_avg"], state["exp_avg_sq"], state["step"]

    def _frame_step(self, batch: FrameBatch, fast: bool, precomputed, keep) -> None:
        group = batch.group
        beta1, beta2 = group["betas"]
        stiefel_adam(
            batch.params,
            batch.grads,
            *batch.state,
            batch.workspaces,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            max_step=group["max_step"],
            weight_decay=group["weight_decay"],
            projector=group["projector"],
            second_moment=group["second_moment"],
            batched=fast,
            precomputed=precomputed,
            keep=keep,
        )


class StiefelSGD(_RiemannianOptimizer):
    """Fixed-step Riemannian SGD on St(d, r): xi = -lr * m, m the (transported) momentum of P_W(grad).

    Degree one in the gradient: scaling the loss by c scales every step by c. Weight decay is a
    no-op on frames, as for StiefelAdam. Groups with `stiefel=False` get AdamW (betas, eps from
    the group, torch's defaults otherwise), as in StiefelAdam.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        max_step: float | None = None,
        weight_decay: float = 0.0,
        batched: bool | None = None,
        *,
        nonfinite: str = "raise",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        _check_common(lr, weight_decay, max_step, nonfinite)
        _check_betas_eps(betas, eps)  # the AdamW groups'
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum: {momentum}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            max_step=max_step,
            weight_decay=weight_decay,
            batched=batched,
            betas=tuple(betas),
            eps=eps,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults, nonfinite)

    def _check_rule(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"invalid momentum: {group['momentum']}")

    def _frame_state(self, group: dict, p: Tensor, state: dict) -> tuple:
        if group["momentum"] != 0.0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return (state.get("momentum_buffer"),)

    def _frame_step(self, batch: FrameBatch, fast: bool, precomputed, keep) -> None:
        group = batch.group
        stiefel_sgd(
            batch.params,
            batch.grads,
            *batch.state,
            batch.workspaces,
            lr=group["lr"],
            momentum=group["momentum"],
            max_step=group["max_step"],
            weight_decay=group["weight_decay"],
            batched=fast,
            precomputed=precomputed,
            keep=keep,
        )


class StiefelMuon(_RiemannianOptimizer):
    """Manifold Muon on frames: steepest descent under the spectral norm within the tangent space of St(d, r),
    then the polar retraction (Bernstein, "Modular Manifolds", Thinking Machines, 2025); AdamW on other groups.

    Each step moves every frame by exactly lr in spectral norm along the tangent direction that decreases the
    loss fastest for that norm (`manifold.spectral_tangent_direction`, found by dual ascent on a symmetric
    multiplier; tangent and of spectral norm lr to round-off whatever the solve reached, its optimality certified
    by the duality gap). Like Muon, the step is scale free and uses momentum (Nesterov by default) on the raw
    gradient. Weight decay on frames is a no-op (not added: its Riemannian gradient is zero). The same param
    groups, `param_groups(model)`, state_dict, DTensor and non-finite conventions as StiefelAdam.

    Args:
        lr: the spectral norm of every frame's step (AdamW's lr in AdamW groups).
        momentum, nesterov: the momentum of the gradient, as torch.optim.Muon.
        tol, max_iters: the inner solve stops when every frame's duality gap (relative) is at most tol, or after
            max_iters iterations (a host read per iteration). The defaults reach tol in a few iterations for
            frames with d >= 4r, attention heads' usual shape (tests); `last_gap` holds the largest gap of the
            last step.
        betas, eps: AdamW's, for groups with stiefel=False.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        *,
        tol: float = 1e-3,
        max_iters: int = 30,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        nonfinite: str = "raise",
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        _check_common(lr, weight_decay, None, nonfinite)
        _check_betas_eps(betas, eps)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            tol=tol,
            max_iters=max_iters,
            betas=tuple(betas),
            eps=eps,
            foreach=foreach,
            fused=fused,
            max_step=None,
        )
        self.last_gap = torch.zeros(())
        super().__init__(params, defaults, nonfinite)

    def _check_rule(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"invalid momentum: {group['momentum']!r}; in [0, 1)")
        if not (_is_number(group["tol"]) and 0.0 < group["tol"] < 1.0):
            raise ValueError(f"invalid tol: {group['tol']!r}; a relative duality gap in (0, 1)")
        if not (isinstance(group["max_iters"], int) and group["max_iters"] >= 1):
            raise ValueError(f"invalid max_iters: {group['max_iters']!r}; a whole number >= 1")

    def _fast(self, batch: FrameBatch) -> bool:
        return False  # its own batched path: no precomputed tangent norms

    def _frame_state(self, group: dict, p: Tensor, state: dict) -> tuple:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return (state["momentum_buffer"],)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        self.last_gap = torch.zeros(())  # the largest duality gap over this step's frame batches
        return super().step(closure)

    def _frame_step(self, batch: FrameBatch, fast: bool, precomputed, keep) -> None:
        group = batch.group
        gap = stiefel_muon(
            batch.params,
            batch.grads,
            *batch.state,
            batch.workspaces,
            lr=group["lr"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            tol=group["tol"],
            max_iters=group["max_iters"],
            keep=keep,
        )
        self.last_gap = torch.maximum(self.last_gap, gap.to(self.last_gap.dtype))


class LandingStiefelAdam(StiefelAdam):
    """StiefelAdam without a retraction: the landing method (Ablin & Peyre 2022; Ablin, Vary, Gao & Absil 2023 for
    St(d, r)), with StiefelAdam's moments and one scalar second moment per frame. Each step moves a frame along a
    direction whose first-order effect on W^T W is zero and pulls it back towards the manifold by one
    Newton-Schulz step (`landing_stiefel_adam`); no eigendecomposition or inverse square root. Frames are not
    kept exactly orthonormal: max ||W^T W - I||_2 <= 2 max_step^2 at every step (`drift_bound`; 0.02 at
    max_step = 0.1), which `manifold_distance()` reports. max_step is required and at most 1/4. AdamW on groups
    with stiefel=False, as StiefelAdam.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, max_step: float = 0.1,
                 weight_decay: float = 0.0, *, nonfinite: str = "raise", foreach=None, fused=None):  # fmt: skip
        super().__init__(params, lr, betas, eps, max_step, weight_decay, batched=False, nonfinite=nonfinite,
                         foreach=foreach, fused=fused)  # fmt: skip

    def _check_rule(self, group: dict[str, Any]) -> None:
        super()._check_rule(group)
        if group["stiefel"] and not (group["max_step"] is not None and 0.0 < group["max_step"] <= 0.25):
            raise ValueError(
                f"LandingStiefelAdam needs max_step in (0, 0.25] on frames (its drift bound is 2 max_step^2), got "
                f"{group['max_step']!r}"
            )

    def _start_tolerance(self, group: dict[str, Any], p: Tensor) -> float:
        # the Frobenius norm of an r x r matrix is at most sqrt(r) times its spectral norm
        return max(_START_TOLERANCE, 1.01 * math.sqrt(p.shape[-1]) * landing_drift_bound(group["max_step"]))

    def drift_bound(self, group: dict[str, Any] | None = None) -> float:
        """The bound on ||W^T W - I||_2 of the group's frames (the first frame group's by default)."""
        group = group or next(g for g in self.param_groups if g["stiefel"])
        return landing_drift_bound(group["max_step"])

    @torch.no_grad()
    def manifold_distance(self) -> float:
        """The largest ||W^T W - I||_2 over this optimizer's frames now (r x r work per frame, one host read)."""
        worst = 0.0
        for group in self.param_groups:
            for p in group["params"] if group["stiefel"] else ():
                W = (p.full_tensor() if is_dtensor(p) else p).double()
                E = W.mT @ W - torch.eye(W.shape[-1], dtype=W.dtype, device=W.device)
                worst = max(worst, float(torch.linalg.matrix_norm(E, 2).max()))
        return worst

    def _frame_step(self, batch: FrameBatch, fast: bool, precomputed, keep) -> None:
        group = batch.group
        beta1, beta2 = group["betas"]  # weight decay: a no-op on frames, not applied (its projection is zero)
        landing_stiefel_adam(
            batch.params,
            batch.grads,
            *batch.state,
            batch.workspaces,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            max_step=group["max_step"],
            keep=keep,
        )
