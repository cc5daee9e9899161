"""Datasets held in memory as uint8 tensors: where they come from, how they split, how they shard.

Readers return `ImageSet`s (images N x C x H x W uint8, labels int64, class names). Sharding is plain index
arithmetic on (rank, world size); nothing here talks to other processes.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .errors import UserError

DEFAULT_DATA = "default"
IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 2051, 2049
# The embedded default: a fixed, stratified 8,000 / 2,000 split of the 10,000 MNIST test images.
DEFAULT_VAL_SIZE = 2000
DEFAULT_SPLIT_SEED = 20240419


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor  # int64, N
    classes: list[str]

    def __post_init__(self):
        if len(self.images) != len(self.labels):
            raise UserError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.images.shape[-1]

    def subset(self, index: torch.Tensor) -> "ImageSet":
        return ImageSet(self.images[index], self.labels[index], self.classes)

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the pixels scaled to [0, 1] (for normalisation)."""
        x = self.images.to(torch.float64).div_(255).transpose(0, 1).reshape(self.channels, -1)
        return x.mean(1).tolist(), x.std(1).clamp_min(1e-6).tolist()


# -- readers ---------------------------------------------------------------------------------------------------
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


def _idx_pair(images_path: Path, labels_path: Path) -> ImageSet:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise UserError(f"{images_path}: expected an IDX image file")
    if labels.ndim != 1:
        raise UserError(f"{labels_path}: expected an IDX label file")
    if len(images) != len(labels):
        raise UserError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    return _from_arrays(images, labels, str(labels_path))


def _from_arrays(images: np.ndarray, labels: np.ndarray, source: str) -> ImageSet:
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.transpose(0, 3, 1, 2)  # N H W C -> N C H W
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise UserError(f"{source}: images must be N x H x W or N x C x H x W with 1 or 3 channels, "
                        f"got shape {images.shape}")
    if len(images) == 0:
        raise UserError(f"{source}: holds no images")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"{source}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.min() < 0:
        raise UserError(f"{source}: label {labels.min()} is negative")
    if images.dtype != np.uint8:
        raise UserError(f"{source}: images must be uint8 (0-255), got {images.dtype}")
    n_classes = int(labels.max()) + 1
    return ImageSet(torch.from_numpy(np.array(images, copy=True)),
                    torch.from_numpy(labels.astype(np.int64)), [str(i) for i in range(n_classes)])


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).exists():
            return folder / name
    return None


def _read_idx_folder(folder: Path) -> tuple[ImageSet, ImageSet | None]:
    """An MNIST-style folder: train-* (required) and t10k-* (used as the validation set when present)."""
    pairs = {}
    for split in ("train", "t10k"):
        imgs, lbls = _find(folder, f"{split}-images-idx3-ubyte"), _find(folder, f"{split}-labels-idx1-ubyte")
        if imgs and lbls:
            pairs[split] = _idx_pair(imgs, lbls)
    if "train" not in pairs:
        raise UserError(f"{folder}: no train-images-idx3-ubyte[.gz] with train-labels-idx1-ubyte[.gz] found")
    return pairs["train"], pairs.get("t10k")


def _read_npz(path: Path) -> tuple[ImageSet, ImageSet | None]:
    """An .npz with arrays images/labels (or x/y), and optionally val_images/val_labels."""
    try:
        arrays = dict(np.load(path, allow_pickle=False))
    except (OSError, ValueError, zlib.error) as e:
        raise UserError(f"{path}: not a readable .npz file ({e})") from None

    def pick(*names: str) -> np.ndarray | None:
        return next((arrays[n] for n in names if n in arrays), None)

    images, labels = pick("images", "x", "x_train"), pick("labels", "y", "y_train")
    if images is None or labels is None:
        raise UserError(f"{path}: expected arrays 'images' and 'labels', found {sorted(arrays)}")
    if len(images) != len(labels):
        raise UserError(f"{path}: {len(images)} images but {len(labels)} labels")
    train = _from_arrays(images, labels, str(path))
    val_images, val_labels = pick("val_images", "x_val"), pick("val_labels", "y_val")
    val = None
    if val_images is not None and val_labels is not None:
        if len(val_images) != len(val_labels):
            raise UserError(f"{path}: {len(val_images)} validation images but {len(val_labels)} labels")
        val = _from_arrays(val_images, val_labels, f"{path} (validation)")
    return train, val


def embedded_mnist() -> ImageSet:
    """The 10,000 genuine MNIST test images shipped inside the package (CC BY-SA 3.0, see assets)."""
    folder = resources.files("scaletrain") / "assets" / "mnist_t10k"
    with resources.as_file(folder) as path:
        return _idx_pair(Path(path) / "t10k-images-idx3-ubyte.gz", Path(path) / "t10k-labels-idx1-ubyte.gz")


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


def load_image_sets(data: str, val_fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """Read `--data` and return (train, validation)."""
    if data == DEFAULT_DATA:
        full = embedded_mnist()
        train_idx, val_idx = stratified_split(full.labels, DEFAULT_VAL_SIZE, DEFAULT_SPLIT_SEED)
        return full.subset(train_idx), full.subset(val_idx)
    path = Path(data)
    if not path.exists():
        raise UserError(f"--data {data}: no such file or folder")
    if path.is_dir():
        train, val = _read_idx_folder(path)
    elif path.suffix == ".npz":
        train, val = _read_npz(path)
    else:
        raise UserError(f"--data {data}: expected 'default', an MNIST IDX folder or an .npz file")
    if val is None:
        val_count = max(1, round(len(train) * val_fraction))
        if val_count >= len(train):
            raise UserError(f"--data {data}: {len(train)} samples are too few to split off a validation set")
        train_idx, val_idx = stratified_split(train.labels, val_count, seed)
        train, val = train.subset(train_idx), train.subset(val_idx)
    if val.images.shape[1:] != train.images.shape[1:]:
        raise UserError(f"--data {data}: validation images are {tuple(val.images.shape[1:])}, "
                        f"training images {tuple(train.images.shape[1:])}")
    classes = max(train.classes, val.classes, key=len)
    train.classes = val.classes = classes
    return train, val


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
