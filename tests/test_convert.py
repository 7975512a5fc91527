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
from stiefel_attention import convert as convert_module
from stiefel_attention import optim as optim_module
from stiefel_attention.convert import Adapter, Projection, StiefelizeError, register_adapter

try:
    import transformers
except ImportError:  # the torch and nanoGPT/timm-style cases below need no transformers
    transformers = None
else:
    transformers.logging.set_verbosity_error()
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written here: fused c_attn, n_head, causal attention. It keeps the logits of its
    last call (before the mask and the 1/sqrt(head_dim) scale), as its own code computes them, for the tests."""

    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        self.last_logits = (q @ k.transpose(-2, -1)).detach()  # (B, H, T, T)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class TimmStyleAttention(nn.Module):
    """A stand-in with the structure of timm's vision_transformer.Attention (timm cannot be installed beside the
    CPU torch here): fused nn.Linear `qkv` of width 3 * dim read as (3, heads, head_dim), `num_heads`, `scale`,
    optional per-head `q_norm`/`k_norm`. Written from that structure, not from timm's code."""

    def __init__(self, dim: int = 32, num_heads: int = 4, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, r) each
        q, k = self.q_norm(q), self.k_norm(k)
        self.last_logits = (q @ k.transpose(-2, -1)).detach()
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


def _lm_input():
    return {"input_ids": torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))}


def _dense_input(shape):
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _hf(cls, cfg_cls, **cfg):
    return lambda: cls(cfg_cls(**cfg))


T = transformers
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=50)
# name: (factory, inputs, output selector, frames per converted weight: list of shapes)
CASES = {
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
    "timm-style": (
        lambda: nn.Sequential(TimmStyleAttention(), TimmStyleAttention(qk_norm=True)),
        _dense_input((2, 5, 32)),
        lambda o: o,
        [(4, 32, 8)] * 4,
    ),
}
HF_CASES = (
    {}
    if transformers is None
    else {
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
        "llama-mqa": (
            _hf(T.LlamaForCausalLM, T.LlamaConfig, num_key_value_heads=1, **SMALL),
            _lm_input,
            lambda o: o.logits,
            [(4, 32, 8), (1, 32, 8)] * 2,
        ),
    }
)
CASES.update(HF_CASES)
ALL = [pytest.param(n, marks=needs_transformers) if n in HF_CASES else n for n in sorted(CASES)]


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


@pytest.mark.parametrize("name", ALL)
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


# --- frames are the model's own heads ---------------------------------------------------------------
# Each head's attention logits, computed by the model's own code before conversion, must equal the logits built
# from that head's frames after conversion (init="nearest" on weights already orthonormal per head). The weights
# are made orthonormal per head without knowing the head layout: every d_model output units of a projection are
# orthonormal, so any set of a head's units is. A consistent but wrong head layout (forward and right_inverse
# agreeing with each other) passes round trips and function checks; it fails this one.


def _orthonormal_chunks(weight: torch.Tensor, rows: bool, d_model: int) -> None:
    out_major = weight if rows else weight.T  # (out, in) view
    for start in range(0, out_major.shape[0], d_model):
        block = out_major[start : start + d_model]
        q, _ = torch.linalg.qr(torch.randn(d_model, block.shape[0], dtype=weight.dtype))  # (D, b), orthonormal
        block.copy_(q.T)


_CAPTURE = "stiefel-attention-test-capture"


def _probe(model, modules, inputs) -> dict:
    """Per attention module: (its input x, what its own code computed per head, how to compare).

    transformers: q and k as the model hands them to its attention function (after rotary embeddings, which
    rotate q_i and k_i at one position alike, so the diagonal q_i . k_i is what frames must reproduce);
    nn.MultiheadAttention: its per-head attention probabilities; the stand-ins: their recorded logits."""
    seen, hooks = {}, []
    hf = [m for m in modules if hasattr(m, "config")]
    if hf:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        def capture(module, query, key, value, attention_mask, **kwargs):
            n_rep = query.shape[1] // key.shape[1]  # grouped-query attention: key head h // n_rep, as repeat_kv
            logits = query @ key.repeat_interleave(n_rep, dim=1).transpose(-2, -1)
            x, rope = seen[module]
            seen[module] = (x, logits.diagonal(dim1=-2, dim2=-1) if rope else logits, "diag" if rope else "logits")
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(_CAPTURE, capture)
        model.set_attn_implementation(_CAPTURE)
        for m in hf:
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, args, kw: seen.__setitem__(
                        mod, ((kw.get("hidden_states", args[0] if args else None)), "position_embeddings" in kw)
                    ),
                    with_kwargs=True,
                )
            )
    for m in modules:
        if isinstance(m, nn.MultiheadAttention):
            x = torch.randn(2, 6, m.embed_dim, dtype=torch.float64)
            _, probs = m(x, x, x, need_weights=True, average_attn_weights=False)
            seen[m] = (x, probs, "probs")
        elif not hasattr(m, "config"):
            hooks.append(m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0])))
    if hf or any(not isinstance(m, nn.MultiheadAttention) for m in modules):
        _run(model, _double(inputs), lambda o: o)
    for h in hooks:
        h.remove()
    for m in modules:
        if not hasattr(m, "config") and not isinstance(m, nn.MultiheadAttention):
            seen[m] = (seen[m], m.last_logits, "logits")
    return seen


