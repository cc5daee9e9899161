"""Parquet files of a Hugging Face dataset (`--data-format parquet`): one file, a folder of them, or the hub's
train-*/validation-*/test-* layout, read with pyarrow alone (see hf.py for the columns and splits)."""

from __future__ import annotations

from pathlib import Path

from ...config import DataConfig
from ..types import ImageSet, Skipped, existing_path
from .hf import has_parquet, read_parquet, to_image_sets

FORMAT = "parquet"


def named(location: str) -> bool:
    return False


def recognise(path: Path) -> bool:
    return path.suffix.lower() == ".parquet" and path.is_file() or path.is_dir() and has_parquet(path)


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, ImageSet | None]:
    path = existing_path(location)
    return to_image_sets(read_parquet(path), cfg, skipped, path if path.is_dir() else path.parent)
