"""What StiefelAdam shares with geoopt's RiemannianAdam: on a Stiefel manifold with the polar retraction in place of
its QR one, geoopt's rule (one scalar second moment per frame, the moment transported by projection) gives
StiefelAdam's trajectory to float64 round-off. Needs geoopt (the `compare` extra); skipped without it."""

from __future__ import annotations

import pytest
import torch

from stiefel_attention import StiefelAdam
from stiefel_attention.manifold import polar_retract, random_frame

geoopt = pytest.importorskip("geoopt")

F64 = torch.float64


class PolarStiefel(geoopt.EuclideanStiefel):
    """geoopt's Stiefel manifold (embedded metric) with the polar retraction instead of its QR one."""

    def retr(self, x, u):
        return polar_retract(x, u)


def _trajectories(W0, grads, max_step):
    ours = W0.clone().requires_grad_(True)
    opt = StiefelAdam([ours], lr=0.05, betas=(0.9, 0.99), eps=1e-8, max_step=max_step)
    theirs = [geoopt.ManifoldParameter(w.clone(), manifold=PolarStiefel()) for w in W0]  # one frame each
    ropt = geoopt.optim.RiemannianAdam(theirs, lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    for G in grads:
        ours.grad = G.clone()
        opt.step()
        for p, g in zip(theirs, G):
            p.grad = g.clone()
        ropt.step()
    return ours.detach(), torch.stack([p.detach() for p in theirs])


def test_geoopts_riemannian_adam_with_a_polar_retraction_is_stiefel_adam():
    g = torch.Generator().manual_seed(0)
    W0 = random_frame(3, d=12, r=4, generator=g, dtype=F64)
    grads = [torch.randn(3, 12, 4, generator=g, dtype=F64) for _ in range(30)]
    ours, theirs = _trajectories(W0, grads, max_step=None)
    gap = float((ours - theirs).abs().max())
    assert gap < 1e-12, gap
    # what StiefelAdam adds changes the trajectory: the trust region (binding here) is not geoopt's
    capped, theirs = _trajectories(W0, grads, max_step=0.01)
    assert float((capped - theirs).abs().max()) > 1e-3
