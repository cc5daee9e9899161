"""Batches from a stream: a user's `IterableDataset` (their own reader, WebDataset, Hugging Face's streaming
datasets, LitData's StreamingDataset), whose length is not known before it runs dry.

Who reads what. A dataset that reads its share by itself says so with a true `shards_by_rank` attribute (LitData's
StreamingDataset is recognised as one): its `__iter__` learns the process from torch.distributed (`get_rank()`,
`get_world_size()`, or the RANK and WORLD_SIZE variables every launcher sets) and the DataLoader worker from
`torch.utils.data.get_worker_info()`, and yields only its part. Any other stream is split here: each of the W
processes x K workers reads the whole stream and keeps every (W x K)-th item, so every item goes to exactly one of
them.

Training. Streams are uneven: one rank's part may run dry while another's has more. Before each batch is handed to
the loop, the ranks agree (one small all-reduce) on whether every one of them has a next batch, so the epoch ends
on every rank at the same step as soon as any rank runs dry, and no rank waits in a collective the others never
join. The epoch also ends after `steps_per_epoch` optimizer steps when that is set. How many samples an epoch
trained on is counted, not known ahead.

Evaluation reads every rank's whole part, so every item is counted once; under a sharded strategy the ranks that
ran dry keep joining the forward passes with empty batches until the last one is done.

Resume. A dataset with `state_dict()` and `load_state_dict()` (the protocol of torchdata's StatefulDataLoader and
LitData) is read in the training process (no DataLoader workers), so that its state after each batch is exactly
what was trained on; checkpoints keep each rank's state and a resumed run continues mid-epoch where it stopped. Any
other stream restarts the interrupted epoch from its beginning. A dataset with `set_epoch(epoch)` is told each
epoch's number before its pass (to reshuffle, as LitData and Hugging Face's datasets do).
"""

from __future__ import annotations

import copy
import itertools
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import UserError
from ..parallel.threads import data_worker_start
from .batches import workers_errors
from .items import empty_like, kept_global_rng, map_targets


def is_stream(data: Any) -> bool:
    """An IterableDataset, or anything iterable without item access: read as it comes."""
    return isinstance(data, IterableDataset) or (hasattr(data, "__iter__") and not hasattr(data, "__getitem__"))


def shards_itself(data: Any) -> bool:
    """Whether the stream yields only this process's and this worker's part by itself (see the module's text)."""
    explicit = getattr(data, "shards_by_rank", None)
    if explicit is not None:
        return bool(explicit)
    return type(data).__module__.startswith("litdata.")


def stateful(data: Any) -> bool:
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


def first_item(data: Any, where: str) -> Any:
    """The stream's first item, read without drawing from the process's generators or moving a resumable stream
    on (its state is put back). A source that stops answering here is a one-line error: before the first step
    there is no training state to save."""
    state = copy.deepcopy(data.state_dict()) if stateful(data) else None
    with kept_global_rng():
        try:
            return next(iter(data))
        except StopIteration:
            raise UserError(f"{where}: the stream yielded no item") from None
        except DataPaused as e:
            raise UserError(f"{where}: {e}") from None
        finally:
            if state is not None:
                data.load_state_dict(state)


def item_zero(data: Any, where: str) -> Any:
    """A dataset's first item, read without drawing from the process's generators: item 0 of a Dataset, the first
    item of a stream (see first_item)."""
    if is_stream(data):
        return first_item(data, where)
    with kept_global_rng():
        return data[0]


