"""Folders of images with one subfolder per class (`--data-format folder`), optionally split into train/ and
val/ (or validation/): listed, every file checked once, and either decoded into memory or served as
`ImageFiles` decoded batch by batch. What a run learned about the folder is kept in its cache (see cache.py).
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...config import DataConfig
from ...errors import UserError
from ..cache import FolderCache
from ..images import DEFAULT_FOLDER_SIZE, IMAGE_SUFFIXES, looks_like_photos, read_image, stored_size
from ..types import ImageFiles, ImageSet, Skipped, existing_path, keep_in_memory, refuse_or_skip

FORMAT = "folder"


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


def _scan(folder: str, inside: tuple[str, ...] = ()) -> list[tuple[str, os.stat_result]]:
    found = []
    here = os.path.realpath(folder)
    inside = (*inside, here)
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                if entry.is_symlink() and os.path.realpath(entry.path) in inside:
                    raise UserError(f"{entry.path}: a symbolic link back to {os.path.realpath(entry.path)}, which "
                                    f"holds it (a loop); remove the link")
                found += _scan(entry.path, inside)
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES:
                st = entry.stat()
                if stat.S_ISREG(st.st_mode):
                    found.append((entry.path, st))
    return found


def check_listing(listing: Listing, skipped: Skipped | None, cache_dir: str | None = None,
                  decode: tuple[int, int, str] | None = None) -> tuple[list[Path], list[int], np.ndarray | None]:
    """Check every file of a listing once: (usable paths, their labels, and with `decode` = (channels, size,
    recipe) their pixels, N x C x S x S uint8, from the same single pass that checked them).

    Files the folder's cache (see data/cache.py) knows unchanged are not checked again; without `decode`
    nothing of theirs is read. Files are read on one thread per core (Pillow decodes with the GIL released).
    Bad files are reported in folder order: the first one refused by name, or all skipped with `skipped`.
    """
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
            refuse_or_skip(skipped, str(listing.paths[i]), why)
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


def named(location: str) -> bool:
    return False


def recognise(path: Path) -> bool:
    return path.is_dir() and any(p.is_dir() for p in path.iterdir())


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet | ImageFiles,
                                                                          ImageSet | ImageFiles | None]:
    root = existing_path(location)
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
