"""LandingStiefelAdam: StiefelAdam's moments with the landing update instead of the polar retraction, against an
independent float64 computation of one step, and its drift from the manifold against the stated bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stiefel_attention import StiefelAdam, frames, param_groups
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.manifold import random_frame
from stiefel_attention.optim import LandingStiefelAdam, landing_drift_bound

F64 = torch.float64


def _spectral_drift(W: torch.Tensor) -> float:
    eye = torch.eye(W.shape[-1], dtype=W.dtype)
    return float(torch.linalg.matrix_norm(W.mT @ W - eye, 2).max())


def test_one_step_equals_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    W0 = random_frame(2, d=10, r=3, generator=g, dtype=F64)
    W0 = W0 + 1e-3 * torch.randn(W0.shape, generator=g, dtype=F64)  # a little off the manifold, as mid-run
    G = torch.randn(2, 10, 3, generator=g, dtype=F64)
    lr, max_step, b1, b2 = 0.05, 0.2, 0.9, 0.999
    W = W0.clone().requires_grad_(True)
    W.grad = G.clone()
    LandingStiefelAdam([W], lr=lr, betas=(b1, b2), eps=0.0, max_step=max_step).step()
    for i in range(2):  # by hand, one frame at a time, written from the formulas
        X, Gi = W0[i], G[i]
        sym = lambda A: (A + A.T) / 2  # noqa: E731
        g_ = Gi - X @ sym(X.T @ Gi)
        m = (1 - b1) * g_
        m = m - X @ sym(X.T @ m)
        v = (1 - b2) * float((g_ * g_).sum())
        D = -lr * (m / (1 - b1)) / (v / (1 - b2)) ** 0.5
        P = torch.eye(10, dtype=F64) - X @ X.T / 2
        psi = P @ D @ X.T - X @ D.T @ P
        assert float((psi + psi.T).abs().max()) < 1e-14  # skew
        xi = psi @ X
        xi = xi * min(1.0, max_step / float(torch.linalg.matrix_norm(xi)))
        want = X + xi - X @ (X.T @ X - torch.eye(3, dtype=F64)) / 2
        torch.testing.assert_close(W.detach()[i], want, rtol=0, atol=1e-14)


def test_on_the_manifold_the_step_is_stiefel_adams_to_first_order():
    g = torch.Generator().manual_seed(1)
    W0 = random_frame(3, d=16, r=4, generator=g, dtype=F64)
    G = torch.randn(3, 16, 4, generator=g, dtype=F64)
    steps = {}
    for cls in (LandingStiefelAdam, StiefelAdam):
        W = W0.clone().requires_grad_(True)
        W.grad = G.clone()
        cls([W], lr=1e-4, max_step=0.1).step()
        steps[cls] = W.detach() - W0
    gap = float((steps[LandingStiefelAdam] - steps[StiefelAdam]).abs().max())
    assert gap < 1e-6 < float(steps[StiefelAdam].abs().max())  # the same step up to O(lr^2)


@pytest.mark.parametrize("max_step", [0.05, 0.1, 0.25])
def test_the_drift_stays_below_its_bound_over_thousands_of_steps_with_the_cap_always_binding(max_step):
    g = torch.Generator().manual_seed(2)
    W = random_frame(8, d=12, r=4, generator=g, dtype=F64).requires_grad_(True)
    opt = LandingStiefelAdam([W], lr=10.0, max_step=max_step)  # lr far above the cap: every step is capped
    worst = 0.0
    for _ in range(3000):
        W.grad = torch.randn(W.shape, generator=g, dtype=F64)
        opt.step()
        worst = max(worst, _spectral_drift(W.detach()))
    bound = landing_drift_bound(max_step)
    assert worst <= bound and opt.manifold_distance() <= bound
    assert worst > 0.2 * bound  # the frames do leave the manifold: the bound is not vacuous
    assert opt.drift_bound() == bound


def test_the_drift_bound_is_needed_the_one_newton_schulz_step_is_what_keeps_it():
    """Without the pull back to the manifold (the -W E / 2 term), the drift grows past the bound."""
    g = torch.Generator().manual_seed(3)
    W = random_frame(4, d=12, r=4, generator=g, dtype=F64)
    eye = torch.eye(4, dtype=F64)
    for _ in range(300):
        X = W
        D = torch.randn(X.shape, generator=g, dtype=F64)
        P = torch.eye(12, dtype=F64) - X @ X.mT / 2
        xi = (P @ D @ X.mT - X @ D.mT @ P) @ X
        xi = xi * (0.1 / torch.linalg.matrix_norm(xi, keepdim=True))
        W = X + xi  # no pull back
    assert float(torch.linalg.matrix_norm(W.mT @ W - eye, 2).max()) > landing_drift_bound(0.1)


def test_landing_trains_a_model_and_keeps_its_frames_within_the_bound():
    torch.manual_seed(0)
    model = CharGPT(30, 12, d_model=32, n_layers=1, n_heads=2, head_dim=8, mlp_ratio=2)
    opt = LandingStiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.1), lr=3e-3, max_step=0.1)
    x = torch.randint(0, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(x).reshape(-1, 30), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5
    assert max(_spectral_drift(p.detach().double()) for _, p in frames(model)) <= landing_drift_bound(0.1)
    opt.load_state_dict(opt.state_dict())  # the recheck after a load accepts frames within the bound
    F.cross_entropy(model(x).reshape(-1, 30), x.roll(-1, 1).reshape(-1)).backward()
    opt.step()


@pytest.mark.parametrize("max_step", [None, 0.3])
def test_landing_needs_a_trust_region_of_at_most_a_quarter(max_step):
    with pytest.raises(ValueError, match="needs max_step in"):
        LandingStiefelAdam([random_frame(d=6, r=2).requires_grad_()], max_step=max_step)
