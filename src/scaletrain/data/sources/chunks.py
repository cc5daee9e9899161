"""A prepared dataset as LitData chunks: what `scaletrain prepare --output s3://bucket/prefix` (or `--chunks`)
writes, and what `--data s3://bucket/prefix` (or such a folder) streams, on LitData's StreamingDataset.

The location holds, per split (`train/`, `val/`), LitData's `index.json` and chunk files (items: the uint8 image,
C x S x S, its label and its position in the split) and `labels.npy`; and at its top scaletrain's `prepared.json`:
the classes, how the images were decoded (recipe, channels, stored size) and the SHA-256 of every file, written
last, so an interrupted `prepare` leaves nothing that reads as a dataset.

Reading. Each process streams its part of a split (LitData shares the chunks out by rank): chunks are downloaded
as they are needed, a few ahead of the one being read, into a cache under `--cache-dir` that LitData keeps below
`--cache-limit` by deleting chunks already read; the first step waits for one chunk, not for the dataset. Every
file is checked against its SHA-256 as it arrives, before LitData sees it: a damaged or missing one stops the run
with its key named. A store that stops answering stops the run too, with a checkpoint at the last step (see
`StoreUnreachable`), and so does a chunk that has not arrived SCALETRAIN_CHUNK_TIMEOUT seconds (300) after the
reader asked for it, named with the store; the same command resumes where it stopped. Training shuffles chunks and
the items within them from the run's seed and the epoch (LitData's shuffle), so a restart reads the same order;
the position of each item lets predictions come back in the split's order on any process count.

The endpoint and credentials are boto3's: AWS_ENDPOINT_URL (an S3-compatible server), AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or the AWS configuration files.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ...config import DataConfig, parse_size
from ...errors import UserError
from ..cache import cache_root
from ..streams import DataPaused
from ..types import Skipped, mean_std
from .prepared import MANIFEST, image_rows, sha256_file, stored_shape

MANIFEST_FORMAT = "scaletrain-chunks"
VERSION = 1
PREFETCH = 2  # chunks each process downloads ahead of the one it reads (LitData's max_pre_download)
INSTALL = "pip install 'scaletrain[stream]'"
TIMEOUT_VARIABLE = "SCALETRAIN_CHUNK_TIMEOUT"
WAIT = 300.0  # seconds a reader waits for a chunk: longer than boto3 takes to give up on a silent store (3 x 35 s)


class StoreUnreachable(DataPaused):
    """The object store did not answer (boto3 gave up after its retries): the run stops with a checkpoint and the
    same command resumes once the store answers."""


# -- the store -------------------------------------------------------------------------------------------------
def _require_litdata():
    import importlib.util

    if not all(importlib.util.find_spec(name) for name in ("litdata", "boto3")):
        raise UserError(f"chunked data (--data s3://..., prepare --output s3://... or --chunks) is streamed by "
                        f"LitData: {INSTALL}")


_clients: dict[int, Any] = {}  # process id -> its client (a forked DataLoader worker makes its own)
_clients_lock = threading.Lock()
# a DataLoader worker forked while a download thread held the lock would wait on it for ever: a fresh one there
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_clients_lock", threading.Lock()))


def _client():
    """A boto3 S3 client for this process, shared by its threads (boto3's clients are thread-safe, and making one
    costs about 0.3 s of CPU: LitData's prefetch downloads on fresh threads every pass), with short timeouts: a
    store that does not answer is noticed in about a minute, not hung on."""
    with _clients_lock:
        if os.getpid() not in _clients:
            import boto3
            from botocore.config import Config

            pool = (PREFETCH + 1) * 10  # the downloads in flight, each on up to 10 of s3transfer's threads
            _clients[os.getpid()] = boto3.session.Session().client(
                "s3", config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                                    read_timeout=30, max_pool_connections=pool))
        return _clients[os.getpid()]


def _split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def _fetch(url: str, local: str, expected: str | None) -> str | None:
    """Download `url` to `local` (written whole or not at all) if its SHA-256 is `expected`; else what is wrong,
    as one line (a StoreUnreachable is raised)."""
    from botocore.exceptions import BotoCoreError, ClientError

    tmp = f"{local}.{os.getpid()}.{threading.get_ident()}.part"
    bucket, key = _split_url(url)
    try:
        _client().download_file(bucket, key, tmp)
        if expected is not None and sha256_file(tmp) != expected:
            return f"{url}: damaged (its SHA-256 differs from {MANIFEST}'s); prepare the data again"
        os.replace(tmp, local)
        return None
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchKey", "NoSuchBucket"):
            return f"{url}: missing ({MANIFEST} lists it); prepare the data again"
        return f"{url}: cannot be read ({code or e})"
    except BotoCoreError as e:
        raise StoreUnreachable(f"{url}: the object store does not answer ({e})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class _Checks:
    """The SHA-256 each file must have (url -> digest) and the problems the download threads met (local path ->
    the error to raise in the process's reading thread)."""

    def __init__(self):
        self.expected: dict[str, str] = {}
        self.problems: dict[str, Exception] = {}
        self.depth_kept: set[str] = set()  # the remote folders whose prefetch depth LitData keeps as asked

    def download(self, url: str, local: str) -> None:
        if os.path.exists(local):
            return
        try:
            problem: Exception | None = UserError(p) if (p := _fetch(url, local, self.expected.get(url))) else None
        except StoreUnreachable as e:
            problem = e
        if problem is None:
            return
        if threading.current_thread() is threading.main_thread():
            raise problem
        self.problems[local] = problem  # raised where the reader waits for this file (see _loader_class)

    def wait(self, local: str, size: int, url: str, timeout: float, stopped=lambda: None) -> None:
        """Until `local` is here with `size` bytes; raises the problem its download met, or after `timeout`
        seconds without it (`stopped()`: what ended LitData's download thread, if it ended) a line naming
        `url` and the store."""
        deadline = time.monotonic() + timeout
        while not (os.path.exists(local) and os.stat(local).st_size >= size):
            problem = self.problems.pop(local, None)
            if problem is not None:
                raise problem
            if (error := stopped()) is not None:
                raise UserError(f"{url}: LitData's download thread stopped before it came from {_server()} "
                                f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]})")
            if time.monotonic() > deadline:
                raise StoreUnreachable(f"{url}: not downloaded from {_server()} within {timeout:g} s "
                                       f"({TIMEOUT_VARIABLE} sets the wait)")
            time.sleep(0.01)


