"""--strategy pipeline: the model cut into stages (split.py), each on a process of its own, the micro-batches of
every batch passed through them by torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B). The
stages are cut, split with --tp, sharded with --shard-stages and materialised by parallelize.py; here are what runs
them (`Pipelined`, `Runner`) and the checks of the data and the model before the cut.

With more processes than stages the pipeline is replicated (the layout's dp, pp outermost: layout.py); the data is
sharded over the replicas only (every stage of a replica reads the same batches: the first feeds the inputs, the
last scores the targets), every replica starts from replica 0's weights, and each stage's gradients are averaged
over its replicas once per optimizer step. Dropout draws from each process's own seed (the run's seed plus its
rank), so the stages draw differently. What makes it exact against the model trained whole on one process:

- each micro-batch's loss is weighted by its share of the batch and by the batch's share of its accumulation
  group, so the gradients are those of the group's mean loss (torch's own scaling by the micro-batch count is off);
- a batch that the micro-batches do not divide (an epoch's last) is cut into the most equal micro-batches up to
  --microbatches that divide it and that the schedule runs (config.microbatches_for; under GPipe's order when
  none does); with --shard-stages every replica runs as many, so that their gathers meet;
- the gradient norm clipped to is the norm over every stage's gradients (engine.py);
- the fp16 loss scaler skips a step on every stage at once (its inf check is reduced over all processes);
- checkpoints hold every parameter under its name in the whole model, so they resume on any layout, and
  last.safetensors, written tensor by tensor, loads into the model unsplit.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .layout import Layout
from .split import Split, StageForward, check_chain, plan_split, runs
from .watch import BEAT


def stage_chunks(model: nn.Module, layout: Layout) -> tuple[Split, list[int]]:
    """Where `model` is cut into stages, and the stages this process holds (two under interleaved 1F1B: s and
    s + stages)."""
    split = plan_split(model, layout.pp * layout.stages.chunks_per_process, layout.stages.split_at)
    return split, [layout.stage + k * layout.pp for k in range(layout.stages.chunks_per_process)]


def check_data(layout: Layout, train_data, val_data) -> None:
    """A pipeline's stages read the same batches of a Dataset's indices (the first feeds the inputs, the last scores
    the targets); a stream, dealt out per process, is refused there."""
    from torch.utils.data import IterableDataset

    if layout.pp == 1:
        return
    for where, data in (("train_data", train_data), ("val_data", val_data)):
        if isinstance(data, IterableDataset):
            raise UserError(f"--strategy pipeline reads a Dataset with len() and item access; {where} is an "
                            f"IterableDataset (a stream, dealt out per process, so stage 1 would feed one "
                            f"process's items and the last stage score another's): train it with --strategy "
                            f"ddp or fsdp, or give a Dataset")


def check_model(model: nn.Module, layout: Layout, batches, step=None) -> None:
    """Before the model is cut: its first training batch through the whole model on the meta device (shapes
    only), refused on one line unless its forward is its parts in order (split.check_chain), with BatchNorm
    while micro-batching, weights tied across stages and a Step of the user's refused too."""
    if step is not None:
        raise UserError("--strategy pipeline runs model(x) stage by stage and the loss on the last stage; a Step "
                        "of your own calls the model as it wishes: train it with --strategy ddp or fsdp")
    x, _ = batches.first_batch()
    if not isinstance(x, torch.Tensor):
        raise UserError("--strategy pipeline passes one tensor from stage to stage; this data's inputs are "
                        f"{type(x).__name__}, not a tensor")
    split, _ = stage_chunks(model, layout)
    check_chain(model, split, x)
    stages_of: dict[int, tuple[int, str]] = {}
    modules = dict(model.named_modules())
    for stage in range(len(split.starts)):
        for part in (m for piece in split.stage_pieces(stage) for m in piece.modules):
            for name, p in modules[part].named_parameters():
                held = stages_of.setdefault(id(p), (stage, f"{part}.{name}"))
                if held[0] != stage:
                    raise UserError(f"--strategy pipeline: {held[1]} (stage {held[0]}) and {part}.{name} (stage "
                                    f"{stage}) are one tensor, tied weights across stages; split elsewhere "
                                    f"(--split-at) or untie them")
    micro, _ = layout.stages.cut(len(x), layout.pp)
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms and micro > 1:
        raise UserError(f"--strategy pipeline: {norms[0]} is a BatchNorm, whose statistics over {micro} "
                        f"micro-batches differ from the whole batch's; use --microbatches 1 --schedule gpipe "
                        f"(stages then take turns), or a norm of each sample (LayerNorm, GroupNorm)")


class Pipelined(StageForward):
    """This process's stage(s) of the model, named as in the whole model. Its forward is evaluation through the
    whole pipeline (every stage returns the last stage's outputs); training goes through its runner's
    `train_batch`."""

    def __init__(self, model: nn.Module, split: Split, chunks: list[int], runner: "Runner"):
        super().__init__(model, tuple(p for c in chunks for p in split.stage_pieces(c)))
        self.split = split
        modules = dict(self.named_modules())
        self.chunks = [(c, _Chunk([modules[m] for p in split.stage_pieces(c) for m in p.modules],
                                  runs(model, split.stage_pieces(c)))) for c in chunks]  # a list: not registered
        self.num_chunks = len(split.starts)
        object.__setattr__(self, "runner", runner)  # not a module

    def forward(self, x: torch.Tensor):
        return self.runner.evaluate(self, x)


