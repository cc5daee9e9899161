"""Datasets as the training loop sees them: what `--data` names, how it splits, how it shards.

`load_image_sets` returns in-memory `ImageSet`s (uint8 N x C x H x W, int64 labels, class names) or, for image
folders, lazily decoded `ImageFiles`. Sharding is plain index arithmetic on (rank, world size); nothing here
talks to other processes.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .config import DataConfig
from .errors import UserError
from .folder_cache import cache_root
from .prepared import PreparedSet, is_prepared, open_prepared
from .sources import (KAGGLE_CLASSES, PHOTO_MIN_SIDE, ImageFiles, Skipped, download_mnist, idx_pair,
                      is_digits_folder, is_idx_folder, is_image_folder, list_class_folder, looks_like_photos,
                      check_listing, read_digits_csv, read_idx_folder, stored_size)

DEFAULT_DATA = "default"
# torchvision's datasets by name, kept under --cache-dir (see vision_sets.py).
NAMED_SETS = ("cifar10", "cifar100", "fashion_mnist", "kmnist", "svhn")
DEFAULT_FOLDER_SIZE = 224  # image folders are decoded to this square size unless --image-size says otherwise
# The embedded default: a fixed, stratified 8,000 / 2,000 split of the 10,000 MNIST test images.
DEFAULT_VAL_SIZE = 2000
DEFAULT_SPLIT_SEED = 20240419


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor  # int64, N
    classes: list[str]
    recipe: str = ""  # how they become model inputs (see pipeline.Preprocess); "": by the images (digits or photo)

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

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])

    @property
    def nbytes(self) -> int:
        return self.images.numel()

    def subset(self, index: torch.Tensor) -> "ImageSet":
        return ImageSet(self.images[index], self.labels[index], self.classes, self.recipe)

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the pixels scaled to [0, 1] (for normalisation)."""
        x = self.images.to(torch.float64).div_(255).transpose(0, 1).reshape(self.channels, -1)
        return x.mean(1).tolist(), x.std(1).clamp_min(1e-6).tolist()


