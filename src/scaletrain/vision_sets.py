"""torchvision's datasets by name (`--data cifar10|cifar100|fashion_mnist|kmnist|svhn`): where their files are
kept under --cache-dir, their download through torchvision, and readers for the files as the archives lay them out.

The files are read here rather than through torchvision's dataset classes: those refuse any file whose checksum is
not the official archive's, and unpickle CIFAR batches unrestricted; here a CIFAR batch may hold only arrays, lists
and strings. The official train / test split becomes train / validation.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .config import DataConfig
from .errors import UserError
from .folder_cache import cache_root
from .sources import read_idx_folder

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


# -- CIFAR python pickles --------------------------------------------------------------------------------------
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
    from .data import _arrays_to_set

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
    return (_arrays_to_set(*_cifar_part(train_files, key), str(folder / train_files[0].name), classes),
            _arrays_to_set(*_cifar_part(test_files, key), str(test_files[0]), classes))


# -- SVHN .mat, Fashion-MNIST / KMNIST IDX ---------------------------------------------------------------------
def read_svhn(folder: Path):
    from .data import _arrays_to_set

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
        sets.append(_arrays_to_set(np.ascontiguousarray(images.transpose(3, 2, 0, 1)),
                                   labels.reshape(-1).astype(np.int64) % 10, str(folder / name),
                                   [str(i) for i in range(10)]))
    return sets[0], sets[1]


def read_idx_named(name: str, folder: Path):
    import torchvision.datasets as tvd

    from .data import _arrays_to_set

    classes = list({"fashion_mnist": tvd.FashionMNIST, "kmnist": tvd.KMNIST}[name].classes)
    splits = read_idx_folder(folder)
    return (_arrays_to_set(*splits["train"], str(folder / "train-*"), classes),
            _arrays_to_set(*splits["t10k"], str(folder / "t10k-*"), classes))
