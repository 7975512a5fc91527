"""Attention whose query and key projections are frames on St(d_model, head_dim).

Read top to bottom: `StiefelAttention`, the transformer `Block`, then helpers that find a
model's frames and query-key parameters.

Pairing: every arm of an experiment builds the same model from the same seed. To keep every
parameter other than W_Q, W_K identical across arms, `StiefelAttention` draws BOTH the
orthonormal frames and the usual nn.Linear initialisation in every mode, in the same order, and
keeps the one its `qk_init` asks for; the global RNG stream is therefore the same in all arms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from ._guard import mark_frames
from .manifold import random_frame

__all__ = [
    "FrameParametrization",
    "QK_MODES",
    "QK_INITS",
    "QK_LAYOUTS",
    "StiefelAttention",
    "Block",
    "frames",
    "qk_matrices",
    "qk_clip",
    "qk_parameters",
    "reset_logit_stats",
    "routing_parameters",
]

QK_MODES = ("stiefel", "euclidean", "frozen", "parametrized")
QK_INITS = ("standard", "orthonormal")
QK_LAYOUTS = ("heads", "linear")
_ORTHONORMAL_MODES = ("stiefel", "frozen", "parametrized")


class _HeadsFromLinear(nn.Module):
    """Parametrization: an nn.Linear-shaped (H*r, D) matrix read as per-head (H, D, r) matrices."""

    def __init__(self, n_heads: int, d_model: int, head_dim: int):
        super().__init__()
        self.shape = (n_heads, d_model, head_dim)

    def forward(self, flat: Tensor) -> Tensor:  # (H*r, D) -> (H, D, r)
        H, D, r = self.shape
        return flat.view(H, r, D).transpose(1, 2)

    def right_inverse(self, heads: Tensor) -> Tensor:  # (H, D, r) -> (H*r, D)
        H, D, r = self.shape
        return heads.transpose(1, 2).reshape(H * r, D)


class StiefelAttention(nn.Module):
    """Multi-head self-attention with W_Q, W_K read as (n_heads, d_model, head_dim) tensors.

    qk, how W_Q and W_K are held:
    - "stiefel": trainable frames (one per head), stepped by StiefelAdam/StiefelSGD.
    - "euclidean": the same tensors as ordinary weights (AdamW, Muon, ...).
    - "frozen": orthonormal and never trained (requires_grad=False).
    - "parametrized": orthonormal by torch's `parametrizations.orthogonal` (one batch of H matrices),
      so any Euclidean optimizer keeps them on St(d_model, head_dim); the trainable tensors are
      `parametrizations.w_q.original` and `parametrizations.w_k.original`.
    qk_init="standard" is nn.Linear's default initialisation (U(-1/sqrt(d), 1/sqrt(d))), what
    users have today; "orthonormal" starts from exactly the frames the Stiefel arm starts from.
    qk_norm: RMSNorm over the head dimension on q and k, each with a learnable gain of size
    head_dim shared by the heads (as timm's qk_norm and Gemma 3), before the 1/sqrt(head_dim) scaling.
    temperature: one learnable log-temperature t_h per head, initialised at 0; head h's logits are
    multiplied by T_h = exp(t_h), or, with max_temperature=c (c > 1), by T_h = c * sigmoid(t_h - log(c - 1)): 1 at
    t_h = 0, below c for every t_h, with d log T_h / d t_h = 1 - T_h / c (as exp far below the cap, and a gradient
    that never vanishes).
    qk_input_norm: queries and keys read their input through an RMS normalisation without a gain
    (x -> x / rms(x) over d_model, so ||x|| <= sqrt(d_model)); the values read the input as it is. With
    orthonormal W_Q, W_K (frames: ||W_Q,h W_K,h^T||_2 = 1) every logit is then bounded by construction,
    |s| <= logit_scale * T * d_model / sqrt(head_dim), T = 1 or max_temperature, whatever the input, the weights
    or the gains before attention (`logit_bound`). With Euclidean W_Q, W_K it is the norm without the bound.
    qk_layout="linear" stores W_Q, W_K as nn.Linear-shaped (n_heads*head_dim, d_model) matrices
    behind a reshaping parametrization, for optimizers that take 2-D matrices only (torch.optim.Muon);
    `w_q`, `w_k` still read as (H, D, r) and the computation is the same.
    W_V and W_O are ordinary nn.Linear layers in every mode.

    The logits of head h are s = logit_scale * q k^T / sqrt(head_dim) (q with the norm and temperature
    applied), then, with logit_softcap=c, c * tanh(s / c) (Gemma 2's soft-cap); the causal mask comes after.
    logit_scale is fixed (not learned); 0 makes every head attend uniformly to the keys it sees.
    track_logits=True records, per head, the largest and smallest scaled logit s (before the soft-cap, masked
    entries excluded) over the forward passes since `reset_logit_stats()`, in `logit_stats`; `qk_clip` reads
    it. Without a soft-cap the attention runs in torch's fused kernel, which does not expose its logits, so
    tracking costs one extra q k^T product per forward (no softmax, no values, no autograd graph); with a
    soft-cap the logits are formed explicitly anyway and tracking reads them for free.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        qk: str = "stiefel",
        qk_init: str | None = None,
        causal: bool = False,
        bias: bool = True,
        qk_norm: bool = False,
        temperature: bool = False,
        qk_layout: str = "heads",
        logit_softcap: float | None = None,
        logit_scale: float = 1.0,
        track_logits: bool = False,
        qk_input_norm: bool = False,
        max_temperature: float | None = None,
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if max_temperature is not None:
            if not temperature:
                raise ValueError("max_temperature caps the learnable temperature: pass temperature=True with it")
            if not (math.isfinite(max_temperature) and max_temperature > 1):
                raise ValueError(
                    f"max_temperature must be a finite number > 1 (temperatures start at 1), got {max_temperature!r}"
                )
        if logit_softcap is not None and not (math.isfinite(logit_softcap) and logit_softcap > 0):
            raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")
        if not (math.isfinite(logit_scale) and logit_scale >= 0):
            raise ValueError(f"logit_scale must be a finite number >= 0, got {logit_scale!r}")
        if qk not in QK_MODES:
            raise ValueError(f"qk must be one of {QK_MODES}, got {qk!r}")
        if qk_init is None:
            qk_init = "standard" if qk == "euclidean" else "orthonormal"
        if qk_init not in QK_INITS:
            raise ValueError(f"qk_init must be one of {QK_INITS}, got {qk_init!r}")
        if qk in _ORTHONORMAL_MODES and qk_init != "orthonormal":
            raise ValueError(f"qk={qk!r} needs orthonormal frames; qk_init='standard' is only for qk='euclidean'")
        if qk_layout not in QK_LAYOUTS:
            raise ValueError(f"qk_layout must be one of {QK_LAYOUTS}, got {qk_layout!r}")
        if qk_layout == "linear" and qk != "euclidean":
            raise ValueError(
                "qk_layout='linear' is for Euclidean W_Q, W_K (2-D optimizers such as Muon); "
                f"qk={qk!r} keeps the per-head layout"
            )
        if head_dim > d_model:
            raise ValueError(f"head_dim={head_dim} > d_model={d_model}: a frame in St(d, r) needs r <= d")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.qk, self.qk_init, self.causal = qk, qk_init, causal
        self.qk_norm, self.temperature, self.qk_layout = qk_norm, temperature, qk_layout
        self.logit_softcap, self.logit_scale, self.track_logits = logit_softcap, float(logit_scale), track_logits
        self.qk_input_norm = qk_input_norm
        self.max_temperature = None if max_temperature is None else float(max_temperature)
        self.logit_stats: dict[str, Tensor] | None = None  # {"max": (H,), "min": (H,)} with track_logits

        init = self._draw_qk()  # (2, H, D, r)
        trainable = qk != "frozen"
        self.w_q = nn.Parameter(init[0].clone(), requires_grad=trainable)  # (H, D, r)
        self.w_k = nn.Parameter(init[1].clone(), requires_grad=trainable)  # (H, D, r)
        if qk == "stiefel":  # only a Stiefel rule may step them (_guard)
            mark_frames([(None, self.w_q), (None, self.w_k)])
        self.w_v = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.w_o = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        if qk_norm:
            self.q_gain = nn.Parameter(torch.ones(head_dim))  # (r,)
            self.k_gain = nn.Parameter(torch.ones(head_dim))  # (r,)
        if temperature:
            self.log_temperature = nn.Parameter(torch.zeros(n_heads))  # (H,)
        # Registering a parametrization may draw random numbers (torch's orthogonal completes each
        # frame to a square basis with randn): keep the global stream where every other arm has it.
        with torch.random.fork_rng(devices=[]):
            for name in ("w_q", "w_k"):
                if qk == "parametrized":
                    parametrizations.orthogonal(self, name)
                elif qk_layout == "linear":
                    parametrize.register_parametrization(
                        self, name, _HeadsFromLinear(n_heads, d_model, head_dim), unsafe=True
                    )

    def _draw_qk(self, device: torch.device | None = None) -> Tensor:
        """W_Q, W_K as qk_init asks, (2, H, D, r); both initialisations are drawn in every mode (module docstring)."""
        ortho = random_frame(2, self.n_heads, d=self.d_model, r=self.head_dim, device=device)  # (2, H, D, r)
        bound = 1.0 / math.sqrt(self.d_model)
        standard = torch.empty(2, self.n_heads, self.d_model, self.head_dim, device=device).uniform_(-bound, bound)
        return ortho if self.qk_init == "orthonormal" else standard

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter afresh, on the device it is on, drawing the global RNG as the constructor does.

        W_Q, W_K as `qk_init` asks (orthonormal frames by default), W_V and W_O as nn.Linear does, norm gains at 1,
        log-temperatures at 0. This is the step after building on the meta device and `to_empty` (FSDP2's way of
        building large models), which leaves memory uninitialised: frames that are not orthonormal.
        """
        init = self._draw_qk(self.w_v.weight.device)
        self.w_v.reset_parameters()
        self.w_o.reset_parameters()
        with torch.random.fork_rng(devices=[]):  # a parametrization's right_inverse may draw (see __init__)
            for name, value in zip(("w_q", "w_k"), init):
                if parametrize.is_parametrized(self, name):
                    setattr(self, name, value)  # through the parametrization's right_inverse
                else:
                    getattr(self, name).copy_(value)
        for name in ("q_gain", "k_gain"):
            if hasattr(self, name):
                getattr(self, name).fill_(1.0)
        if self.temperature:
            self.log_temperature.zero_()

    def _heads(self, x: Tensor, w: Tensor) -> Tensor:
        B, N, _ = x.shape
        # (H, D, r) -> (D, H*r): one matmul for all heads
        flat = w.permute(1, 0, 2).reshape(self.d_model, self.n_heads * self.head_dim)
        return (x @ flat).view(B, N, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, r)

    def _qk(self, x_q: Tensor, x_k: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and keys per head, (B, H, Nq, r) and (B, H, Nk, r), with the norms and temperature applied."""
        if self.qk_input_norm:
            same = x_k is x_q
            x_q = _rms_norm(x_q)  # over d_model, no gain: ||x|| <= sqrt(d_model)
            x_k = x_q if same else _rms_norm(x_k)
        q = self._heads(x_q, self.w_q)
        k = self._heads(x_k, self.w_k)
        if self.qk_norm:
            q = _rms_norm(q) * self.q_gain
            k = _rms_norm(k) * self.k_gain
        if self.temperature:
            q = q * self.temperatures().view(1, -1, 1, 1)
        return q, k

    def temperatures(self) -> Tensor:
        """Each head's logit multiplier from its log-temperature, (H,): exp(t), or c sigmoid(t - log(c - 1)) below
        max_temperature=c. Only with temperature=True."""
        t = self.log_temperature
        c = self.max_temperature
        return t.exp() if c is None else c * torch.sigmoid(t - math.log(c - 1.0))

    def logit_bound(self) -> float | None:
        """The largest |logit| this module can produce whatever its input and weights, before the soft-cap; None
        when nothing bounds it (Euclidean W_Q, W_K, no qk_input_norm, an uncapped temperature, qk_norm's gains).

        With qk_input_norm, ||x|| <= sqrt(d_model); orthonormal W_Q, W_K give ||W_Q,h W_K,h^T||_2 = 1, so
        |x_i^T W_Q W_K^T x_j| <= d_model, times logit_scale, the temperature's cap and 1/sqrt(head_dim). A soft-cap
        c bounds the logits the softmax sees by c in any case.
        """
        if not self.qk_input_norm or self.qk_norm or self.qk not in _ORTHONORMAL_MODES:
            return None
        if self.temperature and self.max_temperature is None:
            return None
        cap = self.max_temperature if self.temperature else 1.0
        return self.logit_scale * cap * self.d_model / math.sqrt(self.head_dim)

    def _values(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        return self.w_v(x).view(B, N, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, r)

    def _hidden(self, n_q: int, n_k: int, device: torch.device) -> Tensor | None:
        """(Nq, Nk) bool, True where the causal mask hides a key; None when nothing is hidden."""
        if not self.causal or n_q == 1:  # a single (last) query sees every key
            return None
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).triu(1)

    def _scaled(self, q: Tensor, k: Tensor) -> Tensor:
        """s = logit_scale * q k^T / sqrt(head_dim), (B, H, Nq, Nk): the logits before the soft-cap and mask."""
        return (q @ k.transpose(-2, -1)) * (self.logit_scale / math.sqrt(self.head_dim))

    def _record(self, scaled: Tensor, hidden: Tensor | None) -> None:
        """Fold this forward's per-head largest and smallest logit into logit_stats."""
        top = scaled if hidden is None else scaled.masked_fill(hidden, -math.inf)
        low = scaled if hidden is None else scaled.masked_fill(hidden, math.inf)
        now = {"max": top.amax(dim=(0, 2, 3)), "min": low.amin(dim=(0, 2, 3))}  # (H,) each
        if self.logit_stats is not None:
            now = {"max": torch.maximum(now["max"], self.logit_stats["max"]),
                   "min": torch.minimum(now["min"], self.logit_stats["min"])}  # fmt: skip
        self.logit_stats = now

    def reset_logit_stats(self) -> None:
        self.logit_stats = None

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(mask(cap(s))) v per head, (B, H, Nq, r): torch's fused kernel unless there is a soft-cap."""
        hidden = self._hidden(q.shape[-2], k.shape[-2], q.device)
        # the fused kernel masks before it scales, so logit_scale 0 (-inf * 0 = NaN) takes the explicit path
        if self.logit_softcap is None and self.logit_scale > 0:
            if self.track_logits:
                with torch.no_grad():
                    self._record(self._scaled(q, k), hidden)
            # scale None is torch's own 1/sqrt(head_dim): logit_scale 1 runs exactly the kernel call it always did
            scale = None if self.logit_scale == 1.0 else self.logit_scale / math.sqrt(self.head_dim)
            return F.scaled_dot_product_attention(q, k, v, is_causal=hidden is not None, scale=scale)
        scaled = self._scaled(q, k)
        if self.track_logits:
            self._record(scaled.detach(), hidden)
        logits = self._capped(scaled, hidden)
        return torch.softmax(logits, dim=-1) @ v

    def _capped(self, scaled: Tensor, hidden: Tensor | None) -> Tensor:
        c = self.logit_softcap
        logits = scaled if c is None else c * torch.tanh(scaled / c)
        return logits if hidden is None else logits.masked_fill(hidden, float("-inf"))

    def forward(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape  # (B, N, D)
        q, k = self._qk(x, x)  # (B, H, N, r) each
        y = self._attend(q, k, self._values(x))  # (B, H, N, r)
        return self.w_o(y.transpose(1, 2).reshape(B, N, self.n_heads * self.head_dim))  # (B, N, D)

    def forward_last(self, x: Tensor) -> Tensor:
        """The output at the last position only: (B, N, D) -> (B, 1, D).

        Exact for causal and non-causal attention alike, since the last query sees every key.
        Saves the queries and the output projection of all other positions (grokking only reads
        the "=" position).
        """
        B, N, _ = x.shape
        q, k = self._qk(x[:, -1:], x)  # (B, H, 1, r), (B, H, N, r)
        y = self._attend(q, k, self._values(x))  # no mask: the last position attends to all
        return self.w_o(y.transpose(1, 2).reshape(B, 1, self.n_heads * self.head_dim))  # (B, 1, D)

    def logits(self, x: Tensor) -> Tensor:
        """Attention logits (B, H, N, N) as the softmax sees them: scaled, soft-capped, -inf where the mask hides
        a key. Not recorded in logit_stats (this is for measuring, not training)."""
        q, k = self._qk(x, x)
        N = x.shape[1]
        return self._capped(self._scaled(q, k), self._hidden(N, N, x.device))

    def bilinear_factors(self) -> tuple[Tensor, Tensor]:
        """(Q', K'), each (H, D, r), with A_h = Q'_h K'_h^T the bilinear form of head h's logits.

        Gains, temperatures and logit_scale are folded in (Q' = logit_scale exp(t_h) W_Q diag(g_q),
        K' = W_K diag(g_k)); the fixed 1/sqrt(head_dim) is not, nor the soft-cap (not linear). With qk_norm
        the logits also divide by the RMS of q and k, and with qk_input_norm by the RMS of the inputs, which
        depend on the input and are not part of A.
        """
        wq, wk = self.w_q.detach() * self.logit_scale, self.w_k.detach()
        if self.qk_norm:
            wq, wk = wq * self.q_gain.detach(), wk * self.k_gain.detach()
        if self.temperature:
            wq = wq * self.temperatures().detach().view(-1, 1, 1)
        return wq, wk

    def qk_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The tensors behind W_Q, W_K that an optimizer steps (a parametrization's original where there is one)."""
        out = []
        for name in ("w_q", "w_k"):
            if parametrize.is_parametrized(self, name):
                out.append((f"parametrizations.{name}.original", getattr(self.parametrizations, name).original))
            else:
                out.append((name, getattr(self, name)))
        return out

    def routing_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """qk_parameters plus what the options add to the query-key path (norm gains, log-temperatures)."""
        extra = [(n, getattr(self, n)) for n in ("q_gain", "k_gain", "log_temperature") if hasattr(self, n)]
        return self.qk_parameters() + extra

    def frame_parameters(self) -> list[tuple[str, Tensor]]:
        """The tensors that hold W_Q, W_K, whatever the mode, as (H, D, r)."""
        return [("w_q", self.w_q), ("w_k", self.w_k)]

    def extra_repr(self) -> str:
        options = ("qk_norm", "qk_input_norm", "temperature", "track_logits")
        extra = "".join(f", {k}=True" for k in options if getattr(self, k))
        extra += f", max_temperature={self.max_temperature:g}" if self.max_temperature is not None else ""
        extra += ", qk_layout=linear" if self.qk_layout == "linear" else ""
        extra += f", logit_softcap={self.logit_softcap:g}" if self.logit_softcap is not None else ""
        extra += f", logit_scale={self.logit_scale:g}" if self.logit_scale != 1.0 else ""
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, qk={self.qk}, "
            f"qk_init={self.qk_init}, causal={self.causal}{extra}"
        )


def _rms_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / RMS(x) over the last dimension, with no gain: ||x|| <= sqrt(x.shape[-1]) (eps only lowers it)."""
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)


class Block(nn.Module):
    """Transformer block; pre-norm when layernorm=True, plain residual otherwise.

    attn_options (qk_norm, qk_input_norm, temperature, max_temperature, qk_layout, logit_softcap, logit_scale,
    track_logits) go to StiefelAttention unchanged.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        d_mlp: int,
        qk: str = "stiefel",
        qk_init: str | None = None,
        causal: bool = False,
        layernorm: bool = True,
        bias: bool = True,
        **attn_options,
    ):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model) if layernorm else nn.Identity()
        self.attn = StiefelAttention(
            d_model, n_heads, head_dim, qk=qk, qk_init=qk_init, causal=causal, bias=bias, **attn_options
        )
        self.ln2 = nn.LayerNorm(d_model) if layernorm else nn.Identity()
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_mlp, bias=bias),
            nn.GELU() if layernorm else nn.ReLU(),
            nn.Linear(d_mlp, d_model, bias=bias),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward_last(self, x: Tensor) -> Tensor:
        """The block's output at the last position only: (B, N, D) -> (B, 1, D)."""
        x_last = x[:, -1:] + self.attn.forward_last(self.ln1(x))
        return x_last + self.mlp(self.ln2(x_last))


