"""Launching real multi-process (gloo, CPU) jobs from a test: a free port, one deadline for every rank, no
process left behind, and the traceback of any rank that failed."""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target, args, err_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
        try:
            target(rank, world, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(err_path, "a") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}\n")
        raise


def launch(world: int, target, args: tuple, tmp_dir, timeout_s: float = 180.0) -> None:
    """Run target(rank, world, *args) in `world` spawned processes of one gloo group; raise AssertionError with
    every failing rank's traceback if any fails or the deadline passes (the processes are then killed)."""
    err_path = os.path.join(str(tmp_dir), f"errors-{world}-{time.monotonic_ns()}.txt")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, err_path)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = open(err_path).read() if os.path.exists(err_path) else ""
    assert not hung, f"ranks {hung} of {world} did not finish within {timeout_s:.0f} s\n{errors}"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}\n{errors}"