CHECKS = _Checks()


def _server() -> str:
    """The store, as a message names it: its endpoint."""
    return f"the object store at {_client().meta.endpoint_url}"


def chunk_timeout() -> float:
    """Seconds a reader waits for a chunk before it gives up: SCALETRAIN_CHUNK_TIMEOUT, or WAIT."""
    raw = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return WAIT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise UserError(f"{TIMEOUT_VARIABLE}={raw}: expected the seconds a chunk may take to arrive, a number "
                        f"above 0 (default {WAIT:g})")
    return seconds


@functools.cache
def _register_with_litdata() -> None:
    """Once per process: LitData downloads s3:// files through scaletrain's checked download, and nothing else
    (_downloader_class); items are read through _loader_class, which waits on those checks. Its check for a newer
    release on PyPI (a web request of up to 30 s each time a dataset is made, on machines that often have no
    internet) is turned off; its prefetch keeps the depth scaletrain asks for, and its download thread does not
    wait on an empty queue (below)."""
    import litdata.helpers
    from litdata.streaming import reader
    from litdata.streaming.downloader import register_downloader

    litdata.helpers._get_newer_version = lambda version: None

    # LitData raises max_pre_download toward 32 chunks on remote data: --cache-limit counts PREFETCH chunks ahead
    # per process (ChunkSet.cache_budget), so scaletrain's own datasets keep the depth they ask for.
    adaptive = getattr(reader, "adaptive_pre_download", None)
    if adaptive is not None:
        def _depth(max_pre_download: int, *, remote_dir: str | None = None, chunks=None) -> int:
            if remote_dir and str(remote_dir) in CHECKS.depth_kept:
                return max_pre_download
            return adaptive(max_pre_download, remote_dir=remote_dir, chunks=chunks)

        reader.adaptive_pre_download = _depth

    # With its prefetch window full, LitData's download thread waits 0.1 s on its queue of forced downloads (nearly
    # always empty) before it looks at the reader's deletions, so each chunk came up to 0.1 s after the reader
    # freed a place for it: one stream then reads about a chunk per 0.1 s whatever the store answers
    # (benchmarks/stream_engines.py, commit 76b1067). With a cache limit the thread still blocks on the deletion
    # queue instead.
    force_download = reader.PrepareChunksThread._force_download

    def _force_download(self, *args, **kwargs) -> None:
        if self._max_cache_size and self._force_download_queue.empty():
            return
        force_download(self, *args, **kwargs)

    reader.PrepareChunksThread._force_download = _force_download

    register_downloader("s3://", _downloader_class(), overwrite=True)


