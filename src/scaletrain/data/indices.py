"""Which samples go where: the seeded, stratified train / validation split, and each rank's share of an epoch.

Plain index arithmetic on (rank, world size, seed, epoch): nothing here talks to other processes, so every rank
computes the same answer on its own.
"""

from __future__ import annotations

import torch


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
def train_indices(n: int, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's training order for an epoch.

    All ranks draw the same permutation (seed + epoch), cut it to a multiple of the world size so every rank
    takes the same number of steps, and take every world-th element: global batch k of a W-process run holds
    the same samples as batch k of one process with a W times larger batch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    usable = n - n % world
    return perm[:usable][rank::world]


def eval_indices(n: int, world: int, rank: int) -> torch.Tensor:
    """This rank's evaluation items: every world-th one, no padding, so every item is counted exactly once."""
    return torch.arange(rank, n, world) if rank < n else torch.arange(0)
