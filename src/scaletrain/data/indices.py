"""Which samples go where: the seeded, stratified train / validation split, each rank's share of an epoch, and an
epoch's order drawn from a user's sampler.

Plain index arithmetic on (rank, world size, seed, epoch): nothing here talks to other processes, so every rank
computes the same answer on its own.
"""

from __future__ import annotations

import operator
import random
from typing import Callable

import numpy as np
import torch

from ..errors import UserError, describe
from .items import kept_global_rng


def stratified_split(labels: torch.Tensor, val_count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val) with each class represented in proportion; deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=g)
    # Sort the shuffled order by class, then deal out every k-th element so each class is cut in proportion.
    by_class = order[torch.sort(labels[order], stable=True).indices]
    rank_in_class = torch.empty(len(labels), dtype=torch.float64)
    counts = torch.bincount(labels)
    start = 0
    for c in counts.tolist():
        rank_in_class[start:start + c] = (torch.arange(c, dtype=torch.float64) + 0.5) / max(c, 1)
        start += c
    # Taking the samples with the lowest fractional rank within the class, across classes, gives proportions.
    pick = torch.argsort(rank_in_class, stable=True)[:val_count]
    is_val = torch.zeros(len(labels), dtype=torch.bool)
    is_val[by_class[pick]] = True
    return torch.nonzero(~is_val).flatten(), torch.nonzero(is_val).flatten()


# -- sharding --------------------------------------------------------------------------------------------------
def train_indices(n: int, world: int, rank: int, seed: int, epoch: int,
                  order: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's training order for an epoch.

    All ranks draw the same order (a permutation seeded by seed and epoch, or `order(epoch)`, a user's sampler's
    draw), cut it to a multiple of the world size so every rank takes the same number of steps, and take every
    world-th element: global batch k of a W-process run holds the same samples as batch k of one process with a W
    times larger batch.
    """
    if order is None:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g)
    else:
        perm = order(epoch)
    usable = len(perm) - len(perm) % world
    return perm[:usable][rank::world]


class SamplerOrder:
    """An epoch's global order drawn from a user's `Sampler` over the dataset's indices (`fit(sampler=...)`): once
    per epoch, with every generator it may draw from seeded from the run's seed and the epoch, so every rank draws
    the same sequence (then shared out by train_indices) and a resumed run draws what the interrupted one drew.

    What is seeded: the sampler's own `generator` attribute when it has one (WeightedRandomSampler, RandomSampler,
    SubsetRandomSampler), else torch's, NumPy's and Python's global generators, restored afterwards."""

    def __init__(self, sampler, n: int, seed: int, where: str = "sampler"):
        if isinstance(sampler, torch.utils.data.BatchSampler) or not hasattr(sampler, "__iter__"):
            raise UserError(f"{where}: expected a Sampler of dataset indices, got {describe(sampler)} (a batch "
                            f"sampler is not taken: the batch is --batch-size, shared among the processes)")
        try:
            self.length = len(sampler)
        except TypeError:
            raise UserError(f"{where}: {type(sampler).__name__} has no len(); the epoch's length must be known "
                            f"before it starts") from None
        self.sampler, self.n, self.seed, self.where = sampler, n, seed, where
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def __call__(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            self._order, self._epoch = self._draw(epoch), epoch
        return self._order

    def _draw(self, epoch: int) -> torch.Tensor:
        seed = (self.seed * 1_000_003 + epoch) % 2**63
        own = getattr(self.sampler, "generator", None)
        with kept_global_rng():
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            if isinstance(own, torch.Generator):
                self.sampler.generator = torch.Generator().manual_seed(seed)
            try:
                drawn = list(iter(self.sampler))
            finally:
                if isinstance(own, torch.Generator):
                    self.sampler.generator = own
        try:
            order = torch.as_tensor([operator.index(i) for i in drawn], dtype=torch.int64)
        except TypeError:
            bad = next(i for i in drawn if not _is_index(i))
            raise UserError(f"{self.where}: yielded {describe(bad)}; expected dataset indices (int), one at a time "
                            f"(a batch sampler is not taken)") from None
        if len(order) != self.length:
            raise UserError(f"{self.where}: len() says {self.length} indices, epoch {epoch + 1} drew {len(order)}")
        if len(order) and not (0 <= int(order.min()) and int(order.max()) < self.n):
            bad = int(order.max()) if int(order.max()) >= self.n else int(order.min())
            raise UserError(f"{self.where}: drew index {bad}; the training set has indices 0..{self.n - 1}")
        return order


def eval_indices(n: int, world: int, rank: int) -> torch.Tensor:
    """This rank's evaluation items: every world-th one, no padding, so every item is counted exactly once."""
    return torch.arange(rank, n, world) if rank < n else torch.arange(0)


def _is_index(value) -> bool:
    try:
        operator.index(value)
        return True
    except TypeError:
        return False