@functools.cache
def _downloader_class() -> type:
    """LitData's downloader for s3://, every way it fetches a file going through CHECKS.download (boto3, then the
    SHA-256): the whole file, the file to a path from its asyncio prefetch, and a range of bytes (read from the
    checked file). It derives from LitData's base class, not its S3Downloader, whose asyncio path reads through
    obstore past any check (and obstore refuses plain-http endpoints)."""
    from litdata.streaming.downloader import Downloader

    class CheckedS3Downloader(Downloader):
        def download_file(self, remote_filepath: str, local_filepath: str) -> None:
            CHECKS.download(remote_filepath, local_filepath)

        async def adownload_file(self, remote_filepath: str, local_filepath: str) -> None:
            import asyncio

            await asyncio.to_thread(CHECKS.download, remote_filepath, local_filepath)
            if os.path.exists(local_filepath):  # else the problem waits in CHECKS for the reader
                self._notify_published(local_filepath)

        def download_bytes(self, remote_filepath: str, offset: int, length: int, local_chunkpath: str) -> bytes:
            CHECKS.download(remote_filepath, local_chunkpath)
            problem = CHECKS.problems.pop(local_chunkpath, None)
            if problem is not None:
                raise problem
            with open(local_chunkpath, "rb") as f:
                f.seek(offset)
                return f.read(length)

    return CheckedS3Downloader


@functools.cache
def _loader_class() -> type:
    """LitData's item loader, waiting for each chunk of a store (`url`) through CHECKS (its download's problem
    raised here, and a chunk that does not come within `timeout` seconds named with the store) before LitData's
    own wait; a folder's chunks are read where they are."""
    from litdata.streaming import item_loader

    class PyTreeLoader(item_loader.PyTreeLoader):  # LitData checks the loader by its class's name
        def __init__(self, url: str | None, timeout: float):
            super().__init__()
            self.scaletrain_url, self.scaletrain_timeout = url, timeout

        def load_item_from_chunk(self, index, chunk_index, chunk_filepath, begin, filesize_bytes, *rest):
            if self.scaletrain_url is not None and chunk_filepath != self._chunk_filepath:
                stopped = getattr(self, "_prefetch_error_provider", None) or (lambda: None)
                CHECKS.wait(chunk_filepath, filesize_bytes, f"{self.scaletrain_url}/{os.path.basename(chunk_filepath)}",
                            self.scaletrain_timeout, stopped)
            return super().load_item_from_chunk(index, chunk_index, chunk_filepath, begin, filesize_bytes, *rest)

    return PyTreeLoader


# -- writing ---------------------------------------------------------------------------------------------------
def write_chunks(output: str, parts: dict[str, Any], chunk_bytes: int, threads: int | None = None,
                 say=print) -> dict:
    """Write each split of `parts` ({"train": ImageSet | ImageFiles, "val": ...}) as LitData chunks of at most
    `chunk_bytes`, with the manifest, to `output` (a folder, or s3://bucket/prefix: written to a temporary folder
    and uploaded, the manifest last). Image files are decoded on one thread per core. Returns the manifest."""
    _require_litdata()
    from litdata.streaming.writer import BinaryWriter

    remote = output.startswith("s3://")
    local = Path(tempfile.mkdtemp(prefix="scaletrain-chunks-")) if remote else Path(output)
    first = parts["train"]
    channels, size = stored_shape(first)
    manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": VERSION, "classes": first.classes,
                                "recipe": first.recipe or "digits", "channels": channels, "size": size,
                                "chunk_bytes": chunk_bytes, "mean_std": mean_std(first), "splits": {}}
    per_read = max(1, (64 << 20) // (channels * size * size))
    try:
        with ThreadPoolExecutor(threads or max(1, os.cpu_count() or 1)) as pool:
            for split, data in parts.items():
                folder = local / split
                folder.mkdir(parents=True)
                writer = BinaryWriter(str(folder), chunk_bytes=chunk_bytes)
                labels = np.asarray(data.labels, dtype=np.int64)
                for start in range(0, len(data), per_read):
                    stop = min(len(data), start + per_read)
                    images = image_rows(data, start, stop, pool)
                    for i in range(start, stop):
                        writer.add_item(i, {"index": i, "image": np.ascontiguousarray(images[i - start]),
                                            "label": int(labels[i])})
                    say(f"{split}: {stop} of {len(data)} samples written")
                writer.done()
                writer.merge()
                np.save(folder / "labels.npy", labels)
                files = sorted(p.name for p in folder.iterdir() if p.is_file())
                manifest["splits"][split] = {"count": len(data), "bytes": sum((folder / f).stat().st_size
                                                                                for f in files),
                                             "files": {f: sha256_file(folder / f) for f in files}}
        (local / f".{MANIFEST}.tmp").write_text(json.dumps(manifest, indent=1) + "\n")
        if remote:
            _upload(local, output, manifest)
        else:
            os.replace(local / f".{MANIFEST}.tmp", local / MANIFEST)
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)
    return manifest


