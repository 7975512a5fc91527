"""Contract tests for stiefel_attention.manifold, the r x r inverse roots included.

Tolerances (stated once, used everywhere through `tol`):
- float64: 1e-12 absolute on quantities of order one (frames, projections, Gram residuals), for
  d <= 16, growing linearly with d beyond that (round-off of a length-d sum grows ~ d eps).
- float32: 1e-5 on the same scale, growing the same way. float32 eps is 1.2e-7, so 1e-5 is about
  80 ulps: loose enough for every kernel, tight enough that any O(h) or O(h^2) modelling error
  at the step sizes used here (h >= 1e-2) is caught.
- half precision: a few multiples of that dtype's eps (stated where used).
References are computed independently in float64: SVD for polar factors, a known
eigendecomposition for inverse square roots.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stiefel_attention import manifold
from stiefel_attention.manifold import (
    binomial_series_terms,
    check_frames,
    inv_sqrt_gram,
    inv_sqrt_spd,
    isometry_error,
    newton_schulz_iterations,
    polar_retract,
    project_tangent,
    random_frame,
    skew,
    sym,
    tangent_error,
)

F32, F64 = torch.float32, torch.float64
DTYPES = [F32, F64]
BATCHES = [(), (3,), (2, 3)]
# (d, r): square (d == r), single column (r == 1), 1 x 1, thin, and a d > 16 case.
DR = [(5, 5), (7, 1), (1, 1), (9, 4), (32, 8)]
SEEDS = [0, 1]


def tol(dtype: torch.dtype, d: int = 1) -> float:
    base = {F64: 1e-12, F32: 1e-5}[dtype]
    return base * max(1.0, d / 16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=F64).to(dtype)


def frames_and_grad(batch, d, r, dtype, seed):
    W = random_frame(*batch, d=d, r=r, generator=gen(seed), dtype=dtype)
    G = randn(*batch, d, r, seed=seed + 1000, dtype=dtype)
    return W, G


def ref_polar(Y: torch.Tensor) -> torch.Tensor:
    """Orthonormal polar factor U V^T of Y by SVD, in float64."""
    U, _, Vh = torch.linalg.svd(Y.to(F64), full_matrices=False)
    return U @ Vh


def fro(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(X.to(F64))


def max_abs(X: torch.Tensor) -> float:
    return float(X.detach().to(F64).abs().max()) if X.numel() else 0.0


def random_tangent(W: torch.Tensor, seed: int) -> torch.Tensor:
    """A random tangent vector at W, built independently of project_tangent: W A + (I - W W^T) B, A skew."""
    d, r = W.shape[-2:]
    A = randn(*W.shape[:-2], r, r, seed=seed, dtype=W.dtype)
    A = A - A.mT
    B = randn(*W.shape, seed=seed + 1, dtype=W.dtype)
    B = B - W @ (W.mT @ B)
    return W @ A + B


shape_params = pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"batch{b}")
dr_params = pytest.mark.parametrize("d,r", DR)
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=str)
seed_params = pytest.mark.parametrize("seed", SEEDS)


# ---------------------------------------------------------------------------------------------
# sym / skew
# ---------------------------------------------------------------------------------------------


def test_sym_skew_decompose():
    A = randn(3, 4, 4, seed=0)
    assert torch.allclose(sym(A) + skew(A), A, atol=1e-15, rtol=0)
    assert torch.equal(sym(A), sym(A).mT)
    assert torch.equal(skew(A), -skew(A).mT)


# ---------------------------------------------------------------------------------------------
# project_tangent
# ---------------------------------------------------------------------------------------------


@shape_params
@dr_params
@dtype_params
@seed_params
def test_project_tangent_is_orthogonal_projection(batch, d, r, dtype, seed):
    W, G = frames_and_grad(batch, d, r, dtype, seed)
    P = project_tangent(W, G)
    t = tol(dtype, d)
    assert P.shape == G.shape and P.dtype == dtype
    # tangent: sym(W^T P) == 0
    assert max_abs(sym(W.mT @ P)) <= t
    assert float(tangent_error(W, P)) <= t
    # idempotent
    assert max_abs(project_tangent(W, P) - P) <= t
    # the removed part is normal: N = G - P = W S with S symmetric
    N = G - P
    S = W.mT @ N
    assert max_abs(S - S.mT) <= t
    assert max_abs(N - W @ S) <= t
    # orthogonal projection: <G - P G, P G> == 0 per frame (scale: ||G||^2 ~ d r)
    inner = (N.to(F64) * P.to(F64)).sum(dim=(-2, -1))
    assert max_abs(inner) <= t * d * r
    # Pythagoras, an independent consequence
    assert torch.allclose(fro(G) ** 2, fro(P) ** 2 + fro(N) ** 2, rtol=t, atol=t)


@shape_params
@dr_params
@dtype_params
def test_project_tangent_is_linear(batch, d, r, dtype):
    W, G1 = frames_and_grad(batch, d, r, dtype, 0)
    G2 = randn(*batch, d, r, seed=7, dtype=dtype)
    a, b = 0.7, -2.5
    lhs = project_tangent(W, a * G1 + b * G2)
    rhs = a * project_tangent(W, G1) + b * project_tangent(W, G2)
    assert max_abs(lhs - rhs) <= 4 * tol(dtype, d)


@shape_params
@dr_params
@dtype_params
def test_project_tangent_fixes_tangent_vectors(batch, d, r, dtype):
    W = random_frame(*batch, d=d, r=r, generator=gen(3), dtype=dtype)
    xi = random_tangent(W, seed=11)
    assert max_abs(project_tangent(W, xi) - xi) <= 4 * tol(dtype, d)


@shape_params
@dr_params
@dtype_params
@pytest.mark.parametrize("lam", [1e-4, 0.5, 3.0])
def test_project_tangent_kills_normal_space_and_weight_decay(batch, d, r, dtype, lam):
    W = random_frame(*batch, d=d, r=r, generator=gen(5), dtype=dtype)
    S = randn(*batch, r, r, seed=9, dtype=dtype)
    S = S + S.mT  # symmetric
    t = tol(dtype, d)
    assert max_abs(project_tangent(W, W @ S)) <= t * max(1.0, max_abs(S))
    # Proposition 5: the weight-decay direction lambda W is normal, P_W(lambda W) == 0.
    assert max_abs(project_tangent(W, lam * W)) <= t * max(1.0, lam)
    # and decay added to a gradient changes nothing
    G = randn(*batch, d, r, seed=10, dtype=dtype)
    assert max_abs(project_tangent(W, G + lam * W) - project_tangent(W, G)) <= 4 * t * max(1.0, lam)


def test_project_tangent_not_identity_on_generic_input():
    # guards against a projector that does nothing: a generic G has a normal part
    W, G = frames_and_grad((), 6, 3, F64, 0)
    assert max_abs(project_tangent(W, G) - G) > 0.1


@pytest.mark.parametrize("wshape,gshape", [((5, 3), (5, 2)), ((5, 3), (4, 3)), ((2, 5, 3), (2, 3, 5))])
def test_project_tangent_shape_mismatch_raises(wshape, gshape):
    W = random_frame(*wshape[:-2], d=wshape[-2], r=wshape[-1], dtype=F64)
    with pytest.raises(ValueError, match="trailing shape"):
        project_tangent(W, torch.zeros(gshape, dtype=F64))


def test_project_tangent_dtype_promotion_and_half():
    W32 = random_frame(6, 3, d=6, r=3, generator=gen(0), dtype=F32)[0]
    G64 = randn(6, 3, seed=1)
    assert project_tangent(W32, G64).dtype == F64
    for half in (torch.bfloat16, torch.float16):
        Wh, Gh = W32.to(half), G64.to(half)
        P = project_tangent(Wh, Gh)
        assert P.dtype == half
        ref = project_tangent(Wh.to(F64), Gh.to(F64))
        assert max_abs(P.to(F64) - ref) <= 4 * torch.finfo(half).eps * max_abs(ref)


@settings(max_examples=40, deadline=None, database=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    r=st.integers(1, 6),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**20),
    dtype=st.sampled_from(DTYPES),
)
def test_project_tangent_properties_hypothesis(batch, r, extra, seed, dtype):
    d = r + extra
    W, G = frames_and_grad(batch, d, r, dtype, seed)
    P = project_tangent(W, G)
    t = tol(dtype, d)
    assert max_abs(sym(W.mT @ P)) <= t
    assert max_abs(project_tangent(W, P) - P) <= t
    assert max_abs(((G - P) * P).sum(dim=(-2, -1))) <= t * d * r


# ---------------------------------------------------------------------------------------------
# polar_retract
# ---------------------------------------------------------------------------------------------


@shape_params
@dr_params
@dtype_params
@seed_params
@pytest.mark.parametrize("tangent", [True, False], ids=["tangent", "nontangent"])
def test_polar_retract_is_svd_polar_factor(batch, d, r, dtype, seed, tangent):
    W = random_frame(*batch, d=d, r=r, generator=gen(seed), dtype=dtype)
    if tangent:
        xi = 0.3 * random_tangent(W, seed=seed + 50)
    else:
        xi = 0.3 * randn(*batch, d, r, seed=seed + 60, dtype=dtype)
    R = polar_retract(W, xi)
    Y64 = W.to(F64) + xi.to(F64)
    # The polar factor is computed from the Gram matrix Y^T Y, whose condition number is
    # cond(Y)^2: round-off scales with it. Tangent steps have cond(Y) <= sqrt(1 + ||xi||^2);
    # random (non-tangent) ones here have cond(Y) up to ~5.
    sv = torch.linalg.svdvals(Y64)
    cond2 = float((sv[..., 0] / sv[..., -1]).max()) ** 2
    t = tol(dtype, d) * cond2
    assert R.shape == W.shape and R.dtype == dtype
    assert float(isometry_error(R)) <= t
    ref = ref_polar(Y64)
    assert max_abs(R.to(F64) - ref) <= 10 * t
    # it actually moved (guards against returning W); St(1, 1) = {+-1} has no tangent
    # directions and its polar factor is a sign
    if d > 1:
        assert max_abs(R.to(F64) - W.to(F64)) > 1e-3


@shape_params
@dr_params
@dtype_params
def test_polar_retract_zero_step_is_identity(batch, d, r, dtype):
    W = random_frame(*batch, d=d, r=r, generator=gen(2), dtype=dtype)
    R = polar_retract(W, torch.zeros_like(W))
    assert max_abs(R - W) <= tol(dtype, d)


def test_polar_retract_zero_step_projects_a_perturbed_matrix():
    # R_W(0) is the frame nearest to W: it repairs a drifted frame (the optimizers rely on this)
    W = random_frame(4, d=10, r=3, generator=gen(0), dtype=F64)
    W_bad = W + 1e-3 * randn(4, 10, 3, seed=1)
    assert float(isometry_error(W_bad)) > 1e-4
    R = polar_retract(W_bad, torch.zeros_like(W_bad))
    assert float(isometry_error(R)) <= 1e-12
    assert max_abs(R - ref_polar(W_bad)) <= 1e-12


@pytest.mark.parametrize("d,r", [(6, 3), (5, 5), (8, 1)])
@pytest.mark.parametrize("seed", SEEDS)
def test_polar_retract_first_and_second_order(d, r, seed):
    """R_W(t xi) = W + t xi - t^2/2 W xi^T xi + O(t^3) for tangent xi (float64)."""
    W = random_frame(d=d, r=r, generator=gen(seed), dtype=F64)
    xi = random_tangent(W, seed=seed + 3)
    xi = xi / fro(xi)
    ts = [1e-1, 1e-2, 1e-3]
    errs = [float(fro(polar_retract(W, t * xi) - W - t * xi)) for t in ts]
    # first order: the error is O(t^2), so it drops 100x when t drops 10x
    for e_big, e_small in zip(errs, errs[1:]):
        assert e_small / e_big == pytest.approx(1e-2, rel=0.05)
    # and its constant is the second-order term ||W xi^T xi|| / 2 = ||xi^T xi|| / 2
    c2 = float(fro(xi.mT @ xi)) / 2
    assert errs[-1] / ts[-1] ** 2 == pytest.approx(c2, rel=1e-2)


def test_polar_retract_nontangent_step_is_not_first_order():
    # the contrapositive, so the first-order test above could fail: a normal step W S is removed
    W = random_frame(d=6, r=3, generator=gen(0), dtype=F64)
    S = randn(3, 3, seed=1)
    xi = W @ (S @ S.mT + torch.eye(3, dtype=F64)) * 1e-3  # normal, keeps W + xi full rank
    R = polar_retract(W, xi)
    assert max_abs(R - W) <= 1e-12  # normal steps do not move the frame at all
    assert float(fro(R - W - xi)) > 1e-4


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"batch{b}")
def test_polar_retract_half_precision(half, batch):
    d, r = 16, 4
    W = random_frame(*batch, d=d, r=r, generator=gen(0), dtype=half)
    xi = (0.5 * randn(*batch, d, r, seed=1)).to(half)  # non-tangent and large: W + xi far from St
    assert float(isometry_error(W + xi)) > 0.5
    R = polar_retract(W, xi)
    assert R.dtype == half and R.shape == W.shape
    eps = torch.finfo(half).eps
    # a correctly rounded frame has ||W^T W - I||_F ~ eps * r / 2; allow 2 eps r
    assert float(isometry_error(R)) <= 2 * eps * r
    ref = ref_polar(W.to(F64) + xi.to(F64))
    assert max_abs(R.to(F64) - ref) <= 2 * eps


def test_polar_retract_shape_mismatch_raises():
    W = random_frame(d=5, r=3, dtype=F64)
    with pytest.raises(ValueError, match="trailing shape"):
        polar_retract(W, torch.zeros(5, 2, dtype=F64))


@settings(max_examples=30, deadline=None, database=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    r=st.integers(1, 6),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**20),
    scale=st.floats(0.0, 2.0),
)
def test_polar_retract_hypothesis(batch, r, extra, seed, scale):
    d = r + extra
    W = random_frame(*batch, d=d, r=r, generator=gen(seed), dtype=F64)
    xi = scale * random_tangent(W, seed=seed + 1)  # tangent: W + xi has singular values >= 1
    R = polar_retract(W, xi)
    assert float(isometry_error(R)) <= 1e-12
    assert max_abs(R - ref_polar(W + xi)) <= 1e-11
    # a tangent step is never lengthened by the retraction
    assert (fro(R - W) <= fro(xi) * (1 + 1e-12) + 1e-14).all()


# ---------------------------------------------------------------------------------------------
# random_frame
# ---------------------------------------------------------------------------------------------


@shape_params
@dr_params
@dtype_params
def test_random_frame_shape_and_orthonormal(batch, d, r, dtype):
    W = random_frame(*batch, d=d, r=r, generator=gen(0), dtype=dtype)
    assert W.shape == (*batch, d, r)
    assert W.dtype == dtype and W.is_contiguous()
    assert float(isometry_error(W)) <= tol(dtype, d)
    # independent check in float64
    eye = torch.eye(r, dtype=F64)
    assert max_abs(W.to(F64).mT @ W.to(F64) - eye) <= tol(dtype, d)


@pytest.mark.parametrize("dtype", [F32, F64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_random_frame_dtype_device(dtype, device):
    W = random_frame(2, d=6, r=3, dtype=dtype, device=device, generator=gen(0))
    assert W.dtype == dtype
    assert W.device.type == "cpu"
    assert float(isometry_error(W)) <= 2 * torch.finfo(dtype).eps * 3 + 1e-12


def test_random_frame_default_dtype_follows_torch_default():
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(F64)
        assert random_frame(d=4, r=2).dtype == F64
    finally:
        torch.set_default_dtype(old)
    assert random_frame(d=4, r=2).dtype == old


def test_random_frame_generator_reproducible():
    a = random_frame(3, d=7, r=2, generator=gen(42), dtype=F64)
    b = random_frame(3, d=7, r=2, generator=gen(42), dtype=F64)
    c = random_frame(3, d=7, r=2, generator=gen(43), dtype=F64)
    assert torch.equal(a, b)
    assert max_abs(a - c) > 1e-2
    # the batch is not one frame repeated
    assert max_abs(a[0] - a[1]) > 1e-2
    # a seed gives the same frames whatever dtype is asked for (sampled in float64, then cast)
    a32 = random_frame(3, d=7, r=2, generator=gen(42), dtype=F32)
    assert torch.equal(a32, a.to(F32))


def test_random_frame_uses_global_rng_without_generator():
    torch.manual_seed(123)
    a = random_frame(d=5, r=2, dtype=F64)
    torch.manual_seed(123)
    b = random_frame(d=5, r=2, dtype=F64)
    assert torch.equal(a, b)


@pytest.mark.parametrize("d,r", [(2, 3), (1, 2), (4, 0), (0, 0)])
def test_random_frame_bad_shape_raises(d, r):
    with pytest.raises(ValueError, match=rf"d >= r >= 1, got d={d}, r={r}"):
        random_frame(d=d, r=r)


@pytest.mark.parametrize("d,r", [(5, 3), (3, 3), (4, 1)])
def test_random_frame_is_haar(d, r):
    """Each entry of a Haar frame has mean 0 and E[W_ij^2] = 1/d; W_11^2 ~ Beta(1/2, (d-1)/2).

    N = 20000 frames. Standard errors: mean sqrt(1/(d N)); second moment sqrt(Var / N) with
    Var(W_ij^2) = 3/(d(d+2)) - 1/d^2. We allow 5 standard errors (per-entry false-alarm rate
    ~6e-7; with a fixed seed the test is deterministic anyway). Without the sign fix of R's
    diagonal, LAPACK's QR makes the diagonal entries one-signed: |mean| ~ 0.4, far outside.
    """
    N = 20000
    W = random_frame(N, d=d, r=r, generator=gen(2024), dtype=F64)
    mean = W.mean(dim=0)
    se_mean = math.sqrt(1.0 / (d * N))
    assert float(mean.abs().max()) <= 5 * se_mean
    second = (W**2).mean(dim=0)
    var_sq = 3.0 / (d * (d + 2)) - 1.0 / d**2
    se_second = math.sqrt(var_sq / N)
    assert float((second - 1.0 / d).abs().max()) <= 5 * se_second + 1e-12
    # exact marginal of one entry
    x = W[:, 0, 0].numpy() ** 2
    if d > 1:
        assert scipy.stats.kstest(x, "beta", args=(0.5, (d - 1) / 2)).pvalue > 1e-4
    # off-diagonal correlation between columns vanishes: E[W_11 W_12] = 0
    if r > 1:
        assert abs(float((W[:, 0, 0] * W[:, 0, 1]).mean())) <= 5 * math.sqrt(1.0 / (d * d * N)) * 2


def test_random_frame_haar_detects_unsigned_qr():
    # the statistic above has power: plain QR (no sign fix) fails it
    X = torch.randn(20000, 5, 3, generator=gen(2024), dtype=F64)
    Q, _ = torch.linalg.qr(X)
    assert float(Q.mean(dim=0).abs().max()) > 10 * math.sqrt(1.0 / (5 * 20000))


# ---------------------------------------------------------------------------------------------
# isometry_error / tangent_error
# ---------------------------------------------------------------------------------------------


@shape_params
@dr_params
@dtype_params
def test_isometry_error_zero_on_frames(batch, d, r, dtype):
    W = random_frame(*batch, d=d, r=r, generator=gen(0), dtype=dtype)
    e = isometry_error(W)
    assert e.dim() == 0 and e.dtype == dtype
    assert 0.0 <= float(e) <= tol(dtype, d)


@pytest.mark.parametrize("d,r", [(6, 3), (4, 4), (5, 1)])
@pytest.mark.parametrize("delta", [1e-6, 1e-2, 0.5])
def test_isometry_error_matches_frobenius_formula(d, r, delta):
    W = random_frame(d=d, r=r, generator=gen(1), dtype=F64) + delta * randn(d, r, seed=2)
    Wn = W.numpy()
    expected = np.linalg.norm(Wn.T @ Wn - np.eye(r), ord="fro")
    assert float(isometry_error(W)) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert expected > delta / 10  # the perturbation is actually visible


def test_isometry_error_takes_max_over_frames():
    W = random_frame(2, 5, d=6, r=3, generator=gen(0), dtype=F64).clone()
    deltas = torch.zeros(2, 5)
    deltas[1, 3] = 0.2
    deltas[0, 2] = 0.01
    W = W + deltas[..., None, None].to(F64) * randn(2, 5, 6, 3, seed=1)
    per_frame = [float(np.linalg.norm(w.T @ w - np.eye(3))) for w in W.reshape(-1, 6, 3).numpy()]
    assert float(isometry_error(W)) == pytest.approx(max(per_frame), rel=1e-12)
    assert max(per_frame) > 5 * sorted(per_frame)[-2]  # the max really is one frame
    assert sorted(per_frame)[-2] > 1e-3  # and is not the only perturbed one


def test_isometry_error_half_precision_computed_in_float32():
    W = random_frame(3, d=8, r=2, generator=gen(0), dtype=torch.bfloat16)
    e = isometry_error(W)
    assert e.dtype == F32
    Wf = W.to(F64)
    assert float(e) == pytest.approx(float(fro(Wf.mT @ Wf - torch.eye(2, dtype=F64)).max()), rel=1e-5)


def test_isometry_error_ignores_autograd():
    W = random_frame(d=5, r=2, dtype=F64).requires_grad_()
    assert not isometry_error(W).requires_grad


def test_tangent_error():
    W = random_frame(3, d=6, r=2, generator=gen(0), dtype=F64)
    xi = random_tangent(W, seed=1)
    assert float(tangent_error(W, xi)) <= 1e-13
    S = torch.tensor([[1.0, 2.0], [2.0, -1.0]], dtype=F64)
    bad = xi.clone()
    bad[1] = bad[1] + W[1] @ S  # a normal part in one frame only
    assert float(tangent_error(W, bad)) == pytest.approx(float(fro(S)), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# check_frames
# ---------------------------------------------------------------------------------------------


def test_check_frames_returns_d_r():
    assert check_frames(torch.zeros(2, 3, 7, 4)) == (7, 4)
    assert check_frames(torch.zeros(3, 3)) == (3, 3)


def test_check_frames_d_less_than_r():
    with pytest.raises(ValueError) as info:
        check_frames(torch.zeros(2, 3, 5), name="W_Q")
    msg = str(info.value)
    assert "W_Q" in msg and "(d, r) = (3, 5)" in msg and "d >= r" in msg


def test_check_frames_zero_columns():
    with pytest.raises(ValueError, match=r"\(d, r\) = \(4, 0\)"):
        check_frames(torch.zeros(4, 0))


@pytest.mark.parametrize("shape", [(5,), ()])
def test_check_frames_needs_two_dims(shape):
    with pytest.raises(ValueError) as info:
        check_frames(torch.zeros(shape), name="frames")
    msg = str(info.value)
    assert "frames must have shape (..., d, r)" in msg and f"got shape {shape}" in msg


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
def test_check_frames_non_float_raises_type_error(dtype):
    with pytest.raises(TypeError) as info:
        check_frames(torch.zeros(4, 2, dtype=dtype))
    msg = str(info.value)
    assert "floating-point" in msg and str(dtype) in msg


def test_check_frames_not_a_tensor():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got ndarray"):
        check_frames(np.zeros((4, 2)))


def test_manifold_functions_validate_frames():
    for fn in (lambda W: project_tangent(W, W), lambda W: polar_retract(W, W), isometry_error):
        with pytest.raises(ValueError, match="d >= r"):
            fn(torch.zeros(2, 4))
        with pytest.raises(TypeError, match="floating-point"):
            fn(torch.zeros(4, 2, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# inverse square roots: manifold.inv_sqrt_spd and manifold.inv_sqrt_gram
# ---------------------------------------------------------------------------------------------


def spd_with_spectrum(n: int, r: int, lo: float, hi: float, seed: int, dtype=F64):
    """(A, A^(-1/2)) with A = Q diag(lambda) Q^T, lambda in [lo, hi] including both ends.

    The reference inverse root comes from the known eigendecomposition, in float64: it does not
    call eigh, so it is independent of the code under test."""
    g = gen(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, r, r, generator=g, dtype=F64))
    lam = lo + (hi - lo) * torch.rand(n, r, generator=g, dtype=F64)
    lam[:, 0] = lo
    if r > 1:
        lam[:, 1] = hi
    A = (Q * lam.unsqueeze(-2)) @ Q.mT
    ref = (Q * lam.rsqrt().unsqueeze(-2)) @ Q.mT
    A = sym(A)
    return A.to(dtype), ref


def rel_err(X: torch.Tensor, ref: torch.Tensor) -> float:
    return float(fro(X.to(F64) - ref).max() / fro(ref).max())


def ref_for(A: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Reference for the matrix actually passed: for float32 input, the float64 eigh-based inverse
    root of the rounded matrix (rounding A to float32 alone moves A^(-1/2) by ~ eps32 * cond)."""
    if A.dtype == F64:
        return ref
    evals, evecs = torch.linalg.eigh(A.to(F64))
    return (evecs * evals.rsqrt().unsqueeze(-2)) @ evecs.mT


