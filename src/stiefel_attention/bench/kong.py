"""Kong, Wang & Tao's momentum Stiefel Adam (ICLR 2023, "Momentum Stiefel Optimizer, with Applications to
Suitably-Orthogonal Attention, and Optimal Transport", Algorithm 2), written here from the paper's update as a
baseline arm: the closest prior art to the paper's rule (Stiefel Adam on each head's W_Q, W_K of a ViT).

Its momentum lives in two parts that stay in the tangent structure by construction: Y (r x r, skew) moves the
frame within its own span, V (d x r, with X^T V = 0 up to the flow) moves it out of the span. With the
canonical-type metric of parameter a (a = 1/2: the canonical metric; b = a / (a - 1)), per frame X and gradient G:

    gY = (1 - b)/2 (X^T G - G^T X),  gV = G - X X^T G
    pY <- b2 pY + (1 - b2) gY^2,  pV <- b2 pV + (1 - b2) gV^2           (elementwise second moments)
    Y  <- b1 Y - (1 - b1) gY;   X <- X + X (lr / bc1) Y / (sqrt(pY / bc2) + eps)      (forward Euler of expm)
    V  <- b1 V - (3a - 2)/2 lr V Y - (1 - b1) gV
    V~ = V / (sqrt(pV / bc2) + eps), less its part in the span of X
    X  <- X + lr V~ (X^T X);   V <- V - lr X (V~^T V)
    X  <- X (X^T X)^(-1/2)                                              (back onto St(d, r))

Differences from StiefelAdam: an elementwise second moment (not one scalar per frame), a momentum split between
the span and its complement (the canonical metric), no trust region. The last normalisation is computed exactly
here (the authors iterate towards it). Defaults are the paper's: lr 1e-3, betas (0.9, 0.99), eps 1e-5.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..manifold import _polar_factor

__all__ = ["KongStiefelAdam"]


class KongStiefelAdam(Optimizer):
    """Kong, Wang & Tao's Stiefel Adam on frames (..., d, r), d >= r; every group holds frames."""

    keeps_frames_on_manifold = True  # its own rule retracts to St(d, r) every step (_guard)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.99), eps: float = 1e-5, metric: float = 0.5):
        if not (0.0 <= lr and 0.0 <= betas[0] < 1.0 and 0.0 < betas[1] < 1.0 and eps >= 0.0 and metric < 1.0):
            raise ValueError(f"invalid settings: lr={lr}, betas={betas}, eps={eps}, metric a={metric} (needs a < 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, metric=metric))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_frames(p, p.grad, self.state[p], group)
        return loss

    @staticmethod
    def _step_frames(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        lr, (b1, b2), eps, a = group["lr"], group["betas"], group["eps"], group["metric"]
        b = a / (a - 1.0)
        X = p.view(-1, p.shape[-2], p.shape[-1])  # (n, d, r)
        G = grad.reshape(X.shape)
        if not state:
            n, d, r = X.shape
            state["step"] = 0
            state["Y"] = torch.zeros(n, r, r, dtype=X.dtype, device=X.device)
            state["pY"] = torch.zeros_like(state["Y"])
            state["V"] = torch.zeros_like(X)
            state["pV"] = torch.zeros_like(X)
        state["step"] += 1
        bc1, bc2 = 1.0 - b1 ** state["step"], 1.0 - b2 ** state["step"]
        Y, pY, V, pV = state["Y"], state["pY"], state["V"], state["pV"]
        XtG = X.mT @ G  # (n, r, r)
        gY = (1.0 - b) / 2.0 * (XtG - XtG.mT)
        gV = G - X @ XtG
        pY.mul_(b2).addcmul_(gY, gY, value=1.0 - b2)
        pV.mul_(b2).addcmul_(gV, gV, value=1.0 - b2)
        Y.mul_(b1).add_(gY, alpha=-(1.0 - b1))
        X.add_(X @ ((lr / bc1) * Y / ((pY / bc2).sqrt() + eps)))
        V.add_(V @ Y, alpha=-(3.0 * a - 2.0) / 2.0 * lr / b1 if b1 else 0.0)  # the transport term, lr V Y after x b1
        V.mul_(b1).add_(gV, alpha=-(1.0 - b1))
        scaled = V / ((pV / bc2).sqrt() + eps)
        XtX = X.mT @ X
        scaled = scaled - X @ torch.linalg.solve(XtX, X.mT @ scaled)  # its part in the span of X removed
        shift = X @ (scaled.mT @ V)
        X.add_(lr * (scaled @ XtX))
        V.add_(shift, alpha=-lr)
        X.copy_(_polar_factor(X))
