"""Contract tests for stiefel_attention.optim: StiefelAdam, StiefelSGD, param_groups.

Both update paths (batched, the default; and the frame-by-frame reference path, batched=False)
are checked against each other and against an independent reference written here (per-frame
loop in float64, SVD polar factor), which follows the update rule of the optim.py docstring
literally:

    g  = P_W(grad + wd W)
    m  = P_W(b1 m + (1 - b1) g)
    v  = b2 v + (1 - b2) ||g||_F^2            (one scalar per frame)
    xi = -lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    xi *= min(1, max_step / ||xi||_F)
    W  = polar(W + xi)

Tolerances: float64 trajectories agree to 1e-12 absolute (entries of frames are O(1); each of
the ~40 steps adds O(1e-16) round-off and the normalised step does not amplify it noticeably);
float32 frames stay within 1e-5 of orthonormal. Exact equality (torch.equal) is asserted where
the computation is bit-for-bit the same (state_dict round trips, refused steps).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stiefel_attention import optim
from stiefel_attention.manifold import isometry_error, random_frame
from stiefel_attention.nn import frames
from stiefel_attention.optim import NonFiniteGradientError, StiefelAdam, StiefelSGD, param_groups, stiefel_adam

F32, F64 = torch.float32, torch.float64

# Several shapes in one group: (6, 3) and (2, 6, 3) share a batched call, the rest do not; square
# (5, 5) and single-column (7, 1) frames; batch dims (), (2,), (3, 2).
MIXED_SHAPES = [(6, 3), (2, 6, 3), (5, 5), (3, 2, 7, 1), (4, 2), (2, 9, 4)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_params(shapes, dtype=F64, seed=0) -> list[nn.Parameter]:
    g = gen(seed)
    return [nn.Parameter(random_frame(*s[:-2], d=s[-2], r=s[-1], generator=g, dtype=dtype)) for s in shapes]


def clone_params(params) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def grad_seq(shapes, steps, dtype=F64, seed=1, scale=1.0) -> list[list[torch.Tensor]]:
    g = gen(seed)
    return [[scale * torch.randn(s, generator=g, dtype=F64).to(dtype) for s in shapes] for _ in range(steps)]


def run(opt, params, grads, transform=None):
    """Set grads and step; returns the list of per-step snapshots of all params."""
    history = []
    for step_grads in grads:
        for p, G in zip(params, step_grads):
            p.grad = (transform(G) if transform else G).clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def max_diff(xs, ys) -> float:
    return max(float((x.detach().to(F64) - y.detach().to(F64)).abs().max()) for x, y in zip(xs, ys))


def state_copy(opt, params):
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params]


def assert_states_equal(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------------------------
# Independent reference (float64, per frame, SVD polar factor)
# ---------------------------------------------------------------------------------------------


def _proj(W, G):
    A = W.T @ G
    return G - W @ ((A + A.T) / 2)


def _polar(Y):
    U, _, Vh = torch.linalg.svd(Y, full_matrices=False)
    return U @ Vh


def _cap(xi, max_step):
    if max_step is None:
        return xi
    n = float(torch.linalg.norm(xi))
    return xi * (max_step / n) if n > max_step else xi


class _RefFrames:
    def __init__(self, params):
        self.shapes = [tuple(p.shape) for p in params]
        self.W = [[w.clone() for w in p.detach().to(F64).reshape(-1, *p.shape[-2:])] for p in params]

    def frames(self):
        return [torch.stack(ws).reshape(s) for ws, s in zip(self.W, self.shapes)]

    def split(self, grads):
        return [G.to(F64).reshape(-1, *G.shape[-2:]) for G in grads]


class RefAdam(_RefFrames):
    def __init__(
        self,
        params,
        lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        max_step=None,
        weight_decay=0.0,
        projector=True,
        second_moment="frame",
    ):
        super().__init__(params)
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.max_step, self.wd, self.projector, self.second_moment = max_step, weight_decay, projector, second_moment
        self.m = [[torch.zeros_like(w) for w in ws] for ws in self.W]
        self.v = [
            [torch.zeros_like(w) if second_moment == "coordinate" else torch.zeros((), dtype=F64) for w in ws]
            for ws in self.W
        ]
        self.t = 0

    def step(self, grads):
        self.t += 1
        b1, b2, t = self.b1, self.b2, self.t
        for i, Gs in enumerate(self.split(grads)):
            for j, G in enumerate(Gs):
                W = self.W[i][j]
                G = G + self.wd * W
                g = _proj(W, G) if self.projector else G
                m = self.b1 * self.m[i][j] + (1 - b1) * g
                if self.projector:
                    m = _proj(W, m)
                if self.second_moment == "frame":
                    v = b2 * self.v[i][j] + (1 - b2) * (g * g).sum()
                else:
                    v = b2 * self.v[i][j] + (1 - b2) * g * g
                m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                xi = _cap(-self.lr * m_hat / (torch.sqrt(v_hat) + self.eps), self.max_step)
                self.m[i][j], self.v[i][j] = m, v
                self.W[i][j] = _polar(W + xi)


class RefSGD(_RefFrames):
    def __init__(self, params, lr, momentum=0.0, max_step=None, weight_decay=0.0):
        super().__init__(params)
        self.lr, self.momentum, self.max_step, self.wd = lr, momentum, max_step, weight_decay
        self.m = [[torch.zeros_like(w) for w in ws] for ws in self.W]

    def step(self, grads):
        for i, Gs in enumerate(self.split(grads)):
            for j, G in enumerate(Gs):
                W = self.W[i][j]
                g = _proj(W, G + self.wd * W)
                if self.momentum:
                    g = self.m[i][j] = _proj(W, self.momentum * self.m[i][j] + g)
                self.W[i][j] = _polar(W + _cap(-self.lr * g, self.max_step))


def run_ref(ref, grads):
    for step_grads in grads:
        ref.step(step_grads)
    return ref.frames()


@pytest.fixture
def path_spy(monkeypatch):
    """Counts calls of the batched and single-tensor implementations."""
    calls = {"batched_adam": 0, "single_adam": 0, "batched_retract": 0}
    for name, key in [
        ("_batched_stiefel_adam", "batched_adam"),
        ("_single_tensor_stiefel_adam", "single_adam"),
        ("_batched_retract", "batched_retract"),
    ]:
        fn = getattr(optim, name)

        def wrapper(*a, __fn=fn, __key=key, **k):
            calls[__key] += 1
            return __fn(*a, **k)

        monkeypatch.setattr(optim, name, wrapper)
    return calls


# ---------------------------------------------------------------------------------------------
# Batched path == reference path == independent reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_step", [None, 0.03])
@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_adam_batched_equals_reference_path_and_independent_reference(path_spy, max_step, weight_decay, seed):
    steps = 40
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, max_step=max_step, weight_decay=weight_decay)
    params0 = make_params(MIXED_SHAPES, seed=seed)
    grads = grad_seq(MIXED_SHAPES, steps, seed=seed + 100)

    pa = clone_params(params0)
    run(StiefelAdam(pa, **kw), pa, grads)
    assert path_spy["batched_adam"] > 0 and path_spy["single_adam"] == 0
    pb = clone_params(params0)
    run(StiefelAdam(pb, batched=False, **kw), pb, grads)
    assert path_spy["single_adam"] > 0
    ref = run_ref(RefAdam(params0, **kw), grads)

    assert max_diff(pa, pb) <= 1e-12
    assert max_diff(pa, ref) <= 1e-12
    assert max_diff(pb, ref) <= 1e-12
    assert max_diff(pa, params0) > 0.1  # the frames did move
    for p in pa + pb:
        assert float(isometry_error(p)) <= 1e-13


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("max_step", [None, 0.04])
@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_sgd_batched_equals_reference_path_and_independent_reference(path_spy, momentum, max_step, weight_decay):
    steps = 40
    kw = dict(lr=0.01, momentum=momentum, max_step=max_step, weight_decay=weight_decay)
    params0 = make_params(MIXED_SHAPES, seed=3)
    grads = grad_seq(MIXED_SHAPES, steps, seed=4)

    pa = clone_params(params0)
    run(StiefelSGD(pa, **kw), pa, grads)
    assert path_spy["batched_retract"] > 0
    n_batched = path_spy["batched_retract"]
    pb = clone_params(params0)
    run(StiefelSGD(pb, batched=False, **kw), pb, grads)
    assert path_spy["batched_retract"] == n_batched  # the reference path never uses it
    ref = run_ref(RefSGD(params0, **kw), grads)

    assert max_diff(pa, pb) <= 1e-12
    assert max_diff(pa, ref) <= 1e-12
    assert max_diff(pa, params0) > 0.05
    for p in pa + pb:
        assert float(isometry_error(p)) <= 1e-13


_frame_shape = st.tuples(
    st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple), st.integers(1, 5), st.integers(0, 4)
).map(lambda t: (*t[0], t[1] + t[2], t[1]))


@settings(max_examples=20, deadline=None, database=None)
@given(
    shapes=st.lists(_frame_shape, min_size=1, max_size=4),
    seed=st.integers(0, 2**20),
    max_step=st.sampled_from([None, 0.02, 0.2]),
    lr=st.sampled_from([1e-3, 0.05, 0.5]),
    opt_name=st.sampled_from(["adam", "sgd"]),
)
def test_batched_equals_reference_random_shapes_hypothesis(shapes, seed, max_step, lr, opt_name):
    params0 = make_params(shapes, seed=seed)
    grads = grad_seq(shapes, 8, seed=seed + 1)
    pa, pb = clone_params(params0), clone_params(params0)
    if opt_name == "adam":
        run(StiefelAdam(pa, lr=lr, max_step=max_step), pa, grads)
        run(StiefelAdam(pb, lr=lr, max_step=max_step, batched=False), pb, grads)
        ref = run_ref(RefAdam(params0, lr=lr, max_step=max_step), grads)
    else:
        run(StiefelSGD(pa, lr=lr / 10, momentum=0.9, max_step=max_step), pa, grads)
        run(StiefelSGD(pb, lr=lr / 10, momentum=0.9, max_step=max_step, batched=False), pb, grads)
        ref = run_ref(RefSGD(params0, lr=lr / 10, momentum=0.9, max_step=max_step), grads)
    assert max_diff(pa, pb) <= 1e-12
    assert max_diff(pa, ref) <= 1e-12
    for p in pa:
        assert float(isometry_error(p)) <= 1e-13


def test_adam_several_param_groups_use_their_own_hyperparameters():
    shapes_a, shapes_b = [(6, 3), (2, 6, 3)], [(6, 3), (5, 2)]
    pa, pb = make_params(shapes_a, seed=0), make_params(shapes_b, seed=1)
    grads = grad_seq(shapes_a + shapes_b, 20, seed=2)
    qa, qb = clone_params(pa), clone_params(pb)
    opt = StiefelAdam([{"params": qa, "lr": 0.01}, {"params": qb, "max_step": 0.02}], lr=0.1, betas=(0.8, 0.95))
    run(opt, qa + qb, grads)
    ref_a = run_ref(RefAdam(pa, lr=0.01, betas=(0.8, 0.95)), [g[:2] for g in grads])
    ref_b = run_ref(RefAdam(pb, lr=0.1, betas=(0.8, 0.95), max_step=0.02), [g[2:] for g in grads])
    assert max_diff(qa, ref_a) <= 1e-12
    assert max_diff(qb, ref_b) <= 1e-12


def test_step_closure_returns_loss_and_is_used():
    p = make_params([(6, 3)])[0]
    target = random_frame(d=6, r=3, generator=gen(5), dtype=F64)
    opt = StiefelAdam([p], lr=0.05)

    def closure():
        opt.zero_grad()
        loss = ((p - target) ** 2).sum()
        loss.backward()
        return loss

    losses = [float(opt.step(closure).detach()) for _ in range(60)]
    assert losses[-1] < 0.2 * losses[0]  # descends towards the target frame
    assert float(isometry_error(p)) <= 1e-13


# ---------------------------------------------------------------------------------------------
# float32: orthonormality does not drift
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_float32_adam_stays_orthonormal_over_10000_steps():
    g = gen(0)
    p = nn.Parameter(random_frame(4, d=32, r=8, generator=g, dtype=F32))
    q = nn.Parameter(random_frame(2, d=12, r=12, generator=g, dtype=F32))  # square frames too
    opt = StiefelAdam([p, q], lr=0.05)
    worst = 0.0
    for step in range(10_000):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = torch.randn(q.shape, generator=g)
        opt.step()
        if step % 500 == 499:
            worst = max(worst, float(isometry_error(p)), float(isometry_error(q)))
    assert worst < 1e-5
    assert float(isometry_error(p)) < 1e-5 and float(isometry_error(q)) < 1e-5
    assert torch.isfinite(p).all() and torch.isfinite(q).all()


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("max_step", [None, 0.1])
def test_float32_adam_large_frames_stay_orthonormal(batched, max_step):
    g = gen(1)
    p = nn.Parameter(random_frame(3, d=256, r=64, generator=g, dtype=F32))
    opt = StiefelAdam([p], lr=0.05, max_step=max_step, batched=batched)
    for _ in range(200):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    # d = 256: the float32 budget grows with the length of the sums, 1e-5 * d / 16
    assert float(isometry_error(p)) < 1.6e-4
    assert float(isometry_error(p)) < 2e-5  # in practice it is at the 1e-6 level


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_float32_sgd_stays_orthonormal(momentum):
    g = gen(2)
    p = nn.Parameter(random_frame(4, d=32, r=8, generator=g, dtype=F32))
    opt = StiefelSGD([p], lr=0.02, momentum=momentum)
    for _ in range(1000):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert float(isometry_error(p)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Invariances
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("c", [1e-3, 1e3])
@pytest.mark.parametrize("max_step", [None, 0.03])
def test_adam_is_scale_invariant_with_eps_zero(batched, c, max_step):
    shapes = [(6, 3), (2, 5, 5), (7, 1)]
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 30, seed=1)
    pa, pb = clone_params(params0), clone_params(params0)
    run(StiefelAdam(pa, lr=0.05, eps=0.0, max_step=max_step, batched=batched), pa, grads)
    run(StiefelAdam(pb, lr=0.05, eps=0.0, max_step=max_step, batched=batched), pb, grads, transform=lambda G: c * G)
    assert max_diff(pa, pb) <= 1e-10
    assert max_diff(pa, params0) > 0.1


@pytest.mark.parametrize("batched", [None, False])
def test_sgd_is_not_scale_invariant(batched):
    shapes = [(6, 3), (2, 5, 5)]
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 10, seed=1)
    pa, pb = clone_params(params0), clone_params(params0)
    run(StiefelSGD(pa, lr=0.01, momentum=0.9, batched=batched), pa, grads)
    run(StiefelSGD(pb, lr=0.01, momentum=0.9, batched=batched), pb, grads, transform=lambda G: 10.0 * G)
    assert max_diff(pa, pb) > 0.05


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_weight_decay_is_a_no_op_on_frames(batched, opt_name):
    params0 = make_params(MIXED_SHAPES, seed=7)
    grads = grad_seq(MIXED_SHAPES, 30, seed=8)
    results = []
    for wd in (0.0, 0.5):
        ps = clone_params(params0)
        if opt_name == "adam":
            opt = StiefelAdam(ps, lr=0.05, weight_decay=wd, batched=batched)
        else:
            opt = StiefelSGD(ps, lr=0.01, momentum=0.9, weight_decay=wd, batched=batched)
        run(opt, ps, grads)
        results.append(ps)
    assert max_diff(results[0], results[1]) <= 1e-12
    assert max_diff(results[0], params0) > 0.05


def test_weight_decay_does_act_without_projector():
    # the contrast that makes the no-op test meaningful: without P_W, lambda W is not removed
    # from the moments. (The polar retraction still discards most of its effect on the step,
    # since W + c W has the same polar factor as W: what remains acts through m and v.)
    params0 = make_params([(6, 3)], seed=7)
    grads = grad_seq([(6, 3)], 10, seed=8)
    out = []
    for wd in (0.0, 0.5):
        ps = clone_params(params0)
        run(StiefelAdam(ps, lr=0.05, weight_decay=wd, projector=False), ps, grads)
        out.append(ps)
    assert max_diff(out[0], out[1]) > 1e-4


def _random_orthogonal(d, seed):
    Q, R = torch.linalg.qr(torch.randn(d, d, generator=gen(seed), dtype=F64))
    return Q * torch.sign(torch.diagonal(R))


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("max_step", [None, 0.03])
def test_adam_is_O_d_equivariant(batched, max_step):
    d = 6
    shapes = [(6, 3), (2, 6, 3), (6, 6), (6, 1)]
    Q = _random_orthogonal(d, seed=11)
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 30, seed=1)
    pa = clone_params(params0)
    run(StiefelAdam(pa, lr=0.05, max_step=max_step, batched=batched), pa, grads)
    pq = [nn.Parameter(Q @ p.detach()) for p in params0]
    run(StiefelAdam(pq, lr=0.05, max_step=max_step, batched=batched), pq, grads, transform=lambda G: Q @ G)
    assert max_diff([Q @ p.detach() for p in pa], pq) <= 1e-12
    assert max_diff(pa, params0) > 0.1


def test_coordinate_second_moment_breaks_O_d_equivariance():
    d = 6
    shapes = [(6, 3), (2, 6, 3)]
    Q = _random_orthogonal(d, seed=11)
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 30, seed=1)
    pa = clone_params(params0)
    run(StiefelAdam(pa, lr=0.05, second_moment="coordinate"), pa, grads)
    pq = [nn.Parameter(Q @ p.detach()) for p in params0]
    run(StiefelAdam(pq, lr=0.05, second_moment="coordinate"), pq, grads, transform=lambda G: Q @ G)
    assert max_diff([Q @ p.detach() for p in pa], pq) > 1e-6


@pytest.mark.parametrize("batched", [None, False])
def test_sgd_is_O_d_equivariant(batched):
    shapes = [(6, 3), (2, 6, 6)]
    Q = _random_orthogonal(6, seed=3)
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 20, seed=1)
    pa = clone_params(params0)
    run(StiefelSGD(pa, lr=0.01, momentum=0.9, batched=batched), pa, grads)
    pq = [nn.Parameter(Q @ p.detach()) for p in params0]
    run(StiefelSGD(pq, lr=0.01, momentum=0.9, batched=batched), pq, grads, transform=lambda G: Q @ G)
    assert max_diff([Q @ p.detach() for p in pa], pq) <= 1e-12


# ---------------------------------------------------------------------------------------------
# Trust region
# ---------------------------------------------------------------------------------------------


def _step_lengths(history, params0):
    """Per step, the Frobenius length of every frame's move: a tensor (steps, n_frames)."""
    prev = [p.detach().clone() for p in params0]
    out = []
    for snap in history:
        lens = [torch.linalg.matrix_norm((s - q).reshape(-1, *s.shape[-2:])) for s, q in zip(snap, prev)]
        out.append(torch.cat(lens))
        prev = snap
    return torch.stack(out)


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", [F64, F32], ids=str)
def test_trust_region_caps_every_step(batched, opt_name, dtype):
    max_step = 0.1
    params0 = make_params(MIXED_SHAPES, dtype=dtype, seed=0)
    grads = grad_seq(MIXED_SHAPES, 25, dtype=dtype, seed=1)

    def make(ps, cap):
        if opt_name == "adam":
            return StiefelAdam(ps, lr=1.0, max_step=cap, batched=batched)
        return StiefelSGD(ps, lr=1.0, momentum=0.5, max_step=cap, batched=batched)

    ps = clone_params(params0)
    lens = _step_lengths(run(make(ps, max_step), ps, grads), params0)
    slack = {F64: 1e-12, F32: 1e-5}[dtype]
    # the polar retraction does not lengthen a tangent step: ||R_W(xi) - W|| <= ||xi|| <= max_step
    assert float(lens.max()) <= max_step * (1 + slack)
    # with lr = 1 the cap binds: ||R_W(xi) - W|| = ||xi|| - O(||xi||^3) for ||xi|| = max_step
    frac_hit = float((lens >= 0.99 * max_step).double().mean())
    assert frac_hit >= 0.9
    for p in ps:
        assert float(isometry_error(p)) <= {F64: 1e-13, F32: 1e-5}[dtype]
    # and without the cap the same run takes longer steps
    pu = clone_params(params0)
    lens_uncapped = _step_lengths(run(make(pu, None), pu, grads), params0)
    assert float(lens_uncapped.max()) > 3 * max_step


