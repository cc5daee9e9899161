"""`scaletrain.predict` and `scaletrain.evaluate`: a user's own model and Dataset scored on every process of a job,
with results exact on any process count.

Each process scores its strided shard of the Dataset (no padding, no duplicates). `predict` gathers the outputs back
into dataset order a block at a time (one batch of every process), so every process returns the same, or the main
process writes them to a .npy file as they come; `evaluate` tallies the loss and the metrics as `fit`'s validation
does (metrics.py). Under --strategy fsdp the model is sharded for the forward. The items are read as `fit` reads
them (data/items.py); items without labels are fine for `predict`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from ..config import AUTO_WORKERS, RunConfig, TrainConfig
from ..data.batches import LoaderBatches
from ..data.items import (ItemCollate, Whole, keyword_label, kept_global_rng, layout_of, map_targets,
                          takes_keywords, workers_for)
from ..data.streams import StreamBatches, is_stream, item_zero
from ..data.types import ImageFiles, ImageSet, PreparedSet
from ..errors import UserError
from ..metrics import Loss, Measures, check_batch_first, classifies
from ..steps import BatchCalls, Scored, Step, StepJob, overrides
from ..models import output_of
from ..parallel import Runtime, runtime_for
from ..parallel.split import CUT
from ..runfolder import atomic_file
from .predict import check_writable


def predict(model: nn.Module, dataset: Dataset, config: TrainConfig | None = None, *,
            output_key: str | int | None = None, output: str | Path | None = None,
            batch_keys: Sequence[str] | None = None, collate_fn: Callable | None = None) -> torch.Tensor | Path:
    """The model's output for every item of `dataset`, batch first as the model gives it (N x classes logits,
    N x K values, N x C x H x W masks, ...; floating outputs as float32), on the CPU, in dataset order, each item
    exactly once, the same on every process and on any process count. Call it in every process of the job (or in
    one). `output_key` picks the tensor of a dict, tuple or object output (models.output_of). `output="preds.npy"`:
    for outputs too large to hold, the main process writes them there in order as they come, atomically (the file
    appears whole when the last block is in), and every process returns its path. The batch size, precision,
    device, strategy and DataLoader workers come from `config` (default: TrainConfig()); the whole config, as `fit`
    takes it.

    A stream (IterableDataset) is scored in its own order: split among the processes item by item (read without
    DataLoader workers, so that the order is the stream's), or, one that shards itself (see data/streams.py), in
    its processes' turns: item j of process 0, item j of process 1, ..."""
    path = _npy_path(output) if output is not None else None
    keywords = not is_stream(dataset) and len(dataset) > 0 and \
        takes_keywords(model, item_zero(dataset, "dataset"), batch_keys, "dataset")  # type: ignore[arg-type]
    _check_scorable(dataset)
    cfg = (config or TrainConfig()).validate()  # only read
    with _scoring(dataset, cfg.run, cfg.optim.batch_size, cfg.model.channels_last, cfg.data.typed().num_workers,
                  batch_keys, collate_fn, labelled=False, whole=keywords) as (runtime, batches):
        blocks = _one_shape(_ordered_blocks(model, batches, runtime, cfg.model.channels_last and not keywords,
                                            output_key))
        if path is None:
            return torch.cat(list(blocks))
        if runtime.is_main:
            _write_npy(path, blocks, None if is_stream(dataset) else len(dataset))  # type: ignore[arg-type]
        else:
            for _ in blocks:  # every rank takes part in every block's gather
                pass
        runtime.barrier()  # the file is whole before any process returns its path
        return path


def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig | None = None,
             loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None, *,
             metrics: Mapping[str, Any] | None = None, output_key: str | int | None = None,
             batch_keys: Sequence[str] | None = None, collate_fn: Callable | None = None,
             step: Step | None = None) -> dict[str, Any]:
    """What `fit` validates, for `model` on a labelled `dataset`, exact on any process count: "loss" (`loss_fn`
    per sample, by default cross-entropy), "samples", each of `metrics` by its name (torchmetrics Metrics, or
    functions f(outputs, targets) per sample), and for a single-label classifier (N x classes outputs, integer
    labels) "accuracy" and "per_class_accuracy" too. A `step` whose eval_step scores a batch its own way (a
    detector's boxes) gives what it returns: its loss where it gives one, and `metrics`. Items that are dicts of
    the keys the model's forward takes are scored as `model(**batch)`. The same on every process. `config` gives
    the batch size, precision, device, strategy and DataLoader workers as for `predict` (the whole config, as
    `fit` takes it)."""
    loss = Loss(loss_fn, output_key=output_key)
    keywords = step is None and not is_stream(dataset) and len(dataset) > 0 and \
        takes_keywords(model, item_zero(dataset, "dataset"), batch_keys, "dataset")  # type: ignore[arg-type]
    calls = BatchCalls(loss, step, keywords)
    _check_scorable(dataset)
    cfg = (config or TrainConfig()).validate()  # only read
    with _scoring(dataset, cfg.run, cfg.optim.batch_size, cfg.model.channels_last, cfg.data.typed().num_workers,
                  batch_keys, collate_fn, labelled=True, whole=calls.eval_whole) as (runtime, batches):
        if keywords:
            calls.label_key = keyword_label(item_zero(dataset, "dataset"))
        job = StepJob(runtime).bind(step, model)
        try:
            with _evaluation_mode(model, runtime, cfg.model.channels_last and not calls.eval_whole) as placed:
                first = _first_item(placed, dataset, batches, runtime, calls)
                out, y = first.outputs, first.targets
                classifier = isinstance(out, torch.Tensor) and classifies(out, y) and not overrides(step, "eval_step")
                has_loss = first.loss is not None or not calls.eval_whole
                measures = Measures(loss, classifier, metrics or {}, has_loss)
                tally = measures.tally(runtime.device)
                per_class = torch.zeros(2, out.shape[1] if classifier else 0, device=runtime.device,
                                        dtype=torch.float64)  # (correct, support) per class
                for x, y in batches.lockstep(runtime.forward_collective or calls.eval_gathers):
                    with runtime.autocast():
                        scored = calls.score(placed, x, y)
                    out, y = scored.outputs, scored.targets
                    if not runtime.holds_outputs:  # another process of this replica counts them
                        continue
                    tally.add(out, y, scored.loss, len(x))
                    if classifier and len(out):
                        k = per_class.shape[1]
                        per_class[0] += torch.bincount(y[out.argmax(1) == y], minlength=k)[:k].double()
                        per_class[1] += torch.bincount(y, minlength=k)[:k].double()
                gather = runtime.gather_objects if runtime.world_size > 1 else None
                result: dict[str, Any] = tally.result(runtime.sum, gather)
        finally:
            job.unbind(step)
        if classifier:
            correct, support = runtime.sum(per_class).tolist()
            result["per_class_accuracy"] = {c: correct[c] / support[c] if support[c] else None
                                            for c in range(len(support))}
        return result


