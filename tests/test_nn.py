"""Tests for stiefel_attention.nn: StiefelAttention, PatchViT, ModularTransformer, frames()."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention.bench.arms import ARMS, HyperParameters, arm_spec, attention_options, build_optimizers
from stiefel_attention.bench.kong import KongStiefelAdam
from stiefel_attention.bench.models import ModularTransformer, PatchViT
from stiefel_attention.manifold import isometry_error, random_frame
from stiefel_attention.nn import QK_MODES, Block, StiefelAttention, frames, qk_matrices, qk_parameters
from stiefel_attention.optim import LandingStiefelAdam, StiefelAdam, StiefelMuon, StiefelSGD

QK_NAMES = ("w_q", "w_k")
# Arms whose W_Q, W_K start from the orthonormal frames; the rest start from nn.Linear's init.
ORTHO_ARMS = (
    "stiefel-adam",
    "stiefel-sgd",
    "frozen",
    "adamw-orthoinit",
    "no-projector",
    "coordinate-moment",
    "orthogonal-param",
    "stiefel-adam-temp",
    "stiefel-adam-bounded",
    "stiefel-adam-bounded-temp",
    "kong-stiefel-adam",
    "stiefel-muon",
    "landing-stiefel-adam",
    "stiefel-muon-bounded",
    "stiefel-sgd-bounded",
)
STANDARD_ARMS = (
    "adamw",
    "adamw-qk-nodecay",
    "qk-norm",
    "muon",
    "adamw-bounded",
    "sgd",
    "sgd-nodecay",
    "qk-norm-muon",
    "qk-norm-sgd",
)
# Parameters an arm may add to or re-parametrise on the query-key path
ROUTING = ("w_q", "w_k", "original", "q_gain", "k_gain", "log_temperature")


def _is_qk(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ROUTING


def _tiny_vit(**kw) -> PatchViT:
    cfg = dict(image_size=16, patch_size=4, d_model=16, depth=2, n_heads=2, head_dim=4)
    cfg.update(kw)
    return PatchViT(**cfg)


def _tiny_mt(**kw) -> ModularTransformer:
    cfg = dict(p=7, d_model=16, n_heads=2, head_dim=4, d_mlp=32, n_layers=2)
    cfg.update(kw)
    return ModularTransformer(**cfg)


def _build_arm(factory, arm: str, seed: int):
    torch.manual_seed(seed)
    model = factory(**attention_options(arm))
    return model, torch.get_rng_state()


# ---------------------------------------------------------------------------------------------
# StiefelAttention: shapes and the reference computation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model,n_heads,head_dim", [(8, 1, 8), (16, 2, 4), (12, 3, 5), (8, 4, 8), (32, 4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_shapes(d_model, n_heads, head_dim, causal):
    torch.manual_seed(0)
    attn = StiefelAttention(d_model, n_heads, head_dim, causal=causal)
    for name in QK_NAMES:
        assert getattr(attn, name).shape == (n_heads, d_model, head_dim)
    assert attn.w_v.weight.shape == (n_heads * head_dim, d_model)
    assert attn.w_o.weight.shape == (d_model, n_heads * head_dim)
    for B, N in [(1, 1), (3, 5), (2, 17)]:
        y = attn(torch.randn(B, N, d_model))
        assert y.shape == (B, N, d_model)
        assert y.dtype == torch.float32
        assert torch.isfinite(y).all()


def _reference_attention(attn: StiefelAttention, x: torch.Tensor) -> torch.Tensor:
    """Per-head softmax(q k^T / sqrt(r)) v, written out, from the module's own weights."""
    B, N, D = x.shape
    H, r = attn.n_heads, attn.head_dim
    Wv, Wo = attn.w_v.weight, attn.w_o.weight  # (H*r, D), (D, H*r)
    bv = attn.w_v.bias if attn.w_v.bias is not None else torch.zeros(H * r, dtype=x.dtype)
    bo = attn.w_o.bias if attn.w_o.bias is not None else torch.zeros(D, dtype=x.dtype)
    heads = []
    for h in range(H):
        q = x @ attn.w_q[h]  # (B, N, r)
        k = x @ attn.w_k[h]  # (B, N, r)
        v = x @ Wv[h * r : (h + 1) * r].T + bv[h * r : (h + 1) * r]  # (B, N, r)
        scores = q @ k.transpose(-2, -1) / math.sqrt(r)  # (B, N, N)
        if attn.causal:
            future = torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    y = torch.cat(heads, dim=-1)  # (B, N, H*r), head-major like the module's reshape
    return y @ Wo.T + bo


