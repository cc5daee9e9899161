"""The training loop: `fit` for any model and dataset, on every process of a job.

`fit` builds what the run needs once (build.py), resumes from the run folder's newest checkpoint, and then
alternates `train_one_epoch` and validation (epoch.py), handing each finished epoch to the run's outputs
(outputs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from torch import nn
from torch.utils.data import Dataset

from ..config import Settings, TrainConfig
from ..data.streams import DataPaused
from ..data.transforms import Preprocess
from ..data.types import ImageFiles, ImageSet
from ..parallel import Runtime, runtime_for
from ..runfolder import JobHold
from .build import Run, build_run, settings_for
from .checkpoint import TrainState
from .epoch import train_one_epoch, validate
from .hooks import UserCode
from .outputs import RunOutputs
from ..steps import Step
from .schedules import Schedule
from .signals import LoopControls, Preempted, TrainingDiverged


@dataclass
class FitResult:
    best_val_accuracy: float | None  # at the best epoch; None: not a classifier, or trained without validation
    history: list[dict[str, Any]] = field(default_factory=list)  # metrics.csv's rows
    run_dir: str = ""
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json
    best: dict[str, float] = field(default_factory=dict)  # every validation value at the best epoch (--monitor)


def fit(model: nn.Module, train_data: ImageSet | ImageFiles | Dataset,
        val_data: ImageSet | ImageFiles | Dataset | None, config: TrainConfig | Settings | None = None, *,
        loss_fn: Callable | None = None, optimizer: Callable | None = None,
        scheduler: Callable | Schedule | None = None, step: Step | None = None,
        metrics: Mapping[str, Any] | None = None, output_key: str | int | None = None,
        batch_keys: Sequence[str] | None = None, collate_fn: Callable | None = None, seed_fn: Callable | None = None,
        sampler: Any = None, on_epoch: Callable[[dict[str, Any], int], None] | None = None) -> FitResult:
    """Train `model` on `train_data`, validating on `val_data` (None: none) after every epoch, on every process.

    Data is an `ImageSet` or `ImageFiles` (uint8 images, augmented and normalised on the device) or any `Dataset`
    whose items are tuples `(x, y, ...)` or dicts (see data/items.py: `batch_keys`, `collate_fn`, `seed_fn`), or an
    IterableDataset of such items (see data/streams.py); the targets may be anything the loss takes. The model's
    output has the batch first (`output_key` picks it from a dict, tuple or object). Validation measures the loss,
    accuracy for a single-label classifier and `metrics` ({name: torchmetrics Metric or f(outputs, targets) per
    sample}), each exact on any process count (see metrics.py); `sampler` (a Sampler of training-set indices) draws
    each epoch's order, seeded and shared among the processes (see data/indices.SamplerOrder);
    `config.optim.monitor` names the value that picks best.safetensors and early stopping.
    `loss_fn`, `optimizer` and `scheduler` replace scaletrain's own (see training/hooks.py); `step`, a
    `scaletrain.Step`, replaces the step itself (see steps.py: a call other than model(x), named losses, a
    different evaluation, several optimizers, a gather that keeps gradients). Items that are dicts of the keys the
    model's forward takes go to it as `model(**batch)`, with the loss it returns. Call it in every
    process of a launched job; each returns the same. A run folder (config.run.output_dir) holding training state
    is resumed from its newest checkpoint. `on_epoch(row, step)` is called in every process after each epoch's
    checkpoint (`step`: the optimizer steps done), with the epoch's metrics.csv row. `config` is only read: the run
    resolves it once (see config.Settings), and config.yaml records what it resolved to. The class names saved with
    the weights are the training set's `classes` (as torchvision's folders have them; a Subset's dataset's too).
    (The whole config: the run is made from it.)
    """
    code = UserCode(loss_fn, optimizer, scheduler, batch_keys, collate_fn, seed_fn, metrics, output_key, sampler,
                    step)
    return fit_launched(model, train_data, val_data, config, code, on_epoch)


@dataclass
class Launched:
    """What scaletrain's own commands give the loop beyond a user's arguments: the runtime and the run folder's
    hold they made already, and the preprocessing that pretrained weights expect (None: the data's own)."""

    runtime: Runtime | None = None
    hold: JobHold | None = None
    preprocess: Preprocess | None = None
    controls: LoopControls | None = None  # `verify`'s: a recorder watching each step


def fit_launched(model: nn.Module, train_data, val_data, config: TrainConfig | Settings | None, code: UserCode,
                 on_epoch: Callable[[dict[str, Any], int], None] | None = None,
                 launched: Launched | None = None) -> FitResult:
    """`fit`, reached by scaletrain's own commands with what they made already (`launched`). (The whole config:
    it resolves it into the run's settings.)"""
    config = config if isinstance(config, Settings) else (config or TrainConfig()).validate()
    launched = launched or Launched()
    if launched.runtime is None:
        runtime = runtime_for(config.run)
        try:
            return fit_launched(model, train_data, val_data, config, code, on_epoch,
                                dataclasses.replace(launched, runtime=runtime))
        finally:
            runtime.end()
    runtime = launched.runtime
    settings = settings_for(config, train_data, runtime)
    runtime.watch(settings.run.stall_timeout)  # a rank that stalls or fails is named by every process
    try:
        with JobHold.workers(settings.run.output_dir, runtime, launched.hold or False) as hold:  # one job a folder
            run = build_run(model, train_data, val_data, settings, runtime, launched.preprocess, code,
                            launched.controls)
            hold.checks_passed()
            state, outputs, summary = _train(run, on_epoch)
            runtime.barrier()  # every rank leaves together, after the main process has written the run folder
    except (Preempted, TrainingDiverged):  # every rank at once
        raise
    except Exception as e:
        named = runtime.named_failure(e)  # another rank's failure, when it broke this rank's collective
        if named is None:
            raise
        raise named from None
    finally:
        runtime.unwatch()
    best = {k[len("best_"):]: v for k, v in summary.items() if k.startswith("best_val_") and v is not None}
    return FitResult(summary.get("best_val_accuracy"), state.history, outputs.run_dir, summary, best)


def _train(run: Run, on_epoch) -> tuple[TrainState, RunOutputs, dict[str, Any]]:
    """fit's work once the run is built: (the final state, the outputs, summary.json's values)."""
    state = run.resume()
    outputs = RunOutputs(run, state, on_epoch)  # console, run folder, checkpoints, trackers, early stopping
    run.controls.observer.started(run)
    try:
        while outputs.keep_training(state):
            try:
                row = train_one_epoch(run, state, outputs.on_log)
            except DataPaused as e:  # every rank at the same step: its training state saved, then stop
                if run.checkpointer is not None:
                    run.checkpointer.save(state)
                raise Preempted(f"{e}; saved the training state at optimizer step {state.step}: run the same "
                                f"command again once it answers") from None
            if row is None:  # a stop signal: every rank saved the same step
                raise Preempted.at_step(state.step, run.controls.stop.received)
            row.update(validate(run, epoch=state.epoch + 1))
            run.schedule.after_epoch(row)  # a scheduler stepped per epoch, or with the monitored value
            outputs.epoch(row, state)
        summary = outputs.finish(state)
        run.runtime.restore_whole(run.plain)  # a model object the layout split trained as a copy: given it whole
    finally:
        outputs.close()
        run.close()
    return state, outputs, summary
