"""Batches made on the device and by a DataLoader: same content, per-rank augmentation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from scaletrain.data.batches import DeviceBatches, LoaderBatches
from scaletrain.data.transforms import Preprocess, augment_batch, augment_seed, to_model_input

CPU = torch.device("cpu")


class _Digits(Dataset):
    """A plain per-sample Dataset over the same images, with the same preprocessing (no augmentation)."""

    def __init__(self, data, pre):
        self.data, self.pre = data, pre

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x = to_model_input(self.data.images[i:i + 1], self.pre, channels_last=False)[0]
        return x, int(self.data.labels[i])


def test_device_and_loader_paths_give_the_same_batches(mnist):
    data = mnist.subset(torch.arange(203))
    pre = Preprocess(1, 28, *data.mean_std())
    for rank in range(2):
        common = dict(train=False, rank=rank, world=2, seed=0, channels_last=False)
        dev = list(DeviceBatches(data, pre, CPU, 32, **common).epoch(0))
        dl = list(LoaderBatches(_Digits(data, pre), CPU, 32, num_workers=0, **common).epoch(0))
        assert len(dev) == len(dl) == 4  # 102 or 101 samples per rank in batches of 32
        for (xa, ya), (xb, yb) in zip(dev, dl):
            assert torch.equal(ya, yb)
            torch.testing.assert_close(xa, xb)


def test_normalisation_uses_the_dataset_statistics(mnist):
    data = mnist.subset(torch.arange(500))
    pre = Preprocess(1, 28, *data.mean_std())
    x = torch.cat([x for x, _ in DeviceBatches(data, pre, CPU, 128, train=False, rank=0, world=1, seed=0)
                   .epoch(0)])
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3


def test_resize_and_channel_conversion(mnist):
    pre = Preprocess(3, 56, [0.5] * 3, [0.5] * 3)
    x = to_model_input(mnist.images[:4], pre, channels_last=True)
    assert x.shape == (4, 3, 56, 56) and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x[:, 0], x[:, 2])


@pytest.fixture(scope="module")
def cropped(mnist):
    """64 copies of one digit, cropped; for each output, the (dy, dx) shift it is, or None."""
    img = mnist.images[:1].float().div(255).expand(64, -1, -1, -1)
    out = augment_batch(img, ("crop",), torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(img[0], (2, 2, 2, 2))
    shifts = {(dy, dx): padded[:, dy:dy + 28, dx:dx + 28] for dy in range(5) for dx in range(5)}
    return [next((s for s, moved in shifts.items() if torch.equal(o, moved)), None) for o in out]


def test_crop_moves_the_digit_by_at_most_2_px_and_fills_the_border_with_zeros(cropped):
    assert None not in cropped, "an output is not a 2-pixel translation of its input"


def test_crop_draws_a_translation_per_sample(cropped):
    assert len(set(cropped)) > 10, "one translation for the whole batch"


def test_augmentation_seeds_differ_for_every_rank_epoch_and_batch():
    seeds = {augment_seed(7, r, e, b) for r in range(4) for e in range(4) for b in range(100)}
    assert len(seeds) == 4 * 4 * 100


def test_augmentation_differs_between_ranks(mnist):
    img = mnist.images[:1].float().div(255).expand(64, -1, -1, -1)
    rank0, rank1 = (augment_batch(img, ("crop", "brightness"),
                                  torch.Generator().manual_seed(augment_seed(1, r, 0, 0))) for r in (0, 1))
    assert not torch.equal(rank0, rank1)


@pytest.fixture
def augmented(mnist):
    return DeviceBatches(mnist.subset(torch.arange(64)), Preprocess(1, 28, [0], [1]), CPU, 64, train=True,
                         rank=0, world=1, seed=1, augment=("crop",), channels_last=False)


def test_augmentation_is_reproducible_for_the_same_epoch(augmented):
    first, again = next(augmented.epoch(0)), next(augmented.epoch(0))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_each_epoch_reshuffles(augmented):
    assert not torch.equal(next(augmented.epoch(0))[1], next(augmented.epoch(1))[1])


def test_starting_mid_epoch_gives_the_batches_of_the_full_pass_from_there_on(mnist):
    many = DeviceBatches(mnist.subset(torch.arange(100)), Preprocess(1, 28, [0], [1]), CPU, 16, train=True,
                         rank=0, world=1, seed=1, augment=("crop", "hflip"), channels_last=False)
    full, tail = list(many.epoch(3)), list(many.epoch(3, start=4))
    assert len(full) == 7 and len(tail) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[4:], tail))


def test_flips_are_exact_mirrors():
    x = torch.arange(16.0).view(1, 1, 4, 4).expand(200, -1, -1, -1)
    out = augment_batch(x, ("hflip",), torch.Generator().manual_seed(0))
    flipped = (out != x).flatten(1).any(1)
    assert 50 < flipped.sum() < 150
    assert torch.equal(out[flipped], x[flipped].flip(-1))
