"""A user's own Dataset as the loop reads it: where its items keep the input and the label, and how a batch of them
becomes (inputs, labels) for the model, whatever shape the items have.

Items may be tuples or lists `(x, y, ...)` or dicts with an input key and a label key (`image`, `img`,
`pixel_values`, `x` / `label`, `labels`, `target`, `y`, or named by `batch_keys`); inputs tensors, NumPy arrays or
PIL images. Float inputs go to the model as they are; uint8 images become float in [0, 1] (H x W x C turned to
C x H x W where that is unambiguous). The layout is read once, from the first item, before training starts; an item
that does not fit it is refused on one line naming what was found.
"""

from __future__ import annotations

import inspect
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ..errors import UserError, describe

IMAGE_KEYS = ("image", "img", "pixel_values", "x")
LABEL_KEYS = ("label", "labels", "target", "y")
CHANNELS = (1, 3, 4)


@dataclass(frozen=True)
class ItemLayout:
    """Where each item keeps the input and the label: positions of a tuple or keys of a dict (label None: the
    items carry none, as a test set's)."""

    image: int | str
    label: int | str | None

    def parts(self, item: Any) -> tuple[Any, Any]:
        return item[self.image], (None if self.label is None else item[self.label])


def layout_of(item: Any, batch_keys: Sequence[str] | None = None, labelled: bool = True,
              where: str = "the dataset") -> ItemLayout:
    """The layout of a Dataset's items, read from one of them; refused on one line when it has none that fits."""
    expected = (f"expected (input, label, ...) or a dict with an input key ({', '.join(IMAGE_KEYS)}) and a label key "
                f"({', '.join(LABEL_KEYS)}), or name them with batch_keys=(input, label)")
    if isinstance(item, dict):
        keys = list(batch_keys) if batch_keys else None
        image = keys[0] if keys else next((k for k in IMAGE_KEYS if k in item), None)
        label = (keys[1] if keys and len(keys) > 1 else None) if keys else next((k for k in LABEL_KEYS if k in item),
                                                                                  None)
        missing = [k for k in (image, label) if k is not None and k not in item]
        if image is None or missing:
            raise UserError(f"{where}: item 0 is {describe(item)}; "
                            + (f"it has no key {missing[0]!r}" if missing else expected))
        if label is None and labelled:
            raise UserError(f"{where}: item 0 is {describe(item)}, with no label key; {expected}")
        return ItemLayout(image, label)
    if isinstance(item, (tuple, list)) and len(item) >= (2 if labelled else 1):
        return ItemLayout(0, 1 if len(item) > 1 else None)
    if isinstance(item, (torch.Tensor, np.ndarray)) and not labelled:
        return ItemLayout(None, None)  # type: ignore[arg-type]  # the item is the input itself
    raise UserError(f"{where}: item 0 is {describe(item)}; {expected}")


def takes_keywords(model: Any, item: Any, batch_keys, where: str = "train_data") -> bool:
    """Whether a dict item goes to the model as keywords, `model(**batch)`: it has none of the input keys (and
    batch_keys names none), and the model's forward takes some of its keys by name (a Hugging Face model's
    input_ids, attention_mask, labels, ...). A key the forward takes neither by name nor through **kwargs is
    refused on one line."""
    if not isinstance(item, Mapping) or batch_keys or any(k in item for k in IMAGE_KEYS):
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    named = [k for k in item if k in params]
    if not named:
        return False
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        extra = [k for k in item if k not in params]
        if extra:
            # one key taken and one not: most likely the input and its label, under names of the user's own
            pair = f"; if they are the input and its label, say so with batch_keys=({named[0]!r}, {extra[0]!r})" \
                if len(named) == 1 and len(extra) == 1 else ""
            raise UserError(f"{where}: item 0 is {describe(dict(item))}; the model's forward takes "
                            f"{', '.join(named)} by name but not {', '.join(map(repr, extra))}: leave them out of "
                            f"the items (or your collate_fn){pair}")
    return True


def keyword_label(item: Mapping) -> str | None:
    """The key of a keyword item's targets (labels for a Hugging Face model), for the metrics; None: it has none."""
    return next((k for k in LABEL_KEYS if k in item), None)


