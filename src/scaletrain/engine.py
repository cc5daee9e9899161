"""The training loop: `fit` for any model and dataset, made of `train_one_epoch` and `evaluate`.

The same code runs on one process or many: it asks the `Runtime` for its rank, device and reductions and never
talks to torch.distributed itself. Printing and files come from the main process only.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .config import TrainConfig, parse_augment
from .data import ImageSet, mean_std
from .parallel import Runtime
from .pipeline import DeviceBatches, LoaderBatches, Preprocess, decode_all, fits_on_device, lockstep
from .sources import ImageFiles
from . import faults
from .checkpoint import TrainingState, find_resumable, load_state, save_state
from .report import EventLog, curves_title, write_curves
from .runfolder import METRIC_COLUMNS, RunFolder, read_metrics, save_weights


class TrainingDiverged(Exception):
    """The loss became NaN or infinite on some process; every process raises it at the same step."""

    exit_code = 3


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1) arrived; every process checkpointed at the same step and stops."""

    exit_code = 75  # EX_TEMPFAIL: run the same command again to resume


class StopSignals:
    """Remembers that SIGTERM or SIGUSR1 arrived, so training can stop at a step boundary after a checkpoint."""

    def __init__(self):
        self.received: str | None = None

    def install(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda num, frame: setattr(self, "received", signal.Signals(num).name))


STOP = StopSignals()


@dataclass
class FitResult:
    best_val_accuracy: float
    history: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


