"""Every module's input and output in one forward, whole: what `scaletrain verify` compares module by module
between a layout and one process.

Hooks on the user's model (its modules under the names the model gives them: a stage, a shard or a split layer
keeps them) record each call's first tensor argument and first tensor output. A module called once per
micro-batch (a pipeline stage) gets its calls joined along the batch. A tensor-parallel process holds parts: a
DTensor is gathered whole; a split layer's output (a local tensor) is gathered over the layer's processes as its
weight's rows are split (q, k and v in three parts for a fused projection), and any other tensor that is a
`--tp`-th of the one-process shape in one dimension is gathered along it. Every process of a split layer takes part
in each gather alike: they hold the same modules and shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .engine import users_model
from .parts import PARTS, split_by_heads


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a module's argument or output (a tensor, a tuple or list, a dict, an object with
    tensor fields), detached; None without one."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        values = value
    elif isinstance(value, dict):
        values = list(value.values())
    elif hasattr(value, "__dict__"):
        values = list(vars(value).values())
    else:
        return None
    for v in values:
        found = first_tensor(v) if isinstance(v, (torch.Tensor, tuple, list, dict)) else None
        if found is not None:
            return found
    return None


def split_layers(model: nn.Module) -> dict[str, str]:
    """{module: "colwise" | "rowwise"} of the layers whose weight is split by tensor parallelism: its rows (the
    outputs, each process a part) or its columns (the inputs; the output summed whole)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, module in users_model(model).named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()):
            placement = weight.placements[weight.device_mesh.mesh_dim_names.index("tp")]
            if not isinstance(placement, Replicate):
                out[name] = "rowwise" if getattr(placement, "dim", 0) == 1 else "colwise"
    return out


class Capture:
    """Records every module's calls while entered (see the module's doc)."""

    def __init__(self, model: nn.Module):
        self.model = users_model(model)
        self.order: list[str] = []  # module names in the order their forwards began
        self.calls: dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
        self._handles: list = []

    def __enter__(self) -> "Capture":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._began(name)))
            self._handles.append(module.register_forward_hook(self._ended(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _began(self, name: str):
        def hook(module, args):
            if name not in self.calls:
                self.order.append(name)
                self.calls[name] = []
        return hook

    def _ended(self, name: str):
        def hook(module, args, output):
            inp, out = first_tensor(args), first_tensor(output)
            self.calls[name].append((None if inp is None else inp.clone(), None if out is None else out.clone()))
        return hook

    def whole(self, tp_group, tp: int, reference: dict[str, tuple[int, ...]] | None) -> dict[str, torch.Tensor]:
        """{"<module>|input" / "<module>|output": the whole tensor on the CPU}, in forward order, micro-batches
        joined. `reference`: each key's shape on one process (None: this is one process), which says how a part
        is gathered under tensor parallelism (`tp` > 1: over `tp_group`, the split layers' processes)."""
        modules = dict(self.model.named_modules())
        out: dict[str, torch.Tensor] = {}
        for name in self.order:
            calls = self.calls[name]
            for k, which in ((0, "input"), (1, "output")):
                parts = [c[k] for c in calls if c[k] is not None]
                if not parts:
                    continue
                t = parts[0] if len(parts) == 1 else _joined(parts)
                if t is None:
                    continue
                key = f"{name}|{which}"
                shape = (reference or {}).get(key)
                if shape and t.dim() and len(shape) == t.dim() and t.shape[0] > shape[0]:
                    t = t[-shape[0]:]  # a pipeline stage's first forward infers its shapes on a micro-batch first
                t = _whole(t, modules[name], which, tp_group, tp, shape)
                out[key] = t.float().cpu().contiguous() if t.is_floating_point() else t.cpu().contiguous()
        return out


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """A module's calls, one per micro-batch, as one batch (None when their shapes do not join)."""
    if any(p.dim() == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
        return None
    return torch.cat([p.to_local() if hasattr(p, "to_local") else p for p in parts])


def _whole(t: torch.Tensor, module: nn.Module, which: str, group, tp: int, shape: tuple[int, ...] | None
           ) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    if tp == 1 or shape is None or tuple(t.shape) == tuple(shape):
        return t
    weight = getattr(module, "weight", None)
    if which == "output" and isinstance(weight, DTensor) and split_by_heads(weight):  # q, k and v: three parts
        gathered = _gather(t.unflatten(-1, (PARTS, t.shape[-1] // PARTS)), t.dim(), group, tp)
        return gathered.flatten(-2)
    dims = [d for d in range(t.dim()) if len(shape) == t.dim() and t.shape[d] * tp == shape[d]
            and all(t.shape[e] == shape[e] for e in range(t.dim()) if e != d)]
    return _gather(t, dims[0], group, tp) if len(dims) == 1 else t


def _gather(t: torch.Tensor, dim: int, group, tp: int) -> torch.Tensor:
    """`t`'s parts on the processes of `group` (this process's split layer), joined along `dim` in their order."""
    pieces = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)