def _check_scorable(dataset: Dataset) -> None:
    """Refuse on one line a dataset that predict and evaluate do not score: scaletrain's image data, or no items."""
    if isinstance(dataset, (ImageSet, ImageFiles, PreparedSet)):
        raise UserError("scaletrain.predict and evaluate take your own Dataset; scaletrain's image data is scored "
                        "with its preprocessing by `scaletrain predict` / `scaletrain evaluate` on a checkpoint")
    if not is_stream(dataset) and len(dataset) == 0:  # type: ignore[arg-type]
        raise UserError("dataset: holds no items to score")


@contextmanager
def _scoring(dataset: Dataset, r: RunConfig, batch_size: int, channels_last: bool, num_workers: int | str,
             batch_keys, collate_fn, labelled: bool, whole: bool = False) -> Iterator[tuple[Runtime, LoaderBatches]]:
    """This process's runtime (`r`: precision, device, strategy; the seed) and its strided shard of `dataset` in
    batches of `batch_size`, for one scoring pass; `num_workers`: --num-workers, resolved."""
    stream = is_stream(dataset)
    runtime = runtime_for(r, scoring=True)
    try:
        layout = None if whole else layout_of(item_zero(dataset, "dataset"), batch_keys, labelled=labelled,
                                              where="dataset")
        items = ItemCollate(layout, collate_fn, "dataset", whole)
        common = dict(train=False, rank=runtime.data_rank, world=runtime.data_world, seed=r.seed,
                      channels_last=channels_last)
        batches = StreamBatches(dataset, runtime.device, batch_size, items, total=runtime.sum_over_replicas,
                                num_workers=0, **common) if stream else \
            LoaderBatches(dataset, runtime.device, batch_size, items=items, **common,
                          num_workers=workers_for(dataset, items, batch_size, num_workers, AUTO_WORKERS, "dataset"))
        with batches:  # its workers end with the pass
            yield runtime, batches
    finally:
        runtime.end()


@contextmanager
def _evaluation_mode(model: nn.Module, runtime: Runtime, channels_last: bool) -> Iterator[nn.Module]:
    """The model on the device (only this rank's shard under fsdp) in evaluation mode, its own mode restored
    after, without gradients."""
    if CUT in model.__dict__:  # a model cut down to a pipeline stage's parts (split.stage_model)
        raise UserError(f"model: holds only one pipeline stage's parts ({model.__dict__[CUT]}); load the run's "
                        f"last.safetensors into the model built whole, and score that")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    placed = runtime.place(model)
    was_training = placed.training
    placed.eval()
    try:
        with torch.no_grad():
            yield placed
    finally:
        placed.train(was_training)


