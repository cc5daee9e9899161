"""What validation measures, exact on any number of processes: the loss per sample, accuracy where it means
something (single-label classification), the user's own metrics, and the value a run monitors for its best
checkpoint and early stopping.

Each rank tallies its own disjoint shard of the set (`Measures.tally`); the sums are added over the ranks by the
caller's all-reduce, and each torchmetrics `Metric`'s states are gathered from every rank in one collective
(`merge_states`: list states item by item in the set's order, tensor states by the metric's own reduction) and
computed once, the same on every rank: rank shards of any sizes (detection's lists of boxes per image among them),
each item counted once, nothing left to torchmetrics' own sync, which makes one collective per list element and
hangs when ranks hold different numbers. torchmetrics is not imported here (it takes seconds to import): a Metric
is recognised by its update, compute and reset, so a user who passes one has already paid for the import.

"Per sample", for a loss or a metric function that returns more than one value per sample (a loss module run with
reduction="none" on N x K values, N x C x H x W logits against N x H x W masks, ...), is the mean of a sample's
values over every dimension but the batch's.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError, describe
from .models import output_of

RESERVED = ("loss", "accuracy", "samples")  # what validation measures itself (accuracy: for a classifier)
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")  # a metric's name becomes the column val_<name>


class Loss:
    """The training loss (a scalar to backpropagate) and the validation loss's sum over a batch: the user's
    `loss_fn`, or cross-entropy with --label-smoothing in training and without it in validation.

    The validation loss is exact on any process count when the loss gives per-sample values: a torch loss module
    (it has `reduction`) is evaluated with `reduction="none"`, and a function that returns values with the batch
    first is summed per sample; any other is taken as the mean of its batch, weighted by the batch's size."""

    def __init__(self, fn: Callable | None = None, label_smoothing: float = 0.0, output_key: str | int | None = None):
        self.fn, self.label_smoothing, self.output_key = fn, label_smoothing, output_key
        per_sample = None
        if isinstance(fn, nn.Module) and hasattr(fn, "reduction"):
            per_sample = copy.deepcopy(fn)
            per_sample.reduction = "none"
        self.per_sample = per_sample

    @property
    def exact(self) -> bool:
        """Whether the validation loss sums per-sample values (else batch means weighted by batch size)."""
        return self.fn is None or self.per_sample is not None

    def outputs(self, raw: Any) -> torch.Tensor:
        """The tensor of a model's output that the loss and the metrics take (models.output_of)."""
        return output_of(raw, self.output_key)

    def __call__(self, outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        if self.fn is None:
            return F.cross_entropy(outputs, targets, label_smoothing=self.label_smoothing)
        value = self.fn(outputs, targets)
        _check_values(value, len(outputs), "loss_fn", scalar_ok=True)
        return value.mean()  # a scalar as it is; values with the batch first: their mean is the batch's loss

    def sum(self, outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        """The validation loss summed over the batch's samples, in fp32 or wider."""
        if self.fn is None:
            return F.cross_entropy(outputs.float(), targets, reduction="sum")
        values = (self.per_sample or self.fn)(outputs.float(), targets)
        return per_sample(values, len(outputs), "loss_fn", scalar_ok=True).sum()


def per_sample(values: Any, samples: int, what: str, scalar_ok: bool = False) -> torch.Tensor:
    """One float value per sample (N) from what a loss or a metric function returned: values with the batch first,
    averaged over their other dimensions; with `scalar_ok`, a scalar taken as the batch's mean."""
    _check_values(values, samples, what, scalar_ok)
    return values.float().expand(samples) if values.ndim == 0 else values.float().reshape(samples, -1).mean(1)


def _check_values(values: Any, samples: int, what: str, scalar_ok: bool) -> None:
    """Refuse on one line what a loss or a metric function returned when it is neither values with the batch first
    nor (with `scalar_ok`) a scalar."""
    expected = ("a scalar or " if scalar_ok else "") + f"values with the batch first ({samples} x ...)"
    if not isinstance(values, torch.Tensor):
        raise UserError(f"{what} returned {describe(values)}; expected a tensor: {expected}")
    if not (values.ndim > 0 and len(values) == samples or scalar_ok and values.ndim == 0):
        raise UserError(f"{what} returned {describe(values)} for a batch of {samples}; expected {expected}"
                        + ("" if scalar_ok else "; a metric that is not a mean over samples is a torchmetrics Metric"))


def check_batch_first(outputs: torch.Tensor, where: str) -> None:
    """Refuse on one line a model's output for one item that has no batch dimension of 1."""
    if outputs.ndim == 0 or len(outputs) != 1:
        raise UserError(f"the model returned {describe(outputs)} for one item of {where}; expected outputs with the "
                        f"batch first (1 x ...)")


def classifies(outputs: torch.Tensor, targets: Any) -> bool:
    """Whether outputs and targets are single-label classification's (N x classes, int64 labels N): the task that
    validation accuracy is measured for."""
    return outputs.ndim == 2 and isinstance(targets, torch.Tensor) and targets.dtype == torch.int64 and \
        targets.ndim == 1


def is_metric(value: Any) -> bool:
    """Whether `value` is a torchmetrics Metric (or behaves as one), without importing torchmetrics."""
    return all(callable(getattr(value, name, None)) for name in ("update", "compute", "reset")) and \
        isinstance(value, nn.Module)


@dataclass(frozen=True)
class Measures:
    """What each validation pass measures, fixed before the first epoch: the loss, accuracy when the task is
    single-label classification, and the user's metrics by name (torchmetrics Metrics, or functions
    `f(outputs, targets)` returning values with the batch first, averaged per sample)."""

    loss: Loss = field(default_factory=Loss)
    classifier: bool = True
    metrics: Mapping[str, Any] = field(default_factory=dict)
    has_loss: bool = True  # False: a step whose evaluation gives no loss (a detector's), no val_loss

    def __post_init__(self):
        reserved = [n for n in RESERVED if n != "accuracy" or self.classifier]  # a multi-label accuracy may be yours
        for name, metric in self.metrics.items():
            if not isinstance(name, str) or not NAME.match(name) or name in reserved:
                raise UserError(f"metrics: {name!r} cannot name a metric; expected a name of letters, digits and _ "
                                f"(it becomes the column val_<name>), not one of {', '.join(reserved)}")
            if not (is_metric(metric) or callable(metric)):
                raise UserError(f"metrics[{name!r}] is {describe(metric)}; expected a torchmetrics Metric or a "
                                f"function f(outputs, targets) returning one value per sample")

    def names(self) -> list[str]:
        """What a pass returns, as evaluate's keys (fit's columns add val_): loss, accuracy, the metrics."""
        return [*(["loss"] if self.has_loss else []), *(["accuracy"] if self.classifier else []), *self.metrics]

    def higher_is_better(self, name: str) -> bool | None:
        """Whether a larger value of `name` is better: None for a metric function, which does not say."""
        if name in ("loss", "accuracy"):
            return name == "accuracy"
        value = getattr(self.metrics[name], "higher_is_better", None)
        return value if isinstance(value, bool) else None

    def tally(self, device: torch.device) -> Tally:
        return Tally(self, device)


class Tally:
    """One validation pass's running values on this rank: sums (loss, samples, correct, each metric function) and a
    fresh copy of each Metric on the device."""

    def __init__(self, measures: Measures, device: torch.device):
        self.measures = measures
        self.functions = [n for n, m in measures.metrics.items() if not is_metric(m)]
        self.objects = {n: copy.deepcopy(m).to(device) for n, m in measures.metrics.items() if is_metric(m)}
        for metric in self.objects.values():
            metric.reset()
        self.sums = torch.zeros(3 + len(self.functions), device=device, dtype=torch.float64)

    def add(self, outputs: Any, targets: Any, loss: torch.Tensor | None = None, n: int | None = None) -> None:
        """One batch's outputs (the batch first; or, from a step of the user's, any structure its Metrics take) and
        targets, of `n` samples (default len(outputs)); `loss`: the step's own (a scalar mean or per-sample
        values), else the Loss of outputs and targets. A batch of no samples (a rank's padding) adds nothing."""
        n = len(outputs) if n is None else n
        if n == 0:
            return
        if isinstance(outputs, torch.Tensor):
            outputs = outputs.float()
        if self.measures.has_loss:
            self.sums[0] += (self.measures.loss.sum(outputs, targets) if loss is None else
                             per_sample(loss, n, "the step's loss", scalar_ok=True).sum()).double()
        self.sums[1] += n
        if self.measures.classifier:  # integer labels (see classifies)
            self.sums[2] += (outputs.argmax(1) == targets).sum()
        for k, name in enumerate(self.functions, start=3):
            values = self.measures.metrics[name](outputs, targets)
            self.sums[k] += per_sample(values, n, f"metrics[{name!r}]").double().sum()
        for metric in self.objects.values():
            metric.update(outputs, targets)

    def result(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
               gather: Callable[[Any], list] | None = None) -> dict[str, float]:
        """The pass's values over every rank's samples: called on every rank, each gets the same. `gather(obj)`
        returns every rank's `obj` in rank order (None: one process)."""
        sums = sum_over_ranks(self.sums)
        n = max(sums[1].item(), 1.0)
        values = {"loss": sums[0].item() / n}
        if self.measures.classifier:
            values["accuracy"] = sums[2].item() / n
        for k, name in enumerate(self.functions, start=3):
            values[name] = sums[k].item() / n
        for name, metric in self.objects.items():
            if gather is not None:
                merge_states(metric, gather)
            value = metric.compute()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UserError(f"metrics[{name!r}].compute() gave {describe(value)}; expected one value (an "
                                f"average over classes, e.g. average='macro')")
            values[name] = value.item()
        return {**{name: values[name] for name in self.measures.names()}, "samples": int(sums[1].item())}


def merge_states(metric: nn.Module, gather: Callable[[Any], list]) -> None:
    """Give `metric` the states of every rank's copy, merged as one process would have them, in one collective:
    a list state's items interleaved (item j of every rank before item j + 1: the set's order for strided shards,
    rank r holding items r, r + W, ...), then reduced by the metric's own function where it has one; a tensor
    state's values stacked and reduced. The metric then computes without syncing again."""
    names = list(metric._defaults)  # type: ignore[attr-defined]
    reductions = metric._reductions  # type: ignore[attr-defined]
    on_cpu = {name: _moved(getattr(metric, name), torch.device("cpu")) for name in names}
    ranks = gather(on_cpu)
    device = getattr(metric, "device", None)  # where a Metric keeps its states
    for name in names:
        values, reduce = [r[name] for r in ranks], reductions.get(name)
        if isinstance(values[0], list):
            merged: Any = [v[j] for j in range(max(map(len, values))) for v in values if j < len(v)]
            if reduce is not None and merged:
                merged = reduce(merged)
        else:
            merged = torch.stack(values)
            merged = reduce(merged) if reduce is not None else merged
        setattr(metric, name, _moved(merged, device))
    metric.distributed_available_fn = lambda: False  # type: ignore[assignment]


def _moved(value: Any, device: torch.device | None) -> Any:
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return [_moved(v, device) for v in value] if isinstance(value, list) else value


@dataclass(frozen=True)
class Monitor:
    """The validation value that picks best.safetensors and that --early-stopping watches: a metrics.csv column
    (val_accuracy, val_loss, val_<metric>) and whether higher is better."""

    name: str
    higher: bool

    @classmethod
    def of(cls, setting: str, mode: str, measures: Measures) -> Monitor:
        """From --monitor and --monitor-mode (auto: validation accuracy for a classifier, else the loss; a Metric's
        own higher_is_better), refused on one line when the run does not measure it or cannot tell its sense."""
        measured = [f"val_{n}" for n in measures.names()]
        if not measured:
            raise UserError("validation measures nothing: the step's eval_step gives no loss and the run has no "
                            "metrics; return (outputs, targets, loss) from it, or pass metrics=")
        name = ("val_accuracy" if measures.classifier else "val_loss" if measures.has_loss else measured[0]) \
            if setting == "auto" else setting
        if name not in measured:
            raise UserError(f"--monitor {setting}: this run's validation measures {', '.join(measured)}"
                            + ("" if measures.classifier or name != "val_accuracy" else
                               " (accuracy only for single-label classification: N x classes outputs, integer "
                               "labels)"))
        higher = {"max": True, "min": False}.get(mode, measures.higher_is_better(name[len("val_"):]))
        if higher is None:
            raise UserError(f"--monitor {name}: say whether higher is better with --monitor-mode max or min "
                            f"(metrics[{name[len('val_'):]!r}] is a function, which does not say)")
        return cls(name, higher)

    def better(self, value: float, than: float) -> bool:
        return value > than if self.higher else value < than

    def best_row(self, history: list[dict[str, Any]], prefix: str = "") -> dict[str, Any] | None:
        """The epoch with the best value (the first of equals); None before any validated epoch."""
        best = None
        for row in history:
            if prefix + self.name in row and (best is None or self.better(row[prefix + self.name],
                                                                           best[prefix + self.name])):
                best = row
        return best

    def improves(self, row: dict[str, Any], history: list[dict[str, Any]], prefix: str = "") -> bool:
        """Whether an epoch's row is better than every epoch before it."""
        best = self.best_row(history, prefix)
        return best is None or self.better(row[prefix + self.name], best[prefix + self.name])

    def epochs_since_best(self, history: list[dict[str, Any]]) -> int:
        best = self.best_row(history)
        return 0 if best is None else len(history) - 1 - history.index(best)
