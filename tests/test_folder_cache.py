"""Image folders are checked once: what a run learned (each file's check, the decoded pixels) is kept under
--cache-dir and reused by the next run over the same folder, which reads only the files that changed."""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import run_cli, train_cli
from scaletrain.data.sources import folder as sources
from scaletrain.cli import main
from scaletrain.config import DataConfig
from scaletrain.data import ImageSet, load_image_sets
from scaletrain.errors import UserError
from scaletrain.data import ImageFiles


def _photo(seed: int, w: int = 96, h: int = 72) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * (seed % 5 + 1)) % 256, (y * 3) % 256, (x + y + 40 * seed) % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(0, 30, base.shape), 0, 255).astype(np.uint8))


def _photo_folder(root, count: int, classes: int, quality: int = 90, **size):
    """`count` JPEGs of _photo(i) (its `size`), the i-th in root/class_<i % classes>/<i>.jpg."""
    for i in range(count):
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        _photo(i, **size).save(folder / f"{i:03d}.jpg", quality=quality)
    return root


@pytest.fixture
def photos(tmp_path):
    """24 colour JPEGs of 96 x 72 px in three class folders (photos, as far as the recipe is concerned)."""
    return _photo_folder(tmp_path / "photos", 24, 3)


@pytest.fixture
def reads(monkeypatch):
    """The files the folder's check opened (to decode them, or only to check them), in order."""
    opened = []

    def counting(real):
        def read(path, *args, **kwargs):
            opened.append(os.path.basename(path))
            return real(path, *args, **kwargs)
        return read

    monkeypatch.setattr(sources, "read_image", counting(sources.read_image))
    monkeypatch.setattr(sources, "check_image", counting(sources.check_image))
    return opened


def _load(root, cache, **kw):
    return load_image_sets(DataConfig(data=str(root), image_size=32, cache_dir=str(cache), **kw), seed=0)


@pytest.mark.parametrize("in_memory", ["yes", "no"])
def test_a_second_run_over_the_same_folder_reads_no_file_and_gets_the_same_data(photos, tmp_path, reads,
                                                                                 in_memory):
    first = _load(photos, tmp_path / "cache", data_on_device=in_memory)
    assert len(reads) == 24
    reads.clear()
    second = _load(photos, tmp_path / "cache", data_on_device=in_memory)
    assert reads == []
    for a, b in zip(first, second):
        assert type(a) is type(b) is (ImageSet if in_memory == "yes" else ImageFiles)
        if in_memory == "yes":
            assert a.recipe == "photo" and a.images.shape[1:] == (3, 36, 36)  # 32 / 0.875: room for the crop
            assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
        else:
            assert a.paths == b.paths and list(a.labels) == list(b.labels)


def test_only_changed_and_new_files_are_read_again(photos, tmp_path, reads):
    _load(photos, tmp_path / "cache", data_on_device="yes")
    changed, added = photos / "class_1" / "004.jpg", photos / "class_2" / "100.jpg"
    _photo(99).save(changed, quality=50)
    os.utime(changed, ns=(1, 1))  # another size and time
    _photo(100).save(added)
    (photos / "class_0" / "000.jpg").unlink()
    reads.clear()
    train, val = _load(photos, tmp_path / "cache", data_on_device="yes")
    assert sorted(reads) == ["004.jpg", "100.jpg"]
    fresh, fresh_val = _load(photos, tmp_path / "other-cache", data_on_device="yes")
    assert torch.equal(torch.cat([train.images, val.images]), torch.cat([fresh.images, fresh_val.images]))


def test_a_bad_file_remembered_as_bad_is_still_refused_by_name_without_reading_it(photos, tmp_path, reads):
    bad = photos / "class_2" / "005.jpg"
    bad.write_bytes(bad.read_bytes()[:600])  # cut short in the scan
    for attempt in range(2):
        reads.clear()
        with pytest.raises(UserError, match="005.jpg: corrupt image"):
            _load(photos, tmp_path / "cache", data_on_device="no")
    assert "005.jpg" not in reads  # the second time, the index said why


