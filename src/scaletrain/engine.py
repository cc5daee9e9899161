"""The training loop: `fit` for any model and dataset, made of `train_one_epoch` and `evaluate`.

The same code runs on one process or many: it asks the `Runtime` for its rank, device and reductions and never
talks to torch.distributed itself. Printing and files come from the main process only.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .config import BatchPlan, TrainConfig, parse_augment, parse_range, resolve_recipe
from .data import ImageSet, mean_std
from .ema import WeightAverage
from .parallel import Runtime
from .pipeline import DeviceBatches, LoaderBatches, Preprocess, decode_all, fits_on_device, lockstep
from .prepared import PreparedSet
from .regularise import Regularise, parse_randaugment
from .sources import ImageFiles
from . import LAUNCHED_AT, faults
from .checkpoint import Checkpointer, TrainState
from .report import ExperimentLog, curves_title
from .runfolder import RunFolder


FILE_SETS = (ImageFiles, PreparedSet)  # uint8 images read batch by batch (from image files, from shards)


class TrainingDiverged(Exception):
    """The loss became NaN or infinite on some process; every process raises it at the same step."""

    exit_code = 3


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1) arrived; every process checkpointed at the same step and stops."""

    exit_code = 75  # EX_TEMPFAIL: run the same command again to resume


class StopSignals:
    """Remembers that SIGTERM or SIGUSR1 arrived, so training can stop at a step boundary after a checkpoint.

    A process that makes no progress after the signal (no batch done within `patience` seconds: stuck in a
    collective whose peer is gone, or hung) cannot reach that boundary; it then exits at once with 128 + the
    signal's number instead of waiting for the launcher's SIGKILL. The last checkpoint stays intact."""

    def __init__(self):
        self.received: str | None = None
        self.patience: float | None = None
        self.beats = 0  # batches done; the watchdog looks for a change
        self.stopping = False  # the loop reached the stop and is saving: no longer watched

    def install(self, patience: float | None = None) -> None:
        import signal
        import threading

        self.patience = patience
        if threading.current_thread() is not threading.main_thread():
            return  # handlers are set from the main thread only (Ray Train runs training in a thread of its own)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, num: int, frame) -> None:
        import signal
        import threading

        first = self.received is None
        self.received = signal.Signals(num).name
        if first and self.patience:
            threading.Thread(target=self._watch, args=(num, self.beats), daemon=True).start()

    def _watch(self, num: int, beats: int) -> None:
        import os

        time.sleep(self.patience)  # type: ignore[arg-type]
        if self.beats == beats and not self.stopping:
            print(f"scaletrain: {self.received} received and no progress for {self.patience:g} s (--timeout): this "
                  f"process is stuck; exiting without a new checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + num)


STOP = StopSignals()


@dataclass
class FitResult:
    best_val_accuracy: float
    history: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


# -- building blocks -------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, cfg: TrainConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """The configured optimizer at peak rate `lr` (the batch plan's, after --lr-scaling; default --lr)."""
    o = cfg.optim
    lr = o.lr if lr is None else lr
    # No weight decay on biases and normalisation parameters (1-D tensors), as timm and nanoGPT do.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Not fused=True: with it, a run resumed from a checkpoint no longer ends bitwise equal (torch 2.15, CPU).
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.momentum > 0)
    if o.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


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


