"""Batches for the training loop: made on the device from in-memory uint8 images, or by a DataLoader.

`DeviceBatches` moves an `ImageSet` to the device once and builds each batch there (index, augment with
per-sample random parameters in single batched ops, resize, normalise): no workers, no copy per step.
`LoaderBatches` serves any `torch.utils.data.Dataset` through a DataLoader with the same sharding rules.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from ..parallel.threads import data_worker_start
from .indices import SamplerOrder, eval_indices, train_indices
from .items import ItemCollate, SeededBatch, SeededItems, empty_like, kept_global_rng, map_targets
from .regularise import Regularise, mix
from .transforms import Preprocess, augment_seed, to_model_input
from .types import ImageFiles, ImageSet


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
        self.images = data.images.to(device if reads_inputs else torch.device("meta"))
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


class EncodedFiles(Dataset):
    """Image files whose JPEGs are handed over undecoded, as bytes, for one batched decode on the device; other
    formats are decoded here, as their ImageFiles decodes them. Item i: (bytes or image, label)."""

    def __init__(self, files):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.files.paths[i]
        if path.suffix.lower() in (".jpg", ".jpeg"):
            return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), int(self.files.labels[i])
        return self.files[i]


def _encoded_batch(batch):
    items, labels = zip(*batch)
    return list(items), torch.tensor(labels)


def fit_to_stored(image: torch.Tensor, size: int, recipe: str) -> torch.Tensor:
    """A decoded uint8 C x H x W image brought to the stored size x size on its device, as read_image does on the
    CPU: photo resizes the shorter side (bilinear, antialiased) and keeps the central square; digits resizes the
    whole image (bicubic, antialiased)."""
    x = image[None].float()
    h, w = x.shape[-2:]
    if recipe == "photo":
        scale = size / min(h, w)
        nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        top, left = (nh - size) // 2, (nw - size) // 2
        x = x[..., top:top + size, left:left + size]
    elif (h, w) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return x.round_().clamp_(0, 255)[0].to(torch.uint8)


def decode_on_device(items: list[torch.Tensor], files, device: torch.device) -> torch.Tensor:
    """One batch from EncodedFiles: its JPEGs decoded together by torchvision's decoder on `device` (nvJPEG on a
    GPU), every image brought to the stored size there; N x C x S x S uint8 on the device."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if files.channels == 1 else ImageReadMode.RGB
    jpegs = [k for k, item in enumerate(items) if item.ndim == 1]
    out = [item.to(device, non_blocking=True) if item.ndim == 3 else None for item in items]
    if jpegs:
        for k, image in zip(jpegs, decode_jpeg([items[k] for k in jpegs], mode=mode, device=device)):
            out[k] = fit_to_stored(image, files.size, files.recipe)
    return torch.stack(out)  # type: ignore[arg-type]


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
            _encoded_batch if decode_on_device else None
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

    def _batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b, (x, y) in enumerate(self.loader, start=start):
            x = decode_on_device(x, self.files, self.device) if self.files is not None else \
                x.to(self.device, non_blocking=True)
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
    batch also goes to the set's `keep` (the folder's cache) as it passes."""

    def __init__(self, files: ImageFiles, pre: Preprocess, device: torch.device, batch_size: int, *, train: bool,
                 rank: int, world: int, seed: int, num_workers: int = 2, channels_last: bool = True,
                 augment: tuple[str, ...] = (), regularise: Regularise | None = None,
                 order: SamplerOrder | None = None):
        common = dict(train=train, rank=rank, world=world, seed=seed, channels_last=channels_last, order=order)
        super().__init__(files, device, batch_size, num_workers=num_workers, pre=pre, augment=augment,
                         regularise=regularise, **common)
        self.source = files
        self.pixels = torch.empty((len(files), files.channels, files.size, files.size), dtype=torch.uint8)
        self.filled = torch.zeros(len(files), dtype=torch.bool)
        self.memory: DeviceBatches | None = None
        self._make_memory = lambda: DeviceBatches(
            ImageSet(self.pixels, torch.as_tensor(files.labels, dtype=torch.int64), files.classes, files.recipe),
            pre, device, batch_size, augment=augment, regularise=regularise, **common)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.memory is not None:
            yield from self.memory.epoch(epoch, start)
            return
        indices = self._indices(epoch)
        self.sampler.epoch, self.sampler.start = epoch, start
        with workers_errors():  # a file the check passed but that does not decode is refused here, by name
            for b, (x, y) in enumerate(self.loader, start=start):
                rows = indices[b * self.batch_size:(b + 1) * self.batch_size]
                self.pixels[rows], self.filled[rows] = x, True
                if self.source.keep is not None:  # to the folder's cache as it passes: no pass of its own later
                    self.source.keep([self.source.paths[r] for r in rows.tolist()], x.numpy())
                yield self._model_input(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True),
                                        epoch, b)
        if bool(self.filled.all()):
            self.memory = self._make_memory()
            self.close()  # its persistent workers end
            del self.loader


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
