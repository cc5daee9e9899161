"""What validation measures, exact on any number of processes: the loss per sample, accuracy where it means
something (single-label classification), the user's own metrics, and the value a run monitors for its best
checkpoint and early stopping.

Each rank tallies its own disjoint shard of the set (`Measures.tally`); the sums are added over the ranks by the
caller's all-reduce, and the states of each torchmetrics `Metric` (a MetricCollection's members and a wrapper's
children included) are merged from every rank by the caller's object gather (`merge_states`: list states item by
item in the set's order, tensor states by the metric's own reduction, one byte buffer per rank exchanged in
slices) and computed once, the same on every rank: rank shards of any sizes (detection's lists of boxes per image
among them), each item counted once, nothing left to torchmetrics' own sync, which makes one collective per list
element and hangs when ranks hold different numbers. A compute() that gives a dict gives a value per key
(`values_of`: <name>_<key>). torchmetrics is not imported here (it takes seconds to import): a Metric is
recognised by its update, compute and reset, so a user who passes one has already paid for the import.

"Per sample", for a loss or a metric function that returns more than one value per sample (a loss module run with
reduction="none" on N x K values, N x C x H x W logits against N x H x W masks, ...), is the mean of a sample's
values over every dimension but the batch's.
"""

from __future__ import annotations

import copy
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
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
    """Whether `value` is a torchmetrics Metric, MetricCollection or wrapper (or behaves as one), without importing
    torchmetrics."""
    return all(callable(getattr(value, name, None)) for name in ("update", "compute", "reset")) and \
        isinstance(value, nn.Module)


def is_collection(value: Any) -> bool:
    """Whether `value` is a torchmetrics MetricCollection: Metrics under names, computed as a dict of them."""
    return is_metric(value) and isinstance(value, nn.ModuleDict)


def members(metric: nn.Module) -> dict[str, nn.Module]:
    """The metrics inside a MetricCollection (under the keys its compute gives them: prefix and postfix added) or
    a MultitaskWrapper (under their tasks); {} for any other metric."""
    if is_collection(metric):
        return dict(zip(metric.keys(), metric._modules.values()))  # keys() alone adds the prefix, no state copied
    tasks = getattr(metric, "task_metrics", None)
    return dict(tasks.items()) if isinstance(tasks, nn.ModuleDict) else {}


def values_of(value: Any, column: str) -> dict[str, float]:
    """The columns of what a metric's compute() gave: one number as `column`; a dict (a MetricCollection's, a
    wrapper's, MeanAveragePrecision's) as `column`_<key> for each of its values of one number, nested dicts
    likewise (a value of several numbers, MeanAveragePrecision's `classes`, is no column); a bare collection's
    (`column` "") under its own keys."""
    if isinstance(value, Mapping):
        found: dict[str, float] = {}
        for key, part in value.items():
            name = f"{column}_{key}" if column else str(key)
            if isinstance(part, Mapping):
                found.update(values_of(part, name))
            elif isinstance(part, (int, float)) or isinstance(part, torch.Tensor) and part.numel() == 1:
                found[name] = float(part)
        return found
    if isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.numel() == 1:
        return {column: float(value)}
    raise UserError(f"metrics[{column!r}].compute() gave {describe(value)}; expected one value (an average over "
                    f"classes, e.g. average='macro'), or a dict of them (a MetricCollection, ClasswiseWrapper for "
                    f"one value per class)")


