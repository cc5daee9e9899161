"""The optimizer and the learning-rate schedule a config asks for: SGD, Adam or AdamW without weight decay on
biases and normalisation parameters, and a warm-up followed by a constant, cosine or one-cycle schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import DEFAULT_LR, OptimConfig


# -- building blocks -------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, o: OptimConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer section's optimizer at peak rate `lr` (the batch plan's, after --lr-scaling; default --lr)."""
    lr = lr if lr is not None else o.lr if o.lr is not None else DEFAULT_LR[o.optimizer]
    # No weight decay on biases and normalisation parameters (1-D tensors), as timm and nanoGPT do.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Not fused=True: with it, a run resumed from a checkpoint no longer ends bitwise equal (torch 2.15, CPU).
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.momentum > 0)
    if o.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total`.

    Linear warm-up over `warmup` steps, then: constant; cosine decay to zero; or onecycle, a linear fall to
    zero (the triangular one-cycle schedule).
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return max(0.0, 1 - progress)


def make_scheduler(optimizer: torch.optim.Optimizer, o: OptimConfig, steps_per_epoch: int):
    """The optimizer section's warm-up and schedule over its epochs, stepped once per optimizer step."""
    total = steps_per_epoch * o.epochs
    warmup = min(total - 1, round(o.warmup() * steps_per_epoch))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, o.scheduler))
