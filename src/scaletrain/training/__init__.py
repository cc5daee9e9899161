"""The training layer: `fit` and what it is made of.

- loop.py           `fit`: build the run, resume it, then epochs until done or stopped early
- build.py          what the loop builds once: runtime, batch makers, the model wrapped, optimizer, schedule (`Run`)
- epoch.py          `train_one_epoch` and `evaluate`
- outputs.py        the run's outputs: what happens when an epoch ends (console, run folder, checkpoint, trackers,
                    callback), early stopping, the summary
- optim.py          the optimizer and the learning-rate schedule
- schedules.py      when a scheduler is stepped: per optimizer step, per epoch, or with a validation value
- checkpoint.py     the training state and the checkpoints that resume it exactly
- ema.py            the weight average (--ema-decay)
- experiment_log.py what TensorBoard, MLflow and W&B receive
- signals.py        a diverged loss, a stop signal
- job.py            what a launcher settles once for its workers (the config, the checked data)
- worker.py         what each worker runs: data and model from a config, then `fit`
- ray_worker.py     the same as Ray Train's training function
- faults.py         fault injection for the tests of failure handling
"""

from .epoch import evaluate
from .loop import FitResult, fit
from .schedules import Schedule

__all__ = ["FitResult", "Schedule", "evaluate", "fit"]
