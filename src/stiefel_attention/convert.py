"""`stiefelize(model)`: W_Q and W_K of the attention in models people already train, as frames.

Each supported attention module keeps its code, masks, rotary embeddings, caches and kernels. Only
the tensors that hold W_Q and W_K change: each becomes a torch parametrization
(`torch.nn.utils.parametrize`) whose originals are one frame per query head, (H, d_model, head_dim),
one per key-value head, (H_kv, d_model, head_dim), and, for fused projections (q, k and v in one
matrix), the rest of the matrix unchanged as an ordinary tensor. `frames(model)` then finds the
frame originals, so `StiefelAdam(param_groups(model, ...))` trains them; biases stay Euclidean.

Supported out of the box, one small adapter per layout of the weights rather than per model: separate
nn.Linear projections named q_proj/k_proj (Llama, Qwen, Mistral, Gemma, OPT, Phi and their kin; grouped- and
multi-query attention included), query/key (BERT, ViT), query_proj/key_proj (DeBERTa-v2), q/k (T5), q_lin/k_lin,
Wq/Wk, project_q/project_k; fused q | k | v weights: GPT-2's Conv1D c_attn, nn.Linear c_attn (nanoGPT,
GPT-BigCode with multi-query), qkv (timm), Wqkv (MPT); q, k, v grouped per key-value head in
query_key_value (GPT-NeoX, Bloom, Persimmon, Falcon) and in_proj (DeBERTa); q, v, k in the mp_num partitions
of qkv_proj (CodeGen); per-head parameters (d, heads, head_dim) named q, k (XLNet); each head's queries beside
its output gate in one weight (Qwen3-Next's and Qwen3.5's q_proj, MiniCPM5's q_gate_proj: matched by class,
since the weights cannot tell it from a gate after all the queries); q_proj, k_proj wrapping an nn.Linear
(Moshi's MoshiLinear, matched by class); torch's `nn.MultiheadAttention` (packed `in_proj_weight`; also inside
`nn.TransformerEncoderLayer`). The heads are read from the module (num_heads,
num_attention_heads, n_heads, n_head, or its config) and the key heads from the key weight itself.
Linear-attention and state-space mixers (a module with the decay of a recurrent state, A_log or dt_bias) are
never matched, though some have a q_proj and a k_proj: no softmax reads them.
`docs/zoo.md` (tools/zoo.py) lists every transformers model type with what happens to it. Register another
layout with `register_adapter`; a model with no adapter is refused with the reason (`why_not`).
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import _guard
from .manifold import polar_retract, random_frame
from .nn import FrameParametrization, _rms_norm, frames

__all__ = [
    "FUNCTION_CHANGE_TOLERANCE",
    "NormalisedInput",
    "Projection",
    "plain_state_dict",
    "Adapter",
    "register_adapter",
    "adapters",
    "reset_frames",
    "stiefelize",
    "unstiefelize",
    "why_not",
    "StiefelizeError",
]

log = logging.getLogger("stiefel_attention")
INITS = ("orthonormal", "nearest", "svd")


class StiefelizeError(ValueError):
    """The model has no attention module stiefelize can convert, or one it cannot convert as configured."""


@dataclass(frozen=True)
class Projection:
    """Where W_Q and/or W_K of one attention module live in one weight tensor.

    owner.<name> is the weight; `rows`: an nn.Linear weight (out, in), used as x W^T; otherwise a
    Conv1D weight (in, out), used as x W. `pieces` lists the blocks along the output dimension in
    order: ("q", n_heads) and ("k", n_kv_heads) are frames of head_dim columns each, ("rest", size)
    is left as it is (the V part of a fused projection). `interleaved`: the pieces repeat key-value head by
    key-value head instead, each group holding its query heads, its key head and its share of the rest
    (Falcon's fused query_key_value; with a key head per query head, q, k and v of each head side by side:
    GPT-NeoX, Bloom, Persimmon; with one, the plain q | k | v of multi-query attention); in a weight without
    keys, query head by query head (each head's queries beside its gate: Qwen3-Next's q_proj); or in `groups`
    partitions, each with its share of every piece (CodeGen's 4: queries, values, keys); needs rows.
    """

    owner: nn.Module
    name: str
    rows: bool
    pieces: tuple[tuple[str, int], ...]
    head_dim: int
    interleaved: bool = False
    per_head: bool = False  # the weight is (D, heads, head_dim), one matrix per head (XLNet), read as (D, units)
    groups: int = 0  # the groups an interleaved weight repeats, where not its key heads (CodeGen's partitions)

    @property
    def d_model(self) -> int:
        """The width of the input the weight reads."""
        weight = getattr(self.owner, self.name)
        return weight.shape[1] if self.rows else weight.shape[0]


@dataclass(frozen=True)
class Adapter:
    """One attention type: `matches(module)` and `projections(module)`."""

    name: str
    matches: Callable[[nn.Module], bool]
    projections: Callable[[nn.Module], list[Projection]]


_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Make stiefelize convert another attention type (tried before the built-in ones)."""
    _ADAPTERS.insert(0, adapter)


def adapters() -> list[Adapter]:
    return list(_ADAPTERS)


class StiefelProjection(FrameParametrization):
    """Assembles a projection weight from per-head frames (and, for fused weights, the untouched rest)."""

    def __init__(
        self, p: Projection, d_model: int, init: str, dtype: torch.dtype = torch.float32, temperature: bool = False
    ):
        super().__init__()
        self.rows, self.pieces, self.head_dim, self.d_model, self.init = p.rows, p.pieces, p.head_dim, d_model, init
        # temperature: one more original after the pieces', a log-temperature per query head (query heads scaled
        # by its exp); right_inverse sets it to 0 and stiefelize to the scale-preserving value
        self.n_query = sum(n for kind, n in p.pieces if kind == "q") if temperature else 0
        self.interleaved, self.per_head = p.interleaved, p.per_head
        heads = dict((kind, n) for kind, n in p.pieces if kind != "rest")
        self.groups = p.groups or heads.get("k", heads.get("q", 0))
        if p.interleaved and (not p.rows or self.groups < 1 or any(n % self.groups for n in heads.values())):
            raise StiefelizeError(
                "an interleaved projection needs an nn.Linear weight and its heads in whole groups (query heads "
                "per key head)"
            )
        self.frame_originals = tuple(i for i, (kind, _) in enumerate(p.pieces) if kind != "rest")
        # The weight is assembled in the dtype the module computes in (half precision models keep float32 frames
        # as master weights); a buffer, so that model.to(dtype) / .half() / .float() move it with the model.
        self.register_buffer("dtype_of_weight", torch.empty(0, dtype=dtype), persistent=False)

    def _width(self, kind: str, n: int) -> int:
        return n if kind == "rest" else n * self.head_dim

    def _split(self, weight: Tensor) -> list[Tensor]:
        """The weight's block of each piece, in the sequential layout ((units, D) rows, or (D, units))."""
        if self.per_head:
            weight = weight.reshape(weight.shape[0], -1)
        widths = [self._width(kind, n) for kind, n in self.pieces]
        if not self.interleaved:
            return list(weight.split(widths, dim=0 if self.rows else 1))
        groups = self._groups()
        shares = [w // groups for w in widths]  # each piece's units per key-value group
        width = weight.shape[-1]  # d_model for a weight, 1 for a bias seen as a column
        per_group = weight.reshape(groups, sum(shares), width).split(shares, dim=1)
        return [b.reshape(groups * share, width) for b, share in zip(per_group, shares)]

    def _join(self, blocks: list[Tensor]) -> Tensor:
        if not self.interleaved:
            return torch.cat(blocks, dim=0 if self.rows else 1)
        groups = self._groups()
        return torch.cat([b.reshape(groups, -1, self.d_model) for b in blocks], dim=1).reshape(-1, self.d_model)

    def _groups(self) -> int:
        """The groups an interleaved weight repeats: those the projection names, else its key-value heads (query
        heads h * g .. h * g + g - 1 share one), or, in a weight without keys, its query heads (each query head
        beside its share of the rest)."""
        return self.groups

    def heads(self, weight: Tensor) -> dict[str, Tensor]:
        """Each frame piece's heads in a weight of this layout, {"q": (H, D, r), "k": (Hkv, D, r)}."""
        out = {}
        for (kind, n), block in zip(self.pieces, self._split(weight)):
            if kind != "rest":
                out[kind] = (
                    block.reshape(n, self.head_dim, self.d_model).transpose(1, 2)
                    if self.rows
                    else block.reshape(self.d_model, n, self.head_dim).permute(1, 0, 2)
                )
        return out

    def head_biases(self, bias: Tensor) -> dict[str, Tensor]:
        """Each frame piece's bias per head, {"q": (H, r), "k": (Hkv, r)}, of a bias of this layout."""
        column = bias.reshape(-1, 1) if self.rows else bias.reshape(1, -1)
        return {
            kind: block.reshape(n, self.head_dim)
            for (kind, n), block in zip(self.pieces, self._split(column))
            if kind != "rest"
        }

    def forward(self, *originals: Tensor) -> Tensor:
        blocks = []
        log_temperature = originals[len(self.pieces)] if self.n_query else None
        for (kind, n), t in zip(self.pieces, originals):
            if kind == "q" and log_temperature is not None:
                t = t * log_temperature.exp().to(t.dtype).view(-1, 1, 1)
            if kind == "rest":
                blocks.append(t)
            elif self.rows:  # (n, D, r) -> (n*r, D): row h*r + j is column j of head h's frame
                blocks.append(t.transpose(1, 2).reshape(n * self.head_dim, self.d_model))
            else:  # (n, D, r) -> (D, n*r)
                blocks.append(t.permute(1, 0, 2).reshape(self.d_model, n * self.head_dim))
        out = self._join(blocks).to(self.dtype_of_weight.dtype)
        return out.reshape(self.d_model, -1, self.head_dim) if self.per_head else out

    def qk_change(self, before: Tensor, after: Tensor) -> float:
        """||W_QK' - W_QK||_F / ||W_QK||_F over the query and key blocks (the rest does not change); NaN on meta."""
        if before.is_meta:
            return float("nan")
        pairs = [
            (b, a) for (kind, _), b, a in zip(self.pieces, self._split(before), self._split(after)) if kind != "rest"
        ]
        diff = sum(float((a.double() - b.double()).square().sum()) for b, a in pairs)
        norm = sum(float(b.double().square().sum()) for b, _ in pairs)
        return (diff / norm) ** 0.5 if norm > 0 else float("inf")

    def nearest_originals(self, weight: Tensor) -> tuple[Tensor, ...]:
        """The originals of a plain weight with every head's frames its nearest ones (init="nearest")."""
        init, self.init = self.init, "nearest"
        try:
            return self.right_inverse(weight)
        finally:
            self.init = init

    def right_inverse(self, weight: Tensor) -> tuple[Tensor, ...]:
        out = []
        by_kind = self.heads(weight)
        for (kind, n), block in zip(self.pieces, self._split(weight)):
            if kind == "rest":
                out.append(block.detach().clone())
                continue
            heads = by_kind[kind].detach()  # (n, D, r)
            heads = heads.to(torch.float32 if heads.dtype in (torch.float16, torch.bfloat16) else heads.dtype)
            if self.init in ("nearest", "svd"):  # svd: stiefelize replaces these frames once it has both weights
                out.append(polar_retract(heads, torch.zeros_like(heads)).contiguous())
            else:
                out.append(random_frame(n, d=self.d_model, r=self.head_dim, dtype=heads.dtype, device=heads.device))
        if self.n_query:
            out.append(torch.zeros(self.n_query, dtype=out[0].dtype, device=out[0].device))
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# Built-in adapters
# ---------------------------------------------------------------------------------------------


def _first(obj, names: tuple[str, ...]):
    return next((getattr(obj, n) for n in names if getattr(obj, n, None)), None)


_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attn_heads")  # a module's names


def _heads(module: nn.Module) -> tuple[int, int, int]:
    """(query heads, key-value heads, head_dim or 0) from the usual attribute and config names."""
    config = getattr(module, "config", None)
    H = _first(module, _HEAD_COUNTS) or _first(config, ("num_attention_heads",))
    if H is None:
        raise StiefelizeError(f"{type(module).__name__}: cannot tell its number of heads")
    Hkv = _first(config, ("num_key_value_heads",)) or _first(
        module, ("num_key_value_heads", "num_kv_heads", "kv_n_heads")
    )
    if getattr(module, "multi_query", False):  # one key-value head shared by every query head
        Hkv = 1
    r = _first(module, ("head_dim", "attention_head_size", "head_size", "dim_head", "key_value_proj_dim"))
    return int(H), int(Hkv or H), int(r) if r else 0


def _has_heads(m: nn.Module) -> bool:
    return (
        _first(m, _HEAD_COUNTS) is not None or _first(getattr(m, "config", None), ("num_attention_heads",)) is not None
    )


# Parameters that hold the decay of a recurrent state: a module that has them (or whose direct child does, a
# forget gate) is a state-space or linear-attention mixer, whose q_proj and k_proj feed no softmax
_RECURRENT_STATE = ("A_log", "dt_bias")


def _recurrent(m: nn.Module) -> bool:
    own = [n for n, _ in m.named_parameters(recurse=False)]
    own += [n for c in m.children() for n, _ in c.named_parameters(recurse=False)]
    return any(n in _RECURRENT_STATE for n in own)


def _query_and_key(m: nn.Module, q: nn.Linear, k: nn.Linear, q_name: str, k_name: str) -> list[Projection]:
    """W_Q in q (the module's query heads), W_K in k (whole key heads of the same width)."""
    H, _, r = _heads(m)
    r = r or q.out_features // H
    Hkv = k.out_features // r  # from the weight itself: a config's key-value heads may not apply to this module
    if q.out_features != H * r or k.out_features != Hkv * r:
        raise StiefelizeError(
            f"{type(m).__name__}: {q_name} has {q.out_features} and {k_name} {k.out_features} outputs, not "
            f"{H} query heads and whole key heads of {r}: a layout no adapter knows (e.g. a gate per head "
            f"beside the queries); register one with register_adapter"
        )
    return [Projection(q, "weight", True, (("q", H),), r), Projection(k, "weight", True, (("k", Hkv),), r)]


def _separate(q_name: str, k_name: str) -> Adapter:
    def matches(m: nn.Module) -> bool:
        q, k = getattr(m, q_name, None), getattr(m, k_name, None)
        return isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and _has_heads(m)

    def projections(m: nn.Module) -> list[Projection]:
        return _query_and_key(m, getattr(m, q_name), getattr(m, k_name), q_name, k_name)

    return Adapter(f"separate nn.Linear {q_name}, {k_name}", matches, projections)


def _wrapped(q_name: str, k_name: str, inner: str, classes: tuple[tuple[str, str], ...], label: str) -> Adapter:
    """q_proj and k_proj as wrappers whose forward is their nn.Linear `inner` alone (Moshi's MoshiLinear), matched
    by class since a wrapper's forward may do more. A wrapper holding anything else (Moshi's depth decoder: one
    weight per codebook) is refused, and with it the model."""
    known = _instance_of(classes)

    def matches(m: nn.Module) -> bool:
        return all(known(getattr(m, n, None)) for n in (q_name, k_name)) and _has_heads(m)

    def projections(m: nn.Module) -> list[Projection]:
        q, k = getattr(getattr(m, q_name), inner, None), getattr(getattr(m, k_name), inner, None)
        if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear)):
            raise StiefelizeError(
                f"{type(m).__name__}: its {q_name}.{inner} is {type(q).__name__}, not an nn.Linear (e.g. one "
                f"weight per codebook), which no adapter reads; convert the parts of the model without such "
                f"modules (e.g. stiefelize(model.decoder)) or register an adapter"
            )
        return _query_and_key(m, q, k, f"{q_name}.{inner}", f"{k_name}.{inner}")

    return Adapter(label, matches, projections)


