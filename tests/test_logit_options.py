"""The attention-logit options of StiefelAttention (soft-cap, fixed scale, tracking) and qk_clip, each against a
computation written out by hand, head by head."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention import StiefelAdam, StiefelAttention, param_groups, qk_clip, reset_logit_stats


def _by_hand(attn: StiefelAttention, x: torch.Tensor, scale=1.0, cap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, N, D), scaled logits before cap and mask (B, H, N, N)), one head at a time."""
    B, N, _ = x.shape
    heads, raw = [], []
    v = attn.w_v(x).view(B, N, attn.n_heads, attn.head_dim)
    for h in range(attn.n_heads):
        s = scale * (x @ attn.w_q[h]) @ (x @ attn.w_k[h]).transpose(-2, -1) / math.sqrt(attn.head_dim)  # (B, N, N)
        raw.append(s)
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if attn.causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ v[:, :, h])  # (B, N, r)
    return attn.w_o(torch.cat(heads, dim=-1)), torch.stack(raw, dim=1)


@pytest.fixture
def x():
    return 3.0 * torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cap", [0.5, 2.0])
def test_softcap_matches_the_hand_computation(x, causal, cap):
    torch.manual_seed(0)
    attn = StiefelAttention(16, 2, 4, qk="euclidean", causal=causal, logit_softcap=cap).double()
    with torch.no_grad():
        want, raw = _by_hand(attn, x, cap=cap)
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)
        logits = attn.logits(x)
    visible = torch.isfinite(logits)
    assert float(raw.abs().max()) > cap  # the cap acts
    assert float(logits[visible].abs().max()) < cap
    torch.testing.assert_close(logits[visible], (cap * torch.tanh(raw / cap))[visible], rtol=0, atol=1e-12)
    assert bool(visible.all()) is not causal


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [0.0, 0.25, 4.0])
def test_a_fixed_logit_scale_matches_the_hand_computation(x, causal, scale):
    torch.manual_seed(1)
    attn = StiefelAttention(16, 2, 4, causal=causal, logit_scale=scale).double()
    with torch.no_grad():
        want, _ = _by_hand(attn, x, scale=scale)
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)
        last = attn.forward_last(x)
    torch.testing.assert_close(last, want[:, -1:], rtol=0, atol=1e-12)
    q, k = attn.bilinear_factors()  # the scale is folded into the bilinear form of the logits
    torch.testing.assert_close(q, scale * attn.w_q.detach(), rtol=0, atol=0)


def test_scale_zero_is_uniform_attention_over_the_keys_a_query_sees(x):
    attn = StiefelAttention(16, 2, 4, causal=True, logit_scale=0.0).double()
    with torch.no_grad():
        v = attn._values(x)  # (B, H, N, r)
        running_mean = v.cumsum(dim=2) / torch.arange(1, 7, dtype=x.dtype).view(1, 1, 6, 1)
        want = attn.w_o(running_mean.transpose(1, 2).reshape(2, 6, 8))
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)


def test_the_default_path_is_torchs_fused_kernel_bit_for_bit(x):
    torch.manual_seed(2)
    attn = StiefelAttention(16, 2, 4, causal=True).double()
    with torch.no_grad():
        q, k = attn._qk(x, x)
        y = F.scaled_dot_product_attention(q, k, attn._values(x), is_causal=True)
        want = attn.w_o(y.transpose(1, 2).reshape(2, 6, 8))
        assert torch.equal(attn(x), want)


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("causal", [False, True])
def test_tracked_logits_are_the_largest_and_smallest_visible_ones(x, cap, causal):
    torch.manual_seed(3)
    plain = StiefelAttention(16, 2, 4, qk="euclidean", causal=causal, logit_softcap=cap).double()
    tracked = StiefelAttention(16, 2, 4, qk="euclidean", causal=causal, logit_softcap=cap, track_logits=True).double()
    tracked.load_state_dict(plain.state_dict())
    assert tracked.logit_stats is None
    x2 = 0.5 * x.flip(0)
    with torch.no_grad():
        assert torch.equal(tracked(x), plain(x))  # tracking does not change the output
        tracked(x2)
        _, raw = _by_hand(plain, torch.cat([x, x2]))  # before the cap
    if causal:
        hidden = torch.ones(6, 6, dtype=torch.bool).triu(1)
        top, low = raw.masked_fill(hidden, -math.inf), raw.masked_fill(hidden, math.inf)
    else:
        top = low = raw
    torch.testing.assert_close(tracked.logit_stats["max"], top.amax(dim=(0, 2, 3)), rtol=0, atol=1e-12)
    torch.testing.assert_close(tracked.logit_stats["min"], low.amin(dim=(0, 2, 3)), rtol=0, atol=1e-12)
    reset_logit_stats(nn.Sequential(tracked))
    assert tracked.logit_stats is None
    with torch.no_grad():
        tracked.forward_last(x)  # the last query's logits only
    torch.testing.assert_close(tracked.logit_stats["max"], raw[:2, :, -1].amax(dim=(0, 2)), rtol=0, atol=1e-12)


