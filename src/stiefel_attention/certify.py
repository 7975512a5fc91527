"""Numerical certification, in float64, of the five propositions, the gauge negative result, and the logit bound
of frames that read a normalised input (`StiefelAttention(qk_input_norm=True)`).

Each check draws random instances over several frame shapes (including d = r and r = 1),
measures a residual that is zero in exact arithmetic, and compares it with a tolerance a few
orders of magnitude above float64 round-off. Checks marked "must fail" certify the opposite: an
ablation is supposed to break the property, and passing means its residual is clearly nonzero.

    stiefel-attention certify [--json PATH] [--seed N]
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .manifold import inv_sqrt_gram, isometry_error, project_tangent, random_frame
from .nn import StiefelAttention
from .optim import StiefelAdam, StiefelSGD

F64 = torch.float64
# (batch..., d, r): ordinary, square (d = r), single column (r = 1), batched heads.
SHAPES: list[tuple[int, ...]] = [(8, 3), (5, 5), (7, 1), (3, 16, 4), (2, 2, 12, 6)]


@dataclass
class Check:
    property: str
    residual: float
    tolerance: float
    must_fail: bool = False

    @property
    def passed(self) -> bool:
        if not math.isfinite(self.residual):
            return False
        return self.residual > self.tolerance if self.must_fail else self.residual <= self.tolerance


def _tangent(W: Tensor, gen: torch.Generator) -> Tensor:
    return project_tangent(W, torch.randn(W.shape, generator=gen, dtype=F64))


def _frob(X: Tensor) -> Tensor:
    return torch.linalg.matrix_norm(X)


def _inner(X: Tensor, Y: Tensor) -> Tensor:
    return (X * Y).sum(dim=(-2, -1))


def _run(opt_factory: Callable, W0: Tensor, grads: list[Tensor]) -> Tensor:
    """Frames after stepping a copy of W0 through the given gradients."""
    W = W0.clone().requires_grad_(True)
    opt = opt_factory([W])
    for G in grads:
        W.grad = G.clone()
        opt.step()
    return W.detach()


def _grads(shape, steps: int, gen: torch.Generator) -> list[Tensor]:
    return [torch.randn(shape, generator=gen, dtype=F64) for _ in range(steps)]


# --- 1. steepest descent --------------------------------------------------------------------


def check_steepest_descent(gen: torch.Generator) -> list[Check]:
    """-P_W(G)/||P_W(G)|| minimises <G, xi> over unit tangent xi, and is StiefelAdam's first step."""
    closed_form, vs_random, first_step = 0.0, 0.0, 0.0
    for shape in SHAPES:
        *batch, d, r = shape
        W = random_frame(*batch, d=d, r=r, generator=gen, dtype=F64)
        G = torch.randn(shape, generator=gen, dtype=F64)
        PG = project_tangent(W, G)
        star = -PG / _frob(PG)[..., None, None]
        # closed form: the minimum of <G, xi> = <P_W G, xi> over unit tangent xi is -||P_W G||
        closed_form = max(closed_form, float((_inner(G, star) + _frob(PG)).abs().max()))
        for _ in range(200):
            xi = _tangent(W, gen)
            xi = xi / _frob(xi)[..., None, None]
            vs_random = max(vs_random, float((_inner(G, star) - _inner(G, xi)).clamp_min(0).max()))
        # StiefelAdam's first step with eps = 0 is exactly lr * star (before retraction)
        lr = 1e-4
        W1 = _run(lambda p: StiefelAdam(p, lr=lr, eps=0.0), W, [G])
        # R_W(xi) = W + xi - W xi^T xi / 2 + O(|xi|^3), and P_W kills W xi^T xi / 2 (symmetric),
        # so P_W(W1 - W) / lr = xi* + O(lr^2)
        first_step = max(first_step, float(_frob(project_tangent(W, W1 - W) / lr - star).max()))
    return [
        Check("1 steepest descent: <G, xi*> = -||P_W G|| (closed form)", closed_form, 1e-12),
        Check("1 steepest descent: no unit tangent direction beats xi* (200 random/shape)", vs_random, 1e-12),
        Check("1 steepest descent: StiefelAdam's first step is lr * xi* (lr=1e-4, +O(lr^2))", first_step, 1e-6),
    ]