# -- building blocks -------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    # No weight decay on biases and normalisation parameters (1-D tensors), as timm and nanoGPT do.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Not fused=True: with it, a run resumed from a checkpoint no longer ends bitwise equal (torch 2.15, CPU).
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.momentum > 0)
    if o.optimizer == "adam":
        return torch.optim.Adam(groups, lr=o.lr)
    return torch.optim.AdamW(groups, lr=o.lr)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total`.

    Linear warm-up over `warmup` steps, then: constant; cosine decay to zero; or onecycle, a linear fall to
    zero (the triangular one-cycle schedule).
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return max(0.0, 1 - progress)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    total = steps_per_epoch * cfg.optim.epochs
    warmup = min(total - 1, round(cfg.optim.warmup_epochs * steps_per_epoch))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, warmup, cfg.optim.scheduler))


def _batches(data: ImageSet | ImageFiles | Dataset, runtime: Runtime, cfg: TrainConfig, pre: Preprocess | None,
             train: bool):
    """Batches for one split: built on the device when the decoded data fits there, else from a DataLoader."""
    common = dict(train=train, rank=runtime.rank, world=runtime.world_size, seed=cfg.run.seed,
                  channels_last=cfg.model.channels_last)
    batch_size = cfg.optim.batch_size * runtime.devices_per_process  # DataParallel splits it over its GPUs
    if not isinstance(data, (ImageSet, ImageFiles)):  # a user's Dataset of model-ready tensors
        return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, **common)
    augment = parse_augment(cfg.data.augment)
    choice = cfg.data.data_on_device
    if choice == "yes" or (choice == "auto" and fits_on_device(data.nbytes, runtime.device)):
        if isinstance(data, ImageFiles):
            images, labels = decode_all(data, cfg.data.num_workers)
            data = ImageSet(images, labels, data.classes)
        return DeviceBatches(data, pre, runtime.device, batch_size, augment=augment, **common)
    return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, pre=pre,
                         augment=augment, **common)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# -- phases ----------------------------------------------------------------------------------------------------
@dataclass
class Position:
    """Where training stands: the epoch in progress, batches of it done, optimizer steps done overall."""

    epoch: int = 0
    batch: int = 0
    step: int = 0


def train_one_epoch(model, optimizer, scheduler, batches, runtime: Runtime, cfg: TrainConfig, pos: Position,
                    totals: torch.Tensor | None = None, bar=None, on_step=None, on_log=None) -> dict[str, float]:
    """This rank's shard of epoch `pos.epoch` from batch `pos.batch` on; returns the epoch's training loss
    averaged over all ranks' samples. `on_step(pos, totals)` runs after every optimizer step (checkpoints);
    `on_log(step, values)` at every --log-every with the loss reduced over all ranks (event files)."""
    model.train()
    accum, n_steps, epoch = cfg.optim.grad_accum, len(batches), pos.epoch
    sizes = [min(batches.batch_size, batches.num_samples - i * batches.batch_size) for i in range(n_steps)]
    # (sum of per-sample losses, samples) of this rank, carried over when resuming mid-epoch
    totals = torch.zeros(2, device=runtime.device) if totals is None else totals.to(runtime.device)
    _sync(runtime.device)
    t0 = time.perf_counter()
    stop_requested = False
    for i, (x, y) in enumerate(batches.epoch(epoch, start=pos.batch), start=pos.batch):
        group = range(i - i % accum, min(i - i % accum + accum, n_steps))
        last_in_group = i == group[-1]
        with runtime.strategy.no_sync(model, skip=not last_in_group):
            with runtime.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=cfg.optim.label_smoothing)
            # Weight each micro-batch by its share of the group's samples: accumulation equals one big batch.
            runtime.backward(loss * (len(y) / sum(sizes[j] for j in group)))
        if last_in_group:
            optimizer.step()
            if not runtime.optimizer_step_was_skipped:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        totals += torch.stack([loss.detach().float() * len(y), torch.tensor(float(len(y)), device=totals.device)])
        if (i + 1) % cfg.run.log_every == 0 or i + 1 == n_steps:
            # One reduction carries the loss and whether any rank was told to stop: all ranks decide alike.
            flag = torch.tensor([float(STOP.received is not None)], device=totals.device)
            summed = runtime.sum(torch.cat([totals, flag]))
            stop_requested = stop_requested or summed[2].item() > 0
            mean_loss = (summed[0] / summed[1]).item()
            if not math.isfinite(mean_loss):
                raise TrainingDiverged(f"training loss became {mean_loss} in epoch {epoch + 1} by step {i + 1}; "
                                       f"lower --lr or use --mixed-precision no")
            if bar is not None or on_log is not None:
                lr, img_s = scheduler.get_last_lr()[0], summed[1].item() / max(time.perf_counter() - t0, 1e-9)
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.3g}", img_s=f"{img_s:.0f}", refresh=False)
                if on_log is not None:
                    on_log(pos.step + int(last_in_group), {"loss": mean_loss, "lr": lr, "images_per_second": img_s})
        if bar is not None:
            bar.update(1)
        faults.after_batch(epoch * n_steps + i + 1, runtime.rank)
        if last_in_group:
            pos.batch, pos.step = i + 1, pos.step + 1
            if on_step is not None:
                on_step(pos, totals, stop_requested)
    _sync(runtime.device)
    seconds = time.perf_counter() - t0
    summed = runtime.sum(totals)
    return {"train_loss": (summed[0] / summed[1]).item(), "lr": scheduler.get_last_lr()[0],
            "epoch_seconds": seconds, "images_per_second": summed[1].item() / seconds}


@torch.no_grad()
def evaluate(model: nn.Module, batches, runtime: Runtime) -> dict[str, float]:
    """Loss and accuracy over exactly the whole set: each rank scores its own disjoint shard, then sums."""
    model.eval()
    totals = torch.zeros(3, device=runtime.device, dtype=torch.float64)  # loss sum, correct, samples
    for x, y in lockstep(batches, runtime.sharded):
        with runtime.autocast():
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    summed = runtime.sum(totals)
    n = int(summed[2].item())
    return {"val_loss": summed[0].item() / max(n, 1), "val_accuracy": summed[1].item() / max(n, 1),
            "val_samples": n}


def runtime_for(cfg: TrainConfig) -> Runtime:
    """The runtime a training config asks for: precision, device, timeout, strategy, determinism."""
    r = cfg.run
    return Runtime(r.mixed_precision, r.cpu, r.timeout, r.strategy, r.deterministic)


# -- the whole run ---------------------------------------------------------------------------------------------
def fit(model: nn.Module, train_data: ImageSet | ImageFiles | Dataset, val_data: ImageSet | ImageFiles | Dataset,
        config: TrainConfig,
        *, preprocess: Preprocess | None = None, model_name: str | None = None,
        classes: list[str] | None = None, runtime: Runtime | None = None) -> FitResult:
    """Train `model` on `train_data`, validating on `val_data` after every epoch, on every process launched.

    Data is an `ImageSet` or `ImageFiles` (uint8 images: kept on the device with batches made there when they
    fit, else decoded by DataLoader workers; augmented and normalised on the device either way) or any `Dataset`
    of model-ready (tensor, label) pairs. Call it in every process of a launched job; each returns the same.
    """
    cfg = config.validate()
    if runtime is None:
        runtime = runtime_for(cfg)
        try:
            return fit(model, train_data, val_data, cfg, preprocess=preprocess, model_name=model_name,
                       classes=classes, runtime=runtime)
        finally:
            runtime.end()
    asked, cfg = cfg, cfg.for_devices(runtime.devices)  # per-device batch and learning rate for this job
    images = isinstance(train_data, (ImageSet, ImageFiles))
    if images and preprocess is None:
        mean, std = mean_std(train_data)
        channels = cfg.data.channels or train_data.channels
        if len(mean) != channels:  # statistics of the converted images: grey is the mean of the colours
            mean, std = ([sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels)
        preprocess = Preprocess(channels, cfg.data.image_size or train_data.image_size, mean, std)
    classes = classes or (train_data.classes if images else None)
    n_train = len(train_data)  # type: ignore[arg-type]
    if n_train < runtime.world_size:
        raise ValueError(f"{n_train} training samples cannot be shared among {runtime.world_size} processes")
    runtime.seed(cfg.run.seed + runtime.rank)  # dropout and dataset randomness differ per rank

    train_batches = _batches(train_data, runtime, cfg, preprocess, train=True)
    val_batches = _batches(val_data, runtime, cfg, preprocess, train=False)
    steps_per_epoch = -(-len(train_batches) // cfg.optim.grad_accum)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model, optimizer = runtime.prepare(model, lambda m: make_optimizer(m, cfg), sync_bn=cfg.model.sync_bn,
                                       activation_checkpointing=cfg.model.activation_checkpointing)
    scheduler = make_scheduler(optimizer, cfg, steps_per_epoch)
    plain = runtime.unwrap(model)  # evaluated and saved as it is; only training runs the compiled graph
    if cfg.model.compile:
        model = torch.compile(model)

    run_dir = Path(cfg.run.output_dir)
    folder = RunFolder(run_dir) if runtime.is_main and cfg.run.output_dir else None  # "" (API): no files
    meta = {"model": model_name or type(plain).__name__, "classes": classes,
            "preprocess": asdict(preprocess) if preprocess else None, "config": cfg.to_dict()}
    say = _printer(runtime)

    pos, totals, history = Position(), None, []
    global_batch = cfg.optim.batch_size * runtime.devices * cfg.optim.grad_accum
    resume_from = find_resumable(run_dir, say) if cfg.run.output_dir else None
    if resume_from is not None:
        state = load_state(resume_from, runtime, plain, optimizer, scheduler, global_batch, cfg.optim.grad_accum)
        pos, totals = Position(state.epoch, state.batch, state.step), state.shared["totals"]
        history = read_metrics(run_dir)[:pos.epoch]
        say(f"resuming from {resume_from}: epoch {pos.epoch + 1}, batch {pos.batch}, optimizer step {pos.step}")
    if folder:
        folder.rows = [{k: r[k] for k in METRIC_COLUMNS} for r in history]
        folder.write_config(asked.to_dict())
    say(f"training {meta['model']} on {n_train} samples, validating on {len(val_data)}; "  # type: ignore[arg-type]
        f"{runtime.world_size} process(es) on {runtime.devices} {runtime.device.type} device(s) "
        f"({cfg.run.strategy}), precision {cfg.run.mixed_precision}, "
        f"batch {cfg.optim.batch_size} per device, global batch {global_batch}, learning rate {cfg.optim.lr:g}"
        + (f", activation checkpointing over {runtime.checkpointed_blocks} blocks"
           if cfg.model.activation_checkpointing else ""))

    def checkpoint(at: Position, epoch_totals: torch.Tensor) -> None:
        save_state(run_dir, runtime, plain, optimizer, scheduler,
                   TrainingState(at.epoch, at.batch, at.step, runtime.world_size, global_batch,
                                 cfg.optim.grad_accum), epoch_totals, cfg.run.keep_checkpoints)

    def on_step(at: Position, epoch_totals: torch.Tensor, stop: bool) -> None:
        due = cfg.run.checkpoint_every and at.step % cfg.run.checkpoint_every == 0
        # A periodic save at an epoch's last batch is left to the end-of-epoch checkpoint; a stop cannot wait.
        if stop or (due and at.batch < len(train_batches)):
            checkpoint(at, epoch_totals)
        if stop:
            raise Preempted(f"stopped by {STOP.received or 'a signal to another process'} after saving the "
                            f"training state at optimizer step {at.step}; run the same command again to resume")

    events = EventLog(run_dir, pos.step) if folder else None
    try:
        start, best = time.perf_counter(), max((r["val_accuracy"] for r in history), default=-1.0)
        while pos.epoch < cfg.optim.epochs:
            epoch = pos.epoch
            bar = _progress_bar(runtime, len(train_batches), f"epoch {epoch + 1}/{cfg.optim.epochs}", pos.batch)
            try:
                row = train_one_epoch(model, optimizer, scheduler, train_batches, runtime, cfg, pos, totals, bar,
                                      on_step if cfg.run.output_dir else None, events.step if events else None)
            finally:
                if bar is not None:
                    bar.close()
            runtime.sync_buffers(plain)
            row.update(evaluate(plain, val_batches, runtime), epoch=epoch + 1)
            history.append(row)
            say(f"epoch {epoch + 1}/{cfg.optim.epochs}  train_loss {row['train_loss']:.4f}  "
                f"val_loss {row['val_loss']:.4f}  val_accuracy {row['val_accuracy']:.4f}  "
                f"{row['epoch_seconds']:.1f}s  {row['images_per_second']:.0f} img/s")
            weights = runtime.strategy.full_state_dict(plain)  # gathered from the shards under fsdp: every rank takes part
            if folder:
                folder.append_metrics(row)
                save_weights(folder.path / "last.safetensors", weights, {**meta, "epoch": epoch + 1})
                if row["val_accuracy"] > best:
                    save_weights(folder.path / "best.safetensors", weights, {**meta, "epoch": epoch + 1})
            best = max(best, row["val_accuracy"])
            pos, totals = Position(epoch + 1, 0, pos.step), None
            if cfg.run.output_dir:
                checkpoint(pos, torch.zeros(2))
            if events:
                events.epoch(row, pos.step)
    finally:
        if events:
            events.close()

    summary = {"best_val_accuracy": best, "final_val_accuracy": history[-1]["val_accuracy"],
               "val_samples": history[-1]["val_samples"], "train_samples": n_train,
               "world_size": runtime.world_size, "devices": runtime.devices, "strategy": cfg.run.strategy,
               "batch_size_per_device": cfg.optim.batch_size, "global_batch_size": global_batch,
               "lr": cfg.optim.lr, "mixed_precision": cfg.run.mixed_precision,
               "device": runtime.device.type, "epochs": cfg.optim.epochs,
               "total_seconds": time.perf_counter() - start, "model": meta["model"],
               "bytes_per_device": runtime.strategy.held_bytes(plain, optimizer)}
    if folder:
        folder.write_summary(summary)
        write_curves(folder.path, folder.rows, curves_title(meta["model"], runtime.devices))
        say(f"best val_accuracy {best:.4f}; run folder {folder.path}")
    runtime.barrier()  # every rank leaves together, after the main process has written the run folder
    return FitResult(best, history, str(folder.path) if folder else cfg.run.output_dir, summary)


def _printer(runtime: Runtime):
    def say(message: str) -> None:
        if runtime.is_main:
            print(message, flush=True)
    return say


def _progress_bar(runtime: Runtime, total: int, desc: str, done: int = 0):
    """A tqdm bar on the main process when its output is a terminal; None elsewhere."""
    if not runtime.is_main or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, leave=False, dynamic_ncols=True)
