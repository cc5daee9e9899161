"""NumPy .npz files (`--data-format npz`): arrays `images` and `labels` (or x / y), optionally `val_images` and
`val_labels`; uint8 images N x H x W, N x H x W x C or N x C x H x W. Read without unpickling anything."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UserError
from ..types import ImageSet, Skipped, arrays_to_set, existing_path

FORMAT = "npz"


def read_npz(path: Path) -> tuple[ImageSet, ImageSet | None]:
    """An .npz with arrays images/labels (or x/y), and optionally val_images/val_labels."""
    try:
        arrays = dict(np.load(path, allow_pickle=False))
    except (OSError, ValueError, zlib.error, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .npz file ({e})") from None

    def pick(*names: str) -> np.ndarray | None:
        return next((arrays[n] for n in names if n in arrays), None)

    images, labels = pick("images", "x", "x_train"), pick("labels", "y", "y_train")
    if images is None or labels is None:
        raise UserError(f"{path}: expected arrays 'images' and 'labels', found {sorted(arrays)}")
    train = arrays_to_set(images, labels, str(path))
    val_images, val_labels = pick("val_images", "x_val"), pick("val_labels", "y_val")
    if (val_images is None) != (val_labels is None):
        raise UserError(f"{path}: 'val_images' and 'val_labels' must be given together")
    val = None if val_images is None else arrays_to_set(val_images, val_labels, f"{path} (validation)")
    return train, val


def named(location: str) -> bool:
    return False


def recognise(path: Path) -> bool:
    return path.suffix.lower() == ".npz" and path.is_file()


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet | None]:
    return read_npz(existing_path(location))
