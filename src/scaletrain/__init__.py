"""scaletrain: train image classifiers unchanged on a CPU, one GPU, several GPUs or several machines.

The Python API: build a `TrainConfig`, bring any `nn.Module` and `Dataset` (or an in-memory `ImageSet`), and call
`fit` in every process of the job. The `scaletrain` command is built on the same calls.
"""

__version__ = "0.1.0"

from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from .data import ImageSet, load_image_sets  # noqa: E402
from .engine import FitResult, evaluate, fit  # noqa: E402
from .models import build_model  # noqa: E402

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TrainConfig", "ImageSet", "load_image_sets",
           "FitResult", "fit", "evaluate", "build_model", "__version__"]