class FrameParametrization(nn.Module):
    """Base of parametrizations whose originals include Stiefel frames (`stiefel_attention.convert`).

    `frame_originals` are the indices i of the originals (`parametrizations.<name>.original<i>`,
    or `.original` for a single one) that are frames of shape (..., d, r); `frames(model)` finds them.
    """

    frame_originals: tuple[int, ...] = ()


def _parametrized_frames(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    out = []
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name, plist in module.parametrizations.items():
            indices = [i for p in plist if isinstance(p, FrameParametrization) for i in p.frame_originals]
            for i in indices:
                attr = "original" if hasattr(plist, "original") else f"original{i}"
                out.append((_qualified(name, f"parametrizations.{tensor_name}.{attr}"), getattr(plist, attr)))
    return out


def _attention_modules(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, StiefelAttention):
            yield name, module


def frames(model: nn.Module, include_frozen: bool = False) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) of every Stiefel frame tensor in the model.

    These are the parameters that a Stiefel optimizer must step: W_Q, W_K of every StiefelAttention
    with qk="stiefel" (with include_frozen, qk="frozen" too, for isometry logging), and the frame
    originals of converted models (`stiefelize`).
    """
    modes = ("stiefel", "frozen") if include_frozen else ("stiefel",)
    out = []
    for name, module in _attention_modules(model):
        if module.qk in modes:
            out += [(f"{name}.{pname}" if name else pname, p) for pname, p in module.frame_parameters()]
    out += _parametrized_frames(model)
    mark_frames([(n, p) for n, p in out if p.requires_grad])  # what is found is marked, under its qualified name
    return out


def qk_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) of every W_Q, W_K tensor, whatever its mode."""
    return [
        (f"{name}.{pname}" if name else pname, p)
        for name, module in _attention_modules(model)
        for pname, p in module.frame_parameters()
    ]


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def qk_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) of the tensors behind every W_Q, W_K that an optimizer would step."""
    return [
        (_qualified(name, pname), p)
        for name, module in _attention_modules(model)
        for pname, p in module.qk_parameters()
    ]


def routing_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """qk_parameters plus the query-key options' gains and log-temperatures: what arms of an experiment differ in."""
    return [
        (_qualified(name, pname), p)
        for name, module in _attention_modules(model)
        for pname, p in module.routing_parameters()
    ]


