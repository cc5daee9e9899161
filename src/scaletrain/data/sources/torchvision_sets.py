"""torchvision's datasets by name (`--data cifar10|cifar100|fashion_mnist|kmnist|svhn`): where their files are
kept under --cache-dir, their download through torchvision, and readers for SVHN's .mat files and the IDX files of
Fashion-MNIST and KMNIST (CIFAR's batches are read by cifar.py).

The files are read here rather than through torchvision's dataset classes: those refuse any file whose checksum is
not the official archive's, and unpickle CIFAR batches unrestricted. The official train / test split becomes
train / validation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UserError
from ..cache import cache_root
from ..types import ImageSet, Skipped, arrays_to_set
from .cifar import read_cifar
from .idx import read_idx_folder

FORMAT = ""  # named by --data alone
NAMES = ("cifar10", "cifar100", "fashion_mnist", "kmnist", "svhn")


CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
                 "batches.meta")


CIFAR100_FILES = ("train", "test", "meta")


IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


# name: (folder under the dataset's cache folder, the files there, the archive or site they come from)
LAYOUTS = {
    "cifar10": ("cifar-10-batches-py", CIFAR10_FILES, "cifar-10-python.tar.gz"),
    "cifar100": ("cifar-100-python", CIFAR100_FILES, "cifar-100-python.tar.gz"),
    "fashion_mnist": ("FashionMNIST/raw", IDX_FILES, "Fashion-MNIST's four IDX files, .gz or not"),
    "kmnist": ("KMNIST/raw", IDX_FILES, "KMNIST's four IDX files, .gz or not"),
    "svhn": (".", ("train_32x32.mat", "test_32x32.mat"), "SVHN's cropped-digits format 2"),
}


def named_folder(name: str, cfg: DataConfig) -> Path:
    return cache_root(cfg.cache_dir) / "torchvision" / name


def _present(folder: Path, files: tuple[str, ...]) -> list[str]:
    """The files of `files` missing from `folder` (an IDX file may also be there gzipped)."""
    return [f for f in files if not (folder / f).is_file() and not (folder / (f + ".gz")).is_file()]


def download(name: str, root: Path) -> None:
    """Fetch a named dataset into `root` with torchvision's own download code (checksums verified)."""
    import torchvision.datasets as tvd

    root.mkdir(parents=True, exist_ok=True)
    try:
        if name == "svhn":
            for split in ("train", "test"):
                tvd.utils.download_url(tvd.SVHN.split_list[split][0], str(root), tvd.SVHN.split_list[split][1],
                                       tvd.SVHN.split_list[split][2])
        else:
            cls = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "fashion_mnist": tvd.FashionMNIST,
                   "kmnist": tvd.KMNIST}[name]
            cls(str(root), train=True, download=True)
    except (OSError, RuntimeError, ValueError) as e:
        folder, files, origin = LAYOUTS[name]
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"--data {name} --download: cannot download it ({why}); put {', '.join(files)} ({origin}) "
                        f"into {root / folder} instead") from None


def read_named(name: str, cfg: DataConfig):
    """(train, validation) of a named dataset from --cache-dir, downloaded first with --download."""
    root = named_folder(name, cfg)
    folder, files, origin = LAYOUTS[name]
    missing = _present(root / folder, files)
    if missing and cfg.download:
        download(name, root)
        missing = _present(root / folder, files)
    if missing:
        raise UserError(f"--data {name}: not in {root / folder} yet (missing {', '.join(missing)}); put the files "
                        f"of {origin} there, or add --download (needs internet)")
    if name in ("cifar10", "cifar100"):
        return read_cifar(root / folder)
    if name == "svhn":
        return read_svhn(root)
    return read_idx_named(name, root / folder)


def read_svhn(folder: Path):
    try:
        from scipy.io import loadmat
    except ImportError:
        raise UserError("--data svhn: reading SVHN's .mat files needs scipy: pip install 'scaletrain[svhn]'") from None
    sets = []
    for name in ("train_32x32.mat", "test_32x32.mat"):
        try:
            mat = loadmat(folder / name)
            images, labels = mat["X"], mat["y"]
        except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as e:
            raise UserError(f"{folder / name}: not an SVHN .mat file with X and y ({e})") from None
        if images.ndim != 4 or images.shape[:3] != (32, 32, 3):
            raise UserError(f"{folder / name}: X is {images.shape}, expected 32 x 32 x 3 x N")
        # SVHN labels the digit 0 as 10.
        sets.append(arrays_to_set(np.ascontiguousarray(images.transpose(3, 2, 0, 1)),
                                   labels.reshape(-1).astype(np.int64) % 10, str(folder / name),
                                   [str(i) for i in range(10)]))
    return sets[0], sets[1]


def read_idx_named(name: str, folder: Path):
    import torchvision.datasets as tvd

    classes = list({"fashion_mnist": tvd.FashionMNIST, "kmnist": tvd.KMNIST}[name].classes)
    splits = read_idx_folder(folder)
    return (arrays_to_set(*splits["train"], str(folder / "train-*"), classes),
            arrays_to_set(*splits["t10k"], str(folder / "t10k-*"), classes))


def named(location: str) -> bool:
    return location in NAMES


def recognise(path: Path) -> bool:
    return False


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet]:
    return read_named(location, cfg)
