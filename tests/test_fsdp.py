"""StiefelAdam under FSDP2 (fully_shard, DTensor parameters), HSDP and DCP checkpoints, on CPU with gloo.

Each rank trains on its slice of one global batch; FSDP averages the gradients, which is the gradient of the
full-batch mean loss, so the sharded run must land where one process on the whole batch lands (to float32
round-off). The model has 3 heads: with 2 ranks the heads split unevenly, with 4 one rank holds no frame at
all. Frames are sharded by heads (Shard(0), FSDP2's default: whole frames per rank), along d_model
(Shard(1), through shard_placement_fn: frames gathered for the step), and on a 2 x 2 mesh (HSDP).
Three launches (4, 1 and 2 processes) run every scenario; each test reads its scenario's result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_helpers import launch
from stiefel_attention import StiefelAdam, frames, isometry_error, param_groups
from stiefel_attention.nn import Block

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

HEADS, STEPS, BATCH = 3, 3, 8


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList([Block(16, HEADS, 4, 32, causal=True) for _ in range(2)])
        self.head = nn.Linear(16, 11)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model() -> _Tiny:
    torch.manual_seed(0)
    return _Tiny()


def _opt(model) -> StiefelAdam:
    return StiefelAdam(param_groups(model, 0.1, frame_lr=0.05), lr=1e-2, max_step=0.1)


def _batch() -> torch.Tensor:
    return torch.randint(0, 11, (BATCH, 9), generator=torch.Generator().manual_seed(5))


def _train(model, opt, x, steps: int) -> None:
    for _ in range(steps):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _full(p) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


# --- the ranks' side ---------------------------------------------------------------------------------------


def _sharded(world: int, mode: str = "shard0"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _model()
    shape, names = ((2, world // 2), ("replicate", "shard")) if mode == "hsdp" else ((world,), None)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kw = {"mesh": mesh}
    if mode == "shard1":  # frames split along d_model; the rest as usual
        ids = {id(p) for _, p in frames(model)}
        kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in ids else Shard(0)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _my_slice(rank: int, world: int) -> torch.Tensor:
    n = BATCH // world
    return _batch()[rank * n : (rank + 1) * n]


def _save_params(model, rank: int, out: str) -> None:
    full = {name: _full(p) for name, p in model.named_parameters()}  # every rank gathers
    if rank == 0:
        placements = {name: str(tuple(p.placements)) for name, p in frames(model)}
        shapes = {name: list(p.to_local().shape) for name, p in frames(model)}
        torch.save({"params": full, "placements": placements, "local_shapes_rank0": shapes}, out)


def _scenario_train(rank, world, out, mode):
    model = _sharded(world, mode)
    opt = _opt(model)
    _train(model, opt, _my_slice(rank, world), STEPS)
    _save_params(model, rank, out)
    local = [list(p.to_local().shape) for _, p in frames(model)]
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(local))


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _scenario_dcp_save(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp

    model = _sharded(world)
    opt = _opt(model)
    _train(model, opt, _my_slice(rank, world), 2)
    dcp.save(_state(model, opt), checkpoint_id=ckpt)


def _scenario_dcp_load(rank, world, ckpt, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = _sharded(world)
    opt = _opt(model)
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, opt, _my_slice(rank, world), 2)
    _save_params(model, rank, out)


def _scenario_refusals(rank, world, out):
    """A non-finite gradient on one rank's shard, and a non-orthonormal frame on one rank: every rank refuses
    alike (a rank that stepped alone would leave the others waiting or out of step). And a Partial placement."""
    from torch.distributed.tensor import DTensor, Partial

    from stiefel_attention import NonFiniteGradientError

    said = {}
    model = _sharded(world)
    opt = _opt(model)
    x = _my_slice(rank, world)
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    frame = model.blocks[0].attn.w_q
    before = _full(frame)
    if rank == 0:
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
    partial = nn.Parameter(DTensor.from_local(torch.zeros(2, 8, 3), frame.device_mesh, [Partial()]))
    try:
        StiefelAdam([partial], lr=0.1)
        said["partial"] = "accepted"
    except ValueError as err:
        said["partial"] = str(err)
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(said))


def _run(rank, world, scenarios):
    for name, args in scenarios:
        globals()[f"_scenario_{name}"](rank, world, *args)


# --- the test's side -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, in three launches: 4 ranks (save A), 1 rank (load A, save C), 2 ranks (load A and C)."""
    d = tmp_path_factory.mktemp("fsdp")
    f = {k: str(d / k) for k in ("w4", "hsdp", "A", "A_at_1", "C", "w2", "shard1", "A_at_2", "C_at_2", "refuse")}
    launch(4, _run, ([("train", (f["w4"], "shard0")), ("train", (f["hsdp"], "hsdp")), ("dcp_save", (f["A"],))],), d)
    launch(1, _run, ([("dcp_load", (f["A"], f["A_at_1"])), ("dcp_save", (f["C"],))],), d)
    launch(
        2,
        _run,
        (
            [
                ("train", (f["w2"], "shard0")),
                ("train", (f["shard1"], "shard1")),
                ("dcp_load", (f["A"], f["A_at_2"])),
                ("dcp_load", (f["C"], f["C_at_2"])),
                ("refusals", (f["refuse"],)),
            ],
        ),
        d,
    )
    return f


