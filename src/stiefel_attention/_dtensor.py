"""Frames held as DTensors (FSDP2, HSDP, tensor parallelism): which part of a frame tensor a rank holds.

A frame tensor has shape (..., d, r): leading batch dimensions (heads), then the d x r frames. The
Riemannian rule needs whole frames. Per placement on each mesh dimension:

- Replicate, or Shard(i) on a batch dimension i (FSDP2's default Shard(0) splits the heads): every frame a
  rank holds is whole, so the step runs on the local tensor with no communication ("local").
- Shard on d or r (e.g. `fully_shard(..., shard_placement_fn=...)` choosing Shard(1)): a rank holds a slice of
  every frame. The step gathers the whole frames (one all-gather of the frame, its gradient and its first
  moment), runs on them identically on every rank, and each rank keeps its slice ("gather"). A frame is never
  updated from a partial view.
- anything else (Partial: values not yet reduced): refused, naming the parameter and its placement.

This module is the only place the optimizers touch torch.distributed; without it they work on plain tensors.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

__all__ = ["LOCAL", "GATHER", "all_reduce_over_mesh", "frame_layout", "is_dtensor", "like_frames_batch"]

LOCAL, GATHER = "local", "gather"


@functools.lru_cache(maxsize=1)
def _dtensor_types():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor, Replicate, Shard


def is_dtensor(t) -> bool:
    # No tensor can be a DTensor before torch.distributed.tensor is imported: look it up, never import it here
    # (importing it costs about a second, and the plain path should not pay for it)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def frame_layout(p: Tensor, where: str) -> str:
    """LOCAL or GATHER for a DTensor frame tensor (see the module docstring); ValueError for another placement."""
    _, Replicate, Shard = _dtensor_types()
    layout = LOCAL
    for placement in p.placements:
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard):
            if placement.dim % p.dim() >= p.dim() - 2:
                layout = GATHER
            continue
        raise ValueError(
            f"{where} is a DTensor with placement {placement!r} on its mesh ({tuple(p.placements)}): Stiefel "
            "optimizers step frames that are replicated (Replicate) or sharded (Shard, on any dimension); "
            "reduce a Partial placement before the optimizer step"
        )
    return layout


def _batch_placements(p: Tensor) -> list:
    """The placements of a per-frame tensor of shape p.shape[:-2]: a shard on a batch dimension stays, one on
    d or r (whose frames are gathered) becomes Replicate."""
    _, Replicate, Shard = _dtensor_types()
    out = []
    for placement in p.placements:
        if isinstance(placement, Shard) and placement.dim % p.dim() < p.dim() - 2:
            out.append(Shard(placement.dim % p.dim()))
        else:
            out.append(Replicate())
    return out


def like_frames_batch(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros of global shape p.shape[:-2] (one scalar per frame), placed like p's frames: a DTensor for a
    DTensor p, so that checkpoints (torch.distributed.checkpoint) reshard it with the frames."""
    DTensor = _dtensor_types()[0]
    local = p.to_local()
    gathered = frame_layout(p, "frame tensor") == GATHER
    local_shape = p.shape[:-2] if gathered else local.shape[:-2]
    zeros = torch.zeros(local_shape, dtype=dtype, device=local.device)
    shape = torch.Size(p.shape[:-2])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(zeros, p.device_mesh, _batch_placements(p), run_check=False, shape=shape, stride=stride)


def all_reduce_over_mesh(t: Tensor, op, mesh) -> Tensor:
    """t reduced in place over every rank of mesh (one all-reduce per mesh dimension)."""
    import torch.distributed as dist

    for dim in range(mesh.ndim):
        dist.all_reduce(t, op=op, group=mesh.get_group(dim))
    return t
