"""Batches for the training loop: made on the device from in-memory uint8 images, or by a DataLoader.

`DeviceBatches` moves an `ImageSet` to the device once and builds each batch there (index, augment with
per-sample random parameters in single batched ops, resize, normalise): no workers, no copy per step.
`LoaderBatches` serves any `torch.utils.data.Dataset` through a DataLoader with the same sharding rules.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from ..parallel.threads import data_worker_start
from .indices import SamplerOrder, eval_indices, train_indices
from .decode import DeviceDecoder, EncodedFiles, encoded_batch
from .items import ItemCollate, SeededBatch, SeededItems, empty_like, kept_global_rng, map_targets
from .regularise import Regularise, mix
from .transforms import Preprocess, augment_seed, to_model_input
from .types import ImageFiles, ImageSet, StoredPixels


class _Shard:
    """This rank's share of n samples, in batches: what both batch makers have in common."""

    def __init__(self, n: int, batch_size: int, train: bool, rank: int, world: int, seed: int,
                 order: SamplerOrder | None = None):
        self.n, self.batch_size, self.train = n, batch_size, train
        self.rank, self.world, self.seed = rank, world, seed
        self.order = order if train else None  # a user's sampler's draw of each epoch (None: a permutation)
        self.num_samples = len(self._indices(0))  # samples this rank sees per epoch (the same every epoch)

    def _indices(self, epoch: int) -> torch.Tensor:
        if self.train:
            return train_indices(self.n, self.world, self.rank, self.seed, epoch, self.order)
        return eval_indices(self.n, self.world, self.rank)

    state = None  # what a stream's batches keep for a resume (see streams.StreamBatches)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def steps(self) -> int:
        """Batches per pass."""
        return len(self)

    def accumulation(self, i: int, accum: int) -> tuple[float, bool]:
        """(weight, whether it ends an accumulation group) of batch `i`: its share of the group's samples, so that
        accumulation equals one big batch."""
        n = len(self)
        group = range(i - i % accum, min(i - i % accum + accum, n))
        size = lambda j: min(self.batch_size, self.num_samples - j * self.batch_size)  # noqa: E731
        return size(i) / sum(size(j) for j in group), i == group[-1]

    def is_last(self, i: int) -> bool:
        return i + 1 == len(self)

    def first_batch(self):
        """This rank's first training batch, read on its own (nothing of the passes to come changes)."""
        first = self.epoch(0)  # type: ignore[attr-defined]
        batch = next(first)
        first.close()
        return batch

    def close(self) -> None:
        """Release what the batches hold beyond memory (LoaderBatches: its workers)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def most_batches(self) -> int:
        """Batches per pass of the rank with the most (rank 0: shards differ by at most one sample)."""
        most = len(train_indices(self.n, self.world, 0, self.seed, 0, self.order)) if self.train else \
            -(-self.n // self.world)
        return -(-most // self.batch_size)

    def lockstep(self, sharded: bool):
        """One pass over evaluation batches, then, on ranks with fewer, empty batches up to the most any rank has:
        a sharded model gathers its parameters in every forward, and every rank must join each gather."""
        yield from self.epoch(0)  # type: ignore[attr-defined]
        if sharded:
            for _ in range(self.most_batches - len(self)):
                yield self.empty_batch()  # type: ignore[attr-defined]

    def _model_input(self, x: torch.Tensor, y: torch.Tensor, epoch: int, batch: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return model_input(x, y, self.pre, self.augment, self.regularise, self.channels_last,  # type: ignore
                           augment_seed(self.seed, self.rank, epoch, batch))


def model_input(x: torch.Tensor, y: torch.Tensor, pre: Preprocess, augment: tuple[str, ...],
                regularise: Regularise | None, channels_last: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of uint8 images on the device made a model input by the recipe; mixed when asked (the labels then
    become soft targets), every random draw from `seed` (augment_seed of the rank, epoch and batch: augmentation
    differs per rank, epoch and batch; the shuffle is shared by all ranks). Nothing is drawn for what is off (all
    of it, for evaluation). Images on the meta device (kept by a process that reads no inputs: a pipeline's later
    stages) give an input of the model's shape on the meta device, and the labels as the others get them."""
    if x.is_meta:
        x = torch.empty((len(x), pre.channels, pre.image_size, pre.image_size), device="meta")
        if regularise is not None and regularise.mixes:
            x, y = mix(x, y, regularise, np.random.default_rng([seed, 1]))
        return x, y
    g = torch.Generator(device=x.device).manual_seed(seed) if augment or (regularise and regularise.on_device) \
        else None
    x = to_model_input(x, pre, channels_last, augment, g, regularise)
    if regularise is not None and regularise.mixes:
        x, y = mix(x, y, regularise, np.random.default_rng([seed, 1]))
    return x, y


