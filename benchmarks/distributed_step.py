"""The optimizer step under FSDP2 with 1, 2 and 4 processes (gloo, CPU): StiefelAdam against AdamW side by side,
and the bytes each rank hands to collectives during the step.

    python benchmarks/distributed_step.py [--worlds 1,2,4] [--repeats 10] [--json out.json]
        [--readme docs/performance.md]

Model: 4 blocks of width 256, 8 heads of 32 (frames: 8 tensors of 8 frames of St(256, 32)); every block and the
root fully_shard-ed, frames split by heads (Shard(0)), or along d_model (Shard(1), `--shard1`). The step is timed
alone (fixed random gradients, no forward or backward); StiefelAdam(param_groups(model)) and
torch.optim.AdamW(foreach) each step their own copy of the model, round-robin, and every rank reports its
median; the table shows the slowest rank's. Bytes: the payload of every collective issued inside one step, as
the dispatcher sees it (c10d and functional-collective ops): 0 for the frames' update under Shard(0); the
raise-mode finiteness verdict is one all-reduce of one float per parameter, so that every rank refuses or steps
alike. A benchmark, not a test: it asserts nothing. On a machine with fewer cores than processes the ranks share
cores, so absolute times there measure contention; the ratio is still side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from readme import replace_block  # benchmarks/readme.py, beside this script

WIDTH, HEADS, HEAD_DIM, DEPTH = 256, 8, 32, 4


def _model():
    from stiefel_attention.nn import Block

    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(WIDTH, HEADS, HEAD_DIM, 4 * WIDTH, causal=True) for _ in range(DEPTH)])


class _Bytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the tensor payload of every collective dispatched while active."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace if hasattr(func, "namespace") else ""
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.calls += 1
            for a in (*args, *(kwargs or {}).values()):
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor):
                        self.bytes += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def _rank(rank: int, world: int, port: int, repeats: int, shard1: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from stiefel_attention import StiefelAdam, frames, param_groups

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    opts = {}
    for name in ("AdamW(foreach)", "StiefelAdam(max_step=0.1)", "StiefelAdam(sync-free)"):
        model = _model()
        ids = {id(p) for _, p in frames(model)}
        kw = {"mesh": mesh}
        if shard1:
            kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in ids else Shard(0)
        for block in model:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():  # the same gradients for every method
            p.grad = torch.distributed.tensor.distribute_tensor(
                torch.randn(p.shape, generator=gen) * 1e-2, mesh, p.placements
            )
        if name.startswith("AdamW"):
            opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        else:
            sync_free = dict(nonfinite="skip", foreach=True) if "sync-free" in name else {}
            opts[name] = StiefelAdam(param_groups(model, 0.1, frame_lr=1e-2), lr=1e-3, max_step=0.1, **sync_free)
    times = {name: [] for name in opts}
    for i in range(repeats + 2):  # round-robin; the first two rounds warm up
        for name, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    comm = {}
    for name, opt in opts.items():
        with _Bytes() as counter:
            opt.step()
        comm[name] = {"bytes": counter.bytes, "collectives": counter.calls}
    result = {"median_s": {n: statistics.median(t) for n, t in times.items()}, "comm": comm}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, repeats: int, shard1: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r")
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, repeats, shard1, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        for p in procs:
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"world {world}: a rank failed (exit codes {[p.exitcode for p in procs]})")
        ranks = [json.load(open(f"{out}.{r}")) for r in range(world)]
    slowest = {n: max(r["median_s"][n] for r in ranks) for n in ranks[0]["median_s"]}
    return {"median_s": slowest, "comm_rank0": ranks[0]["comm"]}


def markdown_table(result: dict) -> str:
    lines = [
        f"The optimizer step under FSDP2 (`benchmarks/distributed_step.py`): {DEPTH} blocks of width {WIDTH}, "
        f"{HEADS} heads of {HEAD_DIM}, frames split by heads, fixed gradients, median of {result['repeats']} "
        f"round-robin rounds (the slowest rank's), torch {result['torch']}, gloo, 1 thread per process on "
        f"{result['machine']}. Bytes: what rank 0 hands to collectives in one step.",
        "",
        "| processes | method | median ms | x AdamW | collectives | bytes |",
        "|---|---|---|---|---|---|",
    ]
    for world, r in result["worlds"].items():
        base = r["median_s"]["AdamW(foreach)"]
        for name, t in r["median_s"].items():
            c = r["comm_rank0"][name]
            lines.append(f"| {world} | {name} | {t * 1e3:.1f} | {t / base:.2f} | {c['collectives']} | {c['bytes']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4", help="numbers of processes (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shard1", action="store_true", help="frames split along d_model instead of by heads")
    ap.add_argument("--json", default=None)
    ap.add_argument("--readme", default=None, help="replace the distributed-benchmark block of this markdown file")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    result = {
        "worlds": {},
        "repeats": args.repeats,
        "shard1": args.shard1,
        "torch": torch.__version__,
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
    }
    for world in worlds:
        r = measure(world, args.repeats, args.shard1)
        result["worlds"][str(world)] = r
        print(f"{world} process(es):", file=sys.stderr)
        base = r["median_s"]["AdamW(foreach)"]
        for name, t in r["median_s"].items():
            c = r["comm_rank0"][name]
            print(f"  {name:<28}{t * 1e3:8.1f} ms  x{t / base:.2f}  {c['collectives']} collectives, {c['bytes']} B")
    table = markdown_table(result)
    print(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.readme:
        replace_block(args.readme, table, "<!-- distributed:start -->", "<!-- distributed:end -->")


if __name__ == "__main__":
    main()