def _first_item(model: nn.Module, dataset: Dataset, batches: LoaderBatches | StreamBatches, runtime: Runtime,
                calls: BatchCalls) -> Scored:
    """The dataset's item 0 scored, alike on every rank (in _evaluation_mode): what the task is."""
    with kept_global_rng():
        x, y = batches.items([item_zero(dataset, "dataset")])  # type: ignore[misc]
    with runtime.autocast():
        scored = calls.score(model, x.to(runtime.device), map_targets(lambda t: t.to(runtime.device), y))
    if isinstance(scored.outputs, torch.Tensor) and not calls.eval_gathers:  # a gather's rows are every rank's
        check_batch_first(scored.outputs, "dataset")
    return scored


def _ordered_blocks(model: nn.Module, batches: LoaderBatches, runtime: Runtime, channels_last: bool,
                    output_key: str | int | None) -> Iterator[torch.Tensor]:
    """The outputs in dataset order, one block per batch step: batch b of every rank, gathered (rank r holds items
    r, r+W, ..., so block b holds a run of consecutive items). Every rank takes part in every block: a rank with
    fewer batches gives empty ones. A short batch is run filled up to the full batch size with copies of its last
    item (their outputs dropped): the kernels then see the same batch size on any process count, and an item's
    output is the same bit for bit."""
    world, size = runtime.data_world, batches.batch_size
    shards = None if batches.steps is None else [len(range(r, batches.n, world)) for r in range(world)]
    with _evaluation_mode(model, runtime, channels_last) as placed:
        for b, (x, _) in enumerate(batches.lockstep(True)):
            with runtime.autocast():
                out = output_of(_called(placed, x, size), output_key)[:len(x)]
            out = out.float() if out.is_floating_point() else out
            if shards is None:  # a stream: as many rows as each rank had
                yield runtime.gather_interleaved(out, size).cpu()
                continue
            in_block = sum(min(max(shard - b * size, 0), size) for shard in shards)
            yield runtime.gather_strided(out, in_block).cpu()


def _one_shape(blocks: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The blocks, refused on one line where one's rows differ in shape from the first's (an output per token of
    batches padded each to its own longest item): predict gives one N x ... array."""
    first = None
    for block in blocks:
        first = block.shape[1:] if first is None else first
        if block.shape[1:] != first:
            raise UserError(f"predict: the model's outputs are {' x '.join(map(str, first))} per item in one batch "
                            f"and {' x '.join(map(str, block.shape[1:]))} in another; pad every item to one length "
                            f"(a collate_fn that pads each batch to its longest item gives outputs of many shapes)")
        yield block


def _called(model: nn.Module, x: torch.Tensor | Whole, size: int) -> Any:
    """The model's output for a batch filled up to `size` items with copies of its last (see _ordered_blocks): a
    tensor of inputs as `model(x)`, a batch of the keys the forward takes (a Whole) as `model(**batch)`."""
    n = len(x)

    def filled(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[-1:].expand(size - n, *t.shape[1:])]) if 0 < n < size and t.ndim and len(t) == n \
            else t

    if isinstance(x, Whole):
        return model(**map_targets(filled, x.data))
    return model(filled(x))


def _npy_path(output: str | Path) -> Path:
    """`predict`'s output file, refused before any work if it is no .npy file that can be written."""
    path = Path(output)
    if path.suffix != ".npy":
        raise UserError(f"output={str(output)!r}: expected a .npy file name")
    check_writable(path, f"output={str(output)!r}")
    return path


def _write_npy(path: Path, blocks: Iterator[torch.Tensor], total: int | None) -> None:
    """The blocks, in order, as one N x ... array in a .npy file, written through a temporary file. A stream's
    `total` (None) is known at its end: its rows go to a file beside first, then behind the header."""
    if total is None:
        rows = path.with_name(f".{path.name}.{os.getpid()}.rows")
        try:
            total, first = 0, None
            with open(rows, "wb") as raw:
                for block in blocks:
                    first = block[:0] if first is None else first
                    total += len(block)
                    raw.write(np.ascontiguousarray(block.numpy()).tobytes())
            with open(rows, "rb") as raw:
                _write_npy(path, _blocks_of(raw, first, total), total)  # type: ignore[arg-type]
        finally:
            rows.unlink(missing_ok=True)
        return
    with atomic_file(path) as f:
        for i, block in enumerate(blocks):
            array = block.numpy()
            if i == 0:
                np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(array.dtype),
                                                         "fortran_order": False,
                                                         "shape": (total, *array.shape[1:])})
            f.write(np.ascontiguousarray(array).tobytes())


def _blocks_of(raw, like: torch.Tensor, total: int, rows: int = 4096) -> Iterator[torch.Tensor]:
    """`total` rows shaped and typed as `like`, read back from a raw file `rows` at a time."""
    dtype = like.numpy().dtype
    row = int(np.prod(like.shape[1:])) * dtype.itemsize
    for start in range(0, max(total, 1), rows):
        count = min(rows, total - start)
        yield torch.from_numpy(np.frombuffer(raw.read(count * row), dtype=dtype).reshape(count, *like.shape[1:]))