class DeviceBatches(_Shard):
    """All of an ImageSet on the device; batches of this rank's shard, made there."""

    def __init__(self, data: ImageSet, pre: Preprocess, device: torch.device, batch_size: int, *,
                 train: bool, rank: int, world: int, seed: int, augment: tuple[str, ...] = (),
                 regularise: Regularise | None = None, channels_last: bool = True,
                 order: SamplerOrder | None = None, reads_inputs: bool = True):
        """`reads_inputs`: False where the inputs are never read (a pipeline's later stages): the images are kept
        on the meta device (their shape only) and the batches' inputs are of the model's shape there."""
        super().__init__(len(data), batch_size, train, rank, world, seed, order)
        self.images = data.placed_on(device if reads_inputs else torch.device("meta"))
        self.labels = data.labels.to(device)
        self.pre, self.device, self.channels_last = pre, device, channels_last
        self.augment = augment if train else ()
        self.regularise = regularise if train else None

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, from batch number `start` on (for a resumed run)."""
        idx = self._indices(epoch).to(self.device)
        for b in range(start, len(self)):
            batch = idx[b * self.batch_size:(b + 1) * self.batch_size]
            yield self._model_input(self.images[batch.to(self.images.device)], self.labels[batch], epoch, b)

    def empty_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of no samples, shaped like the others."""
        return to_model_input(self.images[:0], self.pre, self.channels_last), self.labels[:0]


