"""The data types every layer passes around: `ImageSet` (uint8 images in memory), `ImageFiles` (image files decoded
item by item) and `PreparedSet` (shards read by memory map), with what holds for all of them: labels, subsets,
joining two, the pixel statistics, and whether a set is held in memory.

It sits at the bottom of the data package: the sources read into these types, the batch makers serve them.
"""

from __future__ import annotations

import bisect
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import DataConfig, parse_size
from ..errors import UserError
from ..parallel.threads import usable_cores
from .images import decode_image


@dataclass
class Skipped:
    """Bad samples left out under --skip-bad-samples, one line each: where, and why."""

    entries: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.entries.append(f"{where}: {why}")


def refuse_or_skip(skipped: Skipped | None, where: str, why: str) -> None:
    """Refuse the input, or record the sample as skipped when the user asked for that."""
    if skipped is None:
        raise UserError(f"{where}: {why} (or pass --skip-bad-samples)")
    skipped.add(where, why)


def read_rows(fd: int, into: np.ndarray, at: int, path: Path, last_row: int) -> None:
    """`into` (contiguous) filled from byte `at` of the open file `fd` with pread (no file position: any thread or
    forked process may share `fd`); a file that ends before `last_row` is a UserError naming `path`."""
    view = memoryview(into).cast("B")
    while view:
        n = os.preadv(fd, [view], at)
        if n <= 0:
            raise UserError(f"{path}: ends before row {last_row}; remove it and run again")
        view, at = view[n:], at + n


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor  # int64, N
    classes: list[str]
    recipe: str = ""  # how they become model inputs (see transforms.Preprocess); "": by the images (digits or photo)
    # (file, offset of its first row) where `images` is a memory map of a folder's cached pixels: a GPU reads them
    # from the file a chunk at a time (placed_on), so the map's pages never become the host's resident memory
    mapped: tuple[Path, int] | None = field(default=None, repr=False, compare=False)

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

    def placed_on(self, device: torch.device, chunk: int = 512, force: bool = False) -> torch.Tensor:
        """The images on `device`; mapped from a cache file (and `device` not the CPU, or `force`), read from the
        file `chunk` rows at a time with pread: the host holds one chunk, never the set."""
        if self.mapped is None or (device.type in ("cpu", "meta") and not force):
            return self.images.to(device)
        path, offset = self.mapped
        out = torch.empty(self.images.shape, dtype=torch.uint8, device=device)
        row_bytes = self.images[0].numel()
        buffer = np.empty((chunk, *self.images.shape[1:]), np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            for start in range(0, len(out), chunk):
                rows = min(chunk, len(out) - start)
                read_rows(fd, buffer[:rows], offset + start * row_bytes, path, start + rows - 1)
                out[start:start + rows].copy_(torch.from_numpy(buffer[:rows]))
        finally:
            os.close(fd)
        return out

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the pixels scaled to [0, 1] (for normalisation). A set of more than 64 MiB
        (500 photos kept at 256 px are 94 MiB, 750 MiB as float64, twice that transposed) is summed 64 images at
        a time: the pixels' sums and sums of squares are integers, exact in float64."""
        if self.nbytes <= WHOLE_SET_BYTES:
            x = self.images.to(torch.float64).div_(255).transpose(0, 1).reshape(self.channels, -1)
            return x.mean(1).tolist(), x.std(1).clamp_min(1e-6).tolist()
        total, squares = (torch.zeros(self.channels, dtype=torch.float64) for _ in range(2))
        for chunk in self.images.split(64):
            x = chunk.to(torch.float64).transpose(0, 1).reshape(self.channels, -1)
            total += x.sum(1)
            squares += x.square().sum(1)
        n = self.images.numel() // self.channels
        mean = total / n
        std = ((squares - total * mean) / (n - 1)).clamp_min(0).sqrt()
        return (mean / 255).tolist(), (std / 255).clamp_min(1e-6).tolist()


@dataclass
class ImageFiles(torch.utils.data.Dataset):
    """Image files with integer labels, decoded lazily: item i is (uint8 C x S x S tensor, label).

    Decoding converts to `channels` (1 grey, 3 RGB) and brings the image to `size` x `size` as its `recipe` says
    (see `read_image`), so it can run in DataLoader workers or once up front.
    """

    paths: list[str]  # strings, as a folder's listing makes them (Paths work too)
    labels: np.ndarray
    classes: list[str]
    channels: int
    size: int
    recipe: str = "digits"
    # Set when the files are wanted in memory but were only checked, not decoded (a folder's first run): called
    # with (paths, their decoded pixels) once they are, to keep them for the next run (see sources/folder.py).
    keep: Callable[[list[str], np.ndarray], None] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def wanted_in_memory(self) -> bool:
        """Checked, to be decoded by the first pass and held in memory (else kept decoded on disk only, or not)."""
        return self.keep is not None and getattr(self.keep, "held", True)

    @property
    def image_size(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes the decoded set would take as uint8."""
        return len(self.paths) * self.channels * self.size * self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return decode_image(self.paths[i], self.channels, self.size, self.recipe), int(self.labels[i])

    def decode(self, rows: list[int]) -> torch.Tensor:
        """The images of `rows`, decoded on one thread per usable core (Pillow decodes with the GIL released); those the
        folder's check decoded already (its sample for the statistics) are taken from there, once."""
        done = getattr(self.keep, "sample", {})

        def one(i: int) -> torch.Tensor:
            array = done.pop(os.fspath(self.paths[i]), None)
            return torch.from_numpy(array) if array is not None else decode_image(
                self.paths[i], self.channels, self.size, self.recipe)
        with ThreadPoolExecutor(usable_cores()) as pool:
            images = list(pool.map(one, rows, chunksize=16))
        done.clear()  # used by the first decode (the statistics'), or by none
        return torch.stack(images) if images else torch.empty(0, self.channels, self.size, self.size,
                                                                 dtype=torch.uint8)

    def to_disk(self, chunk: int = 1024) -> None:
        """Every image decoded now, `chunk` at a time, and handed to `keep` (the folder's cache on disk): host
        memory holds one chunk (for several processes, which read a set larger than --cache-memory from there)."""
        for start in range(0, len(self), chunk):
            rows = list(range(start, min(start + chunk, len(self))))
            self.keep([self.paths[i] for i in rows], self.decode(rows).numpy())  # type: ignore[misc]
            if getattr(self.keep, "saved", False):  # all kept, or the cache refused them: no more to decode
                break

    def stored(self) -> "StoredPixels | ImageFiles":
        """The set read from the decoded pixels its `keep` wrote to disk, once they are all there; else itself,
        to be decoded from the files."""
        path = getattr(self.keep, "path", None)
        if path is None:
            return replace(self, keep=None)
        return StoredPixels(path, self.keep.rows_of(self.paths), replace(self, keep=None))  # type: ignore

    def in_memory(self) -> "ImageSet":
        """Every image decoded now, as an ImageSet (and kept for the next run when `keep` is set)."""
        images = self.decode(list(range(len(self))))
        if self.keep is not None:
            self.keep(self.paths, images.numpy())
        return ImageSet(images, torch.as_tensor(self.labels, dtype=torch.int64), self.classes, self.recipe)


class StoredPixels(torch.utils.data.Dataset):
    """Image files' decoded pixels kept on disk (a folder's cache, see cache.py), read a batch at a time: item i is
    (uint8 C x S x S tensor, label). Rows are read with pread into the batch, never memory-mapped, so a process
    holds one batch of them whatever the set's size (the operating system's page cache keeps what it can).
    `rows[i]`: the file's row of item i; `files`: the image files they were decoded from."""

    def __init__(self, path: Path, rows: np.ndarray, files: ImageFiles):
        self.path, self.rows, self.files = Path(path), rows, files
        self.labels, self.classes, self.recipe = files.labels, files.classes, files.recipe
        self.channels, self.size = files.channels, files.size
        self.row_bytes = self.channels * self.size * self.size
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, _, _ = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                           np.lib.format.read_array_header_2_0)(f)
            self.offset = f.tell()
            stat = os.fstat(f.fileno())
        self.identity = (stat.st_ino, stat.st_mtime_ns)  # the file read must be this one (a cache is shared)
        if tuple(shape[1:]) != (self.channels, self.size, self.size) or (len(rows) and rows.max() >= shape[0]):
            raise UserError(f"{self.path}: holds images of shape {tuple(shape)}, not the rows asked for; remove it "
                            f"and run again")
        self._fd: tuple[int, int] | None = None  # (process id, file descriptor): opened by the process reading

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def image_size(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return len(self) * self.row_bytes

    def _file(self) -> int:
        if self._fd is None or self._fd[0] != os.getpid():
            fd = os.open(self.path, os.O_RDONLY)
            stat = os.fstat(fd)
            if (stat.st_ino, stat.st_mtime_ns) != self.identity:
                os.close(fd)
                raise UserError(f"{self.path}: replaced by another run while this one reads it; run again")
            self._fd = (os.getpid(), fd)
        return self._fd[1]

    def __getitems__(self, items: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = np.asarray(items, dtype=np.int64)
        rows = self.rows[items]
        out = np.empty((len(rows), self.channels, self.size, self.size), np.uint8)
        fd = self._file()
        for k in np.argsort(rows, kind="stable"):  # in file order
            read_rows(fd, out[k], self.offset + int(rows[k]) * self.row_bytes, self.path, int(rows[k]))
        return torch.from_numpy(out), torch.as_tensor(self.labels[items])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.__getitems__([i])
        return x[0], int(y[0])

    def subset(self, index: torch.Tensor) -> "StoredPixels":
        idx = index.numpy()
        return StoredPixels(self.path, self.rows[idx], subset_of(self.files, index))

    def __getstate__(self):
        return {**self.__dict__, "_fd": None}


class PreparedSet(torch.utils.data.Dataset):
    """One split of a prepared dataset: item i is (uint8 C x S x S tensor, label), read by memory map.

    `__getitems__` reads a whole batch at once (the DataLoader uses it), one fancy index per shard touched."""

    def __init__(self, store, manifest: dict, split: str):
        self.store, self.split = store, split
        self.shards = manifest["splits"][split]["shards"]
        self.classes, self.recipe = list(manifest["classes"]), manifest["recipe"]
        self.channels, self.size = manifest["channels"], manifest["size"]
        self.starts = np.cumsum([0] + [s["count"] for s in self.shards]).tolist()
        self._arrays: dict[int, np.ndarray] = {}
        self.labels = np.concatenate([np.load(self.store.fetch(s["file"][:-4] + ".labels.npy"))
                                      for s in self.shards]) if self.shards else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def image_size(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return len(self) * self.channels * self.size * self.size

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._arrays:
            self._arrays[k] = np.load(self.store.fetch(self.shards[k]["file"]), mmap_mode="r")
        return self._arrays[k]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        k = bisect.bisect_right(self.starts, i) - 1
        return torch.from_numpy(np.array(self._shard(k)[i - self.starts[k]])), int(self.labels[i])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(index), self.channels, self.size, self.size), np.uint8)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        for k in np.unique(shard).tolist():
            at = np.nonzero(shard == k)[0]
            out[at] = self._shard(k)[index[at] - self.starts[k]]
        return torch.from_numpy(out), torch.from_numpy(self.labels[index])

    def read_all(self) -> torch.Tensor:
        """Every image, N x C x S x S, read shard by shard into one tensor."""
        out = torch.empty((len(self), self.channels, self.size, self.size), dtype=torch.uint8)
        view = out.numpy()
        for k, start in enumerate(self.starts[:-1]):
            view[start:self.starts[k + 1]] = self._shard(k)
        return out

    def __getstate__(self):  # DataLoader workers map the shards themselves
        return {**self.__dict__, "_arrays": {}}


def arrays_to_set(images: np.ndarray, labels: np.ndarray, source: str, classes: list[str] | None = None) -> ImageSet:
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


STATS_SAMPLES = 500  # a large set's normalisation statistics come from about this many evenly spaced images
WHOLE_SET_BYTES = 64 << 20  # a set of at most this many bytes decoded takes its statistics from every image


def small_set(nbytes: int) -> bool:
    """Whether a set of `nbytes` decoded takes its statistics from every image (and is decoded in one pass)."""
    return nbytes <= WHOLE_SET_BYTES


def sample_rows(n: int, nbytes: int, max_samples: int | None = None) -> range:
    """The rows of a set of `n` images (`nbytes` as uint8) its statistics are taken from: all of a set of at most
    64 MiB, else every (n // max_samples)-th (STATS_SAMPLES by default)."""
    return range(0, n, 1 if small_set(nbytes) else max(1, n // (max_samples or STATS_SAMPLES)))


def mean_std(data, max_samples: int | None = None) -> tuple[list[float], list[float]]:
    """Per-channel pixel mean and std in [0, 1]: of every image of a set of at most 64 MiB, else of an evenly spaced
    sample of `max_samples` (the same whether the images are in memory, in files or in shards; streamed data gives
    those its writer measured)."""
    if callable(getattr(data, "stored_mean_std", None)):
        return data.stored_mean_std()
    if isinstance(data, ImageSet) and small_set(data.nbytes):
        return data.mean_std()
    rows = sample_rows(len(data), data.nbytes, max_samples)  # the same rule for every kind
    if isinstance(data, ImageSet):
        sample = data.images[::rows.step]
    elif isinstance(data, ImageFiles):
        sample = data.decode(list(rows))
    else:
        sample = torch.stack([data[i][0] for i in rows])
    return ImageSet(sample, torch.zeros(len(sample), dtype=torch.int64), data.classes).mean_std()


def memory_limit(cfg: DataConfig) -> int:
    """The bytes decoded images may take in host memory: --cache-memory (auto: a quarter of the machine's)."""
    if cfg.cache_memory == "auto":
        return int(0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return parse_size(cfg.cache_memory, "--cache-memory")


def keep_in_memory(cfg: DataConfig, nbytes: int) -> bool:
    """Whether decoded images of `nbytes` are held in memory rather than read batch by batch: --data-on-device
    yes, or auto and within --cache-memory."""
    if cfg.data_on_device == "auto":
        return nbytes <= memory_limit(cfg)
    return cfg.data_on_device == "yes"


def labels_of(data: ImageSet | ImageFiles) -> torch.Tensor:
    return data.labels if isinstance(data, ImageSet) else torch.as_tensor(data.labels)


def subset_of(data: ImageSet | ImageFiles, index: torch.Tensor) -> ImageSet | ImageFiles:
    if isinstance(data, (ImageSet, StoredPixels)):
        return data.subset(index)
    idx = index.tolist()
    return ImageFiles([data.paths[i] for i in idx], data.labels[idx], data.classes, data.channels, data.size,
                      data.recipe, data.keep)


def concat(a: ImageSet | ImageFiles, b: ImageSet | ImageFiles | None) -> ImageSet | ImageFiles:
    """Two sets of the same kind as one (b may be None)."""
    if b is None:
        return a
    if isinstance(a, StoredPixels):  # scored from the files they were decoded from
        a, b = a.files, b.files if isinstance(b, StoredPixels) else b
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
                      a.recipe, a.keep if a.keep is b.keep else None)


def existing_path(location: str) -> Path:
    """--data as a path that exists, or the one-line refusal every source gives."""
    path = Path(location)
    if not path.exists():
        raise UserError(f"--data {location}: no such file or folder")
    return path
