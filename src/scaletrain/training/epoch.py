"""One epoch: `train_one_epoch` (forward, backward and optimizer steps over this rank's shard, with gradient
accumulation, checkpoints when due and the loss reduced over all ranks) and `evaluate` (the loss, accuracy for a
classifier and the user's metrics over exactly the whole validation set, each rank its disjoint shard).

The same code runs on one process or many: it asks the `Runtime` for its rank, device and reductions and never
talks to torch.distributed itself.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import UserError
from ..metrics import Loss, Measures
from ..parallel import BEAT, Runtime
from ..steps import BatchCalls, parts_of
from .checkpoint import TrainState
from .compiling import compile_seconds, eager_unless
from .nonfinite import NonFinite
from .signals import TrainingDiverged

if TYPE_CHECKING:
    from .build import Run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_backward(model, x: Any, y: Any, runtime: Runtime, loss_fn: Loss | BatchCalls, weight: float,
                     sync: bool = True, backward: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch through `loss_fn` (a Loss: `loss_fn(model(x), y)`; or the run's steps.BatchCalls): (the
    loss, returned unweighted; its named parts, a Step's) and its gradients scaled by `weight`, added to the
    parameters' own; `sync=False` skips the all-reduce (inside gradient accumulation); `backward=False` for a step
    that ran its optimizers itself."""
    calls = loss_fn if isinstance(loss_fn, BatchCalls) else BatchCalls(loss_fn)
    if runtime.schedules_batches:  # micro-batch by micro-batch, stage by stage
        return runtime.forward_backward(model, x, y, calls.loss, weight, sync), {}
    with runtime.no_sync(model, skip=not sync), runtime.unused_parameters_named(model):
        BEAT.mark("forward")
        with runtime.autocast():
            losses = calls.train_losses(model, x, y)
        loss, parts = parts_of(losses) if calls.train_whole else (losses, {})
        BEAT.mark("backward" if sync else "backward, accumulating")  # DDP reduces the gradients in the first
        if backward:
            runtime.backward(loss * weight)
    return loss, parts


def train_batch(run: Run, x: Any, y: Any, weight: float, sync: bool) -> torch.Tensor:
    """One micro-batch of the run (forward_backward through its step): [its loss x samples, samples, each named
    part x samples] (detached, unweighted), zeros on a pipeline's stage before the last (the last counts the
    batch). A step that runs its optimizers itself has stepped them already."""
    with eager_unless(run.compiled_batch, x):  # an epoch's last batch is not compiled again
        loss, parts = forward_backward(run.model, x, y, run.runtime, run.calls, weight, sync, not run.job.manual)
    if run.calls.train_whole and list(parts) != run.parts:
        raise UserError(f"train_step returned the losses {', '.join(parts) or 'one loss'}, after "
                        f"{', '.join(run.parts) or 'one loss'} on the first batch; return the same ones each step")
    row = torch.stack([loss.detach().float(), torch.ones((), device=loss.device),
                       *(p.detach().float() for p in parts.values())]) * len(x)
    return row if run.runtime.holds_outputs else torch.zeros_like(row)


def apply_gradients(model, optimizer: torch.optim.Optimizer, runtime: Runtime, clip_grad_norm: float = 0.0) -> bool:
    """Clip (to `clip_grad_norm`, when set), step and clear the gradients; False when the fp16 loss scaler skipped
    the step (an overflow), so the learning-rate schedule does not advance."""
    if clip_grad_norm:
        runtime.clip_grad_norm(model, clip_grad_norm)
    optimizer.step()
    stepped = not runtime.optimizer_step_was_skipped
    optimizer.zero_grad(set_to_none=True)
    return stepped


