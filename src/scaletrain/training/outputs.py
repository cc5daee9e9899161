"""The run's outputs, built once before `fit`'s loop: what happens when an epoch ends (the console line, then the
run folder's files, the weight average's files, the checkpoint, the trackers' values and the `on_epoch` callback,
each an output present only when the run has it), the early-stopping rule that decides whether another epoch
runs, and the run's start and end (config.yaml, the start-up line and the trackers; summary.json, curves.png and
the trackers' summary).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..runfolder import RunFolder, curves_title
from .build import Run
from .checkpoint import Checkpointer, TrainState
from .experiment_log import ExperimentLog


@dataclass
class Ended:
    """An epoch as the outputs see it: its metrics.csv row, the weights it ended with, which validation accuracies
    are the best so far ('val_accuracy', 'ema_val_accuracy'), and where training stands after it."""

    row: dict[str, Any]
    weights: dict[str, torch.Tensor]
    best: dict[str, bool]
    state: TrainState


class Output:
    """One thing done at every epoch's end and at the run's end; each does nothing by default."""

    def epoch(self, ended: Ended) -> None:
        pass

    def finish(self, summary: dict[str, Any], state: TrainState) -> None:
        pass

    def close(self) -> None:
        pass


class FolderFiles(Output):
    """metrics.csv, last/best.safetensors; at the end summary.json and curves.png."""

    def __init__(self, run: Run, folder: RunFolder):
        self.run, self.folder = run, folder

    def epoch(self, ended: Ended) -> None:
        self.folder.end_epoch(ended.row, ended.weights, self.run.meta, best=ended.best.get("val_accuracy", True))

    def finish(self, summary: dict[str, Any], state: TrainState) -> None:
        self.folder.finish(summary, curves_title(self.run.meta["model"], self.run.runtime.devices))
        self.run.say((f"best val_accuracy {state.best:.4f}" if self.run.val_samples else "trained without validation")
                     + f"; run folder {self.folder.path}")


class AverageFiles(Output):
    """The weight average's last_ema/best_ema.safetensors."""

    def __init__(self, run: Run, folder: RunFolder):
        self.run, self.folder = run, folder

    def epoch(self, ended: Ended) -> None:
        self.folder.end_epoch_average(ended.row, self.run.ema.state_dict(), self.run.meta,  # type: ignore[union-attr]
                                      best=ended.best["ema_val_accuracy"])


class CheckpointSave(Output):
    """The epoch's training state (every rank takes part)."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def epoch(self, ended: Ended) -> None:
        self.checkpointer.save(ended.state)


class TrackerValues(Output):
    def __init__(self, trackers: ExperimentLog):
        self.trackers = trackers

    def epoch(self, ended: Ended) -> None:
        self.trackers.epoch(ended.row, ended.state.step)

    def finish(self, summary: dict[str, Any], state: TrainState) -> None:
        self.trackers.summary(summary, state.step)

    def close(self) -> None:
        self.trackers.close()


class Callback(Output):
    """`fit`'s on_epoch(row, step), in every process, after the epoch's checkpoint."""

    def __init__(self, on_epoch: Callable[[dict[str, Any], int], None]):
        self.on_epoch = on_epoch

    def epoch(self, ended: Ended) -> None:
        self.on_epoch(ended.row, ended.state.step)


class RunOutputs:
    """The run's outputs and its stopping rule (see the module's docstring). Made after resuming: the run folder
    starts from the epochs done, the trackers continue at the resumed step."""

    def __init__(self, run: Run, state: TrainState, on_epoch: Callable[[dict[str, Any], int], None] | None = None):
        self.run, self.run_dir = run, run.settings.run.output_dir
        self.outputs: list[Output] = []
        self.on_log = None  # per --log-every values from inside the epoch, for the trackers
        folder = None
        if run.runtime.is_main and self.run_dir:  # "" (the Python API's default): no files
            folder = RunFolder(self.run_dir)
            folder.start(run.meta["config"], run.meta["plan"], state.history)
            self.run_dir = str(folder.path)
            self.outputs.append(FolderFiles(run, folder))
            if run.ema is not None:
                self.outputs.append(AverageFiles(run, folder))
        run.say(describe_job(run))
        if run.checkpointer is not None:
            self.outputs.append(CheckpointSave(run.checkpointer))
        if folder is not None:  # the trackers follow the checkpoint: a resume continues from the step it saved
            trackers = ExperimentLog(run.runtime, run.settings, folder.path, run.meta["plan"], state.step)
            self.outputs.append(TrackerValues(trackers))
            self.on_log = trackers.step
        if on_epoch is not None:
            self.outputs.append(Callback(on_epoch))
        self.started = time.perf_counter()

    def keep_training(self, state: TrainState) -> bool:
        """Another epoch runs: --epochs are not done, and --early-stopping has not seen too many epochs without a
        better validation accuracy (every rank saw the same accuracies, so all decide alike)."""
        patience = self.run.settings.optim.early_stopping
        return state.epoch < self.run.settings.optim.epochs and not (patience and state.epochs_since_best() >= patience)

    def epoch(self, row: dict[str, Any], state: TrainState) -> None:
        """The epoch is done and validated: its console line, then it is recorded in the state and given to every
        output in turn."""
        self.run.say(console_line(row, self.run.settings.optim.epochs))
        weights = self.run.runtime.strategy.full_state_dict(self.run.plain)  # under fsdp gathered from every rank
        best = {k: row[k] > max((r[k] for r in state.history), default=-1.0)
                for k in ("val_accuracy", "ema_val_accuracy") if k in row}
        state.history.append(row)
        state.next_epoch()
        ended = Ended(row, weights, best, state)
        for output in self.outputs:
            output.epoch(ended)

    def finish(self, state: TrainState) -> dict[str, Any]:
        """The run's summary, given to every output; returned."""
        run, patience = self.run, self.run.settings.optim.early_stopping
        if state.epoch < run.settings.optim.epochs:
            run.say(f"early stopping: val_accuracy has not improved for {patience} epoch(s), best {state.best:.4f} "
                    f"at epoch {len(state.history) - patience}")
        summary = run_summary(run, state, time.perf_counter() - self.started)
        for output in self.outputs:
            output.finish(summary, state)
        return summary

    def close(self) -> None:
        for output in self.outputs:
            output.close()


