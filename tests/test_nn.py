"""Tests for stiefel_attention.nn: StiefelAttention, PatchViT, ModularTransformer, frames()."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention.manifold import isometry_error, random_frame
from stiefel_attention.nn import (
    QK_MODES,
    Block,
    ModularTransformer,
    PatchViT,
    StiefelAttention,
    frames,
    qk_matrices,
)
from stiefel_attention.optim import ARMS, MixedOptimizer, StiefelAdam, StiefelSGD, arm_spec, build_optimizer

QK_NAMES = ("w_q", "w_k")
# Arms whose W_Q, W_K start from the orthonormal frames (all but the 'adamw' baseline).
ORTHO_ARMS = ("stiefel-adam", "stiefel-sgd", "frozen", "adamw-orthoinit", "no-projector", "coordinate-moment")


def _is_qk(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in QK_NAMES


def _tiny_vit(**kw) -> PatchViT:
    cfg = dict(image_size=16, patch_size=4, d_model=16, depth=2, n_heads=2, head_dim=4)
    cfg.update(kw)
    return PatchViT(**cfg)


def _tiny_mt(**kw) -> ModularTransformer:
    cfg = dict(p=7, d_model=16, n_heads=2, head_dim=4, d_mlp=32, n_layers=2)
    cfg.update(kw)
    return ModularTransformer(**cfg)


def _build_arm(factory, arm: str, seed: int):
    spec = arm_spec(arm)
    torch.manual_seed(seed)
    model = factory(qk=spec.qk, qk_init=spec.qk_init)
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
        v = x @ Wv[h * r:(h + 1) * r].T + bv[h * r:(h + 1) * r]  # (B, N, r)
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
        for name in QK_NAMES:
            g = getattr(attn, name).grad
            if qk == "frozen":
                assert g is None
            else:
                assert g is not None and g.shape == (2, 16, 4) and g.abs().max() > 0
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
            if not _is_qk(name) or arm != "adamw":
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
    assert set(ORTHO_ARMS) | {"adamw"} == set(ARMS)

    ref_model, ref_rng = built["stiefel-adam"]
    ref_params = dict(ref_model.named_parameters())
    n_qk = sum(_is_qk(n) for n in ref_params)
    assert n_qk == 2 * len(ref_model.blocks)

    for arm, (model, rng) in built.items():
        params = dict(model.named_parameters())
        assert list(params) == list(ref_params), arm  # same names, same order
        # The global RNG stream is in the same place after construction in every arm.
        assert torch.equal(rng, ref_rng), f"RNG state after construction differs for arm {arm!r}"
        for name, p in params.items():
            if not _is_qk(name):
                assert torch.equal(p, ref_params[name]), f"{arm}: {name} differs from the stiefel-adam arm"
        # Buffers too (none expected, but pairing must cover them).
        for (bn, b), (_, rb) in zip(model.named_buffers(), ref_model.named_buffers()):
            assert torch.equal(b, rb), f"{arm}: buffer {bn}"

    for arm in ORTHO_ARMS:
        params = dict(built[arm][0].named_parameters())
        for name, p in params.items():
            if _is_qk(name):
                assert torch.equal(p, ref_params[name]), f"{arm}: {name} is not the stiefel-adam frame"
                assert float(isometry_error(p)) < 1e-5

    adamw = dict(built["adamw"][0].named_parameters())
    for name, p in adamw.items():
        if _is_qk(name):
            assert not torch.equal(p, ref_params[name]), f"adamw: {name} equals the orthonormal frame"
            d = p.shape[-2]
            assert p.abs().max() <= 1.0 / math.sqrt(d)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_pairing_continues_after_construction(arm):
    """What a training script draws after building the model (data order, dropout) is the same."""
    spec = arm_spec(arm)
    torch.manual_seed(42)
    _tiny_vit(qk=spec.qk, qk_init=spec.qk_init)
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
@pytest.mark.parametrize("qk,qk_init", [("stiefel", None), ("frozen", None), ("euclidean", None), ("euclidean", "orthonormal")])
def test_frames_and_qk_matrices(model_kind, qk, qk_init):
    torch.manual_seed(0)
    model = _tiny_vit(depth=3, qk=qk, qk_init=qk_init) if model_kind == "vit" else _tiny_mt(n_layers=3, qk=qk, qk_init=qk_init)
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
    model = nn.ModuleDict({
        "a": StiefelAttention(16, 2, 4, qk="stiefel"),
        "b": StiefelAttention(16, 2, 4, qk="frozen"),
        "c": StiefelAttention(16, 2, 4, qk="euclidean"),
    })
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
    model = PatchViT(image_size=16, patch_size=8, in_channels=1, num_classes=3, d_model=16, depth=1, n_heads=1, head_dim=16)
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
    model = ModularTransformer(p, d_model=16, n_heads=2, head_dim=8, d_mlp=32, n_layers=n_layers, layernorm=layernorm, qk=qk)
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
    model = _tiny_vit(depth=1, qk=spec.qk, qk_init=spec.qk_init)
    opt = build_optimizer(model, arm, lr=1e-3, weight_decay=0.1, frame_lr=1e-2)
    assert isinstance(opt, MixedOptimizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = dict(model.named_parameters())
    for name, p in after.items():
        moved = not torch.equal(p, before[name])
        if _is_qk(name) and spec.qk == "frozen":
            assert not moved, f"{arm}: frozen {name} moved"
        elif _is_qk(name) and spec.qk == "stiefel":
            assert moved, f"{arm}: frame {name} was not stepped"
            assert float(isometry_error(p)) < 1e-5
        else:
            assert moved, f"{arm}: {name} was not stepped"
    if spec.qk == "stiefel":
        frame_opt = opt.optimizers["frames"]
        assert isinstance(frame_opt, StiefelAdam if spec.frame_rule == "adam" else StiefelSGD)
        assert {id(p) for g_ in frame_opt.param_groups for p in g_["params"]} == {id(p) for _, p in frames(model)}
    else:
        assert "frames" not in opt.optimizers


def test_build_optimizer_rejects_model_of_other_mode():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="needs a model built with qk='stiefel'"):
        build_optimizer(_tiny_vit(qk="euclidean"), "stiefel-adam", lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="needs a model built with qk='euclidean'"):
        build_optimizer(_tiny_vit(), "adamw", lr=1e-3, weight_decay=0.0)


def test_training_overfits_a_fixed_batch_and_keeps_frames_orthonormal():
    torch.manual_seed(0)
    model = PatchViT(d_model=32, depth=1, n_heads=2, head_dim=8)
    opt = build_optimizer(model, "stiefel-adam", lr=3e-3, weight_decay=0.0, frame_lr=3e-2)
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
    opt = build_optimizer(model, "stiefel-adam", lr=3e-3, weight_decay=0.01, frame_lr=3e-2)
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
