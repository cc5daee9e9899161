"""Hugging Face datasets as users hold them (`--data-format hf`): a `save_to_disk` folder, or a hub name
(`hf:user/name`) read through the `datasets` package and its cache; and the reading that parquet files share
(see parquet.py): one, a folder of them, or the hub's train-*/validation-*/test-* layout.

Files on disk are read with pyarrow alone; the image column (encoded bytes or uint8 arrays) and the label column
are found by their features or names and decoded into `ImageSet`s, split by the dataset's own splits.
"""

from __future__ import annotations

import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...config import DataConfig
from ...errors import UserError
from ..images import DEFAULT_FOLDER_SIZE, GREY_MODES, IMAGE_SUFFIXES, MAX_IMAGE_PIXELS, PHOTO_MIN_SIDE, read_image, \
    stored_size
from ..types import ImageSet, Skipped, arrays_to_set, refuse_or_skip

# What each split name means here: the training set, a validation set, or a test set (validation if labelled).
SPLIT_ROLES = {"train": "train", "training": "train", "validation": "val", "valid": "val", "val": "val",
               "dev": "val", "test": "test", "testing": "test"}
LABEL_NAMES = ("label", "labels", "target", "targets", "fine_label", "class", "category", "y")
IMAGE_NAMES = ("image", "img", "images", "pixel_values", "pixels", "x")
INSTALL = "pip install 'scaletrain[hf]'"
FORMAT = "hf"


@dataclass
class Split:
    """One split of a dataset as a pyarrow table, with the files it came from (for naming rows in messages)."""

    name: str
    table: object  # pyarrow.Table
    features: dict  # the dataset's serialised features ({} when the files carry none)
    files: list[tuple[str, int]] = field(default_factory=list)  # (file, rows), in table order

    def where(self, row: int) -> str:
        """The file and row within it of the split's row `row`, as a message names it."""
        for name, rows in self.files:
            if row < rows:
                return f"{name}: split '{self.name}' row {row}"
            row -= rows
        return f"split '{self.name}' row {row}"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError(f"reading Hugging Face datasets needs pyarrow: {INSTALL}") from None
    return pyarrow


def _features_of(schema, fallback: dict | None = None) -> dict:
    """The features `datasets` stored in a table's schema metadata, else `fallback`."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if meta:
        try:
            return json.loads(meta)["info"]["features"] or {}
        except (ValueError, KeyError, TypeError):
            pass
    return fallback or {}


# -- what is on disk -------------------------------------------------------------------------------------------
def is_saved_dataset(path: Path) -> bool:
    """A folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or
                              ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def has_parquet(folder: Path, depth: int = 2) -> bool:
    """Whether parquet files lie in `folder` or up to `depth` folders below it. A folder whose first file is an
    image is taken for a class folder and not read further, so a large image folder costs a few entries."""
    try:
        with os.scandir(folder) as entries:
            subfolders = []
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                suffix = os.path.splitext(entry.name)[1].lower()
                if entry.is_file():
                    if suffix == ".parquet":
                        return True
                    if suffix in IMAGE_SUFFIXES:
                        return False
                elif entry.is_dir():
                    subfolders.append(entry.path)
    except OSError:
        return False
    return depth > 0 and any(has_parquet(Path(sub), depth - 1) for sub in sorted(subfolders))


def _split_of(path: Path, root: Path) -> str | None:
    """The split a parquet file belongs to by the hub's naming: train-00000-of-00001.parquet, train.parquet, or
    train/0000.parquet."""
    names = [path.stem, *(p.name for p in path.relative_to(root).parents if p.name)] if path != root else [path.stem]
    for name in names:
        m = re.match(r"([A-Za-z]+)(?:[-_.]|$)", name)
        if m and m.group(1).lower() in SPLIT_ROLES:
            return m.group(1).lower()
    return None


