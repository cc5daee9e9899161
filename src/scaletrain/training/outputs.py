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

from ..metrics import Monitor
from ..parallel import BEAT, folder_bytes
from ..runfolder import INITIAL_WEIGHTS, RunFolder, curves_title, save_weights
from ..steps import overrides
from .build import Run
from .checkpoint import Checkpointer, TrainState
from .experiment_log import ExperimentLog


@dataclass
class Ended:
    """An epoch as the outputs see it: its metrics.csv row, the weights it ended with, whether the monitored
    validation value is the best so far for them ('') and for the weight average ('ema_'), and where training
    stands after it."""

    row: dict[str, Any]
    weights: Any  # a state dict or parallel.WholeTensors: read once, tensor by tensor, as last.safetensors is written
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
        self.folder.end_epoch(ended.row, ended.weights, self.run.meta, best=ended.best.get("", True))

    def finish(self, summary: dict[str, Any], state: TrainState) -> None:
        self.folder.finish(summary, curves_title(self.run.meta["model"], self.run.runtime.devices))
        monitor = self.run.monitor
        self.run.say((f"best {monitor.name} {summary['best_' + monitor.name]:.4f}" if monitor else
                      "trained without validation" if self.run.val_batches is None else
                      "best.safetensors: the last epoch's") + f"; run folder {self.folder.path}")


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
        folder = None  # the main process's run folder (None on the others, and without one)
        if run.runtime.is_main and self.run_dir:  # "" (the Python API's default): no files
            folder = RunFolder(self.run_dir)
            folder.start(run.meta["config"], run.meta["plan"], state.history)
            self.run_dir = str(folder.path)
            self.outputs.append(FolderFiles(run, folder))
        self.folder = folder
        run.say(describe_job(run))
        if run.monitor is not None:
            run.say(run.monitor.says())
        elif run.val_batches is not None:
            run.say(f"best.safetensors: the last epoch's, since no validation value says whether higher is better "
                    f"({', '.join(f'val_{n}' for n in run.measures.names())}); --monitor NAME --monitor-mode max "
                    f"or min picks one")
        if run.checkpointer is not None:
            self.outputs.append(CheckpointSave(run.checkpointer))
        if folder is not None:  # the trackers follow the checkpoint: a resume continues from the step it saved
            trackers = ExperimentLog(run.runtime, run.settings.run, folder.path, run.settings.to_dict(),
                                     run.meta["plan"], state.step)
            self.outputs.append(TrackerValues(trackers))
            self.on_log = trackers.step
        if on_epoch is not None:
            self.outputs.append(Callback(on_epoch))
        if run.settings.run.save_initial_weights and state.step == 0:  # a fresh run (every process alike)
            self.save_initial_weights(folder)
        self.started = time.perf_counter()

    def save_initial_weights(self, folder: RunFolder | None) -> None:
        """initial.safetensors: the weights training starts from, tensor by tensor from wherever they are held,
        for --init-from (runs on other layouts start from the very same weights)."""
        path = folder.path / INITIAL_WEIGHTS if folder is not None else None
        save_weights(path, self.run.runtime.whole_tensors(self.run.plain), {**self.run.meta, "epoch": 0})
        if path is not None:
            self.run.say(f"initial weights written to {path} (for --init-from)")

    def keep_training(self, state: TrainState) -> bool:
        """Another epoch runs: --epochs are not done, and --early-stopping has not seen too many epochs without a
        better monitored value (every rank saw the same values, so all decide alike)."""
        patience, monitor = self.run.settings.optim.early_stopping, self.run.monitor
        return state.epoch < self.run.settings.optim.epochs and not (
            patience and monitor and monitor.epochs_since_best(state.history) >= patience)

    def epoch(self, row: dict[str, Any], state: TrainState) -> None:
        """The epoch is done and validated: its console line, then it is recorded in the state and given to every
        output in turn."""
        monitor = self.run.monitor
        self.run.say(console_line(row, self.run.settings.optim.epochs, monitor))
        # the weights, tensor by tensor from wherever they are held, written by the main process (FolderFiles)
        weights = self.run.runtime.whole_tensors(self.run.plain) if self.run_dir else None
        best = {prefix: monitor.improves(row, state.history, prefix) for prefix, _ in self.run.validated} \
            if monitor else {}
        state.history.append(row)
        state.next_epoch()
        ended = Ended(row, weights, best, state)
        # the main process's files and trackers (their bytes show its progress); the others go on
        BEAT.mark("writing the epoch's outputs", probe=folder_bytes(self.run_dir) if self.run_dir else None)
        if weights is not None and not self.run.runtime.is_main:
            save_weights(None, weights, {})  # this process's pieces of last.safetensors, sent to the main process
        for output in self.outputs:
            output.epoch(ended)
        if self.run.ema is not None and self.run_dir:  # last_ema.safetensors, from every process's parts
            with self.run.ema.applied() as model:
                average = self.run.runtime.whole_tensors(model)
                if self.folder is not None:
                    self.folder.end_epoch_average(row, average, self.run.meta, best=best.get("ema_", True))
                else:
                    save_weights(None, average, {})

    def finish(self, state: TrainState) -> dict[str, Any]:
        """The run's summary, given to every output; returned."""
        run, patience, monitor = self.run, self.run.settings.optim.early_stopping, self.run.monitor
        if state.epoch < run.settings.optim.epochs and monitor:
            best = monitor.best_row(state.history)
            run.say(f"early stopping: {monitor.name} has not improved for {patience} epoch(s), best "
                    f"{best[monitor.name]:.4f} at epoch {best['epoch']}")  # type: ignore[index]
        summary = run_summary(run, state, time.perf_counter() - self.started)
        for output in self.outputs:
            output.finish(summary, state)
        return summary

    def close(self) -> None:
        for output in self.outputs:
            output.close()


