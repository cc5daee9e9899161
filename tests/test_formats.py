"""Each data format read from small real data, and each kind of bad input refused on one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from scaletrain.cli import main
from scaletrain.config import DataConfig
from scaletrain.data import ImageSet, load_image_sets
from scaletrain.errors import UserError
from scaletrain.data.batches import DeviceBatches, FillingBatches, LoaderBatches, decode_all
from scaletrain.data.transforms import Preprocess
from scaletrain.data import ImageFiles, Skipped, types
from scaletrain.data.sources.idx import download_mnist
from scaletrain.data.sources.kaggle import read_digits_csv

from helpers import digit_pngs

CPU = torch.device("cpu")
HEADER = "label," + ",".join(f"pixel{i}" for i in range(784))


def _digits_csv(path, mnist, n, labelled=True):
    rows = [HEADER if labelled else HEADER.split(",", 1)[1]]
    for i in range(n):
        pixels = ",".join(map(str, mnist.images[i].flatten().tolist()))
        rows.append(f"{int(mnist.labels[i])},{pixels}" if labelled else pixels)
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def kaggle(tmp_path, mnist):
    folder = tmp_path / "digit-recognizer"
    folder.mkdir()
    _digits_csv(folder / "train.csv", mnist, 60)
    _digits_csv(folder / "test.csv", mnist, 5, labelled=False)
    return folder


@pytest.fixture
def image_folder(tmp_path, mnist):
    """Digits saved as PNG, JPEG, BMP and WebP in several sizes and modes, one subfolder per class."""
    root = tmp_path / "digits"
    for i in range(80):
        label = int(mnist.labels[i])
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(mnist.images[i, 0].numpy())
        img = [img, img.convert("RGB").resize((40, 40)), img.convert("P"), img.convert("RGBA").resize((31, 20))][i % 4]
        img.save(folder / f"{i}.{['png', 'jpg', 'bmp', 'webp'][i % 4]}")
    (root / "class_0" / "notes.txt").write_text("not an image and ignored")
    return root


def _image_bytes(images) -> list[bytes]:
    return sorted(x.numpy().tobytes() for x in images)


def test_kaggle_train_csv_splits_into_48_and_12_of_ten_digit_classes(kaggle):
    train, val = load_image_sets(str(kaggle))
    assert (len(train), len(val)) == (48, 12) and train.classes == [str(i) for i in range(10)]


def test_kaggle_train_csv_holds_the_original_images_and_labels(kaggle, mnist):
    train, val = load_image_sets(str(kaggle))
    both = torch.cat([train.images, val.images])
    assert _image_bytes(both) == _image_bytes(mnist.images[:60])
    assert sorted(torch.cat([train.labels, val.labels]).tolist()) == sorted(mnist.labels[:60].tolist())


def test_kaggle_test_csv_reads_as_unlabelled_images(kaggle, mnist):
    images, labels = read_digits_csv(kaggle / "test.csv", labelled=False)
    assert labels is None and torch.equal(torch.from_numpy(images), mnist.images[:5, 0])


def test_image_folder_reads_every_image_of_any_format_with_its_folder_as_class(image_folder):
    train, val = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1, data_on_device="no"))
    assert isinstance(train, ImageFiles) and len(train) + len(val) == 80
    assert train.classes == sorted(train.classes) and all(c.startswith("class_") for c in train.classes)
    assert all(not p.endswith(".txt") for p in train.paths)


@pytest.mark.parametrize("channels, size", [(1, 28), (3, 32)])
def test_image_folder_decodes_any_size_and_mode_to_the_asked_channels_and_size(image_folder, channels, size):
    train, _ = load_image_sets(DataConfig(data=str(image_folder), image_size=size, channels=channels))
    shapes = {(tuple(x.shape), x.dtype) for x, _ in (train[i] for i in range(len(train)))}
    assert shapes == {((channels, size, size), torch.uint8)}


def test_lossless_grey_png_decodes_to_the_original_pixels(image_folder, mnist):
    train, _ = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1, data_on_device="no"))
    pngs = [p for p in train.paths if p.endswith(".png")]
    assert pngs
    for png in pngs:
        assert torch.equal(train[train.paths.index(png)][0][0], mnist.images[int(Path(png).stem), 0]), png


@pytest.mark.parametrize("recipe", ["digits", "photo"])
def test_folder_kept_in_memory_is_checked_then_decoded_once_and_held_by_the_next_run(image_folder, tmp_path, recipe,
                                                                                    large_sets):
    """A large folder's first run only checks its files (every one, before training); the pixels its first pass
    decodes are kept, and the next run starts from them: the same pixels the files decode to."""
    cfg = dict(data=str(image_folder), image_size=24, channels=3, recipe=recipe, cache_dir=str(tmp_path))
    files, files_val = load_image_sets(DataConfig(**cfg, data_on_device="no"))
    first, first_val = load_image_sets(DataConfig(**cfg, data_on_device="yes"))
    assert isinstance(files, ImageFiles) and files.keep is None
    assert isinstance(first, ImageFiles) and first.keep is not None  # checked, not decoded
    decoded = [part.in_memory() for part in (first, first_val)]  # what the first pass decodes, and keeps
    assert [torch.equal(again.images, d.images) for again, d in zip((first.in_memory(), first_val.in_memory()),
                                                                     decoded)] == [True, True]  # a second fit
    second, second_val = load_image_sets(DataConfig(**cfg, data_on_device="yes"))
    assert isinstance(second, ImageSet) and second.recipe == recipe
    for lazy, held, cached in zip((files, files_val), decoded, (second, second_val)):
        assert torch.equal(torch.stack([lazy[i][0] for i in range(len(lazy))]), held.images)
        assert torch.equal(held.images, cached.images)
        assert torch.equal(torch.as_tensor(lazy.labels), cached.labels)


def test_a_first_run_cut_short_after_the_training_split_was_kept_starts_the_next_from_both(tmp_path, mnist,
                                                                                           large_sets):
    for split, rows in (("train", range(0, 40)), ("val", range(40, 50))):
        digit_pngs(tmp_path / "digits" / split, mnist, rows)
    cfg = DataConfig(data=str(tmp_path / "digits"), image_size=28, cache_dir=str(tmp_path / "cache"))
    train, val = load_image_sets(cfg)
    kept = train.in_memory()  # the first epoch's training pass ended; its validation did not
    again, again_val = load_image_sets(cfg)
    assert isinstance(again, ImageSet) and isinstance(again_val, ImageSet) and torch.equal(again.images, kept.images)
    assert torch.equal(again_val.images, torch.stack([val[i][0] for i in range(len(val))]))


def test_a_large_folders_small_validation_split_is_decoded_by_its_first_pass_too_with_the_same_results(
        tmp_path, mnist, monkeypatch):
    """Whether the check decodes is decided for the whole folder: a validation split small on its own is not decoded
    before the first step of a large folder either. Its first pass streams and keeps it, and the next run (from
    the kept pixels) trains and validates to the same figures."""
    for split, rows in (("train", range(0, 40)), ("val", range(40, 50))):
        digit_pngs(tmp_path / "digits" / split, mnist, rows)
    monkeypatch.setattr(types, "WHOLE_SET_BYTES", 30 * 28 * 28)  # the folder is large, its validation split not
    cfg = DataConfig(data=str(tmp_path / "digits"), image_size=28, channels=1, cache_dir=str(tmp_path / "cache"))
    train, val = load_image_sets(cfg)
    assert [type(s).__name__ for s in (train, val)] == ["ImageFiles", "ImageFiles"] and val.keep is not None
    flags = ["train", "--data", cfg.data, "--model", "tinycnn", "--epochs", "2", "--image-size", "28", "--channels",
             "1", "--batch-size", "8", "--cache-dir", cfg.cache_dir]
    assert main([*flags, "--output-dir", str(tmp_path / "first")]) == 0
    again, again_val = load_image_sets(cfg)
    assert isinstance(again_val, ImageSet)
    assert torch.equal(again_val.images, torch.stack([val[i][0] for i in range(len(val))]))
    assert main([*flags, "--output-dir", str(tmp_path / "second")]) == 0
    figures = [[row.split(",")[1:] for row in (tmp_path / run / "metrics.csv").read_text().splitlines()]
               for run in ("first", "second")]
    header = figures[0][0]
    keep = [i for i, name in enumerate(header) if "loss" in name or "acc" in name]
    assert [[r[i] for i in keep] for r in figures[0]] == [[r[i] for i in keep] for r in figures[1]]


def test_skipping_bad_samples_decodes_a_large_folder_in_its_check_and_skips_what_only_decoding_finds(
        image_folder, tmp_path, large_sets, monkeypatch):
    monkeypatch.setattr(types, "STATS_SAMPLES", 1)
    bad = _broken_huffman_table(image_folder)
    code = main(["train", "--data", str(image_folder), "--model", "tinycnn", "--epochs", "1", "--image-size", "28",
                 "--skip-bad-samples", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")])
    assert code == 0 and str(bad) in (tmp_path / "run" / "skipped_samples.txt").read_text()


def _broken_huffman_table(folder):
    """A JPEG of the folder whose header and end marker are intact but whose Huffman table is not: only decoding
    finds it bad."""
    bad = sorted(folder.rglob("*.jpg"))[-1]
    data = bytearray(bad.read_bytes())
    table = data.find(b"\xff\xc4")
    data[table + 5:table + 25] = b"\xff" * 20
    bad.write_bytes(data)
    return bad


@pytest.fixture
def large_sets(monkeypatch):
    """Every set counts as large (over 64 MiB decoded): a folder's first run checks without decoding."""
    monkeypatch.setattr(types, "WHOLE_SET_BYTES", 0)