def reset_logit_stats(model: nn.Module) -> None:
    """Forget the logits recorded so far by every attention of the model that tracks them (start of a step)."""
    for _, module in _attention_modules(model):
        module.reset_logit_stats()


@torch.no_grad()
def qk_clip(model: nn.Module, tau: float) -> int:
    """QK-Clip (as in Kimi K2's MuonClip), to call after the optimizer step; returns how many heads it clipped.

    For every head whose largest logit s = logit_scale * q . k / sqrt(head_dim) over the forward passes since
    the last call (or `reset_logit_stats`) exceeded tau, W_Q and W_K of that head are each multiplied by
    sqrt(tau / s_max), so that logit would now be tau; other heads, and the optimizer's state, are left alone.
    Every StiefelAttention of the model must have Euclidean W_Q, W_K (qk="euclidean", either layout), no
    qk_norm (the norm divides the scale out, so rescaling would do nothing) and track_logits=True (the logits
    are read, not recomputed). Frames cannot be rescaled (their columns are orthonormal): a model with frames
    is refused; bound its logits with logit_softcap or logit_scale instead.
    """
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    modules = list(_attention_modules(model))
    if not modules:
        raise ValueError(f"{type(model).__name__} has no StiefelAttention: qk_clip acts on its W_Q, W_K")
    for name, m in modules:
        where = name or type(m).__name__
        if m.qk != "euclidean":
            raise ValueError(
                f"{where} has qk={m.qk!r}: its W_Q, W_K are orthonormal frames, which cannot be rescaled, so "
                "QK-Clip does not apply; bound the logits with logit_softcap or logit_scale instead"
            )
        if m.qk_norm:
            raise ValueError(f"{where} has qk_norm=True: the norm divides out any rescaling of W_Q, W_K")
        if not m.track_logits:
            raise ValueError(f"{where} does not record its logits: build it with track_logits=True for qk_clip")
    clipped = 0
    for _, m in modules:
        if m.logit_stats is None:  # no forward pass since the last call
            continue
        s_max = m.logit_stats["max"]  # (H,)
        over = s_max > tau
        gamma = torch.where(over, torch.sqrt(tau / s_max.clamp_min(tau)), torch.ones_like(s_max))  # (H,)
        for name in ("w_q", "w_k"):
            if parametrize.is_parametrized(m, name):  # qk_layout="linear": rows h*r .. (h+1)*r - 1 are head h
                original = getattr(m.parametrizations, name).original  # (H*r, D)
                original.view(m.n_heads, m.head_dim, m.d_model).mul_(gamma.view(-1, 1, 1).to(original.dtype))
            else:
                getattr(m, name).mul_(gamma.view(-1, 1, 1).to(getattr(m, name).dtype))  # (H, D, r)
        clipped += int(over.sum())
        m.reset_logit_stats()
    return clipped
