"""stiefelize(): contract tests for every supported attention type, against the real packages.

For each type: wiring is exact (stiefelize(init="nearest") of weights already orthonormal per head
leaves the outputs unchanged to round-off); training with StiefelAdam(param_groups(model)) keeps the
frames orthonormal, moves them, and takes the batched fast path; state_dict round trips; and
grouped-query attention gets one key frame per key-value head. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize, unstiefelize
from stiefel_attention import optim as optim_module
from stiefel_attention.convert import Adapter, Projection, StiefelizeError, register_adapter

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written here: fused c_attn, n_head, causal SDPA."""

    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def _lm_input():
    return {"input_ids": torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))}


def _dense_input(shape):
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _hf(cls, cfg_cls, **cfg):
    return lambda: cls(cfg_cls(**cfg))


T = transformers
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=50)
CASES = {
    # name: (factory, inputs, output selector, frames per converted weight: list of shapes)
    "gpt2": (
        _hf(
            T.GPT2LMHeadModel,
            T.GPT2Config,
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=50,
            n_positions=32,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        ),
        _lm_input,
        lambda o: o.logits,
        [(4, 32, 8)] * 4,
    ),
    "llama-gqa": (
        _hf(T.LlamaForCausalLM, T.LlamaConfig, num_key_value_heads=2, **SMALL),
        _lm_input,
        lambda o: o.logits,
        [(4, 32, 8), (2, 32, 8)] * 2,
    ),
    "qwen2-gqa": (
        _hf(T.Qwen2ForCausalLM, T.Qwen2Config, num_key_value_heads=2, **SMALL),
        _lm_input,
        lambda o: o.logits,
        [(4, 32, 8), (2, 32, 8)] * 2,
    ),
    "mistral": (
        _hf(T.MistralForCausalLM, T.MistralConfig, num_key_value_heads=2, **SMALL),
        _lm_input,
        lambda o: o.logits,
        [(4, 32, 8), (2, 32, 8)] * 2,
    ),
    "bert": (
        _hf(T.BertModel, T.BertConfig, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL),
        _lm_input,
        lambda o: o.last_hidden_state,
        [(4, 32, 8)] * 4,
    ),
    "vit": (
        _hf(
            T.ViTModel,
            T.ViTConfig,
            image_size=16,
            patch_size=4,
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=64,
        ),
        lambda: {"pixel_values": _dense_input((2, 3, 16, 16))()},
        lambda o: o.last_hidden_state,
        [(4, 32, 8)] * 4,
    ),
    "multihead-attention": (
        lambda: nn.MultiheadAttention(32, 4, batch_first=True),
        lambda: (lambda x: (x, x, x))(_dense_input((2, 7, 32))()),
        lambda o: o[0],
        [(4, 32, 8)] * 2,
    ),
    "transformer-encoder-layer": (
        lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        _dense_input((2, 7, 32)),
        lambda o: o,
        [(4, 32, 8)] * 2,
    ),
    "nanogpt": (
        lambda: nn.Sequential(CausalSelfAttention(), nn.LayerNorm(32), CausalSelfAttention()),
        _dense_input((2, 7, 32)),
        lambda o: o,
        [(4, 32, 8)] * 4,
    ),
}


def _run(model, inputs, select):
    if isinstance(inputs, dict):
        return select(model(**inputs))
    if isinstance(inputs, tuple):
        return select(model(*inputs))
    return select(model(inputs))


def _build(name):
    factory, make_inputs, select, shapes = CASES[name]
    torch.manual_seed(0)
    model = factory().double()
    stiefelize(model, init="orthonormal")
    unstiefelize(model)  # plain weights again, now orthonormal per head
    return model, make_inputs(), select, shapes


def _double(inputs):
    if isinstance(inputs, dict):
        return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(v.double() for v in inputs)
    return inputs.double()