def _clippable(layout: str = "heads", **kw) -> StiefelAttention:
    torch.manual_seed(4)
    attn = StiefelAttention(16, 3, 4, qk="euclidean", qk_layout=layout, track_logits=True, **kw).double()
    with torch.no_grad():  # heads 0 and 2 far above tau, head 1 below it
        for name in ("w_q", "w_k"):
            scale = torch.tensor([4.0, 0.05, 2.0], dtype=torch.float64).view(3, 1, 1)
            if layout == "linear":
                original = getattr(attn.parametrizations, name).original
                original.view(3, 4, 16).mul_(scale)
            else:
                getattr(attn, name).mul_(scale)
    return attn


@pytest.mark.parametrize("layout", ["heads", "linear"])
def test_qk_clip_brings_each_heads_largest_logit_down_to_tau_and_leaves_the_rest(x, layout):
    tau = 2.0
    attn = _clippable(layout)
    opt = StiefelAdam(param_groups(attn, weight_decay=0.1), lr=1e-3)
    attn(x).square().mean().backward()
    opt.step()
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
    attn.reset_logit_stats()  # the training forward saw the weights before the step; measure after it
    with torch.no_grad():
        attn(x)
    before = attn.logit_stats["max"].clone()
    w_q, w_k = attn.w_q.detach().clone(), attn.w_k.detach().clone()
    assert before[0] > tau and before[2] > tau and before[1] < tau
    assert qk_clip(attn, tau) == 2
    assert attn.logit_stats is None  # read and reset
    with torch.no_grad():
        attn(x)
    after = attn.logit_stats["max"]
    torch.testing.assert_close(after[[0, 2]], torch.full((2,), tau, dtype=after.dtype), rtol=1e-12, atol=0)
    assert after[1] == before[1]
    gamma = torch.sqrt(tau / before[[0, 2]]).view(2, 1, 1)
    torch.testing.assert_close(attn.w_q.detach()[[0, 2]], gamma * w_q[[0, 2]], rtol=1e-12, atol=0)
    torch.testing.assert_close(attn.w_k.detach()[[0, 2]], gamma * w_k[[0, 2]], rtol=1e-12, atol=0)
    assert torch.equal(attn.w_q.detach()[1], w_q[1])
    for g in opt.param_groups:  # the optimizer's state is left alone
        for p in g["params"]:
            assert all(torch.equal(v, state[id(p)][k]) for k, v in opt.state[p].items())
    assert qk_clip(attn, tau) == 0  # no forward since: nothing to read


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(qk="stiefel", track_logits=True), "orthonormal frames, which cannot be rescaled"),
        (dict(qk="frozen", track_logits=True), "orthonormal frames, which cannot be rescaled"),
        (dict(qk="parametrized", track_logits=True), "orthonormal frames, which cannot be rescaled"),
        (dict(qk="euclidean", qk_norm=True, track_logits=True), "qk_norm=True"),
        (dict(qk="euclidean"), "track_logits=True"),
    ],
)
def test_qk_clip_refuses_what_it_cannot_clip(options, match):
    model = nn.Sequential(StiefelAttention(16, 2, 4, **options))
    with pytest.raises(ValueError, match=match):
        qk_clip(model, 2.0)


def test_qk_clip_and_the_options_check_their_arguments():
    attn = _clippable()
    for tau in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tau must be a positive number"):
            qk_clip(attn, tau)
    with pytest.raises(ValueError, match="has no StiefelAttention"):
        qk_clip(nn.Linear(3, 3), 1.0)
    for cap in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="logit_softcap must be a positive number"):
            StiefelAttention(16, 2, 4, logit_softcap=cap)
    for scale in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="logit_scale must be a finite number >= 0"):
            StiefelAttention(16, 2, 4, logit_scale=scale)
    text = repr(StiefelAttention(16, 2, 4, logit_softcap=8.0, logit_scale=4.0, track_logits=True))
    assert "logit_softcap=8" in text and "logit_scale=4" in text and "track_logits=True" in text


def test_a_softcapped_model_trains_and_its_frames_stay_orthonormal():
    from stiefel_attention import frames, isometry_error

    torch.manual_seed(5)
    attn = StiefelAttention(16, 2, 4, causal=True, logit_softcap=2.0, logit_scale=4.0)
    opt = StiefelAdam(param_groups(attn, weight_decay=0.1, frame_lr=0.05), lr=1e-2, max_step=0.1)
    x = torch.randn(4, 6, 16)
    target = torch.randn(4, 6, 16)
    losses = []
    for _ in range(20):
        loss = (attn(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert max(float(isometry_error(p)) for _, p in frames(attn)) < 1e-5