# --- 2. gradient-scale independence ----------------------------------------------------------


def check_scale_independence(gen: torch.Generator) -> list[Check]:
    adam_res, sgd_res = 0.0, math.inf
    for shape in SHAPES:
        *batch, d, r = shape
        W0 = random_frame(*batch, d=d, r=r, generator=gen, dtype=F64)
        grads = _grads(shape, 20, gen)
        for batched in (True, False):
            ref = _run(lambda p: StiefelAdam(p, lr=0.05, eps=0.0, batched=batched), W0, grads)
            for c in (1e-3, 1e-1, 1e1, 1e3):
                W = _run(lambda p: StiefelAdam(p, lr=0.05, eps=0.0, batched=batched), W0, [c * G for G in grads])
                adam_res = max(adam_res, float(_frob(W - ref).max()))
        sgd_ref = _run(lambda p: StiefelSGD(p, lr=0.01), W0, grads)
        sgd_c = _run(lambda p: StiefelSGD(p, lr=0.01), W0, [10.0 * G for G in grads])
        sgd_res = min(sgd_res, float(_frob(sgd_c - sgd_ref).max()))
    return [
        Check("2 scale independence: StiefelAdam(eps=0) trajectory for c*G, c in 1e-3..1e3", adam_res, 1e-11),
        Check("2 scale independence must fail for StiefelSGD (degree one), c=10", sgd_res, 1e-6, must_fail=True),
    ]


# --- 3. well-conditioning --------------------------------------------------------------------


def check_conditioning(gen: torch.Generator) -> list[Check]:
    cond_excess, factor_err, iso = 0.0, 0.0, 0.0
    for delta in (0.1, 0.5, 1.0):
        for shape in SHAPES:
            *batch, d, r = shape
            W = random_frame(*batch, d=d, r=r, generator=gen, dtype=F64)
            xi = _tangent(W, gen) * 10.0
            xi = xi * (delta / _frob(xi)).clamp(max=1.0)[..., None, None]  # the trust region
            gram = (W + xi).mT @ (W + xi)  # = I + xi^T xi
            M = inv_sqrt_gram(gram.reshape(-1, r, r), 1.0 - 1e-8, 1.0 + delta**2 + 1e-8).reshape(gram.shape)
            s = torch.linalg.svdvals(M)
            cond = s[..., 0] / s[..., -1]
            cond_excess = max(cond_excess, float((cond - math.sqrt(1.0 + delta**2)).clamp_min(0).max()))
            # the factor is exact: M^2 gram = I
            eye = torch.eye(r, dtype=F64)
            factor_err = max(factor_err, float(_frob(M @ M @ gram - eye).max()))
            # a long capped run with steps that hit the cap stays on the manifold
            W_end = _run(lambda p: StiefelAdam(p, lr=10.0, max_step=delta), W, _grads(shape, 100, gen))
            iso = max(iso, float(isometry_error(W_end)))
    return [
        Check(
            "3 conditioning: cond((I + xi^T xi)^(-1/2)) <= sqrt(1 + Delta^2), Delta in {0.1, 0.5, 1}",
            cond_excess,
            1e-12,
        ),
        Check("3 conditioning: r x r factor exact, ||M^2 (I + xi^T xi) - I||", factor_err, 1e-12),
        Check("3 conditioning: ||W^T W - I|| after 100 capped steps", iso, 1e-12),
    ]


# --- 4. O(d)-equivariance --------------------------------------------------------------------


def _haar_orthogonal(d: int, gen: torch.Generator) -> Tensor:
    return random_frame(d=d, r=d, generator=gen, dtype=F64)