def _upload(local: Path, output: str, manifest: dict) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = _split_url(output.rstrip("/"))
    key = lambda name: f"{prefix}/{name}" if prefix else name  # noqa: E731
    try:
        for split, part in manifest["splits"].items():
            for name in part["files"]:
                _client().upload_file(str(local / split / name), bucket, key(f"{split}/{name}"))
        _client().upload_file(str(local / f".{MANIFEST}.tmp"), bucket, key(MANIFEST))
    except (BotoCoreError, ClientError) as e:
        raise UserError(f"--output {output}: cannot upload ({e})") from None


# -- reading ---------------------------------------------------------------------------------------------------
def is_chunks(location: str) -> bool:
    """Whether `location` names chunked data: s3://..., or a folder whose prepared.json says so."""
    if location.startswith("s3://"):
        return True
    try:
        return json.loads((Path(location) / MANIFEST).read_text()).get("format") == MANIFEST_FORMAT
    except (OSError, ValueError):
        return False


def read_manifest(location: str) -> dict:
    where = f"--data {location}"
    try:
        if location.startswith("s3://"):
            from botocore.exceptions import BotoCoreError, ClientError

            bucket, prefix = _split_url(location.rstrip("/"))
            try:
                body = _client().get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST}" if prefix else MANIFEST)
                text = body["Body"].read().decode()
            except ClientError as e:
                raise UserError(f"{where}: cannot read {MANIFEST} "
                                f"({e.response.get('Error', {}).get('Code', '') or e})") from None
            except BotoCoreError as e:
                raise UserError(f"{where}: the object store does not answer ({e})") from None
        else:
            text = (Path(location) / MANIFEST).read_text()
        manifest = json.loads(text)
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: cannot read {MANIFEST} ({e})") from None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{where}: {MANIFEST} is not scaletrain's chunked data of version {VERSION} (prepare it "
                        f"with --output s3://... or --chunks)")
    if "train" not in manifest["splits"]:
        raise UserError(f"{where}: {MANIFEST} has no train split")
    return manifest