class Runner:
    """Runs batches through the pipeline for one process's stage(s): the schedule in use for training and for
    evaluation (one of each at most: a batch of another shape replaces it), and what the loss on the last stage
    reads of the batch in flight. `engine`: this process's (engine.py), whose layout says where it stands."""

    def __init__(self, engine):
        self.engine = engine
        self.schedules: dict[bool, tuple[tuple, Any, int]] = {}  # train or not -> (key, schedule, micro-batches)
        self.batch: dict[str, Any] = {}  # this batch's loss, weight, loss scaler and the losses seen

    def _loss(self, out, target):
        """A micro-batch's loss on the last stage, weighted so that the gradients are the group's mean loss's."""
        b = self.batch
        value = b["loss"](b["loss"].outputs(out), target)
        b["seen"].append(value.detach())
        scaled = value * (b["weight"] / b["micro"])
        return b["scaler"].scale(scaled) if b["scaler"] is not None else scaled

    def _schedule(self, stage: Pipelined, x: torch.Tensor, train: bool):
        """The schedule for batches of x's shape (the stages learn the shapes they pass on their first use)."""
        from torch.distributed import pipelining as pp

        p, L = self.engine, self.engine.layout
        micro, kind = L.stages.cut(len(x), L.pp)
        if train and L.dp_shard > 1:  # every replica runs as many micro-batches: each gathers a stage with the others
            sizes = p.runtime.gather_objects(len(x), group=p.replica_group)
            micro, kind = L.stages.cut(math.gcd(*sizes), L.pp)
        key = (tuple(x.shape), x.dtype, micro, kind)
        held = self.schedules.get(train)
        if held is None or held[0] != key:
            self.schedules.pop(train, None)  # its stages' receive buffers go with it
            stages = [pp.PipelineStage(run, index, stage.num_chunks, p.device, group=p.group("pp"))
                      for index, run in stage.chunks]
            cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
                   "interleaved-1f1b": pp.ScheduleInterleaved1F1B}[kind]
            if kind == "gpipe" and len(stages) > 1:
                cls = pp.ScheduleLoopedBFS  # GPipe's order over several stages per process
            one = stages[0] if len(stages) == 1 else stages
            schedule = cls(one, micro, loss_fn=self._loss if train else None, scale_grads=False)
            self.schedules[train] = held = (key, schedule, micro)
        return held[1], held[2]

    def evaluate(self, stage: Pipelined, x: torch.Tensor):
        """Evaluation of one batch through the pipeline; every stage returns the last stage's outputs."""
        p, L = self.engine, self.engine.layout
        rows = len(x)
        if L.dp_shard > 1:  # every replica's batch of one shape (filled with zeros): each gathers with the others
            x = _filled(x, max(p.runtime.gather_objects(rows, group=p.replica_group)))
        schedule, _ = self._schedule(stage, x, train=False)
        with BEAT.during("the pipeline's schedule"):
            out = schedule.step(x) if L.stage == 0 else schedule.step()
            shared = [out.detach().cpu()[:rows] if out is not None else None]
            torch.distributed.broadcast_object_list(shared, src=L.rank_of(stage=L.pp - 1), group=p.group("pp"))
        return shared[0].to(p.device)

    def train_batch(self, stage: Pipelined, x: torch.Tensor, y: Any, loss, weight: float, sync: bool, scaler=None,
                    autocast=contextlib.nullcontext) -> torch.Tensor | None:
        """One batch's forward and backward through the pipeline, its gradients weighted by `weight` and added to
        the stage's own; the batch's mean loss on the last stage (None on the others). `sync`: the last batch of an
        accumulation group, after which the replicas' gradients are averaged."""
        p, L = self.engine, self.engine.layout
        schedule, micro = self._schedule(stage, x, train=True)
        self.batch.update(loss=loss, weight=weight, micro=micro, scaler=scaler, seen=[])
        with BEAT.during("the pipeline's schedule"), autocast():
            if L.stage == 0:
                schedule.step(x, target=y if L.pp == 1 else None)
            else:
                schedule.step(target=y, losses=[] if L.holds_outputs else None)
        if sync and L.dp > 1:  # (fsdp over the replicas reduces its own: the model's own tensors are not its)
            held = [q for q in stage.parameters() if not (p.fully_shards and hasattr(q, "to_local"))]
            p.runtime.average_gradients(held, group=p.replica_group)
        seen = self.batch.pop("seen")[-micro:]  # a stage's first use may score a trial output first
        return torch.stack(seen).mean() if seen else None


class _Chunk(nn.Module):
    """One pipeline stage's forward for torch's PipelineStage: its parts in order (`run`: each as a function of its
    input; its modules stay registered in Pipelined, under their names in the whole model, and here too, where
    fsdp finds them)."""

    def __init__(self, modules: list[nn.Module], run: list):
        super().__init__()
        self.parts = nn.ModuleList(modules)
        object.__setattr__(self, "run", run)

    def forward(self, x):
        x = _DenseGradient.apply(x) if x.requires_grad else x
        for part in self.run:
            x = part(x)
        return x.contiguous()  # sent as it is laid out in memory: a channels_last activation is not


def _filled(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with rows of zeros after its own, up to `rows`."""
    return x if len(x) >= rows else torch.cat([x, x.new_zeros((rows - len(x), *x.shape[1:]))])


class _DenseGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient dense: a stage's input gradient is sent to the stage before
    into a buffer laid out as its output (channels_last layers would give it their own layout)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
