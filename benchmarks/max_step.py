"""How large StiefelAdam's frame steps are, and how often the trust region max_step=0.1 binds, at each frame rate.

    python benchmarks/max_step.py [--steps 600] [--json benchmarks/results/max_step.json]

The language model of the suite's cpu profile (lm, 2 layers, width 64, 4 heads of 16, batches of 32 windows of
64 characters of tiny Shakespeare), trained with the arm stiefel-adam's optimizer (frames by StiefelAdam, the
rest by AdamW at lr 1e-2) for --steps steps with no trust region, at frame rates from a tenth to ten times the
tuned 0.1. Every step, each frame's movement ||W_new - W||_F (the step xi, up to the retraction's O(xi^2)) is
measured. Printed per rate: the median and largest movement over steps and frames, in units of the rate, and
the share of frame steps a trust region of 0.1 would have shortened. One thread; seed 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import torch.nn.functional as F

from stiefel_attention import StiefelAdam, frames, param_groups
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.bench.text import load_text, random_windows

RATES = (0.01, 0.03, 0.1, 0.3, 1.0)
CAP = 0.1


def movements(frame_lr: float, steps: int) -> list[float]:
    corpus = load_text(None)
    torch.manual_seed(0)
    model = CharGPT(corpus.vocab_size, 64, d_model=64, n_layers=2, n_heads=4, head_dim=16, mlp_ratio=4)
    opt = StiefelAdam(param_groups(model, 0.1, frame_lr=frame_lr), lr=1e-2, betas=(0.9, 0.99))
    order = torch.Generator().manual_seed(2)
    framed = [p for _, p in frames(model)]
    out = []
    for _ in range(steps):
        x, y = random_windows(corpus.train, 32, 64, order)
        loss = F.cross_entropy(model(x).reshape(-1, corpus.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = [p.detach().clone() for p in framed]
        opt.step()
        for p, b in zip(framed, before):  # (H, D, r): one movement per head
            out += torch.linalg.matrix_norm(p.detach() - b).tolist()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rows = []
    print(f"frame steps of StiefelAdam without a trust region, lm cpu model, {args.steps} steps, seed 0")
    print(f"{'frame_lr':>9} {'median/lr':>10} {'max/lr':>8} {'share > 0.1':>12}")
    for lr in RATES:
        moves = movements(lr, args.steps)
        row = {
            "frame_lr": lr,
            "median_over_lr": statistics.median(moves) / lr,
            "max_over_lr": max(moves) / lr,
            "share_above_cap": sum(m > CAP for m in moves) / len(moves),
            "n_frame_steps": len(moves),
        }
        rows.append(row)
        print(f"{lr:>9g} {row['median_over_lr']:>10.3f} {row['max_over_lr']:>8.3f} {row['share_above_cap']:>12.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            meta = {"torch": torch.__version__, "machine": platform.machine(), "steps": args.steps, "cap": CAP}
            json.dump({**meta, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
