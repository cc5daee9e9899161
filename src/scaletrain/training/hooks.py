"""What a user's own code brings to `fit` besides the model and the data: the loss, the optimizer and the schedule,
and how the Dataset's items are read and seeded. Each is optional; without it, scaletrain's own is used.

- `loss_fn(logits, targets)`: the training loss, a scalar (a tensor of per-sample values is averaged). The
  validation loss is exact on any process count when the loss gives per-sample values: a torch loss module
  (it has `reduction`) is evaluated with `reduction="none"`, and a function that returns one value per sample is
  summed; any other is taken as the mean of its batch, and the batches' means are weighted by their sizes.
- `optimizer(parameters)`: returns the optimizer over the model's parameters (a closure over the model can build
  param groups of its own, e.g. layer-wise learning rates).
- `scheduler(optimizer, total_steps)`: returns a learning-rate scheduler, stepped after every optimizer step. With
  an optimizer of the user's and no scheduler, the optimizer keeps its own rates (no schedule is added).
- `batch_keys`, `collate_fn`, `seed_fn`: see data/items.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError, describe


@dataclass
class UserCode:
    """The hooks `fit` was given (None: scaletrain's own)."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None
    batch_keys: Sequence[str] | None = None
    collate_fn: Callable | None = None
    seed_fn: Callable | None = None

    def names(self) -> dict[str, str]:
        """The hooks given, by their type or function name: recorded in each checkpoint, so that a resume with other
        ones is refused."""
        return {name: getattr(hook, "__qualname__", type(hook).__qualname__)
                for name, hook in (("loss_fn", self.loss_fn), ("optimizer", self.optimizer),
                                   ("scheduler", self.scheduler)) if hook is not None}


class Loss:
    """The training loss (a scalar to backpropagate) and the validation loss's sum over a batch: the user's
    `loss_fn`, or cross-entropy with --label-smoothing in training and without it in validation."""

    def __init__(self, fn: Callable | None = None, label_smoothing: float = 0.0):
        self.fn, self.label_smoothing = fn, label_smoothing
        per_sample = None
        if isinstance(fn, nn.Module) and hasattr(fn, "reduction"):
            per_sample = copy.deepcopy(fn)
            per_sample.reduction = "none"
        self.per_sample = per_sample

    @property
    def exact(self) -> bool:
        """Whether the validation loss sums per-sample values (else batch means weighted by batch size)."""
        return self.fn is None or self.per_sample is not None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
        return _scalar(self.fn(logits, targets), len(targets))

    def sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The validation loss summed over the batch's samples, in fp32 or wider."""
        if self.fn is None:
            return F.cross_entropy(logits.float(), targets, reduction="sum")
        values = (self.per_sample or self.fn)(logits.float(), targets)
        if not isinstance(values, torch.Tensor):
            raise UserError(f"loss_fn returned {describe(values)}; expected a tensor")
        if values.numel() == len(targets) and values.ndim > 0:
            return values.float().sum()
        return _scalar(values, len(targets)).float() * len(targets)


def _scalar(value: Any, samples: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise UserError(f"loss_fn returned {describe(value)}; expected a tensor (a scalar, or one value per sample)")
    if value.ndim == 0:
        return value
    if value.numel() == samples:
        return value.mean()
    raise UserError(f"loss_fn returned {describe(value)} for a batch of {samples}; expected a scalar or one value "
                    f"per sample")
