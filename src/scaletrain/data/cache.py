"""What a run learned about a folder of images, kept under --cache-dir so the next run need not learn it again.

- The check: for every file (its path inside the folder, size and modification time), whether it is usable or
  why not. A later run over the same folder (any --output-dir, a resume, predict, evaluate) rechecks only the
  files whose size or modification time changed and the files it has not seen.
- The decoded pixels, when the decoded set is kept in memory: one uint8 array per way of decoding (recipe,
  channels, size), read back by memory map, so a second run decodes only what changed. A first run that decodes
  while it trains writes each batch's rows as they pass (`PixelWriter`), so keeping them costs no pass of its own.

Both live in `<cache-dir>/folders/<hash of the folder's absolute path>/` and are written atomically (a temporary
file renamed into place). The data folder itself is only read, so it may be read-only. A cache that cannot be
written is skipped with one note, never an error; one that cannot be read is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import cache_root

INDEX_VERSION = 1


@dataclass(frozen=True)
class Stored:
    """A split's decoded pixels as the cache holds them: its file, and the row of each usable file (in order)."""

    path: Path
    rows: np.ndarray


class FolderCache:
    """The check results and decoded pixels of one folder (see the module's docstring)."""

    def __init__(self, root: Path, cache_dir: str | None):
        self.root = root.resolve()
        self.where = None if cache_dir is None else \
            cache_root(cache_dir) / "folders" / hashlib.sha1(str(self.root).encode()).hexdigest()[:20]
        self.files: dict[str, list] = {}  # relative path -> [size, mtime_ns, why or None]
        self.changed = False
        if self.where is not None:
            try:
                saved = json.loads((self.where / "index.json").read_text())
                if saved.get("version") == INDEX_VERSION and saved.get("root") == str(self.root):
                    self.files = saved["files"]
            except (OSError, ValueError, KeyError, TypeError):
                pass  # none yet, or damaged: everything is checked again

    def lookup(self, rel: str, stat: tuple[int, int]) -> tuple[bool, str | None]:
        """(known unchanged, why it cannot be used or None)."""
        entry = self.files.get(rel)
        if entry is None or (entry[0], entry[1]) != stat:
            return False, None
        return True, entry[2]

    def record(self, rel: str, stat: tuple[int, int], why: str | None) -> None:
        if self.files.get(rel) != [stat[0], stat[1], why]:
            self.files[rel] = [stat[0], stat[1], why]
            self.changed = True

    def save(self, seen: set[str]) -> None:
        """Write the index (entries of files no longer in the folder dropped) when anything changed."""
        gone = set(self.files) - seen
        for rel in gone:
            del self.files[rel]
        if self.where is None or not (self.changed or gone):
            return
        self._write("index.json", json.dumps({"version": INDEX_VERSION, "root": str(self.root),
                                              "files": self.files}).encode())

    # -- decoded pixels -----------------------------------------------------------------------------------------
    @staticmethod
    def _pixels_name(how: tuple[int, int, str]) -> str:
        channels, size, recipe = how
        return f"pixels-{recipe}-{channels}x{size}x{size}"

    def pixels_path(self, how: tuple[int, int, str]) -> Path | None:
        """Where the decoded pixels of `how` are kept (None without a cache)."""
        return None if self.where is None else self.where / f"{self._pixels_name(how)}.npy"

    def pixels(self, how: tuple[int, int, str]) -> tuple[np.ndarray | None, dict[str, tuple[int, int, int]]]:
        """(memory-mapped N x C x S x S array or None, relative path -> (its row, the file's size and mtime_ns
        when it was decoded))."""
        if self.where is None:
            return None, {}
        name = self._pixels_name(how)
        try:
            rows = json.loads((self.where / f"{name}.json").read_text())
            array = np.load(self.where / f"{name}.npy", mmap_mode="c")  # writes stay in this process
        except (OSError, ValueError):
            return None, {}
        if array.shape[0] != len(rows) or array.shape[1:] != (how[0], how[1], how[1]):
            return None, {}
        return array, {rel: (i, size, mtime) for i, (rel, size, mtime) in enumerate(rows)}

    def save_pixels(self, how: tuple[int, int, str], array: np.ndarray, rels: list[str],
                    stats: list[tuple[int, int]]) -> None:
        """Keep decoded pixels for the next run, when the cache's disk has room for twice their size."""
        if self.where is None:
            return
        try:
            self.where.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.where).free < 2 * array.nbytes:
                return
        except OSError:
            return
        name = self._pixels_name(how)
        tmp = self.where / f".{name}.npy.{os.getpid()}.tmp"  # several machines may share a cache
        try:
            with open(tmp, "wb") as f:
                np.save(f, array)
            os.replace(tmp, self.where / f"{name}.npy")
        except OSError as e:
            _remove(tmp)
            self._note(e)
            return
        self._write(f"{name}.json", json.dumps([[r, s[0], s[1]] for r, s in zip(rels, stats)]).encode())

    def pixel_writer(self, how: tuple[int, int, str], count: int) -> "PixelWriter | None":
        """A writer of `count` decoded images' rows as they arrive, or None without a cache or the disk room for
        twice their size."""
        if self.where is None:
            return None
        nbytes = count * how[0] * how[1] * how[1]
        try:
            self.where.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.where).free < 2 * nbytes:
                return None
            _remove_abandoned(self.where)
            return PixelWriter(self, how, count)
        except OSError as e:
            self._note(e)
            return None

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.where / f".{name}.{os.getpid()}.tmp"  # type: ignore[operator]
        try:
            self.where.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            tmp.write_bytes(data)
            os.replace(tmp, self.where / name)  # type: ignore[operator]
        except OSError as e:
            _remove(tmp)
            self._note(e)

    def _note(self, error: OSError) -> None:
        print(f"note: cannot keep what was learned about {self.root} in {self.where} ({error.strerror or error}); "
              f"the next run checks it again", file=sys.stderr, flush=True)
        self.where = None


