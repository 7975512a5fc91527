"""Character-level language model trained with FSDP2 (`fully_shard`), W_Q and W_K as Stiefel frames, DCP checkpoints.

    torchrun --nproc-per-node 2 examples/fsdp_lm.py --steps 200                 # CPU (gloo); time: docs/performance.md
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
processes. Each checkpoint also holds run.json, the options that fix the run (model, text, batch, seed, rates):
a resume that changes any of them is refused, naming each (it would silently keep the checkpoint's rates, or switch
to another data stream), and so is a checkpoint already beyond --steps. A checkpoint whose files DCP's index says
are missing or truncated is skipped for the one before it, naming the file. DCP keeps no checksum: bytes changed
at full length stop the resume (naming the file) only where they no longer load, and go undetected where they
still parse (docs/distributed.md). Rank 0 writes the loss of every step to --loss-log (JSON lines).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
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


RUN_FILE = "run.json"  # in each checkpoint: the options of the run that saved it


def stop(message: str) -> NoReturn:
    """Exit with one line (every rank reaches the same verdict from the same files), the process group released."""
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(message)


def run_options(args, text_sha256: str) -> dict:
    """What fixes the computation a checkpoint continues: the model, its data stream and its optimisation. Not
    --steps (a resume may extend the run) nor the number of processes (a resume may change it)."""
    keys = ("hf_gpt2", "context", "width", "layers", "heads", "batch", "seed", "lr", "frame_lr")
    return {"text_sha256": text_sha256} | {k: getattr(args, k) for k in keys}


def _flag(key: str, value) -> str:
    if key == "text_sha256":
        return f"--text of sha256 {value[:12]}"
    if key == "hf_gpt2":
        return "--hf-gpt2" if value else "no --hf-gpt2"
    return f"--{key.replace('_', '-')} {value}"


def finished_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The checkpoints whose save finished (their .done written last), the latest first."""
    done = [p.parent for p in ckpt_dir.glob("step-*/.done") if p.parent.name.split("-")[1].isdigit()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def dcp_problem(where: Path) -> str | None:
    """What is wrong with a DCP checkpoint's files as far as its index (.metadata) tells: the index unreadable, or
    a file it names missing or shorter than the bytes it indexes there. DCP keeps no checksum: bytes changed at
    full length are not seen here (dcp.load fails on them only where they no longer parse)."""
    try:
        meta = dcp.FileSystemReader(str(where)).read_metadata()
        needed: dict[str, int] = {}
        for info in meta.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as err:
        return f"its index {where / '.metadata'} cannot be read ({type(err).__name__}: {err})"
    for name, size in sorted(needed.items()):
        path = where / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} is truncated ({path.stat().st_size} bytes; the checkpoint's index needs {size})"
    return None


def choose_checkpoint(ckpt_dir: Path, rank: int) -> tuple[Path, Path | None]:
    """The latest finished checkpoint whose files are complete (saying which later ones it skips, and why), and
    the one before it; stops when there is none."""
    found = finished_checkpoints(ckpt_dir)
    if not found:
        stop(f"--resume: no finished checkpoint in {ckpt_dir}")
    skipped = []
    for i, where in enumerate(found):
        problem = dcp_problem(where)
        if problem is None:
            if skipped and rank == 0:
                print(f"warning: skipping {len(skipped)} damaged checkpoint(s): {'; '.join(skipped)}; resuming from "
                      f"{where}, the latest complete one", file=sys.stderr, flush=True)  # fmt: skip
            return where, found[i + 1] if i + 1 < len(found) else None
        skipped.append(problem)
    stop(
        f"--resume: no complete checkpoint in {ckpt_dir}: {'; '.join(skipped)}; start afresh without --resume "
        "(with another --ckpt-dir to keep these files)"
    )


def check_same_run(where: Path, options: dict, args, rank: int) -> None:
    """Stop a resume that would not continue the run the checkpoint `where` belongs to: other options (each
    named, with the run's value), or a checkpoint beyond --steps. A checkpoint at --steps says so."""
    path = where / RUN_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())["options"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            stop(f"--resume: {path} cannot be read ({type(err).__name__}: {err}): the options of the run it continues "
                 f"are unknown; move {where} aside to resume from the checkpoint before it")  # fmt: skip
        changed = [k for k in options if k in saved and saved[k] != options[k]]
        if changed:
            now = ", ".join(_flag(k, options[k]) for k in changed)
            then = " ".join(_flag(k, saved[k]) for k in changed)
            stop(
                f"--resume: {where} continues a run started with other options: this command has {now}; the run "
                f"had {then}. A resume cannot change them (it would keep the checkpoint's rates, or switch the model "
                f"or data stream mid-run): resume with {then}, or start a new run with another --ckpt-dir"
            )
    elif rank == 0:
        print(f"note: {where} has no {RUN_FILE} (saved by an older version of this script): the options it was "
              "saved with cannot be checked", file=sys.stderr, flush=True)  # fmt: skip
    step = int(where.name.split("-")[1])
    if step > args.steps:
        stop(f"--resume: {where} is at step {step}, beyond --steps {args.steps}: pass --steps {step} or more to "
             "continue it, or start afresh with another --ckpt-dir")  # fmt: skip
    if step == args.steps and rank == 0:
        print(f"{where} is at step {step} already: --steps {args.steps} leaves nothing to train (pass a larger "
              "--steps to continue)", flush=True)  # fmt: skip


def _said(err: BaseException) -> str:
    """An exception's type and first sentence."""
    text = str(err).strip()
    first = re.split(r"(?<=\.)\s", text.splitlines()[0])[0] if text else "no message"
    return f"{type(err).__name__}: {first}"


def load_failure(err: BaseException) -> str:
    """DCP's exception in one line: each failing rank's error (DCP gathers them), else the error itself."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {_said(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items()))
    return _said(err)


def damaged_file(where: Path) -> str | None:
    """The first file of a DCP checkpoint with an item that does not load, read item by item as DCP reads them (on
    a failed load only: it reads the whole checkpoint); None if every item loads."""
    meta = dcp.FileSystemReader(str(where)).read_metadata()
    for index, info in sorted(meta.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if info.transform_descriptors:  # compressed or otherwise transformed: not read here
            continue
        tensor = not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        try:
            with open(where / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = io.BytesIO(f.read(info.length))
            torch.load(raw, map_location="cpu", weights_only=tensor)  # as DCP loads it
        except Exception as err:
            return f"{where / info.relative_path} (its item {index.fqn} does not load: {_said(err)})"
    return None


def save_checkpoint(where: Path, state: dict, options: dict, rank: int, distributed: bool) -> None:
    """A DCP checkpoint, then run.json, then .done (written last: a crash mid-save leaves no finished checkpoint,
    also where an earlier save of the same step is overwritten)."""
    if rank == 0:
        (where / ".done").unlink(missing_ok=True)
    if distributed:
        dist.barrier()
    dcp.save(state, checkpoint_id=str(where))
    if distributed:
        dist.barrier()
    if rank == 0:
        tmp = where / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"options": options}, indent=1) + "\n")
        os.replace(tmp, where / RUN_FILE)
        (where / ".done").write_text("")


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
        stop(f"--batch {args.batch} must be divisible by the {world} processes")
    torch.set_flush_denormal(True)
    try:
        corpus = load_text(args.text or (DEFAULT_TEXT if DEFAULT_TEXT.is_file() else None))
    except DataError as err:
        stop(f"fsdp_lm.py: {err}")
    train_ids = corpus.train
    options = run_options(args, corpus.sha256)
    ckpt_dir = Path(args.ckpt_dir)
    if args.resume:  # checked before anything is built: every rank reads the same files and stops alike
        where, before = choose_checkpoint(ckpt_dir, rank)
        check_same_run(where, options, args, rank)

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

    start = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": 0}
        try:
            dcp.load(state, checkpoint_id=str(where))
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is not an Exception
            way = f"move it aside to resume from {before}" if before else "start afresh without --resume"
            try:  # rank 0 looks for the file; every rank stops
                bad = damaged_file(where) if rank == 0 else None
            except Exception:  # the index itself: said by the error above
                bad = None
            what = "every file its index names is there at full length: one holds damaged bytes"
            what = f"{bad} is damaged at full length" if bad else f"{what}, or it was saved by another model"
            del model, opt, sched, state, model_sd, optim_sd  # FSDP's state goes before the process group
            gc.collect()
            stop(f"--resume: cannot load {where} ({load_failure(err)}); {what} (DCP keeps no checksum): {way}")
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
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": done}
            save_checkpoint(ckpt_dir / f"step-{done}", state, options, rank, distributed)
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
