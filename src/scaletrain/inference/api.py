"""`scaletrain.predict` and `scaletrain.evaluate`: a user's own model and Dataset scored on every process of a job,
with results exact on any process count.

Each process scores its strided shard of the Dataset (no padding, no duplicates); the logits are gathered back into
dataset order, so every process returns the same. Under --strategy fsdp the model is sharded for the forward. The
items are read as `fit` reads them (data/items.py); items without labels are fine for `predict`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..config import TrainConfig
from ..data.batches import LoaderBatches, lockstep
from ..data.items import ItemCollate, kept_global_rng, layout_of
from ..data.types import ImageFiles, ImageSet, PreparedSet
from ..errors import UserError, describe
from ..models import logits_of
from ..parallel import Runtime, runtime_for


def predict(model: nn.Module, dataset: Dataset, config: TrainConfig | None = None, *,
            batch_keys: Sequence[str] | None = None, collate_fn: Callable | None = None) -> torch.Tensor:
    """Logits of every item of `dataset`, N x classes float32 on the CPU, in dataset order, each item exactly once,
    the same on every process and on any process count. Call it in every process of the job (or in one). The
    batch size, precision, device, strategy and DataLoader workers come from `config` (default: TrainConfig())."""
    logits, _ = _score(model, dataset, config, batch_keys, collate_fn, labelled=False)
    return logits


def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig | None = None,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, *,
             batch_keys: Sequence[str] | None = None, collate_fn: Callable | None = None) -> dict[str, Any]:
    """{"loss", "accuracy", "samples", "per_class_accuracy"} of `model` on a labelled `dataset`, exact on any
    process count: every item is scored once and the loss is computed over all of them at once (`loss_fn`, a mean
    over the samples, by default cross-entropy). The same on every process."""
    logits, labels = _score(model, dataset, config, batch_keys, collate_fn, labelled=True)
    loss = (loss_fn or F.cross_entropy)(logits.double() if loss_fn is None else logits, labels)
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"loss_fn returned {describe(loss)}; expected a tensor")
    hard = labels.argmax(1) if labels.is_floating_point() else labels
    predicted = logits.argmax(1)
    classes = logits.shape[1]
    per_class = {}
    for c in range(classes):
        mine = hard == c
        per_class[c] = (predicted[mine] == c).float().mean().item() if mine.any() else None
    return {"loss": loss.float().mean().item(), "accuracy": (predicted == hard).float().mean().item(),
            "samples": len(labels), "per_class_accuracy": per_class}


@torch.no_grad()
def _score(model: nn.Module, dataset: Dataset, config: TrainConfig | None, batch_keys, collate_fn,
           labelled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(dataset, (ImageSet, ImageFiles, PreparedSet)):
        raise UserError("scaletrain.predict and evaluate take your own Dataset; scaletrain's image data is scored "
                        "with its preprocessing by `scaletrain predict` / `scaletrain evaluate` on a checkpoint")
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise UserError("dataset: holds no items to score")
    cfg = (config or TrainConfig()).validate()  # only read
    runtime = runtime_for(cfg.run)
    try:
        with kept_global_rng():
            layout = layout_of(dataset[0], batch_keys, labelled=labelled, where="dataset")
        items = ItemCollate(layout, collate_fn, "dataset")
        batches = LoaderBatches(dataset, runtime.device, cfg.optim.batch_size, train=False, rank=runtime.rank,
                                world=runtime.world_size, seed=cfg.run.seed, num_workers=cfg.data.num_workers,
                                channels_last=cfg.model.channels_last, items=items)
        with batches:  # its workers end with the pass
            return _gathered(model, batches, runtime, cfg.model.channels_last, len(dataset),  # type: ignore[arg-type]
                             labelled)
    finally:
        runtime.end()


def _gathered(model: nn.Module, batches: LoaderBatches, runtime: Runtime, channels_last: bool, total: int,
              labelled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    placed = runtime.place(model)  # on the device; only this rank's shard under fsdp
    was_training = placed.training
    placed.eval()
    logits, labels = [], []
    try:
        for x, y in lockstep(batches, runtime.sharded):
            with runtime.autocast():
                logits.append(logits_of(placed(x)).float())
            if labelled:
                labels.append(y)
    finally:
        placed.train(was_training)
    if not logits:  # a rank with no items (fewer items than processes) still gives its empty share
        x, y = batches.empty_batch()
        with runtime.autocast():
            logits.append(logits_of(placed(x)).float())
        labels.append(y)
    mine = torch.cat(logits)[: batches.num_samples]  # the empty batches lockstep adds score nothing
    scored = runtime.gather_strided(mine, total).cpu()
    if not labelled:
        return scored, None
    mine_labels = torch.cat([y for y in labels if y is not None])[: batches.num_samples]
    return scored, runtime.gather_strided(mine_labels, total).cpu()
