"""Readers for the formats users bring: MNIST IDX folders (and their download), Kaggle digit-recognizer CSVs,
folders of images with one subfolder per class, and .npz arrays.

Every reader checks its input before a run can start and reports the first problem on one line naming the file
and row; with `skip_bad` it instead leaves bad rows or files out and lists them in a `Skipped` record.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import math
import os
import stat
import struct
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import UserError

IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 2051, 2049
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
# Larger images are refused: decoding one would take gigabytes (a decompression bomb, or a mistake).
MAX_IMAGE_PIXELS = 64_000_000
KAGGLE_SIDE = 28
KAGGLE_CLASSES = 10


@dataclass
class Skipped:
    """Bad samples left out under --skip-bad-samples, one line each: where, and why."""

    entries: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.entries.append(f"{where}: {why}")


def _bad(skipped: Skipped | None, where: str, why: str) -> None:
    """Refuse the input, or record the sample as skipped when the user asked for that."""
    if skipped is None:
        raise UserError(f"{where}: {why} (or pass --skip-bad-samples)")
    skipped.add(where, why)


# -- MNIST IDX -------------------------------------------------------------------------------------------------
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


# -- Kaggle digit-recognizer CSV -------------------------------------------------------------------------------
def read_digits_csv(path: Path, skipped: Skipped | None = None, labelled: bool = True) -> tuple[np.ndarray,
                                                                                                np.ndarray | None]:
    """train.csv (label, pixel0..pixel783) or test.csv (pixel0..pixel783): uint8 images N x 28 x 28 and labels.

    Rows are numbered as a spreadsheet shows them: the header is row 1, the first image row 2.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        raise UserError(f"{path}: empty file (expected a header row)")
    header = [h.strip() for h in rows[0]]
    pixels = KAGGLE_SIDE * KAGGLE_SIDE
    if labelled and "label" not in header:
        raise UserError(f"{path}: row 1: no 'label' column in the header")
    label_col = header.index("label") if "label" in header else None
    width = pixels + (label_col is not None)
    if len(header) != width:
        raise UserError(f"{path}: row 1: header has {len(header)} columns, expected {width} "
                        f"({'label, ' if label_col is not None else ''}pixel0..pixel{pixels - 1})")
    body = rows[1:]
    if not body:
        raise UserError(f"{path}: holds a header but no images")
    try:  # the fast path; on any failure, the row-by-row pass below finds and names the bad row
        values = np.array(body, dtype=np.int64)
        ok = values.ndim == 2 and values.shape[1] == width and 0 <= values.min()
        if ok and label_col is not None:
            pix = np.delete(values, label_col, axis=1)
            ok = pix.max() <= 255 and values[:, label_col].max() < KAGGLE_CLASSES
        elif ok:
            ok = values.max() <= 255
    except ValueError:
        ok = False
    if not ok:
        good = []
        for i, row in enumerate(body, start=2):
            why = _digits_row_problem(row, width, label_col)
            if why:
                _bad(skipped, f"{path}: row {i}", why)
            else:
                good.append(row)
        if not good:
            raise UserError(f"{path}: no valid rows left")
        values = np.array(good, dtype=np.int64)
    labels = values[:, label_col] if label_col is not None else None
    pix = np.delete(values, label_col, axis=1) if label_col is not None else values
    return pix.astype(np.uint8).reshape(-1, KAGGLE_SIDE, KAGGLE_SIDE), labels


def _digits_row_problem(row: list[str], width: int, label_col: int | None) -> str | None:
    if len(row) != width:
        return f"{len(row)} fields, expected {width}"
    for j, cell in enumerate(row):
        try:
            v = int(cell)
        except ValueError:
            what = "label" if j == label_col else f"pixel{j - (label_col is not None and j > label_col)}"
            return f"{what} '{cell}' is not an integer"
        if j == label_col:
            if not 0 <= v < KAGGLE_CLASSES:
                return f"label {v} is outside 0..{KAGGLE_CLASSES - 1}"
        elif not 0 <= v <= 255:
            return f"pixel{j - (label_col is not None and j > label_col)} value {v} is outside 0..255"
    return None


def is_digits_folder(folder: Path) -> bool:
    return (folder / "train.csv").is_file() or (folder / "test.csv").is_file()


