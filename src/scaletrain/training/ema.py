"""An exponential moving average of a model's weights (--ema-decay), as timm's ModelEmaV3 keeps it.

The average is a second copy of the unwrapped model, updated in place after every optimizer step and evaluated
beside the trained weights each epoch; its tensors go into each checkpoint so a resumed run continues it exactly.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    """ema = decay * ema + (1 - decay) * weights, over every floating-point parameter and buffer (BatchNorm
    statistics too); integer buffers (BatchNorm's batch count) are copied."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.source = model
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        ema, live = self.model.state_dict(keep_vars=True), model.state_dict(keep_vars=True)
        pairs = [(ema[k], live[k]) for k in ema]
        self._floats = ([e for e, _ in pairs if e.is_floating_point()], [s for e, s in pairs if e.is_floating_point()])
        self._others = [(e, s) for e, s in pairs if not e.is_floating_point()]

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the source model's current weights (after an optimizer step)."""
        torch._foreach_lerp_(self._floats[0], self._floats[1], 1 - self.decay)
        for e, s in self._others:
            e.copy_(s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
