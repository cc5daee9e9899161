"""--strategy pipeline: the model cut into stages (split.py), each on a process of its own, the micro-batches of
every batch passed through them by torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B).

With more processes than stages the pipeline is replicated: processes form a (dp, pp) DeviceMesh, rank
`replica * stages + stage`; the data is sharded over the replicas only (every stage of a replica reads the same
batches: the first feeds the inputs, the last scores the targets), and each stage's gradients are averaged over
its replicas once per optimizer step. What makes it exact against the model trained whole on one process:

- each micro-batch's loss is weighted by its share of the batch and by the batch's share of its accumulation
  group, so the gradients are those of the group's mean loss (torch's own scaling by the micro-batch count is off);
- a batch that the micro-batches do not divide (an epoch's last) is cut into the most equal micro-batches up to
  --microbatches that do (run under GPipe when they are fewer than the stages, which 1F1B needs);
- the gradient norm clipped to is the norm over every stage's gradients;
- the fp16 loss scaler skips a step on every stage at once (its inf check is reduced over all processes);
- checkpoints hold every parameter under its name in the whole model (torch.distributed.checkpoint, the optimizer
  state keyed by those names), so they resume on another layout and on one process, and last.safetensors loads into
  the model unsplit.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .split import Split, StageForward, check_chain, plan_split, stage_model
from .strategies import DDP, _flat, _load_sharded, _save_sharded
from .watch import BEAT

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}  # stages each process holds
OLDEST_TORCH = (2, 8)  # pipelining's schedules over gloo could hang before (pytorch#132644, fixed by #152938)


@dataclass(frozen=True)
class Layout:
    """The pipeline a run asks for: --stages, --split-at, --microbatches, --schedule (0: chosen)."""

    stages: int = 0
    split_at: tuple[str, ...] = ()
    microbatches: int = 0
    schedule: str = "1f1b"

    @classmethod
    def of(cls, r) -> "Layout":
        return cls(r.stages, tuple(r.split_at), r.microbatches, r.schedule)

    def stage_count(self, processes: int) -> int:
        """Stages of one pipeline: --stages, one more than the --split-at names, else every process."""
        return self.stages or (len(self.split_at) + 1 if self.split_at else processes)

    def replicas(self, processes: int) -> int:
        """Pipelines in a job of `processes`; refused on one line when the stages do not divide them, or on a torch
        older than OLDEST_TORCH."""
        found = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if found < OLDEST_TORCH:
            raise UserError(f"--strategy pipeline needs torch {'.'.join(map(str, OLDEST_TORCH))} or later (its "
                            f"schedules could hang on gloo before); this is torch {torch.__version__}")
        stages = self.stage_count(processes)
        if processes < stages or processes % stages:
            raise UserError(f"--strategy pipeline with {stages} stages needs a multiple of {stages} processes "
                            f"(--nproc x --nnodes), got {processes}")
        return processes // stages

    def microbatches_for(self, batch: int, stages: int) -> int:
        """Micro-batches of a batch of `batch` rows: --microbatches (0: twice the stages) when it divides the batch,
        else the most below it that do."""
        most = self.microbatches or 2 * stages
        return max(m for m in range(1, min(most, batch) + 1) if batch % m == 0)


class Pipeline(DDP):
    """Each process holds one stage of the model (two under interleaved 1F1B); see the module's doc."""

    name = "pipeline"
    sharded = True  # each process holds a part of the model
    checkpoint_format = "sharded"

    def __init__(self, runtime, layout: Layout | None = None):
        super().__init__(runtime)
        self.layout = layout or Layout()
        self._mesh = None

    # -- the layout (the job's size is fixed: worked out once, not at every batch) ----------------------------
    @functools.cached_property
    def stages(self) -> int:
        return self.layout.stage_count(self.runtime.world_size)

    @functools.cached_property
    def replicas(self) -> int:
        return self.layout.replicas(self.runtime.world_size)

    @property
    def replica(self) -> int:
        return self.runtime.rank // self.stages

    @property
    def stage(self) -> int:
        return self.runtime.rank % self.stages

    @property
    def holds_outputs(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def where(self) -> str:
        """What the stall watch names while this process passes batches through the pipeline."""
        return f"pipeline stage {self.stage + 1} of {self.stages}"

    def group(self, dim: str):
        """This process's group along "pp" (its pipeline) or "dp" (its stage's replicas)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.runtime.device.type, (self.replicas, self.stages),
                                          mesh_dim_names=("dp", "pp"))
        return self._mesh.get_group(dim)

    # -- the model -----------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module, batches, step=None) -> None:
        """Before the model is cut: its first training batch through the whole model, refused on one line unless
        its forward is its parts in order (split.check_chain), with BatchNorm while micro-batching, weights tied
        across stages and a Step of the user's refused too. Every process checks; the main process says why."""
        try:
            self._check_model(model, batches, step)
        except UserError as e:
            raise UserError(str(e), quiet=not getattr(self.runtime, "is_main", True)) from None

    def _check_model(self, model: nn.Module, batches, step) -> None:
        if step is not None:
            raise UserError("--strategy pipeline runs model(x) stage by stage and the loss on the last stage; a Step "
                            "of your own calls the model as it wishes: train it with --strategy ddp or fsdp")
        x, _ = batches.first_batch()
        if not isinstance(x, torch.Tensor):
            raise UserError("--strategy pipeline passes one tensor from stage to stage; this data's inputs are "
                            f"{type(x).__name__}, not a tensor")
        split = self.split(model)
        device = next(model.parameters()).device
        check_chain(model, split, x.to(device))
        stages_of: dict[int, tuple[int, str]] = {}
        modules = dict(model.named_modules())
        for stage in range(len(split.starts)):
            for part in split.stage_parts(stage):
                for name, p in modules[part].named_parameters():
                    held = stages_of.setdefault(id(p), (stage, f"{part}.{name}"))
                    if held[0] != stage:
                        raise UserError(f"--strategy pipeline: {held[1]} (stage {held[0]}) and {part}.{name} (stage "
                                        f"{stage}) are one tensor, tied weights across stages; split elsewhere "
                                        f"(--split-at) or untie them")
        micro = self.layout.microbatches_for(len(x), self.stages)
        norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms and micro > 1:
            raise UserError(f"--strategy pipeline: {norms[0]} is a BatchNorm, whose statistics over {micro} "
                            f"micro-batches differ from the whole batch's; use --microbatches 1 (stages then take "
                            f"turns), "
                            f"or a norm of each sample (LayerNorm, GroupNorm)")

    def split(self, model: nn.Module) -> Split:
        return plan_split(model, self.stages * VIRTUAL[self.layout.schedule], self.layout.split_at)

    def wrap(self, model: nn.Module, make_optimizer, step=None):
        split = self.split(model)
        chunks = [self.stage + k * self.stages for k in range(VIRTUAL[self.layout.schedule])]
        index = {id(p): i for i, p in enumerate(model.parameters())}  # each parameter's place in the whole model
        stage = Pipelined(stage_model(model, split, chunks), split, chunks, self).to(self.runtime.device)
        stage.whole_index = [index[id(p)] for p in stage.parameters()]
        if self.runtime.is_main:
            print(f"pipeline of {self.stages} stages x {self.replicas} replica(s), schedule {self.layout.schedule}: "
                  f"{split.describe()}", flush=True)
        if self.accelerator.scaler is not None:  # fp16: an overflow on any stage skips the step on all of them
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.accelerator.scaler = ShardedGradScaler(device=self.runtime.device.type)
        return stage, self.accelerator.prepare(make_optimizer(stage))

    def no_sync(self, model: nn.Module, skip: bool):
        return contextlib.nullcontext()  # the replicas' gradients are averaged by Pipelined.train_batch

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so that their global L2 norm, over all stages, is at most `max_norm`:
        torch's clip_grad_norm_ over the whole model, each parameter's norm gathered from its stage and taken in
        the whole model's order, so that the norm is the one a single process computes, to the bit."""
        self.accelerator.unscale_gradients()
        held = [(i, p.grad) for i, p in zip(model.whole_index, model.parameters()) if p.grad is not None]
        grads = [g for _, g in held]
        if grads and grads[0].device.type == "cuda":
            norms = torch._foreach_norm(grads, 2.0)  # what clip_grad_norm_ takes on a GPU
        else:
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
        every: list = [None] * self.stages
        with BEAT.during("collective"):
            torch.distributed.all_gather_object(every, [(i, n.cpu()) for (i, _), n in zip(held, norms)],
                                                group=self.group("pp"))
        ordered = sorted((pair for stage in every for pair in stage), key=lambda pair: pair[0])
        total = torch.linalg.vector_norm(torch.stack([n for _, n in ordered]).to(self.runtime.device), 2.0)
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm,
                                             total)
        return total

    def sync_buffers(self, model: nn.Module) -> None:
        """Each stage's buffers from its first replica."""
        if self.replicas > 1:
            src = self.stage  # global rank of replica 0 of this stage
            with BEAT.during("collective"):
                for buf in model.buffers():
                    torch.distributed.broadcast(buf.data, src=src, group=self.group("dp"))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every stage's weights under their names in the whole model, on the main process (others: empty)."""
        mine = {k: v.detach().cpu() for k, v in model.state_dict().items()} if self.replica == 0 else {}
        parts: list | None = [None] * self.runtime.world_size if self.runtime.is_main else None
        with BEAT.during("collective"):
            torch.distributed.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if parts is not None else {}

    def save(self, folder, model: nn.Module, optimizer) -> dict[str, Any]:
        _save_sharded(folder, model, optimizer, flat=True)
        return {"flat": True}  # the optimizer state keyed by each parameter's name: no rank's overwrites another's

    def load(self, folder, model: nn.Module, optimizer, train: dict[str, Any]) -> None:
        _load_sharded(folder, model, optimizer, flat=_flat(train))