def train_one_epoch(run: Run, state: TrainState, on_log=None) -> dict[str, float] | None:
    """This rank's shard of epoch `state.epoch` from batch `state.batch` on; returns the epoch's training loss
    averaged over all ranks' samples, or None when a stop signal ended it (after a checkpoint). The checkpointer
    saves when due; `on_log(step, values)` gets the loss reduced over all ranks at every --log-every; the weight
    average, when kept, follows every optimizer step. Labels may be soft targets (mixup, cutmix)."""
    runtime, batches, controls = run.runtime, run.train_batches, run.controls
    accum, log_every = run.settings.plan.grad_accum, run.settings.run.log_every
    run.model.train()
    n_steps, epoch = batches.steps, state.epoch  # n_steps: None for a stream (its length is not known ahead)
    # (sum of per-sample losses, samples, each named part's sum) of this rank, carried over when resuming mid-epoch
    fresh = state.totals is None or len(state.totals) != 2 + len(run.parts)  # an epoch's end saves two zeros
    totals = torch.zeros(2 + len(run.parts), device=runtime.device) if fresh else state.totals.to(runtime.device)
    state.totals = totals
    progress = Progress(run, _progress_bar(runtime, n_steps, f"epoch {epoch + 1}/{run.settings.optim.epochs}",
                                           state.batch), on_log)
    for i, (x, y) in enumerate(BEAT.each("reading data", batches.epoch(epoch, start=state.batch)), start=state.batch):
        # Weight each micro-batch by its share of the group's samples: accumulation equals one big batch.
        weight, last_in_group = batches.accumulation(i, accum)
        row = train_batch(run, x, y, weight, sync=last_in_group)
        progress.watch(x, row)  # the inputs' non-finite values counted; the first batches' losses checked at once
        totals += row.to(totals.device)
        if last_in_group:
            optimizer_step(run, state)
        if (i + 1) % log_every == 0 or batches.is_last(i):
            progress.reduce(totals, state.step + int(last_in_group), f"in epoch {epoch + 1} by step {i + 1}")
        progress.batch_done()
        controls.faults.after_batch(state.step * accum + i % accum + 1 if n_steps is None else
                                    epoch * n_steps + i + 1, runtime.rank)
        if last_in_group:
            state.batch, state.step, state.stream = i + 1, state.step + 1, batches.state
            if progress.checkpoint_and_stop(state, n_steps):
                return None
    return progress.end(totals)


def optimizer_step(run: Run, state: TrainState) -> None:
    """The optimizer step at the end of an accumulation group: the gradients applied, the schedule and the weight
    average advanced; the first one of this process says how long after launch it came."""
    BEAT.mark("optimizer step", state.step + 1)
    # a step that ran its optimizers itself: only the fp16 loss scaler is left, updated once for all of them
    run.controls.observer.stepping(run)
    stepped = run.job.end_of_batch() if run.job.manual else \
        apply_gradients(run.model, run.optimizer, run.runtime, run.settings.optim.clip_grad_norm)
    if stepped:
        run.schedule.after_optimizer_step()
    if run.ema is not None:
        run.ema.update()
    run.controls.observer.stepped(run, state, state.step + 1)
    if not state.first_step_done:
        state.first_step_done = True
        compiling = compile_seconds() if run.compiled_batch is not None else None
        run.say(f"first step done {time.time() - run.controls.launched_at:.1f} s after launch" +
                (f" ({compiling:.1f} s of it compiling)" if compiling is not None else ""))