class RankSplit(IterableDataset):
    """A stream that does not shard itself, split among ranks and DataLoader workers: item k goes to the reader
    k mod (world x workers)."""

    def __init__(self, data: Any, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers, me = self.world * workers, self.rank * workers + worker
        for k, item in enumerate(self.data):
            if k % readers == me:
                yield item


class DataPaused(Exception):
    """The data's source stopped answering (an object store): the run saves its last step and stops, and the same
    command resumes once it answers."""


class StreamBatches:
    """A stream's batches for this rank, every rank ending each pass at the same step (see the module's text).
    `total(t)` sums a tensor over the ranks; `steps_per_epoch` (training; 0: none) ends an epoch after that many
    optimizer steps of `grad_accum` batches; `recipe(x, y, epoch, batch)`, when given, makes each batch of uint8
    images a model input (scaletrain's chunked data, see sources/chunks.py)."""

    steps = None  # batches per pass: not known ahead

    def __init__(self, data: Any, device: torch.device, batch_size: int, items: Callable, *, train: bool,
                 rank: int, world: int, seed: int, total: Callable[[torch.Tensor], torch.Tensor],
                 num_workers: int = 2, channels_last: bool = True, steps_per_epoch: int = 0, grad_accum: int = 1,
                 recipe: Callable | None = None):
        self.data, self.device, self.batch_size, self.items = data, device, batch_size, items
        self.total, self.world, self.channels_last, self.recipe = total, world, channels_last, recipe
        self.max_batches = steps_per_epoch * grad_accum if train and steps_per_epoch else 0
        self.resumable = stateful(data)
        readable = data if shards_itself(data) else RankSplit(data, rank, world)
        if self.resumable:
            num_workers = 0  # its state must be the trained batches' (see the module's text)
        self.loader = DataLoader(readable, batch_size=batch_size, num_workers=num_workers, collate_fn=items,
                                 pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed),
                                 worker_init_fn=partial(data_worker_start, training_on_cpu=device.type == "cpu"))
        self.last = False  # whether the batch just handed out is the pass's last, on every rank
        self.state: Any = None  # the dataset's state after the batch just handed out (a resumable one)
        self.pending: Any = None  # the state to continue from, in a resumed run
        self._empty: tuple[torch.Tensor, Any] | None = None

    def __len__(self) -> int:
        raise TypeError("a stream's batches have no length")

    def accumulation(self, i: int, accum: int) -> tuple[float, bool]:
        """(weight, whether it ends an accumulation group) of batch `i`: each batch's mean loss over the group's
        batches; the last group of a pass may be shorter (its batches keep their weight)."""
        return 1.0 / accum, (i + 1) % accum == 0 or self.last

    def is_last(self, i: int) -> bool:
        return self.last

    def resume(self, state, say) -> None:
        """Continue a run resumed mid-epoch (`state`, see training/checkpoint.TrainState): a resumable stream from
        its saved state; any other from the interrupted epoch's beginning (the console says so)."""
        if not state.batch:
            return
        if self.resumable and state.stream is not None:
            self.pending = state.stream
            return
        say(f"the stream has no state_dict(): epoch {state.epoch + 1} starts again from its beginning "
            f"({state.batch} batch(es) of it were trained before the stop)")
        state.batch, state.totals = 0, None

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, Any]]:
        """This rank's batches of `epoch`, batch number `start` on (a resumed run's: the stream's state from its
        checkpoint is loaded first)."""
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)
        if self.pending is not None:
            self.data.load_state_dict(self.pending)
            self.pending = None
        with workers_errors():
            batches = iter(self.loader)
            current, ready = self._agreed_next(batches, epoch, start)
            i = start
            while ready == self.world:  # every rank has a batch
                read = self.data.state_dict() if self.resumable else None  # after `current`
                following, ready = (None, 0) if self.max_batches and i + 1 >= self.max_batches else \
                    self._agreed_next(batches, epoch, i + 1)
                self.state, self.last = read, ready < self.world
                yield current  # type: ignore[misc]
                current, i = following, i + 1

    def _agreed_next(self, batches, epoch: int, i: int) -> tuple[Any, int]:
        """(this rank's next batch or None, how many ranks have one). A read that failed on any rank stops
        every rank here, together: the failing one raises its own error, the others one that says another
        process's data stopped (a DataPaused, so that every rank saves the same step)."""
        batch, problem = None, None
        try:
            batch = self._next(batches, epoch, i)
        except (UserError, DataPaused) as e:
            problem = e
        flags = torch.tensor([float(batch is not None), float(isinstance(problem, DataPaused)),
                              float(isinstance(problem, UserError))], device=self.device)
        summed = self.total(flags) if self.world > 1 else flags
        if problem is not None:
            raise problem
        if summed[1] > 0:
            raise DataPaused("another process's data source stopped answering")
        if summed[2] > 0:
            raise UserError("", quiet=True)  # refused on another process, which says why
        return batch, int(summed[0].item())

    def _next(self, batches, epoch: int, i: int) -> tuple[torch.Tensor, Any] | None:
        batch = next(batches, None)
        return None if batch is None else self._ready(batch, epoch, i)

    def first_batch(self) -> tuple[torch.Tensor, Any]:
        """A batch of this rank's first item, read on its own (the stream is not moved on, no rank is waited for)."""
        return self._ready(self.items([first_item(self.data, "the stream")]), 0, 0)

    def empty_batch(self) -> tuple[torch.Tensor, Any]:
        """A batch of no samples, shaped like the others (made once: a rank that ran dry gives one per step)."""
        if self._empty is None:
            x, y = self.first_batch()
            self._empty = empty_like(x), map_targets(lambda t: t[:0], y)
        return self._empty

    def lockstep(self, sharded: bool) -> Iterator[tuple[torch.Tensor, Any]]:
        """One evaluation pass over this rank's whole part; under a sharded strategy, empty batches while any other
        rank still has batches (each forward gathers parameters, and every rank must join)."""
        with workers_errors():
            batches = iter(self.loader)
            for i in itertools.count():
                current, ready = self._agreed_next(batches, -1, i)
                if not ready:  # every rank is done
                    return
                if current is not None:
                    yield current
                elif sharded:
                    yield self.empty_batch()

    def _ready(self, batch, epoch: int, i: int) -> tuple[torch.Tensor, Any]:
        """Batch `i` of `epoch` on the device, made a model input by the recipe when there is one."""
        x, y = batch
        x, y = x.to(self.device, non_blocking=True), map_targets(lambda t: t.to(self.device, non_blocking=True), y)
        if self.recipe is not None:
            return self.recipe(x, y, epoch, i)
        if self.channels_last and isinstance(x, torch.Tensor) and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def close(self) -> None:
        """Nothing to end: a stream's workers live for one pass."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
