"""Where data comes from: one module per source, each with the same small interface, and the table of them.

A source module has `FORMAT`, its `--data-format` name ("" for a source that `--data` names by itself: a name, a
prefix or a marker file); `recognise(location)`, whether `--data` is this source's (a name of it, or a path that
holds it); and `read(location, config, skipped)`, which reads it into the data types as (train, validation or
None), refusing a bad sample by name or, with `skipped`, leaving it out and listing it.

A new source is one module here and one line in `SOURCES`.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import UserError
from . import cifar, embedded, folder, hf, idx, kaggle, npz, parquet, prepared, torchvision_sets

# In the order --data is matched against them: sources named by --data alone first (they win over --data-format),
# then, without --data-format, by what the path holds.
SOURCES = (
    embedded,          # default: the MNIST digits in the package
    torchvision_sets,  # cifar10, cifar100, fashion_mnist, kmnist, svhn, under --cache-dir
    prepared,          # a folder `scaletrain prepare` wrote, local or s3://
    hf,                # hf:<hub name>, or a save_to_disk folder
    cifar,             # cifar-10-batches-py/, cifar-100-python/
    idx,               # mnist (downloaded), or a folder of IDX files
    kaggle,            # train.csv / test.csv
    npz,               # .npz arrays
    parquet,           # .parquet files
    folder,            # class subfolders of images
)


def formats() -> tuple[str, ...]:
    """The values --data-format takes: auto, then each source's own."""
    return ("auto", *(s.FORMAT for s in SOURCES if s.FORMAT))


def source_for(location: str, data_format: str = "auto"):
    """The source module that reads --data `location`: one named by it, else the --data-format asked for, else
    the first that recognises it. Refused on one line when there is none."""
    named = next((s for s in SOURCES if not s.FORMAT and s.recognise(location)), None)
    if named is not None:
        return named
    if data_format != "auto":
        chosen = next((s for s in SOURCES if s.FORMAT == data_format), None)
        if chosen is None:
            raise UserError(f"--data-format {data_format}: unknown format; choose from {', '.join(formats())}")
        return chosen
    found = next((s for s in SOURCES if s.FORMAT and s.recognise(location)), None)
    if found is not None:
        return found
    path = Path(location)
    if not path.exists():
        raise UserError(f"--data {location}: no such file or folder")
    if path.is_file():
        raise UserError(f"--data {path}: a file must be .npz, .csv or .parquet; folders may hold IDX files, "
                        f"train.csv, a saved Hugging Face dataset, parquet files or class subfolders")
    raise UserError(f"--data {path}: found no IDX files, train.csv, saved Hugging Face dataset, parquet files or "
                    f"class subfolders")
