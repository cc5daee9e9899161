"""The data the benchmarks make: the embedded digits as an .npz or as a Kaggle digit-recognizer folder, random
images of any size, and folders of photo-like JPEGs. Each is made once and reused when already there."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

CLASSES = 10


def _digits(count: int | None = None, shuffle: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The embedded digits (N x 28 x 28 uint8, labels), the first `count` (of a fixed shuffle with `shuffle`)."""
    from scaletrain.data import embedded_mnist

    m = embedded_mnist()
    x, y = m.images[:, 0].numpy(), m.labels.numpy()
    order = np.random.default_rng(0).permutation(len(y)) if shuffle else np.arange(len(y))
    return x[order[:count]], y[order[:count]]


def digits_npz(path: Path, n_train: int, n_val: int) -> Path:
    """The first n_train + n_val embedded digits as an .npz that `train --data` reads."""
    if not path.is_file():
        x, y = _digits(n_train + n_val)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, images=x[:n_train], labels=y[:n_train], val_images=x[n_train:], val_labels=y[n_train:])
    return path


def kaggle_digits(folder: Path, count: int | None = None) -> Path:
    """The embedded digits (`count` of them, shuffled) as a Kaggle digit-recognizer folder (train.csv 80 %,
    test.csv 20 %, sample_submission.csv), the format seed 000's script reads."""
    if (folder / "sample_submission.csv").exists():
        return folder
    x, y = _digits(count, shuffle=True)
    x = x.reshape(len(y), -1)
    n = len(y) * 4 // 5
    folder.mkdir(parents=True, exist_ok=True)
    pixels = ",".join(f"pixel{i}" for i in range(x.shape[1]))
    np.savetxt(folder / "train.csv", np.column_stack([y[:n], x[:n]]), fmt="%d", delimiter=",",
               header="label," + pixels, comments="")
    np.savetxt(folder / "test.csv", x[n:], fmt="%d", delimiter=",", header=pixels, comments="")
    ids = np.arange(1, len(y) - n + 1)
    np.savetxt(folder / "sample_submission.csv", np.column_stack([ids, 0 * ids]), fmt="%d", delimiter=",",
               header="ImageId,Label", comments="")
    return folder


def random_images_npz(path: Path, n: int, size: int, n_val: int) -> Path:
    """Random uint8 colour images (N x size x size x 3) and labels of 10 classes: for throughput, where the
    content does not matter."""
    if not path.exists():
        rng = np.random.default_rng(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, images=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
                 labels=rng.integers(0, CLASSES, n), val_images=rng.integers(0, 256, (n_val, size, size, 3),
                                                                              dtype=np.uint8),
                 val_labels=rng.integers(0, CLASSES, n_val))
    return path


def photo(seed: int, label: int, width: int = 400, height: int = 300) -> np.ndarray:
    """A photo-like RGB image: a smooth colour field tinted by the class, a few hard-edged shapes, and grain."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, (6, 8, 3))
    small[..., label % 3] = 0.6 * small[..., label % 3] + 100  # the class shows in the colour balance
    field = np.kron(small, np.ones((height // 6 + 1, width // 8 + 1, 1)))[:height, :width]
    y, x = np.mgrid[:height, :width]
    for _ in range(4):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(15, 80)
        field[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    field += rng.normal(0, 14, field.shape)  # sensor grain: what makes photos cost bytes
    return np.clip(field, 0, 255).astype(np.uint8)


def _write_photo(job: tuple[Path, int, int, int, int]) -> int:
    from PIL import Image, ImageFilter

    path, seed, label, width, height = job
    Image.fromarray(photo(seed, label, width, height)).filter(ImageFilter.GaussianBlur(0.5)).save(path, quality=90)
    return path.stat().st_size


def photo_folder(root: Path, files: int, size: tuple[int, int] = (400, 300), val_fraction: float = 0.2) -> dict:
    """`files` photo-like JPEGs of `size` (width, height, quality 90: about ImageNet's shape and bytes) in
    root/train/<class>/ and root/val/<class>/; kept and reused when already complete. Returns what was made."""
    stamp = root / "made.json"
    if stamp.is_file():
        made = json.loads(stamp.read_text())
        if made.get("files") == files and tuple(made.get("size", (400, 300))) == tuple(size):
            return made
    jobs = []
    for i in range(files):
        split = "val" if (i // CLASSES) % round(1 / val_fraction) == 0 else "train"
        folder = root / split / f"class_{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((folder / f"{i:07d}.jpg", i, i % CLASSES, *size))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        sizes = list(pool.map(_write_photo, jobs, chunksize=64))
    made = {"files": files, "size": list(size), "train": sum(1 for j in jobs if j[0].parts[-3] == "train"),
            "mean_kb": sum(sizes) / len(sizes) / 1024, "seconds_to_make": time.perf_counter() - t0}
    stamp.write_text(json.dumps(made))
    return made


def warm(root: Path, pattern: str = "*.jpg") -> float:
    """Read every file once, so that every contender finds the page cache warm; the MB read."""
    return sum(len(p.read_bytes()) for p in root.rglob(pattern)) / 1e6