def _frames_of(projections) -> tuple[torch.Tensor, torch.Tensor]:
    """(query frames (H, D, r), key frames (H_kv, D, r)) of one converted module."""
    got = {}
    for p in projections:
        plist = getattr(p.owner.parametrizations, p.name)
        if hasattr(plist, "original"):
            originals = [plist.original]
        else:
            originals = [getattr(plist, f"original{i}") for i in range(len(p.pieces))]
        for (kind, _), tensor in zip(p.pieces, originals):
            got[kind] = tensor.detach()
    return got["q"], got["k"]


def _logits_from_frames(module, x, frames_q, frames_k, qk_input_norm: bool = False) -> torch.Tensor:
    if qk_input_norm:  # x / rms(x) over d_model, no gain, written out here
        x = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    q = torch.einsum("bnd,hdr->bhnr", x, frames_q)
    k = torch.einsum("bnd,hdr->bhnr", x, frames_k)
    if isinstance(getattr(module, "q_norm", None), nn.Module):  # per-head norms of the module's own
        q, k = module.q_norm(q), module.k_norm(k)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-2, -1)  # (B, H, N, N)


def _head_wiring_errors(name: str, qk_input_norm: bool = False) -> list[str]:
    factory, make_inputs, _, _ = CASES[name]
    torch.manual_seed(0)
    model = factory().double().eval()
    found = [(n, m, a.projections(m)) for n, m, a in convert_module._find(model)]
    with torch.no_grad():
        for _, _, projections in found:
            for p in projections:
                weight = getattr(p.owner, p.name)
                _orthonormal_chunks(weight, p.rows, weight.shape[1] if p.rows else weight.shape[0])
                for bias in ("bias", "in_proj_bias"):  # the biases' own layout is not what is checked here
                    if isinstance(getattr(p.owner, bias, None), torch.Tensor):
                        getattr(p.owner, bias).zero_()
        seen = _probe(model, [m for _, m, _ in found], make_inputs())
        stiefelize(model, init="nearest", qk_input_norm=qk_input_norm)
        if qk_input_norm:  # the model's own logits, now with the input norm, on inputs 1e3 times larger
            seen = _probe(model, [m for _, m, _ in found], _scaled(make_inputs(), 1e3))
        errors = []
        for where, module, projections in found:
            x, got, kind = seen[module]
            want = _logits_from_frames(module, x, *_frames_of(projections), qk_input_norm=qk_input_norm)
            if kind == "diag":
                want = want.diagonal(dim1=-2, dim2=-1)
            elif kind == "probs":
                want = (want / math.sqrt(x.shape[-1] // got.shape[1])).softmax(dim=-1)
            # float64 throughout, except that transformers computes rotary cos/sin in float32 (rotations then
            # preserve q_i . k_i to ~1e-7 relative); a wrong layout is off by O(1)
            tol = (1e-6 if kind == "diag" else 1e-9) * float(want.abs().max())
            for h in range(got.shape[1]):
                if not torch.allclose(got[:, h], want[:, h], rtol=0, atol=tol):
                    gap = float((got[:, h] - want[:, h]).abs().max())
                    errors.append(f"{where or name} head {h}: {kind} differ by {gap:.2g}")
    return errors


def _scaled(inputs, c: float):
    """Float inputs times c (token ids, masks as they are)."""
    if isinstance(inputs, dict):
        return {k: v * c if v.is_floating_point() else v for k, v in inputs.items()}
    return inputs * c


class _PermutedHeads(convert_module.StiefelProjection):
    """A wrong head layout that is consistent with itself: unit j of head h at position j * n + h, not h * r + j."""

    def forward(self, *originals):
        blocks = []
        for (kind, n), t in zip(self.pieces, originals):
            if kind == "rest":
                blocks.append(t)
            elif self.rows:
                blocks.append(t.permute(2, 0, 1).reshape(n * self.head_dim, self.d_model))
            else:
                blocks.append(t.permute(1, 2, 0).reshape(self.d_model, n * self.head_dim))
        return torch.cat(blocks, dim=0 if self.rows else 1)

    def right_inverse(self, weight):
        widths = [self._width(kind, n) for kind, n in self.pieces]
        out = []
        for (kind, n), block in zip(self.pieces, weight.split(widths, dim=0 if self.rows else 1)):
            if kind == "rest":
                out.append(block.detach().clone())
            elif self.rows:
                out.append(block.reshape(self.head_dim, n, self.d_model).permute(1, 2, 0).contiguous())
            else:
                out.append(block.reshape(self.d_model, self.head_dim, n).permute(2, 0, 1).contiguous())
        return tuple(out)


@pytest.mark.parametrize("name", ALL)
def test_frames_are_the_models_own_heads(name):
    assert _head_wiring_errors(name) == []


@pytest.mark.parametrize("name", ALL)
def test_the_head_check_fails_on_a_permuted_head_layout(name, monkeypatch):
    monkeypatch.setattr(convert_module, "StiefelProjection", _PermutedHeads)
    model, inputs, select, _ = _build(name)  # the permuted layout round-trips and keeps the function...
    with torch.no_grad():
        want = _run(model, _double(inputs), select)
        torch.testing.assert_close(_run(stiefelize(model, init="nearest"), _double(inputs), select), want)
    errors = _head_wiring_errors(name)  # ...but its frames are not the model's heads
    assert errors and all("differ" in e for e in errors)


# --- qk_input_norm: queries and keys read x / rms(x), the values x --------------------------------------------
SEPARATE_QK = ("bert", "llama-gqa", "llama-mqa", "mistral", "qwen2-gqa", "vit")  # own query and key projections
FUSED_QK = sorted(set(CASES) - set(SEPARATE_QK))


@needs_transformers
@pytest.mark.parametrize("name", SEPARATE_QK)
def test_with_the_input_norm_the_frames_read_the_normalised_input_in_the_models_own_heads(name):
    assert _head_wiring_errors(name, qk_input_norm=True) == []


@needs_transformers
@pytest.mark.parametrize("name", ["llama-gqa", "vit"])
def test_the_input_norm_head_check_fails_on_a_wrong_input_path(name, monkeypatch):
    # the hook left out: the model's heads read x itself, the check expects x / rms(x)
    monkeypatch.setattr(convert_module.NormalisedInput, "__call__", lambda self, module, args: None)
    errors = _head_wiring_errors(name, qk_input_norm=True)
    assert errors and all("differ" in e for e in errors)
    # a norm with the wrong reduction (over the tokens, not d_model)
    monkeypatch.setattr(
        convert_module.NormalisedInput,
        "__call__",
        lambda self, module, args: (args[0] / args[0].square().mean(-2, keepdim=True).add(1e-6).sqrt(), *args[1:]),
    )
    errors = _head_wiring_errors(name, qk_input_norm=True)
    assert errors and all("differ" in e for e in errors)


@needs_transformers
def test_the_input_norm_bounds_a_converted_models_logits_and_leaves_its_values_alone():
    factory, make_inputs, _, _ = CASES["llama-gqa"]
    torch.manual_seed(0)
    model = stiefelize(factory().double().eval(), qk_input_norm=True)
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("x", kw["hidden_states"]), with_kwargs=True)
    attn.v_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("v", a[0]))
    attn.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out))
    attn.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))
    with torch.no_grad():  # the pre-attention norm's free gains grown a million-fold, unevenly
        gains = model.model.layers[0].input_layernorm.weight
        gains.mul_(1e6 * torch.exp(torch.randn(gains.shape, dtype=gains.dtype)))
        model(**make_inputs())
    assert torch.equal(seen["v"], seen["x"])  # the values read the input as it is
    r, d = attn.head_dim, attn.q_proj.in_features
    q = seen["q"].view(*seen["q"].shape[:2], -1, r)  # (B, N, H, r), before rotary embeddings (which keep norms)
    k = seen["k"].view(*seen["k"].shape[:2], -1, r)
    largest = float(torch.einsum("bnhr,bmgr->bhgnm", q, k).abs().max()) / math.sqrt(r)
    assert 1.0 < largest <= d / math.sqrt(r) * (1 + 1e-12)
    assert float(seen["x"].norm(dim=-1).max()) > 1e5


