"""`scaletrain tune`: the learning-rate range test (`sweep_lr`) and the largest per-device batch that fits
(`find_batch`), run on every process of a job at once from the same data and model a training run starts from.

Both are made of the training loop's building blocks (batches, `prepare_model`, `forward_backward`,
`apply_gradients`) and every decision comes from figures reduced over all processes, so every process measures,
stops and suggests alike. They write only their plot and measurements: no weights, no checkpoints, no training run folder.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import gc
import io
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig, OptimConfig, Settings, TrainConfig
from ..data.transforms import default_preprocess
from ..errors import UserError
from ..parallel import runtime_for
from ..runfolder import JobHold, atomic_write_bytes, atomic_write_text, default_run_folder, png_bytes, pyplot
from ..training.build import Batching, make_batches, prepare_model
from ..training.epoch import apply_gradients, forward_backward
from ..metrics import Loss
from ..training.job import launcher_held

LOSS_SMOOTHING = 0.98
"""Weight of the running average in the smoothed loss (an exponential moving average, bias-corrected)."""
DIVERGENCE_FACTOR = 4.0
"""The sweep stops once the smoothed loss exceeds this many times the best one so far."""
SKIP_START = 10
"""Steps at the sweep's start left out when looking for the steepest descent (as Lightning does): there the
smoothed loss averages only a few noisy values."""
BATCH_MULTIPLE = 8
"""A suggested batch of 8 or more is rounded down to a multiple of this (what GPU kernels tile by)."""
MEASURED_STEPS = 2
"""Optimizer steps per batch trial: the second holds the optimizer state the first one created."""


# -- the learning-rate range test -------------------------------------------------------------------------------
def exponential_lrs(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """`steps` rates from `min_lr` to `max_lr`, each the previous times the same factor."""
    return [min_lr * (max_lr / min_lr) ** (k / (steps - 1)) for k in range(steps)]


def smoothed(losses: list[float], beta: float = LOSS_SMOOTHING) -> list[float]:
    """The exponential moving average of `losses`, divided by 1 - beta^k so the first values are not pulled
    towards zero."""
    average, out = 0.0, []
    for k, loss in enumerate(losses, 1):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** k))
    return out


def steepest_descent(lrs: list[float], smooth: list[float], skip_start: int = SKIP_START) -> int:
    """Index of the rate at which the smoothed loss falls fastest against log(rate): the first `skip_start`
    steps and the last recorded one (where the sweep may have stopped on divergence) are left out when enough
    remain. As Lightning's `lr_find` suggests."""
    if len(smooth) < 3:
        raise ValueError("need at least 3 points")
    first, last = skip_start, len(smooth) - 1
    if last - first < 2:
        first, last = 0, len(smooth)
    points = [(math.log(lrs[k]), smooth[k]) for k in range(first, last)]
    slopes = []
    for k in range(len(points)):  # central differences inside, one-sided at the ends (numpy.gradient's)
        a, b = points[max(k - 1, 0)], points[min(k + 1, len(points) - 1)]
        slopes.append((b[1] - a[1]) / (b[0] - a[0]))
    return first + min(range(len(slopes)), key=slopes.__getitem__)


@dataclass
class LrSweep:
    """What the range test measured: the rate and the loss (mean over the global batch) of each optimizer
    step, smoothed, and the suggestion."""

    lrs: list[float]
    losses: list[float]
    smoothed_losses: list[float]
    suggested_lr: float
    stopped_early: bool
    settings: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, float]]:
        return [{"step": k + 1, "lr": lr, "loss": loss, "smoothed_loss": s}
                for k, (lr, loss, s) in enumerate(zip(self.lrs, self.losses, self.smoothed_losses))]

    def to_dict(self) -> dict[str, Any]:
        return {"find": "lr", "suggested_lr": self.suggested_lr,
                "suggestion": "the rate at which the smoothed loss falls fastest (steepest negative slope "
                              "against log(lr))", "stopped_early": self.stopped_early, **self.settings,
                "steps": self.rows()}


def _endless(batches):
    """Training batches epoch after epoch, as training would see them."""
    for epoch in itertools.count():
        yield from batches.epoch(epoch)