# ---------------------------------------------------------------------------------------------
# Ablations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ablation",
    [dict(projector=False), dict(second_moment="coordinate"), dict(projector=False, second_moment="coordinate")],
    ids=str,
)
@pytest.mark.parametrize("max_step", [None, 0.03])
def test_ablations_follow_their_rule(path_spy, ablation, max_step):
    params0 = make_params(MIXED_SHAPES, seed=5)
    grads = grad_seq(MIXED_SHAPES, 30, seed=6)
    ps = clone_params(params0)
    run(StiefelAdam(ps, lr=0.05, max_step=max_step, weight_decay=0.1, **ablation), ps, grads)
    assert path_spy["batched_adam"] == 0  # ablations always take the reference path
    ref = run_ref(RefAdam(params0, lr=0.05, max_step=max_step, weight_decay=0.1, **ablation), grads)
    assert max_diff(ps, ref) <= 1e-12
    for p in ps:
        assert float(isometry_error(p)) <= 1e-13
    # and the ablation really is a different rule
    pm = clone_params(params0)
    run(StiefelAdam(pm, lr=0.05, max_step=max_step, weight_decay=0.1), pm, grads)
    assert max_diff(ps, pm) > 1e-4


@pytest.mark.parametrize("ablation", [dict(projector=False), dict(second_moment="coordinate")], ids=str)
def test_ablations_float32_stay_orthonormal(ablation):
    g = gen(3)
    p = nn.Parameter(random_frame(4, d=32, r=8, generator=g, dtype=F32))
    opt = StiefelAdam([p], lr=0.05, **ablation)
    for _ in range(300):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert float(isometry_error(p)) < 1e-5
    assert opt.state[p]["exp_avg_sq"].shape == (p.shape if "second_moment" in ablation else p.shape[:-2])