def console_line(row: dict[str, Any], epochs: int) -> str:
    return (f"epoch {row['epoch']}/{epochs}  train_loss {row['train_loss']:.4f}  "
            + (f"val_loss {row['val_loss']:.4f}  val_accuracy {row['val_accuracy']:.4f}  " if "val_loss" in row else "")
            + (f"ema_val_accuracy {row['ema_val_accuracy']:.4f}  " if "ema_val_accuracy" in row else "")
            + f"{row['epoch_seconds']:.1f}s  {row['images_per_second']:.0f} img/s")


def describe_job(run: Run) -> str:
    """The start-up line: what trains on what, where, in which precision, with which batch and learning rate."""
    runtime, settings, plan = run.runtime, run.settings, run.plan
    validation = f"validating on {run.val_samples}" if run.val_samples else "without validation"
    yours = type(getattr(run.optimizer, "optimizer", run.optimizer)).__name__  # as made, not as accelerate wraps it
    rate = f"your optimizer {yours}" if run.code.optimizer else f"learning rate {plan.lr:g}"
    return (f"training {run.meta['model']} on {run.train_samples} samples, {validation}; {runtime.world_size} "
            f"process(es) on {runtime.devices} {runtime.device.type} device(s) ({settings.run.strategy}), precision "
            f"{settings.run.mixed_precision}, batch {plan.batch_per_device} per device, global batch "
            f"{plan.global_batch}, {rate}" + (f", activation checkpointing over {runtime.checkpointed_blocks} blocks"
                         if settings.model.activation_checkpointing else ""))


def run_summary(run: Run, state: TrainState, seconds: float) -> dict[str, Any]:
    """summary.json: the outcome, the job's shape and what each process held."""
    runtime, settings, plan, last = run.runtime, run.settings, run.plan, state.history[-1]
    validated = "val_accuracy" in last  # None without a validation set: best is the last
    summary = {"best_val_accuracy": state.best if validated else None, "final_val_accuracy": last.get("val_accuracy"),
               "val_samples": last.get("val_samples", 0), "train_samples": run.train_samples,
               "world_size": runtime.world_size, "devices": runtime.devices, "strategy": settings.run.strategy,
               "batch_size_per_device": plan.batch_per_device, "global_batch_size": plan.global_batch,
               "grad_accum": plan.grad_accum, "lr": plan.lr, "mixed_precision": settings.run.mixed_precision,
               "device": runtime.device.type, "epochs": settings.optim.epochs, "total_seconds": seconds,
               "model": run.meta["model"], "bytes_per_device": runtime.strategy.held_bytes(run.plain, run.optimizer),
               "epochs_run": len(state.history)}
    if run.ema is not None:
        summary["best_ema_val_accuracy"] = max(r["ema_val_accuracy"] for r in state.history)
        summary["ema_decay"] = settings.optim.ema_decay
    return summary
