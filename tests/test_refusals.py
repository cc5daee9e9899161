"""Every bad input in one table: what is wrong, the command, the exit code, words its one line must hold, and the
files that must be left exactly as they were. docs/refusals.md lists the same rows for users.

Each row runs the command in this process (as `scaletrain ...` would) and asserts: the exit code, one line on
stderr starting `scaletrain: error:`, the words, no traceback, and every file of the named folders unchanged.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file, save_file

from scaletrain.cli import main

HEADER = "label," + ",".join(f"pixel{i}" for i in range(784))


@dataclass
class Case:
    wrong: str  # what is wrong, in the user's words (also the docs' first column)
    args: list[str]  # the command, {d} standing for the folder the bad inputs are made in
    words: str  # what the one line must hold ({d} as above)
    exit_code: int = 2
    untouched: tuple[str, ...] = ()  # folders under {d} whose every file must be left as it was


def _csv(path: Path, mnist, rows: int = 20, edit=None) -> Path:
    lines = [HEADER] + [",".join([str(int(mnist.labels[i]))] + [str(v) for v in mnist.images[i].flatten().tolist()])
                        for i in range(rows)]
    if edit:
        lines = edit(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def _idx(folder: Path, images: np.ndarray, labels: np.ndarray, magic: int = 2051, cut: int = 0) -> Path:
    folder.mkdir(parents=True)
    raw = struct.pack(">IIII", magic, len(images), 28, 28) + images.tobytes()
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw[:len(raw) - cut]))
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(struct.pack(">II", 2049, len(labels)) +
                                                                     labels.astype(np.uint8).tobytes()))
    return folder


def _folder(root: Path, mnist, classes=(0, 1), per_class: int = 4) -> Path:
    for c in classes:
        (root / str(c)).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            Image.fromarray(mnist.images[c * 10 + k, 0].numpy()).save(root / str(c) / f"{k}.png")
    return root


@pytest.fixture(scope="module")
def d(tmp_path_factory, mnist):
    """The folder every bad input of the table is made in, once."""
    d = tmp_path_factory.mktemp("refusals")
    x, y = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    np.savez(d / "good.npz", images=x[:200], labels=y[:200], val_images=x[200:260], val_labels=y[200:260])
    _csv(d / "wide.csv", mnist, edit=lambda ls: ["label,pixel0"] + ls[1:])
    _csv(d / "nolabel.csv", mnist, edit=lambda ls: [ls[0].replace("label", "lbl")] + ls[1:])
    _csv(d / "label10.csv", mnist, edit=lambda ls: ls[:3] + ["10" + ls[3][1:]] + ls[4:])
    _csv(d / "negative.csv", mnist, edit=lambda ls: ls[:3] + ["-1" + ls[3][1:]] + ls[4:])
    _csv(d / "text.csv", mnist, edit=lambda ls: ls[:2] + [ls[2].split(",", 1)[0] + ",abc," + ls[2].split(",", 2)[2]]
         + ls[3:])
    _csv(d / "nan.csv", mnist, edit=lambda ls: ls[:2] + [ls[2].split(",", 1)[0] + ",nan," + ls[2].split(",", 2)[2]]
         + ls[3:])
    _csv(d / "pixel300.csv", mnist, edit=lambda ls: ls[:2] + [ls[2].split(",", 1)[0] + ",300," +
                                                               ls[2].split(",", 2)[2]] + ls[3:])
    (d / "header_only.csv").write_text(HEADER + "\n")
    (d / "empty.csv").write_text("")
    (d / "notes.txt").write_text("not data")
    (d / "emptydir").mkdir()
    _idx(d / "idx_counts", x[:30], y[:29])
    _idx(d / "idx_magic", x[:30], y[:30], magic=1234)
    _idx(d / "idx_cut", x[:30], y[:30], cut=100)
    np.savez(d / "arrays_missing.npz", pictures=x[:10])
    np.savez(d / "float_images.npz", images=x[:10].astype(np.float32), labels=y[:10])
    np.savez(d / "count_mismatch.npz", images=x[:10], labels=y[:9])
    (d / "not_a_zip.npz").write_bytes(b"definitely not a zip file")
    corrupt = _folder(d / "corrupt", mnist)
    (corrupt / "0" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    empty_image = _folder(d / "empty_image", mnist)
    (empty_image / "1" / "0.png").write_bytes(b"")
    unusable = _folder(d / "unusable", mnist)
    (unusable / "2").mkdir()
    (unusable / "2" / "a.png").write_bytes(b"nope")
    bomb = _folder(d / "bomb", mnist)
    Image.new("L", (9000, 9000)).save(bomb / "0" / "huge.png")  # 81 million pixels: over the 64 million limit
    loop = _folder(d / "loop", mnist)
    (loop / "1" / "back").symlink_to(loop, target_is_directory=True)
    _folder(d / "one_class", mnist, classes=(3,), per_class=8)
    split = d / "split"
    _folder(split / "train", mnist)
    _folder(split / "val", mnist, classes=(0, 7))
    (d / "settings_dir.yaml").mkdir()
    (d / "bad.yaml").write_text("epochs: [1, 2\n")
    (d / "unknown.yaml").write_text("epochz: 3\n")
    (d / "a_file").write_text("not a folder")
    (d / "mymodels.py").write_text("import torch\n\ndef make(num_classes):\n    return 'not a model'\n")
    assert main(["prepare", "--data", str(d / "good.npz"), "--output", str(d / "prepared")]) == 0
    damaged = d / "prepared_damaged"
    damaged.mkdir()
    for f in (d / "prepared").iterdir():
        damaged.joinpath(f.name).write_bytes(f.read_bytes())
    shard = next(damaged.glob("train-00000.npy"))
    shard.write_bytes(shard.read_bytes()[:-16] + b"\x01" * 16)
    missing = d / "prepared_missing"
    missing.mkdir()
    for f in (d / "prepared").iterdir():
        if not f.name.startswith("val-"):
            missing.joinpath(f.name).write_bytes(f.read_bytes())
    unfinished = d / "unfinished"
    unfinished.mkdir()
    np.save(unfinished / "train-00000.npy", x[:4])
    # a finished run, and one stopped after its first epoch
    tiny = ["--model", "tinycnn", "--batch-size", "32", "--num-workers", "0"]
    assert main(["train", "--data", str(d / "good.npz"), *tiny, "--epochs", "1", "--output-dir", str(d / "done")]) == 0
    assert main(["train", "--data", str(d / "good.npz"), *tiny, "--epochs", "1", "--output-dir",
                 str(d / "stopped")]) == 0
    (d / "stopped" / "summary.json").unlink()  # as if it had been stopped before its end
    newer = d / "newer"
    newer.mkdir()
    for f in (d / "stopped").rglob("*"):
        if f.is_file():
            (newer / f.relative_to(d / "stopped")).parent.mkdir(parents=True, exist_ok=True)
            (newer / f.relative_to(d / "stopped")).write_bytes(f.read_bytes())
    for train_json in newer.glob("state/step-*/train.json"):
        saved = json.loads(train_json.read_text())
        train_json.write_text(json.dumps({**saved, "format_version": 99}))
    weights = load_file(d / "done" / "best.safetensors")
    from safetensors import safe_open
    with safe_open(str(d / "done" / "best.safetensors"), framework="pt") as f:
        meta = f.metadata()
    save_file({k: v * float("nan") if v.is_floating_point() else v for k, v in weights.items()},
              str(d / "nan_weights.safetensors"), metadata=meta)
    save_file(weights, str(d / "newer_weights.safetensors"),
              metadata={"scaletrain": json.dumps({**json.loads(meta["scaletrain"]), "format_version": 99})})
    save_file(weights, str(d / "other_classes.safetensors"),
              metadata={"scaletrain": json.dumps({**json.loads(meta["scaletrain"]), "classes": ["a", "b", "c"]})})
    (d / "damaged_header.safetensors").write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\x7f{garbage")
    return d


TINY = ["--model", "tinycnn", "--epochs", "1", "--batch-size", "32", "--num-workers", "0"]
CASES = [
    # -- the data ----------------------------------------------------------------------------------------------
    Case("--data names nothing that exists", ["train", "--data", "{d}/missing"], "--data {d}/missing: no such file "
         "or folder"),
    Case("a data file of a kind scaletrain does not read", ["train", "--data", "{d}/notes.txt"],
         "a file must be .npz, .csv or .parquet"),
    Case("a folder holding no dataset", ["train", "--data", "{d}/emptydir"], "found no IDX files, train.csv"),
    Case("a CSV whose header has the wrong columns", ["train", "--data", "{d}/wide.csv"],
         "row 1: header has 2 columns, expected 785"),
    Case("a CSV without a label column", ["train", "--data", "{d}/nolabel.csv"], "row 1: no 'label' column"),
    Case("a label out of range in a CSV", ["train", "--data", "{d}/label10.csv"], "row 4: label 10 is outside 0..9"),
    Case("a negative label in a CSV", ["train", "--data", "{d}/negative.csv"], "row 4: label -1 is outside 0..9"),
    Case("text in a pixel column", ["train", "--data", "{d}/text.csv"], "row 3: pixel0 'abc' is not an integer"),
    Case("NaN in a pixel column", ["train", "--data", "{d}/nan.csv"], "row 3: pixel0 'nan' is not an integer"),
    Case("a pixel value over 255", ["train", "--data", "{d}/pixel300.csv"], "row 3: pixel0 value 300 is outside "
         "0..255"),
    Case("a CSV with a header and no rows", ["train", "--data", "{d}/header_only.csv"], "holds a header but no "
         "images"),
    Case("an empty CSV file", ["train", "--data", "{d}/empty.csv"], "empty file (expected a header row)"),
    Case("IDX files whose counts disagree", ["train", "--data", "{d}/idx_counts"], "holds 30 images but"),
    Case("an IDX file with a wrong magic number", ["train", "--data", "{d}/idx_magic"], "bad IDX magic number 1234"),
    Case("a truncated IDX file", ["train", "--data", "{d}/idx_cut"], "header promises 23520 bytes of data"),
    Case("an .npz without images and labels", ["train", "--data", "{d}/arrays_missing.npz"],
         "expected arrays 'images' and 'labels', found ['pictures']"),
    Case("an .npz of float images", ["train", "--data", "{d}/float_images.npz"], "images must be uint8 (0-255), "
         "got float32"),
    Case("an .npz with more images than labels", ["train", "--data", "{d}/count_mismatch.npz"],
         "10 images but 9 labels"),
    Case("an .npz that is not a zip archive", ["train", "--data", "{d}/not_a_zip.npz"], "not a readable .npz file"),
    Case("a corrupt image in a class folder", ["train", "--data", "{d}/corrupt"], "corrupt/0/1.png: not an image file (format not recognised)"),
    Case("an empty image file", ["train", "--data", "{d}/empty_image"], "empty_image/1/0.png: empty file"),
    Case("a class folder with no usable image", ["train", "--data", "{d}/unusable"],
         "unusable/2/a.png: not an image file"),
    Case("an image that decodes to a huge size (a decompression bomb)", ["train", "--data", "{d}/bomb"],
         "huge.png: 9000x9000 pixels is larger than the safe limit"),
    Case("a symbolic link loop in an image folder", ["train", "--data", "{d}/loop"],
         "a symbolic link back to {d}/loop, which holds it (a loop)"),
    Case("a training set of a single class", ["train", "--data", "{d}/one_class"],
         "the training samples are all of one class (3)"),
    Case("a validation class the training set lacks", ["train", "--data", "{d}/split"],
         "split/val/7: class not present in the training set"),
    Case("a prepared shard whose checksum disagrees with its manifest", ["train", "--data", "{d}/prepared_damaged",
                                                                         *TINY],
         "damaged shard (SHA-256 differs from prepared.json)", untouched=("prepared_damaged",)),
    Case("a prepared shard that is missing", ["train", "--data", "{d}/prepared_missing", *TINY],
         "shard missing (prepared.json lists it)", untouched=("prepared_missing",)),
    Case("shards without their prepared.json", ["train", "--data", "{d}/unfinished"],
         "holds shards but no prepared.json: an unfinished `scaletrain prepare`"),
    # -- settings and flags ------------------------------------------------------------------------------------
    Case("a misspelt flag", ["train", "--epoch", "3"], "unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
    Case("a settings file that is not valid YAML", ["train", "--config", "{d}/bad.yaml"], "not valid YAML at line"),
    Case("an unknown key in a settings file", ["train", "--config", "{d}/unknown.yaml"], "epochz"),
    Case("a settings file that is a folder", ["train", "--config", "{d}/settings_dir.yaml"], "cannot read it"),
    Case("a batch size of zero", ["train", "--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    Case("DataParallel asked for several processes", ["train", "--strategy", "dp", "--nproc", "2"],
         "--strategy dp runs one process that drives every visible GPU; use --nproc 1"),
    Case("fp16 on a machine without a GPU", ["train", "--mixed-precision", "fp16", "--epochs", "1"],
         "--mixed-precision fp16 needs a GPU"),
    Case("flags that contradict each other: --lr-scaling with --global-batch-size",
         ["train", "--global-batch-size", "64", "--lr-scaling", "linear"], "--lr-scaling is for a fixed per-device "
         "batch"),
    Case("a global batch the devices cannot share", ["train", "--global-batch-size", "65", "--grad-accum", "2"],
         "--global-batch-size 65 cannot be shared evenly"),
    Case("a stream's epoch length for data that has one", ["train", "--steps-per-epoch", "3"],
         "--steps-per-epoch 3: only for a stream"),
    Case("a cache limit that is not a size", ["train", "--cache-limit", "lots"],
         "--cache-limit lots: expected a size such as 128MB"),
    Case("a stall timeout below zero", ["train", "--stall-timeout", "-1"],
         "--stall-timeout must be 0 (off) or a positive number of seconds, got -1.0"),
    Case("a model name that does not exist", ["train", "--model", "resnet1"], "--model: unknown model 'resnet1'"),
    Case("a --model FILE.py:NAME that does not exist", ["train", "--model", "{d}/nowhere.py:make"],
         "--model {d}/nowhere.py:make: no such file"),
    Case("a --model factory that returns no model", ["train", "--model", "{d}/mymodels.py:make", "--epochs", "1",
                                                     "--data", "{d}/good.npz", "--output-dir", "{d}/unused"],
         "returned a str; expected a torch.nn.Module"),
    Case("an unknown tracker", ["train", "--log-with", "comet"], "--log-with: unknown tracker 'comet'"),
    # -- run folders and checkpoints ---------------------------------------------------------------------------
    Case("--output-dir that is a file", ["train", "--output-dir", "{d}/a_file"],
         "--output-dir {d}/a_file: exists and is not a folder"),
    Case("--resume of a folder with no training state", ["train", "--resume", "{d}/emptydir"],
         "no training state (state/step-*) to resume from", untouched=("emptydir",)),
    Case("training into a finished run without more epochs", ["train", "--data", "{d}/good.npz", *TINY,
                                                              "--output-dir", "{d}/done"],
         "holds a finished run of 1 epoch(s); raise --epochs", untouched=("done",)),
    Case("resuming with settings that change the training", ["train", "--data", "{d}/good.npz", *TINY,
                                                             "--lr", "0.3", "--output-dir", "{d}/stopped"],
         "cannot resume with settings that change the training (lr:", untouched=("stopped",)),
    Case("a run folder from a newer format version", ["train", "--data", "{d}/good.npz", *TINY,
                                                      "--output-dir", "{d}/newer"],
         "written by a newer scaletrain (format 99; this one reads up to 1)", untouched=("newer",)),
    Case("a checkpoint that is not there", ["predict", "--checkpoint", "{d}/nothing", "--data", "default",
                                            "--output", "{d}/p.csv"], "--checkpoint {d}/nothing: no such file"),
    Case("a safetensors file with a damaged header", ["predict", "--checkpoint", "{d}/damaged_header.safetensors",
                                                      "--data", "default", "--output", "{d}/p.csv"],
         "not a readable safetensors file"),
    Case("weights holding NaN", ["evaluate", "--checkpoint", "{d}/nan_weights.safetensors", "--data",
                                 "{d}/good.npz"], "holds NaN or infinite values"),
    Case("weights from a newer format version", ["predict", "--checkpoint", "{d}/newer_weights.safetensors",
                                                 "--data", "default", "--output", "{d}/p.csv"],
         "written by a newer scaletrain (format 99"),
    Case("a checkpoint of another class count", ["evaluate", "--checkpoint", "{d}/other_classes.safetensors",
                                                 "--data", "{d}/good.npz"], "weights do not fit model 'tinycnn'"),
    Case("predictions into a folder that does not exist", ["predict", "--checkpoint", "{d}/done", "--data",
                                                           "default", "--output", "{d}/no/such/p.csv"],
         "does not exist"),
    Case("an export format scaletrain does not write", ["export", "--checkpoint", "{d}/done", "--format", "tflite",
                                                        "--output", "{d}/m"], "invalid choice: 'tflite'"),
]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.wrong for c in CASES])
def test_every_bad_input_is_refused_on_one_line(case, d, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(d / "cache"))
    before = {name: _files(d / name) for name in case.untouched}
    code = main([a.format(d=d) for a in case.args])
    err = capsys.readouterr().err.strip()
    assert code == case.exit_code, err
    assert len(err.splitlines()) == 1 and err.startswith("scaletrain: error: "), err
    assert case.words.format(d=d) in err, err
    for name, files in before.items():
        assert _files(d / name) == files, f"{name} changed"


def test_the_table_has_forty_rows_and_the_docs_list_every_one():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "refusals.md").read_text()
    assert len(CASES) >= 40
    missing = [c.wrong for c in CASES if c.wrong not in docs]
    assert not missing, f"docs/refusals.md lacks: {missing}"
