"""DistributedDataParallel on CPU (gloo, 2 processes) gives the full-batch trajectory.

DDP averages the two ranks' gradients of their half-batch mean losses, which is the gradient of
the full-batch mean loss; so 3 steps of StiefelAdam(param_groups(model)) under DDP must land where 3
single-process steps on the whole batch land, frames included (up to float32 round-off).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from stiefel_attention.bench.models import PatchViT
from stiefel_attention.manifold import isometry_error
from stiefel_attention.nn import frames
from stiefel_attention.optim import StiefelAdam, param_groups

WORLD_SIZE = 2
GLOBAL_BATCH = 16
STEPS = 3
TIMEOUT_S = 120.0


def _make_model() -> PatchViT:
    torch.manual_seed(0)
    return PatchViT(d_model=32, depth=1, n_heads=2, head_dim=8, qk="stiefel", qk_init="orthonormal")


def _make_optimizer(model):
    return StiefelAdam(param_groups(model, weight_decay=0.05, frame_lr=3e-2), lr=3e-3)


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    return images, labels


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_path: str, err_path: str) -> None:
    """One DDP rank: train STEPS steps on this rank's half of the global batch."""
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        try:
            model = _make_model()
            ddp = DDP(model)
            opt = _make_optimizer(ddp.module)
            images, labels = _global_batch()
            per_rank = GLOBAL_BATCH // world_size
            x = images[rank * per_rank : (rank + 1) * per_rank]
            y = labels[rank * per_rank : (rank + 1) * per_rank]
            for _ in range(STEPS):
                loss = F.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if rank == 0:
                params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
                frame_dict = {n: p.detach().clone() for n, p in frames(ddp.module)}
                torch.save({"params": params, "frames": frame_dict}, out_path)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(err_path, "a") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}\n")
        raise


def _reference_run():
    """Single process, full batch, same seed and hyperparameters."""
    model = _make_model()
    opt = _make_optimizer(model)
    images, labels = _global_batch()
    for _ in range(STEPS):
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.slow
def test_ddp_two_ranks_matches_full_batch(tmp_path):
    out_path = str(tmp_path / "ddp_rank0.pt")
    err_path = str(tmp_path / "errors.txt")
    port = _free_port()

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(rank, WORLD_SIZE, port, out_path, err_path)) for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    try:
        # One deadline for both ranks: a hang fails the test instead of blocking the suite.
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    errors = open(err_path).read() if os.path.exists(err_path) else ""
    assert not hung, f"DDP ranks {hung} did not finish within {TIMEOUT_S}s\n{errors}"
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE, f"exit codes {[p.exitcode for p in procs]}\n{errors}"
    assert os.path.exists(out_path), "rank 0 did not save its result"

    ddp_result = torch.load(out_path)

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _reference_run()
    finally:
        torch.set_num_threads(n_threads)

    ref_params = dict(ref.named_parameters())
    ref_frames = dict(frames(ref))
    init = dict(_make_model().named_parameters())

    # The frames: same names, orthonormal, moved by training, equal to the full-batch run.
    assert sorted(ddp_result["frames"]) == sorted(ref_frames) == ["blocks.0.attn.w_k", "blocks.0.attn.w_q"]
    for name, W in ddp_result["frames"].items():
        assert float(isometry_error(W)) < 1e-5, name
        assert not torch.allclose(W, init[name]), f"{name} was not trained"
        torch.testing.assert_close(W, ref_frames[name].detach(), rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")

    # Every other parameter too.
    assert sorted(ddp_result["params"]) == sorted(ref_params)
    for name, p in ddp_result["params"].items():
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
        if name in ("pos", "head.weight", "patchify.weight"):
            assert not torch.equal(p, init[name]), f"{name} was not trained"