def mean_std(data, max_samples: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel pixel mean and std in [0, 1]: of every image of a set of at most 64 MiB, else of an evenly spaced
    sample of `max_samples` (the same whether the images are in memory, in files or in shards)."""
    if isinstance(data, ImageSet) and data.nbytes <= 64 << 20:
        return data.mean_std()
    step = 1 if data.nbytes <= 64 << 20 else max(1, len(data) // max_samples)  # the same rule for every kind
    if isinstance(data, ImageSet):
        sample = data.images[::step]
    else:
        sample = torch.stack([data[i][0] for i in range(0, len(data), step)])
    return ImageSet(sample, torch.zeros(len(sample), dtype=torch.int64), data.classes).mean_std()


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


def _arrays_to_set(images: np.ndarray, labels: np.ndarray, source: str, classes: list[str] | None = None) -> ImageSet:
    """uint8 arrays (N x H x W, N x H x W x C or N x C x H x W) and integer labels -> ImageSet."""
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.transpose(0, 3, 1, 2)
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise UserError(f"{source}: images must be N x H x W or N x C x H x W with 1 or 3 channels, "
                        f"got shape {images.shape}")
    if len(images) == 0:
        raise UserError(f"{source}: holds no images")
    if images.dtype != np.uint8:
        raise UserError(f"{source}: images must be uint8 (0-255), got {images.dtype}")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"{source}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise UserError(f"{source}: {len(images)} images but {len(labels)} labels")
    if labels.min() < 0:
        raise UserError(f"{source}: label {labels.min()} at index {int(labels.argmin())} is negative")
    classes = classes or [str(i) for i in range(int(labels.max()) + 1)]
    if labels.max() >= len(classes):
        raise UserError(f"{source}: label {labels.max()} at index {int(labels.argmax())} is out of range "
                        f"0..{len(classes) - 1}")
    return ImageSet(torch.from_numpy(np.array(images, copy=True)), torch.from_numpy(labels.astype(np.int64)),
                    list(classes))


def embedded_mnist() -> ImageSet:
    """The 10,000 genuine MNIST test images shipped inside the package (CC BY-SA 3.0, see assets)."""
    folder = resources.files("scaletrain") / "assets" / "mnist_t10k"
    with resources.as_file(folder) as path:
        images, labels = idx_pair(Path(path) / "t10k-images-idx3-ubyte.gz", Path(path) / "t10k-labels-idx1-ubyte.gz")
    return _arrays_to_set(images, labels, "embedded MNIST")


def detect_format(path: Path) -> str:
    from .hfdata import has_parquet, is_saved_dataset
    from .vision_sets import is_cifar_folder

    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".npz", ".csv", ".parquet"):
            return suffix[1:]
        raise UserError(f"--data {path}: a file must be .npz, .csv or .parquet; folders may hold IDX files, "
                        f"train.csv, a saved Hugging Face dataset, parquet files or class subfolders")
    if is_saved_dataset(path):
        return "hf"
    if is_cifar_folder(path):
        return "cifar"
    if is_idx_folder(path):
        return "idx"
    if is_digits_folder(path):
        return "csv"
    if any(path.glob("*-00000.npy")):
        raise UserError(f"--data {path}: holds shards but no prepared.json: an unfinished `scaletrain prepare`? "
                        f"run it again into an empty folder")
    if has_parquet(path):
        return "parquet"
    if is_image_folder(path):
        return "folder"
    raise UserError(f"--data {path}: found no IDX files, train.csv, saved Hugging Face dataset, parquet files or "
                    f"class subfolders")


def _read_npz(path: Path) -> tuple[ImageSet, ImageSet | None]:
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
    train = _arrays_to_set(images, labels, str(path))
    val_images, val_labels = pick("val_images", "x_val"), pick("val_labels", "y_val")
    if (val_images is None) != (val_labels is None):
        raise UserError(f"{path}: 'val_images' and 'val_labels' must be given together")
    val = None if val_images is None else _arrays_to_set(val_images, val_labels, f"{path} (validation)")
    return train, val


def keep_in_memory(cfg: DataConfig, nbytes: int) -> bool:
    """Whether decoded images of `nbytes` are held in memory (then decoded once, in the check's pass) rather than
    read from their files batch by batch: --data-on-device yes, or auto and at most a quarter of the RAM."""
    if cfg.data_on_device == "auto":
        return nbytes <= 0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cfg.data_on_device == "yes"


def _read_folder(root: Path, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet | ImageFiles,
                                                                                ImageSet | ImageFiles | None]:
    val_dir = next((root / n for n in ("val", "validation") if (root / n).is_dir()), None)
    train_dir = root / "train" if val_dir is not None and (root / "train").is_dir() else root
    listings = [list_class_folder(train_dir)]
    if val_dir is not None:
        listings.append(list_class_folder(val_dir, listings[0].classes))
    recipe = cfg.recipe if cfg.recipe != "auto" else "photo" if looks_like_photos(listings[0].paths) else "digits"
    channels = cfg.channels or 3
    size = stored_size(recipe, cfg.image_size or DEFAULT_FOLDER_SIZE, cfg.crop_pct)
    files = sum(len(part.paths) for part in listings)
    decode = (channels, size, recipe) if keep_in_memory(cfg, files * channels * size * size) else None
    sets: list[ImageSet | ImageFiles] = []
    for listing in listings:
        paths, labels, pixels = check_listing(listing, skipped, cfg.cache_dir, decode)
        classes = listings[0].classes
        sets.append(ImageFiles(paths, np.array(labels), classes, channels, size, recipe) if pixels is None else
                    ImageSet(torch.from_numpy(pixels), torch.tensor(labels, dtype=torch.int64), classes, recipe))
    return sets[0], (sets[1] if len(sets) > 1 else None)


def _read_prepared(location: str, cfg: DataConfig):
    """A prepared dataset (see prepared.py), its shards verified; read into memory when it fits there."""
    train, val = open_prepared(location, cfg.cache_dir)
    if keep_in_memory(cfg, train.nbytes + (val.nbytes if val else 0)):
        return tuple(None if part is None else
                     ImageSet(part.read_all(), torch.from_numpy(part.labels.copy()), part.classes, part.recipe)
                     for part in (train, val))
    return train, val


def _labels_of(data: ImageSet | ImageFiles) -> torch.Tensor:
    return data.labels if isinstance(data, ImageSet) else torch.as_tensor(data.labels)


def _subset(data: ImageSet | ImageFiles, index: torch.Tensor) -> ImageSet | ImageFiles:
    if isinstance(data, ImageSet):
        return data.subset(index)
    idx = index.tolist()
    return ImageFiles([data.paths[i] for i in idx], data.labels[idx], data.classes, data.channels, data.size,
                      data.recipe)


def read_dataset(cfg: DataConfig, skipped: Skipped | None = None) -> tuple[ImageSet | ImageFiles,
                                                                           ImageSet | ImageFiles | None]:
    """Read `--data` as it is: (samples, the explicit validation set or None). Nothing is split off here."""
    data = cfg.data
    if data == DEFAULT_DATA:
        return embedded_mnist(), None
    if data == "mnist":
        folder = cache_root(cfg.cache_dir) / "mnist"
        if cfg.download:
            download_mnist(folder)
        elif not is_idx_folder(folder):
            raise UserError(f"--data mnist: not in {folder} yet; add --download to fetch it (needs internet)")
        return _read(folder, "idx", cfg, skipped)
    if data in NAMED_SETS:
        from .vision_sets import read_named

        return read_named(data, cfg)
    if data.startswith("hf:"):
        from .hfdata import read_hub, to_image_sets

        return to_image_sets(read_hub(data[3:], cfg), cfg, skipped)
    if data.startswith("s3://") or is_prepared(Path(data)):
        return _read_prepared(data, cfg)
    path = Path(data)
    if not path.exists():
        if cfg.data_format == "hf":
            from .hfdata import read_hub, to_image_sets

            return to_image_sets(read_hub(data, cfg), cfg, skipped)
        raise UserError(f"--data {data}: no such file or folder")
    return _read(path, cfg.data_format if cfg.data_format != "auto" else detect_format(path), cfg, skipped)


def load_image_sets(cfg: DataConfig | str = DEFAULT_DATA, val_fraction: float = 0.2, seed: int = 0,
                    skipped: Skipped | None = None) -> tuple[ImageSet | ImageFiles, ImageSet | ImageFiles]:
    """Read `--data` and return (train, validation): in-memory `ImageSet`s, or lazily decoded `ImageFiles`.

    `cfg` is a DataConfig, or just the --data string with the other settings at their defaults. Without an
    explicit validation set, a stratified, seeded `val_fraction` is split off (the embedded default always
    splits the same 8,000 / 2,000 way).
    """
    if isinstance(cfg, str):
        cfg = DataConfig(data=cfg, val_fraction=val_fraction)
    train, val = read_dataset(cfg, skipped)
    if isinstance(train, ImageSet) and not train.recipe:  # arrays; folders chose theirs by their files
        recipe = cfg.recipe
        if recipe == "auto":
            photo = train.channels == 3 and min(train.images.shape[-2:]) >= PHOTO_MIN_SIDE
            recipe = "photo" if photo else "digits"
        for part in (train, val):
            if part is not None:
                part.recipe = recipe
    if cfg.data == DEFAULT_DATA:
        train_idx, val_idx = stratified_split(train.labels, DEFAULT_VAL_SIZE, DEFAULT_SPLIT_SEED)
        return train.subset(train_idx), train.subset(val_idx)
    if val is None:
        val_count = max(1, round(len(train) * cfg.val_fraction))
        if val_count >= len(train):
            raise UserError(f"--data {cfg.data}: {len(train)} samples are too few to split off a validation set")
        train_idx, val_idx = stratified_split(_labels_of(train), val_count, seed)
        train, val = _subset(train, train_idx), _subset(train, val_idx)
    if isinstance(train, ImageSet) and val.images.shape[1:] != train.images.shape[1:]:
        raise UserError(f"--data {cfg.data}: validation images are {tuple(val.images.shape[1:])}, "
                        f"training images {tuple(train.images.shape[1:])}")
    classes = max(train.classes, val.classes, key=len)
    train.classes = val.classes = classes
    return train, val


def concat(a: ImageSet | ImageFiles, b: ImageSet | ImageFiles | None) -> ImageSet | ImageFiles:
    """Two sets of the same kind as one (b may be None)."""
    if b is None:
        return a
    if isinstance(a, PreparedSet):
        raise UserError(f"{a.store.location}: a prepared dataset's splits are scored one at a time: "
                        f"--split train or --split val")
    if isinstance(a, ImageSet):
        if a.images.shape[1:] != b.images.shape[1:]:
            raise UserError(f"images of shape {tuple(a.images.shape[1:])} and {tuple(b.images.shape[1:])} "
                            f"cannot be scored together")
        return ImageSet(torch.cat([a.images, b.images]), torch.cat([a.labels, b.labels]),
                        max(a.classes, b.classes, key=len), a.recipe)
    return ImageFiles(a.paths + b.paths, np.concatenate([a.labels, b.labels]), a.classes, a.channels, a.size,
                      a.recipe)


def _read(path: Path, fmt: str, cfg: DataConfig, skipped: Skipped | None):
    if fmt == "idx":
        splits = read_idx_folder(path)
        if "train" not in splits:  # a folder holding only a test pair is a set of its own
            return _arrays_to_set(*splits["t10k"], str(path / "t10k-*")), None
        val = _arrays_to_set(*splits["t10k"], str(path / "t10k-*")) if "t10k" in splits else None
        return _arrays_to_set(*splits["train"], str(path / "train-*")), val
    if fmt == "csv":
        csv_path = path if path.is_file() else path / "train.csv"
        if not csv_path.is_file():
            raise UserError(f"{path}: no train.csv (Kaggle digit-recognizer layout: train.csv, test.csv)")
        images, labels = read_digits_csv(csv_path, skipped)
        return _arrays_to_set(images, labels, str(csv_path), [str(i) for i in range(KAGGLE_CLASSES)]), None
    if fmt == "folder":
        return _read_folder(path, cfg, skipped)
    if fmt == "npz":
        return _read_npz(path)
    if fmt in ("hf", "parquet"):
        from .hfdata import read_parquet, read_saved, to_image_sets

        if fmt == "hf" and not path.is_dir():
            raise UserError(f"--data {path}: --data-format hf reads a save_to_disk folder or a hub name")
        splits = read_saved(path) if fmt == "hf" else read_parquet(path)
        return to_image_sets(splits, cfg, skipped, path if path.is_dir() else path.parent)
    if fmt == "cifar":
        from .vision_sets import read_cifar

        return read_cifar(path)
    raise UserError(f"--data-format {fmt}: unknown format")


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
