"""Which transformers model types `stiefelize` converts, measured on tiny random configs (nothing is downloaded).

    python tools/zoo.py                       # every type: writes docs/zoo.md and docs/zoo.json (several minutes)
    python tools/zoo.py --types llama,gpt2    # a subset, printed only

Every model type of the installed transformers' AutoModelForCausalLM mapping, plus the encoder, vision and
encoder-decoder families people fine-tune (ENCODERS), is built from its default config shrunk to a few layers
of width 64 (`small_config`) and classified:

- converted: stiefelize found its attention, and on the converted model
  forward runs; heads: each head's attention logits, as the model's own code hands q and k to its attention
  function, equal the logits built from that head's frames (weights made orthonormal per head first, so that
  conversion with init="nearest" keeps the function; q . k at equal positions, which rotary embeddings keep);
  step: one StiefelAdam(param_groups(model)) step keeps every frame orthonormal to 1e-5 and changes the loss;
  unstiefelize: the baked plain model gives the same outputs; generate: greedy generate() with the KV cache
  gives the tokens of a step-by-step forward without it; save/load: save_pretrained, from_pretrained and
  stiefelize(init="nearest") give the same outputs back. n/a where a check does not apply (no generate for an
  encoder; no heads check where the model does not go through transformers' attention functions).
- refused, with the reason: no softmax attention (state-space or recurrent layers), multi-head latent
  attention (W_Q, W_K as low-rank factors), or a layout no adapter knows (named).
- no small config: the shrunk config does not build offline (the error is given) or stays too large.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
ENCODERS = ("bert", "roberta", "deberta", "deberta-v2", "vit", "deit", "clip_text_model", "whisper", "t5", "bart")
MAX_PARAMS = 5e6
_SIZES = (  # (shrunk value, every name configs use for that size)
    (64, ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "hidden_size_global", "lru_width")),
    (32, ("shape_embed_dim", "pronunciation_embed_dim")),
    (2, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers")),
    (4, ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads")),
    (
        128,
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "first_dense_intermediate_size",
        ),
    ),
    (32, ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size")),
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
)
_AT_MOST = {
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_kv_shared_layers": 0,
    "n_group": 1,
    "topk_group": 1,
}
# Fields a default config leaves None for the model to fill in, where some models read them as numbers anyway
_UNSET = {
    "head_dim": 16,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
}
# State-space layers of hybrids: heads of 16 over the mixer's inner width (2 x 64)
_STATE_SPACE = {"mamba_n_heads": 8, "n_mamba_heads": 8, "mamba_d_head": 16, "mamba_headdim": 16, "mamba_d_state": 16}
_ENOUGH = {
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "unpadded_vocab_size": 128,
    "encoder_hash_byte_group_vocab": 128,
    "shape_vocab_size": 128,
    "pronunciation_vocab_size": 128,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
}


def small_config(model_type: str):
    """The type's default config with every size field shrunk (width 64, 2 layers, 4 heads of 16), sub-configs
    (a multimodal model's text and vision towers) too."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    # Per-layer overrides (Gemma 4's wider full-attention heads) make attributes such as head_dim unreadable
    # globally; a config built without them shrinks like any other, every layer with the shared widths (layer
    # kinds, masks and rotary embeddings stay as they were). The overrides may sit in a nested config.
    plain = config.to_dict()
    if plain.get("per_layer_config"):
        config = AutoConfig.for_model(model_type, per_layer_config={})
    nested = {
        k: {**v, "per_layer_config": {}} for k, v in plain.items() if isinstance(v, dict) and v.get("per_layer_config")
    }
    if nested:
        config = AutoConfig.for_model(model_type, **nested)
    _shrink(config)
    for name in list(config.to_dict()):
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):  # a nested config
            _shrink(sub)
    return config


# Widths of parts of a head (rotary and non-rotary parts, multi-head latent attention's ranks): at most these,
# so that they fit the 16-wide heads
_HEAD_PARTS = {
    "rotary_dim": 8,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "partial_rotary_dim": 8,
}


