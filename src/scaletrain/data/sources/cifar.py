"""CIFAR-10 and CIFAR-100 as their python archives extract (`--data-format cifar`): cifar-10-batches-py/ or
cifar-100-python/, the official train / test split becoming train / validation.

The batches are pickles; they are read with an unpickler that accepts only what a CIFAR batch holds (dicts,
lists, strings, numpy arrays), never any other class.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UserError
from ..types import ImageSet, Skipped, arrays_to_set, existing_path

FORMAT = "cifar"


class _ArraysOnly(pickle.Unpickler):
    """Unpickles what a CIFAR batch holds (dicts, lists, strings, numpy arrays) and refuses any other class."""

    ALLOWED = {("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
               ("numpy._core.numeric", "_frombuffer"), ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # how protocol 2 spells bytes under Python 3

    def find_class(self, module: str, name: str):
        if module.startswith("numpy.core"):  # pickles written by numpy 1 name numpy 2's numpy._core
            module = "numpy._core" + module[len("numpy.core"):]
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not something a CIFAR batch holds")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise UserError(f"{path}: not a CIFAR python batch ({e})") from None
    if not isinstance(batch, dict):
        raise UserError(f"{path}: not a CIFAR python batch (holds a {type(batch).__name__}, expected a dict)")
    return batch


def is_cifar_folder(path: Path) -> bool:
    """cifar-10-batches-py/ or cifar-100-python/ as extracted from their archives."""
    return path.is_dir() and ((path / "batches.meta").is_file() or
                              ((path / "meta").is_file() and (path / "train").is_file()))


def _cifar_part(paths: list[Path], key: str):
    images, labels = [], []
    for path in paths:
        batch = _unpickle(path)
        data, lab = batch.get("data"), batch.get(key)
        if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or lab is None:
            raise UserError(f"{path}: expected 'data' (N x 3072 uint8) and '{key}' in a CIFAR batch, found "
                            f"{sorted(batch)}")
        if len(lab) != len(data):
            raise UserError(f"{path}: {len(data)} images but {len(lab)} labels")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(np.asarray(lab, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def read_cifar(folder: Path):
    """(train, validation) `ImageSet`s of an extracted CIFAR-10 or CIFAR-100 python folder."""
    if (folder / "batches.meta").is_file():
        meta, key, names = folder / "batches.meta", "labels", "label_names"
        train_files = sorted(folder.glob("data_batch_*"))
        test_files = [folder / "test_batch"]
    else:
        meta, key, names = folder / "meta", "fine_labels", "fine_label_names"
        train_files, test_files = [folder / "train"], [folder / "test"]
    missing = [p.name for p in (*train_files, *test_files) if not p.is_file()]
    if not train_files or missing:
        raise UserError(f"{folder}: missing {', '.join(missing) or 'data_batch_1..5'} of the CIFAR python layout")
    classes = _unpickle(meta).get(names)
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise UserError(f"{meta}: no list of class names '{names}'")
    return (arrays_to_set(*_cifar_part(train_files, key), str(folder / train_files[0].name), classes),
            arrays_to_set(*_cifar_part(test_files, key), str(test_files[0]), classes))


def named(location: str) -> bool:
    return False


def recognise(path: Path) -> bool:
    return is_cifar_folder(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet]:
    return read_cifar(existing_path(location))
