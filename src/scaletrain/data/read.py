"""Datasets as the training loop sees them: `--data` read by its source (see sources/), and the validation set
split off when the data brings none.

`load_image_sets` returns in-memory `ImageSet`s, lazily decoded `ImageFiles` (image folders too large to hold),
or `PreparedSet`s (prepared shards too large to hold).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ..config import DataConfig
from ..errors import UserError
from .images import PHOTO_MIN_SIDE
from .indices import stratified_split
from .sources import embedded, held_by, source_for
from .types import ImageFiles, ImageSet, PreparedSet, Skipped, labels_of, subset_of


def detect_format(path: Path) -> str:
    """The --data-format of what an existing `path` holds, as auto-detection finds it, whatever the path is called
    ("" for a prepared folder)."""
    return held_by(path).FORMAT


_ahead: list = []  # [(settings, the read begun with them)] while read_ahead holds one


@contextlib.contextmanager
def read_ahead(cfg: DataConfig) -> Iterator[None]:
    """Within it, `--data` is read from now on where its source can begin early (a large folder's first check on
    worker processes while the model's code imports: sources/folder.py), and `read_dataset` with these settings
    takes what was begun; what was not taken is stopped at the end. Nothing starts for other sources, for
    --skip-bad-samples, or for data that cannot be read: its error is raised where it is read."""
    begun = None
    if not cfg.skip_bad_samples:
        try:
            source = source_for(cfg.data, cfg.data_format)
            begun = source.begin(cfg.data, cfg) if hasattr(source, "begin") else None
        except UserError:
            begun = None
    if begun is not None:
        _ahead.append((cfg, begun))
    try:
        yield
    finally:
        if begun is not None and _ahead and _ahead[-1][1] is begun:
            _ahead.pop()
            begun.cancel()


def read_dataset(cfg: DataConfig, skipped: Skipped | None = None) -> tuple[ImageSet | ImageFiles | PreparedSet,
                                                                           ImageSet | ImageFiles | PreparedSet | None]:
    """Read `--data` as it is: (samples, the explicit validation set or None). Nothing is split off here."""
    if _ahead and skipped is None and _ahead[-1][0] == cfg:  # begun by read_ahead with these very settings
        return _ahead.pop()[1].finish()
    return source_for(cfg.data, cfg.data_format).read(cfg.data, cfg, skipped)


def load_image_sets(cfg: DataConfig | str = embedded.DEFAULT_DATA, val_fraction: float = 0.2, seed: int = 0,
                    skipped: Skipped | None = None) -> tuple[ImageSet | ImageFiles, ImageSet | ImageFiles]:
    """Read `--data` and return (train, validation): in-memory `ImageSet`s, or lazily decoded `ImageFiles`.

    `cfg` is a DataConfig, or just the --data string with the other settings at their defaults. Without an
    explicit validation set, a stratified, seeded `val_fraction` is split off (the embedded default always
    splits the same 8,000 / 2,000 way).
    """
    if isinstance(cfg, str):
        cfg = DataConfig(data=cfg, val_fraction=val_fraction)
    train, val = read_dataset(cfg, skipped)
    if isinstance(train, ImageSet) and not train.recipe:  # arrays; folders chose theirs by their files
        recipe = cfg.recipe
        if recipe == "auto":
            photo = train.channels == 3 and min(train.images.shape[-2:]) >= PHOTO_MIN_SIDE
            recipe = "photo" if photo else "digits"
        for part in (train, val):
            if part is not None:
                part.recipe = recipe
    if cfg.data == embedded.DEFAULT_DATA:
        train_idx, val_idx = stratified_split(train.labels, embedded.DEFAULT_VAL_SIZE,
                                              embedded.DEFAULT_SPLIT_SEED)
        return train.subset(train_idx), train.subset(val_idx)
    if val is None:
        val_count = max(1, round(len(train) * cfg.val_fraction))
        if val_count >= len(train):
            raise UserError(f"--data {cfg.data}: {len(train)} samples are too few to split off a validation set")
        train_idx, val_idx = stratified_split(labels_of(train), val_count, seed)
        train, val = subset_of(train, train_idx), subset_of(train, val_idx)
    if isinstance(train, ImageSet) and val.images.shape[1:] != train.images.shape[1:]:
        raise UserError(f"--data {cfg.data}: validation images are {tuple(val.images.shape[1:])}, "
                        f"training images {tuple(train.images.shape[1:])}")
    classes = max(train.classes, val.classes, key=len)
    train.classes = val.classes = classes
    return train, val
