"""Mechanism metrics of attention layers: what a model's attention does, measured on a fixed batch.

Per attention layer and head:
- entropy of the attention distribution of each query, in nats, averaged over the batch and the
  queries, and as a fraction of log(number of keys the query sees) (1: uniform; 0: one key);
- the largest attention logit (after scaling, masked keys excluded);
- for A_h = Q'_h K'_h^T, the bilinear form of the head's logits (gains and temperatures folded in,
  `StiefelAttention.bilinear_factors`): its spectral norm and stable rank ||A||_F^2 / ||A||_2^2;
- ||W_Q||_F and ||W_K||_F of the head.
Each is summarised per layer as [mean, min, max] over heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .nn import StiefelAttention, frames

__all__ = ["METRICS", "attention_metrics", "bilinear_spectrum"]

METRICS = ("entropy", "entropy_frac", "max_logit", "spectral_norm", "stable_rank", "wq_fro", "wk_fro")


def bilinear_spectrum(q: Tensor, k: Tensor) -> Tensor:
    """Singular values of A = q k^T for (..., d, r) factors, as (..., r), from r x r work only.

    With q = U_q R_q and k = U_k R_k (thin QR), A = U_q (R_q R_k^T) U_k^T and U_q, U_k have
    orthonormal columns, so A and the r x r matrix R_q R_k^T share their singular values.
    """
    q64, k64 = q.detach().double(), k.detach().double()
    r_q = torch.linalg.qr(q64, mode="r").R
    r_k = torch.linalg.qr(k64, mode="r").R
    return torch.linalg.svdvals(r_q @ r_k.mT)


def _per_head_logit_stats(logits: Tensor, queries: slice | None) -> dict[str, Tensor]:
    """Entropy (nats, fraction of log n_visible) and max logit per head from (B, H, Nq, Nk) logits."""
    if queries is not None:
        logits = logits[:, :, queries]
    logits = logits.double()
    visible = torch.isfinite(logits)  # (B, H, Nq, Nk)
    logp = torch.log_softmax(logits, dim=-1)
    plogp = torch.where(visible, logp.exp() * logp, torch.zeros_like(logp))
    entropy = -plogp.sum(-1)  # (B, H, Nq)
    n_visible = visible[0, 0].sum(-1)  # (Nq,): the mask is the same for every example and head
    several = n_visible >= 2  # a query that sees one key has no choice to make
    frac = entropy[..., several] / torch.log(n_visible[several].double())
    return {
        "entropy": entropy.mean(dim=(0, 2)),
        "entropy_frac": frac.mean(dim=(0, 2)) if bool(several.any()) else torch.full_like(entropy[0, :, 0], math.nan),
        "max_logit": logits.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3)),
    }


@torch.no_grad()
def attention_metrics(
    model: nn.Module, forward: Callable[[], object], queries: slice | None = None, digits: int = 5
) -> dict[str, list[list[float | None]]]:
    """{metric: [[mean, min, max] per attention layer]} for the StiefelAttention layers of model.

    forward() runs the model on the fixed batch (e.g. `lambda: model(x)`); each layer's input is
    captured on the way and its logits recomputed explicitly. queries selects query positions
    (e.g. slice(-1, None) when only the last position is read). Values are rounded to `digits`
    significant digits (they are for plots and tables, and a run records hundreds of them); an
    undefined value (entropy fraction where no selected query sees two keys) is None.
    """
    layers = [m for m in model.modules() if isinstance(m, StiefelAttention)]
    if not layers:
        converted = [name for name, _ in frames(model)]
        if converted:
            raise ValueError(
                f"attention_metrics measures StiefelAttention layers, and {type(model).__name__} has none: its "
                f"attention was converted by stiefelize ({len(converted)} frame tensors, e.g. {converted[0]}), and "
                "its logits are computed by the model's own code (rotary embeddings, biases, kernels), which this "
                "function cannot recompute. Measure W_Q W_K^T from the frames (bilinear_spectrum), or the logits "
                "through the model's own attention outputs (output_attentions=True)."
            )
        raise ValueError(f"attention_metrics found no StiefelAttention layer in {type(model).__name__}")
    inputs: dict[int, Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0])) for i, m in enumerate(layers)
    ]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, list[list[float | None]]] = {k: [] for k in METRICS}
    for i, layer in enumerate(layers):
        if i not in inputs:
            raise RuntimeError(f"attention layer {i} was not called by forward(); run the full forward pass")
        per_head = _per_head_logit_stats(layer.logits(inputs[i]), queries)
        q, k = layer.bilinear_factors()
        sv = bilinear_spectrum(q, k)  # (H, r)
        per_head["spectral_norm"] = sv[:, 0]
        per_head["stable_rank"] = sv.square().sum(-1) / sv[:, 0].square().clamp_min(torch.finfo(sv.dtype).tiny)
        per_head["wq_fro"] = torch.linalg.matrix_norm(layer.w_q.detach().double())
        per_head["wk_fro"] = torch.linalg.matrix_norm(layer.w_k.detach().double())
        for name in METRICS:
            v = per_head[name]
            out[name].append([_round(float(x), digits) for x in (v.mean(), v.min(), v.max())])
    return out


def _round(x: float, digits: int) -> float | None:
    """x to `digits` significant digits; None for NaN (strict JSON has no NaN)."""
    if math.isnan(x):
        return None
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x