@needs_transformers
@pytest.mark.parametrize("name", FUSED_QK)
def test_the_input_norm_is_refused_for_fused_layouts_and_the_model_stays_unconverted(name):
    factory, _, _, _ = CASES[name]
    torch.manual_seed(0)
    model = factory()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(StiefelizeError, match="qk_input_norm.*nothing was converted"):
        stiefelize(model, qk_input_norm=True)
    assert frames(model) == [] and model.state_dict().keys() == before.keys()
    assert all(not m._forward_pre_hooks for m in model.modules() if isinstance(m, nn.Linear))


@needs_transformers
def test_unstiefelize_removes_the_input_norm():
    factory, make_inputs, select, _ = CASES["mistral"]
    torch.manual_seed(0)
    plain = factory().double().eval()
    model = copy.deepcopy(plain)
    stiefelize(model, init="nearest", qk_input_norm=True)
    unstiefelize(model)
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    assert not any(isinstance(h, convert_module.NormalisedInput) for h in hooks)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(_run(model, make_inputs(), select), _run(plain, make_inputs(), select))


@pytest.mark.parametrize("name", ALL)
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


@pytest.mark.parametrize("name", ALL)
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


@needs_transformers
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


@needs_transformers
def test_nearest_init_reports_how_much_the_function_changed(caplog):
    torch.manual_seed(5)
    model = CASES["gpt2"][0]()
    with caplog.at_level("WARNING", logger="stiefel_attention"):
        stiefelize(model, init="nearest")
    report = model.stiefelize_report
    assert set(report) == {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"}
    assert all(r["relative_change"] > 1.0 for r in report.values())  # std-0.02 weights, unit-norm frames
    assert "function changes" in caplog.text


@needs_transformers
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
    with pytest.raises(StiefelizeError, match="already stiefelized"):
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_keeps_float32_frames_and_computes_in_its_dtype(dtype):
    torch.manual_seed(9)
    reference = stiefelize(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)).eval()
    model = unstiefelize(copy.deepcopy(reference)).to(dtype)
    stiefelize(model, init="nearest")
    assert {p.dtype for _, p in frames(model)} == {torch.float32}
    assert model.self_attn.in_proj_weight.dtype == dtype
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out = model(x.to(dtype))
        assert out.dtype == dtype
        assert float((out.float() - reference(x)).abs().max()) < 0.1
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=1e-3, max_step=0.1)
    model.train()
    model(x.to(dtype)).float().square().mean().backward()
    opt.step()
    assert max(float(isometry_error(p)) for _, p in frames(model)) < 1e-5
    assert unstiefelize(copy.deepcopy(model)).self_attn.in_proj_weight.dtype == dtype