class PixelWriter:
    """Decoded images written into the cache row by row as they arrive, in any order: an .npy file under a
    temporary name, renamed into place with its index once every row is in (`finish`). One never finished (a run
    stopped in its first epoch) is removed when the process ends, or by the next writer on this host."""

    def __init__(self, cache: FolderCache, how: tuple[int, int, str], count: int):
        channels, size, _ = how
        self.cache, self.name, self.count = cache, cache._pixels_name(how), count
        self.row_bytes = channels * size * size
        # host and process in the name: a later run may remove what a dead process of this host left
        self.tmp = cache.where / f".{self.name}.npy.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # type: ignore[operator]
        self.file = open(self.tmp, "wb")
        self._drop = weakref.finalize(self, _drop, self.file, self.tmp, os.getpid())
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                                                         "fortran_order": False,
                                                         "shape": (count, channels, size, size)})
        self.file.flush()
        self.offset = self.file.tell()
        self.file.truncate(self.offset + count * self.row_bytes)  # sparse until written

    def write(self, rows: np.ndarray, pixels: np.ndarray) -> bool:
        """Rows `rows` (distinct) of the array are `pixels`; False (after one note, the file removed) when the
        disk refuses them."""
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        fd = self.file.fileno()
        try:
            # consecutive rows go in one write: a whole set handed over at once is a single write
            for run in np.split(np.arange(len(rows)), np.flatnonzero(np.diff(rows) != 1) + 1):
                at = order[run[0]:run[-1] + 1]
                block = pixels[at[0]:at[-1] + 1] if bool((np.diff(at) == 1).all()) else pixels[at]
                view = memoryview(np.ascontiguousarray(block)).cast("B")
                position = self.offset + int(rows[run[0]]) * self.row_bytes
                while view:
                    written = os.pwrite(fd, view, position)
                    view, position = view[written:], position + written
        except OSError as e:
            self.abandon()
            self.cache._note(e)
            return False
        return True

    def finish(self, rels: list[str], stats: list[tuple[int, int]]) -> bool:
        """Every row written: the file renamed into place, then its index written; whether it was kept."""
        try:
            self.file.close()
            os.replace(self.tmp, self.cache.where / f"{self.name}.npy")  # type: ignore[operator]
        except OSError as e:
            self.abandon()
            self.cache._note(e)
            return False
        self._drop.detach()
        self.cache._write(f"{self.name}.json", json.dumps([[r, s[0], s[1]] for r, s in zip(rels, stats)]).encode())
        return self.cache.where is not None

    def abandon(self) -> None:
        self._drop()


def _drop(file, tmp: Path, pid: int) -> None:
    """An unfinished writer's file closed and removed, by the process that made it (not a forked DataLoader
    worker that inherited it)."""
    if os.getpid() == pid:
        file.close()
        _remove(tmp)


def _remove_abandoned(where: Path) -> None:
    """Temporary pixel files that processes of this host left when they died (killed in their first epoch)."""
    host = socket.gethostname()
    for tmp in where.glob(".pixels-*.npy.*.tmp"):
        made_by, pid, _token, _ = tmp.name.rsplit(".", 3)  # .<name>.npy.<host>.<pid>.<token>.tmp
        if made_by.endswith(f".npy.{host}") and pid.isdigit() and not _alive(int(pid)):
            _remove(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
