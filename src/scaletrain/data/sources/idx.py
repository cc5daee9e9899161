"""MNIST's IDX files (`--data-format idx`): a folder of train-*/t10k-* image and label files, gzipped or not, and
`--data mnist`, the four original files fetched once into --cache-dir (with --download) and checked by MD5.

A folder holding both splits gives train / validation; one holding only the t10k pair is a set of its own.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UserError
from ..cache import cache_root
from ..types import ImageSet, Skipped, arrays_to_set, existing_path

FORMAT = "idx"
IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 2051, 2049


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (optionally gzip-compressed): uint8 images (N, rows, cols) or labels (N,)."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise UserError(f"{path}: cannot read IDX data ({e})") from None
    if len(raw) < 8:
        raise UserError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    magic, count = struct.unpack(">II", raw[:8])
    if magic == IDX_IMAGES_MAGIC:
        if len(raw) < 16:
            raise UserError(f"{path}: truncated IDX image header")
        rows, cols = struct.unpack(">II", raw[8:16])
        shape, offset = (count, rows, cols), 16
    elif magic == IDX_LABELS_MAGIC:
        shape, offset = (count,), 8
    else:
        raise UserError(f"{path}: bad IDX magic number {magic} (expected {IDX_IMAGES_MAGIC} or {IDX_LABELS_MAGIC})")
    expected = int(np.prod(shape))
    if len(raw) - offset != expected:
        raise UserError(f"{path}: header promises {expected} bytes of data, file holds {len(raw) - offset}")
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(shape)


def idx_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise UserError(f"{images_path}: expected an IDX image file (magic {IDX_IMAGES_MAGIC})")
    if labels.ndim != 1:
        raise UserError(f"{labels_path}: expected an IDX label file (magic {IDX_LABELS_MAGIC})")
    if len(images) != len(labels):
        raise UserError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    return images, labels


def _find(folder: Path, stem: str) -> Path | None:
    return next((folder / n for n in (stem, stem + ".gz") if (folder / n).exists()), None)


def is_idx_folder(folder: Path) -> bool:
    return _find(folder, "train-images-idx3-ubyte") is not None or _find(folder, "t10k-images-idx3-ubyte") is not None


def read_idx_folder(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train': (images, labels), 't10k': ...} for the splits present in an MNIST-style folder."""
    splits = {}
    for split in ("train", "t10k"):
        imgs, lbls = _find(folder, f"{split}-images-idx3-ubyte"), _find(folder, f"{split}-labels-idx1-ubyte")
        if imgs and lbls:
            splits[split] = idx_pair(imgs, lbls)
        elif imgs or lbls:
            missing = f"{split}-labels-idx1-ubyte[.gz]" if imgs else f"{split}-images-idx3-ubyte[.gz]"
            raise UserError(f"{folder}: {(imgs or lbls).name} has no matching {missing}")
    if not splits:
        raise UserError(f"{folder}: no train-images-idx3-ubyte[.gz] with train-labels-idx1-ubyte[.gz] "
                        f"(or a t10k-* pair) found")
    return splits


MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://yann.lecun.com/exdb/mnist/")


MNIST_FILES = {  # name: md5 of the original gzip files
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}


def download_mnist(folder: Path, mirrors: tuple[str, ...] = MNIST_MIRRORS, timeout: float = 60.0) -> Path:
    """Fetch the four original MNIST files into `folder` (checked by md5), skipping those already there."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, md5 in MNIST_FILES.items():
        target = folder / name
        if target.exists() and hashlib.md5(target.read_bytes()).hexdigest() == md5:
            continue
        errors = []
        for mirror in mirrors:
            try:
                with urllib.request.urlopen(mirror + name, timeout=timeout) as response:
                    data = response.read()
            except OSError as e:
                errors.append(f"{mirror}: {e}")
                continue
            if hashlib.md5(data).hexdigest() != md5:
                errors.append(f"{mirror}: checksum mismatch")
                continue
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(target)
            break
        else:
            raise UserError(f"cannot download {name} ({'; '.join(errors)})")
    return folder


def named(location: str) -> bool:
    return location == "mnist"


def recognise(path: Path) -> bool:
    return is_idx_folder(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet | None]:
    if location == "mnist":
        folder = cache_root(cfg.cache_dir) / "mnist"
        if cfg.download:
            download_mnist(folder)
        elif not is_idx_folder(folder):
            raise UserError(f"--data mnist: not in {folder} yet; add --download to fetch it (needs internet)")
        location = str(folder)
    path = existing_path(location)
    splits = read_idx_folder(path)
    if "train" not in splits:  # a folder holding only a test pair is a set of its own
        return arrays_to_set(*splits["t10k"], str(path / "t10k-*")), None
    val = arrays_to_set(*splits["t10k"], str(path / "t10k-*")) if "t10k" in splits else None
    return arrays_to_set(*splits["train"], str(path / "train-*")), val