def budget_for(dtype: torch.dtype, cond: float) -> float:
    """1e-12 (float64) / 1e-5 (float32), or 10 eps cond(A) where the conditioning costs more:
    a backward-stable method is exact for a matrix within eps ||A|| of A, which moves A^(-1/2)
    by ~ eps cond(A) relatively."""
    return max({F64: 1e-12, F32: 1e-5}[dtype], 10 * torch.finfo(dtype).eps * cond)


@pytest.mark.parametrize("lo,hi", [(0.5, 2.0), (1.0, 1.0 + 1e-6), (1e-3, 1e3)])
@pytest.mark.parametrize("r", [1, 4, 16])
@dtype_params
def test_inv_sqrt_spd_matches_reference(lo, hi, r, dtype):
    A, ref = spd_with_spectrum(5, r, lo, hi, seed=r, dtype=dtype)
    X = inv_sqrt_spd(A)
    assert X.dtype == dtype and X.shape == A.shape
    assert rel_err(X, ref_for(A, ref)) <= budget_for(dtype, hi / lo)
    # defining property X A X = I (float64 check of the float64 result)
    if dtype == F64:
        eye = torch.eye(r, dtype=F64)
        assert max_abs(X @ A @ X - eye) <= budget_for(F64, hi / lo)


def test_inv_sqrt_spd_batched_shapes():
    A, ref = spd_with_spectrum(6, 3, 0.5, 2.0, seed=0)
    X = inv_sqrt_spd(A.reshape(2, 3, 3, 3))
    assert X.shape == (2, 3, 3, 3)
    assert rel_err(X.reshape(6, 3, 3), ref) <= 1e-12


