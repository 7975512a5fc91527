"""Suite-wide settings and the small models and data several test files share."""

import pytest
import torch
from torch import nn

from stiefel_attention.nn import Block


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs many tiny kernels: on a shared 2-core machine intra-op threading makes them
    up to ~100x slower (OpenMP threads spin against other load) and adds nothing at these sizes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _denormals_as_ieee():
    """Scripts and runners under test flush denormals to zero (their CPU hygiene), a process-wide state torch
    cannot read back: put the IEEE default back after every test, so that no test depends on the order
    (hypothesis refuses to draw floats while subnormals are flushed)."""
    yield
    torch.set_flush_denormal(False)


VOCAB, CONTEXT = 11, 8


class TinyLM(nn.Module):
    """A library-only model: embedding, one causal Block, LayerNorm, head; logits at the last position."""

    def __init__(self, d_model: int = 16, n_heads: int = 2, head_dim: int = 4, **attn_options):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, head_dim, 2 * d_model, causal=True, **attn_options)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, N, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, -1]))  # (B, VOCAB)


@pytest.fixture
def tiny_model():
    """tiny_model(seed=0, **StiefelAttention options) -> TinyLM, built from the seed."""

    def make(seed: int = 0, **attn_options) -> TinyLM:
        torch.manual_seed(seed)
        return TinyLM(**attn_options)

    return make


@pytest.fixture
def token_batches():
    """token_batches(n, seed=0) -> n batches (tokens (4, CONTEXT), next-token labels (4,)) of a learnable rule."""

    def make(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            x = torch.randint(0, VOCAB, (4, CONTEXT), generator=g)
            out.append((x, (x[:, 0] + x[:, -1]) % VOCAB))
        return out

    return make