def sweep_lr(model, train_set, preprocess, b: Batching, m: ModelConfig, o: OptimConfig, runtime, min_lr: float,
             max_lr: float, num_steps: int) -> LrSweep:
    """Train from the initial weights for up to `num_steps` optimizer steps, the rate growing exponentially from
    `min_lr` to `max_lr`, with the configured optimizer (`o`), batch (`b`) and precision (the runtime's); stop
    once the smoothed loss exceeds DIVERGENCE_FACTOR x its best (or is not finite)."""
    plan, loss_fn = b.plan, Loss(label_smoothing=o.label_smoothing)
    batches = make_batches(train_set, runtime, b, preprocess, train=True)
    model, _, optimizer, _ = prepare_model(model, runtime, m, o, plan.lr, steps_per_epoch=len(batches))
    model.train()
    lrs, losses, smooth = exponential_lrs(min_lr, max_lr, num_steps), [], []
    micro_batches, stopped_early = _endless(batches), False
    t0 = time.perf_counter()
    for lr in lrs:
        for group in optimizer.param_groups:  # the sweep sets the rate; the configured schedule plays no part
            group["lr"] = lr
        group_batches = [next(micro_batches) for _ in range(plan.grad_accum)]
        samples = sum(len(y) for _, y in group_batches)
        totals = torch.zeros(2, device=runtime.device, dtype=torch.float64)  # this rank's loss sum, samples
        for j, (x, y) in enumerate(group_batches):
            loss, _ = forward_backward(model, x, y, runtime, loss_fn, len(y) / samples,
                                       sync=j == len(group_batches) - 1)
            totals += torch.stack([loss.detach().double() * len(y), torch.tensor(float(len(y)),
                                                                                  device=runtime.device)])
        apply_gradients(model, optimizer, runtime, o.clip_grad_norm)
        summed = runtime.sum(totals)  # every rank gets the same figure, so every rank stops at the same step
        losses.append((summed[0] / summed[1]).item())
        smooth = smoothed(losses)
        if not math.isfinite(smooth[-1]) or (len(smooth) > 1 and smooth[-1] > DIVERGENCE_FACTOR * min(smooth)):
            stopped_early = len(losses) < num_steps
            break
    seconds = time.perf_counter() - t0
    batches.close()
    finite = [k for k, s in enumerate(smooth) if math.isfinite(s)]
    if len(finite) < 3:
        raise UserError(f"--find lr: the loss diverged within {len(losses)} steps of --min-lr {min_lr:g}; lower "
                        f"--min-lr", quiet=not runtime.is_main)
    n = finite[-1] + 1
    best = steepest_descent(lrs, smooth[:n])
    recorded = {"min_lr": min_lr, "max_lr": max_lr, "num_steps": num_steps, "steps_run": len(losses),
                "optimizer": o.optimizer, "global_batch_size": plan.global_batch,
                "batch_size_per_device": plan.batch_per_device, "grad_accum": plan.grad_accum,
                "world_size": runtime.world_size, "devices": runtime.devices, "device": runtime.device.type,
                "mixed_precision": runtime.mixed_precision, "model": m.model, "seconds": seconds,
                "loss_smoothing": LOSS_SMOOTHING, "divergence_factor": DIVERGENCE_FACTOR}
    return LrSweep(lrs[:len(losses)], losses, smooth, lrs[best], stopped_early, recorded)


def lr_png(sweep: LrSweep) -> bytes:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    ax.plot(sweep.lrs, sweep.losses, color="tab:blue", alpha=0.3, label="loss")
    ax.plot(sweep.lrs, sweep.smoothed_losses, color="tab:blue", label="smoothed loss")
    k = sweep.lrs.index(sweep.suggested_lr)
    ax.plot([sweep.suggested_lr], [sweep.smoothed_losses[k]], "o", color="tab:red",
            label=f"suggested lr {sweep.suggested_lr:.3g}")
    finite = [s for s in sweep.smoothed_losses if math.isfinite(s)]
    ax.set_ylim(min(finite) * 0.95, min(max(finite), DIVERGENCE_FACTOR * min(finite)) * 1.05)
    s = sweep.settings
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss",
           title=f"{s['model']}, {s['optimizer']}, global batch {s['global_batch_size']}, "
                 f"{s['world_size']} process(es)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    return png_bytes(fig)


