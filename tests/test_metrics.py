"""stiefel_attention.metrics: every mechanism metric equals a direct computation on a small case."""

from __future__ import annotations

import math

import pytest
import torch

from stiefel_attention.metrics import METRICS, attention_metrics, bilinear_spectrum
from stiefel_attention.nn import StiefelAttention


def _direct(attn: StiefelAttention, x: torch.Tensor, queries=None) -> dict[str, list[float]]:
    """Per head, written out with dense matrices and softmax probabilities."""
    out = {k: [] for k in METRICS}
    N = x.shape[1]
    for h in range(attn.n_heads):
        scale = math.exp(float(attn.log_temperature[h])) if attn.temperature else 1.0
        q, k = x @ attn.w_q[h], x @ attn.w_k[h]
        if attn.qk_norm:
            q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.q_gain
            k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.k_gain
        s = scale * q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)  # (B, N, N)
        ents, fracs, top = [], [], -math.inf
        for i in range(N) if queries is None else range(N)[queries]:
            n_vis = i + 1 if attn.causal else N
            row = s[:, i, :n_vis]
            p = torch.softmax(row, -1)
            e = -(p * p.log()).sum(-1)  # (B,)
            ents.append(e)
            if n_vis >= 2:
                fracs.append(e / math.log(n_vis))
            top = max(top, float(row.max()))
        out["entropy"].append(float(torch.stack(ents).mean()))
        out["entropy_frac"].append(float(torch.stack(fracs).mean()))
        out["max_logit"].append(top)
        gq = attn.q_gain if attn.qk_norm else torch.ones(attn.head_dim, dtype=x.dtype)
        gk = attn.k_gain if attn.qk_norm else torch.ones(attn.head_dim, dtype=x.dtype)
        A = scale * attn.w_q[h] @ torch.diag(gq * gk) @ attn.w_k[h].T  # (D, D)
        sv = torch.linalg.svdvals(A)
        out["spectral_norm"].append(float(sv[0]))
        out["stable_rank"].append(float((sv**2).sum() / sv[0] ** 2))
        out["wq_fro"].append(float(attn.w_q[h].norm()))
        out["wk_fro"].append(float(attn.w_k[h].norm()))
    return out


@pytest.mark.parametrize(
    "options",
    [
        dict(qk="stiefel"),
        dict(qk="euclidean"),
        dict(qk="euclidean", qk_norm=True),
        dict(qk="stiefel", temperature=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("causal,queries", [(False, None), (True, None), (True, slice(-1, None))])
def test_attention_metrics_equal_a_direct_computation(options, causal, queries):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        StiefelAttention(8, 3, 4, causal=causal, **options), StiefelAttention(8, 3, 4, causal=causal, **options)
    ).double()
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith(("_gain", "log_temperature")):
                p.normal_()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    got = attention_metrics(layers, lambda: layers(x), queries=queries, digits=12)
    h = x
    with torch.no_grad():
        for i, layer in enumerate(layers):
            want = _direct(layer, h, queries)
            for name in METRICS:
                vals = want[name]
                expect = [sum(vals) / len(vals), min(vals), max(vals)]
                assert got[name][i] == pytest.approx(expect, rel=1e-9, abs=1e-10), (name, i)
            h = layer(h)


def test_frames_have_unit_spectrum_and_full_stable_rank():
    torch.manual_seed(1)
    attn = StiefelAttention(16, 2, 4)
    got = attention_metrics(attn, lambda: attn(torch.randn(2, 3, 16)))
    assert got["spectral_norm"] == [[1.0, 1.0, 1.0]] and got["stable_rank"] == [[4.0, 4.0, 4.0]]
    assert got["wq_fro"] == [[2.0, 2.0, 2.0]]


def test_bilinear_spectrum_of_a_rank_one_pair():
    q = torch.zeros(1, 6, 3, dtype=torch.float64)
    k = torch.zeros(1, 6, 3, dtype=torch.float64)
    q[0, 0, 0], k[0, 1, 0] = 2.0, 3.0
    sv = bilinear_spectrum(q, k)
    assert sv.shape == (1, 3) and float(sv[0, 0]) == pytest.approx(6.0) and float(sv[0, 1:].abs().max()) < 1e-12


def test_a_layer_the_forward_does_not_call_is_an_error():
    attn = StiefelAttention(8, 2, 4)
    with pytest.raises(RuntimeError, match="was not called"):
        attention_metrics(attn, lambda: None)


def test_entropy_fraction_is_none_where_no_selected_query_sees_two_keys():
    torch.manual_seed(0)
    attn = StiefelAttention(8, 2, 4, causal=True).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    first = attention_metrics(attn, lambda: attn(x), queries=slice(0, 1))  # the first query sees itself only
    assert first["entropy_frac"] == [[None, None, None]]
    assert first["entropy"] == [[0.0, 0.0, 0.0]]  # one visible key: no choice, zero entropy
    later = attention_metrics(attn, lambda: attn(x), queries=slice(0, 2))  # the second sees two
    assert all(v is not None and 0.0 < v <= 1.0 for v in later["entropy_frac"][0])
