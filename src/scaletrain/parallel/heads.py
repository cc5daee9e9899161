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

from .parts import PARTS, checkpoint_view, part_of, split_by_heads, strided_by_heads


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

        self.weight = split(linear.weight, strided_by_heads())
        self.bias = None if linear.bias is None else split(linear.bias, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the input is the same on every process; its gradient is the sum of each process's heads' (an all-reduce
        # in the backward)
        x = _SumGradient.apply(x, self.mesh)
        bias = None
        if self.bias is not None:  # this process's heads' rows of each of q, k and v; the whole's gradient summed
            whole = _SumGradient.apply(self.bias.to_local(), self.mesh)
            bias = whole.view(PARTS, self.mesh.size(), -1)[:, self.mesh.get_local_rank()].reshape(-1)
        return F.linear(x, self.weight.to_local(), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, split by heads"


class _SumGradient(torch.autograd.Function):
    """The identity, whose backward sums the gradient over `mesh`'s processes (torch's functional all-reduce, which
    torch.compile traces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.mesh)), None


def fused_names(model: nn.Module) -> list[str]:
    """The weights of `model` split by heads (HeadsLinear's), by name."""
    return [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, HeadsLinear)]


class Views:
    """The views a checkpoint is written and read through (see the module's doc), swapped into the state dicts in
    place of the tensors; a tensor that has none (split by heads on one side only) is taken out of the main read
    and read whole after it, one at a time (`read_whole`, then `cut` into this process's part)."""

    def __init__(self):
        self._swapped: list[tuple[dict, Any, torch.Tensor]] = []  # (dict, key, original) put back after
        self.deferred: list[tuple[tuple, torch.Tensor, tuple]] = []  # (path in the checkpoint, tensor, shape)
        self._whole: torch.Tensor | None = None

    def swap(self, where: dict, key, stored: bool, path: tuple) -> None:
        """`stored`: the checkpoint holds this tensor as (3, rows / 3, ...), else under its own shape; `path`: its
        keys from the checkpoint's top."""
        from torch.distributed.tensor import DTensor

        t = where[key]
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return
        self._swapped.append((where, key, t))
        if stored and (split_by_heads(t) or not isinstance(t, DTensor)):
            where[key] = checkpoint_view(t)
            return
        shape = (PARTS, t.shape[0] // PARTS, *t.shape[1:]) if stored else tuple(t.shape)
        self.deferred.append((path, t, shape))
        del where[key]

    def read_whole(self, i: int, state: dict) -> dict:
        """A state dict holding only the `i`-th deferred tensor, whole, under its path (to read into)."""
        path, t, shape = self.deferred[i]
        self._whole = torch.empty(shape, dtype=t.dtype, device=t.to_local().device)
        one: dict = {}
        node = one
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = self._whole
        return one

    @torch.no_grad()
    def cut(self, i: int) -> None:
        """The `i`-th deferred tensor given its part of what `read_whole` read."""
        if i < len(self.deferred) and self._whole is not None:
            t = self.deferred[i][1]
            t.to_local().copy_(part_of(self._whole.view(t.shape), t))
        self._whole = None

    def restore(self) -> None:
        """The tensors back in their dicts."""
        for where, key, t in self._swapped:
            where[key] = t

    @contextlib.contextmanager
    def swapped(self):
        """The block (a checkpoint's write or read) with the views in place, the tensors back after it whatever
        happens (the dicts may be the optimizer's own)."""
        try:
            yield
        finally:
            self.restore()


def viewed(model_state: dict, optim_state: dict, stored, split, flat: bool) -> Views:
    """The views of a model's and an optimizer's state dicts (torch's get_state_dict, the optimizer's flattened or
    not) for a checkpoint that holds `stored` as (3, rows / 3, ...), of a model that splits `split` by heads."""
    views = Views()
    for name in sorted({*stored, *split}):  # in one order on every process
        keep = name in stored
        if name in model_state:
            views.swap(model_state, name, keep, ("model", name))
        if flat:
            for key in sorted(k for k in optim_state if k.startswith(f"state.{name}.")):
                views.swap(optim_state, key, keep, ("optimizer", key))
        else:
            slots = optim_state.get("state", {}).get(name, {})
            for key in sorted(slots):
                views.swap(slots, key, keep, ("optimizer", "state", name, key))
    return views
