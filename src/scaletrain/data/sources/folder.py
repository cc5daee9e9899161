"""Folders of images with one subfolder per class (`--data-format folder`), optionally split into train/ and
val/ (or validation/): listed, every file checked once, and either decoded into memory or served as
`ImageFiles` decoded batch by batch. What a run learned about the folder is kept in its cache (see cache.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...config import DataConfig
from ...errors import UserError
from ..cache import FolderCache, PixelWriter, Stored
from ..images import DEFAULT_FOLDER_SIZE, IMAGE_SUFFIXES, check_image, looks_like_photos, read_image, stored_size
from ..types import (ImageFiles, ImageSet, Skipped, StoredPixels, existing_path, keep_in_memory, memory_limit,
                     refuse_or_skip, sample_rows, small_set)

FORMAT = "folder"


@dataclass
class Listing:
    """The image files of root/<class>/<image>, in folder order, with their labels and (size, mtime_ns). The files'
    paths are strings: a Path each would cost 0.2 s for 20,000 files, and a run that finds them decoded in its
    cache never opens them."""

    root: Path
    classes: list[str]
    folders: list[Path]
    paths: list[str]
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


def image_files_under(folder: Path) -> list[tuple[str, os.stat_result]]:
    """Regular image files anywhere under `folder`, sorted by path, with their stat (one scandir per folder)."""
    # As Path.parts sort (a folder's own subfolders' files before its names that continue past the folder's: NUL
    # sorts first, and no path holds one), 5-10x faster than comparing split lists: 0.01 s for 16,000 files.
    return sorted(_scan(str(folder)), key=lambda item: item[0].replace(os.sep, "\0"))


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


class PixelKeeper:
    """A folder's files checked but decoded later, while the first run trains (ImageFiles.keep): their pixels
    arrive in parts (each batch of a split's first pass) and go to the folder's cache as they arrive, one line
    for each tenth kept; once every usable file's are in, the cache holds them and the next run starts from memory.
    Nothing is read or decoded for it: it keeps what the training decoded anyway."""

    def __init__(self, cache: FolderCache, decode: tuple[int, int, str], paths: list[str], rels: list[str],
                 stats: list[tuple[int, int]], held: bool = True):
        self.cache, self.decode, self.rels, self.stats = cache, decode, rels, stats
        self.held = held  # whether the training holds the pixels in memory too (else: kept on disk only)
        self.path: Path | None = None  # the pixels' file, once every file's are in it
        self.row = {path: i for i, path in enumerate(paths)}
        self.have = np.zeros(len(paths), bool)
        self.kept, self.tenths = 0, -1
        self.writer: PixelWriter | None = None
        self.saved = False  # every file's pixels handed over (kept, or not kept: no cache, no room)
        self.sample: dict[str, np.ndarray] = {}  # the images the check decoded (for the statistics)

    def __call__(self, paths: list[str], pixels: np.ndarray) -> None:
        if self.saved:  # a set decoded again (a second fit on the same data) has nothing new to keep
            return
        rows = self.rows_of(paths)
        rows, first = np.unique(rows, return_index=True)  # a sampler may draw a file twice in one batch
        new = ~self.have[rows]
        if not new.any():
            return
        if self.writer is None:
            self.writer = self.cache.pixel_writer(self.decode, len(self.rels))
            if self.writer is None:  # no cache, or no room in it
                self.saved = True
                return
        rows, first = rows[new], first[new]
        if len(first) < len(pixels) or not bool((first == np.arange(len(first))).all()):
            pixels = pixels[first]  # a whole set in file order (in_memory) is written as it is, without a copy
        if not self.writer.write(rows, pixels):
            self.writer, self.saved = None, True
            return
        self.have[rows] = True
        self.kept += len(rows)
        if self.kept == len(self.rels):
            kept, mib = self.writer.finish(self.rels, self.stats), self.kept * self.writer.row_bytes / 2 ** 20
            self.writer, self.saved = None, True
            if kept:
                self.path = self.cache.pixels_path(self.decode)
                self._say(f"cache of {self.cache.root}: its {self.kept:,} decoded images kept ({mib:,.0f} MiB); "
                          f"the next runs start from them")
        elif self.kept * 10 // len(self.rels) > self.tenths:
            self.tenths = self.kept * 10 // len(self.rels)
            self._say(f"cache of {self.cache.root}: {self.kept:,} of {len(self.rels):,} decoded images kept "
                      f"({100 * self.kept // len(self.rels)} %) as the training reads them")

    def rows_of(self, paths: list[str]) -> np.ndarray:
        """The rows of the kept pixels' file that hold `paths`' images."""
        return np.fromiter((self.row[os.fspath(p)] for p in paths), np.int64, len(paths))

    @staticmethod
    def _say(line: str) -> None:
        if os.environ.get("RANK", "0") == "0":  # the job's main process
            print(line, flush=True)

    def __getstate__(self):  # DataLoader workers and launched processes never keep anything
        return {**self.__dict__, "writer": None, "sample": {}}


def _check_one(task: tuple[str, tuple[int, int, str] | None]) -> tuple[str | None, np.ndarray | None]:
    """One file's check (why it cannot be used, or None), and its pixels when asked for: (channels, size, recipe)."""
    path, decode = task
    if decode is None:
        return check_image(path), None
    array, why = read_image(path, *decode)
    return why, array


class CheckWorkers:
    """One forked process per core for a read's checks, shared by its splits (threads where forking is unsafe:
    other threads running, a process group's or Ray Train's; or not offered: Windows). `map` hands the work out at
    once and gives the results in order as they come, so a check can start before the run needs its result.
    `spare`: cores left to the process that began the check, which goes on with work of its own meanwhile (a
    read begun ahead: the model's code imports on one core). On 2 cores timm's import took 3.9 s beside the check
    of 20,000 files on one worker, 4.1 s beside two and 3.5 s alone (medians of 4, 2026-11-29)."""

    def __init__(self, spare: int = 0):
        self.pool: ProcessPoolExecutor | ThreadPoolExecutor | None = None
        self.spare = spare

    def map(self, work, tasks: list) -> Iterator:
        import multiprocessing
        import threading

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cores = max(1, cores - self.spare)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(cores) if threading.active_count() > 1 or \
                "fork" not in multiprocessing.get_all_start_methods() else \
                ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("fork"))
        return self.pool.map(work, tasks, chunksize=max(1, min(256, len(tasks) // (4 * cores))))

    def close(self, cancel: bool = False) -> None:
        """End the processes once their work is done, or (`cancel`) once the part they started is."""
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=cancel)
            self.pool = None


class ListingCheck:
    """Every file of a listing checked once, in two halves: begun (what the folder's cache knows looked up, the
    files to check handed to `workers`), then `result()`: (usable paths, their labels, and with `decode` =
    (channels, size, recipe) their pixels, N x C x S x S uint8, from the same single pass that checked them).

    Files the folder's cache (see data/cache.py) knows unchanged are not checked again; without `decode`
    nothing of theirs is read. With `later`, pixels the cache does not hold are not decoded here: the files are
    only checked (check_image) and a PixelKeeper takes the pixels' place, for the training's first pass to fill;
    with `statistics` (a training set) the images its normalisation statistics are taken from are decoded too.
    Not `held` (a set larger than --cache-memory): pixels are never gathered in memory; the cache's file, when it
    holds every usable file's, is handed back as `Stored` (read batch by batch), else the first pass fills it.
    Pixels are decoded on one thread per core (Pillow decodes with the GIL released), in `result()`; files only
    checked, on `workers` from the start. Bad files are reported in folder order: the first one refused by name,
    or all skipped with `skipped`.
    """

    def __init__(self, listing: Listing, skipped: Skipped | None, cache_dir: str | None,
                 decode: tuple[int, int, str] | None, later: bool, statistics: bool, held: bool,
                 workers: CheckWorkers):
        self.listing, self.skipped, self.held = listing, skipped, held
        self.cache = cache = FolderCache(listing.root, cache_dir)
        prefix = len(str(listing.root).rstrip(os.sep)) + 1
        self.rels = rels = [p[prefix:] for p in listing.paths]  # the listing's paths all start with its root
        n = len(rels)
        known = [cache.lookup(rel, st) for rel, st in zip(rels, listing.stats)]
        self.whys: list[str | None] = [why for _, why in known]
        self.todo = [i for i, (is_known, why) in enumerate(known) if not is_known]
        self.pixels: np.ndarray | PixelKeeper | Stored | None = None
        self.decoded_now, self.wanted, self.stored_rows = 0, None, {}
        if decode is not None:
            usable = [i for i, (is_known, why) in enumerate(known) if why is None]
            cached, rows = cache.pixels(decode)
            fresh, hits, hit_rows = [], [], []
            for i in usable:
                row = rows.get(rels[i])
                if row is not None and row[1:] == listing.stats[i]:  # decoded from the file as it is now
                    hits.append(i)
                    hit_rows.append(row[0])
                else:
                    fresh.append(i)
            if not held and not fresh and cached is not None:  # its rows picked once the usable files are known
                self.pixels, decode = Stored(cache.pixels_path(decode), np.array(hit_rows, np.int64)), None
                self.stored_rows = dict(zip(hits, hit_rows))
            elif fresh and later:
                self.wanted, decode = decode, None  # checked here, decoded by the training's first pass
            else:
                pixels = np.empty((n, decode[0], decode[1], decode[1]), np.uint8)
                if len(hits) == n and hit_rows == list(range(n)) and len(cached) == n:  # the folder as it was
                    pixels = cached  # read from the memory map as batches need it (copy-on-write: the cache stays)
                elif hits:  # one gather from the memory map
                    pixels[hits] = cached[hit_rows]
                self.pixels, self.todo, self.decoded_now = pixels, fresh, len(fresh)
        self.decode = decode
        self.checked: Iterator | None = None
        if decode is None:
            # The images the normalisation statistics will be taken from are decoded in the same pass (see
            # types.mean_std); on worker processes, since reading headers is mostly Python, which holds the GIL.
            shape = self.wanted or (0, 0, "")
            sample = set(sample_rows(n, n * shape[0] * shape[1] ** 2)) if self.wanted and statistics else set()
            tasks = [(listing.paths[i], shape if i in sample else None) for i in self.todo]
            self.checked = workers.map(_check_one, tasks) if len(tasks) >= 512 else map(_check_one, tasks)

    def result(self) -> tuple[list[str], list[int], np.ndarray | PixelKeeper | Stored | None]:
        listing, cache, rels, whys, pixels = self.listing, self.cache, self.rels, self.whys, self.pixels
        sample: dict[str, np.ndarray] = {}
        if self.decode is not None:
            channels, size, recipe = self.decode

            def work(i: int) -> str | None:
                array, why = read_image(listing.paths[i], channels, size, recipe)
                if array is not None:
                    pixels[i] = array  # type: ignore[index]
                return why
            with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
                for i, why in zip(self.todo, pool.map(work, self.todo, chunksize=32)):
                    whys[i] = why
        else:
            for i, (why, array) in zip(self.todo, self.checked):  # type: ignore[arg-type]
                whys[i] = why
                if array is not None:
                    sample[listing.paths[i]] = array
        for rel, st, why in zip(rels, listing.stats, whys):
            cache.record(rel, st, why)
        cache.save(set(rels))
        keep, usable_per_class = [], [0] * len(listing.classes)
        for i, why in enumerate(whys):  # the listing is in folder order
            if why:
                refuse_or_skip(self.skipped, listing.paths[i], why)
            else:
                keep.append(i)
                usable_per_class[listing.labels[i]] += 1
        for folder in listing.folders:
            if usable_per_class[listing.classes.index(folder.name)] == 0:
                raise UserError(f"{folder}: class '{folder.name}' has no usable images "
                                f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        paths = [listing.paths[i] for i in keep]
        if isinstance(pixels, Stored):  # a file found unusable by this check has a row but no place
            pixels = Stored(pixels.path, np.array([self.stored_rows[i] for i in keep], np.int64))
        if isinstance(pixels, np.ndarray):
            if len(keep) < len(rels):
                pixels = pixels[keep]
            if self.decoded_now:
                cache.save_pixels(self.decode, pixels, [rels[i] for i in keep],  # type: ignore[arg-type]
                                  [listing.stats[i] for i in keep])
        elif self.wanted is not None:
            pixels = PixelKeeper(cache, self.wanted, paths, [rels[i] for i in keep],
                                 [listing.stats[i] for i in keep], self.held)
            pixels.sample = sample
        return paths, [listing.labels[i] for i in keep], pixels


def check_listing(listing: Listing, skipped: Skipped | None, cache_dir: str | None = None,
                  decode: tuple[int, int, str] | None = None, later: bool = False, statistics: bool = False,
                  held: bool = True) -> tuple[list[str], list[int], np.ndarray | PixelKeeper | Stored | None]:
    """A ListingCheck begun and finished at once."""
    workers = CheckWorkers()
    try:
        return ListingCheck(listing, skipped, cache_dir, decode, later, statistics, held, workers).result()
    finally:
        workers.close()


def _whole_map(pixels: np.ndarray) -> bool:
    """Whether `pixels` is the memory map of a whole cache file (not a copy or a part of one)."""
    return isinstance(pixels, np.memmap) and pixels.filename is not None and pixels.flags.c_contiguous and \
        pixels.offset + pixels.nbytes == os.path.getsize(pixels.filename)


def scan_class_folder(root: Path, classes: list[str] | None, skipped: Skipped | None,
                      cache_dir: str | None = None) -> tuple[list[str], list[int], list[str]]:
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
    return FolderRead(location, cfg, skipped).finish()


def begin(location: str, cfg: DataConfig) -> FolderRead:
    """read()'s first half, begun ahead of the run's need (see data.read.read_ahead): a large folder's first check
    runs on worker processes from here on."""
    return FolderRead(location, cfg, None, ahead=True)


class FolderRead:
    """A folder read in two halves: begun (listed, the recipe and sizes settled, each split's check begun), then
    `finish()`: (training set, validation set or None). Begun `ahead` of other work, its checks leave that work
    a core."""

    def __init__(self, location: str, cfg: DataConfig, skipped: Skipped | None, ahead: bool = False):
        root = existing_path(location)
        val_dir = next((root / n for n in ("val", "validation") if (root / n).is_dir()), None)
        train_dir = root / "train" if val_dir is not None and (root / "train").is_dir() else root
        listings = [list_class_folder(train_dir)]
        if val_dir is not None:
            listings.append(list_class_folder(val_dir, listings[0].classes))
        recipe = cfg.recipe if cfg.recipe != "auto" else "photo" if looks_like_photos(listings[0].paths) else "digits"
        channels = cfg.channels or 3
        size = stored_size(recipe, cfg.image_size or DEFAULT_FOLDER_SIZE, cfg.crop_pct)
        nbytes = sum(len(part.paths) for part in listings) * channels * size * size
        held = keep_in_memory(cfg, nbytes)
        # A set larger than --cache-memory is kept decoded on disk instead (not with --data-on-device no, nor with
        # --skip-bad-samples, whose check decodes every file), read back batch by batch.
        on_disk = not held and cfg.data_on_device == "auto" and skipped is None and cfg.cache_dir is not None
        decode = (channels, size, recipe) if held or on_disk else None
        if on_disk:
            PixelKeeper._say(f"{root}: its images decode to {nbytes / 2**20:,.0f} MiB, more than --cache-memory "
                             f"({memory_limit(cfg) / 2**20:,.0f} MiB): kept decoded in --cache-dir on disk, read a "
                             f"batch at a time")
        # A large folder's first run checks its files without decoding them; the first pass of each split decodes
        # and keeps them. A folder of at most 64 MiB decoded (its statistics take every image) is decoded in the
        # check, and so is every folder with --skip-bad-samples: a file only decoding finds bad is skipped too.
        later = skipped is None and (on_disk or not small_set(nbytes))
        self.classes, self.channels, self.size, self.recipe = listings[0].classes, channels, size, recipe
        self.workers = CheckWorkers(spare=1 if ahead else 0)
        try:
            self.checks = [ListingCheck(listing, skipped, cfg.cache_dir, decode, later, listing is listings[0], held,
                                        self.workers) for listing in listings]
        except BaseException:
            self.workers.close(cancel=True)
            raise

    def finish(self) -> tuple[ImageSet | ImageFiles, ImageSet | ImageFiles | None]:
        try:
            sets = [self._set(*check.result()) for check in self.checks]
        finally:
            self.workers.close()  # waited for: a thread left ending it would be there when DataLoader workers fork
        if isinstance(sets[0], ImageSet):  # a first run cut short after its training split was kept: decode the rest
            sets = [s.in_memory() if isinstance(s, ImageFiles) else s for s in sets]
        return sets[0], (sets[1] if len(sets) > 1 else None)

    def cancel(self) -> None:
        """Stop what was begun and is not wanted (the read never finished)."""
        self.workers.close(cancel=True)

    def _set(self, paths: list[str], labels: list[int], pixels) -> ImageSet | ImageFiles | StoredPixels:
        if isinstance(pixels, np.ndarray):
            mapped = (Path(pixels.filename), pixels.offset) if _whole_map(pixels) else None
            return ImageSet(torch.from_numpy(pixels), torch.tensor(labels, dtype=torch.int64), self.classes,
                            self.recipe, mapped)
        files = ImageFiles(paths, np.array(labels), self.classes, self.channels, self.size, self.recipe,
                           keep=pixels if isinstance(pixels, PixelKeeper) else None)
        return StoredPixels(pixels.path, pixels.rows, files) if isinstance(pixels, Stored) else files