def make_batches(data: ImageSet | ImageFiles | Dataset, runtime: Runtime, cfg: TrainConfig, plan: BatchPlan,
                 pre: Preprocess | None, train: bool):
    """Batches for one split: built on the device when the decoded data fits there, else from a DataLoader."""
    common = dict(train=train, rank=runtime.rank, world=runtime.world_size, seed=cfg.run.seed,
                  channels_last=cfg.model.channels_last)
    batch_size = plan.batch_per_process  # DataParallel splits it over its GPUs
    reg = regularisation(cfg, len(getattr(data, "classes", None) or ())) if train else None
    if not isinstance(data, (ImageSet, *FILE_SETS)):  # a user's Dataset of model-ready tensors
        if reg is not None:
            raise ValueError("--randaugment, --random-erasing, --mixup and --cutmix work on scaletrain's image data "
                             "(ImageSet, image files, prepared shards); a Dataset of model-ready tensors does its own")
        return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, **common)
    augment = parse_augment(cfg.data.augment)
    choice = cfg.data.data_on_device
    if choice == "yes" or (choice == "auto" and fits_on_device(data.nbytes, runtime.device)):
        if isinstance(data, PreparedSet):
            data = ImageSet(data.read_all(), torch.from_numpy(data.labels.copy()), data.classes, data.recipe)
        elif isinstance(data, ImageFiles):
            images, labels = decode_all(data, cfg.data.num_workers)
            data = ImageSet(images, labels, data.classes, data.recipe)
        return DeviceBatches(data, pre, runtime.device, batch_size, augment=augment, regularise=reg, **common)
    on_device = isinstance(data, ImageFiles) and (cfg.data.decode == "device" or (
        cfg.data.decode == "auto" and runtime.device.type == "cuda"))
    return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, pre=pre,
                         augment=augment, regularise=reg, decode_on_device=on_device, **common)


def regularisation(cfg: TrainConfig, num_classes: int) -> Regularise | None:
    """The batch regularisation the config asks for; None when all of it is off."""
    d = cfg.data
    reg = Regularise(parse_randaugment(d.randaugment), d.random_erasing, d.mixup, d.cutmix, d.mixup_prob,
                     d.mixup_switch_prob, num_classes)
    return reg if reg.on_device or reg.mixes else None