# Widths some configs state as a multiple of the model's width (RWKV's attention, Zamba2's attention over
# [hidden, embedding], xLSTM's embedding): shrunk in proportion
_PROPORTIONAL = ("attention_hidden_size", "embedding_dim")


def _shrink(config) -> None:
    width = getattr(config, "hidden_size", None)
    proportional = {
        n: getattr(config, n) * 64 // width
        for n in _PROPORTIONAL
        if isinstance(width, int) and isinstance(getattr(config, n, None), int) and getattr(config, n) % width == 0
    }
    for value, names in _SIZES:
        for name in names:
            if name in config.to_dict() or name in getattr(config, "attribute_map", {}):
                try:
                    setattr(config, name, value)
                except (AttributeError, TypeError, ValueError):
                    pass
    for name, value in {**_AT_MOST, **_ENOUGH, **_HEAD_PARTS, **_STATE_SPACE}.items():
        try:
            if isinstance(getattr(config, name, None), int) and getattr(config, name) > value:
                setattr(config, name, value)
        except Exception:  # per-layer attributes some configs refuse to read globally
            pass
    for name, value in proportional.items():
        setattr(config, name, value)
    if isinstance(getattr(config, "attention_head_dim", None), int) and "attention_hidden_size" in proportional:
        config.attention_head_dim = config.attention_hidden_size // config.num_attention_heads
    if all(isinstance(getattr(config, n, None), int) for n in ("expand", "num_heads", "head_dim", "n_groups")):
        config.head_dim, config.n_groups = 16, 1  # Mamba-2's heads over its inner width, expand x 64
        config.num_heads = config.expand * 64 // 16
    if isinstance(getattr(config, "mamba_d_ssm", None), int):  # the state-space mixer's inner width, stated apart
        config.mamba_d_ssm = config.mamba_n_heads * config.mamba_d_head
    for name in ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, 2)
    if isinstance(getattr(config, "swa_num_attention_heads", None), int):  # sliding-window layers' own heads
        config.swa_num_attention_heads = 4
    _shrink_layer_types(config)
    for name in ("head_dim", "dim_head", "swa_head_dim"):  # a head width stated apart from the model's width
        try:
            if getattr(config, name, None):
                setattr(config, name, 16)
        except Exception:
            pass
    plain = config.to_dict()
    for name, value in _UNSET.items():
        if name in plain and plain[name] is None:
            setattr(config, name, value)
    if isinstance(getattr(config, "kv_lora_rank", None), int):  # multi-head latent attention
        # every query head has its own key head, and the rotary part of a head is what these configs call head_dim
        config.num_key_value_heads = config.num_attention_heads
        config.qk_rope_head_dim = config.qk_nope_head_dim = 8
        config.head_dim = config.qk_rope_head_dim
        if isinstance(getattr(config, "qk_head_dim", None), int):  # the two parts' sum, stated apart (LongCat)
            config.qk_head_dim = 16
    vocab = getattr(config, "vocab_size", None)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(vocab, int) and isinstance(getattr(config, name, None), int) and getattr(config, name) >= vocab:
            setattr(config, name, 0)


def _shrink_layer_types(config) -> None:
    """A per-layer list of layer kinds must match the layer count; a hybrid keeps one layer of each kind (its
    first ones would often all be linear attention, leaving nothing to convert)."""
    # hybrids whose attention layers are named by position: the second of the two layers is one
    if isinstance(getattr(config, "attn_layer_period", None), int):  # every period-th layer from the offset
        config.attn_layer_period, config.attn_layer_offset = 2, 1
    if hasattr(config, "attn_layer_indices"):
        config.attn_layer_indices = [1]
    blocks = getattr(config, "block_types", None)  # a pattern the layers repeat (RecurrentGemma): one of each
    if isinstance(blocks, (list, tuple)) and len(set(blocks)) > 1:
        config.block_types = list(dict.fromkeys(blocks))
        config.num_hidden_layers = len(config.block_types)
    layers = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    if not (isinstance(types, list) and isinstance(layers, int)):
        return
    if set(types) == {"linear_attention"}:  # a default that lists only a hybrid's linear layers
        types = ["linear_attention", "full_attention"]
    kinds = list(dict.fromkeys(types))
    keep = kinds if len(kinds) > 1 else types[:layers]
    try:
        config.layer_types = keep
        if len(keep) != layers:
            config.num_hidden_layers = len(keep)
    except AttributeError:  # derived from other fields (a property without a setter)
        pass


