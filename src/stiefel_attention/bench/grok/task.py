"""Modular arithmetic for the grokking experiments: every equation (a op b) mod p, split once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODULAR_OPS = ("+", "-", "*", "/")


@dataclass(frozen=True, eq=False)
class ModularTask:
    """All equations (a op b) mod p as tokens (a, b, "="), split into train and validation.

    Token ids: residues 0..p-1, and p for "=". Division is a * b^(-1) mod p and is defined only
    for b != 0 (p must be prime so that every b != 0 has an inverse).
    """

    p: int
    op: str
    train_tokens: torch.Tensor  # (n_train, 3) int64
    train_labels: torch.Tensor  # (n_train,) int64
    val_tokens: torch.Tensor
    val_labels: torch.Tensor


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % k for k in range(2, int(p**0.5) + 1))


def modular_table(p: int, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (a, b) of the task with its answer: tokens (N, 3) = (a, b, p) and labels (N,)."""
    if op not in MODULAR_OPS:
        raise ValueError(f"op must be one of {MODULAR_OPS}, got {op!r}")
    if not _is_prime(p):
        raise ValueError(f"p must be prime (got {p}): division needs every b != 0 to be invertible mod p")
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    if op == "/":
        keep = b != 0
        a, b = a[keep], b[keep]
        inverse = torch.tensor([pow(int(x), p - 2, p) for x in b])  # Fermat: b^(p-2) = b^(-1) mod p
        labels = (a * inverse) % p
    elif op == "+":
        labels = (a + b) % p
    elif op == "-":
        labels = (a - b) % p
    else:
        labels = (a * b) % p
    tokens = torch.stack([a, b, torch.full_like(a, p)], dim=1)
    return tokens, labels


def modular_task(p: int = 113, op: str = "+", train_fraction: float = 0.3, split_seed: int = 0) -> ModularTask:
    """The task with a random train/validation split fixed by split_seed (independent of the model seed)."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must lie in (0, 1), got {train_fraction}")
    tokens, labels = modular_table(p, op)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_train = int(round(train_fraction * len(labels)))
    tr, va = perm[:n_train], perm[n_train:]
    return ModularTask(p, op, tokens[tr], labels[tr], tokens[va], labels[va])
