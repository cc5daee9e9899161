"""scaletrain: train image classifiers unchanged on a CPU, one GPU, several GPUs or several machines.

The Python API: bring any `nn.Module` and `Dataset` (or an in-memory `ImageSet`), with your own loss, optimizer
and scheduler (a `Schedule` says when it is stepped) and a `Step` of your own if you like, and call `fit` in every
process of the job, then `predict` and `evaluate`; `verify` to prove the model trains the same on each layout; or call
`train(config)` to do what `scaletrain train` does (from a notebook, under accelerate's `notebook_launcher`). The
`scaletrain` command is built on the same calls.
"""

__version__ = "0.1.0"

# parallel first: where there is no /proc, a run's launch time is this import, before torch's (parallel.launch)
from . import parallel  # noqa: E402, F401
from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402, I001
from .data import ImageSet, load_image_sets  # noqa: E402
from .models import build_model  # noqa: E402
from .inference.api import evaluate, predict  # noqa: E402
from .steps import Step  # noqa: E402
from .training import FitResult, Schedule, fit  # noqa: E402
from .measure.verify import VerifyResult, verify_model as verify  # noqa: E402


def train(config: TrainConfig | dict) -> FitResult:
    """Train as `scaletrain train` does, from a config (or its `to_dict()`): data, model and options all from it.

    Runs in this process, or in every process of a job started around it, e.g. by accelerate's
    `notebook_launcher(scaletrain.train, args=(config,), num_processes=2)`, or as the training function of Ray
    Train's `TorchTrainer(scaletrain.train, train_loop_config=config.to_dict(), ...)`, which then receives every
    epoch's metrics and training state (see training/ray_worker.py). `config.run.output_dir` must name the run
    folder, so that every process agrees on it. (The whole config: the run is made from it.)
    """
    from .training import ray_worker
    from .training.worker import run

    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    if not config.run.output_dir:
        raise ValueError("config.run.output_dir: name the run folder (every process must use the same one)")
    config.validate()  # resolved by the run, once; this config is not changed
    on_epoch = ray_worker.prepare(config.run.output_dir) if ray_worker.in_ray_worker() else None
    return run(config, on_epoch=on_epoch)

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TrainConfig", "ImageSet", "load_image_sets",
           "FitResult", "Schedule", "Step", "fit", "train", "predict", "evaluate", "build_model", "verify",
           "VerifyResult", "__version__"]
