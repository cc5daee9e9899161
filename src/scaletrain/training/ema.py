"""An exponential moving average of a model's weights (--ema-decay), as timm's ModelEmaV3 keeps it.

The average is kept as each process holds the model: its part of every tensor (a split layer's, an fsdp shard's, a
pipeline stage's; the whole on one process or under ddp), updated in place after every optimizer step. It is
evaluated beside the trained weights each epoch and written (last_ema.safetensors, each checkpoint's
ema.safetensors) by taking the trained weights' place in the model for a while (`applied`), so that it goes
wherever they go: through the same forward, gathered tensor by tensor into the same files; a resumed run reads its
part of each tensor back and continues it exactly.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class WeightAverage:
    """ema = decay * ema + (1 - decay) * weights, over every floating-point parameter and buffer (BatchNorm
    statistics too); integer buffers (BatchNorm's batch count) are copied."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay, self.model = decay, model
        self._tensors = dict(model.state_dict(keep_vars=True))  # as the model holds them (DTensors: split ones)
        self._live = {k: _local(t.detach()) for k, t in self._tensors.items()}  # this process's parts, in place
        self.average = {k: t.clone() for k, t in self._live.items()}
        floats = [k for k, t in self.average.items() if t.is_floating_point()]
        self._floats = ([self.average[k] for k in floats], [self._live[k] for k in floats])
        self._others = [(self.average[k], self._live[k]) for k in self.average if k not in floats]
        self._buffers = {k for k, _ in model.named_buffers()} & set(self._tensors)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the model's current weights (after an optimizer step)."""
        torch._foreach_lerp_(self._floats[0], self._floats[1], 1 - self.decay)
        for e, s in self._others:
            e.copy_(s)

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[nn.Module]:
        """The model holding the average in place of its trained weights, these put back after; buffers made alike
        meanwhile (sync_buffers before evaluation) stay so in the average."""
        trained = {k: t.clone() for k, t in self._live.items()}
        for k, t in self._live.items():
            t.copy_(self.average[k])
        try:
            yield self.model
        finally:
            for k in self._buffers:
                self.average[k].copy_(self._live[k])
            for k, t in self._live.items():
                t.copy_(trained[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's parts of the average, by name (the whole tensors where the model is whole)."""
        return dict(self.average)

    @torch.no_grad()
    def load(self, path: Path) -> None:
        """The average read back from a weights file of the whole model's tensors (a checkpoint's ema.safetensors):
        each process its own part of each."""
        from safetensors import safe_open

        from ..parallel import read_part

        with safe_open(str(path), "pt") as f:
            for k, t in self._tensors.items():
                self.average[k].copy_(read_part(f.get_slice(k), t) if hasattr(t, "to_local") else f.get_tensor(k))
