"""A stiefelized transformers GPT-2 trained by the Hugging Face Trainer, with StiefelAdam, checkpoints and resume.

    python examples/hf_trainer.py --out runs/hf_trainer --steps 200               # a few minutes on a CPU
    python examples/hf_trainer.py --out runs/hf_trainer --steps 400 --resume      # continue from the last checkpoint

`transformers.Trainer` takes the optimizer and schedule ready-made (`optimizers=(opt, scheduler)`):
StiefelAdam(param_groups(model)) steps the frames with the Riemannian rule and everything else with AdamW.
The Trainer saves the model (its state dict holds the frames as parametrization originals), the optimizer
and schedule state and the RNG states every --save-steps; `--resume` continues from the latest checkpoint
exactly as if training had not stopped. Characters are the tokens (id 0 stands in for GPT-2's special
tokens, which a character vocabulary has none of). Needs `pip install transformers accelerate`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "tinyshakespeare.txt"


class Windows(torch.utils.data.Dataset):
    """Fixed, seeded windows of `context` + 1 characters: input_ids and labels (the Trainer's model shifts them)."""

    def __init__(self, ids: torch.Tensor, n: int, context: int, seed: int):
        starts = torch.randint(0, len(ids) - context - 1, (n,), generator=torch.Generator().manual_seed(seed))
        self.rows = ids[starts[:, None] + torch.arange(context)]  # (n, context)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints go there)")
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="a UTF-8 text file (default: tiny Shakespeare)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--windows", type=int, default=20000, help="training windows (the Trainer's dataset)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    text = Path(args.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    n = int(0.9 * len(ids))
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(chars), n_positions=args.context, n_embd=args.width, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = stiefelize(GPT2LMHeadModel(config))
    opt = StiefelAdam(param_groups(model, weight_decay=0.1, frame_lr=1e-2), lr=1e-3, betas=(0.9, 0.99), max_step=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        save_steps=args.save_steps,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Windows(ids[:n], args.windows, args.context, seed=1),
        eval_dataset=Windows(ids[n:], 64, args.context, seed=2),
        optimizers=(opt, sched),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    iso = max(float(isometry_error(p)) for _, p in frames(model))
    val = trainer.evaluate()["eval_loss"]
    print(f"step {trainer.state.global_step}: train loss {losses[max(losses)]:.3f}, validation loss {val:.3f}, "
          f"frames orthonormal to {iso:.1e}")  # fmt: skip
    return {"losses": losses, "val_loss": val, "isometry": iso, "step": trainer.state.global_step}


if __name__ == "__main__":
    main()
