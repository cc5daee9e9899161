"""What `predict` and `evaluate` score: unlabelled inputs in a stable order with their ids (a Kaggle test.csv, a
folder of images, .npz or IDX arrays), or the labelled samples of --data, split as training split them; image
files decoded as the checkpoint's training decoded them."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DEFAULT_CACHE_DIR, DataConfig
from ..data.images import IMAGE_SUFFIXES, stored_size
from ..data.read import detect_format, load_image_sets, read_dataset
from ..data.sources.folder import Listing, check_listing, image_files_under, scan_class_folder
from ..data.sources.idx import read_idx_folder
from ..data.sources.kaggle import read_digits_csv
from ..data.transforms import Preprocess
from ..data.types import ImageFiles, ImageSet, Skipped, arrays_to_set, concat
from ..errors import UserError
from .checkpoint import Checkpoint


@dataclass
class Inputs:
    """What to predict: images (in memory or files), one id per image, and how the output names them."""

    images: ImageSet | ImageFiles
    ids: list[str]
    id_column: str
    label_column: str = "label"
    sample_submission: Path | None = None


def files_of(paths: list[str], labels, classes: list[str], pre: Preprocess) -> ImageFiles:
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
        return Inputs(files, [str(Path(p).relative_to(path)) for p in files.paths], "path")
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
    if not fmt:
        raise UserError(f"--data {data}: a prepared dataset holds labelled splits; score them with scaletrain "
                        f"evaluate --split train or --split val")
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
    return arrays_to_set(images, np.zeros(len(images), dtype=np.int64), "input", ["?"])


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