class _BranchSpy:
    """Records which of inv_sqrt_gram's three branches ran."""

    def __init__(self, monkeypatch):
        self.series = self.ns = self.eigh = 0
        series, ns, eigh = manifold.binomial_series_terms, manifold.newton_schulz_iterations, manifold.inv_sqrt_spd
        spy = self

        def series_spy(*a, **k):
            out = series(*a, **k)
            spy.series_degree = out
            return out

        def ns_spy(*a, **k):
            out = ns(*a, **k)
            spy.ns_iters = out
            return out

        def eigh_spy(*a, **k):
            spy.eigh += 1
            return eigh(*a, **k)

        monkeypatch.setattr(manifold, "binomial_series_terms", series_spy)
        monkeypatch.setattr(manifold, "newton_schulz_iterations", ns_spy)
        monkeypatch.setattr(manifold, "inv_sqrt_spd", eigh_spy)
        self.series_degree = self.ns_iters = "not called"

    @property
    def branch(self) -> str:
        if self.series_degree not in (None, "not called"):
            return "series"
        if self.ns_iters not in (None, "not called"):
            return "newton-schulz"
        assert self.eigh == 1
        return "eigh"


# (dtype, lo, hi, expected branch). Gram matrices of W + xi for ||xi|| = s have spectrum in
# [1, 1 + s^2]; the optimizer passes a small margin below 1.
GRAM_CASES = [
    (F64, 1 - 1e-8, 1 + 0.05**2, "series"),
    (F64, 1 - 1e-8, 1 + 0.2**2, "series"),
    (F64, 1.0, 1.25, "newton-schulz"),
    (F64, 1.0, 2.0, "newton-schulz"),
    (F64, 0.2, 30.0, "newton-schulz"),
    (F64, 1e-4, 1e4, "eigh"),
    (F32, 1 - 1e-4, 1 + 0.05**2, "series"),
    (F32, 1 - 1e-4, 1.25, "series"),
    (F32, 1.0, 2.0, "newton-schulz"),
    (F32, 1e-2, 1e2, "eigh"),  # float32 cannot hold a condition number of 1e8
]