class ChunkSet(IterableDataset):
    """One split of chunked data, streamed: each item is (uint8 C x S x S tensor, label), or (position in the
    split, image, label) when read `with_positions`. Each process reads its own part (`shards_by_rank`). The reading
    settings (shuffle, seed) are set by `reading`; `state_dict()` (the epoch and the items read in it) lets a
    resumed run continue mid-epoch."""

    shards_by_rank = True

    def __init__(self, location: str, manifest: dict, split: str, cache_dir: str, cache_limit: str):
        self.location, self.manifest, self.split = location.rstrip("/"), manifest, split
        self.cache_dir, self.cache_limit = cache_dir, cache_limit
        part = manifest["splits"][split]
        self.count, self.files = part["count"], part["files"]
        self.classes, self.recipe = list(manifest["classes"]), manifest["recipe"]
        self.channels, self.size = manifest["channels"], manifest["size"]
        self.shuffle, self.seed, self.with_positions = False, 0, False
        self._epoch, self._read, self._resume_at = 0, 0, None
        for name, digest in self.files.items():  # what every file of the split is checked against
            CHECKS.expected[f"{self.url}/{name}"] = digest
        CHECKS.depth_kept.add(self.url)
        self.labels = np.load(self._local_file("labels.npy"))

    def reading(self, train: bool, seed: int, with_positions: bool = False) -> "ChunkSet":
        """This split as a run reads it: shuffled from `seed` for training, in order for evaluation."""
        other = copy.copy(self)
        other.shuffle, other.seed, other.with_positions = train, seed, with_positions
        return other

    def __len__(self) -> int:
        return self.count

    def steps(self, world: int, batch_size: int) -> int:
        """Batches per process and training epoch: LitData gives each of `world` processes the same number of
        items (count // world, the rest left out of that epoch; drop_last) so that all end together."""
        return -(-(self.count // world) // batch_size)

    @property
    def image_size(self) -> int:
        return self.size

    def stored_mean_std(self) -> tuple[list[float], list[float]]:
        """The training images' per-channel mean and std, as `prepare` measured them (see types.mean_std)."""
        mean, std = self.manifest["mean_std"]
        return list(mean), list(std)

    @property
    def nbytes(self) -> int:
        return self.count * self.channels * self.size * self.size

    @property
    def url(self) -> str:
        return f"{self.location}/{self.split}"

    @property
    def remote(self) -> bool:
        return self.location.startswith("s3://")

    def _local_file(self, name: str) -> str:
        """A small file of the split (labels.npy), checked, from the store or the folder."""
        if not self.remote:
            return str(Path(self.location) / self.split / name)
        _require_litdata()
        folder = cache_root(self.cache_dir) / "chunks" / self._key() / "files" / self.split
        folder.mkdir(parents=True, exist_ok=True)
        try:
            CHECKS.download(f"{self.url}/{name}", str(folder / name))
        except StoreUnreachable as e:
            raise UserError(f"--data {self.location}: {e}") from None
        return str(folder / name)

    def _key(self) -> str:
        """The cache's folder for this dataset as prepared: data prepared again at the same location is another
        folder, so no chunk of the earlier one is read for it."""
        return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()[:16]

    def cache_budget(self) -> int:
        """What LitData may keep: --cache-limit less the chunks this machine's processes may be downloading
        beyond it (each its next PREFETCH and the one it reads), so that the cache folder stays within the
        limit."""
        limit = parse_size(self.cache_limit, "--cache-limit")
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        chunk = self.manifest["chunk_bytes"]
        budget = limit - processes * (PREFETCH + 1) * chunk
        if budget < chunk:
            raise UserError(f"--cache-limit {self.cache_limit}: too small for {processes} process(es) streaming "
                            f"chunks of up to {chunk / 2**20:.1f} MiB; at least "
                            f"{(processes * (PREFETCH + 1) + 1) * chunk / 2**20:.0f} MiB")
        return budget

    def _dataset(self):
        _require_litdata()
        from litdata import StreamingDataset

        _register_with_litdata()
        quiet = logging.getLogger("litdata.streaming.dataset")
        level, quiet.level = quiet.level, logging.ERROR  # its advice on cache sizes and drop_last is not for here
        try:
            # a folder's chunks are read where they are; only a store's get a cache
            cache = cache_root(self.cache_dir) / "chunks" / self._key() if self.remote else None
            if cache is not None:
                cache.mkdir(parents=True, exist_ok=True)
            loader = _loader_class()(self.url if self.remote else None, chunk_timeout())
            return StreamingDataset(self.url, cache_dir=None if cache is None else str(cache), item_loader=loader,
                                    shuffle=self.shuffle, drop_last=self.shuffle,
                                    seed=self.seed, max_cache_size=self.cache_budget() if self.remote else "100GB",
                                    max_pre_download=PREFETCH)
        finally:
            quiet.level = level

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "read": self._read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._resume_at = state["epoch"], state["read"] or None

    def __iter__(self) -> Iterator[Any]:
        data = self._dataset()
        data.set_epoch(self._epoch + 1)  # LitData counts epochs from 1
        self._read = 0
        if self._resume_at:
            data.current_epoch = self._epoch + 1
            data.load_state_dict(data.state_dict(self._resume_at, 0, 1))
            self._read, self._resume_at = self._resume_at, None
        for item in data:
            self._read += 1
            image = torch.from_numpy(np.array(item["image"]))  # a copy: LitData's may be a view of its read buffer
            yield (item["index"], image, item["label"]) if self.with_positions else (image, item["label"])


FORMAT = ""  # named by --data alone: s3://bucket/prefix, or a folder whose prepared.json says it holds chunks


def named(location: str) -> bool:
    return is_chunks(location)


def recognise(path: Path) -> bool:
    return is_chunks(str(path))


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ChunkSet, ChunkSet | None]:
    """The chunked dataset, streamed as it is read (see the module's text)."""
    return open_chunks(location, cfg.cache_dir, cfg.cache_limit)


def open_chunks(location: str, cache_dir: str, cache_limit: str) -> tuple[ChunkSet, ChunkSet | None]:
    manifest = read_manifest(location)
    return tuple(ChunkSet(location, manifest, split, cache_dir, cache_limit) if split in manifest["splits"]
                 else None for split in ("train", "val"))  # type: ignore[return-value]