@pytest.mark.parametrize("qk", QK_MODES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("d_model,n_heads,head_dim", [(16, 2, 4), (12, 3, 5), (8, 1, 8)])
def test_attention_matches_explicit_reference(qk, causal, bias, d_model, n_heads, head_dim):
    torch.manual_seed(1)
    attn = StiefelAttention(d_model, n_heads, head_dim, qk=qk, causal=causal, bias=bias).double()
    if bias:  # nn.Linear biases start small; make them matter
        with torch.no_grad():
            attn.w_v.bias.normal_()
            attn.w_o.bias.normal_()
    x = torch.randn(3, 7, d_model, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x)
        want = _reference_attention(attn, x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_attention_matches_reference_after_weights_change():
    """The reference uses whatever the parameters hold (no cached projections)."""
    torch.manual_seed(2)
    attn = StiefelAttention(16, 4, 4, causal=True).double()
    with torch.no_grad():
        attn.w_q.copy_(random_frame(4, d=16, r=4, dtype=torch.float64))
        attn.w_k.mul_(3.0)  # off the manifold: the module does not care, the attention follows
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _reference_attention(attn, x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_causal_mask_blocks_the_future(causal):
    torch.manual_seed(3)
    attn = StiefelAttention(16, 2, 8, causal=causal).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 4:] += torch.randn(2, 2, 16, dtype=torch.float64)  # change only the last two tokens
    with torch.no_grad():
        y, y2 = attn(x), attn(x2)
    if causal:
        torch.testing.assert_close(y[:, :4], y2[:, :4], rtol=0, atol=1e-12)
    else:
        assert (y[:, :4] - y2[:, :4]).abs().max() > 1e-6
    assert (y[:, 4:] - y2[:, 4:]).abs().max() > 1e-6


def test_attention_gradients_reach_qk_in_trainable_modes():
    torch.manual_seed(4)
    x = torch.randn(2, 5, 16)
    for qk in QK_MODES:
        attn = StiefelAttention(16, 2, 4, qk=qk)
        attn(x).square().sum().backward()
        for name, p in attn.qk_parameters():
            if qk == "frozen":
                assert p.grad is None
            else:
                assert p.grad is not None and p.grad.shape == p.shape and p.grad.abs().max() > 0, (qk, name)
        assert attn.w_v.weight.grad is not None and attn.w_o.weight.grad is not None


# ---------------------------------------------------------------------------------------------
# Modes and initialisations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk", ["stiefel", "frozen"])
def test_stiefel_and_frozen_start_orthonormal(qk):
    torch.manual_seed(5)
    attn = StiefelAttention(32, 4, 8, qk=qk)
    assert attn.qk_init == "orthonormal"
    for name in QK_NAMES:
        W = getattr(attn, name)
        assert W.dtype == torch.float32
        assert float(isometry_error(W)) < 1e-5
        assert W.requires_grad == (qk == "stiefel")
        assert W.is_contiguous()
    # The two frames are different draws.
    assert not torch.equal(attn.w_q, attn.w_k)
    # W_V, W_O are trainable in every mode.
    assert all(p.requires_grad for p in attn.w_v.parameters())
    assert all(p.requires_grad for p in attn.w_o.parameters())


def test_frozen_parameters_do_not_require_grad_and_are_listed():
    torch.manual_seed(6)
    attn = StiefelAttention(16, 2, 4, qk="frozen")
    names = {n for n, p in attn.named_parameters() if not p.requires_grad}
    assert names == {"w_q", "w_k"}
    # still Parameters (saved in state_dict, moved by .to())
    assert isinstance(attn.w_q, nn.Parameter) and "w_q" in attn.state_dict()


def test_euclidean_default_init_is_linear_style_uniform():
    torch.manual_seed(7)
    d, H, r = 64, 8, 16
    attn = StiefelAttention(d, H, r, qk="euclidean")
    assert attn.qk_init == "standard"
    bound = 1.0 / math.sqrt(d)
    w = torch.cat([attn.w_q.detach().flatten(), attn.w_k.detach().flatten()]).double()
    assert w.numel() == 2 * H * d * r
    assert w.abs().max() <= bound
    assert w.abs().max() > 0.99 * bound  # fills the interval
    assert abs(float(w.mean())) < 0.05 * bound
    var = float(w.var())
    assert var == pytest.approx(1.0 / (3 * d), rel=0.05)
    # ...and is therefore not orthonormal (columns have norm ~ sqrt(r/(3d)) * ... != 1)
    assert float(isometry_error(attn.w_q)) > 0.1
    assert attn.w_q.requires_grad and attn.w_k.requires_grad


def test_euclidean_default_init_matches_nn_linear_distribution():
    """Same law as nn.Linear(d, H*r).weight: compare bounds and variance with a real Linear."""
    torch.manual_seed(8)
    d, H, r = 48, 4, 12
    attn = StiefelAttention(d, H, r, qk="euclidean")
    lin = nn.Linear(d, 2 * H * r * 4)
    ref = lin.weight.detach().double()
    w = torch.cat([attn.w_q.detach().flatten(), attn.w_k.detach().flatten()]).double()
    assert w.abs().max() <= ref.abs().max() * 1.01 + 1e-12
    assert float(w.var()) == pytest.approx(float(ref.var()), rel=0.1)


def test_euclidean_orthonormal_init_gives_stiefel_frames():
    torch.manual_seed(9)
    eu = StiefelAttention(24, 3, 8, qk="euclidean", qk_init="orthonormal")
    torch.manual_seed(9)
    st = StiefelAttention(24, 3, 8, qk="stiefel")
    for name in QK_NAMES:
        W = getattr(eu, name)
        assert W.requires_grad
        assert float(isometry_error(W)) < 1e-5
        assert torch.equal(W, getattr(st, name))
    assert eu.qk == "euclidean" and eu.qk_init == "orthonormal"


def test_initialisation_order_is_frames_then_uniform():
    """Documented draw order: random_frame(2, H, d, r), then the (2, H, d, r) uniform, then W_V, W_O."""
    d, H, r = 16, 2, 4
    torch.manual_seed(10)
    ortho = random_frame(2, H, d=d, r=r)
    standard = torch.empty(2, H, d, r).uniform_(-1 / math.sqrt(d), 1 / math.sqrt(d))
    for qk, qk_init, want in [
        ("stiefel", None, ortho),
        ("frozen", None, ortho),
        ("euclidean", "orthonormal", ortho),
        ("euclidean", None, standard),
        ("euclidean", "standard", standard),
    ]:
        torch.manual_seed(10)
        attn = StiefelAttention(d, H, r, qk=qk, qk_init=qk_init)
        assert torch.equal(attn.w_q, want[0]), (qk, qk_init)
        assert torch.equal(attn.w_k, want[1]), (qk, qk_init)


def test_invalid_configurations_raise_clear_errors():
    with pytest.raises(ValueError, match=r"qk='stiefel' needs orthonormal frames"):
        StiefelAttention(16, 2, 4, qk="stiefel", qk_init="standard")
    with pytest.raises(ValueError, match=r"qk='frozen' needs orthonormal frames"):
        StiefelAttention(16, 2, 4, qk="frozen", qk_init="standard")
    with pytest.raises(ValueError, match=r"qk must be one of .*'stiefel'.*'euclidean'.*'frozen'.*got 'riemannian'"):
        StiefelAttention(16, 2, 4, qk="riemannian")
    with pytest.raises(ValueError, match=r"qk_init must be one of .*got 'xavier'"):
        StiefelAttention(16, 2, 4, qk="euclidean", qk_init="xavier")
    with pytest.raises(ValueError, match=r"head_dim=17 > d_model=16"):
        StiefelAttention(16, 2, 17)
    with pytest.raises(ValueError, match=r"head_dim=9 > d_model=8"):
        StiefelAttention(8, 1, 9, qk="euclidean")  # the frame constraint holds in every mode
    # The limit case head_dim == d_model is fine (square orthogonal frames).
    StiefelAttention(8, 2, 8)
    # The models forward the checks.
    with pytest.raises(ValueError, match="needs orthonormal frames"):
        _tiny_vit(qk="stiefel", qk_init="standard")
    with pytest.raises(ValueError, match="head_dim"):
        _tiny_mt(head_dim=32)


def test_invalid_configuration_draws_nothing():
    """A rejected configuration fails before touching the global RNG."""
    torch.manual_seed(11)
    state = torch.get_rng_state()
    for kwargs in [dict(qk="stiefel", qk_init="standard"), dict(qk="bogus"), dict(head_dim=99)]:
        cfg = dict(d_model=16, n_heads=2, head_dim=4)
        cfg.update(kwargs)
        with pytest.raises(ValueError):
            StiefelAttention(**cfg)
    assert torch.equal(torch.get_rng_state(), state)


def test_non_contiguous_input():
    torch.manual_seed(12)
    attn = StiefelAttention(16, 2, 4, causal=True)
    for x in (torch.randn(5, 3, 16).transpose(0, 1), torch.randn(3, 5, 32)[..., ::2]):
        assert not x.is_contiguous()
        with torch.no_grad():
            torch.testing.assert_close(attn(x), attn(x.contiguous()), rtol=0, atol=1e-6)


def test_pairing_and_orthonormality_under_float64_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        built = {arm: _build_arm(lambda **kw: _tiny_vit(depth=1, **kw), arm, 5) for arm in ARMS}
    finally:
        torch.set_default_dtype(old)
    ref = dict(built["stiefel-adam"][0].named_parameters())
    for arm, (model, rng) in built.items():
        assert torch.equal(rng, built["stiefel-adam"][1])
        for name, p in model.named_parameters():
            assert p.dtype == torch.float64
            if not _is_qk(name) or arm in ("stiefel-sgd", "frozen", "adamw-orthoinit"):
                assert torch.equal(p, ref[name]), (arm, name)
    for _, W in frames(built["stiefel-adam"][0]):
        assert float(isometry_error(W)) < 1e-12


def test_extra_repr_names_the_mode():
    text = repr(StiefelAttention(16, 2, 4, qk="euclidean", causal=True))
    for part in ("d_model=16", "n_heads=2", "head_dim=4", "qk=euclidean", "qk_init=standard", "causal=True"):
        assert part in text


# ---------------------------------------------------------------------------------------------
# Pairing across arms
# ---------------------------------------------------------------------------------------------


PAIRING_FACTORIES = {
    "vit": lambda **kw: _tiny_vit(**kw),
    "vit-default": lambda **kw: PatchViT(d_model=32, depth=1, n_heads=2, head_dim=8, **kw),
    "mt-1layer": lambda **kw: _tiny_mt(n_layers=1, **kw),
    "mt-2layer-ln": lambda **kw: _tiny_mt(n_layers=2, layernorm=True, **kw),
}


@pytest.mark.parametrize("factory_name", sorted(PAIRING_FACTORIES))
@pytest.mark.parametrize("seed", [0, 123])
def test_pairing_across_arms(factory_name, seed):
    factory = PAIRING_FACTORIES[factory_name]
    built = {arm: _build_arm(factory, arm, seed) for arm in ARMS}
    assert set(ORTHO_ARMS) | set(STANDARD_ARMS) == set(ARMS)

    ref_model, ref_rng = built["stiefel-adam"]
    ref_params = dict(ref_model.named_parameters())
    n_qk = sum(_is_qk(n) for n in ref_params)
    assert n_qk == 2 * len(ref_model.blocks)

    for arm, (model, rng) in built.items():
        params = {n: p for n, p in model.named_parameters() if not _is_qk(n)}
        assert list(params) == [n for n in ref_params if not _is_qk(n)], arm  # same names, same order
        # The global RNG stream is in the same place after construction in every arm.
        assert torch.equal(rng, ref_rng), f"RNG state after construction differs for arm {arm!r}"
        for name, p in params.items():
            assert torch.equal(p, ref_params[name]), f"{arm}: {name} differs from the stiefel-adam arm"
        # The arm-specific parameters start neutral: gains at 1, log-temperatures at 0.
        for name, p in model.named_parameters():
            if name.endswith("_gain"):
                assert torch.equal(p, torch.ones_like(p)), (arm, name)
            if name.endswith("log_temperature"):
                assert torch.equal(p, torch.zeros_like(p)), (arm, name)

    ref_qk = qk_matrices(ref_model)
    for arm in ORTHO_ARMS:
        for (name, W), (_, W_ref) in zip(qk_matrices(built[arm][0]), ref_qk):
            # exactly the stiefel-adam frame; through torch's orthogonal parametrization, to round-off
            tol = 1e-6 if arm == "orthogonal-param" else 0.0
            torch.testing.assert_close(W, W_ref, rtol=0, atol=tol, msg=lambda m, a=arm, n=name: f"{a} {n}: {m}")
            assert float(isometry_error(W)) < 1e-5

    adamw_qk = qk_matrices(built["adamw"][0])
    for arm in STANDARD_ARMS:
        for (name, W), (_, W_ref), (_, W_adamw) in zip(qk_matrices(built[arm][0]), ref_qk, adamw_qk):
            assert not torch.equal(W, W_ref), f"{arm}: {name} equals the orthonormal frame"
            assert torch.equal(W, W_adamw), f"{arm}: {name} is not the adamw arm's init"
            assert W.abs().max() <= 1.0 / math.sqrt(W.shape[-2])


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_pairing_continues_after_construction(arm):
    """What a training script draws after building the model (data order, dropout) is the same."""
    torch.manual_seed(42)
    _tiny_vit(**attention_options(arm))
    after = torch.randn(5)
    torch.manual_seed(42)
    _tiny_vit()
    assert torch.equal(after, torch.randn(5))


@pytest.mark.parametrize("factory_name", sorted(PAIRING_FACTORIES))
def test_different_seeds_give_different_models(factory_name):
    factory = PAIRING_FACTORIES[factory_name]
    a, rng_a = _build_arm(factory, "stiefel-adam", 0)
    b, rng_b = _build_arm(factory, "stiefel-adam", 1)
    assert not torch.equal(rng_a, rng_b)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    randomly_initialised = [n for n, p in pa.items() if p.numel() > 1 and float(p.detach().std()) > 0]
    assert any(_is_qk(n) for n in randomly_initialised)
    for name in randomly_initialised:
        assert not torch.equal(pa[name], pb[name]), name
    # Same seed, same model.
    c, _ = _build_arm(factory, "stiefel-adam", 0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


# ---------------------------------------------------------------------------------------------
# frames() and qk_matrices()
# ---------------------------------------------------------------------------------------------


def _expected_qk_names(prefix: str, n_blocks: int) -> list[str]:
    return [f"{prefix}blocks.{i}.attn.{w}" for i in range(n_blocks) for w in QK_NAMES]


@pytest.mark.parametrize("model_kind", ["vit", "mt"])
@pytest.mark.parametrize(
    "qk,qk_init", [("stiefel", None), ("frozen", None), ("euclidean", None), ("euclidean", "orthonormal")]
)
def test_frames_and_qk_matrices(model_kind, qk, qk_init):
    torch.manual_seed(0)
    model = (
        _tiny_vit(depth=3, qk=qk, qk_init=qk_init)
        if model_kind == "vit"
        else _tiny_mt(n_layers=3, qk=qk, qk_init=qk_init)
    )
    names = _expected_qk_names("", 3)
    params = dict(model.named_parameters())

    qkm = qk_matrices(model)
    assert [n for n, _ in qkm] == names
    assert all(p is params[n] for n, p in qkm)

    got = frames(model)
    got_frozen = frames(model, include_frozen=True)
    if qk == "stiefel":
        assert [n for n, _ in got] == names
        assert [n for n, _ in got_frozen] == names
        assert all(p is params[n] and p.requires_grad for n, p in got)
    elif qk == "frozen":
        assert got == []
        assert [n for n, _ in got_frozen] == names
        assert all(p is params[n] and not p.requires_grad for n, p in got_frozen)
    else:
        assert got == [] and got_frozen == []
    for _, p in got_frozen:
        assert isinstance(p, nn.Parameter) and p.shape == (2, 16, 4)


def test_frames_naming_for_bare_and_nested_modules():
    torch.manual_seed(0)
    attn = StiefelAttention(16, 2, 4)
    assert [n for n, _ in frames(attn)] == ["w_q", "w_k"]
    assert [n for n, _ in qk_matrices(attn)] == ["w_q", "w_k"]
    wrapped = nn.Sequential(nn.Identity(), _tiny_vit(depth=1))
    assert [n for n, _ in frames(wrapped)] == _expected_qk_names("1.", 1)
    # The dotted names resolve to the same objects through get_parameter / named_parameters.
    for n, p in frames(wrapped):
        assert wrapped.get_parameter(n) is p
    assert frames(nn.Linear(3, 3)) == [] and qk_matrices(nn.Linear(3, 3)) == []


def test_frames_in_a_mixed_model():
    """Modes are per module: frames() picks exactly the Stiefel ones."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "a": StiefelAttention(16, 2, 4, qk="stiefel"),
            "b": StiefelAttention(16, 2, 4, qk="frozen"),
            "c": StiefelAttention(16, 2, 4, qk="euclidean"),
        }
    )
    assert [n for n, _ in frames(model)] == ["a.w_q", "a.w_k"]
    assert [n for n, _ in frames(model, include_frozen=True)] == ["a.w_q", "a.w_k", "b.w_q", "b.w_k"]
    assert [n for n, _ in qk_matrices(model)] == ["a.w_q", "a.w_k", "b.w_q", "b.w_k", "c.w_q", "c.w_k"]


# ---------------------------------------------------------------------------------------------
# PatchViT and ModularTransformer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk", QK_MODES)
def test_patchvit_logits_shape(qk):
    torch.manual_seed(0)
    model = PatchViT(d_model=32, depth=2, n_heads=2, head_dim=8, qk=qk)
    for B in (1, 4):
        out = model(torch.randn(B, 3, 32, 32))
        assert out.shape == (B, 10) and torch.isfinite(out).all()
    assert model.pos.shape == (1, 64, 32)
    assert len(model.blocks) == 2
    assert all(not blk.attn.causal for blk in model.blocks)


def test_patchvit_other_geometries():
    torch.manual_seed(0)
    model = PatchViT(
        image_size=16, patch_size=8, in_channels=1, num_classes=3, d_model=16, depth=1, n_heads=1, head_dim=16
    )
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 3)
    assert model.pos.shape == (1, 4, 16)


@pytest.mark.parametrize("image_size,patch_size", [(30, 4), (32, 5), (7, 2)])
def test_patchvit_rejects_indivisible_patches(image_size, patch_size):
    with pytest.raises(ValueError, match=rf"image_size={image_size} is not divisible by patch_size={patch_size}"):
        PatchViT(image_size=image_size, patch_size=patch_size)


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("layernorm", [False, True])
@pytest.mark.parametrize("qk", QK_MODES)
def test_modular_transformer(n_layers, layernorm, qk):
    p = 11
    torch.manual_seed(0)
    model = ModularTransformer(
        p, d_model=16, n_heads=2, head_dim=8, d_mlp=32, n_layers=n_layers, layernorm=layernorm, qk=qk
    )
    tokens = torch.stack([torch.randint(0, p, (6,)), torch.randint(0, p, (6,)), torch.full((6,), p)], dim=1)
    assert tokens.dtype == torch.int64 and tokens.shape == (6, 3)
    out = model(tokens)
    assert out.shape == (6, p) and torch.isfinite(out).all()
    assert len(model.blocks) == n_layers
    assert model.embed.num_embeddings == p + 1
    for blk in model.blocks:
        assert blk.attn.causal
        assert isinstance(blk.ln1, nn.LayerNorm if layernorm else nn.Identity)
        assert isinstance(blk.mlp[1], nn.GELU if layernorm else nn.ReLU)
    assert isinstance(model.norm, nn.LayerNorm if layernorm else nn.Identity)
    # No biases anywhere except LayerNorm's.
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert layernorm and ("ln" in name or name.startswith("norm")), name
    # The readout at "=" sees both operands (causal attention, last position).
    t2 = tokens.clone()
    t2[:, 0] = (t2[:, 0] + 1) % p
    with torch.no_grad():
        assert (model(t2) - model(tokens)).abs().max() > 1e-6


def test_modular_transformer_last_position_only():
    """Logits depend only on the '=' position's residual stream (causal: nothing leaks back)."""
    torch.manual_seed(0)
    model = _tiny_mt(n_layers=2).double()
    tokens = torch.tensor([[1, 2, 7], [3, 4, 7]])
    with torch.no_grad():
        x = model.embed(tokens) + model.pos
        for blk in model.blocks:
            x = blk(x)
        want = model.unembed(model.norm(x[:, -1]))
        torch.testing.assert_close(model(tokens), want, rtol=0, atol=1e-12)


def test_block_residual_structure():
    torch.manual_seed(0)
    blk = Block(16, 2, 4, 32, qk="stiefel", qk_init=None, layernorm=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        h = x + blk.attn(blk.ln1(x))
        torch.testing.assert_close(blk(x), h + blk.mlp(blk.ln2(h)), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Models with the optimizers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_arm_trains_its_model(arm):
    spec = arm_spec(arm)
    torch.manual_seed(0)
    model = _tiny_vit(depth=1, **attention_options(arm))
    opts = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=1e-2, max_step=0.1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    qk_before = [W.detach().clone() for _, W in qk_matrices(model)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == p.requires_grad, f"{arm}: {name} moved={moved}, requires_grad={p.requires_grad}"
    for (name, W), W0 in zip(qk_matrices(model), qk_before):
        assert torch.equal(W, W0) == (spec.qk == "frozen"), f"{arm}: {name}"
        if spec.qk != "euclidean":  # frames, frozen frames, and frames by parametrization stay orthonormal
            # (the landing rule within its bound 2 max_step^2, spectral, so sqrt(r) times that in Frobenius)
            tol = math.sqrt(W.shape[-1]) * 2 * 0.1**2 if arm == "landing-stiefel-adam" else 1e-5
            assert float(isometry_error(W)) < tol, f"{arm}: {name}"
    # every trainable parameter is stepped by exactly one optimizer
    stepped = [id(p) for o in opts for g_ in o.param_groups for p in g_["params"]]
    assert sorted(stepped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    frame_groups = [(o, g_) for o in opts for g_ in o.param_groups if _steps_frames(o, g_)]
    assert {id(p) for _, g_ in frame_groups for p in g_["params"]} == {id(p) for _, p in frames(model)}
    if spec.qk == "stiefel":
        expected = {
            "stiefel-sgd": StiefelSGD,
            "stiefel-sgd-bounded": StiefelSGD,
            "kong-stiefel-adam": KongStiefelAdam,
            "stiefel-muon": StiefelMuon,
            "stiefel-muon-bounded": StiefelMuon,
            "landing-stiefel-adam": LandingStiefelAdam,
        }.get(arm, StiefelAdam)
        assert frame_groups and all(isinstance(o, expected) for o, _ in frame_groups)


def _steps_frames(opt, group) -> bool:
    """Whether opt's rule keeps the frames of this group on the manifold (the guard's question)."""
    rule = getattr(opt, "keeps_frames_on_manifold", False)
    return bool(rule(group)) if callable(rule) else bool(rule)


def test_muon_arm_steps_qk_with_torchs_muon_on_linear_shaped_matrices():
    torch.manual_seed(0)
    model = _tiny_vit(depth=1, **attention_options("muon"))
    hp = HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=2e-3)
    rest, muon = build_optimizers(model, "muon", hp)
    assert type(muon) is torch.optim.Muon and isinstance(rest, StiefelAdam)
    qk = [p for _, p in qk_parameters(model)]
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in qk]
    attn = model.blocks[0].attn
    assert all(p.shape == (attn.n_heads * attn.head_dim, attn.d_model) for p in qk)  # nn.Linear's layout
    g = muon.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["adjust_lr_fn"]) == (2e-3, 0.1, "match_rms_adamw")
    assert not any(id(p) in {id(q) for q in qk} for g_ in rest.param_groups for p in g_["params"])


@pytest.mark.parametrize(
    "arm,decayed", [("adamw", True), ("adamw-qk-nodecay", False), ("qk-norm", True), ("orthogonal-param", False)]
)
def test_which_arms_decay_qk(arm, decayed):
    torch.manual_seed(0)
    model = _tiny_vit(depth=1, **attention_options(arm))
    (opt,) = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=5e-3))
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    for _, p in qk_parameters(model):
        assert (decay[id(p)] == 0.1) == decayed
        assert lr[id(p)] == (5e-3 if arm_spec(arm).swept == "frame_lr" else 1e-3)
    assert decay[id(model.head.weight)] == 0.1 and decay[id(model.head.bias)] == 0.0
    assert arm_spec(arm).decays_qk == decayed


def test_build_optimizers_rejects_model_of_other_mode_and_unknown_arms():
    torch.manual_seed(0)
    hp = HyperParameters(lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="needs a model built with qk='stiefel'"):
        build_optimizers(_tiny_vit(qk="euclidean"), "stiefel-adam", hp)
    with pytest.raises(ValueError, match="needs a model built with qk='euclidean'"):
        build_optimizers(_tiny_vit(), "adamw", hp)
    with pytest.raises(ValueError) as info:
        build_optimizers(_tiny_vit(), "stiefel-adamw", hp)
    assert "'stiefel-adamw'" in str(info.value) and all(name in str(info.value) for name in ARMS)


def test_training_overfits_a_fixed_batch_and_keeps_frames_orthonormal():
    torch.manual_seed(0)
    model = PatchViT(d_model=32, depth=1, n_heads=2, head_dim=8)
    (opt,) = build_optimizers(model, "stiefel-adam", HyperParameters(lr=3e-3, weight_decay=0.0, frame_lr=3e-2))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    start = [p.detach().clone() for _, p in frames(model)]
    losses = []
    for _ in range(60):
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
    assert all(math.isfinite(v) for v in losses)
    assert final < 0.5 * losses[0], (losses[0], final)
    for (name, W), W0 in zip(frames(model), start):
        assert float(isometry_error(W)) < 1e-5, name
        assert (W - W0).abs().max() > 1e-3, f"{name} barely moved"


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


def _compile_run(compiled: bool, steps: int = 3):
    torch.manual_seed(0)
    model = PatchViT(image_size=16, patch_size=4, d_model=16, depth=1, n_heads=2, head_dim=8)
    (opt,) = build_optimizers(model, "stiefel-adam", HyperParameters(lr=3e-3, weight_decay=0.01, frame_lr=3e-2))
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    losses, eager_gaps = [], []
    for _ in range(steps):
        out = fwd(x)
        if compiled:
            with torch.no_grad():
                eager_gaps.append(float((out - model(x)).abs().max()))
        loss = F.cross_entropy(out, y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, fwd, losses, eager_gaps, x


def test_torch_compile_aot_eager_matches_eager_training():
    torch._dynamo.reset()
    try:
        ref_model, _, ref_losses, _, _ = _compile_run(compiled=False)
        model, compiled, losses, gaps, x = _compile_run(compiled=True)
        # Compiled and eager forward agree at every step (the frames were updated in place between).
        assert len(gaps) == 3 and max(gaps) < 1e-5, gaps
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
        for name, W in frames(model):
            assert float(isometry_error(W)) < 1e-5, name
        # The compiled module's parameters are the original module's.
        assert [n for n, _ in frames(compiled)] == ["_orig_mod." + n for n, _ in frames(model)]
        assert all(p is q for (_, p), (_, q) in zip(frames(compiled), frames(model)))
        # Same trajectory as an uncompiled run from the same seed.
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        ref_params = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(model.blocks[0].attn.w_q, _compile_run(False, steps=0)[0].blocks[0].attn.w_q)
    finally:
        torch._dynamo.reset()


def test_torch_compile_fullgraph_no_graph_breaks():
    """The forward of both models traces as one graph (no data-dependent Python in nn.py)."""
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        mt = _tiny_mt(n_layers=1)
        tokens = torch.tensor([[1, 2, 7], [3, 4, 7], [0, 6, 7]])
        compiled = torch.compile(mt, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(tokens), mt(tokens), rtol=0, atol=1e-5)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Query-key options: qk_norm, temperature, parametrized frames, the nn.Linear layout
# ---------------------------------------------------------------------------------------------


def _hand_logits(attn: StiefelAttention, x: torch.Tensor, h: int) -> torch.Tensor:
    """Head h's logits written out: RMSNorm with gains, then exp(t_h) and 1/sqrt(r)."""
    q, k = x @ attn.w_q[h], x @ attn.w_k[h]  # (B, N, r)
    if attn.qk_norm:
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.q_gain
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.k_gain
    scale = math.exp(float(attn.log_temperature[h].detach())) if attn.temperature else 1.0
    return scale * (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_dim)


@pytest.mark.parametrize(
    "options",
    [dict(qk="euclidean", qk_norm=True), dict(temperature=True), dict(qk="euclidean", qk_norm=True, temperature=True)],
    ids=str,
)
def test_qk_norm_and_temperature_equal_a_hand_computation(options):
    torch.manual_seed(13)
    attn = StiefelAttention(8, 2, 4, causal=True, **options).double()
    with torch.no_grad():  # move the neutral initial gains and temperatures
        for name in ("q_gain", "k_gain", "log_temperature"):
            if hasattr(attn, name):
                getattr(attn, name).normal_()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    logits = attn.logits(x)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    Wv, Wo = attn.w_v.weight, attn.w_o.weight
    heads = []
    for h in range(2):
        want = _hand_logits(attn, x, h).masked_fill(mask, float("-inf"))
        torch.testing.assert_close(logits[:, h], want, rtol=0, atol=1e-12)
        v = x @ Wv[4 * h : 4 * (h + 1)].T + attn.w_v.bias[4 * h : 4 * (h + 1)]
        heads.append(torch.softmax(want, dim=-1) @ v)
    with torch.no_grad():
        out = torch.cat(heads, dim=-1) @ Wo.T + attn.w_o.bias
        torch.testing.assert_close(attn(x), out, rtol=0, atol=1e-12)
        torch.testing.assert_close(attn.forward_last(x), attn(x)[:, -1:], rtol=0, atol=1e-12)
    # gains 1 and temperature 0 (the initial values) are neutral for the temperature
    fresh = StiefelAttention(8, 2, 4, temperature=True).double()
    plain = StiefelAttention(8, 2, 4).double()
    plain.load_state_dict({k: v for k, v in fresh.state_dict().items() if k != "log_temperature"})
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain(x), rtol=0, atol=1e-12)


def test_parametrized_frames_stay_orthonormal_under_adamw():
    torch.manual_seed(14)
    attn = StiefelAttention(32, 4, 8, qk="parametrized")
    start = attn.w_q.detach().clone()
    opt = torch.optim.AdamW(attn.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(4, 6, 32)
    for _ in range(50):
        opt.zero_grad()
        attn(x).square().mean().backward()
        opt.step()
    for name in QK_NAMES:
        assert float(isometry_error(getattr(attn, name))) < 1e-5, name
    assert (attn.w_q - start).abs().max() > 1e-2  # it moved
    assert [n for n, _ in attn.qk_parameters()] == ["parametrizations.w_q.original", "parametrizations.w_k.original"]
    assert frames(attn) == []  # not a Stiefel frame: a Euclidean optimizer steps it


def test_parametrization_leaves_the_global_rng_where_other_modes_do():
    torch.manual_seed(15)
    StiefelAttention(16, 2, 4, qk="parametrized")
    after = torch.randn(3)
    torch.manual_seed(15)
    StiefelAttention(16, 2, 4)
    assert torch.equal(after, torch.randn(3))


def test_linear_layout_computes_the_same_attention():
    torch.manual_seed(16)
    heads = StiefelAttention(16, 2, 4, qk="euclidean")
    torch.manual_seed(16)
    linear = StiefelAttention(16, 2, 4, qk="euclidean", qk_layout="linear")
    assert torch.equal(linear.w_q, heads.w_q) and torch.equal(linear.w_k, heads.w_k)
    (name, flat), _ = linear.qk_parameters()
    assert name == "parametrizations.w_q.original" and flat.shape == (8, 16)
    # row h*r + j of the nn.Linear-shaped matrix is column j of head h
    torch.testing.assert_close(flat[4 * 1 + 2], heads.w_q[1, :, 2], rtol=0, atol=0)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), heads(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="qk_layout='linear' is for Euclidean"):
        StiefelAttention(16, 2, 4, qk="stiefel", qk_layout="linear")
    with pytest.raises(ValueError, match="qk_layout must be one of"):
        StiefelAttention(16, 2, 4, qk="euclidean", qk_layout="fused")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_in_half_precision_and_under_autocast(dtype):
    torch.manual_seed(0)
    attn = StiefelAttention(32, 4, 8, causal=True)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        want = attn(x)
        with torch.autocast("cpu", dtype=dtype):
            got = attn(x)
    assert got.dtype == dtype and float((got.float() - want).abs().max()) < 0.05
    half = StiefelAttention(32, 4, 8, causal=True)
    half.load_state_dict(attn.state_dict())
    half = half.to(dtype)
    with torch.no_grad():
        out = half(x.to(dtype))
    assert out.dtype == dtype and float((out.float() - want).abs().max()) < 0.05
    with pytest.raises(ValueError, match="float32 or float64"):  # frames stay float32 master weights
        StiefelAdam([half.w_q], lr=0.1)


def test_routing_and_frame_parameters_name_what_each_option_adds():
    from stiefel_attention.nn import routing_parameters

    plain = StiefelAttention(16, 2, 4)
    assert [n for n, _ in plain.frame_parameters()] == ["w_q", "w_k"]
    assert [n for n, _ in plain.routing_parameters()] == ["w_q", "w_k"]
    full = StiefelAttention(16, 2, 4, qk="euclidean", qk_norm=True, temperature=True)
    assert [n for n, _ in full.routing_parameters()] == ["w_q", "w_k", "q_gain", "k_gain", "log_temperature"]
    assert full.routing_parameters()[2][1] is full.q_gain
    param = StiefelAttention(16, 2, 4, qk="parametrized")
    names = [n for n, _ in param.routing_parameters()]
    assert names == ["parametrizations.w_q.original", "parametrizations.w_k.original"]
    assert [tuple(p.shape) for _, p in param.frame_parameters()] == [(2, 16, 4)] * 2  # W_Q, W_K, not originals
    model = nn.Sequential(plain, nn.Linear(16, 16), full)
    assert [n for n, _ in routing_parameters(model)] == [
        "0.w_q", "0.w_k", "2.w_q", "2.w_k", "2.q_gain", "2.k_gain", "2.log_temperature",
    ]  # fmt: skip