def read_parquet(path: Path) -> list[Split]:
    """A .parquet file (one split), or the parquet files under a folder grouped into splits by their names."""
    pa = _pyarrow()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.parquet")
                                                 if not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise UserError(f"--data {path}: no .parquet files")
    groups: dict[str, list[Path]] = {}
    splits = {p: _split_of(p, path) for p in files}
    if len(files) > 1 and any(s is None for s in splits.values()) and any(s is not None for s in splits.values()):
        odd = next(p for p, s in splits.items() if s is None)
        raise UserError(f"{odd}: belongs to no split (name it train-*, validation-* or test-*, as the other files)")
    for p in files:
        groups.setdefault(splits[p] or "train", []).append(p)
    out = []
    for name, paths in groups.items():
        tables = []
        for p in paths:
            try:
                tables.append(pa.parquet.read_table(p))
            except (OSError, pa.ArrowException) as e:
                raise UserError(f"{p}: not a readable parquet file ({e})") from None
        out.append(_joined(name, tables, [str(p) for p in paths]))
    return out


def _joined(name: str, tables: list, files: list[str]) -> Split:
    pa = _pyarrow()
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowException as e:
        raise UserError(f"{files[-1]}: its columns differ from those of {files[0]} ({e})") from None
    return Split(name, table, _features_of(tables[0].schema), [(f, len(t)) for f, t in zip(files, tables)])


def read_saved(path: Path) -> list[Split]:
    """The splits of a `save_to_disk` folder (a DatasetDict's, or a single Dataset's as 'train'), read from its
    arrow files by pyarrow."""
    if (path / "dataset_dict.json").is_file():
        try:
            names = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path / 'dataset_dict.json'}: cannot read the list of splits ({e})") from None
        return [_read_saved_split(path / name, name) for name in names]
    return [_read_saved_split(path, "train")]


