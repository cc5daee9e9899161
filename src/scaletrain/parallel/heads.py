"""A fused q, k, v projection (timm's `Attention.qkv`, one Linear(dim, 3 x dim)) split between tensor-parallel
processes by heads, and the checkpoint views that keep its tensors readable on any layout.

Its output is [q | k | v], each reshaped by heads, so a plain column split would give the first process all of q and
part of k. Here each process holds the rows of its own heads in each of q, k and v: the weight is a DTensor placed
`_StridedShard(0, split_factor=3)` (each third split over the processes, a process's pieces side by side), whose
whole tensor is the unsplit model's, in its order (`full_tensor()` and a weights file give the model's own rows).
The bias is small and kept whole on every process; each takes its heads' rows of it.

torch.distributed.checkpoint stores boxes of a tensor, which a strided split is not: in a checkpoint each such
tensor is seen as (3, rows / 3, ...), where each process's part is a box (`checkpoint_view`); a layout without the
split (one process, fsdp) reads it through the same view of its own tensors, or whole and cut (`Views`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .materialise import part_of

PARTS = 3  # q, k and v


def _strided():
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=PARTS)


class HeadsLinear(nn.Module):
    """`linear` (q, k and v fused) split by heads over `mesh` (1-D, the tensor-parallel processes); its forward
    gives this process's heads' [q | k | v]. Its parameters keep the Linear's names."""

    def __init__(self, linear: nn.Linear, mesh):
        from torch.distributed.tensor import Replicate, distribute_tensor

        super().__init__()
        self.mesh = mesh
        self.in_features, self.out_features = linear.in_features, linear.out_features
        src = None if linear.weight.is_meta else 0  # real tensors: every process's part of process 0's

        def split(t: torch.Tensor, placement) -> nn.Parameter:
            return nn.Parameter(distribute_tensor(t.data, mesh, [placement], src_data_rank=src),
                                requires_grad=t.requires_grad)

        self.weight = split(linear.weight, _strided())
        self.bias = None if linear.bias is None else split(linear.bias, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        # the input is the same on every process; its gradient is the sum of each process's heads' (an all-reduce
        # in the backward, made by DTensor's redistribution)
        x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        bias = None if self.bias is None else self.bias.redistribute(placements=[_strided()]).to_local()
        return F.linear(x, self.weight.to_local(), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, split by heads"


def fused_names(model: nn.Module) -> list[str]:
    """The weights of `model` split by heads (HeadsLinear's), by name."""
    return [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, HeadsLinear)]


def split_by_heads(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor split by heads (a HeadsLinear weight, or its optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(_by_heads(p) for p in t.placements)


def _by_heads(placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard) and placement.split_factor == PARTS


def checkpoint_view(t: torch.Tensor) -> torch.Tensor:
    """A HeadsLinear weight (or its optimizer state) as (3, rows / 3, ...): each process's part a box."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (PARTS, t.shape[0] // PARTS, *t.shape[1:])
    if not isinstance(t, DTensor):
        return t.view(shape)
    placements = [Shard(1) if _by_heads(p) else Shard(p.dim + 1) if isinstance(p, Shard) else p
                  for p in t.placements]
    local = t.to_local()
    return DTensor.from_local(local.view(PARTS, local.shape[0] // PARTS, *local.shape[1:]), t.device_mesh,
                              placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


class Views:
    """The views a checkpoint is written and read through (see the module's doc), swapped into the state dicts in
    place of the tensors (a view of the tensor itself, or a whole tensor read and cut into the part after)."""

    def __init__(self):
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the tensor, the whole one read for it)
        self._swapped: list[tuple[dict, Any, torch.Tensor]] = []  # (dict, key, original) put back after

    def swap(self, where: dict, key, stored: bool) -> None:
        """`stored`: the checkpoint holds this tensor as (3, rows / 3, ...), else under its own shape."""
        from torch.distributed.tensor import DTensor

        t = where[key]
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return
        self._swapped.append((where, key, t))
        if stored and (split_by_heads(t) or not isinstance(t, DTensor)):
            where[key] = checkpoint_view(t)
            return
        shape = (PARTS, t.shape[0] // PARTS, *t.shape[1:]) if stored else tuple(t.shape)
        whole = torch.empty(shape, dtype=t.dtype, device=t.to_local().device)  # read whole, this part kept
        self._copies.append((t, whole))
        where[key] = whole

    @torch.no_grad()
    def restore(self, read: bool = True) -> None:
        """The tensors back in their dicts; `read`: each first holding what was read into its view (a write, or
        a read that failed, leaves them as they were)."""
        for t, whole in self._copies if read else ():
            t.to_local().copy_(part_of(whole.view(t.shape), t))
        for where, key, t in self._swapped:
            where[key] = t

    @contextlib.contextmanager
    def swapped(self):
        """The block (a checkpoint's write or read) with the views in place, the tensors back after it whatever
        happens (the dicts may be the optimizer's own)."""
        try:
            yield
        except BaseException:
            self.restore(read=False)
            raise
        self.restore()


def viewed(model_state: dict, optim_state: dict, stored, split, flat: bool) -> Views:
    """The views of a model's and an optimizer's state dicts (torch's get_state_dict, the optimizer's flattened or
    not) for a checkpoint that holds `stored` as (3, rows / 3, ...), of a model that splits `split` by heads."""
    views = Views()
    for name in {*stored, *split}:
        keep = name in stored
        if name in model_state:
            views.swap(model_state, name, keep)
        if flat:
            for key in [k for k in optim_state if k.startswith(f"state.{name}.")]:
                views.swap(optim_state, key, keep)
        else:
            slots = optim_state.get("state", {}).get(name, {})
            for key in list(slots):
                views.swap(slots, key, keep)
    return views
