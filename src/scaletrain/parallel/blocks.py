"""A model's repeated blocks: the units FSDP shards and gathers one at a time, what activation checkpointing
recomputes, and what `estimate-memory` counts (one definition serves all three); and the identical blocks
--compile compiles one kind at a time."""

from __future__ import annotations

import torch
from torch import nn


def _holds_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def block_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, innermost last: what FSDP shards as units and activation checkpointing wraps.

    A block is an element of an nn.Sequential or nn.ModuleList holding at least two elements with parameters:
    timm's ResNet bottlenecks, ConvNeXt stages and their blocks, ViT blocks. When no such element has
    sub-modules (a plain stack of layers, like the built-in CNNs), the parameterised layers of the stack are
    the blocks.
    """
    composite, layers = [], []
    for container in model.modules():
        if not isinstance(container, (torch.nn.Sequential, torch.nn.ModuleList)):
            continue
        elements = [m for m in container if _holds_parameters(m)]
        if len(elements) < 2:
            continue
        for m in elements:
            (composite if any(True for _ in m.children()) else layers).append(m)
    return composite or layers


def keeps_fp32_parameters(unit: torch.nn.Module) -> bool:
    """Whether an FSDP unit computes with fp32 parameters under mixed precision: when it holds BatchNorm, whose
    kernels expect fp32 weights beside fp32 running statistics."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in unit.modules())


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Keep only each innermost block's input and recompute the rest of its activations in the backward pass
    (per block, as is usual for transformers and ResNets); returns how many blocks (none for a plain stack of
    layers, such as the built-in CNNs). Parameter names do not change, so weights and checkpoints stay
    interchangeable."""
    from torch.distributed._composable import checkpoint

    blocks = [b for b in block_units(model) if any(True for _ in b.children())]  # single layers gain nothing
    ids = {id(b) for b in blocks}
    innermost = [b for b in blocks if not any(id(m) in ids for m in b.modules() if m is not b)]
    for block in innermost:
        checkpoint(block)
        for m in block.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.register_forward_pre_hook(_freeze_running_stats_when_recomputed)
    return len(innermost)


_NOT_FROZEN = object()


def _freeze_running_stats_when_recomputed(bn: torch.nn.Module, args) -> None:
    """Let a BatchNorm that the backward pass runs again (recomputation) leave its running statistics alone:
    the real forward updated them once. Momentum 0 keeps them exactly and the step counter is taken back by the
    one its forward adds; the momentum returns at the next forward. (No post-hook: torch may stop a
    recomputation in the middle of a layer once it has what the backward needs.)"""
    momentum = bn.__dict__.pop("_scaletrain_momentum", _NOT_FROZEN)
    if momentum is not _NOT_FROZEN:
        bn.momentum = momentum
    if bn.training and torch._C._current_graph_task_id() != -1:
        bn._scaletrain_momentum, bn.momentum = bn.momentum, 0.0
        bn.num_batches_tracked.sub_(1)


def _shape(module: nn.Module) -> tuple:
    return type(module), tuple(tuple(p.shape) for p in module.parameters())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost runs of identical blocks: children of a container (Sequential, ModuleList) of which at least
    two are of one class that is not torch's own (a timm Block, a ResNet stage's later blocks, a user's layer) with
    the same parameter shapes, so that they share one compiled graph."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            kinds: dict[tuple, int] = {}
            for child in children:
                kinds[_shape(child)] = kinds.get(_shape(child), 0) + 1
            blocks = [c for c in children if kinds[_shape(c)] >= 2 and not type(c).__module__.startswith("torch.")
                      and any(True for _ in c.parameters())]
            found.extend(blocks)
            children = [c for c in children if not any(c is b for b in blocks)]
        for child in children:
            visit(child)
    visit(model)
    return found


def regional_blocks(model: nn.Module) -> list[nn.Module]:
    """--compile (--compile-scope blocks): the model's repeated blocks, compiled in place each kind once (regional
    compilation: a transformer's identical blocks share one compiled graph, so the first step waits for one block's
    compile, not the whole model's), where they hold most of its parameters; [] where they do not (the whole
    training module is compiled then: a ResNet, whose stages' blocks differ in shape, compiles faster whole: 38 s to
    its first step against 47 s block by block for resnet18 on 2 CPU cores)."""
    blocks = repeated_blocks(model)
    count = sum(p.numel() for b in blocks for p in b.parameters())
    return blocks if blocks and count * 2 >= sum(p.numel() for p in model.parameters()) else []


def compile_blocks(blocks: list[nn.Module], held: nn.Module) -> str:
    """`blocks` (regional_blocks of a whole model) that `held` (the model, or a pipeline stage cut from it) holds,
    compiled in place; what was compiled, in words ('' where it holds none)."""
    mine = {id(m) for m in held.modules()}
    blocks = [b for b in blocks if id(b) in mine]
    if not blocks:
        return ""
    for block in blocks:
        block.compile()
    count = sum(p.numel() for b in blocks for p in b.parameters())
    kinds = sorted({type(b).__name__ for b in blocks})
    return f"its {len(blocks)} repeated blocks ({', '.join(kinds)}; {count:,} of its parameters) one by one"