def _factory(model_type: str):
    """The Auto class that builds the type: its causal LM where it has one, else its base model."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel


def _build(model_type: str, **overrides):
    factory = _factory(model_type)
    config = small_config(model_type)
    for name, value in overrides.items():  # a variant of the type's default config (tests)
        setattr(config, name, value)
    with torch.device("meta"):
        size = sum(p.numel() for p in factory.from_config(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = factory.from_config(config).eval()
    languages = getattr(config, "languages", None)
    if hasattr(model, "set_default_language") and languages:  # per-language adapters (X-MOD): pick the first
        model.set_default_language(languages[0])
    try:  # float64 where the model runs in it (tighter checks); some kernels (grouped matmuls) take float32 only
        model.double()(**_inputs(model, config))
    except RuntimeError:
        model.float()
    return model, config


def _default_builds(model_type: str) -> bool:
    """Whether the type's default config, unshrunk, builds (on the meta device: no memory is allocated)."""
    from transformers import AutoConfig

    try:
        with torch.device("meta"):
            _factory(model_type).from_config(AutoConfig.for_model(model_type))
    except Exception:
        return False
    return True


def _inputs(model, config) -> dict:
    gen = torch.Generator().manual_seed(1)
    names = set(inspect.signature(model.forward).parameters)
    if "pixel_values" in names and "input_ids" not in names:
        size = getattr(config, "image_size", 32)
        return {"pixel_values": torch.randn(2, 3, size, size, generator=gen, dtype=torch.float64)}
    if "input_features" in names and "input_ids" not in names:  # speech models (whisper): a mel spectrogram
        frames = 2 * getattr(config, "max_source_positions", 64)
        feats = torch.randn(2, getattr(config, "num_mel_bins", 80), frames, generator=gen, dtype=torch.float64)
        return {"input_features": feats, "decoder_input_ids": torch.randint(0, 100, (2, 6), generator=gen)}
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size  # composite: its text model's
    ids = torch.randint(3, min(100, vocab), (2, 7), generator=gen)
    out = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids[:, :5]
    return out


def _output(out) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "pooler_output"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    return out[0]