def test_batched_true_with_ablation_is_refused_by_the_functional_api():
    p = make_params([(6, 3)])[0].detach()
    state = [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.tensor(0.0)]
    with pytest.raises(ValueError, match="batched path needs"):
        stiefel_adam(
            [p],
            [torch.randn(6, 3, dtype=F64)],
            *state,
            lr=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            max_step=None,
            weight_decay=0.0,
            second_moment="coordinate",
            batched=True,
        )


# ---------------------------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------------------------


def _roundtrip_case(make_opt, through_bytes: bool):
    shapes = [(6, 3), (2, 6, 3), (5, 5)]
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 20, seed=1)
    pa = clone_params(params0)
    opt = make_opt(pa)
    run(opt, pa, grads[:10])
    saved_frames = copy.deepcopy([p.detach() for p in pa])
    if through_bytes:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
    else:
        saved_sd = copy.deepcopy(opt.state_dict())
    run(opt, pa, grads[10:])  # -> A

    pb = [nn.Parameter(f.clone()) for f in saved_frames]
    opt_b = make_opt(pb)
    opt_b.load_state_dict(torch.load(buf) if through_bytes else saved_sd)
    run(opt_b, pb, grads[10:])  # -> B
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    for sa, sb in zip(state_copy(opt, pa), state_copy(opt_b, pb)):
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    # and the state mattered: a fresh optimizer from the saved frames diverges
    pc = [nn.Parameter(f.clone()) for f in saved_frames]
    run(make_opt(pc), pc, grads[10:])
    assert max_diff(pa, pc) > 1e-6


