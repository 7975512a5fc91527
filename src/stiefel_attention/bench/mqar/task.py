"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), generated in memory.

A sequence holds `n_pairs` key-value pairs (k_1 v_1 ... k_N v_N), then filler tokens up to the
sequence length, then `n_queries` of those keys in random order. At each query position the model
must output the value paired with that key; loss and accuracy are taken at query positions only.
Token ids: keys 0..K-1, values K..2K-1 (K = vocab_size // 2 - 1, so ids 2K and 2K+1 remain for
the filler). Keys within a sequence are distinct; values are drawn independently.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE", "max_pairs", "mqar_batch", "min_seq_len"]

IGNORE = -100  # label of every non-query position (cross_entropy's ignore_index)


def min_seq_len(n_pairs: int, n_queries: int) -> int:
    return 2 * n_pairs + n_queries


def max_pairs(vocab_size: int) -> int:
    """The number of distinct keys K a vocabulary holds, so the most pairs a sequence can have."""
    return vocab_size // 2 - 1


def mqar_batch(batch: int, vocab_size: int, n_pairs: int, n_queries: int, seq_len: int, generator: torch.Generator):
    """(tokens, labels), each (batch, seq_len): labels hold the value at query positions, IGNORE elsewhere."""
    n_keys = max_pairs(vocab_size)
    if n_pairs > n_keys:
        raise ValueError(
            f"n_pairs={n_pairs} needs at least that many distinct keys; vocab_size={vocab_size} gives {n_keys}"
        )
    if not 1 <= n_queries <= n_pairs:
        raise ValueError(f"n_queries must lie in 1..n_pairs={n_pairs}, got {n_queries}")
    if seq_len < min_seq_len(n_pairs, n_queries):
        raise ValueError(f"seq_len={seq_len} < 2 * n_pairs + n_queries = {min_seq_len(n_pairs, n_queries)}")
    keys = torch.rand(batch, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]  # distinct keys per row
    values = n_keys + torch.randint(0, n_keys, (batch, n_pairs), generator=generator)
    asked = torch.rand(batch, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]  # which pairs are queried
    filler = 2 * n_keys + torch.randint(0, 2, (batch, seq_len - min_seq_len(n_pairs, n_queries)), generator=generator)
    pairs = torch.stack([keys, values], dim=2).reshape(batch, 2 * n_pairs)
    query_keys = keys.gather(1, asked)
    tokens = torch.cat([pairs, filler, query_keys], dim=1)
    labels = torch.full_like(tokens, IGNORE)
    labels[:, seq_len - n_queries :] = values.gather(1, asked)
    return tokens, labels
