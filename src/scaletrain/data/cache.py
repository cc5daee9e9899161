"""What a run learned about a folder of images, kept under --cache-dir so the next run need not learn it again.

- The check: for every file (its path inside the folder, size and modification time), whether it is usable or
  why not. A later run over the same folder (any --output-dir, a resume, predict, evaluate) rechecks only the
  files whose size or modification time changed and the files it has not seen.
- The decoded pixels, when the decoded set is kept in memory: one uint8 array per way of decoding (recipe,
  channels, size), read back by memory map, so a second run decodes only what changed.

Both live in `<cache-dir>/folders/<hash of the folder's absolute path>/` and are written atomically (a temporary
file renamed into place). The data folder itself is only read, so it may be read-only. A cache that cannot be
written is skipped with one note, never an error; one that cannot be read is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..config import cache_root

INDEX_VERSION = 1


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


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
