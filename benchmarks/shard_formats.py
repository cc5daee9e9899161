"""Storage formats for a prepared dataset of decoded images, measured side by side on one machine in one run.

The prepared dataset is N decoded uint8 images of one fixed size (C x H x W) with int64 labels, cut into shards of
about 64 MB. Training reads it by global sample index (a seeded permutation, split exactly across ranks, resumed
bitwise mid-epoch), so a format must give random access by index; a sequential stream alone does not do.

The same images (smooth colour gradients plus seeded noise, 3 x 73 x 73 by default, labels 0..9) are written in
each format, then read back in a fresh process per format, which measures:

- write: seconds to write every shard from the images already in memory; bytes on disk (all files written);
- open: seconds to open the written dataset, after importing the format's package (`import_s`, in a fresh
  process);
- round trip: every sample of one sequential pass, and a few indices read by random access (shard boundaries
  included), equal byte for byte to what was written, labels too; a format that fails this is a fail;
- random access: one epoch of batches of 64 indices from a seeded permutation, each batch returned as a torch
  uint8 tensor B x C x H x W (and int64 labels), single process: images/s;
- sequential: the same in index order, by the format's own sequential path: images/s;
- sha256 of every file written (what a manifest of shard checksums costs to verify), and the private (anonymous)
  memory the reading process gained from opening to the end of the reads, which each rank or loader worker would
  pay (memory-mapped pages are shared through the page cache and not counted);
- dependency weight: the installed distributions each format needs beyond torch and numpy, and their size.

Each format is read in 3 rounds (`--rounds`), the formats taking turns, each round in a fresh process that opens
the dataset 3 times and reads 3 epochs each way; the figures are medians over all of them. Every file is read once
before any read is timed, so all formats find the page cache warm. Ratios (`random_x`,
`sequential_x`) are against the random-access images/s of safetensors opened with `safe_open`. Built-in
checksums and remote (S3) storage are noted from each package's source, not measured.

Each storage is written, and each way of reading it run, in a process of its own; `--python STORAGE=EXE` runs a
storage's processes with another interpreter (a venv of its own, where packages conflict). A format whose package
does not install or import is a row with the error. The JSON's meta records the load average, since other work
on the machine slows every figure.

    python benchmarks/shard_formats.py --out benchmarks/results/shard_formats_cpu.json           # 20,000 images
    python benchmarks/shard_formats.py --images 2000 --out /tmp/smoke.json --only safetensors,npy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLASSES = 10
BATCH = 64
REPEATS = 3
SHARD_BYTES = 64 * 2**20


# -- the data --------------------------------------------------------------------------------------------------
def make_images(n: int, shape: tuple[int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n image-like uint8 arrays: a smooth colour field (a 3 x 3 grid of colours, bilinearly spread) plus noise."""
    c, h, w = shape
    rng = np.random.default_rng(seed)
    images = np.empty((n, c, h, w), np.uint8)

    def spread(size: int) -> np.ndarray:  # size x 3 bilinear weights from 3 control points
        t = np.linspace(0, 2, size)
        return np.clip(1 - np.abs(t[:, None] - np.arange(3)[None, :]), 0, None).astype(np.float32)

    wh, ww = spread(h), spread(w)
    for a in range(0, n, 1000):
        b = min(n, a + 1000)
        grid = rng.uniform(0, 255, (b - a, c, 3, 3)).astype(np.float32)
        field = np.einsum("hk,nckl,wl->nchw", wh, grid, ww)
        field += rng.normal(0, 4, field.shape).astype(np.float32)
        images[a:b] = np.clip(field, 0, 255).astype(np.uint8)
    labels = rng.integers(0, CLASSES, n).astype(np.int64)
    return images, labels


# -- helpers used by the readers -------------------------------------------------------------------------------
def gather(shards, per_shard: int, idx: np.ndarray, shape, labels):
    """Batch of global indices from per-shard image arrays (torch tensors or numpy arrays) and all the labels."""
    import torch

    shard_of, local = np.divmod(idx, per_shard)
    if isinstance(shards[0], torch.Tensor):  # one row view per sample, copied once by stack
        images = torch.stack([shards[s][i] for s, i in zip(shard_of.tolist(), local.tolist())])
        return images, labels[torch.from_numpy(idx)]
    images = np.empty((len(idx), *shape), np.uint8)
    for s in np.unique(shard_of):  # numpy fancy indexing, shard by shard
        pos = np.flatnonzero(shard_of == s)
        images[pos] = shards[s][local[pos]]
    return torch.from_numpy(images), torch.from_numpy(labels[idx])