@pytest.mark.parametrize("through_bytes", [False, True], ids=["deepcopy", "bytesio"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: StiefelAdam(ps, lr=0.05, max_step=0.04),
        lambda ps: StiefelAdam(ps, lr=0.05, batched=False),
        lambda ps: StiefelAdam(ps, lr=0.05, second_moment="coordinate"),
        lambda ps: StiefelSGD(ps, lr=0.01, momentum=0.9),
    ],
    ids=["adam", "adam-reference", "adam-coordinate", "sgd-momentum"],
)
def test_state_dict_round_trip_is_exact(make_opt, through_bytes):
    _roundtrip_case(make_opt, through_bytes)


def test_state_dict_contents():
    p = make_params([(2, 6, 3)])[0]
    opt = StiefelAdam([p], lr=0.05, max_step=0.1)
    p.grad = torch.randn(p.shape, dtype=F64)
    opt.step()
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(st["step"]) == 1.0
    assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == (2,)
    g = sd["param_groups"][0]
    assert g["lr"] == 0.05 and g["max_step"] == 0.1 and g["second_moment"] == "frame"
    # workspaces are derived data and are not saved
    assert all(not k.startswith("_") for k in st)


# ---------------------------------------------------------------------------------------------
# One optimizer for a whole model: param_groups, AdamW groups, state_dict, schedulers
# ---------------------------------------------------------------------------------------------


def train(model, opt, data, sched=None):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def test_adamw_groups_are_torch_adamw_exactly(tiny_model, token_batches):
    """Groups with stiefel=False step exactly as torch.optim.AdamW does (its functional AdamW, not a copy)."""
    model_a, model_b = tiny_model(qk="euclidean"), tiny_model(qk="euclidean")
    opt_a = StiefelAdam(param_groups(model_a, weight_decay=0.1), lr=3e-3, betas=(0.8, 0.95), eps=1e-7)
    opt_b = torch.optim.AdamW(param_groups(model_b, weight_decay=0.1), lr=3e-3, betas=(0.8, 0.95), eps=1e-7)
    data = token_batches(6)
    train(model_a, opt_a, data)
    train(model_b, opt_b, data)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert opt_a.state[pa].keys() == opt_b.state[pb].keys()
        for k in opt_a.state[pa]:
            assert torch.equal(opt_a.state[pa][k], opt_b.state[pb][k]), k