def _orthonormal_per_head(found) -> None:
    """Every d_model output units of each projection orthonormal: every head's W_Q, W_K then is, whatever the layout."""
    with torch.no_grad():
        for _, _, projections in found:
            for p in projections:
                weight = getattr(p.owner, p.name)
                if p.per_head:  # (D, heads, head_dim): a view as (D, units)
                    weight = weight.view(weight.shape[0], -1)
                d = p.d_model
                out_major = weight if p.rows else weight.T
                for start in range(0, out_major.shape[0], d):
                    block = out_major[start : start + d]
                    q, _ = torch.linalg.qr(torch.randn(d, block.shape[0], dtype=weight.dtype))
                    block.copy_(q.T)
                bias = getattr(p.owner, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.zero_()


def _heads_check(model, found, inputs) -> str | None:
    """None if every head's logits match its frames; else what differs. Raises LookupError if not applicable."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from stiefel_attention import stiefelize

    seen: dict = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen.setdefault(module, {})["qk"] = (query.detach().clone(), key.detach().clone())
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)  # the model's own
        attend = eager if eager is not None else ALL_ATTENTION_FUNCTIONS["sdpa"]
        return attend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("stiefel-zoo-capture", capture)
    modules = [m for _, m, _ in found]

    def remember_input(mod, args, kw):  # returns None: the hook must not replace the module's arguments
        x = kw.get("hidden_states", args[0] if args else None)
        memory = next((kw[n] for n in ("key_value_states", "encoder_hidden_states") if kw.get(n) is not None), x)
        # every call overwrites: a module a model calls several times per forward (Dory loops its layers) is
        # compared on its last call, whose q and k the capture keeps
        seen.setdefault(mod, {})["x"] = x
        seen[mod]["x_k"] = memory  # cross-attention: keys from the encoder's states

    hooks = [m.register_forward_pre_hook(remember_input, with_kwargs=True) for m in modules]
    implementation = getattr(model.config, "_attn_implementation", None)
    try:
        model.set_attn_implementation("stiefel-zoo-capture")
        with torch.no_grad():
            model(**inputs)
    except Exception as err:
        raise LookupError(f"the model does not take a custom attention function ({type(err).__name__})") from None
    finally:
        for h in hooks:
            h.remove()
        if implementation is not None:  # every later check runs the model as it was built
            model.set_attn_implementation(implementation)
    if not all("qk" in seen.get(m, {}) for m in modules):
        raise LookupError("the model does not go through transformers' attention functions")
    norms = {}
    for _, module, _ in found:
        pairs = (("q_norm", "q"), ("k_norm", "k"), ("q_layernorm", "q"), ("k_layernorm", "k"), ("qk_norm", "q"),
                 ("qk_norm", "k"), ("query_layernorm", "q"), ("key_layernorm", "k"))  # fmt: skip
        for attr, side in pairs:
            norm = getattr(module, attr, None)
            if isinstance(norm, nn.Module):
                shape = tuple(getattr(norm, "normalized_shape", None) or getattr(norm, "weight", torch.empty(0)).shape)
                norms[(module, side)] = (norm, int(shape[-1]) if shape else -1)  # -1 or 0: no parameters, per head
    stiefelize(model, init="nearest")
    worst, where = 0.0, ""
    for name, module, projections in found:
        x, x_k, (q_model, k_model) = seen[module]["x"], seen[module]["x_k"], seen[module]["qk"]
        frames = {}
        for p in projections:
            plist = getattr(p.owner.parametrizations, p.name)
            originals = [plist.original] if hasattr(plist, "original") else [
                getattr(plist, f"original{i}") for i in range(len(p.pieces))
            ]  # fmt: skip
            frames.update({kind: t.detach() for (kind, _), t in zip(p.pieces, originals) if kind != "rest"})
        per_head = {}
        for side in ("q", "k"):
            t = torch.einsum("bnd,hdr->bhnr", x if side == "q" else x_k, frames[side])  # (B, H, N, r)
            norm, width = norms.get((module, side), (None, 0))
            if norm is not None and width in (t.shape[-1], -1, 0):  # per head (Qwen3, Persimmon; Llama 4's L2)
                t = norm(t)
            elif norm is not None and width == t.shape[1] * t.shape[-1]:  # over every head at once (OLMo2)
                B, H, N, r = t.shape
                t = norm(t.transpose(1, 2).reshape(B, N, H * r)).view(B, N, H, r).transpose(1, 2)
            elif norm is not None:
                raise LookupError(f"a q/k norm over {width} units, neither a head's nor all heads', is not reproduced")
            per_head[side] = t
        q, k = per_head["q"], per_head["k"]
        if q_model.shape[1] != q.shape[1] or k_model.shape[1] != k.shape[1]:
            return f"{name}: the model has {q_model.shape[1]}/{k_model.shape[1]} q/k heads, the frames {q.shape[1]}"
        rep, n = q.shape[1] // k.shape[1], min(q.shape[2], k.shape[2])
        diag = lambda a, b: (a[:, :, :n] * b.repeat_interleave(rep, dim=1)[:, :, :n]).sum(-1)  # noqa: E731 - q_i.k_i
        got, want = diag(q_model, k_model), diag(q, k)
        # a model may scale q (or k) by a constant inside its projection step (OPT, BART: q * head_dim^-0.5):
        # one positive scalar per module is allowed, a different head layout is not
        scale = float((got * want).sum() / (want * want).sum().clamp_min(1e-300))
        gap = float((got - scale * want).abs().max()) / max(float(got.abs().max()), 1e-30)
        if scale <= 0:
            gap = math.inf
        if gap > worst:
            worst, where = gap, name
    tol = 1e-5 if x.dtype == torch.float64 else 1e-3
    return None if worst < tol else f"{where}: head logits differ from the frames' by {worst:.1e} (relative)"


def check_type(model_type: str, **overrides) -> dict:
    """The row of one model type: status, reason, and each check (True, False, or None for n/a) with notes."""
    from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize, unstiefelize
    from stiefel_attention.convert import StiefelizeError, _find, why_not

    row: dict = {"type": model_type, "status": None, "reason": "", "checks": {}, "notes": {}}
    try:
        model, config = _build(model_type, **overrides)
        inputs = _inputs(model, config)
        with torch.no_grad():
            model(**inputs)
    except Exception as err:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        if not _default_builds(model_type):
            reason = f"its default config does not build either ({reason})"
        row.update(status="no small config", reason=reason)
        return row
    row["class"] = type(model).__name__
    matched = _find(model)
    try:
        found = [(n, m, a.projections(m)) for n, m, a in matched]
    except StiefelizeError as err:  # an adapter matched and found the weights in a shape it cannot read
        row.update(status="refused", reason=str(err), adapters=sorted({a.name for _, _, a in matched}))
        return row
    row["adapters"] = sorted({a.name for _, _, a in matched})
    if not found:
        row.update(status="refused", reason=why_not(model))
        return row
    checks, notes = row["checks"], row["notes"]
    try:
        _orthonormal_per_head(found)
        with torch.no_grad():
            before = _output(model(**inputs)).clone()
            deterministic = torch.equal(_output(model(**inputs)), before)
        try:
            problem = _heads_check(model, found, inputs)
            checks["heads"] = problem is None
            if problem:
                notes["heads"] = problem
        except LookupError as why:
            checks["heads"], notes["heads"] = None, str(why)
            if not frames(model):
                stiefelize(model, init="nearest")
        with torch.no_grad():
            after = _output(model(**inputs))
        tight = dict(atol=1e-7, rtol=1e-6) if after.dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
        checks["forward"] = bool(torch.isfinite(after).all()) and torch.allclose(after, before, **tight)
        if not deterministic:  # e.g. random attention blocks: two forwards differ before any conversion
            checks["forward"], notes["forward"] = None, "the model's forward is not deterministic"
        baked = unstiefelize(copy.deepcopy(model))
        with torch.no_grad():
            checks["unstiefelize"] = torch.allclose(_output(baked(**inputs)), after, **tight)
        try:
            checks["save/load"] = _save_load(baked, inputs, after) if deterministic else None
        except Exception as err:  # the tiny config itself may not survive from_pretrained's validation
            checks["save/load"], notes["save/load"] = None, f"the tiny config does not reload ({type(err).__name__})"
        try:
            checks["generate"] = _generate(model, inputs)
        except Exception as err:
            try:
                _generate(baked, inputs)
            except Exception:  # the plain model fails alike: its own limit at this size or dtype, not ours
                checks["generate"] = None
                notes["generate"] = f"fails without stiefelize too ({type(err).__name__})"
            else:
                raise
        if checks["generate"] is False and _generate(baked, inputs) is False:  # not ours: the model's own quirk
            checks["generate"], notes["generate"] = None, "cached and uncached greedy differ without stiefelize too"
        checks["step"] = _step(model, inputs, StiefelAdam, param_groups, frames, isometry_error)
    except StiefelizeError as err:
        row.update(status="refused", reason=str(err).splitlines()[0])
        return row
    except Exception as err:
        notes["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        checks.setdefault("error", False)
    row["status"] = "converted" if all(v is not False for v in checks.values()) else "converted, a check fails"
    return row


def _save_load(baked, inputs, want) -> bool:
    from stiefel_attention import stiefelize

    with tempfile.TemporaryDirectory() as d:
        baked.save_pretrained(d)
        loaded = stiefelize(type(baked).from_pretrained(d, dtype=want.dtype).eval(), init="nearest")
    tol = dict(atol=1e-6, rtol=1e-5) if want.dtype == torch.float64 else dict(atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        return torch.allclose(_output(loaded(**inputs)), want, **tol)


def _generate(model, inputs) -> bool | None:
    if "input_ids" not in inputs or getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        return None
    ids = inputs["input_ids"][:1]
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                use_cache=True, pad_token_id=0)  # fmt: skip
        seq = ids
        for _ in range(6):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return torch.equal(cached[:, : seq.shape[1]], seq)


def _step(model, inputs, StiefelAdam, param_groups, frames, isometry_error) -> bool:
    model.train()
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=0.05), lr=1e-2, max_step=0.1)
    loss = _output(model(**inputs)).double().square().mean()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        again = _output(model(**inputs)).double().square().mean()
    iso = max(float(isometry_error(p)) for _, p in frames(model))
    return iso < 1e-5 and float(again) != float(loss)


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(ENCODERS))


_KINDS = (
    ("no softmax attention", "no softmax attention (state-space or recurrent layers)"),
    ("latent attention", "multi-head latent attention (W_Q, W_K low-rank)"),
    ("r <= d", "heads wider than the model (r > d: no frame)"),
    ("interleaved projection", "a query_key_value whose query heads do not group whole per key head"),
    ("no adapter knows", "a layout no adapter knows"),
    ("no attention module", "no attention module"),
)


def _reason_kind(reason: str) -> str:
    return next((kind for key, kind in _KINDS if key in reason), "other")


def markdown(rows: list[dict], version: str) -> str:
    counts = Counter(r["status"] for r in rows)
    reasons = Counter(_reason_kind(r["reason"]) for r in rows if r["status"] == "refused")
    order = ("converted", "converted, a check fails", "refused", "no small config")
    lines = [
        "# stiefelize across the transformers model zoo",
        "",
        f"Generated by `python tools/zoo.py` with transformers {version}: every model type of "
        "`AutoModelForCausalLM`'s mapping and the encoder, vision and encoder-decoder families "
        f"{', '.join(ENCODERS)}, each built from its default config shrunk to width 64, 2 layers, 4 heads "
        "(nothing downloaded). What each check means is in the script's docstring; n/a where it does not apply.",
        "",
        "Counts: " + ", ".join(f"{s} {counts[s]}" for s in order if counts[s]) + f" (of {len(rows)}). "
        "Refused by reason: " + "; ".join(f"{why} {n}" for why, n in reasons.most_common()) + ".",
        "",
        "| type | status | heads | forward | step | unstiefelize | generate | save/load | adapter, reason or notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mark = {True: "yes", False: "**no**", None: "n/a"}
    for r in sorted(rows, key=lambda r: (order.index(r["status"]), r["type"])):
        c = r["checks"]
        cells = [
            mark[c[k]] if k in c else "" for k in ("heads", "forward", "step", "unstiefelize", "generate", "save/load")
        ]
        parts = [*r.get("adapters", []), r["reason"], *(f"{k}: {v}" for k, v in r["notes"].items())]
        notes = "; ".join(p for p in parts if p)
        lines.append(f"| {r['type']} | {r['status']} | " + " | ".join(cells) + f" | {notes.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=None, help="comma-separated model types (default: all); printed only")
    ap.add_argument("--out", default=str(ROOT / "docs" / "zoo.md"), help="the table (full runs only)")
    ap.add_argument("--render", action="store_true", help="rewrite the table from its JSON, running nothing")
    args = ap.parse_args(argv)
    if args.render:
        table = json.loads(Path(args.out).with_suffix(".json").read_text())
        Path(args.out).write_text(markdown(table["rows"], table["transformers"]))
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    types = args.types.split(",") if args.types else model_types()
    rows = []
    for t in types:
        t0 = time.perf_counter()
        try:
            row = check_type(t)
        except Exception as err:  # a crash in the tool itself is a row too, never a lost sweep
            row = {"type": t, "status": "no small config", "reason": f"{type(err).__name__}: {err}"[:160],
                   "checks": {}, "notes": {"trace": traceback.format_exc(limit=1)[-200:]}}  # fmt: skip
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{t}: {row['status']} {row['checks']} {row['reason']} {row['notes']}", file=sys.stderr, flush=True)
    if args.types:
        return 0
    Path(args.out).write_text(markdown(rows, transformers.__version__))
    table = {"transformers": transformers.__version__, "rows": rows}
    Path(args.out).with_suffix(".json").write_text(json.dumps(table, indent=1, default=str) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