def test_an_unwritable_cache_is_a_note_and_the_data_folder_is_only_read(photos, tmp_path, capsys):
    before = sorted((p.relative_to(photos), p.stat().st_mtime_ns) for p in photos.rglob("*"))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    train, val = _load(photos, not_a_folder, data_on_device="yes")
    assert len(train) + len(val) == 24
    assert "cannot keep what was learned" in capsys.readouterr().err
    assert sorted((p.relative_to(photos), p.stat().st_mtime_ns) for p in photos.rglob("*")) == before


def test_a_damaged_cache_is_rebuilt(photos, tmp_path, reads):
    first = _load(photos, tmp_path / "cache", data_on_device="yes")
    for f in (tmp_path / "cache").rglob("*.json"):
        f.write_text("{not json")
    for f in (tmp_path / "cache").rglob("*.npy"):
        f.write_bytes(b"garbage")
    reads.clear()
    again = _load(photos, tmp_path / "cache", data_on_device="yes")
    assert len(reads) == 24 and torch.equal(first[0].images, again[0].images)


@pytest.mark.slow
def test_train_then_evaluate_reuse_the_check_and_give_the_validation_figures(photos, tmp_path, capsys):
    run = tmp_path / "run"
    common = ["--model", "tinycnn", "--image-size", "32", "--epochs", "1", "--batch-size", "8",
              "--cache-dir", str(tmp_path / "cache")]
    assert main(["train", "--data", str(photos), *common, "--output-dir", str(run)]) == 0
    out = capsys.readouterr().out
    val_loss = float(out.split("val_loss ")[1].split()[0])
    assert main(["evaluate", "--checkpoint", str(run), "--data", str(photos), "--split", "val"]) == 0
    assert f"loss {val_loss:.4f}" in capsys.readouterr().out


@pytest.fixture(scope="module")
def large_photos(tmp_path_factory):
    """400 colour JPEGs in four class folders: at --image-size 224 (kept at 256 x 256 for the crop) they take
    79 MB decoded, over the 64 MiB a folder's check decodes in its own pass, as a large folder's do."""
    return _photo_folder(tmp_path_factory.mktemp("large") / "photos", 400, 4)


def _train(data, out, cache, *extra, expect=0):
    return train_cli(data, out, "--model", "tinycnn", "--image-size", "224", "--batch-size", "32", "--epochs", "1",
                     "--cache-dir", str(cache), *extra, expect=expect)


def _figures(run):
    header, *rows = [row.split(",") for row in (run / "metrics.csv").read_text().splitlines()]
    keep = [i for i, name in enumerate(header) if "loss" in name or "acc" in name]
    return [[row[i] for i in keep] for row in rows]


@pytest.mark.slow
def test_a_large_folders_first_run_trains_while_it_fills_the_cache_and_the_next_run_starts_from_it(large_photos,
                                                                                                 tmp_path):
    """The first step waits for one batch, not for a pass over the folder: lines say how much of the cache is
    written as the first epoch decodes (before the first step and after it), the last one when it is complete;
    the second run reads no image, says nothing of the cache, and trains to the same figures, bit for bit."""
    cache = tmp_path / "cache"
    lines = _train(large_photos, tmp_path / "first", cache).stdout.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("first step done"))
    progress = [i for i, line in enumerate(lines) if f"cache of {large_photos}: " in line]
    assert progress and progress[0] < first_step < progress[-1], lines
    assert "of 400 decoded images kept" in lines[progress[0]] and "%) as the training reads them" in \
        lines[progress[0]]
    assert lines[progress[-1]].endswith("its 400 decoded images kept (75 MiB); the next runs start from them")
    assert len(progress) <= 11  # a line per tenth at most, and the last
    assert [p.name for p in cache.rglob("*") if p.suffix in (".npy", ".tmp")] == ["pixels-photo-3x256x256.npy"]

    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    second = _train(large_photos, tmp_path / "second", cache).stdout
    assert "decoded images kept" not in second
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before  # read, not written again
    assert _figures(tmp_path / "first") == _figures(tmp_path / "second")