@pytest.mark.parametrize(
    "flags, path",
    [
        (dict(foreach=True), "_multi_tensor_adam"),
        (dict(fused=True), "_fused_adam"),
        (dict(foreach=False), "_single_tensor_adam"),
    ],
    ids=["foreach", "fused", "loop"],
)
def test_adamw_groups_pass_foreach_and_fused_to_torch(tiny_model, token_batches, flags, path, monkeypatch):
    import torch.optim.adam as torch_adam

    # On a CPU the loop and the foreach kernels give identical numbers, so the path taken is observed, not inferred
    taken = []
    for name in ("_multi_tensor_adam", "_fused_adam", "_single_tensor_adam"):
        real = getattr(torch_adam, name)
        monkeypatch.setattr(torch_adam, name, lambda *a, _n=name, _f=real, **k: (taken.append(_n), _f(*a, **k))[1])
    model_a, model_b = tiny_model(qk="euclidean"), tiny_model(qk="euclidean")
    opt_a = StiefelAdam(param_groups(model_a, weight_decay=0.1), lr=3e-3, **flags)
    opt_b = torch.optim.AdamW(param_groups(model_b, weight_decay=0.1), lr=3e-3, **flags)
    data = token_batches(4)
    train(model_a, opt_a, data)
    assert taken and set(taken) == {path}
    train(model_b, opt_b, data)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


def test_param_groups_follow_the_nanogpt_rule_and_exempt_frames(tiny_model):
    model = tiny_model()
    groups = param_groups(model, weight_decay=0.1, frame_lr=0.02, max_step=0.1, eps=1e-6)
    decay, plain, frame_group = groups
    assert (decay["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert not decay["stiefel"] and not plain["stiefel"] and frame_group["stiefel"]
    assert (frame_group["lr"], frame_group["max_step"], frame_group["eps"]) == (0.02, 0.1, 1e-6)
    assert "weight_decay" not in frame_group  # the optimizer's (a no-op on frames, Proposition 5)
    ids = {k: {id(p) for p in g["params"]} for k, g in zip(("decay", "plain", "frames"), groups)}
    assert ids["frames"] == {id(p) for _, p in frames(model)}
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            assert {id(module.weight), id(module.bias)} <= ids["plain"], name
        if isinstance(module, nn.Linear):
            assert id(module.weight) in ids["decay"], name
            if module.bias is not None:
                assert id(module.bias) in ids["plain"], name
        if isinstance(module, nn.Embedding):
            assert id(module.weight) in ids["decay"], name
    # every trainable parameter in exactly one group
    every = [id(p) for g in groups for p in g["params"]]
    assert sorted(every) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    # no_decay moves a matrix to the plain group; frozen parameters are left out; empty groups dropped
    head = model.head.weight
    assert id(head) in {id(p) for p in param_groups(model, 0.1, no_decay=[head])[1]["params"]}
    frozen = tiny_model(qk="frozen")
    assert all(not g["stiefel"] for g in param_groups(frozen, 0.1))
    assert not any(
        id(p) in {id(q) for g in param_groups(frozen, 0.1) for q in g["params"]}
        for p in frozen.blocks[0].attn.parameters()
        if not p.requires_grad
    )


def test_one_optimizer_trains_a_whole_model(tiny_model, token_batches):
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.02), lr=1e-2, max_step=0.1)
    losses = train(model, opt, token_batches(1) * 40)  # one batch, fitted
    assert losses[-1] < 0.5 * losses[0]
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} was not stepped"
    for name, W in frames(model):
        assert float(isometry_error(W)) < 1e-5, name


@pytest.mark.parametrize("cls", ["adam", "sgd"])
def test_state_dict_round_trip_with_scheduler_resumes_bit_identically(tiny_model, token_batches, cls):
    data = token_batches(20)

    def make(model):
        groups = param_groups(model, weight_decay=0.1, frame_lr=0.02)
        if cls == "adam":
            return StiefelAdam(groups, lr=3e-3, max_step=0.1)
        return StiefelSGD(groups, lr=3e-3, momentum=0.9)

    model = tiny_model()
    opt = make(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(model, opt, data[:10], sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    train(model, opt, data[10:], sched)  # -> A

    model_b = tiny_model(seed=99)
    opt_b = make(model_b)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    ck = torch.load(buf)
    model_b.load_state_dict(ck["model"])
    opt_b.load_state_dict(ck["opt"])
    sched_b.load_state_dict(ck["sched"])
    train(model_b, opt_b, data[10:], sched_b)  # -> B

    for (name, a), b in zip(model.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    # torch's layout: one state dict per parameter index, groups with their hyper-parameters
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert len(sd["state"]) == sum(1 for p in model.parameters() if p.requires_grad)
    # 20 scheduler steps with step_size 3: every group's lr halved 6 times
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3 * 0.5**6] * 2 + [0.02 * 0.5**6], rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt_b.param_groups]


def test_scheduler_lr_reaches_frames_and_adamw_groups(tiny_model, token_batches, monkeypatch):
    model = tiny_model()
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.02), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    frame_lrs, adamw_lrs = [], []
    real_frames, real_adamw = optim.stiefel_adam, optim._torch_adamw
    monkeypatch.setattr(optim, "stiefel_adam", lambda *a, **k: (frame_lrs.append(k["lr"]), real_frames(*a, **k))[1])
    monkeypatch.setattr(optim, "_torch_adamw", lambda *a, **k: (adamw_lrs.append(k["lr"]), real_adamw(*a, **k))[1])
    train(model, opt, token_batches(3), sched)
    assert frame_lrs == pytest.approx([0.02, 0.002, 0.0002], rel=1e-12)
    assert adamw_lrs == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4, 1e-5, 1e-5], rel=1e-12)  # two AdamW groups


def test_non_finite_gradient_anywhere_leaves_the_model_unchanged(tiny_model, token_batches):
    model = tiny_model()
    opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=1e-3)
    train(model, opt, token_batches(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    ((x, y),) = token_batches(1, seed=5)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.head.bias.grad[0] = float("inf")  # an AdamW parameter only
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[1\]"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[n][k]), (n, k)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [StiefelAdam, lambda ps: StiefelSGD(ps, lr=0.1)], ids=["adam", "sgd"])
def test_frame_with_d_less_than_r_raises(cls):
    with pytest.raises(ValueError) as info:
        cls([nn.Parameter(torch.zeros(2, 3, 5))])
    msg = str(info.value)
    assert "(d, r) = (3, 5)" in msg and "d >= r" in msg


@pytest.mark.parametrize("cls", [StiefelAdam, lambda ps: StiefelSGD(ps, lr=0.1)], ids=["adam", "sgd"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_non_orthonormal_start_raises(cls, dtype):
    good = make_params([(6, 3)], dtype=dtype)[0]
    bad = nn.Parameter(torch.randn(2, 6, 3, generator=gen(0)).to(dtype))
    with pytest.raises(ValueError) as info:
        cls([good, bad])
    msg = str(info.value)
    assert "Stiefel" in msg and "orthonormal" in msg and "params'][1]" in msg


def test_non_orthonormal_param_group_added_later_raises():
    opt = StiefelAdam(make_params([(6, 3)]), lr=0.1)
    with pytest.raises(ValueError, match="param_groups\\[1\\].*Stiefel"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(6, 3, dtype=F64))]})


def test_non_float_and_non_frame_tensors_raise_value_error():
    with pytest.raises(ValueError, match="floating-point"):
        StiefelAdam([torch.eye(4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="shape"):
        StiefelAdam([nn.Parameter(torch.ones(4))])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1e-3), "learning rate"),
        (dict(lr=float("nan")), "learning rate"),
        (dict(betas=(1.0, 0.9)), "betas"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(-0.1, 0.9)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(max_step=0.0), "max_step"),
        (dict(max_step=-0.1), "max_step"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(second_moment="coord"), "second_moment"),
    ],
)
def test_adam_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StiefelAdam(make_params([(6, 3)]), **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-0.1), "learning rate"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, momentum=-0.5), "momentum"),
        (dict(lr=0.1, max_step=0.0), "max_step"),
        (dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
    ],
)
def test_sgd_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StiefelSGD(make_params([(6, 3)]), **kwargs)