def test_a_small_folder_is_decoded_in_the_pass_that_checks_it(image_folder, tmp_path):
    first, _ = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1, cache_dir=str(tmp_path)))
    assert isinstance(first, ImageSet)


def test_the_check_reads_the_size_pillow_reads_and_refuses_a_huge_header_unread(tmp_path):
    """A large folder's check takes a JPEG's or PNG's size from its header (whatever its kind: progressive, CMYK,
    grey, a long EXIF block first) and its end marker; a header claiming 81 million pixels is refused by its size,
    before any decoding; a file cut short, or with bytes after its end, is decoded to say what is wrong."""
    from scaletrain.data.images import check_image

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (123, 457, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x010F] = "camera " * 5000  # a 35 KB segment before the frame header
    made = {"plain.jpg": dict(), "progressive.jpg": dict(progressive=True), "exif.jpg": dict(exif=exif.tobytes()),
            "cmyk.jpg": dict(mode="CMYK"), "grey.jpg": dict(mode="L"), "rgb.png": dict(), "palette.png": dict(mode="P"),
            "image.webp": dict()}
    for name, how in made.items():
        mode = how.pop("mode", "RGB")
        rgb.convert(mode).save(tmp_path / name, **how)
        assert check_image(tmp_path / name) is None, name
    jpeg = (tmp_path / "plain.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(jpeg[:3000])
    assert "truncated" in check_image(tmp_path / "cut.jpg")
    (tmp_path / "trailing.jpg").write_bytes(jpeg + b"junk")  # Pillow decodes it: taken
    assert check_image(tmp_path / "trailing.jpg") is None
    sof = jpeg.index(b"\xff\xc0")
    huge = jpeg[:sof + 5] + (9000).to_bytes(2, "big") * 2 + jpeg[sof + 9:]
    (tmp_path / "huge.jpg").write_bytes(huge)
    assert check_image(tmp_path / "huge.jpg") == "9000x9000 pixels is larger than the safe limit of 64000000 pixels"


def test_a_file_only_decoding_finds_bad_is_refused_by_name_on_one_line_in_the_first_pass(image_folder, tmp_path,
                                                                                         large_sets, monkeypatch,
                                                                                         capsys):
    """A large folder's check reads each file's header and end marker; a JPEG whose Huffman table is broken passes
    it, and is refused when the first pass decodes it: one line naming the file, exit code 2."""
    monkeypatch.setattr(types, "STATS_SAMPLES", 1)  # the check decodes one image, for the statistics
    bad = _broken_huffman_table(image_folder)
    code = main(["train", "--data", str(image_folder), "--model", "tinycnn", "--epochs", "1", "--image-size", "28",
                 "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and f"{bad}: cannot decode image (corrupt image" in err, err


def test_filling_batches_stream_the_first_pass_then_serve_the_same_batches_from_memory(image_folder, tmp_path,
                                                                                    large_sets):
    first, first_val = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1,
                                                  cache_dir=str(tmp_path)))
    assert isinstance(first, ImageFiles) and first.keep is not None
    pre = Preprocess(1, 28, [0.1], [0.3])
    common = dict(train=True, rank=0, world=1, seed=0, channels_last=False, augment=("hflip", "brightness"))
    filling = FillingBatches(first, pre, CPU, 16, num_workers=2, **common)
    images, labels = decode_all(ImageFiles(first.paths, first.labels, first.classes, 1, 28, first.recipe), 0)
    device = DeviceBatches(ImageSet(images, labels, first.classes), pre, CPU, 16, **common)
    for epoch in (0, 1):
        assert (filling.memory is not None) == (epoch == 1)  # from files in the first pass, then from memory
        pairs = list(zip(filling.epoch(epoch), device.epoch(epoch)))
        assert len(pairs) == len(device) > 1
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    list(FillingBatches(first_val, pre, CPU, 16, train=False, rank=0, world=1, seed=0).epoch(0))  # a validation
    again, _ = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1,
                                          cache_dir=str(tmp_path)))
    assert isinstance(again, ImageSet) and torch.equal(again.images, images)  # kept for the next run


