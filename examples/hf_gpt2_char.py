"""A Hugging Face GPT-2 on tiny Shakespeare, characters as tokens, with W_Q and W_K as Stiefel frames.

    python examples/hf_gpt2_char.py                 # its time on a CPU: docs/performance.md
    python examples/hf_gpt2_char.py --steps 20 --smoke

The model is transformers' GPT2LMHeadModel built from a small config (nothing is downloaded);
`stiefelize` turns every head's W_Q, W_K into a frame and `StiefelAdam(param_groups(model))` trains
the frames with the Riemannian rule and everything else with AdamW.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "tinyshakespeare.txt"


def batches(ids: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=gen)
        seq = ids[starts[:, None] + torch.arange(context + 1)]
        yield seq[:, :-1], seq[:, 1:]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="a UTF-8 text file (default: tiny Shakespeare)")
    ap.add_argument("--data", dest="text", help=argparse.SUPPRESS)  # the old name of --text
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and context, for a quick check")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    text = Path(args.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text])
    n = int(0.9 * len(ids))
    width, layers, context = (32, 1, 32) if args.smoke else (128, 4, 128)
    config = GPT2Config(
        vocab_size=len(chars),
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # characters are the tokens: id 0 stands in for GPT-2's special tokens (50256, outside this vocabulary)
        bos_token_id=0,
        eos_token_id=0,
    )
    model = stiefelize(GPT2LMHeadModel(config))  # fresh orthonormal frames for W_Q, W_K
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=1e-2), lr=1e-3, betas=(0.9, 0.99), max_step=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    train, gen = batches(ids[:n], 16, context, torch.Generator().manual_seed(1)), torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(train)
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps:
            print(f"step {step}: train loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        xv, yv = next(batches(ids[n:], 64, context, gen))
        val = F.cross_entropy(model(input_ids=xv).logits.flatten(0, 1), yv.flatten()).item()
        prompt = xv[:1, :8]  # nothing is padded: the mask says so, and generate() need not guess
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=context - 8, do_sample=True,
                             top_k=None, pad_token_id=0)  # fmt: skip
    worst = max(float(isometry_error(p)) for _, p in frames(model))
    print(f"validation loss {val:.3f} nats/char ({val / math.log(2):.3f} bits); frames orthonormal to {worst:.1e}")
    print("".join(chars[i] for i in out[0].tolist()))
    return {"val_loss": val, "isometry": worst}


if __name__ == "__main__":
    main()
