"""scaletrain: train image classifiers unchanged on a CPU, one GPU, several GPUs or several machines.

The Python API: build a `TrainConfig`, bring any `nn.Module` and `Dataset` (or an in-memory `ImageSet`), and call
`fit` in every process of the job; or call `train(config)` to do what `scaletrain train` does (from a notebook,
under accelerate's `notebook_launcher`). The `scaletrain` command is built on the same calls.
"""

__version__ = "0.1.0"

import os as _os  # noqa: E402
import time as _time  # noqa: E402

# When this job was launched: the launcher's own start, handed to its workers, or this process's import.
LAUNCHED_AT = float(_os.environ.get("SCALETRAIN_LAUNCH_TIME") or _time.time())

from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from .data import ImageSet, load_image_sets  # noqa: E402
from .engine import FitResult, evaluate, fit  # noqa: E402
from .models import build_model  # noqa: E402


def train(config: TrainConfig | dict) -> FitResult:
    """Train as `scaletrain train` does, from a config (or its `to_dict()`): data, model and options all from it.

    Runs in this process, or in every process of a job started around it, e.g. by accelerate's
    `notebook_launcher(scaletrain.train, args=(config,), num_processes=2)`, or as the training function of Ray
    Train's `TorchTrainer(scaletrain.train, train_loop_config=config.to_dict(), ...)`, which then receives every
    epoch's metrics and training state (see ray_train.py). `config.run.output_dir` must name the run folder, so
    that every process agrees on it.
    """
    from . import ray_train
    from .training import run

    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    if not config.run.output_dir:
        raise ValueError("config.run.output_dir: name the run folder (every process must use the same one)")
    config.validate()
    return ray_train.run(config) if ray_train.in_ray_worker() else run(config)

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TrainConfig", "ImageSet", "load_image_sets",
           "FitResult", "fit", "train", "evaluate", "build_model", "__version__"]