@pytest.mark.parametrize("dtype,lo,hi,branch", GRAM_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("r", [1, 3, 8])
def test_inv_sqrt_gram_branches_match_reference(monkeypatch, dtype, lo, hi, branch, r):
    spy = _BranchSpy(monkeypatch)
    # eigenvalues at both ends of the promised interval and in between
    A, ref = spd_with_spectrum(7, r, lo, hi, seed=r, dtype=dtype)
    X = inv_sqrt_gram(A, lo, hi)
    assert spy.branch == branch
    assert X.dtype == dtype and X.shape == A.shape
    budget = budget_for(dtype, hi / lo)
    assert rel_err(X, ref_for(A, ref)) <= budget
    assert max_abs(X - X.mT) <= budget * float(fro(ref).max())


@settings(max_examples=40, deadline=None, database=None)
@given(
    dtype=st.sampled_from(DTYPES),
    lo=st.floats(0.05, 1.0),
    width=st.floats(0.0, 20.0),
    r=st.integers(1, 6),
    seed=st.integers(0, 2**20),
)
def test_inv_sqrt_gram_any_interval_hypothesis(dtype, lo, width, r, seed):
    hi = lo + width
    A, ref = spd_with_spectrum(3, r, lo, hi, seed=seed, dtype=dtype)
    X = inv_sqrt_gram(A, lo, hi)
    assert rel_err(X, ref_for(A, ref)) <= budget_for(dtype, hi / lo)


def test_inv_sqrt_gram_does_not_modify_input():
    for lo, hi in [(1.0, 1.01), (1.0, 2.0), (1e-4, 1e4)]:
        A, _ = spd_with_spectrum(4, 3, lo, hi, seed=0)
        A0 = A.clone()
        inv_sqrt_gram(A, lo, hi)
        assert torch.equal(A, A0)


@pytest.mark.parametrize(
    "lo,hi,dtype",
    [
        (0.0, 1.0, F64),  # lo must be > 0
        (-1.0, 1.0, F64),
        (2.0, 1.0, F64),  # lo > hi
        (1.0, math.inf, F64),
        (math.nan, 1.0, F64),
        (1.0, math.nan, F64),
        (1e-12, 1.0, F64),  # too wide to converge in 30 iterations
        (1e-9, 1e3, F32),
    ],
)
def test_newton_schulz_iterations_none_outside_range(lo, hi, dtype):
    assert newton_schulz_iterations(lo, hi, dtype) is None


def test_newton_schulz_iterations_counts():
    k64 = newton_schulz_iterations(1.0, 2.0, F64)
    k32 = newton_schulz_iterations(1.0, 2.0, F32)
    assert isinstance(k64, int) and isinstance(k32, int)
    assert 2 <= k32 <= k64 <= 30
    # wider interval, more iterations; a point interval converges at once
    assert newton_schulz_iterations(1.0, 100.0, F64) > k64
    assert newton_schulz_iterations(3.0, 3.0, F64) == 2
    # max_iters is honoured
    assert newton_schulz_iterations(1e-4, 1e4, F64, max_iters=30) is not None
    assert newton_schulz_iterations(1e-4, 1e4, F64, max_iters=12) is None


@pytest.mark.parametrize("lo,hi", [(1.0, 2.0), (0.1, 10.0), (1.0, 1.0 + 1e-3)])
@dtype_params
def test_newton_schulz_iterations_count_is_sufficient(lo, hi, dtype):
    """The returned count drives every eigenvalue's scalar iterate z -> z (3 - z)^2 / 4 to 1."""
    k = newton_schulz_iterations(lo, hi, dtype)
    mu = 0.5 * (lo + hi)
    tol_ = 4 * torch.finfo(dtype).eps
    for lam in np.linspace(lo, hi, 101):
        z = lam / mu
        for _ in range(k - 1):
            z = z * (3 - z) ** 2 / 4
        assert abs(1 - z) <= tol_


@pytest.mark.parametrize("rho", [1.0, 1.5, -0.1, 0.9, 0.5])
def test_binomial_series_terms_none_outside_range(rho):
    # 0.5 in float64 needs ~50 terms (> 12)
    assert binomial_series_terms(rho, F64) is None


@pytest.mark.parametrize(
    "rho,dtype", [(r, F64) for r in (0.0, 1e-8, 1e-3, 0.05)] + [(r, F32) for r in (0.0, 1e-8, 1e-3, 0.05, 0.2)]
)
def test_binomial_series_terms_is_minimal_and_sufficient(rho, dtype):
    K = binomial_series_terms(rho, dtype)
    assert isinstance(K, int) and 1 <= K <= 12
    t = 4 * torch.finfo(dtype).eps
    assert rho ** (K + 1) / (1 - rho) <= t
    if K > 1:
        assert rho**K / (1 - rho) > t
    # the truncated scalar series really is that accurate at x = +-rho
    for x in (rho, -rho):
        c, s = 1.0, 1.0
        for k in range(1, K + 1):
            c *= -(2 * k - 1) / (2 * k)
            s += c * x**k
        assert abs(s - (1 + x) ** -0.5) <= t


def test_binomial_series_terms_float32_cheaper_than_float64():
    assert binomial_series_terms(0.05, F32) < binomial_series_terms(0.05, F64)
    # rho = 0.2 is in range for float32 only; max_terms is honoured
    assert binomial_series_terms(0.2, F32) is not None
    assert binomial_series_terms(0.2, F64) is None
    assert binomial_series_terms(0.2, F64, max_terms=40) is not None