def test_image_folder_with_explicit_validation(tmp_path, mnist):
    for split, rng in (("train", range(0, 40)), ("val", range(40, 50))):
        for i in rng:
            d = tmp_path / split / str(int(mnist.labels[i]))
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(mnist.images[i, 0].numpy()).save(d / f"{i}.png")
    train, val = load_image_sets(DataConfig(data=str(tmp_path), image_size=28))
    assert (len(train), len(val)) == (40, 10)
    assert [train.classes[int(l)] for l in val.labels] == [str(int(mnist.labels[i])) for i in
                                                             sorted(range(40, 50), key=lambda i: (int(mnist.labels[i]), str(i)))]


def test_device_and_dataloader_paths_agree_for_image_files(image_folder):
    train, _ = load_image_sets(DataConfig(data=str(image_folder), image_size=28, channels=1, data_on_device="no"))
    pre = Preprocess(1, 28, [0.1], [0.3])
    images, labels = decode_all(train, num_workers=0)
    common = dict(train=False, rank=1, world=2, seed=0, channels_last=False)
    device = list(DeviceBatches(ImageSet(images, labels, train.classes), pre, CPU, 16, **common).epoch(0))
    loader = list(LoaderBatches(train, CPU, 16, num_workers=2, pre=pre, **common).epoch(0))
    assert len(device) == len(loader) > 1
    for (xa, ya), (xb, yb) in zip(device, loader):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.fixture