def test_sparse_gradient_raises():
    p = make_params([(6, 3)])[0]
    opt = StiefelAdam([p])
    p.grad = torch.randn(6, 3, dtype=F64).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


# ---------------------------------------------------------------------------------------------
# Non-finite gradients: refused, nothing written
# ---------------------------------------------------------------------------------------------


def _make_opt(kind, params, batched):
    if kind == "adam":
        return StiefelAdam(params, lr=0.05, max_step=0.5, weight_decay=0.1, batched=batched)
    if kind == "adam-coordinate":
        return StiefelAdam(params, lr=0.05, second_moment="coordinate", batched=batched)
    return StiefelSGD(params, lr=0.01, momentum=0.9, batched=batched)


def _check_refused_step(kind, batched, shapes, bad_index, bad_value):
    params0 = make_params(shapes, seed=0)
    grads = grad_seq(shapes, 6, seed=1)
    ps = clone_params(params0)
    opt = _make_opt(kind, ps, batched)
    run(opt, ps, grads[:3])  # the state exists and is non-trivial
    frames_before = [p.detach().clone() for p in ps]
    state_before = state_copy(opt, ps)
    bad = [G.clone() for G in grads[3]]
    bad[bad_index].view(-1)[5] = bad_value
    for p, G in zip(ps, bad):
        p.grad = G
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    for p, f in zip(ps, frames_before):
        assert torch.equal(p, f)
    assert_states_equal(state_copy(opt, ps), state_before)
    # the refused step was a no-op: carrying on gives the run that never saw the bad batch
    run(opt, ps, grads[4:])
    pr = clone_params(params0)
    opt_r = _make_opt(kind, pr, batched)
    run(opt_r, pr, grads[:3] + grads[4:])
    for a, b in zip(ps, pr):
        assert torch.equal(a, b)
    return str(info.value)


# the ablation takes the reference path whatever `batched` says: one case for it
@pytest.mark.parametrize(
    "kind, batched", [("adam", None), ("adam", False), ("adam-coordinate", None), ("sgd", None), ("sgd", False)]
)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bad_index", [0, 2])
def test_non_finite_gradient_refused_same_shape_group(kind, batched, bad_value, bad_index):
    # one (d, r) shape, so one batched call covers the group
    shapes = [(6, 3), (2, 6, 3), (6, 3)]
    msg = _check_refused_step(kind, batched, shapes, bad_index, bad_value)
    assert "non-finite gradient" in msg and f"[{bad_index}]" in msg


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("batched", [None, False])
def test_non_finite_gradient_refused_mixed_shape_group(kind, batched):
    _check_refused_step(kind, batched, MIXED_SHAPES, bad_index=4, bad_value=float("nan"))


def test_non_finite_gradient_message_names_group_index():
    ps = make_params([(8, 3), (6, 2)], seed=0)
    opt = StiefelAdam(ps, lr=0.05)
    ps[0].grad = torch.randn(8, 3, dtype=F64)
    ps[1].grad = torch.full((6, 2), float("nan"), dtype=F64)
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    assert "[1]" in str(info.value)