def check_equivariance(gen: torch.Generator) -> list[Check]:
    adam_res, coord_res = 0.0, math.inf
    for shape in SHAPES:
        *batch, d, r = shape
        if d == r == 1:
            continue
        W0 = random_frame(*batch, d=d, r=r, generator=gen, dtype=F64)
        Q = _haar_orthogonal(d, gen)
        grads = _grads(shape, 20, gen)
        for batched in (True, False):
            opt = lambda p: StiefelAdam(p, lr=0.05, max_step=0.3, batched=batched)  # noqa: E731
            W = _run(opt, W0, grads)
            W_rot = _run(opt, Q @ W0, [Q @ G for G in grads])
            adam_res = max(adam_res, float(_frob(W_rot - Q @ W).max()))
        coord = lambda p: StiefelAdam(p, lr=0.05, second_moment="coordinate")  # noqa: E731
        Wc = _run(coord, W0, grads)
        Wc_rot = _run(coord, Q @ W0, [Q @ G for G in grads])
        if d > 1:
            coord_res = min(coord_res, float(_frob(Wc_rot - Q @ Wc).max()))
    return [
        Check(
            "4 O(d)-equivariance: StiefelAdam from (QW, QG) = Q x StiefelAdam from (W, G), 20 steps", adam_res, 1e-12
        ),
        Check("4 O(d)-equivariance must fail for second_moment='coordinate'", coord_res, 1e-6, must_fail=True),
    ]


# --- 5. weight decay -------------------------------------------------------------------------


def check_weight_decay(gen: torch.Generator) -> list[Check]:
    proj, run_res = 0.0, 0.0
    for shape in SHAPES:
        *batch, d, r = shape
        W0 = random_frame(*batch, d=d, r=r, generator=gen, dtype=F64)
        for lam in (1e-3, 1.0, 10.0):
            proj = max(proj, float(_frob(project_tangent(W0, lam * W0)).max()) / lam)
        grads = _grads(shape, 20, gen)
        for batched in (True, False):
            ref = _run(lambda p: StiefelAdam(p, lr=0.05, batched=batched), W0, grads)
            for lam in (0.1, 1.0):
                W = _run(lambda p: StiefelAdam(p, lr=0.05, weight_decay=lam, batched=batched), W0, grads)
                run_res = max(run_res, float(_frob(W - ref).max()))
    return [
        Check("5 weight decay: ||P_W(lambda W)|| / lambda (normal, so projected to 0)", proj, 1e-13),
        Check("5 weight decay: StiefelAdam(weight_decay>0) trajectory = weight_decay=0", run_res, 1e-12),
    ]


# --- 6. gauge negative result ----------------------------------------------------------------


def check_gauge(gen: torch.Generator) -> list[Check]:
    """Attention depends on W_Q W_K^T only, so (W_Q A, W_K A) with A skew carries no gradient."""
    res = 0.0
    for d_model, n_heads, head_dim, causal in ((16, 2, 4, False), (12, 3, 1, True), (8, 1, 8, False)):
        with torch.random.fork_rng():  # the layer draws its init from the global RNG; leave it as found
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            attn = StiefelAttention(d_model, n_heads, head_dim, qk="stiefel", causal=causal).double()
        x = torch.randn(4, 6, d_model, generator=gen, dtype=F64)
        target = torch.randn(4, 6, d_model, generator=gen, dtype=F64)
        loss = ((attn(x) - target) ** 2).mean()
        gq, gk = torch.autograd.grad(loss, [attn.w_q, attn.w_k])  # (H, D, r)
        g_norm = torch.sqrt(_frob(gq) ** 2 + _frob(gk) ** 2)  # (H,)
        for i in range(head_dim):
            for j in range(i + 1, head_dim):
                A = torch.zeros(head_dim, head_dim, dtype=F64)
                A[i, j], A[j, i] = 1.0, -1.0
                dq, dk = attn.w_q.detach() @ A, attn.w_k.detach() @ A
                directional = _inner(gq, dq) + _inner(gk, dk)  # (H,)
                scale = g_norm * torch.sqrt(_frob(dq) ** 2 + _frob(dk) ** 2)
                res = max(res, float((directional.abs() / scale).max()))
    return [Check("6 gauge: relative gradient along (W_Q A, W_K A), A skew", res, 1e-12)]


# --- 7. the logit bound of frames reading a normalised input (qk_input_norm) -----------------


def _bound_layer(gen: torch.Generator, d: int, h: int, r: int, qk_input_norm: bool, **options) -> StiefelAttention:
    with torch.random.fork_rng():  # the layer draws its init from the global RNG; leave it as found
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        return StiefelAttention(d, h, r, qk_input_norm=qk_input_norm, **options).double()


