"""Every rank decides alike on meshes where one rank's view differs: the reductions over a device mesh.

The optimizer combines per-rank verdicts (a frame off the manifold, a non-finite gradient) over every dimension of
the mesh. On a 1-D mesh a reduction over the wrong mesh dimension, or none, goes unseen when every rank's data is
alike; here one rank holds something the others do not, on an HSDP 2 x 2 mesh (replicate x shard: a reduction over
one mesh dimension reaches only half the ranks) and in skip mode (nonfinite="skip"), where an AdamW group whose
gradient is not finite on one rank must be skipped on every rank. Two launches (4 and 2 gloo processes) run the
scenarios; the model and the sharding are tests/test_fsdp.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import launch
from stiefel_attention import StiefelAdam, frames, param_groups
from test_fsdp import _full, _my_slice, _opt, _sharded

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _loss_backward(model, rank: int, world: int) -> None:
    x = _my_slice(rank, world)
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()


# --- the ranks' side ---------------------------------------------------------------------------------------


def _scenario_hsdp_refusals(rank, world, out):
    """On the 2 x 2 mesh the last rank alone holds a NaN in its gradient shard, then alone a doubled frame
    shard: every rank refuses the step, then the optimizer."""
    from stiefel_attention import NonFiniteGradientError

    said = {}
    model = _sharded(world, "hsdp")
    opt = _opt(model)
    _loss_backward(model, rank, world)
    frame = model.blocks[0].attn.w_q
    before = _full(frame)
    if rank == world - 1:
        frame.grad.to_local()[0, 0, 0] = float("nan")
    try:
        opt.step()
        said["nonfinite"] = "stepped"
    except NonFiniteGradientError as err:
        said["nonfinite"] = str(err)
    said["unchanged"] = bool(torch.equal(_full(frame), before))
    with torch.no_grad():
        if rank == world - 1:
            model.blocks[1].attn.w_k.to_local().mul_(2.0)
    try:
        _opt(model)
        said["start"] = "accepted"
    except ValueError as err:
        said["start"] = str(err)
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(said))


def _scenario_skip(rank, world, out, mode):
    """nonfinite="skip" with a NaN in rank 0's shard of the head's weight gradient: the head's AdamW group keeps
    its parameters and moments on every rank; the frames, whose gradients are finite, step."""
    model = _sharded(world, mode)
    opt = StiefelAdam(param_groups(model, 0.1, frame_lr=0.05), lr=1e-2, max_step=0.1, nonfinite="skip")
    for step in range(2):  # the first step makes moments to keep; the second brings the NaN
        opt.zero_grad()
        _loss_backward(model, rank, world)
        if step == 0:
            opt.step()
    head = model.head.weight
    before = {"head": head.to_local().clone(), "exp_avg": opt.state[head]["exp_avg"].to_local().clone()}
    frames_before = [p.to_local().clone() for _, p in frames(model)]
    if rank == 0:
        head.grad.to_local()[0, 0] = float("nan")
    opt.step()
    said = {
        "head_unchanged": bool(torch.equal(head.to_local(), before["head"])),
        "exp_avg_unchanged": bool(torch.equal(opt.state[head]["exp_avg"].to_local(), before["exp_avg"])),
        "head_rows": head.to_local().shape[0],
        "frames_moved": [not torch.equal(p.to_local(), b) for (_, p), b in zip(frames(model), frames_before)],
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(said))


def _run(rank, world, scenarios):
    for name, args in scenarios:
        globals()[f"_scenario_{name}"](rank, world, *args)


# --- the test's side -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mesh")
    f = {k: str(d / k) for k in ("hsdp_refuse", "hsdp_skip", "skip")}
    launch(4, _run, ([("hsdp_refusals", (f["hsdp_refuse"],)), ("skip", (f["hsdp_skip"], "hsdp"))],), d)
    launch(2, _run, ([("skip", (f["skip"], "shard0"))],), d)
    return f


def _said(path: str, world: int) -> list[dict]:
    return [json.loads(Path(f"{path}.rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_every_rank_of_a_two_by_two_mesh_refuses_alike(runs):
    said = _said(runs["hsdp_refuse"], 4)
    for rank, s in enumerate(said):
        assert "non-finite gradient" in s["nonfinite"] and s["unchanged"], rank  # rank 3 alone had the NaN
        assert "is not on the Stiefel manifold" in s["start"], rank  # rank 3 alone held the doubled shard
    assert len({s["nonfinite"] for s in said}) == 1 and len({s["start"] for s in said}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("which, world", [("skip", 2), ("hsdp_skip", 4)], ids=["fsdp-2", "hsdp-2x2"])
def test_skip_mode_skips_a_sharded_adamw_group_on_every_rank(runs, which, world):
    said = _said(runs[which], world)
    assert all(s["head_rows"] > 0 for s in said)  # every rank holds part of the head: each one could step
    for rank, s in enumerate(said):
        assert s["head_unchanged"] and s["exp_avg_unchanged"], (rank, s)
        assert any(s["frames_moved"]), (rank, s)  # a rank holding frames stepped them: skip is per group