def test_non_finite_gradient_first_step_leaves_frames():
    ps = make_params([(6, 3), (6, 3)], seed=0)
    before = [p.detach().clone() for p in ps]
    opt = StiefelAdam(ps, lr=0.05)
    ps[0].grad = torch.randn(6, 3, dtype=F64)
    ps[1].grad = torch.full((6, 3), float("nan"), dtype=F64)
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert all(float(opt.state[p].get("step", torch.tensor(0.0))) == 0.0 for p in ps)
    ps[1].grad = torch.randn(6, 3, dtype=F64)
    opt.step()
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ps)
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))
    assert all(float(isometry_error(p)) <= 1e-13 for p in ps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt_cls", [StiefelAdam, StiefelSGD])
def test_half_precision_frames_are_refused_with_a_clear_error(dtype, opt_cls):
    # One scalar second moment per frame overflows float16 for ||g||_F > 256; frames stay float32
    # master weights instead (the optimizer says so rather than freezing a frame silently).
    p = nn.Parameter(random_frame(d=16, r=4, generator=gen(0), dtype=dtype))
    with pytest.raises(ValueError, match="float32 or float64"):
        opt_cls([p], lr=0.05)


def test_float32_frames_cast_to_float64_are_accepted():
    p = nn.Parameter(random_frame(d=64, r=16, generator=gen(0), dtype=torch.float32).double())
    opt = StiefelAdam([p], lr=0.05)
    p.grad = torch.randn(64, 16, generator=gen(1), dtype=F64)
    opt.step()
    assert float(isometry_error(p)) < 1e-13  # the first retraction removes the float32 round-off


@pytest.mark.parametrize("batched", [None, False])
def test_eps_zero_with_zero_gradient_does_not_move_or_nan(batched):
    p = nn.Parameter(random_frame(d=8, r=3, generator=gen(0), dtype=F64))
    before = p.detach().clone()
    opt = StiefelAdam([p], lr=0.05, eps=0.0, batched=batched)
    p.grad = torch.zeros(8, 3, dtype=F64)
    opt.step()
    assert torch.equal(p.detach(), before) or float((p.detach() - before).abs().max()) < 1e-15


def test_batched_true_with_an_ablation_is_refused_at_construction():
    p = nn.Parameter(random_frame(d=8, r=3, generator=gen(0), dtype=F64))
    with pytest.raises(ValueError, match="batched=True"):
        StiefelAdam([p], lr=0.05, second_moment="coordinate", batched=True)


# ---------------------------------------------------------------------------------------------
# Skipped and non-contiguous frames
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_frames_without_grad_are_skipped(batched, opt_name):
    shapes = [(6, 3), (6, 3), (5, 2)]
    ps = make_params(shapes, seed=0)
    if opt_name == "adam":
        opt = StiefelAdam(ps, lr=0.05, batched=batched)
    else:
        opt = StiefelSGD(ps, lr=0.01, momentum=0.9, batched=batched)
    frozen = ps[1].detach().clone()
    for G in grad_seq(shapes, 5, seed=1):
        ps[0].grad, ps[1].grad, ps[2].grad = G[0], None, G[2]
        opt.step()
    assert torch.equal(ps[1], frozen)
    assert len(opt.state[ps[1]]) == 0
    # the others did step, exactly as they would alone
    alone = make_params(shapes, seed=0)
    alone = [alone[0], alone[2]]
    opt2 = (
        StiefelAdam(alone, lr=0.05, batched=batched)
        if opt_name == "adam"
        else StiefelSGD(alone, lr=0.01, momentum=0.9, batched=batched)
    )
    run(opt2, alone, [[G[0], G[2]] for G in grad_seq(shapes, 5, seed=1)])
    assert max_diff([ps[0], ps[2]], alone) <= 1e-15


def _non_contiguous_like(frames_tensor):
    """Same values, non-contiguous layout (columns stored first)."""
    return frames_tensor.mT.contiguous().mT


@pytest.mark.parametrize("shape", [(6, 3), (2, 6, 3)])
def test_non_contiguous_frame_adam_falls_back_to_reference(path_spy, shape):
    params0 = make_params([shape, (5, 2)], seed=0)
    grads = grad_seq([shape, (5, 2)], 20, seed=1)
    pn = [nn.Parameter(_non_contiguous_like(params0[0].detach().clone())), nn.Parameter(params0[1].detach().clone())]
    assert not pn[0].is_contiguous() and torch.equal(pn[0], params0[0])
    run(StiefelAdam(pn, lr=0.05), pn, grads)
    assert path_spy["single_adam"] >= 1  # the non-contiguous shape took the reference path
    ref = run_ref(RefAdam(params0, lr=0.05), grads)
    assert max_diff(pn, ref) <= 1e-12
    assert not pn[0].is_contiguous()  # updated in place
    assert float(isometry_error(pn[0])) <= 1e-13


def test_non_contiguous_frame_sgd():
    params0 = make_params([(2, 6, 3)], seed=0)
    grads = grad_seq([(2, 6, 3)], 20, seed=1)
    pn = [nn.Parameter(_non_contiguous_like(params0[0].detach().clone()))]
    run(StiefelSGD(pn, lr=0.01, momentum=0.9), pn, grads)
    ref = run_ref(RefSGD(params0, lr=0.01, momentum=0.9), grads)
    assert max_diff(pn, ref) <= 1e-12


def test_non_contiguous_frame_trains_through_autograd():
    # grads from autograd follow the parameter's layout
    W0 = random_frame(3, d=8, r=4, generator=gen(0), dtype=F64)
    p = nn.Parameter(_non_contiguous_like(W0.clone()))
    x = torch.randn(16, 8, generator=gen(1), dtype=F64)
    opt = StiefelAdam([p], lr=0.05)
    for _ in range(10):
        opt.zero_grad()
        loss = (x @ p).square().sum()
        loss.backward()
        opt.step()
    assert float(isometry_error(p)) <= 1e-13
    assert not torch.equal(p, W0)


# ---------------------------------------------------------------------------------------------
# nonfinite="skip" and the step without host syncs
# ---------------------------------------------------------------------------------------------


class _NoHostSync(TorchDispatchMode):
    """Fails on aten._local_scalar_dense, which every .item(), bool() and float() of a tensor goes through.

    `host_counters`: tensors that live on the host by design whatever the parameters' device (torch's
    non-fused AdamW keeps its step counts on the CPU and reads them: no device synchronisation on a GPU), so
    reading them is allowed; on a CPU-only machine nothing else tells a host read from a device one."""

    def __init__(self, host_counters=()):
        super().__init__()
        self.allowed = {t.data_ptr() for t in host_counters}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].data_ptr() not in self.allowed:
            raise AssertionError("device-to-host synchronisation (.item()/bool()/float() of a tensor) in step()")
        return func(*args, **(kwargs or {}))


def _adamw_step_counts(opt) -> list[torch.Tensor]:
    """The host-side step counts of an optimizer's non-fused AdamW groups (see _NoHostSync)."""
    return [
        opt.state[p]["step"]
        for g in opt.param_groups
        if not g["stiefel"] and not g["fused"]
        for p in g["params"]
        if "step" in opt.state[p]
    ]


def test_no_host_sync_mode_catches_item():
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        float(torch.ones(()) + 1)


@pytest.mark.parametrize("cls", ["adam", "sgd"])
@pytest.mark.parametrize("adamw", [dict(fused=True), dict(foreach=True), dict(foreach=False)], ids=str)
def test_skip_mode_with_max_step_steps_without_host_syncs(tiny_model, token_batches, cls, adamw):
    """The sync-free configuration: max_step set, nonfinite='skip'; AdamW groups fused (skipped on the device)
    or not (masked back, no branch)."""
    model = tiny_model()
    groups = param_groups(model, weight_decay=0.1, frame_lr=0.02)
    kw = dict(max_step=0.1, nonfinite="skip", **adamw)
    opt = StiefelAdam(groups, lr=3e-3, **kw) if cls == "adam" else StiefelSGD(groups, lr=3e-3, momentum=0.9, **kw)
    data = token_batches(4)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if not opt.state:  # the first step creates the state, step counts included
            opt.step()
            continue
        with _NoHostSync(_adamw_step_counts(opt)):
            opt.step()
    for name, W in frames(model):
        assert float(isometry_error(W)) < 1e-5, name
    # the default (raise) mode does read the device back, which is what the guard detects
    opt_raise = StiefelAdam(param_groups(model, weight_decay=0.1), lr=3e-3, max_step=0.1)
    F.cross_entropy(model(data[0][0]), data[0][1]).backward()
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        opt_raise.step()


