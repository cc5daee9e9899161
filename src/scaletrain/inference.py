"""Predict and evaluate with a trained checkpoint, on any number of processes, with exact results.

Each rank scores its strided shard of the inputs (no padding, no duplicates); the logits are gathered back into
input order, so every rank holds the same N x classes matrix and the main process writes the files.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .data import ImageSet, concat, detect_format, load_image_sets, read_dataset
from .config import DataConfig
from .parallel import Runtime
from .errors import UserError
from .models import build_model
from .pipeline import DeviceBatches, LoaderBatches, Preprocess, fits_on_device, lockstep
from .runfolder import atomic_write_bytes, atomic_write_text, load_weights, png_bytes, pyplot
from .folder_cache import DEFAULT_CACHE_DIR
from .sources import (IMAGE_SUFFIXES, ImageFiles, Listing, Skipped, check_listing, image_files_under,
                      read_digits_csv, read_idx_folder, scan_class_folder, stored_size)


# -- checkpoints -----------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str) -> Path:
    """A run folder (its best.safetensors, else last) or a .safetensors file."""
    p = Path(path)
    if p.is_dir():
        for name in ("best.safetensors", "last.safetensors"):
            if (p / name).is_file():
                return p / name
        raise UserError(f"--checkpoint {path}: the folder holds no best.safetensors or last.safetensors")
    if not p.exists():
        raise UserError(f"--checkpoint {path}: no such file or folder")
    return p


@dataclass
class Checkpoint:
    model: torch.nn.Module
    model_name: str
    classes: list[str]
    preprocess: Preprocess
    meta: dict[str, Any]


def load_checkpoint(path: str) -> Checkpoint:
    """Rebuild the model a checkpoint describes and load its weights (safetensors only: nothing is unpickled)."""
    file = resolve_checkpoint(path)
    weights, meta = load_weights(file)
    if not meta.get("model") or not meta.get("preprocess") or not meta.get("classes"):
        raise UserError(f"{file}: not a scaletrain checkpoint (no model, classes or preprocessing in its metadata)")
    pre = Preprocess(**meta["preprocess"])
    model = build_model(meta["model"], pre.channels, len(meta["classes"]))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise UserError(f"{file}: weights do not fit model '{meta['model']}' ({first})") from None
    model.eval()
    return Checkpoint(model, meta["model"], list(meta["classes"]), pre, meta)


# -- inputs ----------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """What to predict: images (in memory or files), one id per image, and how the output names them."""

    images: ImageSet | ImageFiles
    ids: list[str]
    id_column: str
    label_column: str = "label"
    sample_submission: Path | None = None


def files_of(paths: list[Path], labels, classes: list[str], pre: Preprocess) -> ImageFiles:
    """Image files decoded as the checkpoint's training decoded them (photos kept with room for the crop)."""
    return ImageFiles(paths, np.asarray(labels, dtype=np.int64), classes, pre.channels,
                      stored_size(pre.recipe, pre.image_size, pre.crop_pct), pre.recipe)