def test_the_timm_adapter_matches_the_timm_style_stand_in():
    model = nn.Sequential(TimmStyleAttention(), TimmStyleAttention(qk_norm=True))
    assert [a.name for _, _, a in convert_module._find(model)] == [
        "fused nn.Linear qkv, q | k | v (timm Attention)"
    ] * 2


# ---------------------------------------------------------------------------------------------
# Conversions that keep the function: init="svd" and temperature=True
# ---------------------------------------------------------------------------------------------


def _pretrained_like_nanogpt(seed: int = 0) -> nn.Module:
    """nanoGPT attention with weights of uneven scale per head and direction, as trained weights have."""
    torch.manual_seed(seed)
    model = nn.Sequential(CausalSelfAttention(), CausalSelfAttention()).double()
    with torch.no_grad():
        for m in model:
            m.c_attn.weight.mul_(torch.logspace(-1, 0.5, 32, dtype=torch.float64).view(1, -1))  # skewed inputs
            m.c_attn.weight[:64].mul_(0.1)  # small, as trained weights of Hugging Face models start
            m.c_attn.weight[:32].mul_(3.0)  # larger queries than keys
    return model


def _bilinear_forms(module: CausalSelfAttention) -> torch.Tensor:
    """W_Q,h W_K,h^T per head, (H, D, D), from the weight the module computes with."""
    w = module.c_attn.weight.detach()  # (3D, D): x W^T; rows h*r .. h*r+r-1 are head h's
    wq, wk = (w[i * 32 : (i + 1) * 32].reshape(4, 8, 32).transpose(1, 2) for i in (0, 1))
    return wq @ wk.transpose(1, 2)


def _relative_error(model, reference) -> float:
    num = sum(float((_bilinear_forms(a) - _bilinear_forms(b)).square().sum()) for a, b in zip(model, reference))
    return (num / sum(float(_bilinear_forms(b).square().sum()) for b in reference)) ** 0.5


def test_temperature_starts_at_the_scalar_closest_to_each_heads_bilinear_form():
    ref = _pretrained_like_nanogpt()
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True)
    for m, r in zip(model, ref):
        got = _bilinear_forms(m)
        frames_only = got / got.flatten(1).norm(dim=1).view(-1, 1, 1) * math.sqrt(8)  # ||Q K^T||_F = sqrt(r)
        want = (frames_only * _bilinear_forms(r)).sum((1, 2)) / 8  # least squares: <M, Q K^T> / ||Q K^T||^2
        torch.testing.assert_close(got.flatten(1).norm(dim=1) / math.sqrt(8), want)
    plain = stiefelize(copy.deepcopy(ref), init="nearest")
    assert _relative_error(model, ref) < 0.5 * _relative_error(plain, ref)  # the scale is most of what nearest loses
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref(x), model(x), plain(x)
    gap = [float((a.last_logits - b.last_logits).norm() / b.last_logits.norm()) for a, b in zip(model, ref)]
    gap_plain = [float((a.last_logits - b.last_logits).norm() / b.last_logits.norm()) for a, b in zip(plain, ref)]
    assert max(gap) < min(gap_plain), (gap, gap_plain)  # the module's own logits, not only our formula


