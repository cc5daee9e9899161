"""Reading, splitting and sharding data."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from scaletrain.data import load_image_sets
from scaletrain.data.indices import eval_indices, stratified_split, train_indices
from scaletrain.data.sources.idx import read_idx
from scaletrain.errors import UserError


def test_embedded_digits_are_the_genuine_mnist_test_set(mnist):
    assert mnist.images.shape == (10000, 1, 28, 28) and mnist.images.dtype == torch.uint8
    # The first MNIST test digit is a 7, the second a 2 (as in every MNIST distribution).
    assert mnist.labels[:2].tolist() == [7, 2]
    assert torch.bincount(mnist.labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="module")
def default_split():
    """The default data's split, made with two different --seed values."""
    return load_image_sets("default", 0.2, seed=123), load_image_sets("default", 0.2, seed=456)


def test_default_data_splits_8000_for_training_and_2000_for_validation(default_split):
    (train, val), _ = default_split
    assert (len(train), len(val)) == (8000, 2000)
    assert train.classes == [str(i) for i in range(10)]


def test_default_split_ignores_the_seed(default_split):
    (_, val), (_, val2) = default_split
    assert torch.equal(val.labels, val2.labels) and torch.equal(val.images, val2.images)


def test_default_split_gives_each_class_its_share_of_validation(default_split, mnist):
    """Stratified: each class's share of the validation set is within a sample of its share overall."""
    (_, val), _ = default_split
    overall = torch.bincount(mnist.labels) / len(mnist)
    in_val = torch.bincount(val.labels, minlength=10)
    assert torch.all((in_val - overall * 2000).abs() <= 1)


LABELS = torch.tensor([0] * 30 + [1] * 10 + [2] * 5)


def test_split_is_disjoint_and_complete():
    tr, va = stratified_split(LABELS, 9, seed=0)
    assert len(tr) + len(va) == 45
    assert sorted(torch.cat([tr, va]).tolist()) == list(range(45))


def test_split_takes_each_class_in_proportion():
    _, va = stratified_split(LABELS, 9, seed=0)
    assert torch.bincount(LABELS[va]).tolist() == [6, 2, 1]


def test_split_is_the_same_for_the_same_seed():
    assert torch.equal(stratified_split(LABELS, 9, seed=0)[1], stratified_split(LABELS, 9, seed=0)[1])


def _idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(">I" + "I" * len(dims), magic, *dims) + payload


def test_idx_reader_reads_a_gzipped_file(tmp_path):
    good = tmp_path / "imgs-idx3-ubyte.gz"
    good.write_bytes(gzip.compress(_idx_bytes(2051, (2, 3, 3), bytes(range(18)))))
    assert read_idx(good).tolist() == np.arange(18, dtype=np.uint8).reshape(2, 3, 3).tolist()


@pytest.mark.parametrize("name, content, expected", [
    ("bad-magic", _idx_bytes(1234, (1,), b"\x00"), r"bad-magic: bad IDX magic number 1234"),
    ("short", _idx_bytes(2051, (2, 3, 3), bytes(10)), r"short: header promises 18 bytes of data, file holds 10"),
    # mtime=0: the compressed bytes, and so the test's id, are the same in every xdist worker (pytest-xdist refuses
    # to run when its workers collect different ids, as a gzip header's timestamp a second apart made them)
    ("trunc.gz", gzip.compress(_idx_bytes(2051, (2, 3, 3), bytes(range(18))), mtime=0)[:-12],
     r"trunc.gz: cannot read IDX data"),
], ids=["bad-magic", "short", "trunc.gz"])
def test_idx_reader_refuses_a_bad_file_naming_it(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=expected):
        read_idx(tmp_path / name)


def _write_idx(path, magic, arr):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I" + "I" * arr.ndim, magic, *arr.shape) + arr.tobytes())


@pytest.fixture
def idx_folder(tmp_path, mnist):
    """50 training and 20 t10k digits in MNIST's own file format."""
    imgs, lbls = mnist.images[:, 0].numpy(), mnist.labels.numpy().astype(np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2051, imgs[:50])
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, lbls[:50])
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, imgs[50:70])
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 2049, lbls[50:70])
    return tmp_path


def test_idx_folder_uses_t10k_as_validation(idx_folder, mnist):
    train, val = load_image_sets(str(idx_folder), 0.2, seed=0)
    assert (len(train), len(val)) == (50, 20)
    assert torch.equal(val.labels, mnist.labels[50:70]) and torch.equal(val.images, mnist.images[50:70])


def test_idx_folder_with_fewer_labels_than_images_is_refused(idx_folder, mnist):
    _write_idx(idx_folder / "t10k-labels-idx1-ubyte.gz", 2049, mnist.labels.numpy().astype(np.uint8)[50:69])
    with pytest.raises(UserError, match="holds 20 images but .* holds 19 labels"):
        load_image_sets(str(idx_folder), 0.2, seed=0)


@pytest.mark.parametrize("n", [1, 7, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    shards = [eval_indices(n, world, r) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))


@pytest.mark.parametrize("n", [7, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_shards_have_equal_lengths_and_no_sample_twice(n, world):
    shards = [train_indices(n, world, r, seed=5, epoch=0) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "ranks would take different numbers of steps"
    flat = torch.cat(shards).tolist()
    assert len(flat) == len(set(flat)) == n - n % world


@pytest.mark.parametrize("n", [7, 101, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_shards_are_strides_of_one_shared_shuffle(n, world):
    """Rank r holds every world-th element of one shared permutation: batch k of W ranks == batch k of 1 rank."""
    shards = [train_indices(n, world, r, seed=5, epoch=0) for r in range(world)]
    single = train_indices(n, 1, 0, seed=5, epoch=0)[: n - n % world]
    assert torch.equal(torch.stack(shards, 1).flatten(), single)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_shards_are_reshuffled_each_epoch(world):
    assert not torch.equal(train_indices(1000, world, 0, seed=5, epoch=1), train_indices(1000, world, 0, seed=5,
                                                                                           epoch=0))
