"""One epoch: `train_one_epoch` (forward, backward and optimizer steps over this rank's shard, with gradient
accumulation, checkpoints when due and the loss reduced over all ranks) and `evaluate` (loss and accuracy over
exactly the whole validation set, each rank its disjoint shard).

The same code runs on one process or many: it asks the `Runtime` for its rank, device and reductions and never
talks to torch.distributed itself.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

from typing import TYPE_CHECKING

from ..config import TrainConfig
from ..data.batches import lockstep
from ..models import logits_of
from ..parallel import LAUNCHED_AT, Runtime
from . import faults
from .checkpoint import TrainState
from .hooks import Loss
from .signals import STOP, TrainingDiverged

if TYPE_CHECKING:
    from .build import Run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_backward(model, x: torch.Tensor, y: torch.Tensor, runtime: Runtime, cfg: TrainConfig, weight: float,
                     sync: bool = True, loss_fn: Loss | None = None) -> torch.Tensor:
    """One micro-batch: the loss (returned unweighted) and its gradients scaled by `weight`, added to the
    parameters' own; `sync=False` skips the all-reduce (inside gradient accumulation). The loss is `loss_fn`'s, by
    default cross-entropy with --label-smoothing."""
    loss_fn = loss_fn or Loss(label_smoothing=cfg.optim.label_smoothing)
    with runtime.strategy.no_sync(model, skip=not sync):
        with runtime.autocast():
            loss = loss_fn(logits_of(model(x)), y)
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


def train_one_epoch(run: Run, state: TrainState, on_log=None) -> dict[str, float] | None:
    """This rank's shard of epoch `state.epoch` from batch `state.batch` on; returns the epoch's training loss
    averaged over all ranks' samples, or None when a stop signal ended it (after a checkpoint). The checkpointer
    saves when due; `on_log(step, values)` gets the loss reduced over all ranks at every --log-every; the weight
    average, when kept, follows every optimizer step. Labels may be soft targets (mixup, cutmix)."""
    model, optimizer, scheduler, batches, runtime, cfg = (run.model, run.optimizer, run.scheduler, run.train_batches,
                                                          run.runtime, run.cfg)
    checkpointer, ema = run.checkpointer, run.ema
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
                                sync=last_in_group, loss_fn=run.loss)
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
def evaluate(model: nn.Module, batches, runtime: Runtime, loss_fn: Loss | None = None) -> dict[str, float]:
    """Loss and accuracy over exactly the whole set: each rank scores its own disjoint shard, then sums (the loss
    is exact when `loss_fn` gives per-sample values; see hooks.Loss)."""
    model.eval()
    loss_fn = loss_fn or Loss()
    totals = torch.zeros(3, device=runtime.device, dtype=torch.float64)  # loss sum, correct, samples
    for x, y in lockstep(batches, runtime.sharded):
        with runtime.autocast():
            logits = logits_of(model(x))
        totals[0] += loss_fn.sum(logits, y).double()
        totals[1] += (logits.argmax(1) == (y.argmax(1) if y.is_floating_point() else y)).sum()  # soft: its top
        totals[2] += len(y)
        STOP.beats += 1
    summed = runtime.sum(totals)
    n = int(summed[2].item())
    return {"val_loss": summed[0].item() / max(n, 1), "val_accuracy": summed[1].item() / max(n, 1),
            "val_samples": n}


def validate(run: Run, epoch: int) -> dict[str, float]:
    """`evaluate` for each (column prefix, model) the run validates, BatchNorm statistics made the same on every
    rank first: the trained weights' values under their own names, then the epoch's number, then the weight
    average's as ema_*. Without a validation set only the statistics are made the same."""
    row: dict[str, float] = {}
    for prefix, model in run.validated:
        run.runtime.sync_buffers(model)
        if run.val_batches is not None:
            row.update({prefix + k: v for k, v in evaluate(model, run.val_batches, run.runtime, run.loss).items()
                        if not (prefix and k == "val_samples")})
        row.setdefault("epoch", epoch)
    return row


def _progress_bar(runtime: Runtime, total: int, desc: str, done: int = 0):
    """A tqdm bar on the main process when its output is a terminal; None elsewhere."""
    if not runtime.is_main or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, leave=False, dynamic_ncols=True)
