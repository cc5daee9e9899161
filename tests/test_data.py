"""Reading, splitting and sharding data."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from scaletrain.data import eval_indices, load_image_sets, stratified_split, train_indices
from scaletrain.sources import read_idx
from scaletrain.errors import UserError


def test_embedded_default_is_the_genuine_10k_split_8000_2000(mnist):
    assert mnist.images.shape == (10000, 1, 28, 28) and mnist.images.dtype == torch.uint8
    # The first MNIST test digit is a 7, the second a 2 (as in every MNIST distribution).
    assert mnist.labels[:2].tolist() == [7, 2]
    train, val = load_image_sets("default", 0.2, seed=123)
    train2, val2 = load_image_sets("default", 0.2, seed=456)
    assert (len(train), len(val)) == (8000, 2000)
    assert torch.equal(val.labels, val2.labels) and torch.equal(val.images, val2.images), "split ignores --seed"
    # Stratified: each class's share of the validation set is within a sample of its share overall.
    overall = torch.bincount(mnist.labels) / len(mnist)
    in_val = torch.bincount(val.labels, minlength=10)
    assert torch.all((in_val - overall * 2000).abs() <= 1)
    assert train.classes == [str(i) for i in range(10)]


def test_split_is_disjoint_and_complete():
    labels = torch.tensor([0] * 30 + [1] * 10 + [2] * 5)
    tr, va = stratified_split(labels, 9, seed=0)
    assert sorted(torch.cat([tr, va]).tolist()) == list(range(45))
    assert torch.bincount(labels[va]).tolist() == [6, 2, 1]
    tr2, va2 = stratified_split(labels, 9, seed=0)
    assert torch.equal(va, va2)


def _idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(">I" + "I" * len(dims), magic, *dims) + payload


def test_idx_reader_round_trip_and_errors(tmp_path):
    good = tmp_path / "imgs-idx3-ubyte.gz"
    good.write_bytes(gzip.compress(_idx_bytes(2051, (2, 3, 3), bytes(range(18)))))
    assert read_idx(good).shape == (2, 3, 3)

    bad_magic = tmp_path / "bad-magic"
    bad_magic.write_bytes(_idx_bytes(1234, (1,), b"\x00"))
    with pytest.raises(UserError, match=r"bad-magic: bad IDX magic number 1234"):
        read_idx(bad_magic)

    short = tmp_path / "short"
    short.write_bytes(_idx_bytes(2051, (2, 3, 3), bytes(10)))
    with pytest.raises(UserError, match=r"short: header promises 18 bytes of data, file holds 10"):
        read_idx(short)

    truncated = tmp_path / "trunc.gz"
    truncated.write_bytes(good.read_bytes()[:-12])
    with pytest.raises(UserError, match=r"trunc.gz: cannot read IDX data"):
        read_idx(truncated)


def test_idx_folder_uses_t10k_as_validation(tmp_path, mnist):
    def write(name, magic, arr):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(struct.pack(">I" + "I" * arr.ndim, magic, *arr.shape) + arr.tobytes())
    imgs, lbls = mnist.images[:, 0].numpy(), mnist.labels.numpy().astype(np.uint8)
    write("train-images-idx3-ubyte.gz", 2051, imgs[:50])
    write("train-labels-idx1-ubyte.gz", 2049, lbls[:50])
    write("t10k-images-idx3-ubyte.gz", 2051, imgs[50:70])
    write("t10k-labels-idx1-ubyte.gz", 2049, lbls[50:70])
    train, val = load_image_sets(str(tmp_path), 0.2, seed=0)
    assert (len(train), len(val)) == (50, 20)
    assert torch.equal(val.labels, mnist.labels[50:70])

    write("t10k-labels-idx1-ubyte.gz", 2049, lbls[50:69])
    with pytest.raises(UserError, match="holds 20 images but .* holds 19 labels"):
        load_image_sets(str(tmp_path), 0.2, seed=0)


@pytest.mark.parametrize("n", [1, 7, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    shards = [eval_indices(n, world, r) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))


@pytest.mark.parametrize("n", [7, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_shards_share_one_shuffle_and_equal_lengths(n, world):
    shards = [train_indices(n, world, r, seed=5, epoch=0) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "ranks would take different numbers of steps"
    flat = torch.cat(shards).tolist()
    assert len(flat) == len(set(flat)) == n - n % world
    # Rank r holds every world-th element of one shared permutation: batch k of W ranks == batch k of 1 rank.
    single = train_indices(n, 1, 0, seed=5, epoch=0)[: n - n % world]
    assert torch.equal(torch.stack(shards, 1).flatten(), single)
    assert not torch.equal(train_indices(n, world, 0, seed=5, epoch=1), shards[0]), "no reshuffle per epoch"