@dataclass(frozen=True)
class Measures:
    """What each validation pass measures, fixed before the first epoch: the loss, accuracy when the task is
    single-label classification, and the user's metrics by name (torchmetrics Metrics, or functions
    `f(outputs, targets)` returning values with the batch first, averaged per sample)."""

    loss: Loss = field(default_factory=Loss)
    classifier: bool = True
    metrics: Mapping[str, Any] = field(default_factory=dict)
    has_loss: bool = True  # False: a step whose evaluation gives no loss (a detector's), no val_loss

    def reserved(self) -> list[str]:
        """The names validation measures itself (a multi-label accuracy may be yours)."""
        return [n for n in RESERVED if n != "accuracy" or self.classifier]

    def __post_init__(self):
        reserved = self.reserved()
        if is_collection(self.metrics):  # its keys name the columns: the name "" stands for the collection itself
            object.__setattr__(self, "metrics", {"": self.metrics})
        elif not isinstance(self.metrics, Mapping):
            raise UserError(f"metrics= is {describe(self.metrics)}; expected a dict {{name: metric}} (each a column "
                            f"val_<name>) or a torchmetrics MetricCollection (a column val_<key> for each of its "
                            f"values)")
        for name, metric in self.metrics.items():
            if name == "" and is_collection(metric):
                continue
            if not isinstance(name, str) or not NAME.match(name) or name in reserved:
                raise UserError(f"metrics: {name!r} cannot name a metric; expected a name of letters, digits and _ "
                                f"(it becomes the column val_<name>), not one of {', '.join(reserved)}")
            if not (is_metric(metric) or callable(metric)):
                raise UserError(f"metrics[{name!r}] is {describe(metric)}; expected a torchmetrics Metric or a "
                                f"function f(outputs, targets) returning one value per sample")

    def names(self) -> list[str]:
        """What a pass returns, as far as is known before it (evaluate's keys; fit's columns add val_): loss,
        accuracy, the metrics by name, a bare MetricCollection's keys. A metric whose compute gives a dict adds
        <name>_<key> for each of its values (see values_of), known once it has computed."""
        bare = list(members(self.metrics[""])) if "" in self.metrics else []
        return [*(["loss"] if self.has_loss else []), *(["accuracy"] if self.classifier else []),
                *(n for n in self.metrics if n), *bare]

    def parent(self, name: str) -> tuple[str, str] | None:
        """The metric (by name) and key of a value `name` that a metric giving a dict may have (<name>_<key>, or a
        bare collection's <key>); None when no Metric can give it."""
        for metric in sorted(self.metrics, key=len, reverse=True):
            if is_metric(self.metrics[metric]) and (metric == "" or name.startswith(metric + "_")):
                return metric, name[len(metric) + 1:] if metric else name
        return None

    def higher_is_better(self, name: str) -> bool | None:
        """Whether a larger value of `name` is better: None for a metric function, which does not say. A value of a
        collection's or a MultitaskWrapper's member is its member's; any other of a dict, its metric's."""
        if name in ("loss", "accuracy"):
            return name == "accuracy"
        if name in self.metrics:
            metric = self.metrics[name]
        elif (found := self.parent(name)) is not None:
            metric = self.metrics[found[0]]
            metric = members(metric).get(found[1], metric)
        else:
            return None
        value = getattr(metric, "higher_is_better", None)
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
        values = {"loss": sums[0].item() / n} if self.measures.has_loss else {}
        if self.measures.classifier:
            values["accuracy"] = sums[2].item() / n
        taken = set(self.measures.reserved())
        for name in self.measures.metrics:  # the user's order, a dict's values in its place
            if name in self.objects:
                metric = self.objects.pop(name)  # let go once computed: its merged states before the next's
                if gather is not None:
                    merge_states(metric, gather)
                found = values_of(metric.compute(), name)
                del metric
            else:
                found = {name: sums[3 + self.functions.index(name)].item() / n}
            for column, value in found.items():
                if column in values or column in taken:
                    raise UserError(f"metrics: the value {column!r} is given twice or is taken (a metric's name, "
                                    f"or a name and a key of its dict joined by _); rename the metric")
                values[column] = value
        return {**values, "samples": int(sums[1].item())}


def metric_parts(metric: nn.Module) -> list[nn.Module]:
    """Every torchmetrics Metric that holds states in `metric`: itself, a MetricCollection's members, a wrapper's
    children (ClasswiseWrapper, MultitaskWrapper, MinMaxMetric, ...), each once, in the same order on every rank."""
    return [m for m in metric.modules() if hasattr(m, "_defaults") and hasattr(m, "_reductions")]