class _IndexBatches(torch.utils.data.Sampler):
    """This rank's batches for the current epoch; the epoch is set before each pass (workers persist). With
    `seed_of(epoch, batch)`, each batch comes with the seed its items are read with (see items.SeededItems)."""

    def __init__(self, indices_of_epoch, batch_size: int, seed_of=None):
        self.indices_of_epoch, self.batch_size, self.epoch, self.start = indices_of_epoch, batch_size, 0, 0
        self.seed_of = seed_of

    def __iter__(self):
        indices = self.indices_of_epoch(self.epoch).tolist()
        for start in range(self.start * self.batch_size, len(indices), self.batch_size):
            batch = indices[start:start + self.batch_size]
            yield batch if self.seed_of is None else SeededBatch(self.seed_of(self.epoch, start // self.batch_size),
                                                                 batch)

    def __len__(self) -> int:
        return -(-len(self.indices_of_epoch(self.epoch)) // self.batch_size)


class LoaderBatches(_Shard):
    """A Dataset served by a DataLoader (workers, pinned memory, persistent workers), sharded like DeviceBatches.

    With `pre` set, items are uint8 images (decoded in the workers) and each batch is augmented and normalised on
    the device exactly as DeviceBatches does. With `items` instead, it is a user's Dataset doing its own
    preprocessing: each batch is read with every generator its augmentation draws from seeded for that batch
    (`seed_fn` reaches what scaletrain cannot find), then collated and read into (inputs, labels) by `items`.
    """

    def __init__(self, dataset: Dataset, device: torch.device, batch_size: int, *, train: bool, rank: int,
                 world: int, seed: int, num_workers: int = 2, channels_last: bool = True,
                 pre: Preprocess | None = None, augment: tuple[str, ...] = (), regularise: Regularise | None = None,
                 decode_on_device: bool = False, items: ItemCollate | None = None,
                 seed_fn: Callable[[Dataset, int], None] | None = None, order: SamplerOrder | None = None):
        super().__init__(len(dataset), batch_size, train, rank, world, seed, order)  # type: ignore[arg-type]
        self.device, self.channels_last, self.pre, self.items = device, channels_last, pre, items
        self.files = dataset if decode_on_device else None  # image files whose JPEGs the device decodes
        self.decoder = DeviceDecoder(dataset, device, to_host=self.keeps_pixels) if decode_on_device else None
        if decode_on_device:
            dataset = EncodedFiles(dataset)
        self.augment = augment if train else ()
        self.regularise = regularise if train else None
        loader_options: dict = {}
        if items is not None:
            dataset = SeededItems(dataset, seed_fn)
            self.sampler = _IndexBatches(self._indices, batch_size, lambda epoch, batch: augment_seed(
                seed, rank, epoch, batch) if train else augment_seed(seed, rank, -1, batch))
            # The workers' own seeds are drawn from this generator, not the process's: every batch is seeded anyway
            loader_options["generator"] = torch.Generator().manual_seed(seed)
        else:
            self.sampler = _IndexBatches(self._indices, batch_size)
        # A dataset that reads whole batches (__getitems__, e.g. prepared shards) returns them ready: no collate.
        collate = items if items is not None else _whole_batch if hasattr(dataset, "__getitems__") else \
            encoded_batch if decode_on_device else None
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, num_workers=num_workers, collate_fn=collate,
                                 pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
                                 worker_init_fn=partial(data_worker_start, training_on_cpu=device.type == "cpu"),
                                 **loader_options)
        if items is not None and num_workers > 0:
            # Start the workers now, before the training's collectives: a worker forked while another thread holds
            # Python 3.11's thread-state lock hangs in its fork handler (seen once, forking right after a gloo
            # broadcast). The first pass resets this iterator; the batches it fetched are dropped.
            iter(self.loader)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, from batch number `start` on (for a resumed run)."""
        self.sampler.epoch, self.sampler.start = epoch, start
        with workers_errors():
            yield from self._batches(epoch, start)

    keeps_pixels = False  # whether each batch's decoded images are wanted on the CPU too (FillingBatches)

    def _read(self) -> Iterator[tuple[Any, Any, torch.Tensor | None]]:
        """Each batch as the loader gives it: (inputs on the device, labels as read, the decoded images on the CPU
        when kept). JPEGs streamed for the device are decoded there, a batch ahead."""
        if self.decoder is not None:
            yield from self.decoder.each(self.loader)
            return
        for x, y in self.loader:
            yield x.to(self.device, non_blocking=True), y, x

    def _batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b, (x, y, _) in enumerate(self._read(), start=start):
            y = None if y is None else map_targets(lambda t: t.to(self.device, non_blocking=True),  # None: no labels
                                                   y if self.items is not None else torch.as_tensor(y))
            if self.pre is not None:
                x, y = self._model_input(x, y, epoch, b)
            elif self.channels_last and isinstance(x, torch.Tensor) and x.ndim == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, y

    def close(self) -> None:
        """End the persistent workers now. Left to the garbage collector (the loader sits in reference cycles),
        their queues are finalized before the iterator's shutdown can tell the workers to stop, and the process
        waits 5 s per worker before it ends them."""
        iterator = getattr(getattr(self, "loader", None), "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self.loader._iterator = None

    def empty_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A batch of no samples, shaped like the others."""
        if self.items is not None:
            with kept_global_rng():
                x, y = self.items([self.loader.dataset[0]])
            return empty_like(x).to(self.device), map_targets(lambda t: t[:0].to(self.device), y)
        x, y = (self.files if self.files is not None else self.loader.dataset)[0]
        x, y = torch.as_tensor(x)[None, ...][:0].to(self.device), torch.as_tensor(y)[None, ...][:0]
        if self.pre is not None:
            x = to_model_input(x, self.pre, self.channels_last)
        return x, y.to(self.device)


class FillingBatches(LoaderBatches):
    """Image files wanted in memory but only checked so far (a folder's first run, see ImageFiles.keep): until
    every image has been through a pass, batches stream from DataLoader workers as LoaderBatches makes them, and
    each decoded batch is kept; from then on they are made from memory as DeviceBatches makes them. The batches
    are the same either way, bit for bit; the first step waits for one batch, not for the whole set. Each decoded
    batch also goes to the set's `keep` (the folder's cache) as it passes. With `decode_on_device`, the first pass's
    JPEGs are decoded on the device (see decode.py) and the set is kept as that decoder made it. The set is held
    on the device as it fills: on a GPU the host holds a batch at a time, never the set.

    Not `held` (a set larger than --cache-memory): nothing is held; once the folder's cache has every file's
    pixels on disk (after the first pass of each split), the batches are read from there (StoredPixels), a batch
    at a time, the same bit for bit; without room in the cache every pass decodes again."""

    keeps_pixels = True

    def __init__(self, files: ImageFiles, pre: Preprocess, device: torch.device, batch_size: int, *, train: bool,
                 rank: int, world: int, seed: int, num_workers: int = 2, channels_last: bool = True,
                 augment: tuple[str, ...] = (), regularise: Regularise | None = None,
                 order: SamplerOrder | None = None, decode_on_device: bool = False, held: bool = True):
        common = dict(train=train, rank=rank, world=world, seed=seed, channels_last=channels_last, order=order)
        super().__init__(files, device, batch_size, num_workers=num_workers, pre=pre, augment=augment,
                         regularise=regularise, decode_on_device=decode_on_device, **common)
        self.source = files
        self.pixels = torch.empty((len(files), files.channels, files.size, files.size), dtype=torch.uint8,
                                  device=device) if held else None
        self.filled = torch.zeros(len(files), dtype=torch.bool)
        self.memory: DeviceBatches | LoaderBatches | None = None
        self._later = dict(pre=pre, augment=augment, regularise=regularise, **common)  # how later passes are made
        self._workers = num_workers

    def _make_memory(self) -> DeviceBatches | LoaderBatches | None:
        """The batches of the passes after the first: from the set held on the device, else from the decoded
        pixels the folder's cache has on disk (None while it does not have them all)."""
        files = self.source
        if self.pixels is not None:
            labels = torch.as_tensor(files.labels, dtype=torch.int64)
            return DeviceBatches(ImageSet(self.pixels, labels, files.classes, files.recipe), device=self.device,
                                 batch_size=self.batch_size, **self._later)
        if getattr(files.keep, "path", None) is None:
            return None
        stored = StoredPixels(files.keep.path, files.keep.rows_of(files.paths), files)  # type: ignore[union-attr]
        return LoaderBatches(stored, self.device, self.batch_size, num_workers=self._workers, **self._later)

    def _from_memory(self) -> bool:
        """Whether the batches come from memory (or the disk's decoded pixels) now: once every image was read."""
        if self.memory is None and bool(self.filled.all()):
            self.memory = self._make_memory()
            if self.memory is not None:
                super().close()  # the decoding workers end
                del self.loader
        return self.memory is not None

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._from_memory():
            yield from self.memory.epoch(epoch, start)  # type: ignore[union-attr]
            return
        indices = self._indices(epoch)
        self.sampler.epoch, self.sampler.start = epoch, start
        with workers_errors():  # a file the check passed but that does not decode is refused here, by name
            for b, (x, y, host) in enumerate(self._read(), start=start):
                rows = indices[b * self.batch_size:(b + 1) * self.batch_size]
                if self.pixels is not None:
                    self.pixels[rows.to(self.device)] = x
                self.filled[rows] = True
                if self.source.keep is not None:  # to the folder's cache as it passes: no pass of its own later
                    self.source.keep([self.source.paths[r] for r in rows.tolist()], host.numpy())
                yield self._model_input(x, y.to(self.device, non_blocking=True), epoch, b)
        self._from_memory()

    def close(self) -> None:
        super().close()
        if self.memory is not None:
            self.memory.close()


@contextlib.contextmanager
def workers_errors():
    """A UserError raised in a DataLoader worker (an image file that will not decode) arrives wrapped in the
    worker's traceback text: raise it as the one line it was."""
    try:
        yield
    except UserError as e:
        text = str(e)
        if "DataLoader worker" not in text.split("\n", 1)[0]:
            raise
        raise UserError(text.rstrip().splitlines()[-1].split("UserError: ", 1)[-1], e.quiet) from None


def _whole_batch(batch):
    return batch


def decode_all(files: Dataset, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every item of a uint8 image Dataset once, in DataLoader workers: (images, labels)."""
    loader = DataLoader(files, batch_size=256, num_workers=num_workers)
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


def fits_on_device(nbytes: int, device: torch.device, share: float = 0.25) -> bool:
    """Whether `nbytes` of uint8 data is at most `share` of the device's memory (RAM on the CPU)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return nbytes <= share * total