@pytest.mark.parametrize("name", sorted(CASES))
def test_wiring_is_exact_on_orthonormal_heads(name):
    model, inputs, select, shapes = _build(name)
    inputs = _double(inputs)
    model.eval()
    with torch.no_grad():
        want = _run(model, inputs, select)
        stiefelize(model, init="nearest")
        got = _run(model, inputs, select)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert [tuple(p.shape) for _, p in frames(model)] == shapes
    assert all(r["relative_change"] < 1e-10 for r in model.stiefelize_report.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_keeps_frames_orthonormal_and_moves_them_on_the_fast_path(name, monkeypatch):
    factory, make_inputs, select, _ = CASES[name]
    torch.manual_seed(1)
    model = stiefelize(factory(), init="orthonormal").train()
    calls = {"batched": 0}
    real = optim_module._batched_stiefel_adam
    monkeypatch.setattr(
        optim_module,
        "_batched_stiefel_adam",
        lambda *a, **k: (calls.__setitem__("batched", calls["batched"] + 1), real(*a, **k))[1],
    )
    start = {n: p.detach().clone() for n, p in frames(model)}
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=1e-3, max_step=0.1)
    inputs = make_inputs()
    for _ in range(4):
        opt.zero_grad()
        _run(model, inputs, select).float().square().mean().backward()
        opt.step()
    assert calls["batched"] == 4
    for n, p in frames(model):
        assert float(isometry_error(p)) < 1e-5, n
        assert float((p.detach() - start[n]).abs().max()) > 1e-4, f"{n} did not move"
    # the rest of the model still trains as usual (not stepped twice, not left out)
    stepped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(stepped) == sorted(id(p) for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trip(name):
    factory, make_inputs, select, _ = CASES[name]
    torch.manual_seed(2)
    model = stiefelize(factory(), init="orthonormal").eval()
    sd = copy.deepcopy(model.state_dict())
    assert any("parametrizations." in k for k in sd)
    torch.manual_seed(3)
    other = stiefelize(factory(), init="orthonormal").eval()
    other.load_state_dict(sd)
    inputs = make_inputs()
    with torch.no_grad():
        torch.testing.assert_close(_run(other, inputs, select), _run(model, inputs, select), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_save_pretrained_round_trip_through_unstiefelize(name, tmp_path):
    factory, make_inputs, select, _ = CASES[name]
    torch.manual_seed(4)
    model = stiefelize(factory(), init="orthonormal").eval()
    baked = unstiefelize(copy.deepcopy(model))
    assert not frames(baked) and not any(".parametrizations." in k for k in baked.state_dict())
    baked.save_pretrained(tmp_path)
    loaded = stiefelize(type(model).from_pretrained(tmp_path), init="nearest").eval()
    inputs = make_inputs()
    with torch.no_grad():
        torch.testing.assert_close(_run(loaded, inputs, select), _run(model, inputs, select), rtol=0, atol=1e-5)
    for (na, a), (nb, b) in zip(frames(model), frames(loaded)):
        assert na == nb
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_nearest_init_reports_how_much_the_function_changed(caplog):
    torch.manual_seed(5)
    model = CASES["gpt2"][0]()
    with caplog.at_level("WARNING", logger="stiefel_attention"):
        stiefelize(model, init="nearest")
    report = model.stiefelize_report
    assert set(report) == {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"}
    assert all(r["relative_change"] > 1.0 for r in report.values())  # std-0.02 weights, unit-norm frames
    assert "function changes" in caplog.text


def test_biases_and_v_stay_euclidean_and_untouched():
    torch.manual_seed(6)
    model = CASES["gpt2"][0]()
    c_attn = model.transformer.h[0].attn.c_attn
    bias, v_block = c_attn.bias.detach().clone(), c_attn.weight.detach()[:, 64:].clone()
    stiefelize(model)
    assert torch.equal(c_attn.bias, bias) and torch.equal(c_attn.weight[:, 64:], v_block)
    names = [n for n, _ in frames(model)]
    assert "transformer.h.0.attn.c_attn.parametrizations.weight.original2" not in names  # V is not a frame


def test_compile_works_on_a_converted_model():
    torch._dynamo.reset()
    try:
        factory, make_inputs, select, _ = CASES["nanogpt"]
        torch.manual_seed(7)
        model = stiefelize(factory()).eval()
        x = make_inputs()
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_unsupported_model_names_what_is_supported_and_how_to_register():
    with pytest.raises(StiefelizeError) as info:
        stiefelize(nn.Sequential(nn.Linear(4, 4)))
    msg = str(info.value)
    assert "GPT-2" in msg and "MultiheadAttention" in msg and "register_adapter" in msg


def test_register_adapter_converts_a_new_attention_type():
    class MyAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)

    register_adapter(
        Adapter(
            "my attention",
            lambda m: isinstance(m, MyAttention),
            lambda m: [
                Projection(m.wq, "weight", True, (("q", 2),), 4),
                Projection(m.wk, "weight", True, (("k", 2),), 4),
            ],
        )
    )
    model = stiefelize(nn.Sequential(MyAttention()))
    assert [tuple(p.shape) for _, p in frames(model)] == [(2, 16, 4), (2, 16, 4)]
    w = model[0].wq.weight.detach()  # rows h*r .. (h+1)*r - 1 are the columns of head h's frame
    for h in range(2):
        block = w[4 * h : 4 * (h + 1)]
        torch.testing.assert_close(block @ block.T, torch.eye(4), rtol=0, atol=1e-5)


def test_bad_init_and_converting_twice():
    with pytest.raises(ValueError, match="init must be one of"):
        stiefelize(CausalSelfAttention(), init="random")
    model = stiefelize(CausalSelfAttention())
    with pytest.raises(StiefelizeError, match="already parametrized"):
        stiefelize(model)


def test_timm_attention_if_timm_is_installed():
    timm = pytest.importorskip(
        "timm", reason="timm needs torchvision, whose index wheels need a CUDA torch; not installed here"
    )
    from timm.models.vision_transformer import Attention

    torch.manual_seed(8)
    attn = Attention(32, num_heads=4, qkv_bias=True).double().eval()
    stiefelize(attn)
    unstiefelize(attn)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        got = stiefelize(attn, init="nearest")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert timm and len(frames(attn)) == 2 and math.isfinite(float(got.sum()))