# -- image folders ---------------------------------------------------------------------------------------------
@dataclass
class ImageFiles(torch.utils.data.Dataset):
    """Image files with integer labels, decoded lazily: item i is (uint8 C x S x S tensor, label).

    Decoding converts to `channels` (1 grey, 3 RGB) and brings the image to `size` x `size` as its `recipe` says
    (see `read_image`), so it can run in DataLoader workers or once up front.
    """

    paths: list[Path]
    labels: np.ndarray
    classes: list[str]
    channels: int
    size: int
    recipe: str = "digits"

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def image_size(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes the decoded set would take as uint8."""
        return len(self.paths) * self.channels * self.size * self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return decode_image(self.paths[i], self.channels, self.size, self.recipe), int(self.labels[i])


def read_image(path: Path | bytes, channels: int = 0, size: int = 0, recipe: str = "digits") -> tuple[
        np.ndarray | None, str | None]:
    """(pixels, None) or (None, why the file cannot be used); never raises for a bad file.

    The size is read from the header before anything is decoded (a decompression bomb is refused unread); then
    the image is decoded once, so a truncated or corrupt file is found before training, not during it. JPEGs are
    decoded at a reduced scale where that is enough (DCT scaling still reads every byte of the scan, so a file cut
    short is still found). With channels 0 the file is only checked (at 1/8 scale); else it is converted to
    `channels` and brought to size x size: digits resize the whole image (Lanczos); photo resizes the shorter side
    to `size` keeping the aspect ratio and keeps the central square (bilinear, as timm's evaluation resize); size 0
    keeps the image's own size. `path` may also be the bytes of an encoded image (an image column of a table).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        if (len(path) if isinstance(path, bytes) else path.stat().st_size) == 0:
            return None, "empty file"
        with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                return None, f"{w}x{h} pixels is larger than the safe limit of {MAX_IMAGE_PIXELS} pixels"
            mode = "L" if channels == 1 else "RGB"
            if not channels:
                if img.format == "JPEG":
                    img.draft(img.mode, (max(1, w // 8), max(1, h // 8)))
                img.load()
                return None, None
            if not size:
                img = img.convert(mode)
            elif recipe == "photo":
                scale = size / min(w, h)
                if img.format == "JPEG" and scale < 1:  # decode at the smallest DCT scale still >= the target
                    img.draft(mode, (math.ceil(w * scale), math.ceil(h * scale)))
                img = img.convert(mode)
                dw, dh = img.size  # after draft
                side = min(dw, dh)
                box = ((dw - side) / 2, (dh - side) / 2, (dw + side) / 2, (dh + side) / 2)
                if (dw, dh) != (size, size):
                    img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
            else:
                img = img.convert(mode)
                if img.size != (size, size):
                    img = img.resize((size, size), Image.Resampling.LANCZOS)
            array = np.array(img, dtype=np.uint8)  # a writable copy
    except UnidentifiedImageError:
        return None, "not an image file (format not recognised)"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return None, f"corrupt image ({e})"
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)), None


def decode_image(path: Path, channels: int, size: int, recipe: str = "digits") -> torch.Tensor:
    """uint8 C x size x size, as `read_image` makes it; a bad file is a UserError naming it."""
    array, why = read_image(path, channels, size, recipe)
    if array is None:
        raise UserError(f"{path}: cannot decode image ({why})")
    return torch.from_numpy(np.ascontiguousarray(array))


@dataclass
class Listing:
    """The image files of root/<class>/<image>, in folder order, with their labels and (size, mtime_ns)."""

    root: Path
    classes: list[str]
    folders: list[Path]
    paths: list[Path]
    labels: list[int]
    stats: list[tuple[int, int]]


def list_class_folder(root: Path, classes: list[str] | None = None) -> Listing:
    """The files of root/<class>/<image>; `classes` fixes the class order (e.g. from the training set)."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise UserError(f"{root}: no class subfolders (expected {root}/<class name>/<images>)")
    names = [f.name for f in folders]
    if classes is None:
        classes = names
    else:
        extra = sorted(set(names) - set(classes))
        if extra:
            raise UserError(f"{root}/{extra[0]}: class not present in the training set")
    listing = Listing(root, classes, folders, [], [], [])
    for folder in folders:
        label = classes.index(folder.name)
        for path, st in image_files_under(folder):
            listing.paths.append(path)
            listing.labels.append(label)
            listing.stats.append((st.st_size, st.st_mtime_ns))
    return listing


def image_files_under(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """Regular image files anywhere under `folder`, sorted by path, with their stat (one scandir per folder)."""
    return [(Path(path), st) for path, st in sorted(_scan(str(folder)), key=lambda item: Path(item[0]).parts)]


def _scan(folder: str) -> list[tuple[str, os.stat_result]]:
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                found += _scan(entry.path)
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES:
                st = entry.stat()
                if stat.S_ISREG(st.st_mode):
                    found.append((entry.path, st))
    return found


def check_listing(listing: Listing, skipped: Skipped | None, cache_dir: str | None = None,
                  decode: tuple[int, int, str] | None = None) -> tuple[list[Path], list[int], np.ndarray | None]:
    """Check every file of a listing once: (usable paths, their labels, and with `decode` = (channels, size,
    recipe) their pixels, N x C x S x S uint8, from the same single pass that checked them).

    Files the folder's cache (see folder_cache.py) knows unchanged are not checked again; without `decode`
    nothing of theirs is read. Files are read on one thread per core (Pillow decodes with the GIL released).
    Bad files are reported in folder order: the first one refused by name, or all skipped with `skipped`.
    """
    from .folder_cache import FolderCache

    cache = FolderCache(listing.root, cache_dir)
    prefix = len(str(listing.root).rstrip(os.sep)) + 1
    rels = [str(p)[prefix:] for p in listing.paths]  # the listing's paths all start with its root
    n = len(rels)
    whys: list[str | None] = [None] * n
    todo = []
    for i, (rel, st) in enumerate(zip(rels, listing.stats)):
        known, why = cache.lookup(rel, st)
        if known and (why is not None or decode is None):
            whys[i] = why
        else:
            todo.append(i)
    pixels = None
    if decode is not None:
        channels, size, recipe = decode
        pixels = np.empty((n, channels, size, size), np.uint8)
        cached, rows = cache.pixels(decode)
        fresh, hits, hit_rows = [], [], []
        for i in todo:
            row = rows.get(rels[i])
            if row is not None and row[1:] == listing.stats[i]:  # decoded from the file as it is now
                hits.append(i)
                hit_rows.append(row[0])
            else:
                fresh.append(i)
        if len(hits) == n and hit_rows == list(range(n)) and len(cached) == n:  # the folder as it was
            pixels = cached  # read from the memory map as batches need it (copy-on-write: the cache stays intact)
        elif hits:  # one gather from the memory map
            pixels[hits] = cached[hit_rows]
        todo, decoded_now = fresh, len(fresh)

        def work(i: int) -> str | None:
            array, why = read_image(listing.paths[i], channels, size, recipe)
            if array is not None:
                pixels[i] = array
            return why
    else:
        def work(i: int) -> str | None:
            return read_image(listing.paths[i])[1]
    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        for i, why in zip(todo, pool.map(work, todo, chunksize=32)):
            whys[i] = why
    for rel, st, why in zip(rels, listing.stats, whys):
        cache.record(rel, st, why)
    cache.save(set(rels))
    keep, usable = [], [0] * len(listing.classes)
    for i, why in enumerate(whys):  # the listing is in folder order
        if why:
            _bad(skipped, str(listing.paths[i]), why)
        else:
            keep.append(i)
            usable[listing.labels[i]] += 1
    for folder in listing.folders:
        if usable[listing.classes.index(folder.name)] == 0:
            raise UserError(f"{folder}: class '{folder.name}' has no usable images "
                            f"({', '.join(sorted(IMAGE_SUFFIXES))})")
    if pixels is not None:
        if len(keep) < n:
            pixels = pixels[keep]
        if decoded_now:
            cache.save_pixels(decode, pixels, [rels[i] for i in keep],  # type: ignore[arg-type]
                              [listing.stats[i] for i in keep])
    return [listing.paths[i] for i in keep], [listing.labels[i] for i in keep], pixels


def scan_class_folder(root: Path, classes: list[str] | None, skipped: Skipped | None,
                      cache_dir: str | None = None) -> tuple[list[Path], list[int], list[str]]:
    """Checked files and labels of root/<class>/<image>; `classes` fixes the class order."""
    listing = list_class_folder(root, classes)
    paths, labels, _ = check_listing(listing, skipped, cache_dir)
    return paths, labels, listing.classes


PHOTO_MIN_SIDE = 64  # colour images at least this large on their shorter side get the photo recipe
GREY_MODES = {"1", "L", "LA", "I", "I;16", "F"}


def stored_side(image_size: int, crop_pct: float) -> int:
    """The side photos are kept at (shorter side resized to it, then the central square): room for the crop, as
    timm's evaluation resizes to image_size / crop_pct before cropping image_size."""
    return max(image_size, math.floor(image_size / crop_pct))


def stored_size(recipe: str, image_size: int, crop_pct: float) -> int:
    """The side image files are decoded to for a model input of `image_size`: photos keep room for the crop."""
    return stored_side(image_size, crop_pct) if recipe == "photo" else image_size


def looks_like_photos(paths: list[Path], sample: int = 16) -> bool:
    """Whether most of an evenly spaced sample of the files are colour images with a shorter side of at least
    PHOTO_MIN_SIDE pixels (headers only)."""
    from PIL import Image

    picked = paths[::max(1, len(paths) // sample)][:sample]
    votes = 0
    for path in picked:
        try:
            with Image.open(path) as img:
                votes += img.mode not in GREY_MODES and min(img.size) >= PHOTO_MIN_SIDE
        except (OSError, ValueError, SyntaxError):
            pass
    return votes * 2 > len(picked)


def is_image_folder(folder: Path) -> bool:
    return any(p.is_dir() for p in folder.iterdir())