def as_inputs(x: Any, where: str = "the dataset") -> torch.Tensor:
    """A collated batch of inputs as the model takes it: float as it is; uint8 images scaled to [0, 1] and brought
    from N x H x W x C to N x C x H x W where the channels are plainly last."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise UserError(f"{where}: a batch of inputs collated to {describe(x)}; expected a tensor or an array")
    if x.dtype == torch.uint8:
        if x.ndim == 4 and x.shape[-1] in CHANNELS and x.shape[1] not in CHANNELS:
            x = x.permute(0, 3, 1, 2)
        x = x.float().div_(255)
    return x


def as_targets(y: Any, where: str = "the dataset") -> Any:
    """A collated batch of targets as the loss takes it: class labels as int64 N (N x 1 too), any other tensor as it
    is (floats, multi-hot, N x H x W class masks as int64), NumPy arrays as tensors, dicts, lists and tuples of them
    alike; None for items without labels."""
    if y is None:
        return None
    if isinstance(y, np.ndarray):
        y = torch.from_numpy(y)
    if isinstance(y, (list, tuple)) and y and all(isinstance(v, (int, np.integer)) for v in y):
        y = torch.as_tensor(y)
    if isinstance(y, dict):
        return {k: as_targets(v, where) for k, v in y.items()}
    if isinstance(y, (list, tuple)) and y:
        return type(y)(as_targets(v, where) for v in y)
    if not isinstance(y, torch.Tensor):
        raise UserError(f"{where}: a batch of labels collated to {describe(y)}; expected tensors (class labels, "
                        f"values, masks) or a dict of them")
    if y.is_floating_point() or y.dtype == torch.bool:
        return y  # soft targets, values, multi-hot: for the user's loss as they are
    return y.long().view(-1) if y.ndim == 2 and y.shape[1] == 1 else y.long()


def map_targets(fn: Callable[[torch.Tensor], torch.Tensor], y: Any) -> Any:
    """`fn` applied to every tensor of a batch's targets (a tensor, or dicts, lists and tuples of them)."""
    if isinstance(y, torch.Tensor):
        return fn(y)
    if isinstance(y, Mapping):  # a dict, or a tokenizer's BatchEncoding (a UserDict)
        return {k: map_targets(fn, v) for k, v in y.items()}
    if isinstance(y, tuple) and hasattr(y, "_fields"):  # a namedtuple
        return type(y)(*(map_targets(fn, v) for v in y))
    if isinstance(y, (list, tuple)):
        return type(y)(map_targets(fn, v) for v in y)
    return y


class Whole:
    """A batch as the user's collate made it (tensors, dicts, lists, tuples of any shape), for a step that takes
    the batch whole (see steps.py): `data`, and `size`, the items it holds (0: a batch that only keeps a rank in
    step with the others, whose results count for nothing)."""

    __slots__ = ("data", "size")

    def __init__(self, data: Any, size: int):
        self.data, self.size = data, size

    def __len__(self) -> int:
        return self.size

    def to(self, device: torch.device, non_blocking: bool = False) -> Whole:
        return Whole(map_targets(lambda t: t.to(device, non_blocking=non_blocking), self.data), self.size)

    def pin_memory(self) -> Whole:
        return Whole(map_targets(lambda t: t.pin_memory(), self.data), self.size)

    def counting_nothing(self) -> Whole:
        return Whole(self.data, 0)

    def emptied(self) -> Whole:
        """No rows at all: every tensor with the batch first cut to none (for a step that gathers the batch's rows
        over the processes, where a rank's padding must add none)."""
        size = self.size if self.size else _first_length(self.data)
        return Whole(map_targets(lambda t: t[:0] if t.ndim and len(t) == size else t, self.data), 0)


def _first_length(data: Any) -> int | None:
    """The length of the first tensor in a batch (the batch size of a batch that counts nothing)."""
    found: list[int] = []
    map_targets(lambda t: found.append(len(t)) or t if t.ndim else t, data)
    return found[0] if found else None


def empty_like(x: Any) -> Any:
    """A batch of inputs of no samples, shaped like `x` (a Whole batch: the same data, counting nothing)."""
    return x.counting_nothing() if isinstance(x, Whole) else x[:0]


class ItemCollate:
    """The DataLoader's collate_fn for a user's Dataset: the user's own collate_fn (else torch's default), then the
    batch read by the layout into (inputs, labels or None), or, `whole`, kept as it is: (Whole, None). Runs in the
    DataLoader's workers."""

    def __init__(self, layout: ItemLayout | None, collate_fn: Callable | None = None, where: str = "the dataset",
                 whole: bool = False):
        self.layout, self.collate_fn, self.where, self.whole = layout, collate_fn, where, whole

    def __call__(self, items: list) -> tuple[torch.Tensor | Whole, Any]:
        batch = (self.collate_fn or default_collate)(items)
        if self.whole:
            return Whole(batch, len(items)), None
        if self.layout.image is None:
            return as_inputs(batch, self.where), None
        try:
            x, y = self.layout.parts(batch)
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{self.where}: a batch collated to {describe(batch)}, which has no "
                            f"{self.layout.image!r} / {self.layout.label!r} as item 0 had") from None
        return as_inputs(x, self.where), as_targets(y, self.where)