class Pipelined(StageForward):
    """This process's stage(s) of the model, named as in the whole model, and the pipeline they run in.

    `forward(x)` is evaluation: the batch through every stage, the last stage's outputs given to every stage of
    the pipeline. `train_batch` is one batch's forward and backward through the schedule."""

    def __init__(self, model: nn.Module, split: Split, chunks: list[int], strategy: Pipeline):
        super().__init__(model, tuple(p for c in chunks for p in split.stage_parts(c)))
        modules = dict(self.named_modules())
        chunk_runs = [_Chunk([modules[p] for p in split.stage_parts(c)]) for c in chunks]
        object.__setattr__(self, "pipeline", strategy)
        object.__setattr__(self, "chunks", list(zip(chunks, chunk_runs)))
        object.__setattr__(self, "schedules", {})
        object.__setattr__(self, "batch", {})  # this batch's loss, weight, loss scaler and the losses seen
        self.num_chunks = len(split.starts)

    def _loss(self, out, target):
        """A micro-batch's loss on the last stage, weighted so that the gradients are the group's mean loss's."""
        b = self.batch
        value = b["loss"](b["loss"].outputs(out), target)
        b["seen"].append(value.detach())
        scaled = value * (b["weight"] / b["micro"])
        return b["scaler"].scale(scaled) if b["scaler"] is not None else scaled

    def _schedule(self, x: torch.Tensor, train: bool):
        """The schedule for batches of x's shape (the stages learn the shapes they pass on their first use)."""
        from torch.distributed import pipelining as pp

        p = self.pipeline
        micro = p.layout.microbatches_for(len(x), p.stages)
        kind = p.layout.schedule if micro >= p.stages else "gpipe"  # 1F1B needs a micro-batch per stage
        key = (tuple(x.shape), x.dtype, train, micro, kind)
        if key not in self.schedules:
            if len(self.schedules) > 16:
                self.schedules.clear()
            stages = [pp.PipelineStage(run, index, self.num_chunks, p.runtime.device, group=p.group("pp"))
                      for index, run in self.chunks]
            cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
                   "interleaved-1f1b": pp.ScheduleInterleaved1F1B}[kind]
            if kind == "gpipe" and len(stages) > 1:
                cls = pp.ScheduleLoopedBFS  # GPipe's order over several stages per process
            one = stages[0] if len(stages) == 1 else stages
            self.schedules[key] = (cls(one, micro, loss_fn=self._loss if train else None, scale_grads=False), micro)
        return self.schedules[key]

    def forward(self, x: torch.Tensor):
        """Evaluation of one batch through the pipeline; every stage returns the last stage's outputs."""
        p = self.pipeline
        schedule, _ = self._schedule(x, train=False)
        with BEAT.during(p.where):
            out = schedule.step(x) if p.stage == 0 else schedule.step()
            shared = [out.detach().cpu() if out is not None else None]
            torch.distributed.broadcast_object_list(shared, src=p.runtime.rank - p.stage + p.stages - 1,
                                                    group=p.group("pp"))
        return shared[0].to(p.runtime.device)

    def train_batch(self, x: torch.Tensor, y: Any, loss, weight: float, sync: bool, scaler=None,
                    autocast=contextlib.nullcontext) -> torch.Tensor | None:
        """One batch's forward and backward through the pipeline, its gradients weighted by `weight` and added to
        the stage's own; the batch's mean loss on the last stage (None on the others). `sync`: the last batch of an
        accumulation group, after which the replicas' gradients are averaged."""
        p = self.pipeline
        schedule, micro = self._schedule(x, train=True)
        self.batch.update(loss=loss, weight=weight, micro=micro, scaler=scaler, seen=[])
        with BEAT.during(p.where), autocast():
            if p.stage == 0:
                schedule.step(x, target=y if p.stages == 1 else None)
            else:
                schedule.step(target=y, losses=[] if p.holds_outputs else None)
        if sync and p.replicas > 1:
            p.runtime.average_gradients(list(self.parameters()), group=p.group("dp"))
        seen = self.batch.pop("seen")[-micro:]  # a stage's first use may score a trial output first
        return torch.stack(seen).mean() if seen else None


class _Chunk(nn.Module):
    """One pipeline stage's forward for torch's PipelineStage: its parts in order (the parts stay registered in
    Pipelined, under their names in the whole model)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        x = _DenseGradient.apply(x) if x.requires_grad else x
        for part in self.parts:
            x = part(x)
        return x.contiguous()  # sent as it is laid out in memory: a channels_last activation is not


class _DenseGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient dense: a stage's input gradient is sent to the stage before
    into a buffer laid out as its output (channels_last layers would give it their own layout)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
