"""An nn.TransformerEncoder classifier whose attention's W_Q, W_K are Stiefel frames.

    python examples/encoder_classifier.py            # its time on a CPU: docs/performance.md
    python examples/encoder_classifier.py --smoke

The task needs attention: a sequence of random tokens is labelled by whether its first token
appears again later in the sequence. `stiefelize` converts the packed in_proj_weight of every
layer's nn.MultiheadAttention; StiefelAdam trains the frames, AdamW the rest.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize

VOCAB, LENGTH = 16, 12


class Classifier(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(LENGTH, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 4, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos)[:, 0])  # read out at the first token


def task(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=gen)
    return x, (x[:, 1:] == x[:, :1]).any(dim=1).long()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = stiefelize(Classifier(32 if args.smoke else 64, 1 if args.smoke else 2))
    opt = StiefelAdam(param_groups(model, weight_decay=0.05, frame_lr=2e-2), lr=2e-3, max_step=0.1)
    gen = torch.Generator().manual_seed(1)
    x_test, y_test = task(2000, torch.Generator().manual_seed(2))
    for step in range(1, args.steps + 1):
        x, y = task(128, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(-1) == y_test).float().mean().item()
    worst = max(float(isometry_error(p)) for _, p in frames(model))
    positive = y_test.float().mean().item()
    majority = max(positive, 1 - positive)
    print(f"test accuracy {100 * acc:.1f}% (majority class {100 * majority:.1f}%); frames orthonormal to {worst:.1e}")
    return {"accuracy": acc, "isometry": worst, "majority": majority}


if __name__ == "__main__":
    main()
