"""Datasets users already hold: Hugging Face save_to_disk folders, parquet files and hub names, and torchvision's
named datasets (CIFAR python batches, Fashion-MNIST IDX files), each made small here in its real layout."""

from __future__ import annotations

import gzip
import io
import json
import pickle

import numpy as np
import pytest
from PIL import Image

from helpers import run_cli
from scaletrain.cli import main
from scaletrain.config import DataConfig
from scaletrain.data import load_image_sets
from scaletrain.data import Skipped

CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _colour_images(n: int, side: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n RGB images whose class (0..2) is which channel is bright, so a tiny model can learn them."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 3
    images = rng.integers(0, 60, (n, side, side, 3), dtype=np.uint8)
    images[np.arange(n), :, :, labels] += 150
    return images, labels


def _encoded(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def _train(data, out, *extra: str) -> dict:
    assert main(["train", "--data", str(data), "--model", "tinycnn", "--epochs", "1", "--batch-size", "16",
                 "--output-dir", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def _refused(capsys, *args: str) -> str:
    code = main(["train", *args, "--output-dir", "/nonexistent/never-created"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- Hugging Face ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_dict(tmp_path_factory):
    """A DatasetDict saved to disk: 40 training and 20 test RGB 32x32 images, Image and ClassLabel features."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"img": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["red", "green", "blue"])})
    parts = {}
    for split, n, seed in (("train", 40, 0), ("test", 20, 1)):
        images, labels = _colour_images(n, 32, seed)
        parts[split] = datasets.Dataset.from_dict(
            {"img": [Image.fromarray(a) for a in images], "label": labels.tolist()}, features=features)
    folder = tmp_path_factory.mktemp("hf") / "colours"
    datasets.DatasetDict(parts).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def saved_grey(tmp_path_factory, mnist):
    """A single Dataset saved to disk: 60 grey 28x28 digits, integer labels without class names."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in mnist.images[:60, 0].numpy()],
                                     "label": mnist.labels[:60].tolist()}, features=features)
    folder = tmp_path_factory.mktemp("hf") / "digits"
    ds.save_to_disk(str(folder))
    return folder


def _write_parquet(path, images, labels, fmt="PNG", image="image", label="label"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    blobs = [{"bytes": _encoded(a, fmt), "path": None} for a in images]
    pq.write_table(pa.table({image: blobs, label: pa.array(labels, pa.int64())}), path)


@pytest.fixture
def hub_parquet(tmp_path):
    """The hub's layout: data/train-00000-of-00001.parquet (PNG, 48 rows) and data/validation-... (JPEG, 21)."""
    folder = tmp_path / "hub-colours" / "data"
    folder.mkdir(parents=True)
    images, labels = _colour_images(69, 32, 2)
    _write_parquet(folder / "train-00000-of-00001.parquet", images[:48], labels[:48])
    _write_parquet(folder / "validation-00000-of-00001.parquet", images[48:], labels[48:], fmt="JPEG")
    return folder.parent


def test_a_saved_dataset_dict_trains_with_its_class_names_and_validates_on_its_test_split(saved_dict, tmp_path):
    train, val = load_image_sets(DataConfig(data=str(saved_dict)))
    assert (len(train), len(val)) == (40, 20) and train.classes == ["red", "green", "blue"]
    assert tuple(train.images.shape[1:]) == (3, 32, 32)
    expected, _ = _colour_images(40, 32, 0)
    assert np.array_equal(train.images[5].numpy().transpose(1, 2, 0), expected[5])  # PNG: lossless, same pixels
    summary = _train(saved_dict, tmp_path / "run")
    assert (summary["train_samples"], summary["val_samples"]) == (40, 20)


def test_a_saved_single_dataset_of_grey_digits_splits_off_its_validation_share(saved_grey, mnist):
    train, val = load_image_sets(DataConfig(data=str(saved_grey)))
    assert (len(train), len(val)) == (48, 12) and train.channels == 1 and train.image_size == 28
    assert train.classes == [str(i) for i in range(10)] and train.recipe == "digits"
    assert set(train.images.flatten().tolist()) <= set(mnist.images[:60].flatten().tolist())


def test_hub_parquet_layout_reads_its_splits_and_validates_on_all_of_validation(hub_parquet, tmp_path):
    train, val = load_image_sets(DataConfig(data=str(hub_parquet)))
    assert (len(train), len(val)) == (48, 21) and train.classes == ["0", "1", "2"]
    summary = _train(hub_parquet, tmp_path / "run")
    assert (summary["train_samples"], summary["val_samples"]) == (48, 21)


@pytest.mark.slow
def test_two_processes_validate_on_exactly_every_validation_row(hub_parquet, tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(hub_parquet), "--model", "tinycnn", "--epochs", "1", "--batch-size", "8",
                   "--nproc", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_samples"] == 21


def test_a_single_parquet_file_with_other_column_names(tmp_path, capsys):
    images, labels = _colour_images(30, 32, 3)
    path = tmp_path / "shapes.parquet"
    _write_parquet(path, images, labels, image="picture", label="kind")
    err = _refused(capsys, "--data", str(path))
    assert f"{path}: no label column" in err and "picture (struct" in err and "kind (int64)" in err
    err = _refused(capsys, "--data", str(path), "--label-column", "category")
    assert err == (f"scaletrain: error: --label-column category: {path} has no such column; its columns: "
                   f"picture (struct<bytes: binary, path: null>), kind (int64)")
    train, val = load_image_sets(DataConfig(data=str(path), label_column="kind"))
    assert (len(train), len(val)) == (24, 6)


def test_photos_of_different_sizes_are_brought_to_one_size_by_the_photo_recipe(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(4)
    shapes = [(80, 120), (100, 100), (90, 70)] * 4
    blobs = [{"bytes": _encoded(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "JPEG")} for h, w in shapes]
    pq.write_table(pa.table({"image": blobs, "label": [i % 2 for i in range(12)]}), tmp_path / "train.parquet")
    train, val = load_image_sets(DataConfig(data=str(tmp_path / "train.parquet"), image_size=64))
    assert train.recipe == "photo" and tuple(train.images.shape[1:]) == (3, 73, 73)  # 64 / 0.875, as folders
    assert len(train) + len(val) == 12


def test_a_bad_image_is_named_by_file_split_and_row_or_skipped(hub_parquet, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = hub_parquet / "data" / "train-00000-of-00001.parquet"
    table = pq.read_table(path).to_pydict()
    table["image"][7] = {"bytes": table["image"][7]["bytes"][:-200], "path": None}  # cut short
    pq.write_table(pa.table(table), path)
    err = _refused(capsys, "--data", str(hub_parquet))
    assert f"{path}: split 'train' row 7: corrupt image" in err and "--skip-bad-samples" in err
    skipped = Skipped()
    train, val = load_image_sets(DataConfig(data=str(hub_parquet)), skipped=skipped)
    assert (len(train), len(val)) == (47, 21) and len(skipped.entries) == 1 and "row 7" in skipped.entries[0]


def test_an_unlabelled_test_split_is_not_used_for_validation(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    images, labels = _colour_images(40, 32, 5)
    _write_parquet(folder / "train-00000-of-00001.parquet", images[:30], labels[:30])
    _write_parquet(folder / "test-00000-of-00001.parquet", images[30:], [-1] * 10)
    train, val = load_image_sets(DataConfig(data=str(folder)))
    assert (len(train), len(val)) == (24, 6)  # the stratified --val-fraction split of train


def test_uint8_array_columns_are_images_too(tmp_path, mnist):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pixels = mnist.images[:40, 0].numpy()
    column = pa.array([row.tolist() for row in pixels], pa.list_(pa.list_(pa.uint8())))
    pq.write_table(pa.table({"pixels": column, "target": mnist.labels[:40].numpy()}), tmp_path / "d.parquet")
    train, val = load_image_sets(DataConfig(data=str(tmp_path / "d.parquet")))
    assert len(train) + len(val) == 40 and tuple(train.images.shape[1:]) == (1, 28, 28)


def test_an_unreachable_hub_dataset_says_what_to_fill(tmp_path):
    pytest.importorskip("datasets")
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    proc = run_cli("train", "--data", "hf:someone/no-such-set", "--output-dir", str(tmp_path / "run"), env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "--data hf:someone/no-such-set: cannot load it" in err and str(tmp_path / "hf-cache") in err
    assert "save_to_disk" in err


# -- torchvision's named datasets --------------------------------------------------------------------------------
def _cifar10_layout(folder, per_batch=10):
    """cifar-10-batches-py as the archive lays it out: five training batches, a test batch and batches.meta,
    pickled by protocol 2 with CHW rows of 3072 bytes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(6)
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch).tolist()
        batch = {"batch_label": f"{name} of 5", "labels": labels,
                 "data": rng.integers(0, 255, (per_batch, 3072), dtype=np.uint8),
                 "filenames": [f"img_{i}.png" for i in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {"num_cases_per_batch": per_batch, "label_names": CIFAR_NAMES, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def test_cifar10_by_name_from_the_cache_trains_on_the_official_split(tmp_path):
    _cifar10_layout(tmp_path / "cache" / "torchvision" / "cifar10" / "cifar-10-batches-py")
    train, val = load_image_sets(DataConfig(data="cifar10", cache_dir=str(tmp_path / "cache")))
    assert (len(train), len(val)) == (50, 10) and train.classes == CIFAR_NAMES
    first = pickle.loads((tmp_path / "cache/torchvision/cifar10/cifar-10-batches-py/data_batch_1").read_bytes())
    assert np.array_equal(train.images[0].numpy().reshape(-1), first["data"][0])
    summary = _train("cifar10", tmp_path / "run", "--cache-dir", str(tmp_path / "cache"))
    assert (summary["train_samples"], summary["val_samples"]) == (50, 10)


def test_a_cifar_folder_is_recognised_by_path_and_a_pickle_holding_code_is_refused(tmp_path, capsys):
    folder = _cifar10_layout(tmp_path / "cifar-10-batches-py")
    assert len(load_image_sets(DataConfig(data=str(folder)))[1]) == 10
    (folder / "test_batch").write_bytes(pickle.dumps({"data": print}, protocol=2))
    err = _refused(capsys, "--data", str(folder))
    assert f"{folder / 'test_batch'}: not a CIFAR python batch" in err and "print is not something" in err


def test_fashion_mnist_by_name_reads_the_raw_idx_files_with_its_class_names(tmp_path, mnist):
    raw = tmp_path / "cache" / "torchvision" / "fashion_mnist" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split, part in (("train", slice(0, 60)), ("t10k", slice(60, 80))):
        for kind, magic, arr in (("images-idx3", 2051, mnist.images[part, 0].numpy()),
                                 ("labels-idx1", 2049, mnist.labels[part].numpy().astype(np.uint8))):
            header = np.array([magic, *arr.shape], dtype=">u4").tobytes()
            (raw / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + arr.tobytes()))
    train, val = load_image_sets(DataConfig(data="fashion_mnist", cache_dir=str(tmp_path / "cache")))
    assert (len(train), len(val)) == (60, 20) and train.classes[0] == "T-shirt/top" and train.channels == 1


def test_a_named_dataset_not_yet_there_says_where_to_put_it(tmp_path, capsys):
    err = _refused(capsys, "--data", "kmnist", "--cache-dir", str(tmp_path / "cache"))
    assert f"--data kmnist: not in {tmp_path / 'cache' / 'torchvision' / 'kmnist' / 'KMNIST' / 'raw'} yet" in err
    assert "add --download" in err


def test_svhn_mat_files_become_digits_with_zero_for_ten(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    root = tmp_path / "cache" / "torchvision" / "svhn"
    root.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for name, n in (("train_32x32.mat", 30), ("test_32x32.mat", 10)):
        y = (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)  # 1..10, as SVHN stores them
        scipy_io.savemat(root / name, {"X": rng.integers(0, 255, (32, 32, 3, n), dtype=np.uint8), "y": y})
    train, val = load_image_sets(DataConfig(data="svhn", cache_dir=str(tmp_path / "cache")))
    assert (len(train), len(val)) == (30, 10) and sorted(set(train.labels.tolist())) == list(range(10))
    assert int(train.labels[9]) == 0  # stored as 10
