"""A stiefelized transformers GPT-2 trained by the Hugging Face Trainer, with StiefelAdam, checkpoints and resume.

    python examples/hf_trainer.py --out runs/hf_trainer --steps 200               # time: docs/performance.md
    python examples/hf_trainer.py --out runs/hf_trainer --steps 400 --resume      # continue from the last checkpoint

`transformers.Trainer` takes the optimizer and schedule ready-made (`optimizers=(opt, scheduler)`):
StiefelAdam(param_groups(model)) steps the frames with the Riemannian rule and everything else with AdamW.
Every --save-steps the Trainer saves the model, the optimizer and schedule state and the RNG states; the model by
its save_pretrained, which for a stiefelized model writes both the frames (parametrization originals, which the
resume loads exactly) and the plain weights (which GPT2LMHeadModel.from_pretrained loads). This script then writes
`checksums.json`, the sha256 of each of the checkpoint's files. `--resume` continues from the latest checkpoint
exactly as if training had not stopped: it checks that checkpoint first and refuses, naming the file and what to
do, one that cannot continue the run exactly: a file missing (the Trainer itself would start a fresh optimizer
without a word), changed since it was saved, unreadable, weights without the frames, or an optimizer state that
does not fit or is not finite. Characters are the tokens (id 0 stands in for GPT-2's special tokens, which a
character vocabulary has none of). Needs `pip install transformers accelerate`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups, stiefelize
from stiefel_attention.bench.partial import file_sha256, why_unreadable

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


CHECKSUMS = "checksums.json"
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


class Checksums(TrainerCallback):
    """After each save, `checksums.json` in the checkpoint: the sha256 of each of its files, written last and
    atomically (the Trainer calls on_save once the checkpoint's files are all written)."""

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            sums = {f.name: file_sha256(f) for f in sorted(folder.iterdir()) if f.is_file() and f.name != CHECKSUMS}
            tmp = folder / f".{CHECKSUMS}.tmp"
            tmp.write_text(json.dumps(sums, indent=1) + "\n")
            os.replace(tmp, folder / CHECKSUMS)


def needed_files(training: TrainingArguments) -> dict[str, str]:
    """The files a checkpoint needs to go on exactly as if training had not stopped, and what each restores."""
    rng = "rng_state.pth" if training.world_size <= 1 else f"rng_state_{training.process_index}.pth"
    return {
        "optimizer.pt": "the optimizer state (StiefelAdam's moments and step counts)",
        "scheduler.pt": "the learning-rate schedule's position",
        rng: "the random number generators' states",
        "trainer_state.json": "the Trainer's step and log",
    }


def frames_problem(weights: Path, model: torch.nn.Module) -> str | None:
    """Why the weights file would not restore the model's frames (the Trainer loads it with strict=False), or None."""
    frame_keys = [k for k in model.state_dict() if ".parametrizations." in k]
    try:
        if weights.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(weights), "pt") as f:
                saved = set(f.keys())
        else:
            saved = set(torch.load(weights, map_location="cpu", weights_only=True))
    except Exception as err:
        return f"{weights} cannot be read: {why_unreadable(weights, err)}"
    missing = [k for k in frame_keys if k not in saved]
    if missing:
        return (
            f"{weights} does not hold the model's frames ({len(missing)} of {len(frame_keys)} missing, e.g. "
            f"{missing[0]}; a plain save_pretrained layout?): the resume would leave them at their initial values"
        )
    return None


def checkpoint_problem(
    folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, training: TrainingArguments
) -> str | None:
    """What stops the checkpoint `folder` from continuing this run exactly, naming the file; None if nothing."""
    lost = "cannot be restored, so training would not go on as if it had not stopped"
    for name, what in needed_files(training).items():
        if not (folder / name).is_file():
            return f"{folder / name} is missing: {what} {lost}"
    weights = next((folder / name for name in MODEL_FILES if (folder / name).is_file()), None)
    if weights is None:
        return f"{folder} holds no model weights ({' or '.join(MODEL_FILES)})"
    problem = frames_problem(weights, model)
    if problem is not None:
        return problem
    loaded = {}
    for name in ("optimizer.pt", "scheduler.pt"):
        try:
            loaded[name] = torch.load(folder / name, map_location="cpu", weights_only=True)
        except Exception as err:
            return f"{folder / name} cannot be read: {why_unreadable(folder / name, err)}"
    sums_path = folder / CHECKSUMS
    if sums_path.is_file():
        try:
            sums = json.loads(sums_path.read_text())
        except (OSError, ValueError) as err:
            return f"{sums_path} cannot be read ({err})"
        for name, saved in sums.items():
            if not (folder / name).is_file():
                return f"{folder / name} is missing (its checksum is in {CHECKSUMS})"
            found = file_sha256(folder / name)
            if found != saved:
                return f"{folder / name} has changed since it was saved (sha256 {found[:12]}, saved {saved[:12]})"
    else:
        print(f"note: {folder} has no {CHECKSUMS} (saved by an older version of this script, or cut off before its "
              "save finished): its files are checked for completeness and readability only", flush=True)  # fmt: skip
    return optimizer_problem(folder / "optimizer.pt", loaded["optimizer.pt"], opt)


def optimizer_problem(path: Path, saved, opt: torch.optim.Optimizer) -> str | None:
    """Why a loaded optimizer state cannot continue `opt` (layout, or a value that is not finite), or None."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        return f"{path} is not an optimizer state (no 'state' and 'param_groups')"
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    mine = [len(g["params"]) for g in opt.param_groups]
    if sizes != mine:
        return f"{path} holds parameter groups of {sizes} parameters; this model's optimizer has {mine}"
    for index, state in saved["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                finite = bool(torch.isfinite(value).all())
            else:
                finite = not isinstance(value, float) or math.isfinite(value)
            if not finite:
                return f"{path} holds non-finite values (the {name} of parameter {index}): it is damaged"
    return None


def checkpoints_in(out: Path) -> dict[int, Path]:
    """The Trainer's checkpoint folders in `out`, by step."""
    found = {}
    for path in out.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if path.is_dir() and step.isdigit():
            found[int(step)] = path
    return found


def resume_point(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, training: TrainingArguments) -> str:
    """The latest checkpoint in `out`, checked; SystemExit naming the file and the way out if it cannot continue
    the run exactly."""
    found = checkpoints_in(out)
    if not found:
        raise SystemExit(f"--resume: no {PREFIX_CHECKPOINT_DIR}-* folder in {out}")
    last = found.pop(max(found))
    problem = checkpoint_problem(last, model, opt, training)
    if problem is not None:
        way = (
            f"move {last} aside to resume from {found[max(found)]}, the checkpoint before it"
            if found
            else "start afresh without --resume (or in another --out)"
        )
        raise SystemExit(f"--resume: {problem}; {way}")
    return str(last)


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
        callbacks=[Checksums()],
    )
    resume = resume_point(Path(args.out), model, opt, training) if args.resume else None
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    iso = max(float(isometry_error(p)) for _, p in frames(model))
    val = trainer.evaluate()["eval_loss"]
    print(f"step {trainer.state.global_step}: train loss {losses[max(losses)]:.3f}, validation loss {val:.3f}, "
          f"frames orthonormal to {iso:.1e}")  # fmt: skip
    return {"losses": losses, "val_loss": val, "isometry": iso, "step": trainer.state.global_step}


if __name__ == "__main__":
    main()
