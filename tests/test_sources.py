"""Which source reads --data: a name wins over --data-format and over a local path of that name, --data-format
wins over detection, and detection goes by what a path holds, not by what it is called."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
from PIL import Image

from scaletrain.config import DataConfig
from scaletrain.data import load_image_sets
from scaletrain.data.read import detect_format
from scaletrain.data.sources import SOURCES, formats, source_for
from scaletrain.errors import UserError


def _class_folder(root, mnist, n=20):
    for i in range(n):
        folder = root / f"class_{int(mnist.labels[i])}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(mnist.images[i, 0].numpy()).save(folder / f"{i}.png")
    return root


def _idx_folder(root, mnist, n=30):
    root.mkdir(parents=True, exist_ok=True)
    images = mnist.images[:n, 0].numpy()
    labels = mnist.labels[:n].numpy().astype(np.uint8)
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(struct.pack(">IIII", 2051, n, 28, 28) +
                                                                   images.tobytes()))
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(struct.pack(">II", 2049, n) + labels.tobytes()))
    return root


@pytest.mark.parametrize("data_format", ["auto", "folder"])
def test_mnist_names_the_cached_download_even_beside_a_local_folder_of_that_name(tmp_path, mnist, monkeypatch,
                                                                                 data_format):
    _class_folder(tmp_path / "mnist", mnist)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--data mnist: not in .*cache.* yet; add --download"):
        load_image_sets(DataConfig(data="mnist", data_format=data_format, cache_dir=str(tmp_path / "cache")))


def test_a_local_folder_is_detected_by_what_it_holds_not_by_its_name(tmp_path, mnist):
    assert detect_format(_class_folder(tmp_path / "cifar10", mnist)) == "folder"
    assert detect_format(_idx_folder(tmp_path / "mnist", mnist)) == "idx"


def test_data_format_overrides_detection(tmp_path, mnist):
    folder = _idx_folder(tmp_path / "digits", mnist)
    assert source_for(str(folder)).FORMAT == "idx"
    with pytest.raises(UserError, match="no class subfolders"):
        load_image_sets(DataConfig(data=str(folder), data_format="folder"))


def test_stray_shards_do_not_hide_a_dataset_and_alone_are_an_unfinished_prepare(tmp_path, mnist):
    folder = _idx_folder(tmp_path / "digits", mnist)
    np.save(folder / "train-00000.npy", np.zeros((1, 1, 28, 28), np.uint8))
    assert detect_format(folder) == "idx"
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "train-00000.npy", np.zeros((1, 1, 28, 28), np.uint8))
    with pytest.raises(UserError, match="holds shards but no prepared.json: an unfinished `scaletrain prepare`"):
        load_image_sets(str(shards))


def test_an_unknown_data_format_is_refused_naming_the_known_ones():
    with pytest.raises(UserError, match=r"--data-format tiff: unknown format; choose from auto, .*folder"):
        load_image_sets(DataConfig(data="default", data_format="tiff"))
    assert formats()[0] == "auto" and set(formats()[1:]) == {s.FORMAT for s in SOURCES if s.FORMAT}
