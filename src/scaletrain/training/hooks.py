"""What a user's own code brings to `fit` besides the model and the data: the loss, the optimizer and the schedule,
and how the Dataset's items are read and seeded. Each is optional; without it, scaletrain's own is used.

- `loss_fn(outputs, targets)`: the training loss, a scalar (values with the batch first are averaged). The
  validation loss is exact on any process count when the loss gives per-sample values (see metrics.Loss).
- `metrics`: the user's validation metrics by name, each a column val_<name> (see metrics.Measures).
- `output_key`: which entry of a model's dict, tuple or object output is scored (see models.output_of).
- `optimizer(parameters)`: returns the optimizer over the model's parameters (a closure over the model can build
  param groups of its own, e.g. layer-wise learning rates).
- `scheduler`: `make(optimizer, total_steps)` returning a learning-rate scheduler that plans over total_steps
  (stepped after every optimizer step), or a `Schedule(make, interval, monitor)` saying when it is stepped: per
  optimizer step, per epoch, or after validation with the monitored value (ReduceLROnPlateau); see schedules.py.
  With an optimizer of the user's and no scheduler, the optimizer keeps its own rates (no schedule is added).
- `sampler`: a `Sampler` over the training set's indices (e.g. `WeightedRandomSampler`): each epoch's order is
  drawn from it once, seeded, and shared among the processes (see data/indices.SamplerOrder).
- `batch_keys`, `collate_fn`, `seed_fn`: see data/items.py.
- `step`: a `Step` of the user's (steps.py): its own training and evaluation step, its optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..steps import Step
from .schedules import Schedule


@dataclass
class UserCode:
    """The hooks `fit` was given (None: scaletrain's own)."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | Schedule | None = None
    batch_keys: Sequence[str] | None = None
    collate_fn: Callable | None = None
    seed_fn: Callable | None = None
    metrics: Mapping[str, Any] | None = None
    output_key: str | int | None = None
    sampler: Any = None
    step: Step | None = None

    def names(self) -> dict[str, str]:
        """The hooks given, by their type or function name: recorded in each checkpoint, so that a resume with other
        ones is refused."""
        return {name: getattr(hook, "__qualname__", type(hook).__qualname__)
                for name, hook in (("loss_fn", self.loss_fn), ("optimizer", self.optimizer),
                                   ("scheduler", getattr(Schedule.of(self.scheduler), "make", None)),
                                   ("sampler", self.sampler), ("step", self.step)) if hook is not None}
