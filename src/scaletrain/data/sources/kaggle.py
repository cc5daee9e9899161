"""Kaggle's digit-recognizer CSVs (`--data-format csv`): train.csv (label, pixel0..pixel783) for training, test.csv
(pixels only) for `predict`; a .csv file, or a folder holding them.

Every row is checked before a run starts; the first bad one is refused naming its row as a spreadsheet shows it,
or, with --skip-bad-samples, every bad row is left out and listed.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UserError
from ..types import ImageSet, Skipped, arrays_to_set, existing_path, refuse_or_skip

FORMAT = "csv"
KAGGLE_SIDE = 28
KAGGLE_CLASSES = 10


def read_digits_csv(path: Path, skipped: Skipped | None = None, labelled: bool = True) -> tuple[np.ndarray,
                                                                                                np.ndarray | None]:
    """train.csv (label, pixel0..pixel783) or test.csv (pixel0..pixel783): uint8 images N x 28 x 28 and labels.

    Rows are numbered as a spreadsheet shows them: the header is row 1, the first image row 2.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        raise UserError(f"{path}: empty file (expected a header row)")
    header = [h.strip() for h in rows[0]]
    pixels = KAGGLE_SIDE * KAGGLE_SIDE
    if labelled and "label" not in header:
        raise UserError(f"{path}: row 1: no 'label' column in the header")
    label_col = header.index("label") if "label" in header else None
    width = pixels + (label_col is not None)
    if len(header) != width:
        raise UserError(f"{path}: row 1: header has {len(header)} columns, expected {width} "
                        f"({'label, ' if label_col is not None else ''}pixel0..pixel{pixels - 1})")
    body = rows[1:]
    if not body:
        raise UserError(f"{path}: holds a header but no images")
    try:  # the fast path; on any failure, the row-by-row pass below finds and names the bad row
        values = np.array(body, dtype=np.int64)
        ok = values.ndim == 2 and values.shape[1] == width and 0 <= values.min()
        if ok and label_col is not None:
            pix = np.delete(values, label_col, axis=1)
            ok = pix.max() <= 255 and values[:, label_col].max() < KAGGLE_CLASSES
        elif ok:
            ok = values.max() <= 255
    except ValueError:
        ok = False
    if not ok:
        good = []
        for i, row in enumerate(body, start=2):
            why = _digits_row_problem(row, width, label_col)
            if why:
                refuse_or_skip(skipped, f"{path}: row {i}", why)
            else:
                good.append(row)
        if not good:
            raise UserError(f"{path}: no valid rows left")
        values = np.array(good, dtype=np.int64)
    labels = values[:, label_col] if label_col is not None else None
    pix = np.delete(values, label_col, axis=1) if label_col is not None else values
    return pix.astype(np.uint8).reshape(-1, KAGGLE_SIDE, KAGGLE_SIDE), labels


def _digits_row_problem(row: list[str], width: int, label_col: int | None) -> str | None:
    if len(row) != width:
        return f"{len(row)} fields, expected {width}"
    for j, cell in enumerate(row):
        try:
            v = int(cell)
        except ValueError:
            what = "label" if j == label_col else f"pixel{j - (label_col is not None and j > label_col)}"
            return f"{what} '{cell}' is not an integer"
        if j == label_col:
            if not 0 <= v < KAGGLE_CLASSES:
                return f"label {v} is outside 0..{KAGGLE_CLASSES - 1}"
        elif not 0 <= v <= 255:
            return f"pixel{j - (label_col is not None and j > label_col)} value {v} is outside 0..255"
    return None


def is_digits_folder(folder: Path) -> bool:
    return (folder / "train.csv").is_file() or (folder / "test.csv").is_file()


def named(location: str) -> bool:
    return False


def recognise(path: Path) -> bool:
    return path.suffix.lower() == ".csv" and path.is_file() or path.is_dir() and is_digits_folder(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, None]:
    path = existing_path(location)
    csv_path = path if path.is_file() else path / "train.csv"
    if not csv_path.is_file():
        raise UserError(f"{path}: no train.csv (Kaggle digit-recognizer layout: train.csv, test.csv)")
    images, labels = read_digits_csv(csv_path, skipped)
    return arrays_to_set(images, labels, str(csv_path), [str(i) for i in range(KAGGLE_CLASSES)]), None