def _image_files(root: Path, pre: Preprocess) -> ImageFiles:
    found = image_files_under(root)
    if not found:
        raise UserError(f"--data {root}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    files = [path for path, _ in found]
    stats = [(st.st_size, st.st_mtime_ns) for _, st in found]
    # the checks of training (kept in the folder's cache), naming the first bad file: one "class", the folder
    bad = Skipped()
    files, _, _ = check_listing(Listing(root, [root.name], [root], files, [0] * len(files), stats), bad,
                                DEFAULT_CACHE_DIR)
    if bad.entries:
        more = f" (and {len(bad.entries) - 1} more)" if len(bad.entries) > 1 else ""
        raise UserError(bad.entries[0] + more)
    return files_of(files, np.zeros(len(files)), [], pre)


def load_inputs(data: str, pre: Preprocess, data_format: str = "auto") -> Inputs:
    """Unlabelled inputs for predict, in a stable order with their ids."""
    if data == "default":
        _, val = load_image_sets("default")
        return Inputs(val, [str(i) for i in range(len(val))], "index")
    path = Path(data)
    if not path.exists():
        raise UserError(f"--data {data}: no such file or folder")
    fmt = data_format if data_format != "auto" else _input_format(path)
    if fmt == "csv":
        csv_path = path / "test.csv" if path.is_dir() else path
        if not csv_path.is_file():
            raise UserError(f"--data {data}: no test.csv to predict")
        images, _ = read_digits_csv(csv_path, labelled=False)  # a label column, if any, is read and ignored
        # Kaggle's sample_submission.csv describes test.csv; another CSV in the folder is predicted on its own.
        sample = csv_path.parent / "sample_submission.csv" if csv_path.name == "test.csv" else Path("-")
        n = len(images)
        return Inputs(_unlabelled(images), [str(i) for i in range(1, n + 1)], "ImageId", "Label",
                      sample if sample.is_file() else None)
    if fmt == "folder":
        files = _image_files(path, pre)
        return Inputs(files, [str(p.relative_to(path)) for p in files.paths], "path")
    if fmt == "npz":
        arrays = np.load(path, allow_pickle=False)
        key = next((k for k in ("images", "x", "x_test", "test_images") if k in arrays), None)
        if key is None:
            raise UserError(f"{path}: expected an 'images' array, found {sorted(arrays)}")
        images = arrays[key]
        return Inputs(_unlabelled(images), [str(i) for i in range(len(images))], "index")
    if fmt == "idx":
        splits = read_idx_folder(path)
        images = splits["t10k"][0] if "t10k" in splits else splits["train"][0]
        return Inputs(_unlabelled(images), [str(i) for i in range(len(images))], "index")
    raise UserError(f"--data-format {fmt}: cannot predict from this format")


def _input_format(path: Path) -> str:
    """How to read inputs: as training would, and a folder of images without class subfolders as images."""
    try:
        return detect_format(path)
    except UserError:
        if path.is_dir() and any(p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir()):
            return "folder"
        raise


def _unlabelled(images: np.ndarray) -> ImageSet:
    from .data import _arrays_to_set

    return _arrays_to_set(images, np.zeros(len(images), dtype=np.int64), "input", ["?"])


# -- the computation -------------------------------------------------------------------------------------------
@torch.no_grad()
def predict_logits(model: torch.nn.Module, data: ImageSet | ImageFiles, pre: Preprocess, runtime: Runtime,
                   batch_size: int, num_workers: int = 2, channels_last: bool = True) -> torch.Tensor:
    """Logits (float32, N x classes) for every input in input order, identical on every rank."""
    if len(data) == 0:
        raise UserError("no inputs to score")
    common = dict(train=False, rank=runtime.rank, world=runtime.world_size, seed=0, channels_last=channels_last)
    if isinstance(data, ImageSet) and fits_on_device(data.nbytes, runtime.device):
        batches = DeviceBatches(data, pre, runtime.device, batch_size, **common)
    else:
        batches = LoaderBatches(data, runtime.device, batch_size, num_workers=num_workers, pre=pre, **common)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = runtime.place(model)  # on the device; only this rank's shard under fsdp
    model.eval()
    parts = []
    for x, _ in lockstep(batches, runtime.sharded):
        with runtime.autocast():
            parts.append(model(x).float())
    if not parts:  # a rank with no inputs (fewer inputs than processes) still gives its empty share
        parts.append(model(batches.empty_batch()[0]).float())
    return runtime.gather_strided(torch.cat(parts), len(data)).cpu()


def classification_report(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    """Loss, accuracy, per-class accuracy and the confusion matrix (rows: true class, columns: predicted)."""
    k = len(classes)
    if labels.max() >= k:
        raise UserError(f"label {int(labels.max())} is out of range for a model of {k} classes")
    pred = logits.argmax(1)
    confusion = torch.bincount(labels * k + pred, minlength=k * k).view(k, k)
    support = confusion.sum(1)
    per_class = {c: (confusion[i, i].item() / support[i].item()) if support[i] else None
                 for i, c in enumerate(classes)}
    return {"samples": len(labels), "loss": F.cross_entropy(logits.double(), labels).item(),
            "accuracy": (pred == labels).sum().item() / len(labels), "per_class_accuracy": per_class,
            "support": dict(zip(classes, support.tolist())), "confusion_matrix": confusion.tolist(),
            "classes": classes}


# -- outputs ---------------------------------------------------------------------------------------------------
def check_writable(path: Path) -> None:
    """Refuse an output path before any work is done if it cannot be written."""
    parent = path.parent if path.parent != Path("") else Path(".")
    if path.is_dir():
        raise UserError(f"--output {path}: is a folder; give a file name")
    if not parent.is_dir():
        raise UserError(f"--output {path}: folder {parent} does not exist")
    probe = parent / f".{path.name}.probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--output {path}: cannot write there ({e.strerror})") from None


def submission_csv(inputs: Inputs, logits: torch.Tensor, classes: list[str], top_k: int = 1,
                   probabilities: bool = False, raw_logits: bool = False) -> str:
    probs = logits.softmax(1)
    top = probs.topk(min(top_k, len(classes)), dim=1)
    header = [inputs.id_column, inputs.label_column]
    header += [f"{inputs.label_column}_{j + 1}" for j in range(1, top.indices.shape[1])]
    if probabilities:
        header += [f"p_{c}" for c in classes]
    if raw_logits:
        header += [f"logit_{c}" for c in classes]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    names = np.array(classes, dtype=object)
    labels = names[top.indices.numpy()]
    for i, id_ in enumerate(inputs.ids):
        row = [id_, *labels[i].tolist()]
        if probabilities:
            row += [f"{p:.6f}" for p in probs[i].tolist()]
        if raw_logits:
            row += [f"{v:.7g}" for v in logits[i].tolist()]  # float32's precision
        writer.writerow(row)
    return buf.getvalue()


def check_sample_submission(inputs: Inputs) -> None:
    """The ids must match sample_submission.csv row for row when it is there."""
    if inputs.sample_submission is None:
        return
    with inputs.sample_submission.open() as f:
        rows = list(csv.reader(f))
    ids = [r[0] for r in rows[1:] if r]
    if ids != inputs.ids:
        raise UserError(f"{inputs.sample_submission}: {len(ids)} ImageIds do not match the {len(inputs.ids)} "
                        f"rows of test.csv numbered 1..{len(inputs.ids)}")


def confusion_png(report: dict[str, Any], path: Path) -> None:
    matrix = np.array(report["confusion_matrix"])
    classes = report["classes"]
    size = max(4.0, 0.5 * len(classes) + 2)
    fig, ax = pyplot().subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=90 if len(classes) > 12 else 0)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"accuracy {report['accuracy']:.4f} on {report['samples']} samples")
    if len(classes) <= 30:
        high = matrix.max() / 2 if matrix.size else 0
        for (i, j), v in np.ndenumerate(matrix):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v > high else "black")
    fig.tight_layout()
    atomic_write_bytes(path, png_bytes(fig, dpi=110))


