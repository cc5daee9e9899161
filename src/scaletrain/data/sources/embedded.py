"""`--data default`: the 10,000 genuine MNIST test images shipped inside the package (CC BY-SA 3.0, see assets),
which training splits the same fixed, stratified 8,000 / 2,000 way every time."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ...config import DataConfig
from ..types import ImageSet, Skipped, arrays_to_set
from .idx import idx_pair

FORMAT = ""  # named by --data alone
DEFAULT_DATA = "default"
DEFAULT_VAL_SIZE = 2000
DEFAULT_SPLIT_SEED = 20240419


def embedded_mnist() -> ImageSet:
    """The 10,000 genuine MNIST test images shipped inside the package (CC BY-SA 3.0, see assets)."""
    folder = resources.files("scaletrain") / "assets" / "mnist_t10k"
    with resources.as_file(folder) as path:
        images, labels = idx_pair(Path(path) / "t10k-images-idx3-ubyte.gz", Path(path) / "t10k-labels-idx1-ubyte.gz")
    return arrays_to_set(images, labels, "embedded MNIST")


def named(location: str) -> bool:
    return location == DEFAULT_DATA


def recognise(path: Path) -> bool:
    return False


def read(location: str, cfg: DataConfig, skipped: Skipped | None) -> tuple[ImageSet, None]:
    return embedded_mnist(), None
