"""Where data comes from: one module per source, each with the same small interface, and the table of them.

A source module has:
- `FORMAT`: its `--data-format` name ("" for a source that `--data` alone selects);
- `named(location)`: whether `--data` names this source by itself (a name such as `mnist`, a prefix such as `hf:`
  or `s3://`, a marker file such as prepared.json); a source so named is read whatever `--data-format` says;
- `recognise(path)`: whether an existing path holds this source's data (auto-detection, `--data-format auto`);
- `read(location, config, skipped)`: the data as (train, validation or None) in the types of data/types.py, a bad
  sample refused by name or, with `skipped`, left out and listed;
- optionally `begin(location, config)`: read()'s first half started ahead of the run's need, something with
  `finish()` (what read() returns) and `cancel()` (see read.read_ahead).

A new source is one module here and one line in `SOURCES`.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import UserError
from . import chunks, cifar, embedded, folder, hf, idx, kaggle, npz, parquet, prepared, torchvision_sets

# The order in which sources are asked, for a name first, then for what a path holds. It also orders the
# --data-format choices.
SOURCES = (
    embedded,          # default: the MNIST digits in the package
    torchvision_sets,  # cifar10, cifar100, fashion_mnist, kmnist, svhn, under --cache-dir
    hf,                # hf:<hub name>, or a save_to_disk folder
    cifar,             # cifar-10-batches-py/, cifar-100-python/
    idx,               # mnist (downloaded), or a folder of IDX files
    kaggle,            # train.csv / test.csv
    chunks,            # chunks `scaletrain prepare` wrote to s3://... (or with --chunks), streamed by LitData
    prepared,          # a folder of shards `scaletrain prepare` wrote
    npz,               # .npz arrays
    parquet,           # .parquet files
    folder,            # class subfolders of images
)


def formats() -> tuple[str, ...]:
    """The values --data-format takes: auto, then each source's own."""
    return ("auto", *(s.FORMAT for s in SOURCES if s.FORMAT))


def source_for(location: str, data_format: str = "auto"):
    """The source module that reads --data `location`: the one it names, else the --data-format asked for, else
    the first that recognises what the path holds. Refused on one line when there is none."""
    if data_format not in formats():
        raise UserError(f"--data-format {data_format}: unknown format; choose from {', '.join(formats())}")
    named = next((s for s in SOURCES if s.named(location)), None)
    if named is not None:
        return named
    if data_format != "auto":
        return next(s for s in SOURCES if s.FORMAT == data_format)
    path = Path(location)
    if not path.exists():
        raise UserError(f"--data {location}: no such file or folder")
    return held_by(path)


def held_by(path: Path):
    """The first source that recognises what an existing path holds, names aside; refused when none does."""
    found = next((s for s in SOURCES if s.recognise(path)), None)
    if found is not None:
        return found
    if path.is_file():
        raise UserError(f"--data {path}: a file must be .npz, .csv or .parquet; folders may hold IDX files, "
                        f"train.csv, a saved Hugging Face dataset, parquet files or class subfolders")
    raise UserError(f"--data {path}: found no IDX files, train.csv, saved Hugging Face dataset, parquet files or "
                    f"class subfolders")
