"""A checkpoint's model and optimizer files: written in the layout's format, read by any layout.

- "whole" (a layout where every process holds the model whole: one process, ddp, dp): model.safetensors and
  optimizer.safetensors, written by the main process; the optimizer's non-tensor state and the name of each of its
  parameters go into train.json.
- "sharded" (a layout that splits the model, or fsdp): torch.distributed.checkpoint's files in sharded/, each
  process writing its part, every parameter and its optimizer state under the name it has in the whole model; the
  tensors split by heads through their checkpoint views (heads.py).

Either is read on any layout. A whole checkpoint read where the model is split: each process reads its own part of
each tensor from the safetensors files (safetensors' slices: its rows, its columns, its heads' rows of q, k and v),
tensor by tensor. A sharded one: torch.distributed.checkpoint reads each process's part, resharded; a tensor split
by heads on one side and not on the other is read whole, one tensor at a time, and cut.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .heads import fused_names, viewed
from .parts import read_part


def inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


# -- "whole" ---------------------------------------------------------------------------------------------------
def save_whole(folder: Path, model: nn.Module, optimizer, is_main: bool) -> dict[str, Any] | None:
    """model.safetensors and optimizer.safetensors, by the main process; returns what train.json records of the
    optimizer (its non-tensor state, and each parameter's name by its index)."""
    from safetensors.torch import save_file

    if not is_main:
        return None
    weights = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))
    tensors, plain = _flatten_optimizer(inner_optimizer(optimizer).state_dict())
    save_file(tensors, str(folder / "optimizer.safetensors"))
    return {**plain, "names": _names_by_index(model, inner_optimizer(optimizer))}


def _names_by_index(model: nn.Module, optimizer) -> dict[str, str]:
    """Each parameter's name in the model, by its index in the optimizer's state dict."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {str(i): names[id(p)] for i, p in enumerate(params) if id(p) in names}


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (for safetensors) and plain data (for JSON)."""
    tensors, plain = {}, {"param_groups": state["param_groups"], "state": {}}
    for idx, slots in state["state"].items():
        plain["state"][str(idx)] = {}
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
                plain["state"][str(idx)][name] = {"tensor": f"{idx}.{name}"}
            else:
                plain["state"][str(idx)][name] = value
    return tensors, plain


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    state = {}
    for idx, slots in plain["state"].items():
        state[int(idx)] = {name: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
                           for name, v in slots.items()}
    return {"state": state, "param_groups": plain["param_groups"]}


def _same_parameters(model: nn.Module, optimizer, plain: dict[str, Any]) -> bool:
    """Whether this process holds every parameter whole, in the optimizer the checkpoint's was (its groups of the
    same sizes, its parameters of the same names): its state dict loads as it is."""
    if any(hasattr(p, "to_local") for p in model.parameters()):
        return False
    groups = inner_optimizer(optimizer).param_groups
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in plain["param_groups"]]:
        return False
    names = plain.get("names")
    return names is None or names == _names_by_index(model, inner_optimizer(optimizer))


def load_whole(folder: Path, model: nn.Module, optimizer, plain: dict[str, Any]) -> None:
    """Read a whole checkpoint into this process's model and optimizer, whatever the layout (see the module's
    doc)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if _same_parameters(model, optimizer, plain):  # as it was written: loaded as it is
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        optimizer.load_state_dict(_unflatten_optimizer(load_file(str(folder / "optimizer.safetensors")), plain))
        return
    if "names" not in plain:
        raise UserError(f"{folder}: a whole checkpoint written before checkpoints named the optimizer's parameters; "
                        f"resume it where every process holds the model whole (one process, or --strategy ddp)")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    inner = inner_optimizer(optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, inner, options=options)
    index = {name: int(i) for i, name in plain["names"].items()}
    group_of = {i: g for g in plain["param_groups"] for i in g["params"]}
    with torch.no_grad(), safe_open(str(folder / "model.safetensors"), "pt") as weights, \
            safe_open(str(folder / "optimizer.safetensors"), "pt") as tensors:
        for name, t in model_state.items():
            copy_part(weights, name, t)
        for key, t in list(optim_state.items()):
            kind, rest = key.split(".", 1)
            name, slot = rest.rsplit(".", 1)
            if name not in index:
                raise UserError(f"{folder}: holds no optimizer state for {name}")
            i = index[name]
            if kind == "param_groups":
                optim_state[key] = group_of[i][slot]
                continue
            saved = plain["state"].get(str(i), {}).get(slot)
            if isinstance(saved, dict) and "tensor" in saved:
                copy_part(tensors, saved["tensor"], t)
            elif saved is not None:
                optim_state[key] = saved
    set_state_dict(model, inner, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


@torch.no_grad()
def copy_part(source, key: str, t: torch.Tensor) -> None:
    """Copy into `t` (a whole tensor, or a DTensor: this process's part) its part of the tensor `key` of an open
    safetensors file, reading only that part (its rows and columns; a split by heads: its rows of q, k and v)."""
    if not hasattr(t, "to_local"):
        t.copy_(source.get_tensor(key))
        return
    t.to_local().copy_(read_part(source.get_slice(key), t))


# -- "sharded" -------------------------------------------------------------------------------------------------
def _state_dicts(model: nn.Module, optimizer, flat: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, inner_optimizer(optimizer),
                          options=StateDictOptions(flatten_optimizer_state_dict=flat))


def save_sharded(folder: Path, model: nn.Module, optimizer, fused: list[str]) -> dict[str, Any]:
    """sharded/ by every process (torch.distributed.checkpoint), the optimizer's state keyed by each parameter's
    name; `fused`: the whole model's tensors split by heads, written through their views. Returns what train.json
    records of the optimizer."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _state_dicts(model, optimizer, flat=True)
    with viewed(model_state, optim_state, fused, fused_names(model), True).swapped(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process" without a group
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "sharded"))
    return {"flat": True, "fused": list(fused)}


def load_sharded(folder: Path, model: nn.Module, optimizer, recorded: dict[str, Any], agree=max) -> None:
    """Read sharded/ into this layout (`recorded`: what train.json says of the optimizer). A tensor the checkpoint
    and this layout hold through different views is read whole after the rest, one at a time (`agree(n)`: the
    most of them any process has, so that each reads as many times)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    flat, fused = bool(recorded.get("flat")), list(recorded.get("fused", []))
    model_state, optim_state = _state_dicts(model, optimizer, flat)
    state = {"model": model_state, "optimizer": optim_state}
    views = viewed(model_state, optim_state, fused, fused_names(model), flat)
    with views.swapped(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder / "sharded"))
        for i in range(agree(len(views.deferred))):  # every process reads as many times: each read is collective
            one = views.read_whole(i, state) if i < len(views.deferred) else {}
            dcp.load(one, checkpoint_id=str(folder / "sharded"))
            views.cut(i)
    set_state_dict(model, inner_optimizer(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=StateDictOptions(flatten_optimizer_state_dict=flat))