@pytest.mark.parametrize("cls", ["adam", "sgd", "sgd-nomomentum"])
@pytest.mark.parametrize("batched", [None, False])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), 1e200])
def test_skip_mode_leaves_a_bad_frame_and_its_moments_untouched(cls, batched, bad_value):
    """Frame 1 of a (3, 6, 3) tensor gets a non-finite gradient at step 4 (or a finite one whose squared norm
    overflows: 1e200 in these float64 frames): it and its moments stay as they were; every other frame steps
    exactly as in a run where frame 1's gradient was finite."""
    shape = [(3, 6, 3)]
    params0 = make_params(shape, seed=0)
    grads = grad_seq(shape, 8, seed=1)
    bad = [[G.clone() for G in step] for step in grads]
    bad[4][0][1, 2, 0] = bad_value

    def make(ps):
        if cls == "adam":
            return StiefelAdam(ps, lr=0.05, max_step=0.1, nonfinite="skip", batched=batched)
        return StiefelSGD(
            ps,
            lr=0.05,
            momentum=0.0 if cls == "sgd-nomomentum" else 0.9,
            max_step=0.1,
            nonfinite="skip",
            batched=batched,
        )

    ps = clone_params(params0)
    opt = make(ps)
    run(opt, ps, bad[:4])
    frame1, state1 = ps[0][1].detach().clone(), state_copy(opt, ps)[0]
    run(opt, ps, bad[4:5])
    assert torch.equal(ps[0][1], frame1)
    for k, v in opt.state[ps[0]].items():
        if k != "step" and v.dim() > 0:
            assert torch.equal(v[1], state1[k][1]), k
    assert all(torch.isfinite(v).all() for v in opt.state[ps[0]].values())
    run(opt, ps, bad[5:])
    # the other frames: as in a run that never saw the bad entry
    pr = clone_params(params0)
    run(make(pr), pr, grads)
    assert torch.equal(ps[0][0], pr[0][0]) and torch.equal(ps[0][2], pr[0][2])
    assert not torch.equal(ps[0][1], pr[0][1])
    assert float(isometry_error(ps[0])) <= 1e-13


def test_skip_mode_equals_raise_mode_on_finite_gradients():
    """Same rule, other arithmetic for the bias corrections and the inverse root: equal to round-off."""
    params0 = make_params(MIXED_SHAPES, seed=2)
    grads = grad_seq(MIXED_SHAPES, 15, seed=3)
    pa, pb = clone_params(params0), clone_params(params0)
    run(StiefelAdam(pa, lr=0.05, max_step=0.1), pa, grads)
    run(StiefelAdam(pb, lr=0.05, max_step=0.1, nonfinite="skip"), pb, grads)
    assert max_diff(pa, pb) <= 1e-12


def test_skip_mode_skips_an_adamw_group_with_a_non_finite_gradient(tiny_model, token_batches):
    for fused in (None, True):
        model = tiny_model()
        opt = StiefelAdam(param_groups(model, weight_decay=0.1), lr=3e-3, max_step=0.1, nonfinite="skip", fused=fused)
        ((x, y),) = token_batches(1)
        F.cross_entropy(model(x), y).backward()
        model.head.weight.grad[0, 0] = float("nan")  # in the decay group
        decay_group = [id(p) for p in opt.param_groups[0]["params"]]
        before = {id(p): p.detach().clone() for p in model.parameters()}
        opt.step()
        for p in model.parameters():
            moved = not torch.equal(p, before[id(p)])
            assert moved == (id(p) not in decay_group), (fused, p.shape)


def test_invalid_nonfinite_mode():
    with pytest.raises(ValueError, match="nonfinite"):
        StiefelAdam(make_params([(6, 3)]), nonfinite="ignore")


def test_step_under_torch_compile_matches_eager(tiny_model, token_batches):
    torch._dynamo.reset()
    try:
        data = token_batches(3)
        runs = []
        for compiled in (False, True):
            model = tiny_model()
            opt = StiefelAdam(
                param_groups(model, weight_decay=0.1, frame_lr=0.02), lr=3e-3, max_step=0.1, nonfinite="skip"
            )
            step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                step()
            runs.append(model)
        for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        for name, W in frames(runs[1]):
            assert float(isometry_error(W)) < 1e-5, name
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("adamw", [dict(fused=True), dict(foreach=True), dict(foreach=False)], ids=str)
def test_skip_mode_leaves_an_adamw_group_with_a_bad_gradient_untouched(adamw):
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    opt = StiefelAdam([{"params": ps, "stiefel": False}], lr=0.1, weight_decay=0.1, nonfinite="skip", **adamw)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    before = [p.detach().clone() for p in ps]
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    ps[0].grad, ps[1].grad = torch.randn(4, 3), torch.full((5,), float("nan"))
    opt.step()
    for p, b, m in zip(ps, before, moments):
        assert torch.equal(p, b)  # the whole group keeps its values, the finite gradient's parameter too
        assert torch.equal(opt.state[p]["exp_avg"], m["exp_avg"]) and torch.equal(
            opt.state[p]["exp_avg_sq"], m["exp_avg_sq"]
        )
        # non-fused, the count advances, as the frames' does; torch's fused kernel does not advance it
        assert float(opt.state[p]["step"]) == float(m["step"]) + (0 if adamw.get("fused") else 1)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(ps[0], before[0])


@pytest.mark.slow
def test_the_whole_skip_mode_step_compiles_and_equals_the_eager_step(tiny_model, token_batches):
    """torch.compile(opt.step, fullgraph=True) captures the whole step, frames and AdamW groups, as graphs with no
    host read: fullgraph refuses a graph break, which every .item()/bool() would be, and the captured graphs are
    checked for scalar reads too (a dispatch mode cannot watch a compiled call). Equal to the eager step.
    aot_eager keeps CI fast; benchmarks/gpu_check.py compiles with inductor on a GPU."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def inspect(gm, example_inputs):  # every aten graph the step compiles to
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        eager_model, compiled_model = tiny_model(), tiny_model()
        kw = dict(max_step=0.1, nonfinite="skip", foreach=True)
        eager = StiefelAdam(param_groups(eager_model, weight_decay=0.1, frame_lr=0.02), lr=3e-3, **kw)
        compiled = StiefelAdam(param_groups(compiled_model, weight_decay=0.1, frame_lr=0.02), lr=3e-3, **kw)
        step = torch.compile(compiled.step, fullgraph=True, backend=aot_autograd(fw_compiler=inspect))
        for x, y in token_batches(3):
            for model, opt_step in ((eager_model, eager.step), (compiled_model, step)):
                F.cross_entropy(model(x), y).backward()
                opt_step()
                model.zero_grad()
        for (name, a), b in zip(eager_model.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert graphs
        reads = [n for g in graphs for n in g.graph.nodes if "_local_scalar_dense" in str(n.target)]
        assert reads == [], reads
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("batched", [None, False])
def test_a_gradient_whose_squared_norm_overflows_is_refused_by_both_paths(batched):
    """Finite entries (1e200 in float64) whose squared norm is infinite would make the second moment infinite
    and freeze the frame for good: both paths refuse the step before writing, naming it non-finite."""
    params = make_params([(2, 6, 3)], seed=0)
    grads = grad_seq([(2, 6, 3)], 1, seed=1)
    grads[0][0][1, 0, 0] = 1e200
    opt = StiefelAdam(params, lr=0.05, max_step=0.1, batched=batched)
    before = params[0].detach().clone()
    with pytest.raises(NonFiniteGradientError):
        run(opt, params, grads)
    assert torch.equal(params[0], before)
    assert all(float(v.abs().max()) == 0.0 for v in opt.state[params[0]].values())  # nothing written