def console_line(row: dict[str, Any], epochs: int, monitor: Monitor | None = None) -> str:
    """An epoch's line: the training loss (and a step's named losses), every validation value, the weight
    average's monitored one, the time."""
    values = [k for k in row if k.startswith("train_") and k not in ("train_loss", "train_samples")] + \
        [k for k in row if k.startswith("val_") and k != "val_samples"]
    if monitor is not None and "ema_" + monitor.name in row:
        values.append("ema_" + monitor.name)
    return (f"epoch {row['epoch']}/{epochs}  train_loss {row['train_loss']:.4f}  "
            + (f"{row['train_samples']} samples  " if "train_samples" in row else "")
            + "".join(f"{k} {row[k]:.4f}  " for k in values)
            + f"{row['epoch_seconds']:.1f}s  {row['images_per_second']:.0f} img/s")


def describe_job(run: Run) -> str:
    """The start-up line: what trains on what, where, in which precision, with which batch and learning rate."""
    runtime, settings, plan = run.runtime, run.settings, run.plan
    validation = "validating on a stream" if run.val_samples is None else \
        f"validating on {run.val_samples}" if run.val_samples else "without validation"
    trained = "a stream" if run.train_samples is None else f"{run.train_samples} samples"
    yours = type(getattr(run.optimizer, "optimizer", run.optimizer)).__name__  # as made, not as accelerate wraps it
    rate = f"your optimizers {run.optimizer.describe()}" if run.job.manual else f"your optimizer {yours}" \
        if run.code.optimizer or overrides(run.code.step, "optimizers") else f"learning rate {plan.lr:g}"
    return (f"training {run.meta['model']} on {trained}, {validation}; {runtime.world_size} "
            f"process(es) on {runtime.devices} {runtime.device.type} device(s) ({runtime.describe_layout()}), precision "
            f"{settings.run.mixed_precision}, batch {plan.batch_per_device} per device, global batch "
            f"{plan.global_batch}, {rate}" + (f", activation checkpointing over {runtime.checkpointed_blocks} blocks"
                         if settings.model.activation_checkpointing else ""))


def run_summary(run: Run, state: TrainState, seconds: float) -> dict[str, Any]:
    """summary.json: the outcome (the monitored value, and every validation value at the best epoch and at the
    last; accuracy only for a classifier), the job's shape and what each process held."""
    runtime, settings, plan, last, monitor = run.runtime, run.settings, run.plan, state.history[-1], run.monitor
    best = monitor.best_row(state.history) if monitor else None
    def values(row: dict[str, Any], prefix: str) -> dict[str, Any]:
        return {prefix + k: v for k, v in row.items() if k.startswith("val_") and k != "val_samples"}

    summary: dict[str, Any] = {"best_val_accuracy": None, "final_val_accuracy": None} if monitor is None else {
        "monitor": monitor.name, "best_epoch": best["epoch"], **values(best, "best_")}  # type: ignore[index, arg-type]
    summary.update(values(last, "final_"))
    summary.update({"val_samples": last.get("val_samples", 0),
                    "train_samples": last.get("train_samples", run.train_samples),  # a stream's: its last epoch's
                    "world_size": runtime.world_size, "devices": runtime.devices, "strategy": settings.run.strategy,
                    "batch_size_per_device": plan.batch_per_device, "global_batch_size": plan.global_batch,
                    "grad_accum": plan.grad_accum, "lr": plan.lr, "mixed_precision": settings.run.mixed_precision,
                    "device": runtime.device.type, "epochs": settings.optim.epochs, "total_seconds": seconds,
                    "model": run.meta["model"], "bytes_per_device": runtime.held_bytes(run.plain,
                                                                                            run.optimizer),
                    "epochs_run": len(state.history), "threads_per_process": torch.get_num_threads(),
                    "num_workers": run.workers})
    if run.ema is not None and monitor is not None:
        best_ema = monitor.best_row(state.history, "ema_")
        summary["best_ema_" + monitor.name] = best_ema["ema_" + monitor.name]  # type: ignore[index]
    if run.ema is not None:
        summary["ema_decay"] = settings.optim.ema_decay
    return summary
