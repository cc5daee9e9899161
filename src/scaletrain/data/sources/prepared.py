"""A dataset decoded once into checksummed shards: what `scaletrain prepare` writes into a local folder and
`--data` reads (object storage holds chunks instead, see chunks.py).

A prepared folder holds:

- `prepared.json`: the classes, how the images were decoded (recipe, channels, stored size), and for each split
  (`train`, `val`) its shards in order, each with its sample count, byte size and SHA-256;
- `<split>-<k>.npy`: uint8 images, n x C x S x S, read by memory map (numpy's .npy: random access to any row
  with no decoding, so sharding stays exact and a resumed run reads what the uninterrupted one read);
- `<split>-<k>.labels.npy`: their int64 labels.

Shards are written to a temporary name and renamed; `prepared.json` is written last, so an interrupted
`prepare` leaves nothing that reads as a dataset. Every shard's checksum is verified before a run uses it (by the
process that checks the data, once per machine); a damaged shard is refused by name.

A shard verified once on a machine is not hashed again while its size and modification time stay the same
(recorded under `--cache-dir`), so later starts cost a stat per shard, not a read of the whole dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import DataConfig
from ...errors import UserError
from ..cache import cache_root
from ..types import ImageSet, PreparedSet, Skipped, keep_in_memory

FORMAT = ""  # named by --data alone: a folder holding prepared.json
MANIFEST = "prepared.json"
MANIFEST_FORMAT = "scaletrain-prepared"
VERSION = 1


def is_prepared(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# -- writing ---------------------------------------------------------------------------------------------------
def stored_shape(data: ImageSet | Any) -> tuple[int, int]:
    """(channels, side) of the images a split holds as written: an ImageSet's tensor, or image files' settings."""
    return (data.images.shape[1], data.images.shape[-1]) if isinstance(data, ImageSet) else (data.channels, data.size)


def image_rows(data: ImageSet | Any, start: int, stop: int, pool: ThreadPoolExecutor) -> np.ndarray:
    """Images start..stop of a split as a uint8 array: sliced from an ImageSet, or decoded from image files on
    `pool`'s threads."""
    if isinstance(data, ImageSet):
        return data.images[start:stop].numpy()
    return np.stack(list(pool.map(lambda i: data[i][0].numpy(), range(start, stop))))


def write_prepared(output: Path, parts: dict[str, Any], shard_bytes: int, threads: int | None = None,
                   say=print) -> dict:
    """Write each split of `parts` ({"train": ImageSet | ImageFiles, "val": ...}) into `output` as shards of at
    most `shard_bytes`; image files are decoded one shard at a time, on one thread per core, so memory stays at
    about one shard whatever the dataset's size. Returns the manifest."""
    output.mkdir(parents=True, exist_ok=True)
    first = parts["train"]
    channels, size = stored_shape(first)
    row = channels * size * size
    per_shard = max(1, shard_bytes // row)
    manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": VERSION, "classes": first.classes,
                                "recipe": first.recipe or "digits", "channels": channels, "size": size, "splits": {}}
    with ThreadPoolExecutor(threads or max(1, os.cpu_count() or 1)) as pool:
        for split, data in parts.items():
            shards = []
            for k, start in enumerate(range(0, len(data), per_shard)):
                stop = min(len(data), start + per_shard)
                images = image_rows(data, start, stop, pool)
                labels = np.asarray(data.labels[start:stop], dtype=np.int64)
                name = f"{split}-{k:05d}"
                for suffix, array in ((".npy", images), (".labels.npy", labels)):
                    tmp = output / f".{name}{suffix}.tmp"
                    with open(tmp, "wb") as f:
                        np.save(f, np.ascontiguousarray(array))
                    os.replace(tmp, output / f"{name}{suffix}")
                shards.append({"file": f"{name}.npy", "count": stop - start,
                               "bytes": (output / f"{name}.npy").stat().st_size,
                               "sha256": sha256_file(output / f"{name}.npy"),
                               "labels_sha256": sha256_file(output / f"{name}.labels.npy")})
                say(f"{split}: {stop} of {len(data)} samples written")
            manifest["splits"][split] = {"count": len(data), "shards": shards}
    tmp = output / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, output / MANIFEST)
    return manifest