def _reference(steps: int) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model()
        _train(model, _opt(model), _batch(), steps)
    finally:
        torch.set_num_threads(threads)
    return {name: p.detach() for name, p in model.named_parameters()}


def _assert_matches(path: str, steps: int) -> dict:
    got = torch.load(path)
    ref = _reference(steps)
    start = {name: p.detach() for name, p in _model().named_parameters()}
    assert sorted(got["params"]) == sorted(ref)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
        if name.endswith(("w_q", "w_k")):
            assert float(isometry_error(p)) < 1e-5, name
            assert not torch.allclose(p, start[name]), f"{name} did not move"
    return got


@pytest.mark.slow
@pytest.mark.parametrize("which", ["w2", "w4"])
def test_fsdp_matches_one_process_with_uneven_and_empty_shards(runs, which):
    got = _assert_matches(runs[which], STEPS)
    assert set(got["placements"].values()) == {"(Shard(dim=0),)"}
    world = int(which[1])
    heads = [json.loads(Path(f"{runs[which]}.rank{r}.json").read_text())[0][0] for r in range(world)]
    assert sum(heads) == HEADS and (0 in heads) == (world > HEADS)  # 2 ranks: 2 + 1; 4 ranks: 1 + 1 + 1 + 0


@pytest.mark.slow
def test_frames_sharded_along_d_model_are_stepped_whole(runs):
    got = _assert_matches(runs["shard1"], STEPS)
    assert set(got["placements"].values()) == {"(Shard(dim=1),)"}
    assert all(shape == [HEADS, 8, 4] for shape in got["local_shapes_rank0"].values())  # a slice of every frame


@pytest.mark.slow
def test_hsdp_on_a_two_by_two_mesh(runs):
    got = _assert_matches(runs["hsdp"], STEPS)
    assert set(got["placements"].values()) == {"(Replicate(), Shard(dim=0))"}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["A_at_2", "A_at_1", "C_at_2"], ids=["4->2", "4->1", "1->2"])
def test_a_dcp_checkpoint_resumes_at_another_world_size_as_if_never_stopped(runs, which):
    _assert_matches(runs[which], 4)  # 2 steps, saved, loaded at another world size, 2 more


@pytest.mark.slow
def test_every_rank_refuses_alike(runs):
    said = [json.loads(Path(f"{runs['refuse']}.rank{r}.json").read_text()) for r in range(2)]
    for rank, s in enumerate(said):
        assert "non-finite gradient" in s["nonfinite"] and s["unchanged"], rank  # rank 1's gradient was finite
        assert "is not on the Stiefel manifold" in s["start"], rank  # rank 1 alone held a bad frame
        assert "placement Partial" in s["partial"] and "param_groups[0]['params'][0]" in s["partial"], rank
    assert said[0]["nonfinite"] == said[1]["nonfinite"]
