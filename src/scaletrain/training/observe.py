"""What may watch a run's optimizer steps from outside it: `scaletrain verify`'s recorder (training/verify.py).
The loop calls each method at its moment with the run (build.Run) and its state (checkpoint.TrainState); the
default watches nothing."""

from __future__ import annotations

from typing import Any


class StepObserver:
    def started(self, run: Any) -> None:
        """The run is built and resumed; no step taken yet."""

    def stepping(self, run: Any) -> None:
        """An optimizer step's gradients are complete (every process), before clipping and the step."""

    def stepped(self, run: Any, state: Any, step: int) -> None:
        """Optimizer step `step` (from 1) is done: the weights updated, its loss in the epoch's totals."""