# -- reading ---------------------------------------------------------------------------------------------------
class Store:
    """A prepared folder's files."""

    def __init__(self, location: str):
        self.location, self.local = location, Path(location)

    def fetch(self, name: str) -> Path:
        return self.local / name


def read_manifest(store: Store) -> dict:
    try:
        manifest = json.loads(store.fetch(MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--data {store.location}: cannot read {MANIFEST} ({e})") from None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"--data {store.location}: {MANIFEST} is not a scaletrain prepared dataset of version "
                        f"{VERSION}")
    return manifest


def verify(store: Store, manifest: dict, cache_dir: str, threads: int | None = None) -> None:
    """Every shard present with the checksum it was written with; refuses the first damaged or missing one by
    name. A shard verified before on this machine and unchanged since (same size and modification time, recorded
    under --cache-dir) is not hashed again."""
    jobs = [(s["file"], s["sha256"]) for split in manifest["splits"].values() for s in split["shards"]]
    jobs += [(s["file"][:-4] + ".labels.npy", s["labels_sha256"]) for split in manifest["splits"].values()
             for s in split["shards"]]
    where = str(store.local.resolve())
    record_path = cache_root(cache_dir) / "prepared" / f"{hashlib.sha1(where.encode()).hexdigest()[:20]}.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}

    def check(job: tuple[str, str]) -> str | None:
        name, expected = job
        path = store.local / name
        try:
            st = path.stat()
            if record.get(name) == [st.st_size, st.st_mtime_ns, expected]:
                return None
            digest = sha256_file(path)
        except OSError:
            digest = None
        if digest is None:
            return f"{path}: shard missing ({MANIFEST} lists it)"
        if digest != expected:
            return f"{path}: damaged shard (SHA-256 differs from {MANIFEST}); prepare the data again"
        st = path.stat()
        record[name] = [st.st_size, st.st_mtime_ns, expected]
        return None

    with ThreadPoolExecutor(threads or max(1, os.cpu_count() or 1)) as pool:
        problems = [p for p in pool.map(check, jobs) if p]
    try:  # what was verified stays verified, even when something else was not
        record_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = record_path.with_name(f".{record_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, record_path)
    except OSError:
        pass
    if problems:
        raise UserError(problems[0])


def open_prepared(location: str, cache_dir: str, check: bool = True) -> tuple[PreparedSet, PreparedSet | None]:
    """(train, validation or None) of a prepared dataset, its shards verified first when `check`."""
    store = Store(location)
    manifest = read_manifest(store)
    if check:
        verify(store, manifest, cache_dir)
    splits = manifest["splits"]
    if "train" not in splits:
        raise UserError(f"--data {location}: {MANIFEST} has no train split")
    return PreparedSet(store, manifest, "train"), (PreparedSet(store, manifest, "val") if "val" in splits else None)


def named(location: str) -> bool:
    return is_prepared(Path(location))


def recognise(path: Path) -> bool:
    """A prepared folder; shards without their prepared.json are refused here, before another source takes them
    for its own."""
    if path.is_dir() and not is_prepared(path) and any(path.glob("*-00000.npy")):
        raise UserError(f"--data {path}: holds shards but no prepared.json: an unfinished `scaletrain prepare`? "
                        f"run it again into an empty folder")
    return is_prepared(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None):
    """The prepared dataset, its shards verified; read into memory when it fits there."""
    train, val = open_prepared(location, cfg.cache_dir)
    if keep_in_memory(cfg, train.nbytes + (val.nbytes if val else 0)):
        return tuple(None if part is None else
                     ImageSet(part.read_all(), torch.from_numpy(part.labels.copy()), part.classes, part.recipe)
                     for part in (train, val))
    return train, val