def test_svd_init_is_the_best_scaled_frame_pair_for_each_heads_bilinear_form():
    ref = _pretrained_like_nanogpt()
    model = stiefelize(copy.deepcopy(ref), init="svd", temperature=True)
    assert max(isometry_error(p) for _, p in frames(model)) < 1e-12
    for m, r in zip(model, ref):
        s = torch.linalg.svdvals(_bilinear_forms(r))[:, :8]  # top r singular values of each head's D x D form
        best = _bilinear_forms(r).square().sum((1, 2)) - s.sum(1).square() / 8  # min over s, Q, K of ||M - sQK^T||^2
        torch.testing.assert_close((_bilinear_forms(m) - _bilinear_forms(r)).square().sum((1, 2)), best)
    nearest = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True)
    assert _relative_error(model, ref) < _relative_error(nearest, ref)


def test_temperature_is_trained_undecayed_and_survives_a_round_trip():
    ref = _pretrained_like_nanogpt()
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True)
    temps = [p for n, p in model.named_parameters() if n.endswith("weight.original3")]  # after q, k, rest
    assert len(temps) == 2 and all(t.shape == (4,) for t in temps)
    groups = param_groups(model, weight_decay=0.1)
    assert all(any(t is p for p in g["params"]) for t in temps for g in groups if g.get("weight_decay") == 0.0)
    assert not any(t is p for t in temps for g in groups if g.get("stiefel") for p in g["params"])
    before = [t.detach().clone() for t in temps]
    opt = StiefelAdam(groups, lr=1e-2)
    model(torch.randn(2, 7, 32, dtype=torch.float64)).square().mean().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, temps))
    assert max(isometry_error(p) for _, p in frames(model)) < 1e-12
    again = stiefelize(unstiefelize(copy.deepcopy(model)), init="nearest", temperature=True)
    torch.testing.assert_close(_relative_error(again, model), 0.0, atol=1e-12, rtol=0)


@needs_transformers
def test_temperature_uses_each_query_heads_own_key_head_under_grouped_query_attention():
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **SMALL)).double()
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True)
    a, b = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    wq, wk = (p.weight.detach().view(-1, 8, 32).transpose(1, 2) for p in (b.q_proj, b.k_proj))  # (H, D, r)
    q, k = (p.weight.detach().view(-1, 8, 32).transpose(1, 2) for p in (a.q_proj, a.k_proj))
    k, wk = k.repeat_interleave(2, dim=0), wk.repeat_interleave(2, dim=0)  # query heads 0, 1 read key head 0
    scale = q.flatten(1).norm(dim=1) / math.sqrt(8)
    frame_q = q / scale.view(-1, 1, 1)
    want = ((wq @ wk.transpose(1, 2)) * (frame_q @ k.transpose(1, 2))).sum((1, 2)) / 8
    torch.testing.assert_close(scale, want)
    with pytest.raises(StiefelizeError, match="one key head per query head.*4 query heads share 2"):
        stiefelize(copy.deepcopy(ref), init="svd")
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in ref.modules())


def test_svd_and_temperature_refusals():
    with pytest.raises(ValueError, match="temperature=True starts each head's scale"):
        stiefelize(nn.Sequential(CausalSelfAttention()), init="orthonormal", temperature=True)

    class TwoQuery(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    register_adapter(
        Adapter(
            "two query weights",
            lambda m: isinstance(m, TwoQuery),
            lambda m: [
                Projection(m.a, "weight", True, (("q", 2),), 8),
                Projection(m.b, "weight", True, (("q", 2),), 8),
                Projection(m.c, "weight", True, (("k", 2),), 8),
            ],
        )
    )
    try:
        model = TwoQuery()
        with pytest.raises(StiefelizeError, match="2 query and 1 key blocks"):
            stiefelize(model, init="nearest", temperature=True)
        assert not torch.nn.utils.parametrize.is_parametrized(model.a)
        stiefelize(model, init="nearest")  # without pairing it converts
    finally:
        convert_module._ADAPTERS.pop(0)


def test_calibrated_temperature_is_the_least_squares_scale_of_the_modules_own_logits():
    ref = _pretrained_like_nanogpt()
    x = torch.randn(3, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True, calibrate=lambda m: m(x))
    temp = model[0].c_attn.parametrizations.weight.original3  # log-temperatures of the first module's heads
    ref[0](x)
    want = ref[0].last_logits  # (B, H, N, N), q k^T as the module computes it, biases included

    def error(shift: float) -> torch.Tensor:  # per head, with every log-temperature moved by shift
        with torch.no_grad():
            temp.add_(shift)
            model[0](x)
            temp.sub_(shift)
        return (model[0].last_logits - want).square().sum((0, 2, 3))

    best = error(0.0)
    assert (best < error(1e-3)).all() and (best < error(-1e-3)).all()
    data_free = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True)
    data_free[0](x)
    assert float(best.sum()) < float((data_free[0].last_logits - want).square().sum())


