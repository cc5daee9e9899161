"""A split tensor's part on this process: which placements are cut from the whole tensor rather than read as
rows, the part cut from a whole tensor, the part read alone from a file, and the (3, rows / 3, ...) view under which
a weight split by heads (q, k and v fused, heads.py) is each process's box of the whole."""

from __future__ import annotations

import torch

PARTS = 3  # q, k and v


def strided_by_heads():
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=PARTS)


def split_by_heads(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor split by heads (a HeadsLinear weight, or its optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(by_heads(p) for p in t.placements)


def by_heads(placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard) and placement.split_factor == PARTS


def checkpoint_view(t: torch.Tensor) -> torch.Tensor:
    """A HeadsLinear weight (or its optimizer state) as (3, rows / 3, ...): each process's part a box."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (PARTS, t.shape[0] // PARTS, *t.shape[1:])
    if not isinstance(t, DTensor):
        return t.view(shape)
    placements = [Shard(1) if by_heads(p) else Shard(p.dim + 1) if isinstance(p, Shard) else p
                  for p in t.placements]
    local = t.to_local()
    return DTensor.from_local(local.view(PARTS, local.shape[0] // PARTS, *local.shape[1:]), t.device_mesh,
                              placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def cut_from_whole(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor placed otherwise than as fsdp's rows (a tensor-parallel split, a 2-D mesh): its
    part is cut from the whole tensor (`part_of`), not read as rows."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and (len(t.placements) != 1 or t.placements[0] != Shard(0))


def part_of(whole: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This process's part of `whole` as the DTensor `t` places it (any placements, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    local = t.to_local()
    return distribute_tensor(whole.to(local.device), t.device_mesh, t.placements, src_data_rank=None).to_local()


def read_part(whole, t: torch.Tensor) -> torch.Tensor:
    """This process's part of the DTensor `t` read from `whole` (anything sliced as a tensor is: a safetensors
    slice, a tensor), reading that part only."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    view = checkpoint_view(t) if split_by_heads(t) else t
    shape, offset = compute_local_shape_and_global_offset(view.shape, view.device_mesh, view.placements)
    if view is t:
        return whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    third = t.shape[0] // PARTS  # the view is (3, rows / 3, ...): each of q, k and v read as rows of the whole
    rest = tuple(slice(o, o + s) for o, s in zip(offset[2:], shape[2:]))
    parts = [whole[(slice(k * third + offset[1], k * third + offset[1] + shape[1]), *rest)]
             for k in range(offset[0], offset[0] + shape[0])]
    return torch.cat(parts).view(t.to_local().shape)
