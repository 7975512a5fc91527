"""Kong, Wang & Tao's Stiefel Adam (the arm kong-stiefel-adam): one step against the paper's update written out
frame by frame, frames kept on the manifold, a problem with a known optimum solved, and the arm's wiring."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stiefel_attention import frames, isometry_error
from stiefel_attention.bench.arms import HyperParameters, attention_options, build_optimizers
from stiefel_attention.bench.kong import KongStiefelAdam
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.manifold import random_frame

F64 = torch.float64


def _by_hand(X, G, lr, b1, b2, eps, a, steps_grads):
    """The update of Algorithm 2 for one frame, a step at a time, from the formulas (no batching)."""
    b = a / (a - 1)
    d, r = X.shape
    Y, pY, V, pV = torch.zeros(r, r, dtype=F64), torch.zeros(r, r, dtype=F64), torch.zeros(d, r, dtype=F64), None
    pV = torch.zeros(d, r, dtype=F64)
    for t, G in enumerate(steps_grads, start=1):
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        gY = (1 - b) / 2 * (X.T @ G - G.T @ X)
        gV = G - X @ (X.T @ G)
        pY = b2 * pY + (1 - b2) * gY**2
        pV = b2 * pV + (1 - b2) * gV**2
        Y = b1 * Y - (1 - b1) * gY
        X = X + X @ (lr / bc1 * Y / (torch.sqrt(pY / bc2) + eps))
        V = b1 * V - (3 * a - 2) / 2 * lr * (V @ Y) - (1 - b1) * gV
        Vt = V / (torch.sqrt(pV / bc2) + eps)
        Vt = Vt - X @ torch.linalg.inv(X.T @ X) @ (X.T @ Vt)
        X, V = X + lr * Vt @ (X.T @ X), V - lr * X @ (Vt.T @ V)
        u, _, vh = torch.linalg.svd(X, full_matrices=False)  # the polar factor
        X = u @ vh
    return X


def test_steps_equal_the_update_written_out_frame_by_frame():
    g = torch.Generator().manual_seed(0)
    W0 = random_frame(3, d=9, r=3, generator=g, dtype=F64)
    grads = [torch.randn(3, 9, 3, generator=g, dtype=F64) for _ in range(4)]
    W = W0.clone().requires_grad_(True)
    opt = KongStiefelAdam([W], lr=0.02)
    for G in grads:
        W.grad = G.clone()
        opt.step()
    for i in range(3):
        want = _by_hand(W0[i], None, 0.02, 0.9, 0.99, 1e-5, 0.5, [G[i] for G in grads])
        torch.testing.assert_close(W.detach()[i], want, rtol=0, atol=1e-12)
    assert float(isometry_error(W.detach())) < 1e-13


def test_it_finds_a_leading_eigenspace():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(16, 16, generator=g, dtype=F64)
    A = A @ A.T
    X = random_frame(1, d=16, r=3, generator=g, dtype=F64).requires_grad_(True)
    opt = KongStiefelAdam([X], lr=0.02)
    for _ in range(1500):
        loss = -torch.einsum("nji,jk,nki->", X, A, X)
        opt.zero_grad()
        loss.backward()
        opt.step()
    best = float(torch.linalg.eigvalsh(A)[-3:].sum())
    assert abs(-float(loss.detach()) - best) < 1e-3 * best


def test_the_arm_steps_frames_by_kongs_rule_and_the_rest_by_adamw():
    torch.manual_seed(0)
    model = CharGPT(30, 12, d_model=32, n_layers=1, n_heads=2, head_dim=8, mlp_ratio=2,
                    **attention_options("kong-stiefel-adam"))  # fmt: skip
    rest, kong = build_optimizers(model, "kong-stiefel-adam", HyperParameters(lr=1e-3, weight_decay=0.1,
                                                                               frame_lr=2e-3))  # fmt: skip
    assert isinstance(kong, KongStiefelAdam) and kong.param_groups[0]["lr"] == 2e-3
    assert {id(p) for p in kong.param_groups[0]["params"]} == {id(p) for _, p in frames(model)}
    x = torch.randint(0, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.cross_entropy(model(x).reshape(-1, 30), x.roll(-1, 1).reshape(-1)).backward()
    rest.step()
    kong.step()  # the guard lets it step frames: its rule retracts
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(float(isometry_error(p)) < 1e-5 for _, p in frames(model))