@needs_transformers
def test_calibrated_temperature_reads_gpt2s_fused_conv1d_layout_and_biases():
    torch.manual_seed(0)
    ref = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=16)).double()
    with torch.no_grad():
        ref.transformer.h[0].attn.c_attn.bias.normal_(0, 0.5)
    ref.eval()  # the input the calibration sees: no dropout (stiefelize calibrates in eval mode)
    ref.transformer.h[0].train()  # ...and puts back each module's mode afterwards
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    seen = []
    hook = ref.transformer.h[0].attn.c_attn.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    ref(ids)
    hook.remove()
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True, calibrate=lambda m: m(ids))
    # independently of the library's layout code: c_attn computes x W + b with W (D, 3D) = [W_Q | W_K | W_V]
    x, w, b = seen[0], ref.transformer.h[0].attn.c_attn.weight, ref.transformer.h[0].attn.c_attn.bias
    per_head = lambda t: t.unflatten(-1, (4, 8)).transpose(-3, -2)  # (..., N, D) -> (..., H, N, r)  # noqa: E731
    q_old, k_old = per_head(x @ w[:, :32] + b[:32]), per_head(x @ w[:, 32:64] + b[32:64])
    conv = model.transformer.h[0].attn.c_attn
    frame_q, frame_k = conv.parametrizations.weight.original0, conv.parametrizations.weight.original1
    q_part = torch.einsum("bnd,hdr->bhnr", x, frame_q)
    k_new = torch.einsum("bnd,hdr->bhnr", x, frame_k) + b[32:64].view(4, 1, 8)
    a = q_part @ k_new.mT
    target = q_old @ k_old.mT - b[:32].view(4, 1, 8) @ k_new.mT
    want = ((target * a).sum((0, 2, 3)) / a.square().sum((0, 2, 3))).detach()
    got = conv.parametrizations.weight.original3.detach().exp()
    assert (want > 0).any() and (want < 0).any()  # random heads: both cases occur
    torch.testing.assert_close(got[want > 0], want[want > 0])
    data_free = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True).transformer.h[0].attn.c_attn
    floor = 1e-3 * data_free.parametrizations.weight.original3.detach().exp()
    torch.testing.assert_close(got[want <= 0], floor[want <= 0])  # not positive: near 0, still trainable
    assert model.transformer.h[0].training and not model.transformer.training


def test_calibration_refusals_leave_the_model_unconverted():
    model = nn.Sequential(CausalSelfAttention(), CausalSelfAttention())
    with pytest.raises(ValueError, match="pass temperature=True"):
        stiefelize(model, init="nearest", calibrate=lambda m: m(torch.randn(1, 3, 32)))
    with pytest.raises(StiefelizeError, match=r"did not run 1: Linear; nothing was converted"):
        stiefelize(model, init="nearest", temperature=True, calibrate=lambda m: m[0](torch.randn(1, 3, 32)))
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **SMALL)) if transformers else None
    if llama is not None:  # a key projection skipped in one call (as a cache would) cannot be paired

        def unpaired(m):
            m(torch.randint(0, 50, (1, 4)))
            m.model.layers[0].self_attn.k_proj._forward_pre_hooks.clear()  # its next calls are not seen
            m(torch.randint(0, 50, (1, 4)))

        with pytest.raises(StiefelizeError, match="query projection ran 2 times and its key projection 1 times"):
            stiefelize(llama, init="nearest", temperature=True, calibrate=unpaired)
        assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in llama.modules())
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    with pytest.raises(StiefelizeError, match="in_proj_weight is not applied that way"):
        stiefelize(mha, init="nearest", temperature=True, calibrate=lambda m: m(*[torch.randn(1, 3, 32)] * 3))
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in [*model.modules(), mha])
    assert not any(m._forward_pre_hooks for m in model.modules())  # the capture hooks are gone