def idx_folder(tmp_path, mnist):
    folder = tmp_path / "mnist-idx"
    folder.mkdir()
    for split, rng in (("train", slice(0, 300)), ("t10k", slice(300, 350))):
        for kind, magic, arr in (("images-idx3", 2051, mnist.images[rng, 0].numpy()),
                                 ("labels-idx1", 2049, mnist.labels[rng].numpy().astype(np.uint8))):
            header = np.array([magic, *arr.shape], dtype=">u4").tobytes()
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + arr.tobytes()))
    return folder


@pytest.mark.parametrize("path", [pytest.param("folder", marks=pytest.mark.slow), "npz", "csv", "idx"])
def test_each_format_trains_from_the_cli(path, tmp_path, kaggle, image_folder, small_npz, idx_folder):
    data = {"folder": image_folder, "npz": small_npz, "csv": kaggle, "idx": idx_folder}[path]
    args = ["train", "--data", str(data), "--model", "tinycnn", "--epochs", "1", "--batch-size", "16",
            "--image-size", "28", "--output-dir", str(tmp_path / "run")]
    if path == "folder":
        args += ["--data-on-device", "no", "--num-workers", "1"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected_val = {"folder": 16, "npz": 101, "csv": 12, "idx": 50}[path]
    assert summary["val_samples"] == expected_val and summary["epochs"] == 1


# -- bad input ---------------------------------------------------------------------------------------------------
def _refused(data: str, capsys, *extra: str) -> str:
    code = main(["train", "--data", data, "--output-dir", "/nonexistent/never-created", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("edit, expected", [
    (lambda rows: rows[:3] + [rows[3] + ",0"] + rows[4:], "train.csv: row 4: 786 fields, expected 785"),
    (lambda rows: rows[:2] + [rows[2].replace(",0,", ",x,", 1)] + rows[3:], "train.csv: row 3: pixel"),
    (lambda rows: rows[:5] + [rows[5].replace(",0,", ",256,", 1)] + rows[6:], "row 6: pixel"),
    (lambda rows: [rows[0].replace("label", "digit")] + rows[1:], "train.csv: row 1: no 'label' column"),
    (lambda rows: rows[:-1] + [rows[-1][: len(rows[-1]) // 2]], "train.csv: row 61: "),
    (lambda rows: [], "train.csv: empty file"),
    (lambda rows: rows[:1], "train.csv: holds a header but no images"),
    (lambda rows: rows[:7] + ["12" + rows[7][1:]] + rows[8:], "train.csv: row 8: label 12 is outside 0..9"),
    (lambda rows: rows[:7] + ["1.5" + rows[7][1:]] + rows[8:], "train.csv: row 8: label '1.5' is not an integer"),
])
def test_bad_csv_is_refused_naming_the_row(kaggle, capsys, edit, expected):
    rows = (kaggle / "train.csv").read_text().splitlines()
    (kaggle / "train.csv").write_text("\n".join(edit(rows)))
    assert expected in _refused(str(kaggle), capsys)


def test_out_of_range_pixel_message(kaggle, capsys):
    rows = (kaggle / "train.csv").read_text().splitlines()
    cells = rows[5].split(",")
    cells[100] = "300"
    rows[5] = ",".join(cells)
    (kaggle / "train.csv").write_text("\n".join(rows))
    assert "train.csv: row 6: pixel99 value 300 is outside 0..255" in _refused(str(kaggle), capsys)


@pytest.fixture
def two_bad_rows(kaggle):
    """The Kaggle train.csv with row 4 one field too long and row 10's label not a number."""
    rows = (kaggle / "train.csv").read_text().splitlines()
    rows[3] += ",0"
    rows[9] = "x" + rows[9][1:]
    (kaggle / "train.csv").write_text("\n".join(rows))
    return kaggle


def test_skip_bad_samples_keeps_the_good_rows_and_names_the_bad(two_bad_rows):
    skipped = Skipped()
    train, val = load_image_sets(DataConfig(data=str(two_bad_rows)), skipped=skipped)
    assert len(train) + len(val) == 58
    assert [e.split(": ")[1] for e in skipped.entries] == ["row 4", "row 10"]


def test_skip_bad_samples_trains_and_lists_them_in_the_run_folder(two_bad_rows, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--data", str(two_bad_rows), "--skip-bad-samples", "--model", "tinycnn", "--epochs", "1",
                 "--output-dir", str(out)]) == 0
    listed = (out / "skipped_samples.txt").read_text().splitlines()
    assert len(listed) == 2 and "row 4: 786 fields, expected 785" in listed[0] and "row 10" in listed[1]
    assert json.loads((out / "summary.json").read_text())["train_samples"] + \
        json.loads((out / "summary.json").read_text())["val_samples"] == 58


@pytest.mark.parametrize("damage, expected", [
    ("empty_class", "class 'class_3' has no usable images"),
    ("zero_byte", "empty file"),
    ("not_image", "not an image file"),
    ("truncated", "corrupt image"),
    ("cut_mid_scan", "corrupt image"),  # checked at 1/8 scale: every byte of the scan is still read
    ("huge", "larger than the safe limit"),
])
def test_bad_image_folder_is_refused_naming_the_file(image_folder, capsys, damage, expected):
    victim = sorted((image_folder / "class_1").glob("*.jpg"))[0]
    if damage == "empty_class":
        for p in (image_folder / "class_3").iterdir():
            p.unlink()
        victim = image_folder / "class_3"
    elif damage == "zero_byte":
        victim.write_bytes(b"")
    elif damage == "not_image":
        victim.write_text("this is a text file named like a JPEG")
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:200])
    elif damage == "cut_mid_scan":
        data = victim.read_bytes()
        victim.write_bytes(data[:len(data) * 7 // 10])
    elif damage == "huge":
        victim = victim.with_suffix(".png")
        Image.new("L", (8100, 8000)).save(victim)
    line = _refused(str(image_folder), capsys, "--image-size", "28")
    assert str(victim) in line and expected in line


def _empty_idx(tmp_path, mnist):
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(12)))
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01" + bytes(4)))
    return folder


def _npz_file(tmp_path, **arrays):
    np.savez(tmp_path / "bad.npz", **arrays)
    return tmp_path / "bad.npz"


def _cut_npz(tmp_path, mnist):
    good = _npz_file(tmp_path, images=mnist.images[:10, 0].numpy(), labels=mnist.labels[:10].numpy())
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:100])
    return tmp_path / "cut.npz"


@pytest.mark.parametrize("make, expected", [
    (_empty_idx, "train-*: holds no images"),
    (lambda tmp, m: _npz_file(tmp, images=m.images[:10, 0].numpy(), labels=m.labels[:9].numpy()),
     "10 images but 9 labels"),
    (lambda tmp, m: _npz_file(tmp, images=m.images[:10, 0].numpy(), labels=m.labels[:10].numpy().astype(np.float32)),
     "labels must be a 1-D integer array"),
    (_cut_npz, "not a readable .npz file"),
], ids=["empty-idx", "npz-fewer-labels", "npz-float-labels", "truncated-npz"])
def test_bad_idx_and_npz_are_refused(tmp_path, capsys, mnist, make, expected):
    assert expected in _refused(str(make(tmp_path, mnist)), capsys)


@pytest.fixture
def mirror(monkeypatch):
    """urlopen served from the shipped t10k files instead of the network; the train files are unreachable."""
    import urllib.request
    from importlib import resources

    shipped = resources.files("scaletrain") / "assets" / "mnist_t10k"

    class _Response:
        def __init__(self, data):
            self.data = data

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return self.data

    def fake_urlopen(url, timeout):
        name = url.rsplit("/", 1)[1]
        if name.startswith("t10k"):
            return _Response((shipped / name).read_bytes())
        raise OSError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return shipped


def test_a_failed_mnist_download_names_the_file_and_leaves_nothing_behind(mirror, tmp_path):
    with pytest.raises(UserError, match="cannot download train-images-idx3-ubyte.gz"):
        download_mnist(tmp_path, mirrors=("https://mirror.invalid/",))
    assert not list(tmp_path.iterdir())


def test_a_downloaded_file_with_the_wrong_checksum_is_refused_and_the_good_ones_kept(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr("scaletrain.data.sources.idx.MNIST_FILES", {
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "0" * 32})
    with pytest.raises(UserError, match="t10k-labels-idx1-ubyte.gz .*checksum mismatch"):
        download_mnist(tmp_path, mirrors=("https://mirror.invalid/",))
    assert (tmp_path / "t10k-images-idx3-ubyte.gz").read_bytes() == (mirror / "t10k-images-idx3-ubyte.gz").read_bytes()
    assert not (tmp_path / "t10k-labels-idx1-ubyte.gz").exists()


def test_mnist_without_download_says_how(capsys, tmp_path):
    line = _refused("mnist", capsys, "--cache-dir", str(tmp_path))
    assert "add --download" in line
