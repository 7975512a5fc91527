"""Character-level language model trained with FSDP2 (`fully_shard`), W_Q and W_K as Stiefel frames, DCP checkpoints.

    torchrun --nproc-per-node 2 examples/fsdp_lm.py --steps 200                 # CPU (gloo), a few minutes
    torchrun --nproc-per-node 8 examples/fsdp_lm.py --device cuda --steps 5000   # GPUs (nccl)
    torchrun --nproc-per-node 2 examples/fsdp_lm.py --resume                     # continue from --ckpt-dir
    python examples/fsdp_lm.py --steps 200                                       # one process, no sharding

The model is the `lm` testbed's CharGPT (or, with --hf-gpt2, a stiefelized transformers GPT-2). Every block
and the root are `fully_shard`-ed: parameters, gradients and optimizer state are DTensors split across ranks;
a frame tensor (heads, d_model, head_dim) is split by heads, so each rank steps whole frames with no
communication. Every step draws one global batch from a generator seeded by the step number, and each rank
trains on its slice, so any number of processes follows the single-process run on the same global batch.
Every --ckpt-every steps the model, optimizer, schedule and step are saved with torch.distributed.checkpoint
(DCP), in a layout any world size can load: --resume continues from the latest checkpoint, on any number of
processes. Rank 0 writes the loss of every step to --loss-log (JSON lines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups
from stiefel_attention.bench.errors import DataError
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.bench.text import load_text

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "tinyshakespeare.txt"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=None, help="UTF-8 text (default: tiny Shakespeare, as `stiefel-attention lm`)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (windows per step, over all ranks)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--frame-lr", type=float, default=0.03)
    ap.add_argument("--hf-gpt2", action="store_true", help="a stiefelized transformers GPT-2 instead of CharGPT")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per process)")
    ap.add_argument("--ckpt-dir", default="checkpoints/fsdp_lm")
    ap.add_argument("--ckpt-every", type=int, default=50, help="save every K steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    ap.add_argument("--loss-log", default=None, help="rank 0 writes one JSON line per step here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--crash-at-step", type=int, default=None, help="testing: the last rank exits abruptly at this step"
    )
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        ap.error("--batch and --steps must be >= 1")
    return args


def build_model(args, vocab: int) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every run
    if args.hf_gpt2:
        from transformers import GPT2Config, GPT2LMHeadModel

        from stiefel_attention import stiefelize

        config = GPT2Config(
            vocab_size=vocab, n_positions=args.context, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return stiefelize(GPT2LMHeadModel(config))
    return CharGPT(vocab, args.context, d_model=args.width, n_layers=args.layers, n_heads=args.heads,
                   head_dim=args.width // args.heads)  # fmt: skip


def blocks_of(model) -> list[torch.nn.Module]:
    return list(model.transformer.h) if hasattr(model, "transformer") else list(model.blocks)


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def global_batch(train_ids: torch.Tensor, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch, the same on every rank and in every run (seeded by the step)."""
    g = torch.Generator().manual_seed(1_000_003 * args.seed + step)
    starts = torch.randint(0, len(train_ids) - args.context - 1, (args.batch,), generator=g)
    seq = train_ids[starts[:, None] + torch.arange(args.context + 1)]
    return seq[:, :-1], seq[:, 1:]


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = sorted(ckpt_dir.glob("step-*/.done"), key=lambda p: int(p.parent.name.split("-")[1]))
    return done[-1].parent if done else None


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    distributed = "WORLD_SIZE" in os.environ
    device = torch.device(args.device)
    if distributed:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    torch.set_flush_denormal(True)
    try:
        corpus = load_text(args.text or (DEFAULT_TEXT if DEFAULT_TEXT.is_file() else None))
    except DataError as err:
        raise SystemExit(f"fsdp_lm.py: {err}") from None
    train_ids = corpus.train

    model = build_model(args, corpus.vocab_size).to(device)
    if distributed:
        mesh = init_device_mesh(device.type, (world,))
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = StiefelAdam(
        param_groups(model, weight_decay=0.1, frame_lr=args.frame_lr), lr=args.lr, betas=(0.9, 0.99), max_step=0.1
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))

    ckpt_dir = Path(args.ckpt_dir)
    start = 0
    if args.resume:
        where = latest_checkpoint(ckpt_dir)
        if where is None:
            raise SystemExit(f"--resume: no finished checkpoint in {ckpt_dir}")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=str(where))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from {where} at step {start} on {world} process(es)", flush=True)

    log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None
    per_rank = args.batch // world
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if args.crash_at_step is not None and step == args.crash_at_step and rank == world - 1:
            os._exit(1)  # a rank dies mid-run, as a lost node would
        x, y = global_batch(train_ids, step, args)
        x, y = x[rank * per_rank : (rank + 1) * per_rank].to(device), y[rank * per_rank : (rank + 1) * per_rank]
        logits = logits_of(model, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        global_loss = loss.detach().clone()  # each rank's mean over its slice; the global mean is their mean
        if distributed:
            dist.all_reduce(global_loss)  # a sum (gloo has no average)
            global_loss /= world
        if log is not None:
            log.write(json.dumps({"step": step + 1, "loss": float(global_loss), "world": world}) + "\n")
            log.flush()
        done = step + 1
        if args.ckpt_every and (done % args.ckpt_every == 0 or done == args.steps):
            where = ckpt_dir / f"step-{done}"
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save(
                {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": done},
                checkpoint_id=str(where),
            )
            if distributed:
                dist.barrier()
            if rank == 0:
                (where / ".done").write_text("")  # written last: a crash mid-save leaves no finished checkpoint
        if rank == 0 and (done % 50 == 0 or done == args.steps):
            print(f"step {done}/{args.steps} loss {float(global_loss):.4f} ({time.perf_counter() - t0:.1f} s)")
    iso = max(float(isometry_error(p.full_tensor() if hasattr(p, "full_tensor") else p)) for _, p in frames(model))
    if rank == 0:
        print(f"frames orthonormal to {iso:.1e} (max ||W^T W - I||_F)")
    if log is not None:
        log.close()
    if distributed:
        dist.barrier()  # no rank tears the group down while another still uses it
        # FSDP's state holds the process group: release it first (left to interpreter exit, its teardown
        # sometimes aborted a rank after training had finished: "terminate called without an active exception")
        del model, opt, sched
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