def slice_batches(shards, per_shard: int, n: int, labels):
    """Batches in index order, as contiguous copies of shard ranges."""
    import torch

    for a in range(0, n, BATCH):
        b = min(n, a + BATCH)
        parts = []
        i = a
        while i < b:
            s, lo = divmod(i, per_shard)
            hi = min(per_shard, lo + (b - i))
            x = shards[s][lo:hi]
            parts.append(x.clone() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
            i += hi - lo
        y = labels[a:b]
        y = y.clone() if isinstance(y, torch.Tensor) else torch.from_numpy(np.array(y))
        yield (parts[0] if len(parts) == 1 else torch.cat(parts)), y


def stack_batches(samples, shape):
    """Batches of BATCH from an iterator of (image bytes-like, label int)."""
    import torch

    buf_i, buf_l = [], []
    for img, lab in samples:
        buf_i.append(np.frombuffer(img, np.uint8))
        buf_l.append(lab)
        if len(buf_i) == BATCH:
            yield torch.from_numpy(np.stack(buf_i).reshape(-1, *shape)), torch.tensor(buf_l, dtype=torch.int64)
            buf_i, buf_l = [], []
    if buf_i:
        yield torch.from_numpy(np.stack(buf_i).reshape(-1, *shape)), torch.tensor(buf_l, dtype=torch.int64)


def per_shard_count(shape) -> int:
    return SHARD_BYTES // (int(np.prod(shape)) + 8)


# -- writers: (images, labels, folder) -> None; each writes about 64 MB shards ---------------------------------
def write_safetensors(images, labels, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    per = per_shard_count(images.shape[1:])
    for k, a in enumerate(range(0, len(images), per)):
        save_file({"images": torch.from_numpy(images[a:a + per]), "labels": torch.from_numpy(labels[a:a + per])},
                  str(folder / f"shard-{k:05d}.safetensors"), metadata={"first_index": str(a)})


def write_npy(images, labels, folder: Path) -> None:
    per = per_shard_count(images.shape[1:])
    for k, a in enumerate(range(0, len(images), per)):
        np.save(folder / f"images-{k:05d}.npy", images[a:a + per])
        np.save(folder / f"labels-{k:05d}.npy", labels[a:a + per])


def write_tar(images, labels, folder: Path) -> None:
    import webdataset as wds

    with wds.ShardWriter(str(folder / "shard-%05d.tar"), maxsize=SHARD_BYTES, maxcount=10**9, verbose=0) as sink:
        for i in range(len(images)):
            sink.write({"__key__": f"{i:09d}", "img": images[i].tobytes(), "cls": str(int(labels[i])).encode()})
    counts = []  # what wids needs, and so part of writing: each shard's path and sample count (tar headers only)
    for path in sorted(folder.glob("shard-*.tar")):
        with tarfile.open(path) as tar:
            counts.append({"url": str(path), "nsamples": sum(1 for m in tar if m.name.endswith(".img"))})
    (folder / "shards.json").write_text(json.dumps(counts))


def write_mds(images, labels, folder: Path) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(folder), columns={"image": "bytes", "label": "int64"}, size_limit=SHARD_BYTES,
                   compression=None, progress_bar=False) as out:
        for i in range(len(images)):
            out.write({"image": images[i].tobytes(), "label": int(labels[i])})


def write_arrow(images, labels, folder: Path) -> None:
    from datasets import Array3D, Dataset, Features, Value

    features = Features({"image": Array3D(shape=images.shape[1:], dtype="uint8"), "label": Value("int64")})
    ds = Dataset.from_dict({"image": images, "label": labels}, features=features)
    ds.save_to_disk(str(folder), max_shard_size=SHARD_BYTES)


_SOURCE = None


def _litdata_sample(i: int) -> dict:
    return {"image": _SOURCE[0][i], "label": int(_SOURCE[1][i])}


def write_litdata(images, labels, folder: Path) -> None:
    global _SOURCE
    from litdata import optimize

    _SOURCE = (images, labels)
    optimize(fn=_litdata_sample, inputs=list(range(len(images))), output_dir=str(folder), chunk_bytes=SHARD_BYTES,
             num_workers=1, mode="overwrite", verbose=False, start_method="fork")


# -- readers: each has open(folder, n, shape) -> handle; random(handle, idx) -> (images, labels) or None;
#    sequential(handle) -> iterator of (images, labels) in index order ------------------------------------------
class SafetensorsOpen:
    """safe_open per shard; its tensors are memory-mapped. Labels of all shards are held in one small tensor."""

    packages = ("safetensors",)

    def open(self, folder, n, shape):
        import torch
        from safetensors import safe_open

        self.handles = [safe_open(str(f), framework="pt") for f in sorted(folder.glob("shard-*.safetensors"))]
        self._hold([h.get_tensor("images") for h in self.handles], [h.get_tensor("labels") for h in self.handles],
                   n, shape)
        self.labels = torch.cat(self.labels)

    def _hold(self, images, labels, n, shape):
        self.shards, self.labels, self.per, self.n, self.shape = images, labels, len(images[0]), n, shape

    def random(self, idx):
        return gather(self.shards, self.per, idx, self.shape, self.labels)

    def sequential(self):
        return slice_batches(self.shards, self.per, self.n, self.labels)


class SafetensorsLoadFile(SafetensorsOpen):
    """safetensors.torch.load_file per shard (in safetensors 0.8 also memory-mapped by default)."""

    def open(self, folder, n, shape):
        import torch
        from safetensors.torch import load_file

        loaded = [load_file(str(f)) for f in sorted(folder.glob("shard-*.safetensors"))]
        self._hold([d["images"] for d in loaded], [d["labels"] for d in loaded], n, shape)
        self.labels = torch.cat(self.labels)


class Npy(SafetensorsOpen):
    packages = ("numpy",)

    def open(self, folder, n, shape):
        images = [np.load(p, mmap_mode="r") for p in sorted(folder.glob("images-*.npy"))]
        labels = np.concatenate([np.load(p) for p in sorted(folder.glob("labels-*.npy"))])
        self._hold(images, labels, n, shape)


class TarSequential:
    packages = ("webdataset",)

    def open(self, folder, n, shape):
        import webdataset as wds

        self.urls = [str(p) for p in sorted(folder.glob("shard-*.tar"))]
        self.wds, self.shape = wds, shape

    random = None  # a tar stream has no index

    def sequential(self):
        ds = self.wds.WebDataset(self.urls, shardshuffle=False, empty_check=False)
        return stack_batches(((s["img"], int(s["cls"])) for s in ds), self.shape)


class TarWids:
    packages = ("webdataset", "wids")

    def open(self, folder, n, shape):
        import wids

        shards = json.loads((folder / "shards.json").read_text())
        self.ds = wids.ShardListDataset(shards, localname=lambda url: url, transformations=[], lru_size=64)
        self.n, self.shape = n, shape

    def _pairs(self, indices):
        for i in indices:
            s = self.ds[int(i)]
            yield s[".img"].getbuffer(), int(s[".cls"].getvalue())

    def random(self, idx):
        return next(stack_batches(self._pairs(idx), self.shape))

    def sequential(self):
        return stack_batches(self._pairs(range(self.n)), self.shape)


class Mds:
    packages = ("mosaicml-streaming",)

    def open(self, folder, n, shape):
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        if getattr(self, "ds", None) is not None:
            del self.ds
        clean_stale_shared_memory()
        self.ds = StreamingDataset(local=str(folder), remote=None, shuffle=False, batch_size=BATCH)
        self.n, self.shape = n, shape

    def random(self, idx):
        return next(stack_batches(((s["image"], s["label"]) for s in map(self.ds.get_item, idx.tolist())), self.shape))

    def sequential(self):
        return stack_batches(((s["image"], s["label"]) for s in self.ds), self.shape)


class Arrow:
    """with_format("numpy") as documented; it returns the uint8 images as int64 (huggingface/datasets#5834)."""

    packages = ("datasets",)

    def open(self, folder, n, shape):
        from datasets import load_from_disk

        self.ds = load_from_disk(str(folder)).with_format("numpy")
        self.n = n

    def random(self, idx):
        import torch

        b = self.ds[idx.tolist()]
        return torch.from_numpy(b["image"]), torch.from_numpy(b["label"])

    def sequential(self):
        import torch

        for a in range(0, self.n, BATCH):
            b = self.ds[a:a + BATCH]
            yield torch.from_numpy(b["image"]), torch.from_numpy(b["label"])


class ArrowUint8(Arrow):
    """The image column formatted with dtype=uint8, the labels as int64."""

    def open(self, folder, n, shape):
        from datasets import load_from_disk

        ds = load_from_disk(str(folder))
        self.ds = ds.with_format("numpy", columns=["image"], dtype=np.uint8, output_all_columns=True)
        self.n = n

    def random(self, idx):
        import torch

        b = self.ds[idx.tolist()]
        return torch.from_numpy(b["image"]), torch.tensor(b["label"], dtype=torch.int64)

    def sequential(self):
        import torch

        for a in range(0, self.n, BATCH):
            b = self.ds[a:a + BATCH]
            yield torch.from_numpy(b["image"]), torch.tensor(b["label"], dtype=torch.int64)


class Litdata:
    packages = ("litdata",)

    def open(self, folder, n, shape):
        from litdata import StreamingDataset

        # batch_decode=0: decode the row asked for; the default ("auto") decodes a window of up to 256 rows around
        # it, made for sequential reads, which makes each random index cost a whole window
        self.ds = StreamingDataset(input_dir=str(folder), shuffle=False, batch_decode=0)
        self.n, self.shape = n, shape

    def _pairs(self, samples):
        for s in samples:
            yield s["image"], s["label"]

    def random(self, idx):
        return next(stack_batches(self._pairs(self.ds[int(i)] for i in idx), self.shape))

    def sequential(self):
        return stack_batches(self._pairs(iter(self.ds)), self.shape)


# name: (storage, reader class, built-in checksum, remote storage, notes) -- checksums and remote storage from
# each package's source, not measured
STORAGES = {"safetensors": write_safetensors, "npy": write_npy, "tar": write_tar, "mds": write_mds,
            "arrow": write_arrow, "litdata": write_litdata}
FORMATS = {
    "safetensors safe_open": ("safetensors", SafetensorsOpen, "none over the data (header offsets are checked)",
                              "none: fetch the files yourself", "one file per shard: images and labels"),
    "safetensors load_file": ("safetensors", SafetensorsLoadFile, "as above", "as above", "same files as above"),
    "npy mmap": ("npy", Npy, "none", "none: fetch the files yourself", "two files per shard: images, labels"),
    "webdataset tar": ("tar", TarSequential, "none over the data (tar headers only)",
                       "any URL or pipe: command, streamed", "no index: sequential streams only (random order "
                       "only through a shuffle buffer)"),
    "webdataset tar + wids": ("tar", TarWids, "optional md5 per shard in the shard list",
                              "downloads whole shards into a local cache",
                              "wids, a separate package (0.1.x), indexes each tar when opened and memory-maps it"),
    "mosaicml MDS": ("mds", Mds, "optional per-shard hashes in index.json, checked only when a shard is downloaded",
                     "S3, GCS, Azure, OCI and more: whole shards into a local cache",
                     "`import streaming` imports transformers and torchvision; random access through "
                     "StreamingDataset.get_item"),
    "HF datasets Arrow, numpy format": ("arrow", Arrow,
                                        "none in save_to_disk output (a fingerprint, not a checksum)",
                                        "load_from_disk from an fsspec URL copies the whole dataset locally first",
                                        "Array3D uint8 images; with_format('numpy') returns them as int64 "
                                        "(8x the bytes; huggingface/datasets#5834, #7254)"),
    "HF datasets Arrow, numpy uint8": ("arrow", ArrowUint8, "as above", "as above",
                                       "with_format('numpy', columns=['image'], dtype=np.uint8, "
                                       "output_all_columns=True)"),
    "LitData": ("litdata", Litdata, "none", "S3, GCS, Azure: chunks fetched on demand into a local cache",
                "read with batch_decode=0; the default ('auto') decodes a window of up to 256 rows around "
                "each index asked for"),
}
IMPORTS = {"safetensors": "safetensors", "numpy": "numpy", "webdataset": "webdataset", "wids": "wids",
           "mosaicml-streaming": "streaming", "datasets": "datasets", "litdata": "litdata"}


# -- measurements inside a child process -----------------------------------------------------------------------
def _closure(names) -> dict[str, int]:
    """Installed distributions needed by `names` (requirements without extras, recursively): name -> bytes."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    seen: dict[str, int] = {}
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = sum(f.locate().stat().st_size for f in (dist.files or []) if f.locate().is_file())
        for req in dist.requires or []:
            if Requirement is not None:
                r = Requirement(req)
                if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                    continue
                todo.append(r.name)
            elif "extra ==" not in req:
                todo.append(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0]
                            .split("~")[0].strip())
    return seen


def dependency_weight(packages) -> dict:
    base = _closure(["torch", "numpy"])
    mine = _closure(packages)
    extra = {k: v for k, v in mine.items() if k not in base}
    return {"distributions_beyond_torch_numpy": len(extra), "mb_beyond_torch_numpy": sum(extra.values()) / 1e6,
            "beyond_torch_numpy": sorted(extra)}


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _anon_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def child_write(storage: str, work: Path) -> dict:
    images = np.load(work / "source_images.npy")
    labels = np.load(work / "source_labels.npy")
    folder = work / storage
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    STORAGES[storage](images, labels, folder)
    write_s = time.perf_counter() - t0
    files = _files(folder)
    return {"write_s": write_s, "bytes_on_disk": sum(p.stat().st_size for p in files), "files": len(files),
            "data_files_mb": sorted({round(p.stat().st_size / 1e6, 1) for p in files if p.stat().st_size > 1e6})}


def child_read(name: str, work: Path) -> dict:
    import torch

    torch.set_num_threads(1)  # one reading process; also keeps a busy machine's thread waits out of the figures

    storage, cls, *_ = FORMATS[name]
    reader = cls()
    t0 = time.perf_counter()
    for pkg in reader.packages:
        __import__(IMPORTS[pkg])
    r: dict = {"import_s": time.perf_counter() - t0, "load_average_1min": os.getloadavg()[0]}
    anon0 = _anon_mib()
    source = np.load(work / "source_images.npy", mmap_mode="r")
    labels = np.load(work / "source_labels.npy")
    n, shape = source.shape[0], tuple(source.shape[1:])
    r["images"] = n
    folder = work / storage
    files = _files(folder)
    r["warm_mb"] = sum(len(p.read_bytes()) for p in files) / 1e6  # page cache warm for every format alike

    opens = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        reader.open(folder, n, shape)
        opens.append(time.perf_counter() - t0)
    r["open_s"] = statistics.median(opens)

    # round trip: one whole sequential pass, and random access at shard edges and a few seeded indices
    problems = []
    seen = 0
    for x, y in reader.sequential():
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != shape:
            problems.append(f"sequential batch at {seen}: {x.dtype} {tuple(x.shape)}")
            break
        b = seen + len(x)
        if not (np.array_equal(x.numpy(), source[seen:b]) and np.array_equal(y.numpy(), labels[seen:b])):
            problems.append(f"sequential batch {seen}..{b}: bytes differ")
            break
        seen = b
    if seen != n and not problems:
        problems.append(f"sequential pass gave {seen} samples, not {n}")
    per = per_shard_count(shape)
    check = np.unique(np.concatenate([[0, n - 1], [e for k in range(per, n, per) for e in (k - 1, k)],
                                      np.random.default_rng(1).integers(0, n, 8)]))
    check = np.random.default_rng(2).permutation(check).astype(np.int64)
    r["random_access"] = reader.random is not None
    if reader.random is not None:
        x, y = reader.random(check)
        if x.dtype != torch.uint8 or tuple(x.shape) != (len(check), *shape):
            problems.append(f"random batch: {x.dtype} {tuple(x.shape)}")
        elif not (np.array_equal(x.numpy(), source[check]) and np.array_equal(y.numpy(), labels[check])):
            problems.append(f"random indices {check.tolist()}: bytes differ")
    r["round_trip"] = not problems
    r["round_trip_problems"] = problems
    r["checked_random_indices"] = check.tolist() if reader.random is not None else []

    perm = np.random.default_rng(0).permutation(n).astype(np.int64)
    if reader.random is not None:
        epochs = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            got = 0
            for a in range(0, n, BATCH):
                x, _ = reader.random(perm[a:a + BATCH])
                got += len(x)
            epochs.append(time.perf_counter() - t0)
        assert got == n
        r["random_epoch_s"] = epochs
        r["random_images_per_s"] = n / statistics.median(epochs)
    passes = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        got = sum(len(x) for x, _ in reader.sequential())
        passes.append(time.perf_counter() - t0)
    r["sequential_pass_s"] = passes
    r["sequential_images_per_s"] = got / statistics.median(passes)
    anon1 = _anon_mib()
    r["private_memory_mib_added"] = None if anon0 is None or anon1 is None else anon1 - anon0

    t0 = time.perf_counter()
    for p in files:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    r["sha256_all_files_s"] = time.perf_counter() - t0
    r["dependencies"] = dependency_weight(reader.packages)
    return r


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for d in ("torch", "numpy", "safetensors", "webdataset", "wids", "mosaicml-streaming", "datasets", "pyarrow",
              "litdata"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def _child(spec: str, work: Path) -> None:
    kind, name = spec.split(":", 1)
    try:
        r = child_write(name, work) if kind == "write" else child_read(name, work)
        r["versions"] = versions()
    except Exception as e:  # a row with the error, not a crash of the whole benchmark
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(r))


# -- the parent ------------------------------------------------------------------------------------------------
def combine(rounds: list[dict]) -> dict:
    """One format's read figures over the rounds: medians of every epoch and pass timed, all round trips."""
    bad = [r for r in rounds if "error" in r]
    if bad:
        return {**bad[0], "rounds_failed": len(bad), "rounds": len(rounds)}
    first = rounds[0]
    out = {k: first[k] for k in ("random_access", "dependencies", "warm_mb", "checked_random_indices", "images")}
    out["round_trip"] = all(r["round_trip"] for r in rounds)
    out["round_trip_problems"] = sorted({p for r in rounds for p in r["round_trip_problems"]})
    for key in ("import_s", "open_s", "sha256_all_files_s"):
        out[key] = statistics.median(r[key] for r in rounds)
    out["private_memory_mib_added"] = max((r["private_memory_mib_added"] for r in rounds
                                           if r["private_memory_mib_added"] is not None), default=None)
    for kind, key in (("random", "random_epoch_s"), ("sequential", "sequential_pass_s")):
        times = [t for r in rounds for t in r.get(key, [])]
        out[key] = times
        if times:
            out[f"{kind}_images_per_s"] = first["images"] / statistics.median(times)
    out["load_average_1min"] = [r["load_average_1min"] for r in rounds]
    out["rounds"] = len(rounds)
    return out


def run_child(python: str, spec: str, work: Path, timeout: float) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--child", spec, "--work-dir", str(work)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit code {p.returncode}, no result", "stderr_tail": p.stderr[-3000:]}
    r = json.loads(lines[-1][len("RESULT "):])
    r["process_s"] = time.perf_counter() - t0
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=20000, help="images to write [default: 20000]")
    p.add_argument("--shape", default="3,73,73", help="C,H,W of every image [default: 3,73,73]")
    p.add_argument("--only", default="", help="comma-separated storages: " + ", ".join(STORAGES))
    p.add_argument("--python", action="append", default=[], metavar="STORAGE=EXE",
                   help="interpreter for one storage's processes (repeatable) [default: this one]")
    p.add_argument("--rounds", type=int, default=3, help="times each format is read, in a fresh process each, "
                   "the formats taking turns [default: 3]")
    p.add_argument("--timeout", type=float, default=240, help="seconds for each child process [default: 240]")
    p.add_argument("--work-dir", type=Path, default=None, help="where the shards go [default: a temporary folder]")
    p.add_argument("--out", type=Path, default=HERE / "results" / "shard_formats_cpu.json")
    p.add_argument("--note", action="append", default=[], help="text kept in the JSON's meta (repeatable), "
                   "e.g. how the packages were installed")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.work_dir)
        return 0

    shape = tuple(int(v) for v in args.shape.split(","))
    only = [s for s in args.only.split(",") if s] or list(STORAGES)
    pythons = dict(s.split("=", 1) for s in args.python)
    started = time.perf_counter()
    load_before = os.getloadavg()
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="shard-formats-")
        work = Path(tmp.name)
    else:
        work = args.work_dir
        work.mkdir(parents=True, exist_ok=True)
    try:
        images, labels = make_images(args.images, shape)
        np.save(work / "source_images.npy", images)
        np.save(work / "source_labels.npy", labels)
        raw = images.nbytes + labels.nbytes
        sample = images[:1000].tobytes()
        compressibility = len(sample) / len(zlib.compress(sample, 1))
        print(f"{args.images} images {shape}, {raw / 1e6:.1f} MB raw, shards of {SHARD_BYTES / 2**20:.0f} MiB; "
              f"work folder {work}", flush=True)
        del images, labels
        writes = {}
        for storage in only:
            python = pythons.get(storage, sys.executable)
            w = run_child(python, f"write:{storage}", work, args.timeout)
            print(f"write {storage}: " + (w.get("error") or f"{w['write_s']:.1f} s, {w['bytes_on_disk'] / 1e6:.1f} MB"),
                  flush=True)
            writes[storage] = (python, w)
        names = [name for name, spec in FORMATS.items() if spec[0] in writes]
        rounds: dict = {name: [] for name in names}
        for k in range(args.rounds):  # formats interleaved: a burst of other work hits one round, not one format
            for name in names:
                python, w = writes[FORMATS[name][0]]
                rd = {"error": "not written"} if "error" in w else run_child(python, f"read:{name}", work,
                                                                               args.timeout)
                rounds[name].append(rd)
                said = rd.get("error") or (f"round trip {rd['round_trip']}, random "
                                           f"{rd.get('random_images_per_s', 0):.0f}/s, "
                                           f"sequential {rd['sequential_images_per_s']:.0f}/s")
                print(f"round {k + 1} read {name}: {said}", flush=True)
        results: dict = {}
        for name in names:
            storage, _cls, checksum, remote, notes = FORMATS[name]
            python, w = writes[storage]
            results[name] = {"storage": storage, "python": python, "write": w, "builtin_checksum": checksum,
                             "remote_storage": remote, "notes": notes, "read": combine(rounds[name])}
    finally:
        if tmp is not None:
            tmp.cleanup()

    ref = results.get("safetensors safe_open", {}).get("read", {}).get("random_images_per_s")
    for row in results.values():
        rd = row["read"]
        if ref and "error" not in rd:
            rd["random_x"] = rd["random_images_per_s"] / ref if rd.get("random_images_per_s") else None
            rd["sequential_x"] = rd["sequential_images_per_s"] / ref

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    print("\n| format | round trip | random access img/s | x | sequential img/s | x | write s | MB on disk | open ms "
          "| sha256 all s | private MiB added | import s | deps beyond torch+numpy |\n|" + "---|" * 13)
    for name, row in results.items():
        w, rd = row["write"], row["read"]
        if "error" in rd:
            print(f"| {name} | fail: {(w.get('error') or rd['error'])[:80]} |" + " |" * 11)
            continue
        dep = rd["dependencies"]
        print(f"| {name} | {'yes' if rd['round_trip'] else 'FAIL'} | "
              f"{f(rd.get('random_images_per_s'), '.0f') if rd['random_access'] else 'none'} | "
              f"{f(rd.get('random_x'), '.2f')} | {rd['sequential_images_per_s']:.0f} | "
              f"{f(rd.get('sequential_x'), '.2f')} | "
              f"{w['write_s']:.1f} | {w['bytes_on_disk'] / 1e6:.1f} | {rd['open_s'] * 1e3:.1f} | "
              f"{rd['sha256_all_files_s']:.2f} | {f(rd['private_memory_mib_added'], '.0f')} | {rd['import_s']:.2f} | "
              f"{dep['distributions_beyond_torch_numpy']} ({dep['mb_beyond_torch_numpy']:.0f} MB) |")
    print(f"\nx: against safetensors safe_open's random-access images/s ({f(ref, '.0f')}/s). "
          f"Whole run {time.perf_counter() - started:.0f} s.")

    command = [a for i, a in enumerate(sys.argv) if a != "--note" and (i == 0 or sys.argv[i - 1] != "--note")]
    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(command), "images": args.images,
            "shape": list(shape), "batch": BATCH, "repeats": REPEATS, "rounds": args.rounds, "shard_bytes": SHARD_BYTES,
            "raw_mb": raw / 1e6, "zlib_level1_ratio_first_1000_images": compressibility,
            "machine": {"platform": platform.platform(), "machine": platform.machine(),
                        "processor": platform.processor(), "python": platform.python_version(),
                        "cpu_count": os.cpu_count()},
            "versions": versions(), "whole_run_s": time.perf_counter() - started,
            "load_average_1_5_15min": {"start": load_before, "end": os.getloadavg()},
            "notes": args.note,
            "ratios": "random_x and sequential_x: images/s over safetensors safe_open's random-access images/s"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all("error" not in r["read"] for r in results.values()) else 1  # a failed round trip is a finding


if __name__ == "__main__":
    sys.exit(main())
