"""What a non-finite training loss came from, named before anything is suggested: the inputs the data gave, the
weights (an update that overflowed), the model's outputs, or the loss of finite outputs (the labels, the loss).

The first batches of each epoch (every batch with --log-every 1) are checked as they come, before their optimizer
step: every process says on one
all-reduce which of these it found, and all stop together with the first cause any found. Later, the inputs'
non-finite values are counted on the device (no synchronisation) and a non-finite loss is found at the next
--log-every, where the weights and the last batch are looked at."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .compiling import eager_unless
from .signals import TrainingDiverged

if TYPE_CHECKING:
    from .build import Run

CHECKED_BATCHES = 20  # the batches of each epoch whose loss is checked at once
GROWN = 1e4  # weights this large in magnitude have grown by the updates, not by any usual initialisation
CAUSES = ("inputs", "weights", "outputs", "loss", "unknown")


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t).detach()  # a DTensor's own shard: no collective


def _finite(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_meta or bool(torch.isfinite(t).all())


class NonFinite:
    """One epoch's watch for non-finite values (see the module's docstring)."""

    def __init__(self, run: Run):
        self.run, self.seen = run, 0
        self.count = torch.zeros(1, device=run.runtime.device)  # the inputs' non-finite values so far
        self.last: Any = None

    def see(self, x: Any, row: torch.Tensor) -> None:
        """After a batch's forward and backward, before its optimizer step; `row[0]`: its loss x samples."""
        self.last, self.seen = x, self.seen + 1
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.is_meta:
            self.count += (~torch.isfinite(x)).sum().to(self.count.device)
        if self.seen > CHECKED_BATCHES and self.run.settings.run.log_every != 1:
            return
        finite = _finite(row[0])
        if self.run.runtime.sum(torch.tensor([float(not finite)], device=self.count.device)).item() == 0:
            return
        # every process is here: those with a non-finite loss look for its cause (on their own, no collective)
        found = torch.zeros(len(CAUSES) + 1, device=self.count.device)
        if not finite:
            found[CAUSES.index(self._cause())] = 1
        found[-1] = self.count[0]
        found = self.run.runtime.sum(found)
        cause = CAUSES[int(torch.nonzero(found[:-1])[0])]
        raise TrainingDiverged(f"training loss became non-finite in batch {self.seen} of the epoch: "
                               f"{self._said(cause, int(found[-1].item()))}")

    def named(self, bad_inputs: int) -> str:
        """What a non-finite loss found at a --log-every came from; `bad_inputs`: the inputs' non-finite values
        counted on every process."""
        cause = "inputs" if bad_inputs else self._cause(inputs=False)
        if cause in ("loss", "unknown"):  # the last batch's outputs are finite: an earlier batch's loss was not
            return ("the inputs and weights are finite, and so are the last batch's outputs: a batch since the last "
                    "check gave it; --log-every 1 checks each batch and names the cause")
        return self._said(cause, bad_inputs)

    def _cause(self, inputs: bool = True) -> str:
        if inputs and not _finite(self.last):
            return "inputs"
        if any(not _finite(_local(p)) for p in self.run.plain.parameters()):
            return "weights"
        try:
            outputs = self._last_outputs()
        except Exception:  # noqa: BLE001 - looking for a cause must not raise another error
            return "unknown"
        return "unknown" if outputs is None else "loss" if _finite(outputs) else "outputs"

    def _said(self, cause: str, bad_inputs: int) -> str:
        precision = self.run.runtime.mixed_precision
        if cause == "inputs":
            return (f"the inputs held {bad_inputs:,} NaN or infinite values before the model saw them: the data gives "
                    f"them (a transform dividing by zero, a corrupt file; with --decode device try --decode "
                    f"workers); the learning rate is not the cause")
        if cause == "weights":
            name = next((n for n, p in self.run.plain.named_parameters() if not _finite(_local(p))), "?")
            return (f"the weights became non-finite ({name}, and maybe others) in an optimizer step while the "
                    f"losses were finite: the update overflowed; lower --lr, set --clip-grad-norm (e.g. 1.0), or "
                    f"use --mixed-precision no")
        if cause == "outputs":
            largest = max((float(_local(p).abs().max()) for p in self.run.plain.parameters() if p.numel()),
                          default=0.0)
            if largest > GROWN:
                return (f"the weights grew to {largest:.1e} in magnitude and the model's outputs overflowed: the "
                        f"updates are too large; lower --lr, or set --clip-grad-norm (e.g. 1.0)")
            fix = "use --mixed-precision bf16 or no, or lower --lr" if precision == "fp16" else \
                "use --mixed-precision no, or lower --lr" if precision != "no" else \
                "check the inputs' scale and the model's own arithmetic, or lower --lr"
            return (f"the model's outputs are non-finite with finite inputs and weights: an overflow in the forward "
                    f"pass ({'fp32' if precision == 'no' else precision}); {fix}")
        if cause == "loss":
            return ("the model's outputs are finite and their loss is not: check the labels (a class index out of "
                    "range, soft targets that do not sum to 1) and the loss function")
        return "the inputs and weights are finite: lower --lr, or use --mixed-precision no"

    def _last_outputs(self) -> torch.Tensor | None:
        """The unwrapped model's outputs on the last batch (no gradients), where one process alone can compute
        them: a plain `loss(model(x), y)` step of a model neither sharded nor cut into stages; else None."""
        run, x = self.run, self.last
        if run.calls.step is not None or run.calls.keywords or run.runtime.forward_collective or \
                run.runtime.schedules_batches or not isinstance(x, torch.Tensor) or x.is_meta:
            return None
        training = run.plain.training
        run.plain.eval()  # this process alone: no SyncBatchNorm collective, no running statistics updated
        try:
            with torch.no_grad(), run.runtime.autocast(), eager_unless(run.compiled_batch):
                out = run.calls.loss.outputs(run.plain(x))
        finally:
            run.plain.train(training)
        return out.float() if isinstance(out, torch.Tensor) else None