def _read_saved_split(folder: Path, name: str) -> Split:
    pa = _pyarrow()
    try:
        state = json.loads((folder / "state.json").read_text())
        info = json.loads((folder / "dataset_info.json").read_text())
        files = [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{folder}: not a saved dataset split (state.json, dataset_info.json: {e})") from None
    tables = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{f}: not a readable arrow file ({e})") from None
    if not tables:
        raise UserError(f"{folder / 'state.json'}: lists no data files")
    split = _joined(name, tables, [str(f) for f in files])
    split.features = _features_of(tables[0].schema, info.get("features"))
    return split


def read_hub(name: str, cfg: DataConfig) -> list[Split]:
    """A hub dataset (`user/name`, optionally `:config`) through `datasets.load_dataset` and its cache."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"--data hf:{name}: reading from the Hugging Face hub needs the datasets package: "
                        f"{INSTALL}") from None
    repo, _, config = name.partition(":")
    try:
        loaded = datasets.load_dataset(repo, config or None)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, no access: all end in the same advice
        cache = os.environ.get("HF_DATASETS_CACHE") or str(Path(os.environ.get("HF_HOME", "~/.cache/huggingface"))
                                                           / "datasets")
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"--data hf:{name}: cannot load it from the hub or the cache {cache} ({why}); where "
                        f"internet exists, fill that cache (HF_HOME / HF_DATASETS_CACHE), or save it with "
                        f"datasets.load_dataset('{repo}').save_to_disk(DIR) and pass --data DIR") from None
    parts = loaded.items() if isinstance(loaded, dict) else [("train", loaded)]
    return [Split(split, ds.with_format("arrow")[:], ds.features.to_dict(), [(f"hf:{name}", len(ds))])
            for split, ds in parts]


# -- columns ---------------------------------------------------------------------------------------------------
def _columns(split: Split) -> str:
    return ", ".join(f"{f.name} ({f.type})" for f in split.table.schema)


def _is_encoded(t) -> bool:
    pa = _pyarrow()
    if pa.types.is_struct(t):
        return any(t.field(i).name == "bytes" for i in range(t.num_fields))
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_array(t) -> bool:
    pa = _pyarrow()
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
        if pa.types.is_integer(t):
            return True
    return False


def _is_label(t) -> bool:
    pa = _pyarrow()
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or \
        pa.types.is_dictionary(t)


def _pick(names: list[str], preferred: tuple[str, ...]) -> str | None:
    return next((n for p in preferred for n in names if n.lower() == p), names[0] if names else None)


def find_columns(split: Split, cfg: DataConfig) -> tuple[str, str]:
    """(image column, label column) of a split: as named by --image-column / --label-column, else detected."""
    schema, features = split.table.schema, split.features
    source = split.files[0][0] if split.files else split.name
    for flag, name in (("--image-column", cfg.image_column), ("--label-column", cfg.label_column)):
        if name and name not in schema.names:
            raise UserError(f"{flag} {name}: {source} has no such column; its columns: {_columns(split)}")
    image = cfg.image_column or _pick([n for n in schema.names if (features.get(n) or {}).get("_type") == "Image"]
                                      or [n for n in schema.names if _is_encoded(schema.field(n).type)]
                                      or [n for n in schema.names if _is_array(schema.field(n).type)], IMAGE_NAMES)
    if image is None:
        raise UserError(f"{source}: no image column (encoded image bytes, or a uint8 array per row) among its "
                        f"columns {_columns(split)}; name it with --image-column")
    rest = [n for n in schema.names if n != image and _is_label(schema.field(n).type)]
    class_labels = [n for n in rest if (features.get(n) or {}).get("_type") == "ClassLabel"]
    label = cfg.label_column or next((n for p in LABEL_NAMES for n in rest if n.lower() == p), None) or \
        (class_labels[0] if len(class_labels) == 1 else None)
    if label is None:
        raise UserError(f"{source}: no label column (an integer or class-name column named "
                        f"{'/'.join(LABEL_NAMES[:4])}..., or a ClassLabel feature) among its columns "
                        f"{_columns(split)}; name it with --label-column")
    if not _is_label(schema.field(label).type):
        raise UserError(f"--label-column {label}: {source} holds {schema.field(label).type} there; expected integer "
                        f"labels or class names")
    if not (_is_encoded(schema.field(image).type) or _is_array(schema.field(image).type)):
        raise UserError(f"--image-column {image}: {source} holds {schema.field(image).type} there; expected "
                        f"encoded image bytes or uint8 arrays")
    return image, label


def _raw_labels(split: Split, column: str) -> tuple[list, bool]:
    """The label column as Python values, and whether it holds class names rather than numbers."""
    pa = _pyarrow()
    col = split.table.column(column)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.to_pylist(), not pa.types.is_integer(col.type)


def is_labelled(split: Split, column: str) -> bool:
    """Whether every row has a label (the hub marks unlabelled test rows with -1 or null)."""
    if column not in split.table.schema.names:
        return False
    values, named = _raw_labels(split, column)
    return all(v is not None and (named or v >= 0) for v in values)


def _label_ids(split: Split, column: str, classes: list[str] | None) -> np.ndarray:
    """Integer labels of a split (class names mapped to their index in `classes`); -1 where a row has none or
    names a class not in `classes`."""
    values, named = _raw_labels(split, column)
    if named:
        index = {c: i for i, c in enumerate(classes or [])}
        return np.array([index.get(v, -1) if v is not None else -1 for v in values], dtype=np.int64)
    return np.array([-1 if v is None else v for v in values], dtype=np.int64)


# -- images ----------------------------------------------------------------------------------------------------
def _encoded(split: Split, column: str, base: Path | None) -> list[bytes | None]:
    """The encoded bytes of each row (an Image feature without bytes is read from its path)."""
    pa = _pyarrow()
    col = split.table.column(column)
    if not pa.types.is_struct(col.type):
        return col.to_pylist()
    data = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    blobs = data.field("bytes").to_pylist()
    if any(b is None for b in blobs) and data.type.get_field_index("path") >= 0:
        for i, p in enumerate(data.field("path").to_pylist()):
            if blobs[i] is None and p:
                target = Path(p) if Path(p).is_absolute() or base is None else base / p
                try:
                    blobs[i] = target.read_bytes()
                except OSError:
                    pass
    return blobs


def _header(blob: bytes | None) -> tuple[tuple[int, int, bool] | None, str | None]:
    """((width, height, grey), None) from an encoded image's header, or (None, why it cannot be used)."""
    from PIL import Image, UnidentifiedImageError

    if not blob:
        return None, "no image data"
    try:
        with Image.open(io.BytesIO(blob)) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                return None, f"{w}x{h} pixels is larger than the safe limit of {MAX_IMAGE_PIXELS} pixels"
            return (w, h, img.mode in GREY_MODES), None
    except UnidentifiedImageError:
        return None, "not an image (format not recognised)"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return None, f"corrupt image ({e})"


def _array_rows(split: Split, column: str) -> np.ndarray:
    """A column of nested lists of integers 0..255 (one array per row, all of one shape) as uint8 N x ..."""
    pa = _pyarrow()
    col = split.table.column(column)
    data = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    source = split.files[0][0] if split.files else split.name
    if data.null_count:
        raise UserError(f"{split.where(int(np.flatnonzero(data.is_null().to_numpy(zero_copy_only=False))[0]))}: "
                        f"no image data")
    shape = [len(data)]
    while pa.types.is_list(data.type) or pa.types.is_large_list(data.type) or pa.types.is_fixed_size_list(data.type):
        lengths = pa.compute.list_value_length(data).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise UserError(f"{source}: the arrays of column {column} differ in shape; expected one shape for "
                            f"every row")
        shape.append(int(lengths[0]) if len(lengths) else 0)
        data = data.flatten()
    values = data.to_numpy(zero_copy_only=False)
    if values.size and (values.min() < 0 or values.max() > 255):
        raise UserError(f"{source}: column {column} holds values outside 0..255; expected uint8 pixels")
    return values.astype(np.uint8).reshape(shape)


@dataclass
class Decoding:
    """How every image of a dataset is decoded: channels, side (0: the images' own, all alike) and recipe."""

    channels: int
    size: int
    recipe: str


def plan_decoding(headers: list[tuple[int, int, bool]], cfg: DataConfig) -> Decoding:
    """Images all of one square size are kept at it, as arrays are (the recipe then chosen as for arrays);
    otherwise they are brought to one size by the recipe, as an image folder's are. Grey unless some are colour."""
    channels = cfg.channels or (1 if all(grey for _, _, grey in headers) else 3)
    sizes = {(w, h) for w, h, _ in headers}
    if len(sizes) == 1 and len({*next(iter(sizes))}) == 1:
        return Decoding(channels, 0, "")
    recipe = cfg.recipe
    if recipe == "auto":
        sample = headers[::max(1, len(headers) // 16)][:16]
        photos = sum(not grey and min(w, h) >= PHOTO_MIN_SIDE for w, h, grey in sample)
        recipe = "photo" if photos * 2 > len(sample) else "digits"
    return Decoding(channels, stored_size(recipe, cfg.image_size or DEFAULT_FOLDER_SIZE, cfg.crop_pct), recipe)


def _decode_all(blobs: list[bytes], keep: list[int], plan: Decoding, side: int) -> tuple[np.ndarray, list[str | None]]:
    pixels = np.empty((len(keep), plan.channels, side, side), np.uint8)

    def work(j: int) -> str | None:
        array, why = read_image(blobs[keep[j]], plan.channels, plan.size, plan.recipe or "digits")
        if array is not None:
            pixels[j] = array
        return why

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        whys = list(pool.map(work, range(len(keep)), chunksize=64))
    return pixels, whys


# -- splits into sets ------------------------------------------------------------------------------------------
def choose_splits(splits: list[Split], label: str | None = None) -> tuple[Split, Split | None]:
    """(training split, validation split or None): train; then validation/valid/val, else a labelled test."""
    by_role: dict[str, Split] = {}
    for s in splits:
        role = SPLIT_ROLES.get(s.name.lower())
        if role and role not in by_role:
            by_role[role] = s
    train = by_role.get("train") or (splits[0] if len(splits) == 1 else None)
    if train is None:
        raise UserError(f"{splits[0].files[0][0] if splits[0].files else splits[0].name}: no 'train' split among "
                        f"{', '.join(s.name for s in splits)}")
    val = by_role.get("val")
    if val is None and "test" in by_role and by_role["test"] is not train and \
            (label is None or is_labelled(by_role["test"], label)):
        val = by_role["test"]
    return train, (val if val is not train else None)


def to_image_sets(splits: list[Split], cfg: DataConfig, skipped: Skipped | None, base: Path | None = None):
    """(train, validation or None) as `ImageSet`s, from a dataset's splits."""
    first, _ = choose_splits(splits)
    image, label = find_columns(first, cfg)
    train, val = choose_splits(splits, label)
    parts = [train] + ([val] if val is not None else [])
    for part in parts[1:]:
        missing = [c for c in (image, label) if c not in part.table.schema.names]
        if missing:
            raise UserError(f"{part.files[0][0] if part.files else part.name}: split '{part.name}' has no column "
                            f"{missing[0]}; its columns: {_columns(part)}")
    names = (train.features.get(label) or {}).get("names")
    raw, named = _raw_labels(train, label)
    if named and not names:
        names = sorted({v for v in raw if v is not None})
    labels = [_label_ids(part, label, names) for part in parts]
    classes = list(names) if names else \
        [str(i) for i in range(max(int(max((lab.max() for lab in labels if len(lab)), default=-1)) + 1, 1))]
    sets, plan = [], None
    if _is_array(train.table.schema.field(image).type):
        arrays = [_array_rows(part, image) for part in parts]
    else:
        blobs = [_encoded(part, image, base) for part in parts]
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            headers = [list(pool.map(_header, b, chunksize=256)) for b in blobs]
        plan = plan_decoding([h for part in headers for h, _ in part if h is not None] or [(1, 1, True)], cfg)
    for k, part in enumerate(parts):
        good = []
        for i, lab in enumerate(labels[k]):
            why = None if 0 <= lab < len(classes) else \
                "no label" if lab == -1 else f"label {lab} is outside 0..{len(classes) - 1}"
            if why is None and plan is not None:
                why = headers[k][i][1]
            if why:
                refuse_or_skip(skipped, part.where(i), why)
            else:
                good.append(i)
        if plan is None:
            pixels = arrays[k][good]
        else:
            side = plan.size or (headers[k][good[0]][0][0] if good else 1)
            pixels, whys = _decode_all(blobs[k], good, plan, side)
            if any(whys):
                for j, why in enumerate(whys):
                    if why:
                        refuse_or_skip(skipped, part.where(good[j]), why)
                ok = [j for j, why in enumerate(whys) if not why]
                pixels, good = pixels[ok], [good[j] for j in ok]
        if not good:
            raise UserError(f"{part.where(0).rsplit(' row', 1)[0]}: no usable samples")
        if plan is None:
            made = arrays_to_set(pixels, labels[k][good], part.where(0).rsplit(" row", 1)[0], classes)
        else:
            made = ImageSet(torch.from_numpy(pixels), torch.from_numpy(labels[k][good]), classes, plan.recipe)
        sets.append(made)
    return sets[0], (sets[1] if len(sets) > 1 else None)


def named(location: str) -> bool:
    return location.startswith("hf:")


def recognise(path: Path) -> bool:
    return is_saved_dataset(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet | None]:
    """A hub name (hf:user/name, or any name with --data-format hf that is no path here), or a save_to_disk folder."""
    path = Path(location)
    if location.startswith("hf:") or not path.exists():
        return to_image_sets(read_hub(location.removeprefix("hf:"), cfg), cfg, skipped)
    if not path.is_dir():
        raise UserError(f"--data {path}: --data-format hf reads a save_to_disk folder or a hub name")
    return to_image_sets(read_saved(path), cfg, skipped, path)