def _fused(
    attr: str, rows: bool, label: str, needs: Callable[[nn.Module], bool] = lambda m: True, interleaved: bool = False
) -> Adapter:
    """q | k | rest in one weight: the q heads, then the key-value heads, then the rest (V); or, interleaved,
    head by head."""

    def matches(m: nn.Module) -> bool:
        return hasattr(m, attr) and isinstance(getattr(m, attr), nn.Module) and needs(m)

    def projections(m: nn.Module) -> list[Projection]:
        H, _, r = _heads(m)
        fused = getattr(m, attr)
        D, out = fused.weight.shape[1 if rows else 0], fused.weight.shape[0 if rows else 1]
        r = r or D // H
        Hkv = (out // r - H) // 2  # q, then k and v with as many heads each: from the weight, whatever the config
        if Hkv < 1 or out != (H + 2 * Hkv) * r:
            raise StiefelizeError(
                f"{type(m).__name__}: {attr} has {out} outputs, not {H} query heads of {r} and as many key as value "
                "heads"
            )
        return [Projection(fused, "weight", rows, (("q", H), ("k", Hkv), ("rest", Hkv * r)), r, interleaved)]

    return Adapter(label, matches, projections)


def _instance_of(classes: tuple[tuple[str, str], ...]) -> Callable[[nn.Module], bool]:
    """Whether a module is one of these classes, given as (module path, class name); a class whose module was
    never imported has no instances, so nothing is imported here."""

    def matches(m: nn.Module) -> bool:
        found = (getattr(sys.modules.get(path), name, None) for path, name in classes)
        return any(isinstance(m, cls) for cls in found if isinstance(cls, type))

    return matches


def _gated_queries(q_name: str, k_name: str, classes: tuple[tuple[str, str], ...], label: str) -> Adapter:
    """Queries and an output gate in one nn.Linear, head by head: each head's r query units, then its r gate
    units (the module's forward views the output as (heads, 2 r) and halves the last axis); keys separate. The
    weights alone cannot tell this from a gate after all the queries (a per-block layout), so the adapter matches
    only classes whose forward is known to read it per head."""
    known = _instance_of(classes)

    def matches(m: nn.Module) -> bool:
        q, k = getattr(m, q_name, None), getattr(m, k_name, None)
        return isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and _has_heads(m) and known(m)

    def projections(m: nn.Module) -> list[Projection]:
        H, _, r = _heads(m)
        q, k = getattr(m, q_name), getattr(m, k_name)
        r = r or q.out_features // (2 * H)
        if q.out_features != 2 * H * r or k.out_features % r:
            raise StiefelizeError(
                f"{type(m).__name__}: {q_name} has {q.out_features} outputs and {k_name} {k.out_features}, not "
                f"{H} heads of {r} queries and {r} gate units each, and whole key heads of {r}"
            )
        return [
            Projection(q, "weight", True, (("q", H), ("rest", H * r)), r, interleaved=True),
            Projection(k, "weight", True, (("k", k.out_features // r),), r),
        ]

    return Adapter(label, matches, projections)


def _partitioned(attr: str) -> Adapter:
    """q, v, k in mp_num partitions of one nn.Linear, each holding its share of the query heads, then of the
    values, then of the key heads, in head order (CodeGen, which names its partitions mp_num)."""

    def matches(m: nn.Module) -> bool:
        parts, fused = getattr(m, "mp_num", None), getattr(m, attr, None)
        return isinstance(parts, int) and isinstance(fused, nn.Linear) and _has_heads(m)

    def projections(m: nn.Module) -> list[Projection]:
        H, _, r = _heads(m)
        fused, parts = getattr(m, attr), m.mp_num
        r = r or fused.in_features // H
        if fused.out_features != 3 * H * r or H % parts:
            raise StiefelizeError(
                f"{type(m).__name__}: {attr} has {fused.out_features} outputs, not queries, values and keys of {H} "
                f"heads of {r} in {parts} partitions"
            )
        pieces = (("q", H), ("rest", H * r), ("k", H))
        return [Projection(fused, "weight", True, pieces, r, interleaved=True, groups=parts)]

    return Adapter(f"fused nn.Linear {attr}, q | v | k in mp_num partitions (CodeGen)", matches, projections)


def _per_head_parameters(q_name: str, k_name: str) -> Adapter:
    """W_Q, W_K as parameters of shape (D, heads, head_dim) that the module applies itself (XLNet's q, k)."""

    def matches(m: nn.Module) -> bool:
        q, k = getattr(m, q_name, None), getattr(m, k_name, None)
        return all(isinstance(t, nn.Parameter) and t.dim() == 3 for t in (q, k)) and _has_heads(m)

    def projections(m: nn.Module) -> list[Projection]:
        q, k = getattr(m, q_name), getattr(m, k_name)
        r = q.shape[2]
        return [
            Projection(m, q_name, False, (("q", q.shape[1]),), r, per_head=True),
            Projection(m, k_name, False, (("k", k.shape[1]),), r, per_head=True),
        ]

    return Adapter(
        f"per-head parameters {q_name}, {k_name} of shape (d, heads, head_dim) (XLNet)", matches, projections
    )


def _linear(attr: str) -> Callable[[nn.Module], bool]:
    return lambda m: isinstance(getattr(m, attr), nn.Linear) and _has_heads(m)


def _mha_projections(m: nn.MultiheadAttention) -> list[Projection]:
    if not m._qkv_same_embed_dim:
        raise StiefelizeError(
            "nn.MultiheadAttention with kdim/vdim != embed_dim keeps separate q/k/v weights; "
            "stiefelize supports the packed in_proj_weight (kdim = vdim = embed_dim)"
        )
    H, D = m.num_heads, m.embed_dim
    return [Projection(m, "in_proj_weight", True, (("q", H), ("k", H), ("rest", D)), D // H)]


for _adapter in (
    Adapter(
        "torch.nn.MultiheadAttention (packed in_proj_weight)",
        lambda m: isinstance(m, nn.MultiheadAttention),
        _mha_projections,
    ),
    _fused(
        "c_attn",
        rows=False,
        label="GPT-2 attention (fused Conv1D c_attn)",
        needs=lambda m: type(getattr(m, "c_attn")).__name__ == "Conv1D",
    ),
    _fused(
        "c_attn",
        rows=True,
        label="fused nn.Linear c_attn, q | k | v (nanoGPT; GPT-BigCode with multi-query)",
        needs=_linear("c_attn"),
    ),
    _fused("qkv", rows=True, label="fused nn.Linear qkv, q | k | v (timm Attention)", needs=_linear("qkv")),
    _fused("Wqkv", rows=True, label="fused nn.Linear Wqkv, q | k | v (MPT)", needs=_linear("Wqkv")),
    _partitioned("qkv_proj"),
    _fused(
        "qkv_proj",
        rows=True,
        label="fused nn.Linear qkv_proj, q | k | v with key-value heads (Phi-3)",
        # a plain q | k | v split only where the config names its key-value heads (CodeGen's qkv_proj, which
        # interleaves 4 groups of q, v, k, has none)
        needs=lambda m: _linear("qkv_proj")(m) and _first(getattr(m, "config", None), ("num_key_value_heads",)),
    ),
    _fused(
        "query_key_value",
        rows=True,
        label="fused nn.Linear query_key_value, grouped per key-value head (GPT-NeoX, Bloom, Persimmon, Falcon)",
        needs=_linear("query_key_value"),
        interleaved=True,
    ),
    _fused(
        "in_proj",
        rows=True,
        label="fused nn.Linear in_proj, q, k, v side by side per head (DeBERTa)",
        # DeBERTa's disentangled attention: its query and value biases, kept apart, mark the layout (the
        # in_proj of a state-space block, Mamba-2's say, has none)
        needs=lambda m: _linear("in_proj")(m) and isinstance(getattr(m, "q_bias", None), nn.Parameter),
        interleaved=True,
    ),
    _per_head_parameters("q", "k"),
    _gated_queries(
        "q_proj",
        "k_proj",
        (
            ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextAttention"),
            ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Attention"),
            ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeAttention"),
        ),
        "q_proj with each head's queries beside its output gate, k_proj (Qwen3-Next, Qwen3.5)",
    ),
    _gated_queries(
        "q_gate_proj",
        "k_proj",
        (("transformers.models.minicpm5_moe.modeling_minicpm5_moe", "MiniCPM5MoeAttention"),),
        "q_gate_proj with each head's queries beside its output gate, k_proj (MiniCPM5-MoE)",
    ),
    _wrapped(
        "q_proj",
        "k_proj",
        "linear",
        (("transformers.models.moshi.modeling_moshi", "MoshiLinear"),),
        "q_proj, k_proj wrapping an nn.Linear (Moshi's MoshiLinear)",
    ),
    _separate("q_proj", "k_proj"),
    _separate("query", "key"),
    _separate("q_lin", "k_lin"),
    _separate("Wq", "Wk"),
    _separate("project_q", "project_k"),
    _separate("query_proj", "key_proj"),
    _separate("q", "k"),
):
    _ADAPTERS.append(_adapter)


# ---------------------------------------------------------------------------------------------
# The conversion
# ---------------------------------------------------------------------------------------------


def _find(model: nn.Module) -> list[tuple[str, nn.Module, Adapter]]:
    found, claimed = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue  # inside an attention module already converted (e.g. a q_proj of a matched parent)
        adapter = next((a for a in _ADAPTERS if a.matches(module)), None)
        if adapter is None or _recurrent(module):  # linear attention, a state-space mixer: its q, k feed no softmax
            continue
        found.append((name, module, adapter))
        claimed.add(name)
    return found


def why_not(model: nn.Module) -> str:
    """Why no adapter matched anything in model, as far as its modules tell."""
    names = {type(m).__name__ for m in model.modules()}
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    mixers = {id(m) for m in model.modules() if _recurrent(m)}
    attention = sorted(
        {type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__ and id(m) not in mixers}
    )
    recurrent = ("Mamba", "Rwkv", "Mixer", "XLSTM", "xLSTM", "Recurrent", "Ssm", "Mlstm")
    recurrent_mixers = bool(mixers) or any(k in n for n in names for k in recurrent)
    if recurrent_mixers and all(any(k in n for k in recurrent) for n in attention):  # no softmax kind is left
        return "it has no softmax attention (state-space or recurrent layers)"
    if "kv_a_proj_with_mqa" in linears or "q_a_proj" in linears:
        return (
            "its attention is multi-head latent attention, whose W_Q and W_K are low-rank factorisations "
            "(q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj), not per-head matrices a frame can replace"
        )
    if not attention:
        return "it has no attention module"
    mods = [m for m in model.modules() if type(m).__name__ in attention]
    routed = sorted({f"{type(m).__name__}.{n} ({type(c).__name__})" for m in mods for n, c in m.named_children()
                     if n == "experts"})  # fmt: skip
    if routed:
        return (
            f"its queries come from a mixture of experts, {', '.join(routed)}: a W_Q routed token by token, not "
            "one per head"
        )
    wrapped = sorted({f"{type(m).__name__}.{n} ({type(c).__name__})" for m in mods for n, c in m.named_children()
                      if n in ("q_proj", "k_proj") and not isinstance(c, nn.Linear)})  # fmt: skip
    if wrapped:
        return (
            f"its W_Q, W_K are {', '.join(wrapped)}: modules of their own, not nn.Linear weights, and no adapter "
            "knows what they compute around their weights; register one with register_adapter"
        )
    kids = sorted({n for m in mods for n, c in m.named_children() if isinstance(c, nn.Linear)})
    return f"no adapter knows the layout of {', '.join(attention)} (linear layers: {', '.join(kids) or 'none'})"


class NormalisedInput:
    """Forward pre-hook of a query or key projection: it reads x / rms(x) over the last dimension, with no gain
    (`stiefelize(qk_input_norm=True)`, the converted counterpart of `StiefelAttention(qk_input_norm=True)`)."""

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (_rms_norm(args[0]), *args[1:])


def _input_norm_refusal(name: str, projections: list[Projection]) -> str | None:
    """Why qk_input_norm cannot be given to this module's projections (None: it can)."""
    for p in projections:
        kinds = [kind for kind, _ in p.pieces]
        if kinds not in (["q"], ["k"]):
            shared = "the values" if "rest" in kinds and "k" in kinds else "another block"
            shares = ", ".join(f"{kind} ({n})" for kind, n in p.pieces)
            return (
                f"{name}: qk_input_norm normalises the input of the query and key projections only, and "
                f"{type(p.owner).__name__}.{p.name} computes {shares} from one input, so {shared} would read the "
                "normalised input too (a fused layout); it needs separate query and key projections"
            )
        if p.name != "weight":
            return (
                f"{name}: qk_input_norm normalises the first argument of the module that owns each projection "
                f"(nn.Linear, Conv1D), and {type(p.owner).__name__}.{p.name} is not applied that way"
            )
    return None


def stiefelize(
    model: nn.Module,
    init: str = "orthonormal",
    *,
    temperature: bool = False,
    calibrate: Callable | None = None,
    qk_input_norm: bool = False,
) -> nn.Module:
    """Re-parameterise W_Q and W_K of every supported attention module as frames, in place; returns model.

    init="orthonormal" draws fresh Haar-random frames (training from scratch; uses the global RNG).
    init="nearest" takes the polar factor of each head's current W_Q, W_K (fine-tuning): the closest
    frame in Frobenius norm. Unless those weights were already orthonormal per head this changes the
    function; how much is logged and recorded in `model.stiefelize_report` (per converted weight, the
    relative change ||W' - W||_F / ||W||_F of its query and key blocks). Weights initialised at small
    scale (std 0.02, as Hugging Face models are) change a lot: a frame's columns have unit norm, so the
    attention logits grow accordingly. init="svd" (one key head per query head) takes each head's best
    frames for its bilinear form W_Q W_K^T instead: Q_h, K_h the top-r singular vectors of W_Q,h W_K,h^T,
    which with one scalar per head (temperature=True) give the closest s Q K^T in Frobenius norm. That is
    exact for the bilinear form only: a model that rotates q and k between projection and product (rotary
    embeddings) or adds biases to them computes something else, and there svd can do worse than nearest.

    temperature=True adds one learnable log-temperature per query head (an ordinary parameter, trained by
    the AdamW groups of `param_groups`, not decayed), whose exp scales that head's query frame. It starts
    at the scalar that keeps the head's bilinear form closest to the original, <W_Q W_K^T, Q K^T>_F / r (for
    nearest frames, the logit scale the polar factors drop). With `calibrate`, a callable that runs the model on
    a few typical inputs (`calibrate(model)`, called once under no_grad before anything is converted), each
    temperature starts instead at the least-squares scalar between the head's logits before and after
    conversion on the inputs its projections saw (in eval mode), biases included: it keeps the logits on data,
    where the bilinear form weighs every direction alike (a head whose best scalar is not positive starts at a
    thousandth of its bilinear-form scale: nearly uniform attention, still trainable). Logits are compared
    before any rotary embedding, which a scalar cannot follow anyway. Each projection's weight must be applied
    to its module's first argument (nn.Linear, transformers' Conv1D; not nn.MultiheadAttention's packed weight).

    qk_input_norm=True makes the query and key projections read their input through an RMS normalisation with no
    gain (a forward pre-hook on each; the values, and everything else, read the input as before), so that every
    logit q . k / sqrt(r) of a bias-free head is bounded by d_model / sqrt(r) times the temperature, whatever the
    input: the bound of `StiefelAttention(qk_input_norm=True)`. Rotary embeddings rotate q and k and keep the bound;
    biases and a model's own q/k norms with gains add what they add. Only layouts where queries and keys have their
    own projection (q_proj/k_proj and kin) take it: a fused q | k | v weight is refused, since its values read the
    same input. `unstiefelize` removes the hooks with the parametrizations.

    Frames are kept in float32 (or the model's float64); a half-precision model keeps float32 frames as
    master weights.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if calibrate is not None and not temperature:
        raise ValueError("calibrate sets each head's temperature: pass temperature=True with it")
    if temperature and init == "orthonormal":
        raise ValueError(
            "temperature=True starts each head's scale from its current W_Q, W_K: use init='nearest' or 'svd' "
            "(fresh orthonormal frames have no scale to keep)"
        )
    converted_before = _converted_weights(model)
    if converted_before:
        raise StiefelizeError(
            f"{type(model).__name__} is already stiefelized, in part or in whole "
            f"({_count(len(converted_before), 'weight')} with frames, e.g. {converted_before[0]}); nothing was "
            "converted. To convert it again (another init, "
            "temperature or qk_input_norm), call unstiefelize(model) first."
        )
    found = _find(model)
    if not found:
        supported = "; ".join(a.name for a in _ADAPTERS)
        raise StiefelizeError(
            f"stiefelize found no supported attention module in {type(model).__name__}: {why_not(model)}. "
            f"Supported: {supported}. Register another type with stiefel_attention.convert.register_adapter("
            "Adapter(name, matches, projections)), where projections(module) says which weight holds W_Q and W_K "
            "(a Projection)."
        )
    # Every module is checked before any is converted: a refusal leaves the model as it was.
    planned = [(name, module, adapter, adapter.projections(module)) for name, module, adapter in found]
    for name, _, _, projections in planned:
        for p in projections:
            if parametrize.is_parametrized(p.owner, p.name):
                raise StiefelizeError(
                    f"{name}: {p.name} is already parametrized (stiefelize twice?); nothing was converted"
                )
            if p.head_dim > p.d_model:
                raise StiefelizeError(
                    f"{name}: heads of {p.head_dim} dimensions read a {p.d_model}-dimensional input; a frame on "
                    f"St(d, r) needs r <= d, so W_Q, W_K cannot be frames; nothing was converted"
                )
        if qk_input_norm and (why := _input_norm_refusal(name, projections)) is not None:
            raise StiefelizeError(f"{why}; nothing was converted")
        if init == "svd" or temperature:
            counts = {kind: [n for p in projections for k, n in p.pieces if k == kind] for kind in ("q", "k")}
            if len(counts["q"]) != 1 or len(counts["k"]) != 1:
                raise StiefelizeError(
                    f"{name}: init={init!r} and temperature={temperature} pair each query head with its key head, "
                    f"and this module's weights hold {len(counts['q'])} query and {len(counts['k'])} key blocks, "
                    "not one each; nothing was converted"
                )
            if init == "svd" and counts["q"] != counts["k"]:
                raise StiefelizeError(
                    f"{name}: init='svd' needs one key head per query head ({counts['q'][0]} query heads share "
                    f"{counts['k'][0]} key heads); use init='nearest' (with temperature=True to keep each head's "
                    "scale); nothing was converted"
                )
    inputs = _capture_inputs(model, planned, calibrate) if calibrate is not None else None
    report = {}
    for name, module, adapter, projections in planned:
        converted = []
        for p in projections:
            weight = getattr(p.owner, p.name)
            before = weight.detach().clone()
            param = StiefelProjection(p, p.d_model, init, dtype=weight.dtype, temperature=temperature)
            parametrize.register_parametrization(p.owner, p.name, param, unsafe=True)
            converted.append((p, param, before))
            originals = {id(t) for t in p.owner.parametrizations[p.name].parameters()}
            if id(weight) not in originals:  # an optimizer built before now holds a tensor the model no longer uses
                owner = next(n for n, m in model.named_modules() if m is p.owner)
                _guard.mark_replaced(
                    [(".".join(x for x in (owner, p.name) if x), weight)],
                    "stiefelize(model)",
                    "Build the optimizer after stiefelize: StiefelAdam(param_groups(model), ...).",
                )
        if init == "svd" or temperature:
            _fit_heads(converted, init == "svd", temperature, inputs)
        for p, _, _ in converted:
            p.owner.register_load_state_dict_pre_hook(_LoadsPlainLayout(p.name))
            if qk_input_norm:
                p.owner.register_forward_pre_hook(NormalisedInput())
        for p, param, before in converted:
            owner = next(n for n, m in module.named_modules() if m is p.owner)
            report[".".join(x for x in (name, owner, p.name) if x)] = {
                "adapter": adapter.name,
                "relative_change": param.qk_change(before, getattr(p.owner, p.name).detach()),
            }
    model.stiefelize_report = report
    frames(model)  # marks the new frames, under their names in the model (_guard)
    _save_plain_layout(model)
    if init != "orthonormal":
        worst = max(report.items(), key=lambda kv: kv[1]["relative_change"])
        changed = worst[1]["relative_change"] > FUNCTION_CHANGE_TOLERANCE
        log.log(
            logging.WARNING if changed else logging.INFO,
            f"stiefelize(init={init!r}) changed W_Q, W_K of %d weights by up to %.3g (relative, %s): "
            + ("the function changes" if changed else "the same function, to float round-off"),
            len(report),
            worst[1]["relative_change"],
            worst[0],
        )
    return model


# The relative change of W_Q, W_K below which init="nearest" or "svd" is said to keep the function: heads that
# were orthonormal in float32 move by a few 1e-7 (their round-off), and a change of 1e-5 moves logits by as much.
FUNCTION_CHANGE_TOLERANCE = 1e-5


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _converted_weights(model: nn.Module) -> list[str]:
    """Qualified names of the weights of model that stiefelize parametrized."""
    return [
        f"{name}.{tensor}" if name else tensor
        for name, module in model.named_modules()
        if parametrize.is_parametrized(module)
        for tensor, plist in module.parametrizations.items()
        if any(isinstance(q, StiefelProjection) for q in plist)
    ]


def plain_state_dict(model: nn.Module, keep_frames: bool = False) -> dict[str, Tensor]:
    """model.state_dict() with every stiefelized weight in the plain layout of the original architecture: the key
    `<module>.<weight>` holding the weight the frames (and temperatures) assemble, in place of (keep_frames: beside)
    its `<module>.parametrizations.<weight>.original<i>` keys. A plain model loads it (`from_pretrained`), and
    `stiefelize(init="nearest")` then restores the frames."""
    state = model.state_dict()
    for name in _converted_weights(model):
        module_name, _, tensor = name.rpartition(".")
        module = model.get_submodule(module_name)
        prefix = f"{module_name}.parametrizations.{tensor}." if module_name else f"parametrizations.{tensor}."
        if not keep_frames:
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
        state[name] = getattr(module, tensor).detach()
    return state


def _save_plain_layout(model: nn.Module) -> None:
    """Give a model with `save_pretrained` (Hugging Face) one that writes both layouts, unless its caller passes a
    state_dict of its own: the plain weights, which the original architecture's `from_pretrained` loads (it reports
    the frame keys as unused), and the frames, which a stiefelized model loads exactly (the Trainer's resume).
    `unstiefelize` takes it away."""
    save = getattr(type(model), "save_pretrained", None)
    if save is None or "save_pretrained" in vars(model):
        return

    def save_pretrained(self, *args, state_dict=None, **kwargs):
        state = plain_state_dict(self, keep_frames=True) if state_dict is None else state_dict
        return save(self, *args, state_dict=state, **kwargs)

    model.save_pretrained = types.MethodType(save_pretrained, model)


class _LoadsPlainLayout:
    """Load-state-dict pre-hook of a stiefelized weight's owner. Where a state dict holds both layouts (what
    `save_pretrained` writes), the frames are loaded and the plain weight is dropped; where it holds the plain weight
    only (a checkpoint of the original architecture), the weight is loaded as its nearest frames, as
    `stiefelize(init="nearest")` would take them."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        if not parametrize.is_parametrized(module, self.name):  # unstiefelized since: an ordinary weight again
            return
        plain = prefix + self.name
        if plain not in state_dict:
            return
        weight = state_dict.pop(plain)
        originals = f"{prefix}parametrizations.{self.name}."
        if any(k.startswith(originals) for k in state_dict):
            return
        param = next(p for p in module.parametrizations[self.name] if isinstance(p, StiefelProjection))
        if param.n_query:
            errors.append(
                f"{plain} is in the plain layout, which holds each head's temperature folded into its weight: it "
                "cannot restore the log-temperatures; load it into the plain model, then stiefelize(model, "
                "init='nearest', temperature=True)"
            )
            return
        for i, t in enumerate(param.nearest_originals(weight)):
            state_dict[f"{originals}original{i}"] = t


def _original(p: Projection, index: int) -> nn.Parameter:
    return getattr(p.owner.parametrizations[p.name], f"original{index}")


def _capture_inputs(model: nn.Module, planned: list, calibrate: Callable) -> dict[int, list[Tensor]]:
    """The inputs every projection's owner receives while calibrate(model) runs (id(owner) -> one per call)."""
    owners = {id(p.owner): (f"{name}: {type(p.owner).__name__}", p) for name, _, _, ps in planned for p in ps}
    for where, p in owners.values():
        if p.name != "weight":  # e.g. nn.MultiheadAttention's in_proj_weight: its key input is another argument
            raise StiefelizeError(
                f"{where}: calibrate reads each projection's input as the first argument of the module that owns "
                f"its weight (nn.Linear, Conv1D), and this module's {p.name} is not applied that way; nothing was "
                "converted"
            )
    seen: dict[int, list[Tensor]] = {key: [] for key in owners}

    def hook(module, args):
        where, p = owners[id(module)]
        if not args or not isinstance(args[0], Tensor) or args[0].shape[-1] != p.d_model:
            raise StiefelizeError(
                f"{where}: calibrate needs the projection applied to the module's first argument (a tensor of "
                f"width {p.d_model}), as nn.Linear does; nothing was converted"
            )
        seen[id(module)].append(args[0].detach())

    handles = [p.owner.register_forward_pre_hook(hook) for _, (_, p) in owners.items()]
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # no dropout in the statistics
        with torch.no_grad():
            calibrate(model)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    missing = [where for key, (where, _) in owners.items() if not seen[key]]
    if missing:
        raise StiefelizeError(f"calibrate(model) did not run {', '.join(missing)}; nothing was converted")
    for name, _, _, projections in planned:  # each query input is paired with the key input of the same call
        calls = {kind: len(seen[id(p.owner)]) for p in projections for kind, _ in p.pieces if kind != "rest"}
        if calls.get("q") != calls.get("k"):
            raise StiefelizeError(
                f"{name}: during calibrate its query projection ran {calls.get('q')} times and its key projection "
                f"{calls.get('k')} times, so their inputs cannot be paired (a key cache?); run plain forward passes "
                "without a cache; nothing was converted"
            )
    return seen


def _least_squares_scale(q_frame, k_frame, wq, wk, biases, xs_q, xs_k) -> Tensor:
    """Per query head, s minimising sum ||L - (s A + C)||^2 over the calibration calls, where L = q k^T before
    conversion, A = (x Q_h) k'^T and C = b_q k'^T after (k' = x K_g + b_k): the scaled part is the frame's."""
    bq, bk = biases
    num = torch.zeros(q_frame.shape[0], dtype=q_frame.dtype, device=q_frame.device)
    den = torch.zeros_like(num)
    group = q_frame.shape[0] // k_frame.shape[0]
    for xq, xk in zip(xs_q, xs_k):
        xq, xk = xq.to(q_frame.dtype).reshape(-1, *xq.shape[-2:]), xk.to(q_frame.dtype).reshape(-1, *xk.shape[-2:])
        q_old = torch.einsum("bnd,hdr->bhnr", xq, wq) + bq[:, None]  # (B, H, N, r)
        k_old = (torch.einsum("bmd,gdr->bgmr", xk, wk) + bk[:, None]).repeat_interleave(group, dim=1)
        q_frame_part = torch.einsum("bnd,hdr->bhnr", xq, q_frame)
        k_new = (torch.einsum("bmd,gdr->bgmr", xk, k_frame) + bk[:, None]).repeat_interleave(group, dim=1)
        target = q_old @ k_old.mT - bq[:, None] @ k_new.mT  # (B, H, N, M)
        a = q_frame_part @ k_new.mT
        num += (target * a).sum((0, 2, 3))
        den += a.square().sum((0, 2, 3))
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)


@torch.no_grad()
def _fit_heads(
    converted: list[tuple[Projection, StiefelProjection, Tensor]],
    svd: bool,
    temperature: bool,
    inputs: dict[int, list[Tensor]] | None = None,
) -> None:
    """One attention module's joint initialisation, from its weights before conversion.

    svd: frames Q_h, K_h = the top-r singular vectors of W_Q,h W_K,h^T (from QR factors, never a D x D matrix).
    temperature: the log of s_h = <W_Q,h W_K,g^T, Q_h K_g^T>_F / r, the scalar that brings query head h's
    bilinear form closest to the original, g its key head (query heads in order share key heads in whole
    groups); with inputs, the least-squares scalar of the head's logits on them instead.
    """
    where = {}  # kind -> (frame original, heads before conversion (n, D, r), biases (n, r), owner's inputs)
    for p, param, before in converted:
        heads = param.heads(before)
        bias = getattr(p.owner, "bias", None) if p.name == "weight" else None
        biases = param.head_biases(bias.detach()) if isinstance(bias, Tensor) else {}
        for i, (kind, n) in enumerate(p.pieces):
            if kind != "rest":
                frame = _original(p, i)
                b = biases.get(kind, torch.zeros(n, p.head_dim)).to(frame)
                where[kind] = (frame, heads[kind].to(frame.dtype), b, inputs[id(p.owner)] if inputs else None)
    (q_frame, wq, bq, xs_q), (k_frame, wk, bk, xs_k) = where["q"], where["k"]
    if svd:
        qa, ra = torch.linalg.qr(wq)  # W_Q = Qa Ra, W_K = Qb Rb, so W_Q W_K^T = Qa (Ra Rb^T) Qb^T
        qb, rb = torch.linalg.qr(wk)
        u, _, vh = torch.linalg.svd(ra @ rb.transpose(-2, -1))
        q_frame.copy_(qa @ u)
        k_frame.copy_(qb @ vh.transpose(-2, -1))
    if temperature:
        k_of = torch.arange(q_frame.shape[0], device=q_frame.device) // (q_frame.shape[0] // k_frame.shape[0])
        pk = k_frame.transpose(-2, -1) @ wk  # (Hkv, r, r): K^T W_K
        pq = wq.transpose(-2, -1) @ q_frame  # (H, r, r): W_Q^T Q
        scale = (pk[k_of] * pq.transpose(-2, -1)).sum((-2, -1)) / q_frame.shape[-1]  # tr(K^T W_K W_Q^T Q) / r
        if xs_q is not None:  # the best positive scalar is max(s, 0): a head whose s is not positive starts near 0,
            # at a thousandth of its bilinear-form scale, where its log-temperature can still train
            fitted = _least_squares_scale(q_frame, k_frame, wq, wk, (bq, bk), xs_q, xs_k)
            scale = torch.where(fitted > 1e-3 * scale, fitted, 1e-3 * scale)
        p = next(p for p, _, _ in converted if any(kind == "q" for kind, _ in p.pieces))
        _original(p, len(p.pieces)).copy_(scale.clamp_min(torch.finfo(scale.dtype).tiny).log())


@torch.no_grad()
def reset_frames(model: nn.Module) -> nn.Module:
    """Draw every frame of the model afresh (Haar-random, in place, on its device); returns model.

    Covers the W_Q, W_K of `StiefelAttention` (qk="stiefel" or "frozen") and the frame originals of
    `stiefelize`d modules. For a model built on the meta device and then `to_empty`-ed, whose memory is
    uninitialised: initialise the rest as the model does (its own init, `reset_parameters`), then call this.
    A fused projection's other block (its V part) is an ordinary tensor and is not touched here.
    """
    from .nn import frames

    for _, p in frames(model, include_frozen=True):
        p.copy_(random_frame(*p.shape[:-2], d=p.shape[-2], r=p.shape[-1], dtype=p.dtype, device=p.device))
    return model


def unstiefelize(model: nn.Module) -> nn.Module:
    """Bake every stiefelize parametrization back into a plain weight (the current frames), in place.

    The model then saves and loads like the original architecture (e.g. `save_pretrained`); a later
    `stiefelize(model, init="nearest")` restores the frames exactly, since the heads are orthonormal.
    Safe on a `copy.deepcopy` of a converted model: the original keeps its parametrizations. The input norm of
    `stiefelize(qk_input_norm=True)` is removed too.
    """
    for module_name, module in list(model.named_modules()):
        if not parametrize.is_parametrized(module):
            continue
        # A deep copy shares torch's per-instance parametrized class with its original, and removing a
        # parametrization deletes a property of that class: give this module a class of its own first.
        cls = module.__class__
        module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
        for name, plist in list(module.parametrizations.items()):
            if any(isinstance(p, StiefelProjection) for p in plist):
                originals = [(f"{module_name}.parametrizations.{name}.{n}".lstrip("."), t)
                             for n, t in plist.named_parameters()]  # fmt: skip
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
                kept = {id(t) for t in module.parameters()}  # torch may keep a single original as the weight
                _guard.forget([t for _, t in originals if id(t) in kept])
                _guard.mark_replaced(
                    [(n, t) for n, t in originals if id(t) not in kept],
                    "unstiefelize(model)",
                    "Its frames are plain weights again: build a new optimizer for the model as it is now.",
                )
    vars(model).pop("save_pretrained", None)
    for module in model.modules():  # stiefelize(qk_input_norm=True)'s hooks
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, NormalisedInput):
                del module._forward_pre_hooks[key]
    return model
