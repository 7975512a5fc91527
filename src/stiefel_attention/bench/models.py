"""The benchmark suite's models, built from the library's `Block`: PatchViT (CIFAR-10),
ModularTransformer (grokking) and CharGPT (language modelling, associative recall). Every
StiefelAttention option (qk, qk_init, qk_norm, temperature, qk_layout) passes through their
constructors, so every arm of the suite applies unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn import Block

__all__ = ["PatchViT", "ModularTransformer", "CharGPT"]


class PatchViT(nn.Module):
    """A small vision transformer for 32x32 images: patchify, pre-norm blocks, mean pooling, head."""

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        num_classes: int = 10,
        d_model: int = 64,
        depth: int = 2,
        n_heads: int = 4,
        head_dim: int = 16,
        mlp_ratio: int = 2,
        qk: str = "stiefel",
        qk_init: str | None = None,
        **attn_options,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} is not divisible by patch_size={patch_size}")
        n_patches = (image_size // patch_size) ** 2
        self.patchify = nn.Conv2d(in_channels, d_model, kernel_size=patch_size, stride=patch_size)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, head_dim, mlp_ratio * d_model, qk=qk, qk_init=qk_init, **attn_options)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patchify(images)  # (B, D, H/p, W/p)
        x = x.flatten(2).transpose(1, 2) + self.pos  # (B, N, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))  # (B, num_classes)


class ModularTransformer(nn.Module):
    """The grokking model: tokens (a, b, "=") -> logits over the p residues at the "=" position.

    Defaults follow the usual reference setup: 1 layer, d_model 128, 4 heads of 32, MLP 512,
    no LayerNorm, no biases, causal attention, learned positional embeddings.
    """

    def __init__(
        self,
        p: int,
        d_model: int = 128,
        n_heads: int = 4,
        head_dim: int = 32,
        d_mlp: int = 512,
        n_layers: int = 1,
        layernorm: bool = False,
        qk: str = "stiefel",
        qk_init: str | None = None,
        **attn_options,
    ):
        super().__init__()
        self.p = p
        self.embed = nn.Embedding(p + 1, d_model)  # residues 0..p-1 and "=" (token p)
        self.pos = nn.Parameter(torch.randn(3, d_model) / math.sqrt(d_model))
        self.blocks = nn.ModuleList(
            Block(
                d_model,
                n_heads,
                head_dim,
                d_mlp,
                qk=qk,
                qk_init=qk_init,
                causal=True,
                layernorm=layernorm,
                bias=False,
                **attn_options,
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model) if layernorm else nn.Identity()
        self.unembed = nn.Linear(d_model, p, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits at the "=" position; the last block computes that position only (exact)."""
        x = self.embed(tokens) + self.pos  # (B, 3, D)
        for block in self.blocks[:-1]:
            x = block(x)
        x = self.blocks[-1].forward_last(x)  # (B, 1, D)
        return self.unembed(self.norm(x[:, 0]))  # (B, p)

    def forward_full(self, tokens: Tensor) -> Tensor:
        """The plain forward pass over all positions, then the "=" position: the reference for `forward`."""
        x = self.embed(tokens) + self.pos  # (B, 3, D)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x[:, -1]))  # (B, p)


class CharGPT(nn.Module):
    """A GPT-style decoder for the language-model and associative-recall testbeds.

    Token embedding plus learned positions, `n_layers` causal pre-norm Blocks (GELU MLP of width
    mlp_ratio * d_model), a final LayerNorm and an untied output head (untied so that every arm's
    parameter groups are the same matrices, and the head is an ordinary decayed matrix).
    """

    def __init__(
        self,
        vocab_size: int,
        context: int,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        head_dim: int = 16,
        mlp_ratio: int = 4,
        qk: str = "stiefel",
        qk_init: str | None = None,
        **attn_options,
    ):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, head_dim, mlp_ratio * d_model, qk=qk, qk_init=qk_init, causal=True, **attn_options)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> logits (B, T, vocab); T <= context."""
        T = tokens.shape[1]
        if T > self.context:
            raise ValueError(f"sequence of {T} tokens is longer than the model's context {self.context}")
        x = self.embed(tokens) + self.pos[:T]  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, vocab)

    @torch.no_grad()
    def sample(self, prompt: Tensor, n: int, generator: torch.Generator, temperature: float = 1.0) -> Tensor:
        """n tokens drawn one at a time after prompt (1-D), from the last `context` tokens; returns (n,)."""
        seq = prompt.clone()
        for _ in range(n):
            logits = self(seq[-self.context :][None])[0, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits.float(), -1).cpu(), 1, generator=generator)
            seq = torch.cat([seq, nxt.to(seq.device)])
        return seq[len(prompt) :]