@needs_transformers
def test_deberta_in_proj_frames_are_the_heads_its_own_code_reads():
    """DeBERTa splits in_proj's output head by head into q, k, v (its transpose_for_scores, then chunk): the
    frames must be those heads, checked with the model's own method, not with our layout code."""
    torch.manual_seed(0)
    config = T.DebertaConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL)
    model = T.DebertaModel(config).double().eval()
    stiefelize(model, init="orthonormal")
    attn = model.encoder.layer[0].attention.self
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        q, k, _ = attn.transpose_for_scores(attn.in_proj(x)).chunk(3, dim=-1)  # (B, H, N, r) each
    plist = attn.in_proj.parametrizations.weight
    frames_q, frames_k = plist.original0.detach(), plist.original1.detach()  # (H, D, r)
    torch.testing.assert_close(q, torch.einsum("bnd,hdr->bhnr", x, frames_q))
    torch.testing.assert_close(k, torch.einsum("bnd,hdr->bhnr", x, frames_k))
    ids = {"input_ids": torch.randint(0, 50, (2, 7))}
    before = model(**ids).last_hidden_state
    again = stiefelize(unstiefelize(copy.deepcopy(model)), init="nearest")
    torch.testing.assert_close(again(**ids).last_hidden_state, before)


@needs_transformers
def test_xlnet_per_head_parameters_become_frames_at_the_heads_its_own_code_reads():
    """XLNet keeps W_Q, W_K as (d, heads, head_dim) parameters and applies them itself (q_head = einsum
    'ibh,hnd->ibnd'): head n reads q[:, n, :], which must be frame n."""
    torch.manual_seed(0)
    config = T.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=64, vocab_size=50, dropout=0.0)
    model = T.XLNetModel(config).double().eval()
    stiefelize(model, init="orthonormal")
    attn = model.layer[0].rel_attn
    frames_q = attn.parametrizations.q.original0.detach()  # (H, D, r)
    x = torch.randn(5, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # (N, B, D)
    torch.testing.assert_close(torch.einsum("ibh,hnd->ibnd", x, attn.q), torch.einsum("ibh,nhd->ibnd", x, frames_q))
    assert attn.q.shape == (32, 4, 8) and max(float(isometry_error(p)) for _, p in frames(model)) < 1e-12
    ids = {"input_ids": torch.randint(0, 50, (2, 7))}
    before = model(**ids).last_hidden_state
    again = stiefelize(unstiefelize(copy.deepcopy(model)), init="nearest")
    torch.testing.assert_close(again(**ids).last_hidden_state, before)
    opt = StiefelAdam(param_groups(again, frame_lr=0.05), lr=1e-2)
    again(**ids).last_hidden_state.square().mean().backward()
    opt.step()
    assert max(float(isometry_error(p)) for _, p in frames(again)) < 1e-12


@needs_transformers
def test_qwen3_next_gated_q_proj_frames_are_the_query_units_of_each_head_and_the_gate_stays():
    """Qwen3-Next's q_proj holds, head by head, r query units then r gate units (its forward views the output as
    (heads, 2 r) and halves it): the frames must be the query halves, the gates untouched Euclidean weights."""
    torch.manual_seed(0)
    config = T.Qwen3NextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, layer_types=["full_attention"], vocab_size=50, num_experts=4, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts_per_tok=2,
    )  # fmt: skip
    model = T.Qwen3NextForCausalLM(config).double().eval()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    split = lambda out: torch.chunk(out.view(2, 5, -1, 16), 2, dim=-1)  # noqa: E731 - as its forward reads q_proj
    with torch.no_grad():
        _, gate_before = split(attn.q_proj(x))
    stiefelize(model, init="nearest", temperature=True)
    plist = attn.q_proj.parametrizations.weight
    frames_q, frames_k = plist.original0.detach(), attn.k_proj.parametrizations.weight.original0.detach()
    assert frames_q.shape == (4, 32, 8) and frames_k.shape == (2, 32, 8)
    with torch.no_grad():
        q, gate = split(attn.q_proj(x))
        scale = plist.original2.exp().view(1, 1, 4, 1)  # each query head's temperature
    torch.testing.assert_close(q, scale * torch.einsum("bnd,hdr->bnhr", x, frames_q))
    torch.testing.assert_close(gate, gate_before)  # the gate is the rest: left as it was
    torch.testing.assert_close(attn.k_proj(x).view(2, 5, 2, 8), torch.einsum("bnd,hdr->bnhr", x, frames_k))


def test_a_gated_query_projection_of_a_class_not_known_to_read_it_per_head_is_refused():
    """q_proj with twice the query units: per head (q_h | gate_h) or per block (q | gate) cannot be told from the
    weights, so a module not known to read it per head is refused, nothing converted."""

    class GatedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = 4, 8
            self.q_proj, self.k_proj = nn.Linear(32, 64), nn.Linear(32, 32)

    model = nn.Sequential(GatedAttention())
    with pytest.raises(StiefelizeError, match="not 4 query heads .*a layout no adapter knows"):
        stiefelize(model)
    assert not frames(model)