def check_logit_bound(gen: torch.Generator) -> list[Check]:
    """|s| <= logit_scale * T * d / sqrt(r) with qk_input_norm, for inputs an adversary places in each head's frames
    and scales by up to 1e6 through a LayerNorm's free gains; attained (so it cannot be lowered); exceeded by the
    same frames without the norm (must fail)."""
    excess, shortfall, plain_excess = 0.0, 0.0, math.inf
    for d, h, r, options in (
        (16, 2, 4, {}),
        (12, 3, 1, dict(logit_scale=2.5)),
        (8, 1, 8, dict(temperature=True, max_temperature=3.0)),
        (32, 4, 8, dict(causal=True)),
    ):
        bounded = _bound_layer(gen, d, h, r, True, **options)
        if bounded.temperature:
            with torch.no_grad():  # temperatures pushed as far as they go
                bounded.log_temperature.fill_(50.0)
        plain = _bound_layer(gen, d, h, r, False, **options)
        plain.load_state_dict(bounded.state_dict())
        bound = bounded.logit_bound()
        # token 2a holds head a's key direction W_K[a] e_1, token 2a+1 its query direction W_Q[a] e_1 (a query sees
        # the key before it under a causal mask): the pair where x_i^T W_Q W_K^T x_j = ||x_i|| ||x_j||; then
        # noise, per-channel gains and scales up to 1e6
        wq, wk = bounded.w_q.detach()[..., 0], bounded.w_k.detach()[..., 0]  # (H, D)
        aligned = torch.stack([wk, wq], dim=1).reshape(1, 2 * h, d) * math.sqrt(d)  # (1, 2H, D), norms sqrt(d)
        with torch.no_grad():
            top = bounded.logits(aligned)
            shortfall = max(shortfall, 1.0 - float(top[torch.isfinite(top)].abs().max()) / bound)
            for scale in (1e-6, 1.0, 1e6):
                gains = torch.exp(2 * torch.randn(d, generator=gen, dtype=F64))
                noise = 1e-2 * torch.randn(3, 2 * h, d, generator=gen, dtype=F64)
                x = scale * (aligned + noise) * gains
                s = bounded.logits(x)
                excess = max(excess, float(s[torch.isfinite(s)].abs().max()) / bound - 1.0)
            s = plain.logits(x)  # the largest scale
            plain_excess = min(plain_excess, float(s[torch.isfinite(s)].abs().max()) / bound - 1.0)
    return [
        Check("7 logit bound: max |s| / (scale T d / sqrt(r)) - 1 with qk_input_norm, inputs to 1e6", excess, 1e-12),
        Check("7 logit bound: attained by inputs along the frames (1 - max |s| / bound; rms eps)", shortfall, 1e-5),
        Check(
            "7 logit bound must fail without qk_input_norm (inputs at 1e6: max |s| / bound - 1)",
            plain_excess,
            1.0,
            must_fail=True,
        ),
    ]


CHECKS = [
    check_steepest_descent,
    check_scale_independence,
    check_conditioning,
    check_equivariance,
    check_weight_decay,
    check_gauge,
    check_logit_bound,
]


def certify(seed: int = 0) -> list[Check]:
    gen = torch.Generator().manual_seed(seed)
    results: list[Check] = []
    for check in CHECKS:
        results += check(gen)
    return results


def format_table(results: list[Check]) -> str:
    width = max(len(c.property) for c in results)
    lines = [f"{'property':<{width}}  {'residual':>10}  {'tolerance':>10}  result"]
    for c in results:
        relation = ">" if c.must_fail else "<="
        verdict = "pass" if c.passed else "FAIL"
        lines.append(f"{c.property:<{width}}  {c.residual:>10.2e}  {relation}{c.tolerance:>8.0e}  {verdict}")
    n_pass = sum(c.passed for c in results)
    lines.append(f"{n_pass} of {len(results)} checks pass (float64, torch {torch.__version__})")
    return "\n".join(lines)


def to_json(results: list[Check], path: str, seed: int) -> None:
    rows = [dict(asdict(c), passed=c.passed) for c in results]
    with open(path, "w") as f:
        json.dump(
            {"seed": seed, "torch": torch.__version__, "all_passed": all(c.passed for c in results), "checks": rows},
            f,
            indent=2,
        )