def _stopped_in_its_first_epoch(data, cache, out, fault: str) -> subprocess.CompletedProcess:
    """A first run stopped by `fault` (SCALETRAIN_FAULT) after its second batch of 50."""
    return run_cli("train", "--data", str(data), "--model", "tinycnn", "--image-size", "224", "--batch-size", "8",
                   "--epochs", "2", "--cache-dir", str(cache), "--output-dir", str(out),
                   env={"SCALETRAIN_FAULT": fault})


@pytest.mark.slow
def test_a_first_run_stopped_in_its_first_epoch_leaves_no_partial_cache_and_the_next_run_fills_it(large_photos,
                                                                                               tmp_path):
    """Ctrl-C in the first epoch removes the part of the cache written so far; a run killed outright leaves it,
    and the next run on this machine removes it before it fills the cache."""
    cache = tmp_path / "cache"
    pixel_files = lambda: [p.name for p in cache.rglob("*") if p.suffix in (".npy", ".tmp")]  # noqa: E731
    interrupted = _stopped_in_its_first_epoch(large_photos, cache, tmp_path / "a", "int:2")
    assert interrupted.returncode == 130 and "scaletrain: interrupted" in interrupted.stderr
    assert "decoded images kept" in interrupted.stdout, "a part of the cache was written before the stop"
    assert pixel_files() == []
    killed = _stopped_in_its_first_epoch(large_photos, cache, tmp_path / "b", "kill:2")
    assert killed.returncode == -signal.SIGKILL
    assert len(pixel_files()) == 1 and pixel_files()[0].endswith(".tmp")
    assert "its 400 decoded images kept" in _train(large_photos, tmp_path / "c", cache).stdout
    assert pixel_files() == ["pixels-photo-3x256x256.npy"]


