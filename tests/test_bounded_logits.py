"""qk_input_norm and max_temperature: attention logits bounded by construction (frames reading a gain-free
RMS-normalised input), held to the bound over shapes, scales, gains and dtypes, to a hand computation, to
gradcheck, and in the arms built on them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention import StiefelAttention, frames, qk_parameters
from stiefel_attention.bench.arms import (
    BOUNDED_ARMS,
    BOUNDED_MAX_TEMPERATURE,
    HyperParameters,
    arm_spec,
    attention_options,
    build_optimizers,
)
from stiefel_attention.bench.models import CharGPT


def _adversarial_input(attn: StiefelAttention, B: int, N: int, scale: float, g: torch.Generator) -> torch.Tensor:
    """Inputs in the span of head 0's query frame (half the tokens) and key frame (the other half), scaled up: the
    directions along which W_Q W_K^T is largest, as a LayerNorm with grown gains would feed them.

    W_Q W_K^T has every nonzero singular value 1 ((W_Q W_K^T)(W_Q W_K^T)^T = W_Q W_Q^T), reached by x_i = W_Q a,
    x_j = W_K a for any unit a: here a = e_1."""
    x_q = attn.w_q.detach()[0, :, 0].double()  # (D,)
    x_k = attn.w_k.detach()[0, :, 0].double()  # (D,)
    noise = torch.randn(B, N, attn.d_model, generator=g, dtype=torch.float64) * 1e-3
    x = noise.clone()
    x[:, : N // 2] += x_q
    x[:, N // 2 :] += x_k
    return (scale * x).to(attn.w_v.weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("qk", ["stiefel", "frozen", "parametrized"])
@pytest.mark.parametrize("shape", [(16, 2, 4), (64, 4, 16), (24, 3, 24)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e6])
def test_every_logit_stays_within_the_bound_for_any_input_scale(dtype, qk, shape, scale):
    D, H, r = shape
    torch.manual_seed(0)
    attn = StiefelAttention(D, H, r, qk=qk, qk_input_norm=True).to(dtype)
    assert attn.logit_bound() == pytest.approx(D / math.sqrt(r))
    g = torch.Generator().manual_seed(1)
    gains = torch.exp(3 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)  # a LayerNorm's free gains
    x = _adversarial_input(attn, 2, 8, scale, g) * gains
    with torch.no_grad():
        logits = attn.logits(x)
    slack = 1e-12 if dtype == torch.float64 else 1e-5
    assert float(logits.abs().max()) <= attn.logit_bound() * (1 + slack)


def test_the_bound_is_nearly_reached_and_is_lost_without_the_norm_or_the_frames():
    torch.manual_seed(2)
    D, H, r = 32, 2, 8
    bounded = StiefelAttention(D, H, r, qk_input_norm=True).double()
    g = torch.Generator().manual_seed(3)
    # a token aligned with the top query/key directions: the bound is tight up to the part of x outside the frames
    x = torch.stack([bounded.w_q.detach()[0, :, 0], bounded.w_k.detach()[0, :, 0]]).unsqueeze(0) * math.sqrt(D)
    with torch.no_grad():
        assert float(bounded.logits(x).abs().max()) > 0.99 * bounded.logit_bound()
    # the same frames without the norm: a large input goes far past the bound
    plain = StiefelAttention(D, H, r).double()
    plain.load_state_dict(bounded.state_dict())
    big = _adversarial_input(plain, 1, 4, 1e6, g)
    with torch.no_grad():
        assert float(plain.logits(big).abs().max()) > 1e6 * bounded.logit_bound()
    assert plain.logit_bound() is None
    # the norm on Euclidean W_Q, W_K (the control): no bound, and weights scaled up exceed it
    euclid = StiefelAttention(D, H, r, qk="euclidean", qk_init="orthonormal", qk_input_norm=True).double()
    euclid.load_state_dict(bounded.state_dict())
    assert euclid.logit_bound() is None
    with torch.no_grad():
        euclid.w_q.mul_(100.0)
        assert float(euclid.logits(x).abs().max()) > 10 * bounded.logit_bound()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("temperature", [None, 3.0])
def test_the_input_norm_matches_a_hand_computation(causal, temperature):
    torch.manual_seed(4)
    options = dict(temperature=True, max_temperature=temperature) if temperature else {}
    attn = StiefelAttention(8, 2, 4, causal=causal, qk_input_norm=True, logit_scale=1.5, **options).double()
    if temperature:
        with torch.no_grad():
            attn.log_temperature.copy_(torch.tensor([0.7, -2.0]))
    x = 5.0 * torch.randn(3, 5, 8, dtype=torch.float64)
    x_hat = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)  # no gain
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    Wv, Wo = attn.w_v.weight, attn.w_o.weight
    heads = []
    for h in range(2):
        t = 1.0
        if temperature:
            c, th = temperature, float(attn.log_temperature[h].detach())
            t = c / (1.0 + math.exp(-(th - math.log(c - 1.0))))
        s = 1.5 * t * (x_hat @ attn.w_q[h]) @ (x_hat @ attn.w_k[h]).mT / 2.0  # sqrt(head_dim) = 2
        if causal:
            s = s.masked_fill(mask, float("-inf"))
        with torch.no_grad():
            torch.testing.assert_close(attn.logits(x)[:, h], s, rtol=0, atol=1e-12)
        v = x @ Wv[4 * h : 4 * (h + 1)].T + attn.w_v.bias[4 * h : 4 * (h + 1)]  # the values read x as it is
        heads.append(torch.softmax(s, dim=-1) @ v)
    with torch.no_grad():
        want = torch.cat(heads, dim=-1) @ Wo.T + attn.w_o.bias
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(attn.forward_last(x), want[:, -1:], rtol=0, atol=1e-12)


def test_gradients_through_the_input_norm_and_the_capped_temperature_pass_gradcheck():
    torch.manual_seed(5)
    attn = StiefelAttention(6, 2, 3, causal=True, qk_input_norm=True, temperature=True, max_temperature=2.5).double()
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, t: _with_temperature(attn, t)(x), (x, attn.log_temperature.detach()))


def _with_temperature(attn: StiefelAttention, t: torch.Tensor):
    def forward(x):
        saved = attn.log_temperature
        del attn.log_temperature
        attn.log_temperature = t  # a plain tensor in place of the parameter, so gradcheck can vary it
        try:
            return attn(x)
        finally:
            del attn.log_temperature
            attn.log_temperature = saved

    return forward


def test_the_capped_temperature_never_exceeds_its_cap_under_a_gradient_that_pushes_it():
    torch.manual_seed(6)
    c = 3.0
    attn = StiefelAttention(16, 2, 4, qk_input_norm=True, temperature=True, max_temperature=c)
    torch.testing.assert_close(attn.temperatures().detach(), torch.ones(2))  # 1 at the start, as exp(0)
    opt = torch.optim.Adam([attn.log_temperature], lr=0.5)
    x = torch.randn(2, 8, 16)
    seen = []
    for _ in range(300):
        loss = -attn.logits(x).amax(dim=(0, 2, 3)).sum()  # push every head's largest logit up
        opt.zero_grad()
        loss.backward()
        assert float(attn.log_temperature.grad.abs().min()) > 0  # the cap never stops the gradient
        opt.step()
        seen.append(float(attn.temperatures().detach().max()))
    assert max(seen) < c and seen[-1] > 0.99 * c  # pushed right up to the cap, never past it
    assert float(attn.logits(x).abs().max()) <= attn.logit_bound() * (1 + 1e-6)
    assert attn.logit_bound() == pytest.approx(c * 16 / 2)
    # d log T / dt = 1 - T / c: as exp(t) far below the cap, saturating at it
    for t0 in (-6.0, 0.0, 2.0):
        t = torch.tensor(t0, requires_grad=True)
        with torch.no_grad():
            attn.log_temperature.fill_(t0)
        T = float(attn.temperatures()[0].detach())
        slope = torch.autograd.grad(torch.log(c * torch.sigmoid(t - math.log(c - 1.0))), t)[0]
        assert float(slope) == pytest.approx(1 - T / c, rel=1e-6)
        attn.log_temperature.grad = None
        torch.log(attn.temperatures()[0]).backward()
        assert float(attn.log_temperature.grad[0]) == pytest.approx(1 - T / c, rel=1e-6)


def test_what_bounds_the_logits_with_each_option():
    cases = [
        (dict(), None),
        (dict(qk_input_norm=True), 64 / 4),
        (dict(qk_input_norm=True, logit_scale=0.5), 0.5 * 64 / 4),
        (dict(qk_input_norm=True, temperature=True), None),  # an uncapped temperature
        (dict(qk_input_norm=True, temperature=True, max_temperature=4.0), 4 * 64 / 4),
        (dict(qk_input_norm=True, qk="euclidean"), None),
        (dict(qk_input_norm=True, qk="euclidean", qk_norm=True), None),  # the gains are free
        (dict(qk_input_norm=True, qk="parametrized"), 64 / 4),
    ]
    for options, bound in cases:
        attn = StiefelAttention(64, 4, 16, **options)
        assert attn.logit_bound() == (None if bound is None else pytest.approx(bound)), options


def test_bad_temperature_caps_are_refused():
    with pytest.raises(ValueError, match="pass temperature=True"):
        StiefelAttention(8, 2, 4, max_temperature=2.0)
    for bad in (1.0, 0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_temperature must be a finite number > 1"):
            StiefelAttention(8, 2, 4, temperature=True, max_temperature=bad)


def test_extra_repr_names_the_bound_options():
    text = repr(StiefelAttention(8, 2, 4, qk_input_norm=True, temperature=True, max_temperature=2.0))
    assert "qk_input_norm=True" in text and "max_temperature=2" in text


@pytest.mark.parametrize("arm", BOUNDED_ARMS)
def test_the_bounded_arms_wiring(arm):
    spec = arm_spec(arm)
    torch.manual_seed(7)
    model = CharGPT(20, 16, d_model=32, n_layers=2, n_heads=2, head_dim=8, mlp_ratio=2, **attention_options(arm))
    attns = [m for m in model.modules() if isinstance(m, StiefelAttention)]
    assert all(m.qk_input_norm for m in attns)
    hp = HyperParameters(lr=1e-3, weight_decay=0.1, frame_lr=2e-2, max_step=0.1)
    (opt,) = build_optimizers(model, arm, hp)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    qk = [p for _, p in qk_parameters(model)]
    if spec.qk == "stiefel":  # frames: the Stiefel group, at frame_lr, bound d/sqrt(r) times the temperature's cap
        assert {id(p) for p in qk} == {id(p) for _, p in frames(model)}
        assert all(by_param[id(p)]["stiefel"] and by_param[id(p)]["lr"] == 2e-2 for p in qk)
        cap = BOUNDED_MAX_TEMPERATURE if "temperature" in spec.attention else 1.0
        assert all(m.logit_bound() == pytest.approx(cap * 32 / math.sqrt(8)) for m in attns)
    else:  # the control: ordinary W_Q, W_K under AdamW with decay, no bound
        assert frames(model) == []
        assert all(not by_param[id(p)].get("stiefel") and by_param[id(p)]["weight_decay"] == 0.1 for p in qk)
        assert all(m.logit_bound() is None for m in attns)
        assert spec.decays_qk
    if "temperature" in spec.attention:  # the log-temperatures: AdamW, never decayed
        for m in attns:
            g = by_param[id(m.log_temperature)]
            assert not g.get("stiefel") and g["weight_decay"] == 0.0
    # one step moves every trainable parameter and leaves the frames orthonormal
    x = torch.randint(0, 20, (3, 16))
    loss = F.cross_entropy(model(x).reshape(-1, 20), x.roll(-1, 1).reshape(-1))
    loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_a_large_learning_rate_cannot_push_the_bounded_frames_logits_past_the_bound():
    """The reason for the option: a learning rate that makes the plain frames' logits explode (the attention input
    grows into their span) leaves the bounded frames' logits within d/sqrt(r), with the LayerNorm gains free."""
    torch.manual_seed(8)
    arm = "stiefel-adam-bounded"
    model = CharGPT(20, 16, d_model=32, n_layers=1, n_heads=2, head_dim=8, mlp_ratio=2, **attention_options(arm))
    (opt,) = build_optimizers(model, arm, HyperParameters(lr=1.0, weight_decay=0.0, frame_lr=1.0, max_step=1.0))
    x = torch.randint(0, 20, (8, 16))
    attn = next(m for m in model.modules() if isinstance(m, StiefelAttention))
    inputs = {}
    attn.register_forward_pre_hook(lambda mod, args: inputs.__setitem__("x", args[0]))
    for _ in range(30):
        loss = -model(x).abs().mean()  # grow everything
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model(x)
        assert float(inputs["x"].norm(dim=-1).max()) > 10 * math.sqrt(32)  # the attention input grew
        logits = attn.logits(inputs["x"])
        visible = logits[torch.isfinite(logits)]  # the causal mask's -inf aside
        assert float(visible.abs().max()) <= attn.logit_bound() * (1 + 1e-5)


def test_the_norm_has_no_gain_to_train():
    attn = StiefelAttention(8, 2, 4, qk_input_norm=True)
    assert {n for n, _ in attn.named_parameters()} == {"w_q", "w_k", "w_v.weight", "w_v.bias", "w_o.weight",
                                                       "w_o.bias"}  # fmt: skip
    assert isinstance(attn, nn.Module)
