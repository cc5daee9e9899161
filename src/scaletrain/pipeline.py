"""Batches for the training loop: made on the device from in-memory uint8 images, or by a DataLoader.

`DeviceBatches` moves an `ImageSet` to the device once and builds each batch there (index, augment with
per-sample random parameters in single batched ops, resize, normalise): no workers, no copy per step.
`LoaderBatches` serves any `torch.utils.data.Dataset` through a DataLoader with the same sharding rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from .data import ImageSet, eval_indices, train_indices


@dataclass
class Preprocess:
    """How raw uint8 images become model inputs; saved with the weights so inference needs no flags."""

    channels: int
    image_size: int
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)


def augment_seed(seed: int, rank: int, epoch: int) -> int:
    """The augmentation seed of one rank in one epoch (distinct across ranks and epochs)."""
    return (seed * 1_000_003 + epoch) * 65_537 + rank + 1


def augment_batch(x: torch.Tensor, ops: tuple[str, ...], g: torch.Generator) -> torch.Tensor:
    """Random augmentations of a float batch in [0, 1], each sample with its own parameters."""
    b, c, h, w = x.shape
    dev = x.device

    def coin() -> torch.Tensor:
        return (torch.rand(b, generator=g, device=dev) < 0.5).view(b, 1, 1, 1)

    if "crop" in ops:
        # Random translation by up to ~7% of the side (2 px on 28x28), zero-filled: pad, then one gather.
        # Written by hand because torchvision's RandomCrop draws one offset for the whole batch.
        pad = max(1, round(h / 14))
        xp = F.pad(x, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
        rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
        x = xp[torch.arange(b, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
               rows, cols]
    if "hflip" in ops:
        x = torch.where(coin(), x.flip(-1), x)
    if "vflip" in ops:
        x = torch.where(coin(), x.flip(-2), x)
    if "contrast" in ops:
        alpha = torch.empty(b, 1, 1, 1, device=dev).uniform_(0.8, 1.2, generator=g)
        x = torch.where(coin(), x * alpha, x)
    if "brightness" in ops:
        beta = torch.empty(b, 1, 1, 1, device=dev).uniform_(-0.2, 0.2, generator=g)
        x = torch.where(coin(), x + beta, x)
    if "contrast" in ops or "brightness" in ops:
        x = x.clamp_(0, 1)
    return x


def to_model_input(x_uint8: torch.Tensor, pre: Preprocess, channels_last: bool,
                   ops: tuple[str, ...] = (), g: torch.Generator | None = None) -> torch.Tensor:
    """uint8 N x C x H x W on any device -> normalised float input of the model's size."""
    x = x_uint8.float().div_(255)
    if x.shape[1] != pre.channels:  # grey <-> colour, so a model made for one can read the other
        x = x.mean(1, keepdim=True) if pre.channels == 1 else x.expand(-1, pre.channels, -1, -1)
    if ops:
        x = augment_batch(x, ops, g)
    if x.shape[-1] != pre.image_size or x.shape[-2] != pre.image_size:
        x = F.interpolate(x, size=(pre.image_size, pre.image_size), mode="bicubic", antialias=True,
                          align_corners=False).clamp_(0, 1)
    mean = torch.tensor(pre.mean, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(pre.std, device=x.device).view(1, -1, 1, 1)
    x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


class DeviceBatches:
    """All of an ImageSet on the device; batches of this rank's shard, made there."""

    def __init__(self, data: ImageSet, pre: Preprocess, device: torch.device, batch_size: int, *,
                 train: bool, rank: int, world: int, seed: int, augment: tuple[str, ...] = (),
                 channels_last: bool = True):
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)
        self.pre, self.batch_size, self.train = pre, batch_size, train
        self.rank, self.world, self.seed = rank, world, seed
        self.augment = augment if train else ()
        self.channels_last = channels_last
        self.device = device
        self.indices = self._indices(0)

    def _indices(self, epoch: int) -> torch.Tensor:
        n = len(self.labels)
        if self.train:
            return train_indices(n, self.world, self.rank, self.seed, epoch)
        return eval_indices(n, self.world, self.rank)

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch."""
        return len(self.indices)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self._indices(epoch).to(self.device)
        g = None
        if self.augment:
            # Augmentation differs per rank and per epoch; the shuffle above is shared by all ranks.
            g = torch.Generator(device=self.device)
            g.manual_seed(augment_seed(self.seed, self.rank, epoch))
        for start in range(0, len(idx), self.batch_size):
            batch = idx[start:start + self.batch_size]
            x = to_model_input(self.images[batch], self.pre, self.channels_last, self.augment, g)
            yield x, self.labels[batch]


class _IndexBatches(torch.utils.data.Sampler):
    def __init__(self, indices: torch.Tensor, batch_size: int):
        self.indices, self.batch_size = indices.tolist(), batch_size

    def __iter__(self):
        for start in range(0, len(self.indices), self.batch_size):
            yield self.indices[start:start + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)


class LoaderBatches:
    """A user's Dataset through a DataLoader, sharded exactly like DeviceBatches.

    Items are (input tensor, integer label); the dataset does its own preprocessing and augmentation.
    """

    def __init__(self, dataset: Dataset, device: torch.device, batch_size: int, *, train: bool, rank: int,
                 world: int, seed: int, num_workers: int = 2, channels_last: bool = True):
        self.dataset, self.device, self.batch_size = dataset, device, batch_size
        self.train, self.rank, self.world, self.seed = train, rank, world, seed
        self.num_workers, self.channels_last = num_workers, channels_last
        self.n = len(dataset)  # type: ignore[arg-type]
        self.indices = self._indices(0)

    def _indices(self, epoch: int) -> torch.Tensor:
        if self.train:
            return train_indices(self.n, self.world, self.rank, self.seed, epoch)
        return eval_indices(self.n, self.world, self.rank)

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Workers' random seeds come from this generator: different per rank and per epoch.
        g = torch.Generator().manual_seed(augment_seed(self.seed, self.rank, epoch))
        loader = DataLoader(self.dataset, batch_sampler=_IndexBatches(self._indices(epoch), self.batch_size),
                            num_workers=self.num_workers, pin_memory=self.device.type == "cuda", generator=g)
        for x, y in loader:
            x = x.to(self.device, non_blocking=True)
            if self.channels_last and x.ndim == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, torch.as_tensor(y).to(self.device, non_blocking=True)