class Progress:
    """An epoch's progress as every rank sees it alike: the clock, the loss reduced over all ranks at each
    --log-every (with whether any rank was asked to stop), the progress bar and the checkpoints a stop makes."""

    def __init__(self, run: Run, bar, on_log):
        self.run, self.bar, self.on_log, self.stop_requested = run, bar, on_log, False
        self.inputs = NonFinite(run)  # what a non-finite loss came from, should it come
        _sync(run.runtime.device)
        self.t0 = time.perf_counter()

    def watch(self, x: Any, row: torch.Tensor) -> None:
        self.inputs.see(x, row)

    def reduce(self, totals: torch.Tensor, step: int, where: str) -> None:
        """One reduction carries the loss and whether any rank was told to stop: all ranks decide alike."""
        flag = torch.tensor([float(self.run.controls.stop.received is not None)], device=totals.device)
        summed = self.run.runtime.sum(torch.cat([totals, flag, self.inputs.count]))
        self.stop_requested = self.stop_requested or summed[-2].item() > 0
        mean_loss = (summed[0] / summed[1]).item()
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(f"training loss became {mean_loss} {where}: "
                                   f"{self.inputs.named(int(summed[-1].item()))}")
        lr = self.run.schedule.lr
        img_s = summed[1].item() / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.3g}", img_s=f"{img_s:.0f}", refresh=False)
        if self.on_log is not None:
            self.on_log(step, {"loss": mean_loss, "lr": lr, "images_per_second": img_s})

    def batch_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
        self.run.controls.stop.beat()

    def checkpoint_and_stop(self, state: TrainState, n_steps: int | None) -> bool:
        """After an optimizer step: save when due or when a stop was requested (then True: the epoch ends here)."""
        checkpointer = self.run.checkpointer
        stop = self.stop_requested and checkpointer is not None
        self.run.controls.stop.stopping = stop
        if checkpointer is not None and (stop or checkpointer.due(state, n_steps)):
            checkpointer.save(state)
        if stop and self.bar is not None:
            self.bar.close()
        return stop

    def end(self, totals: torch.Tensor) -> dict[str, float]:
        _sync(self.run.runtime.device)
        seconds = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.close()
        summed = self.run.runtime.sum(totals)
        counted = {"train_samples": int(summed[1].item())} if self.run.train_samples is None else {}  # a stream's
        parts = {f"train_{name}": (summed[2 + k] / summed[1]).item() for k, name in enumerate(self.run.parts)}
        return {"train_loss": (summed[0] / summed[1]).item(), **parts, **counted, "lr": self.run.schedule.lr,
                "epoch_seconds": seconds, "images_per_second": summed[1].item() / seconds}


@torch.no_grad()
def evaluate(model: nn.Module, batches, runtime: Runtime, measures: Measures | None = None,
             on_batch: Callable[[], None] | None = None, calls: BatchCalls | None = None) -> dict[str, float]:
    """val_loss, val_accuracy (a classifier's), val_<name> of the user's metrics and val_samples over exactly the
    whole set: each rank tallies its own disjoint shard, then the ranks' tallies are added (see metrics.Measures;
    the loss is exact when it gives per-sample values). `on_batch()` after each batch; `calls`: how a batch is
    scored (steps.BatchCalls; default `model(x)` against `y`)."""
    model.eval()
    measures = measures or Measures()
    calls = calls or BatchCalls(measures.loss)
    tally = measures.tally(runtime.device)
    for x, y in BEAT.each("validation", batches.lockstep(runtime.forward_collective or
                                                          calls.eval_gathers)):
        with runtime.autocast():
            scored = calls.score(model, x, y)
        if runtime.holds_outputs:  # a pipeline's last stage counts its batches, the stages before it none
            tally.add(scored.outputs, scored.targets, scored.loss, len(x))  # in fp32, outside autocast
        if on_batch is not None:
            on_batch()
    gather = runtime.gather_objects if runtime.world_size > 1 else None
    return {f"val_{name}": value for name, value in tally.result(runtime.sum, gather).items()}


def validate(run: Run, epoch: int) -> dict[str, float]:
    """`evaluate` for each (column prefix, model) the run validates, BatchNorm statistics made the same on every
    rank first: the trained weights' values under their own names, then the epoch's number, then the weight
    average's as ema_*. Without a validation set only the statistics are made the same."""
    row: dict[str, float] = {}
    with eager_unless(run.compiled_batch):
        for prefix, weights in run.validated:
            with weights() as model:
                run.runtime.sync_buffers(model)
                if run.val_batches is not None:
                    scored = evaluate(model, run.val_batches, run.runtime, run.measures, run.controls.stop.beat,
                                      run.calls)
                    row.update({prefix + k: v for k, v in scored.items() if not (prefix and k == "val_samples")})
            row.setdefault("epoch", epoch)
    return row


def _progress_bar(runtime: Runtime, total: int, desc: str, done: int = 0):
    """A tqdm bar on the main process when its output is a terminal; None elsewhere."""
    if not runtime.is_main or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, leave=False, dynamic_ncols=True)