# -- the largest batch that fits -------------------------------------------------------------------------------
def largest_fitting(first: int, fits: Callable[[int], bool], multiple: int = BATCH_MULTIPLE,
                    limit: int = 1 << 24) -> int:
    """The largest batch for which `fits` holds (0: not even 1), trying `first`, then doubling while it fits or
    halving while it does not, then bisecting between the largest that fitted and the smallest that did not;
    from `multiple` up only multiples of it are tried, and the answer is rounded down to one."""
    lo, hi = 0, None
    if fits(max(1, first)):
        lo = max(1, first)
        while hi is None and lo < limit:
            batch = min(lo * 2, limit)
            lo, hi = (batch, hi) if fits(batch) else (lo, batch)
    else:
        hi = max(1, first)
        while lo == 0:
            if hi == 1:
                return 0
            batch = hi // 2
            lo, hi = (batch, hi) if fits(batch) else (lo, batch)
    while hi is not None:
        unit = multiple if lo >= multiple else 1
        low, high = lo // unit + 1, -(-hi // unit) - 1  # multiples of `unit` strictly between lo and hi
        if low > high:
            break
        mid = (low + high) // 2 * unit
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo // multiple * multiple if lo >= multiple else lo


@dataclass
class Trial:
    batch: int
    peak_bytes: int  # the most any process held beyond what it held before the trial
    out_of_memory: bool  # some process ran out of device memory
    fits: bool


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Measure the peak bytes a block adds to what was in use before it: on a GPU the CUDA caching allocator's
    peak of allocated bytes; on a CPU the bytes the C allocator has handed out (glibc's mallinfo2), read after
    every torch op, or, without glibc, the bytes of the tensors the block creates. Yields a dict whose 'bytes'
    is filled in when the block ends."""
    from .memory import AllocatorPeak, StorageTracker, c_allocator_bytes

    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result["bytes"] = torch.cuda.max_memory_allocated(device) - before
        return
    in_use = c_allocator_bytes()
    if in_use is None:
        tracker = StorageTracker()
        try:
            with tracker:
                yield result
        finally:
            result["bytes"] = max(tracker.timeline(), default=0)
        return
    before, peak = in_use(), AllocatorPeak(in_use)
    try:
        with peak:
            yield result
    finally:
        result["bytes"] = max(peak.peak - before, 0)


def _steps(model, images, labels, batch: int, m: ModelConfig, o: OptimConfig, lr: float, runtime) -> None:
    """MEASURED_STEPS real optimizer steps at `batch` from a fresh copy of the model and its optimizer (peak rate
    `lr`). The gradients are not all-reduced: no collective that a process out of memory could leave the others
    waiting in; every process still holds DDP's gradient buckets."""
    index = torch.arange(batch, device=images.device) % len(images)  # the real batch, repeated to size
    x, y = images[index], labels[index]
    if m.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    net, _, optimizer, _ = prepare_model(copy.deepcopy(model), runtime, m, o, lr, steps_per_epoch=1)
    net.train()
    loss_fn = Loss(label_smoothing=o.label_smoothing)
    for _ in range(MEASURED_STEPS):
        forward_backward(net, x, y, runtime, loss_fn, 1.0, sync=False)
        apply_gradients(net, optimizer, runtime, o.clip_grad_norm)


def _free(runtime) -> None:
    runtime.release()
    gc.collect()
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class BatchSearch:
    trials: list[Trial]
    suggested_batch: int
    settings: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(t) for t in self.trials]

    def to_dict(self) -> dict[str, Any]:
        return {"find": "batch", "suggested_batch": self.suggested_batch,
                "suggestion": "the largest per-device batch whose real training steps fit on every process",
                **self.settings, "trials": self.rows()}