def merge_states(metric: nn.Module, gather: Callable[[Any], list]) -> None:
    """Give `metric` (a Metric, a MetricCollection or a wrapper) the states of every rank's copy, merged as one
    process would have them: a list state's items interleaved (item j of every rank before item j + 1: the set's
    order for strided shards, rank r holding items r, r + W, ...), then reduced by the metric's own function where it
    has one; a tensor state's values stacked and reduced. The metric then computes without syncing again.

    Every tensor of this rank's states is packed into one byte buffer (the states themselves are let go), the
    buffers are exchanged in slices of at most CHUNK bytes, and the merged states are views into the received
    buffers: while merging, a process holds every rank's states once plus, for a state reduced by concatenation,
    its concatenated copy. States shared by a collection's compute group travel once. A list state of a Metric
    made with compute_on_cpu=True stays on the CPU; every other state goes back to its metric's device."""
    parts = metric_parts(metric)
    pairs = [(m, name) for m in parts for name in m._defaults]  # type: ignore[attr-defined]
    layout, tensors, size = _layout(pairs)
    buffer = torch.empty(size, dtype=torch.uint8)
    for t, offset in tensors:
        _view(buffer, t.dtype, t.shape, offset).copy_(t.detach())
    del tensors
    for m, name in pairs:  # this rank's own states live on in the buffer only
        setattr(m, name, [])
    token = uuid.uuid4().hex  # finds this rank's own entry in what the gather returns
    ranks = gather({"token": token, "layout": layout, "size": size,
                    "counts": [m._update_count for m in parts]})  # type: ignore[attr-defined]
    buffers = [buffer if r["token"] == token else torch.empty(r["size"], dtype=torch.uint8) for r in ranks]
    _exchange(buffers, [r["token"] == token for r in ranks].index(True), gather)
    merged: dict[tuple, Any] = {}  # one merged value per distinct set of sources (a compute group's shared state)
    for k, (m, name) in enumerate(pairs):
        sources = tuple(_source(r["layout"], k) for r in ranks)
        if sources not in merged:
            values = [_value(buffers[i], r["layout"][j]) for i, (r, j) in enumerate(zip(ranks, sources))]
            device = torch.device("cpu") if getattr(m, "compute_on_cpu", False) and isinstance(
                m._defaults[name], list) else getattr(m, "device", None)  # type: ignore[attr-defined]
            merged[sources] = _moved(_merged(values, m._reductions.get(name)), device)  # type: ignore[attr-defined]
        setattr(m, name, merged[sources])
    for i, m in enumerate(parts):
        m._update_count = sum(r["counts"][i] for r in ranks)  # type: ignore[attr-defined]
        m._computed = None  # type: ignore[attr-defined]
        m.distributed_available_fn = _not_distributed  # type: ignore[assignment]


CHUNK = 16 << 20  # bytes per exchange: what pickling a slice costs each process on top of the states
ALIGN = 16  # every tensor starts at a multiple of the widest element (complex128)