def test_a_folder_larger_than_cache_memory_is_kept_decoded_on_disk_and_trains_bit_for_bit_as_held(photos, tmp_path):
    """--cache-memory below what the folder decodes to: nothing of the set is held; the first pass decodes and
    writes it to the cache, the next passes and the next run read it a batch at a time from there; the weights are
    those of the run that held the set in memory, bit for bit."""
    from safetensors.torch import load_file

    def train(name, cache, *extra):
        return _train(photos, tmp_path / name, cache, "--image-size", "32", "--epochs", "2", "--batch-size", "8",
                      *extra).stdout

    train("held", tmp_path / "held-cache")
    first = train("disk", tmp_path / "cache", "--cache-memory", "20KB")
    assert f"{photos}: its images decode to 0 MiB, more than --cache-memory (0 MiB): kept decoded in --cache-dir " \
           f"on disk, read a batch at a time" in first
    assert "its 24 decoded images kept" in first
    second = train("disk-again", tmp_path / "cache", "--cache-memory", "20KB")
    assert "kept decoded in --cache-dir on disk" in second and "decoded images kept" not in second
    held = load_file(str(tmp_path / "held" / "last.safetensors"))
    for name in ("disk", "disk-again"):
        weights = load_file(str(tmp_path / name / "last.safetensors"))
        assert all(weights[k].equal(held[k]) for k in held), name
    assert _figures(tmp_path / "disk-again") == _figures(tmp_path / "held")
    assert main(["train", "--data", str(photos), "--cache-memory", "lots", "--output-dir", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_two_processes_read_a_folder_larger_than_cache_memory_from_the_disk_as_if_held(photos, tmp_path):
    """Two processes: the launcher's check decodes the folder to the cache on disk once, a chunk at a time, and
    both read their shards from there; the weights are those of two processes holding the set, bit for bit."""
    from safetensors.torch import load_file

    def train(name, *extra):
        return _train(photos, tmp_path / name, tmp_path / f"cache-{name[:4]}", "--image-size", "32", "--epochs",
                      "1", "--batch-size", "8", "--nproc", "2", *extra).stdout

    train("held")
    out = train("disk", "--cache-memory", "20KB")
    assert "kept decoded in --cache-dir on disk" in out and "its 24 decoded images kept" in out
    held, disk = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("held", "disk"))
    assert all(disk[k].equal(held[k]) for k in held)


def test_a_second_runs_mapped_pixels_reach_a_device_a_chunk_at_a_time_as_they_are(photos, tmp_path):
    """A second run finds the folder's pixels in the cache, memory-mapped; a GPU reads them from the file a chunk
    at a time (the host never holds the set): the same bytes (here forced onto the CPU, the path a GPU takes)."""
    root = tmp_path / "split"
    for i, photo in enumerate(sorted(photos.rglob("*.jpg"))):  # train/ and val/: no split copies the sets
        (root / ("val" if i % 4 == 0 else "train") / photo.parent.name).mkdir(parents=True, exist_ok=True)
        photo.rename(root / ("val" if i % 4 == 0 else "train") / photo.parent.name / photo.name)
    _load(root, tmp_path / "cache")
    again, _ = _load(root, tmp_path / "cache")
    assert isinstance(again, ImageSet) and again.mapped is not None
    placed = again.placed_on(torch.device("cpu"), chunk=5, force=True)
    assert torch.equal(placed, again.images) and placed.data_ptr() != again.images.data_ptr()
    assert again.subset(torch.arange(3)).mapped is None  # a copy is no map


@pytest.fixture(scope="module")
def many_photos(tmp_path_factory):
    """600 colour JPEGs in three class folders, more than the 512 files a folder's check hands to worker
    processes; at --image-size 224 they decode to 118 MB, a large folder's first run."""
    return _photo_folder(tmp_path_factory.mktemp("many") / "photos", 600, 3, quality=80, w=48, h=36)


def test_a_folder_read_begun_ahead_is_the_read_itself_and_a_bad_file_is_refused_where_it_is_read(many_photos,
                                                                                               tmp_path):
    """`train` begins a large folder's first check while the model's code imports (read_ahead): what it reads is
    what a read from scratch gives, and a file that is not an image is refused by name when the run reads the
    data, not before; a read begun and not taken leaves no worker process behind."""
    import multiprocessing
    import shutil

    from scaletrain.data import read as reading
    from scaletrain.data import read_ahead, read_dataset

    def config(root, cache):
        return DataConfig(data=str(root), image_size=224, cache_dir=str(tmp_path / cache)).typed()

    at_once = read_dataset(config(many_photos, "a"))[0]
    with read_ahead(config(many_photos, "b")):
        ahead = read_dataset(config(many_photos, "b"))[0]
    assert isinstance(ahead, ImageFiles) and ahead.keep is not None  # checked only: the first pass decodes
    assert ahead.paths == at_once.paths and ahead.labels.tolist() == at_once.labels.tolist()
    assert sorted(ahead.keep.sample) == sorted(at_once.keep.sample) and len(ahead.keep.sample) > 0

    bad = shutil.copytree(many_photos, tmp_path / "bad")
    (bad / "class_1" / "301.jpg").write_bytes(b"not a JPEG")
    with read_ahead(config(bad, "c")):  # begins without a word
        with pytest.raises(UserError, match="301.jpg"):
            read_dataset(config(bad, "c"))
    with read_ahead(config(bad, "d")):  # not taken
        begun = reading._ahead[-1][1]
        assert begun.workers.pool is not None  # the check handed out before anything asked for the data
    assert begun.workers.pool is None and not reading._ahead and not multiprocessing.active_children()


def test_a_folder_lists_its_files_in_path_order_subfolders_included(tmp_path):
    """The listing's order is Path.parts' (a subfolder's files before the names that continue past its name), which
    the check's cache rows and the training's samples follow."""
    names = ["b-c.png", "b/x.png", "b/y/z.png", "b.png", "b0.png", "a b.png", "B.png", "b/-.png"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    listed = [os.path.relpath(path, tmp_path) for path, _ in sources.image_files_under(tmp_path)]
    assert listed == [str(p.relative_to(tmp_path)) for p in sorted(tmp_path / n for n in names)]