def find_batch(model, train_set, preprocess, b: Batching, m: ModelConfig, o: OptimConfig, runtime,
               device_memory: int | None) -> BatchSearch:
    """The largest per-device batch whose real training steps fit: first the one `scaletrain estimate-memory`
    gives, then doubled, halved and bisected (see `largest_fitting`). A batch fits when no process ran out of
    device memory and, with `device_memory`, every process's peak stays within its usable share."""
    from .memory import USABLE_SHARE, cuda_memory, estimate

    plan = b.plan
    memory = device_memory if device_memory is not None else cuda_memory() if runtime.device.type == "cuda" \
        else None
    usable = int(device_memory * USABLE_SHARE) if device_memory is not None else None
    est = estimate(m.model, image_size=preprocess.image_size, channels=preprocess.channels,
                   num_classes=len(train_set.classes), batch_size=plan.batch_per_device,
                   mixed_precision=runtime.mixed_precision, nproc=runtime.world_size,
                   optimizer=o.optimizer, activation_checkpointing=m.activation_checkpointing,
                   device_memory=memory)
    first = runtime.broadcast_object(est.largest_batch_size or plan.batch_per_device)
    per_process = -(-len(train_set) // runtime.world_size)
    sample = b.with_plan(batch_per_device=max(1, min(first, per_process)))
    with make_batches(train_set, runtime, sample, preprocess, train=True) as batches:
        images, labels = next(iter(batches.epoch(0)))
    trials: list[Trial] = []

    def measure(batch: int) -> Trial:
        with peak_memory(runtime.device) as peak:
            try:
                _steps(model, images, labels, batch, m, o, plan.lr, runtime)
                out_of_memory = False
            except torch.OutOfMemoryError:
                out_of_memory = True
        _free(runtime)
        over = out_of_memory or (usable is not None and peak["bytes"] > usable)
        # One reduction: the most any process held, whether any ran out of memory, whether any went over.
        worst = runtime.max(torch.tensor([float(peak["bytes"]), float(out_of_memory), float(over)],
                                         device=runtime.device, dtype=torch.float64))
        return Trial(batch, int(worst[0].item()), worst[1].item() > 0, worst[2].item() == 0)

    measure(1)  # a warm-up: the math libraries' one-time allocations are not a batch's
    _free(runtime)

    def fits(batch: int) -> bool:
        trials.append(measure(batch))
        if runtime.is_main:
            t = trials[-1]
            print(f"batch {batch}: {'fits' if t.fits else 'does not fit'} "
                  f"({'out of memory' if t.out_of_memory else f'peak {t.peak_bytes / 2 ** 20:.1f} MiB'})",
                  flush=True)
        return trials[-1].fits

    t0 = time.perf_counter()
    suggested = largest_fitting(first, fits)
    if not suggested:
        raise UserError("--find batch: not even batch 1 per device fits"
                        + (f" in the usable {USABLE_SHARE:.0%} of --device-memory" if usable is not None else ""),
                        quiet=not runtime.is_main)
    constant, per_sample = est.fixed_bytes + est.activations.line_at(first)[0], est.activations.line_at(first)[1]
    recorded = {"device_memory": memory, "usable_memory": usable, "usable_share": USABLE_SHARE,
                "estimated_batch": est.largest_batch_size, "first_batch": first,
                "estimated_bytes_constant": round(constant), "estimated_bytes_per_sample": math.ceil(per_sample),
                "measured": "peak bytes a trial adds, the most over all processes: "
                            + ("CUDA max_memory_allocated" if runtime.device.type == "cuda" else
                               "the C allocator's bytes in use (glibc mallinfo2) after every op"),
                "steps_per_trial": MEASURED_STEPS, "model": m.model, "optimizer": o.optimizer,
                "mixed_precision": runtime.mixed_precision, "world_size": runtime.world_size,
                "device": runtime.device.type, "seconds": time.perf_counter() - t0}
    return BatchSearch(trials, suggested, recorded)


def batch_png(search: BatchSearch) -> bytes:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    s, mib = search.settings, 2 ** 20
    ok = [t for t in search.trials if t.fits]
    over = [t for t in search.trials if not t.fits and not t.out_of_memory]
    ax.plot([t.batch for t in ok], [t.peak_bytes / mib for t in ok], "o", color="tab:green", label="fits")
    ax.plot([t.batch for t in over], [t.peak_bytes / mib for t in over], "o", color="tab:red",
            label="does not fit")
    for t in search.trials:
        if t.out_of_memory:
            ax.axvline(t.batch, color="tab:red", linestyle=":", alpha=0.6)
    top = max(t.batch for t in search.trials)
    ax.plot([0, top], [s["estimated_bytes_constant"] / mib,
                       (s["estimated_bytes_constant"] + s["estimated_bytes_per_sample"] * top) / mib],
            color="tab:gray", linestyle="--", label="estimate-memory's estimate")
    if s["usable_memory"]:
        ax.axhline(s["usable_memory"] / mib, color="black", linewidth=1, label="usable memory")
    ax.axvline(search.suggested_batch, color="tab:blue", alpha=0.5, label=f"suggested batch {search.suggested_batch}")
    ax.set(xlabel="batch per device", ylabel="peak memory of a training step (MiB)",
           title=f"{s['model']}, {s['optimizer']}, {s['mixed_precision']}, {s['world_size']} process(es) on "
                 f"{s['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return png_bytes(fig)


# -- one process's part ----------------------------------------------------------------------------------------
def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_outputs(folder: Path, result: LrSweep | BatchSearch) -> list[Path]:
    """<what>_find.png, .json (settings, suggestion, every measurement) and .csv (the measurements)."""
    stem, png = ("lr_find", lr_png) if isinstance(result, LrSweep) else ("batch_find", batch_png)
    paths = [folder / f"{stem}.{ext}" for ext in ("png", "json", "csv")]
    atomic_write_bytes(paths[0], png(result))  # type: ignore[operator]
    atomic_write_text(paths[1], json.dumps(result.to_dict(), indent=2) + "\n")
    atomic_write_text(paths[2], _csv(result.rows()))
    return paths


def run(cfg: TrainConfig | Settings, find: str, job: str | None = None, *, min_lr: float = 1e-6,
        max_lr: float = 1.0, num_steps: int = 100, device_memory: int | None = None,
        hold: JobHold | None = None) -> LrSweep | BatchSearch:
    """Find a learning rate (`find` 'lr') or a batch ('batch') in this process, one of possibly many launched;
    the main process writes the plot and measurements into --output-dir (default: a new folder under runs/) and
    prints the suggestion as its last line. `hold`: the run folder's hold when the launcher in this process took it.
    (The whole config: a tune worker's entry point, it resolves it as training does.)"""
    from ..training.build import settings_for
    from ..training.worker import data_and_model

    runtime = runtime_for(cfg.run)
    try:
        with JobHold.workers(cfg.run.output_dir, runtime, hold or launcher_held(job)) as held:
            train_set, _, model, preprocess = data_and_model(cfg.data, cfg.model, cfg.run, runtime, held, job)
            held.checks_passed()
            settings = settings_for(cfg, train_set, runtime)
            m, o = settings.model, settings.optim
            b = Batching(settings.data, settings.plan, settings.run.seed, m.channels_last, o.steps_per_epoch)
            preprocess = preprocess or default_preprocess(train_set, settings.data)
            runtime.seed(settings.run.seed + runtime.rank)  # augmentation differs per rank, as in training
            if find == "lr":
                result: LrSweep | BatchSearch = sweep_lr(model, train_set, preprocess, b, m, o, runtime, min_lr,
                                                         max_lr, num_steps)
            else:
                result = find_batch(model, train_set, preprocess, b, m, o, runtime, device_memory)
            if runtime.is_main:
                paths = write_outputs(Path(settings.run.output_dir or default_run_folder()), result)
                print(f"wrote {paths[0]}, {paths[1].name}, {paths[2].name}", flush=True)
                print(f"suggested lr {result.suggested_lr:.3g}" if isinstance(result, LrSweep)
                      else f"suggested batch {result.suggested_batch}", flush=True)
            runtime.barrier()  # every process leaves together, after the main one has written
            return result
    finally:
        runtime.end()