class _LinearAttention(nn.Module):
    """A linear-attention mixer as Kimi's or Qwen3-Next's delta rules are built: q_proj, k_proj and heads like
    softmax attention, and the decay of a recurrent state (A_log, here in a forget-gate child)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 4, 8
        self.q_proj, self.k_proj = nn.Linear(32, 32), nn.Linear(32, 32)
        self.forget_gate = nn.Module()
        self.forget_gate.A_log = nn.Parameter(torch.zeros(4))


def test_linear_attention_mixers_are_not_converted_as_softmax_attention():
    with pytest.raises(StiefelizeError, match="no softmax attention"):
        stiefelize(nn.Sequential(_LinearAttention(), _LinearAttention()))
    hybrid = nn.Sequential(_LinearAttention(), CausalSelfAttention())  # one softmax layer: only it converts
    stiefelize(hybrid)
    assert not hasattr(hybrid[0].q_proj, "parametrizations") and len(frames(hybrid)) == 2


@needs_transformers
def test_codegen_partitions_hold_queries_values_keys_and_their_frames_are_its_heads():
    """CodeGen's qkv_proj holds mp_num = 4 partitions, each with its share of the query heads, the values and the
    key heads, in that order; with 8 heads each partition has two, so a head order within partitions is tested."""
    torch.manual_seed(0)
    config = T.CodeGenConfig(n_embd=64, n_layer=1, n_head=8, rotary_dim=4, vocab_size=50, n_positions=32)
    model = T.CodeGenForCausalLM(config).double().eval()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def own_split(out):  # as its forward reads qkv_proj: (B, N, 4, 3 * 16) -> query, value, key -> (B, N, 8, 8)
        query, value, key = out.view(2, 5, 4, 48).split(16, dim=-1)
        return query.reshape(2, 5, 8, 8), value.reshape(2, 5, 8, 8), key.reshape(2, 5, 8, 8)

    with torch.no_grad():
        _, value_before, _ = own_split(attn.qkv_proj(x))
    stiefelize(model, init="orthonormal")
    plist = attn.qkv_proj.parametrizations.weight
    frames_q, frames_k = plist.original0.detach(), plist.original2.detach()
    assert frames_q.shape == frames_k.shape == (8, 64, 8)
    with torch.no_grad():
        query, value, key = own_split(attn.qkv_proj(x))
    torch.testing.assert_close(query, torch.einsum("bnd,hdr->bnhr", x, frames_q))
    torch.testing.assert_close(key, torch.einsum("bnd,hdr->bnhr", x, frames_k))
    torch.testing.assert_close(value, value_before)


def test_refusals_name_routed_queries_and_wrapped_projections():
    class RoutedAttention(nn.Module):  # JetMoE's shape: keys from one linear, queries from routed experts
        def __init__(self):
            super().__init__()
            self.num_heads = 4
            self.kv_proj, self.experts = nn.Linear(32, 64), nn.ModuleList([nn.Linear(32, 32)] * 2)

    class PerCodebook(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 32, 32))  # one W per codebook

    class WrappedAttention(nn.Module):  # Moshi's shape: projections that are not nn.Linear
        def __init__(self):
            super().__init__()
            self.num_heads = 4
            self.q_proj, self.k_proj = PerCodebook(), PerCodebook()

    with pytest.raises(StiefelizeError, match=r"mixture of experts, RoutedAttention.experts \(ModuleList\)"):
        stiefelize(nn.Sequential(RoutedAttention()))
    with pytest.raises(StiefelizeError, match=r"WrappedAttention.k_proj \(PerCodebook\), .*not nn.Linear weights"):
        stiefelize(nn.Sequential(WrappedAttention()))


@needs_transformers
def test_moshi_wrapped_projections_convert_and_per_codebook_ones_are_refused():
    """Moshi's attention reads q and k through MoshiLinear: a plain nn.Linear inside (its main decoder), converted;
    or one weight per codebook (its depth decoder), refused with the way out, the model left unconverted."""
    from transformers.models.moshi.modeling_moshi import MoshiAttention

    config = T.MoshiConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_codebooks=3)
    main = nn.Sequential(MoshiAttention(config, layer_idx=0, use_flexible_linear=False))
    before = main[0].q_proj.linear.weight.detach().clone()
    stiefelize(main, init="nearest")
    frames_q = main[0].q_proj.linear.parametrizations.weight.original0.detach()  # (H, D, r)
    assert frames_q.shape == (4, 32, 8) and len(frames(main)) == 2
    heads = before.view(4, 8, 32).transpose(1, 2)  # head h: rows h*8 .. h*8+7 of the (out, in) weight
    torch.testing.assert_close(frames_q, convert_module.polar_retract(heads, torch.zeros_like(heads)))
    depth = nn.Sequential(MoshiAttention(config, layer_idx=0, use_flexible_linear=True))
    with pytest.raises(StiefelizeError, match="is MoshiFlexibleLinear, not an nn.Linear .*one weight per codebook"):
        stiefelize(depth)
    assert not frames(depth)