def write_report(report: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    writer.writerow(["true \\ predicted", *report["classes"]])
    for c, row in zip(report["classes"], report["confusion_matrix"]):
        writer.writerow([c, *row])
    atomic_write_text(folder / "confusion_matrix.csv", rows.getvalue())
    atomic_write_text(folder / "metrics.json", json.dumps(report, indent=2) + "\n")
    confusion_png(report, folder / "confusion_matrix.png")


def labelled_set(data: str, split: str, ckpt: Checkpoint, data_format: str = "auto") -> ImageSet | ImageFiles:
    """The labelled samples to evaluate: all of --data, or its train/val part split as training split it.

    Labels are matched to the checkpoint's classes by name for image folders, by number otherwise.
    """
    saved = ckpt.meta.get("config", {})
    saved_data = saved.get("data", {})
    cfg = DataConfig(data=data, data_format=data_format, val_fraction=saved_data.get("val_fraction", 0.2),
                     image_size=ckpt.preprocess.image_size, channels=ckpt.preprocess.channels,
                     recipe=ckpt.preprocess.recipe, crop_pct=ckpt.preprocess.crop_pct,
                     cache_dir=saved_data.get("cache_dir", DEFAULT_CACHE_DIR),
                     image_column=saved_data.get("image_column", ""), label_column=saved_data.get("label_column", ""))
    if split == "auto":
        split = "val" if data == "default" else "all"
    if split == "all":
        path = Path(data)
        if data != "default" and path.is_dir() and (data_format == "folder" or (
                data_format == "auto" and detect_format(path) == "folder")):
            paths, labels, _ = scan_class_folder(path, ckpt.classes, None, DEFAULT_CACHE_DIR)
            return files_of(paths, labels, ckpt.classes, ckpt.preprocess)
        return concat(*read_dataset(cfg))
    train, val = load_image_sets(cfg, seed=saved.get("run", {}).get("seed", 0))
    return train if split == "train" else val
