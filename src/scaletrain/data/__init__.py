"""The data layer: what `--data` names, read into a few types, split and sharded, and made into batches.

From the bottom up: `types` (ImageSet, ImageFiles, PreparedSet) with `images` (one image file read) and `indices`
(the split and each rank's share); `cache` (what a run learned about an image folder); `sources/` (one module per
kind of data, and the table `--data` and `--data-format` read); `read` (a dataset and its validation split);
`transforms` and `regularise` (uint8 batches made model inputs on the device); `batches` (the batch makers the loop
iterates). Nothing here imports the training loop or talks to other processes.
"""

from .read import load_image_sets, read_ahead, read_dataset
from .sources.embedded import embedded_mnist
from .types import ImageFiles, ImageSet, PreparedSet, Skipped, mean_std

__all__ = ["ImageFiles", "ImageSet", "PreparedSet", "Skipped", "embedded_mnist", "load_image_sets", "mean_std",
           "read_ahead", "read_dataset"]
