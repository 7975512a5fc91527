"""StiefelMuon (manifold Muon on frames) and the direction it steps along, against an independent float64
computation, its defining properties (tangent, spectral norm = lr), and the defaults of its inner solve."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stiefel_attention import StiefelAdam, StiefelMuon, frames, isometry_error, param_groups
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.manifold import msign, random_frame, spectral_tangent_direction

F64 = torch.float64


def _independent_direction(W: torch.Tensor, G: torch.Tensor, iters: int = 4000) -> tuple[torch.Tensor, float]:
    """The same problem solved another way, one frame at a time in float64: projected subgradient descent on the
    dual min_L ||G + W L||_* with SVDs (torch.linalg.svd) and diminishing steps; returns (A, the best dual bound).
    A is the msign of the best multiplier, projected to the tangent space and normalised."""
    best, best_L = math.inf, None
    L = -0.5 * (W.T @ G + G.T @ W)
    scale = float(torch.linalg.svdvals(G + W @ L).mean())
    for k in range(iters):
        U, S, Vh = torch.linalg.svd(G + W @ L, full_matrices=False)
        if float(S.sum()) < best:
            best, best_L = float(S.sum()), L.clone()
        M = U @ Vh
        L = L - (0.5 * scale / math.sqrt(k + 1)) * 0.5 * (W.T @ M + M.T @ W)
    U, _, Vh = torch.linalg.svd(G + W @ best_L, full_matrices=False)
    A = -(U @ Vh)
    A = A - W @ (0.5 * (W.T @ A + A.T @ W))
    return A / torch.linalg.matrix_norm(A, 2), best


@pytest.mark.parametrize("shape", [(24, 6), (40, 10), (16, 4)])
def test_the_direction_is_tangent_of_unit_spectral_norm_and_as_good_as_an_independent_solve(shape):
    d, r = shape
    g = torch.Generator().manual_seed(0)
    W = random_frame(3, d=d, r=r, generator=g, dtype=F64)
    G = torch.randn(3, d, r, generator=g, dtype=F64)
    A, gap, _ = spectral_tangent_direction(W, G, tol=1e-9, max_iters=500)
    assert float((W.mT @ A + A.mT @ W).abs().max()) < 1e-12  # tangent
    torch.testing.assert_close(torch.linalg.matrix_norm(A, 2), torch.ones(3, dtype=F64), rtol=0, atol=1e-12)
    for i in range(3):
        A_ref, dual = _independent_direction(W[i], G[i])
        ours, theirs = float((G[i] * A[i]).sum()), float((G[i] * A_ref).sum())
        assert ours <= theirs + 1e-6 * dual  # at least as good as the independent solve
        assert ours >= -dual * (1 + 1e-9)  # and no better than the independent dual bound allows (weak duality)
        torch.testing.assert_close(A[i], A_ref, rtol=0, atol=1e-3)  # the same direction (unique optimum here)


def test_square_frames_get_the_closed_form_and_zero_gradients_no_step():
    g = torch.Generator().manual_seed(1)
    W = random_frame(2, d=6, r=6, generator=g, dtype=F64)
    G = torch.randn(2, 6, 6, generator=g, dtype=F64)
    A, gap, it = spectral_tangent_direction(W, G)
    S = W.mT @ G
    want = -W @ msign(0.5 * (S - S.mT))[0]  # the orthogonal group's steepest spectral direction
    torch.testing.assert_close(A, want, rtol=0, atol=1e-10)
    assert int(it) == 1 and float(gap.max()) < 1e-10
    A0, gap0, _ = spectral_tangent_direction(W, torch.zeros_like(G))
    assert torch.equal(A0, torch.zeros_like(A0)) and float(gap0.max()) == 0.0


@pytest.mark.parametrize("shape", [(64, 16), (128, 32), (256, 64), (768, 64)])
def test_the_default_tolerance_is_reached_within_the_default_iteration_cap_for_attention_heads(shape):
    """The defaults, justified: for frames with d >= 4r (attention heads: d_model = n_heads x head_dim with 4 heads
    or more) and random gradients, every solve reaches tol = 1e-3 in float32 well within max_iters = 30."""
    d, r = shape
    g = torch.Generator().manual_seed(2)
    W = random_frame(32, d=d, r=r, generator=g)
    G = torch.randn(32, d, r, generator=g)
    A, gap, it = spectral_tangent_direction(W, G)
    assert float(gap.max()) <= 1e-3 and int(it) <= 15
    assert float((W.mT @ A + A.mT @ W).abs().max()) < 1e-5


def _frames_and_grads(n=3, d=20, r=5, steps=15, seed=3):
    g = torch.Generator().manual_seed(seed)
    return random_frame(n, d=d, r=r, generator=g, dtype=F64), [torch.randn(n, d, r, generator=g, dtype=F64)
                                                               for _ in range(steps)]  # fmt: skip


def _trajectory(W0, grads, **kw):
    W = W0.clone().requires_grad_(True)
    opt = StiefelMuon([W], **kw)
    for G in grads:
        W.grad = G.clone()
        opt.step()
    return W.detach(), opt


def test_one_step_equals_the_independent_computation_and_retracts_polarly():
    W0, grads = _frames_and_grads(steps=1)
    lr = 0.05
    W1, opt = _trajectory(W0, grads, lr=lr, momentum=0.0, tol=1e-10, max_iters=500)
    for i in range(W0.shape[0]):
        A, _ = _independent_direction(W0[i], grads[0][i])
        U, _, Vh = torch.linalg.svd(W0[i] + lr * A, full_matrices=False)
        torch.testing.assert_close(W1[i], U @ Vh, rtol=0, atol=1e-4 * lr)
    assert float(isometry_error(W1)) < 1e-12 and float(opt.last_gap) < 1e-7  # the dual's float64 plateau


def test_steps_move_each_frame_by_lr_in_spectral_norm_to_first_order():
    W0, grads = _frames_and_grads(steps=1, d=40, r=8)
    for lr in (1e-3, 1e-2):
        W1, _ = _trajectory(W0, grads, lr=lr, momentum=0.0)
        step = W1 - W0  # polar(W + A) - W = A + O(lr^2)
        torch.testing.assert_close(torch.linalg.matrix_norm(step, 2) / lr, torch.ones(3, dtype=F64), rtol=0,
                                   atol=2 * lr)  # fmt: skip


def test_weight_decay_is_an_exact_no_op_and_the_step_is_scale_free():
    W0, grads = _frames_and_grads()
    ref, _ = _trajectory(W0, grads, lr=0.05)
    decayed, _ = _trajectory(W0, grads, lr=0.05, weight_decay=0.5)
    assert torch.equal(decayed, ref)
    for c in (1e-3, 1e3):
        scaled, _ = _trajectory(W0, [c * G for G in grads], lr=0.05)
        torch.testing.assert_close(scaled, ref, rtol=0, atol=1e-10)


def test_stiefel_muon_trains_a_model_keeps_its_frames_and_steps_the_rest_as_adamw():
    torch.manual_seed(0)
    model = CharGPT(30, 12, d_model=32, n_layers=1, n_heads=2, head_dim=8, mlp_ratio=2)
    twin = CharGPT(30, 12, d_model=32, n_layers=1, n_heads=2, head_dim=8, mlp_ratio=2)
    twin.load_state_dict(model.state_dict())
    opt = StiefelMuon(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=3e-3)
    ref = StiefelAdam(param_groups(twin, weight_decay=0.1, frame_lr=0.05), lr=3e-3)
    x = torch.randint(0, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for _, p in frames(model)]
    for m, o in ((model, opt), (twin, ref)):  # one step from the same weights and gradients
        F.cross_entropy(m(x).reshape(-1, 30), x.roll(-1, 1).reshape(-1)).backward()
        o.step()
        o.zero_grad()
    frame_ids = {id(p) for _, p in frames(model)}
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if id(p) not in frame_ids:  # AdamW groups: torch's AdamW in both
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    for _ in range(3):
        F.cross_entropy(model(x).reshape(-1, 30), x.roll(-1, 1).reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    assert all(float(isometry_error(p)) < 1e-5 for _, p in frames(model))
    assert all(not torch.equal(p, b) for (_, p), b in zip(frames(model), before))


@pytest.mark.parametrize("kwargs, match", [(dict(tol=0.0), "invalid tol"), (dict(max_iters=0), "invalid max_iters"),
                                           (dict(momentum=1.0), "invalid momentum")])  # fmt: skip
def test_bad_solver_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StiefelMuon([random_frame(d=4, r=2).requires_grad_()], **kwargs)


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_momentum_is_torch_muons_on_the_raw_gradient(nesterov):
    W0, grads = _frames_and_grads(steps=2)
    beta, lr = 0.9, 0.05
    got, _ = _trajectory(W0, grads, lr=lr, momentum=beta, nesterov=nesterov)
    W, buf = W0.clone(), torch.zeros_like(W0)
    for G in grads:  # by hand: b = beta b + g; U = g + beta b (Nesterov) or b; W <- polar(W + lr A(U))
        buf = beta * buf + G
        U = G + beta * buf if nesterov else buf
        A, _, _ = spectral_tangent_direction(W, U)
        u, _, vh = torch.linalg.svd(W + lr * A, full_matrices=False)
        W = u @ vh
    torch.testing.assert_close(got, W, rtol=0, atol=1e-12)