def _layout(pairs: list[tuple[nn.Module, str]]) -> tuple[list, list, int]:
    """Where each (metric, state) is in this rank's byte buffer: per pair ("same", k) for a state already placed
    by pair k (a compute group's), ("tensor", spec) or ("list", [spec or ("object", item)]); a spec is
    ("tensor", dtype, shape, offset). With the tensors to copy and the buffer's size."""
    layout: list = []
    tensors: list[tuple[torch.Tensor, int]] = []
    placed: dict[int, int] = {}
    size = 0

    def spec(t: torch.Tensor) -> tuple:
        nonlocal size
        tensors.append((t, size))
        found = ("tensor", t.dtype, tuple(t.shape), size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return found

    for k, (m, name) in enumerate(pairs):
        value = getattr(m, name)
        if id(value) in placed:
            layout.append(("same", placed[id(value)]))
            continue
        placed[id(value)] = k
        if isinstance(value, list):
            layout.append(("list", [spec(v) if isinstance(v, torch.Tensor) else ("object", v) for v in value]))
        else:
            layout.append(("tensor", spec(value)))
    return layout, tensors, size


def _exchange(buffers: list[torch.Tensor], own: int, gather: Callable[[Any], list]) -> None:
    """Fill every other rank's buffer with its bytes, slice by slice (the same number of gathers on every rank)."""
    most = max(len(b) for b in buffers)
    chunk = min(CHUNK, max(1 << 20, -(-most // 16)))
    for start in range(0, most, chunk):
        pieces = gather(buffers[own][start:start + chunk].numpy().tobytes())
        for r, piece in enumerate(pieces):
            if r != own and piece:
                buffers[r][start:start + len(piece)].numpy()[:] = np.frombuffer(piece, dtype=np.uint8)


def _source(layout: list, k: int) -> int:
    """The pair whose entry holds pair k's state on a rank (k itself unless it is shared)."""
    return layout[k][1] if layout[k][0] == "same" else k


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple, offset: int) -> torch.Tensor:
    count = math.prod(shape)
    return buffer[offset:offset + count * dtype.itemsize].view(dtype).view(shape)


def _value(buffer: torch.Tensor, entry: tuple) -> Any:
    """One rank's state from its entry: tensors as views into its buffer."""
    def item(spec: tuple) -> Any:
        return _view(buffer, *spec[1:]) if spec[0] == "tensor" else spec[1]

    return [item(s) for s in entry[1]] if entry[0] == "list" else item(entry[1])


def _merged(values: list, reduce: Callable | None) -> Any:
    """Every rank's value of one state as one process would hold it (see merge_states)."""
    if isinstance(values[0], list):
        merged: Any = [v[j] for j in range(max(map(len, values))) for v in values if j < len(v)]
        return reduce(merged) if reduce is not None and merged else merged
    merged = torch.stack(values)
    return reduce(merged) if reduce is not None else merged


def _not_distributed() -> bool:
    return False  # the states are merged already: torchmetrics must not sync them again


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
    chosen: bool = False  # picked by scaletrain (--monitor auto): a metric's dict then gives its first value

    @classmethod
    def of(cls, setting: str, mode: str, measures: Measures) -> Monitor | None:
        """From --monitor and --monitor-mode, refused on one line when the run does not measure it or cannot tell
        its sense. auto picks only a value whose sense it knows: validation accuracy for a classifier, else the
        loss, else the first of the user's metrics that says (a torchmetrics Metric's higher_is_better, or any with
        --monitor-mode); None when none does (best.safetensors is then the last epoch's)."""
        measured = [f"val_{n}" for n in measures.names()]
        if not measured and "" not in measures.metrics:
            raise UserError("validation measures nothing: the step's eval_step gives no loss and the run has no "
                            "metrics; return (outputs, targets, loss) from it, or pass metrics=")
        if setting == "auto":
            name = cls._chosen(mode, measures)
            if name is None:
                return None
        else:
            name = setting
        dict_value = name.startswith("val_") and measures.parent(name[len("val_"):]) is not None
        if name not in measured and not dict_value:  # a dict's keys are known once it computes: see improves
            raise UserError(f"--monitor {setting}: this run's validation measures {', '.join(measured)}"
                            + ("" if measures.classifier or name != "val_accuracy" else
                               " (accuracy only for single-label classification: N x classes outputs, integer "
                               "labels)"))
        higher = {"max": True, "min": False}.get(mode, measures.higher_is_better(name[len("val_"):]))
        if higher is None:
            raise UserError(f"--monitor {name}: say whether higher is better with --monitor-mode max or min "
                            f"(metrics[{name[len('val_'):]!r}] is a function, which does not say)")
        return cls(name, higher, chosen=setting == "auto")

    @staticmethod
    def _chosen(mode: str, measures: Measures) -> str | None:
        """--monitor auto's value: accuracy, the loss, or the first metric whose sense is known (a collection's:
        its first member's)."""
        if measures.classifier:
            return "val_accuracy"
        if measures.has_loss:
            return "val_loss"
        for name in measures.metrics:
            inside = members(measures.metrics[name]) if is_metric(measures.metrics[name]) else {}
            chosen = f"{name}_{next(iter(inside))}" if inside else name  # a collection: its first member's
            if mode in ("max", "min") or measures.higher_is_better(chosen) is not None:
                return f"val_{chosen}"
        return None

    def says(self) -> str:
        """What the start-up line says of it."""
        picked = "picked by --monitor auto" if self.chosen else "--monitor"
        return f"best.safetensors by {self.name}, {'higher' if self.higher else 'lower'} is better ({picked})"

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
        """Whether an epoch's row is better than every epoch before it; a monitored value that a metric's dict
        turned out not to have is refused on one line, naming what validation measured."""
        first = next((k[len(prefix):] for k in row if k.startswith(prefix + self.name + "_")), None)
        if prefix + self.name not in row and self.chosen and first is not None:
            object.__setattr__(self, "name", first)  # the metric scaletrain picked gave a dict: its first value
        if prefix + self.name not in row:
            measured = [k[len(prefix):] for k in row if k.startswith(prefix + "val_") and k != prefix + "val_samples"]
            raise UserError(f"--monitor {self.name}: this run's validation measured {', '.join(measured)}")
        best = self.best_row(history, prefix)
        return best is None or self.better(row[prefix + self.name], best[prefix + self.name])

    def epochs_since_best(self, history: list[dict[str, Any]]) -> int:
        best = self.best_row(history)
        return 0 if best is None else len(history) - 1 - history.index(best)