def default_preprocess(data: ImageSet | ImageFiles, cfg: TrainConfig) -> Preprocess:
    """Normalisation by the training images' own statistics, at the configured channels and size, by the data's
    recipe (photos without --image-size: the central --crop-pct of their stored size)."""
    mean, std = mean_std(data)
    channels = cfg.data.channels or data.channels
    if len(mean) != channels:  # statistics of the converted images: grey is the mean of the colours
        mean, std = ([sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels)
    d, recipe = cfg.data, data.recipe or "digits"
    size = d.image_size or (round(data.image_size * d.crop_pct) if recipe == "photo" else data.image_size)
    if recipe == "digits":  # as saved before recipes existed
        return Preprocess(channels, size, mean, std)
    return Preprocess(channels, size, mean, std, recipe, d.crop_pct, parse_range("--crop-scale", d.crop_scale),
                      parse_range("--crop-ratio", d.crop_ratio))


def prepare_model(model: nn.Module, runtime: Runtime, cfg: TrainConfig, plan: BatchPlan, steps_per_epoch: int):
    """(model to train, the same unwrapped for evaluation and saving, optimizer, scheduler)."""
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model, optimizer = runtime.prepare(model, lambda m: make_optimizer(m, cfg, plan.lr), sync_bn=cfg.model.sync_bn,
                                       activation_checkpointing=cfg.model.activation_checkpointing)
    scheduler = make_scheduler(optimizer, cfg, steps_per_epoch)
    plain = runtime.unwrap(model)  # evaluated and saved as it is; only training runs the compiled graph
    if cfg.model.compile:
        model = torch.compile(model)
    return model, plain, optimizer, scheduler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_backward(model, x: torch.Tensor, y: torch.Tensor, runtime: Runtime, cfg: TrainConfig, weight: float,
                     sync: bool = True) -> torch.Tensor:
    """One micro-batch: the loss (returned unweighted) and its gradients scaled by `weight`, added to the
    parameters' own; `sync=False` skips the all-reduce (inside gradient accumulation)."""
    with runtime.strategy.no_sync(model, skip=not sync):
        with runtime.autocast():
            loss = F.cross_entropy(model(x), y, label_smoothing=cfg.optim.label_smoothing)
        runtime.backward(loss * weight)
    return loss


def apply_gradients(model, optimizer: torch.optim.Optimizer, runtime: Runtime, cfg: TrainConfig) -> bool:
    """Clip (with --clip-grad-norm), step and clear the gradients; False when the fp16 loss scaler skipped the
    step (an overflow), so the learning-rate schedule does not advance."""
    if cfg.optim.clip_grad_norm:
        runtime.clip_grad_norm(model, cfg.optim.clip_grad_norm)
    optimizer.step()
    stepped = not runtime.optimizer_step_was_skipped
    optimizer.zero_grad(set_to_none=True)
    return stepped


# -- phases ----------------------------------------------------------------------------------------------------
def train_one_epoch(model, optimizer, scheduler, batches, runtime: Runtime, cfg: TrainConfig, state: TrainState,
                    checkpointer: Checkpointer | None = None, on_log=None,
                    ema: WeightAverage | None = None) -> dict[str, float] | None:
    """This rank's shard of epoch `state.epoch` from batch `state.batch` on; returns the epoch's training loss
    averaged over all ranks' samples, or None when a stop signal ended it (after a checkpoint). The checkpointer
    saves when due; `on_log(step, values)` gets the loss reduced over all ranks at every --log-every; the weight
    average, when kept, follows every optimizer step. Labels may be soft targets (mixup, cutmix)."""
    model.train()
    accum, n_steps, epoch = cfg.optim.grad_accum, len(batches), state.epoch
    sizes = [min(batches.batch_size, batches.num_samples - i * batches.batch_size) for i in range(n_steps)]
    # (sum of per-sample losses, samples) of this rank, carried over when resuming mid-epoch
    totals = torch.zeros(2, device=runtime.device) if state.totals is None else state.totals.to(runtime.device)
    state.totals = totals
    bar = _progress_bar(runtime, n_steps, f"epoch {epoch + 1}/{cfg.optim.epochs}", state.batch)
    _sync(runtime.device)
    t0 = time.perf_counter()
    stop_requested = False
    for i, (x, y) in enumerate(batches.epoch(epoch, start=state.batch), start=state.batch):
        group = range(i - i % accum, min(i - i % accum + accum, n_steps))
        last_in_group = i == group[-1]
        # Weight each micro-batch by its share of the group's samples: accumulation equals one big batch.
        loss = forward_backward(model, x, y, runtime, cfg, len(y) / sum(sizes[j] for j in group),
                                sync=last_in_group)
        if last_in_group:
            if apply_gradients(model, optimizer, runtime, cfg):
                scheduler.step()
            if ema is not None:
                ema.update()
            if not state.first_step_done:
                state.first_step_done = True
                if runtime.is_main:
                    print(f"first step done {time.time() - LAUNCHED_AT:.1f} s after launch", flush=True)
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
            lr, img_s = scheduler.get_last_lr()[0], summed[1].item() / max(time.perf_counter() - t0, 1e-9)
            if bar is not None:
                bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.3g}", img_s=f"{img_s:.0f}", refresh=False)
            if on_log is not None:
                on_log(state.step + int(last_in_group), {"loss": mean_loss, "lr": lr, "images_per_second": img_s})
        if bar is not None:
            bar.update(1)
        STOP.beats += 1
        faults.after_batch(epoch * n_steps + i + 1, runtime.rank)
        if last_in_group:
            state.batch, state.step = i + 1, state.step + 1
            stop = stop_requested and checkpointer is not None
            STOP.stopping = stop
            if checkpointer is not None and (stop or checkpointer.due(state, n_steps)):
                checkpointer.save(state)
            if stop:
                if bar is not None:
                    bar.close()
                return None
    _sync(runtime.device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
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
        STOP.beats += 1
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
        classes: list[str] | None = None, runtime: Runtime | None = None,
        on_epoch: Callable[[dict[str, Any], int], None] | None = None) -> FitResult:
    """Train `model` on `train_data`, validating on `val_data` after every epoch, on every process launched.

    Data is an `ImageSet` or `ImageFiles` (uint8 images: kept on the device with batches made there when they
    fit, else decoded by DataLoader workers; augmented and normalised on the device either way) or any `Dataset`
    of model-ready (tensor, label) pairs. Call it in every process of a launched job; each returns the same.
    A run folder (config.run.output_dir) holding training state is resumed from its newest checkpoint.
    `on_epoch(row, step)` is called in every process after each epoch's checkpoint (state/step-NNNNNNNN, `step`
    being the optimizer steps done), with the epoch's metrics.csv row.
    """
    cfg = copy.deepcopy(config.validate())  # resolved below from the data; the caller's config stays as given
    if runtime is None:
        runtime = runtime_for(cfg)
        try:
            return fit(model, train_data, val_data, cfg, preprocess=preprocess, model_name=model_name,
                       classes=classes, runtime=runtime, on_epoch=on_epoch)
        finally:
            runtime.end()
    plan = cfg.plan(runtime.devices, runtime.devices_per_process)
    images = isinstance(train_data, (ImageSet, *FILE_SETS))
    resolve_recipe(cfg, (train_data.recipe if images else "") or "digits")  # type: ignore[union-attr]
    preprocess = preprocess or (default_preprocess(train_data, cfg) if images else None)
    if len(train_data) < runtime.world_size:  # type: ignore[arg-type]
        raise ValueError(f"{len(train_data)} training samples cannot be shared among {runtime.world_size} "
                         f"processes")
    runtime.seed(cfg.run.seed + runtime.rank)  # dropout and dataset randomness differ per rank
    train_batches = make_batches(train_data, runtime, cfg, plan, preprocess, train=True)
    val_batches = make_batches(val_data, runtime, cfg, plan, preprocess, train=False)
    model, plain, optimizer, scheduler = prepare_model(model, runtime, cfg, plan,
                                                       steps_per_epoch=-(-len(train_batches) // plan.grad_accum))
    run_dir, say = Path(cfg.run.output_dir), _printer(runtime)
    folder = RunFolder(run_dir) if runtime.is_main and cfg.run.output_dir else None  # "" (API): no files
    ema = WeightAverage(plain, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
    checkpointer = Checkpointer(run_dir, runtime, plain, optimizer, scheduler, cfg, plan, ema) \
        if cfg.run.output_dir else None
    state = (checkpointer.resume(say) if checkpointer else None) or TrainState()
    meta = {"model": model_name or type(plain).__name__, "classes": classes or getattr(train_data, "classes", None),
            "preprocess": asdict(preprocess) if preprocess else None, "config": cfg.to_dict(),
            "plan": plan.to_dict()}
    if folder:
        folder.start(meta["config"], plan.to_dict(), state.history)
    say(_describe_job(meta["model"], len(train_data), len(val_data), runtime, cfg, plan))  # type: ignore[arg-type]
    trackers = ExperimentLog(runtime, cfg, run_dir, plan.to_dict(), state.step) if folder else None
    start = time.perf_counter()
    patience = cfg.optim.early_stopping
    try:
        while state.epoch < cfg.optim.epochs and not (patience and state.epochs_since_best() >= patience):
            row = train_one_epoch(model, optimizer, scheduler, train_batches, runtime, cfg, state, checkpointer,
                                  trackers.step if trackers else None, ema)
            if row is None:
                raise Preempted(f"stopped by {STOP.received or 'a signal to another process'} after saving the "
                                f"training state at optimizer step {state.step}; run the same command again to "
                                f"resume")
            runtime.sync_buffers(plain)
            row.update(evaluate(plain, val_batches, runtime), epoch=state.epoch + 1)
            if ema is not None:
                runtime.sync_buffers(ema.model)
                row.update({f"ema_{k}": v for k, v in evaluate(ema.model, val_batches, runtime).items()
                            if k != "val_samples"})
            say(f"epoch {state.epoch + 1}/{cfg.optim.epochs}  train_loss {row['train_loss']:.4f}  "
                f"val_loss {row['val_loss']:.4f}  val_accuracy {row['val_accuracy']:.4f}  "
                + (f"ema_val_accuracy {row['ema_val_accuracy']:.4f}  " if ema is not None else "")
                + f"{row['epoch_seconds']:.1f}s  {row['images_per_second']:.0f} img/s")
            weights = runtime.strategy.full_state_dict(plain)  # under fsdp gathered from every rank's shard
            if folder:
                folder.end_epoch(row, weights, meta, best=row["val_accuracy"] > state.best)
                if ema is not None:
                    folder.end_epoch_average(row, ema.state_dict(), meta, best=row["ema_val_accuracy"] > max(
                        (r["ema_val_accuracy"] for r in state.history), default=-1.0))
            state.history.append(row)
            state.next_epoch()
            if checkpointer:
                checkpointer.save(state)
            if trackers:
                trackers.epoch(row, state.step)
            if on_epoch:
                on_epoch(row, state.step)
        if state.epoch < cfg.optim.epochs:  # every rank saw the same validation accuracies: all stop here
            say(f"early stopping: val_accuracy has not improved for {patience} epoch(s), best {state.best:.4f} "
                f"at epoch {len(state.history) - patience}")
        summary = _summary(state, runtime, cfg, plan, meta["model"], len(train_data), time.perf_counter() - start,
                           runtime.strategy.held_bytes(plain, optimizer))
        summary["epochs_run"] = len(state.history)
        if ema is not None:
            summary["best_ema_val_accuracy"] = max(r["ema_val_accuracy"] for r in state.history)
            summary["ema_decay"] = cfg.optim.ema_decay
        if folder:
            folder.finish(summary, curves_title(meta["model"], runtime.devices))
            say(f"best val_accuracy {state.best:.4f}; run folder {folder.path}")
        if trackers:
            trackers.summary(summary, state.step)
    finally:
        if trackers:
            trackers.close()
    runtime.barrier()  # every rank leaves together, after the main process has written the run folder
    return FitResult(state.best, state.history, str(folder.path) if folder else cfg.run.output_dir, summary)


def _describe_job(model_name: str, n_train: int, n_val: int, runtime: Runtime, cfg: TrainConfig,
                  plan: BatchPlan) -> str:
    return (f"training {model_name} on {n_train} samples, validating on {n_val}; {runtime.world_size} process(es) "
            f"on {runtime.devices} {runtime.device.type} device(s) ({cfg.run.strategy}), precision "
            f"{cfg.run.mixed_precision}, batch {plan.batch_per_device} per device, global batch "
            f"{plan.global_batch}, learning rate {plan.lr:g}"
            + (f", activation checkpointing over {runtime.checkpointed_blocks} blocks"
               if cfg.model.activation_checkpointing else ""))


def _summary(state: TrainState, runtime: Runtime, cfg: TrainConfig, plan: BatchPlan, model_name: str,
             n_train: int, seconds: float, held_bytes: dict[str, int]) -> dict[str, Any]:
    last = state.history[-1]
    return {"best_val_accuracy": state.best, "final_val_accuracy": last["val_accuracy"],
            "val_samples": last["val_samples"], "train_samples": n_train, "world_size": runtime.world_size,
            "devices": runtime.devices, "strategy": cfg.run.strategy, "batch_size_per_device": plan.batch_per_device,
            "global_batch_size": plan.global_batch, "grad_accum": plan.grad_accum, "lr": plan.lr,
            "mixed_precision": cfg.run.mixed_precision, "device": runtime.device.type, "epochs": cfg.optim.epochs,
            "total_seconds": seconds, "model": model_name, "bytes_per_device": held_bytes}


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