CHEAP_BATCH_SECONDS = 0.002  # a batch read faster than this gains nothing from workers: their hand-over costs more


def workers_for(data: Any, items: Callable[[list], Any], batch_size: int, setting: int | str, auto: int,
                where: str, say: Callable[[str], None] | None = None, decided: int | None = None) -> int:
    """The DataLoader workers that read a user's Dataset: `setting` when it is a number; for "auto", none when its
    first batch reads (items and collate) in under CHEAP_BATCH_SECONDS here (items already in memory: a worker
    only adds the batch's hand-over between processes, and its share of the cores), else `auto`; `decided`: what
    the run decided before it was resumed, kept. Nothing is drawn from the process's generators (and each batch is
    read with them seeded for it, in a worker or not: the weights do not depend on the decision); `say` gets the
    decision on one line."""
    if setting != "auto":
        return int(setting)
    if decided is not None:
        if say is not None:
            say(f"{where}: read by {decided or 'no'} DataLoader worker(s), as the run decided before it was resumed "
                f"(--num-workers auto)")
        return int(decided)
    n, took = min(batch_size, len(data)), None
    with kept_global_rng():
        for _ in range(3):  # a preemption can slow one read: the first that is quick enough decides
            took = _read_seconds(data, items, n, CHEAP_BATCH_SECONDS)
            if took is not None:
                break
    workers = 0 if took is not None else auto
    if say is not None:
        how = f"reads in {took * 1e3:.2f} ms: read in the training process, without DataLoader workers" \
            if took is not None else f"takes more than {CHEAP_BATCH_SECONDS * 1e3:.0f} ms to read: read by " \
                                     f"{workers} DataLoader workers beside the step"
        say(f"{where}: a batch of {n} items {how} (--num-workers auto; set a number to choose)")
    return workers


def _read_seconds(data: Any, items: Callable[[list], Any], n: int, limit: float) -> float | None:
    """Seconds to read and collate items 0..n-1, or None once they pass `limit` (the rest is not read)."""
    start, got = time.perf_counter(), []
    for i in range(n):
        got.append(data[i])
        if time.perf_counter() - start > limit:
            return None
    items(got)
    took = time.perf_counter() - start
    return took if took <= limit else None


@contextmanager
def kept_global_rng():
    """The process's global random generators (Python, NumPy, torch's CPU) as they were, after the block."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])


def seed_everything_of(dataset: Dataset, seed: int, seed_fn: Callable[[Dataset, int], None] | None = None) -> None:
    """Seed what a Dataset's own random augmentation draws from: the global generators (Python's `random`, NumPy's,
    torch's CPU generator: what torchvision's transforms use), albumentations pipelines found on the Dataset (they
    keep generators of their own), and the user's `seed_fn(dataset, seed)` for anything else."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    for pipeline in _pipelines(dataset):
        pipeline.set_random_seed(seed % 2**32)
    if seed_fn is not None:
        seed_fn(dataset, seed)


def _pipelines(dataset: Any) -> list:
    """Objects with `set_random_seed` (albumentations 2's Compose) held by the Dataset, directly or in a list,
    tuple or dict attribute, one level down (a Subset's dataset too)."""
    found, seen = [], set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 2:
            return
        seen.add(id(value))
        if callable(getattr(value, "set_random_seed", None)) and not isinstance(value, type):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)
        elif isinstance(value, Dataset) and depth < 2:
            for v in vars(value).values():
                visit(v, depth + 1)

    for v in vars(dataset).values() if hasattr(dataset, "__dict__") else ():
        visit(v, 1)
    return found


@dataclass(frozen=True)
class SeededBatch:
    """A batch's item indices and the seed its items are read with (from the run's seed, rank, epoch, batch)."""

    seed: int
    indices: list[int]

    def __len__(self) -> int:
        return len(self.indices)


class SeededItems(Dataset):
    """A user's Dataset read a batch at a time with every generator its augmentation draws from seeded for that
    batch, so a run resumed mid-epoch draws exactly what the uninterrupted one drew, whatever the number of
    DataLoader workers. The process's own generators are left as they were."""

    def __init__(self, dataset: Dataset, seed_fn: Callable[[Dataset, int], None] | None = None):
        self.dataset, self.seed_fn = dataset, seed_fn

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        return self.dataset[i]

    def __getitems__(self, batch: SeededBatch) -> list:
        with kept_global_rng():
            seed_everything_of(self.dataset, batch.seed, self.seed_fn)
            return [self.dataset[i] for i in batch.indices]
