"""--strategy pipeline: the model cut into stages (split.py), each on a process of its own, the micro-batches of
every batch passed through them by torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B).

A model built on the meta device (a model by name, or a function given to `fit`) is never whole in any process:
the cut is checked on the meta device, and each process materialises only its stage's parts (materialise.py),
with the values the whole model has at the run's seed, or those of --init-from.

With more processes than stages the pipeline is replicated: processes form a (pp, dp) DeviceMesh, rank
`stage * replicas + replica` (pp outermost, as torchtitan lays it out); the data is sharded over the replicas only
(every stage of a replica reads the same batches: the first feeds the inputs, the last scores the targets), every
replica starts from replica 0's weights, and each stage's gradients are averaged over its replicas once per
optimizer step. Dropout draws from each process's own seed (the run's seed plus its rank), so the stages draw
differently. What makes it exact against the model trained whole on one process:

- each micro-batch's loss is weighted by its share of the batch and by the batch's share of its accumulation
  group, so the gradients are those of the group's mean loss (torch's own scaling by the micro-batch count is off);
- a batch that the micro-batches do not divide (an epoch's last) is cut into the most equal micro-batches up to
  --microbatches that divide it and that the schedule runs (config.microbatches_for; under GPipe's order when
  none does);
- the gradient norm clipped to is the norm over every stage's gradients;
- the fp16 loss scaler skips a step on every stage at once (its inf check is reduced over all processes);
- checkpoints hold every parameter under its name in the whole model (torch.distributed.checkpoint, the optimizer
  state keyed by those names), so they resume on another layout and on one process, and last.safetensors, written
  tensor by tensor, loads into the model unsplit.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import CHUNKS_PER_PROCESS, check_schedule, microbatches_for
from ..errors import UserError
from .materialise import on_meta
from .split import Split, StageForward, check_chain, plan_split, stage_model
from .strategies import DDP, _flat, _fused, _load_sharded, _save_sharded, broadcast_tensors, clip_to_norm
from .tensor import apply, plan_for
from .watch import BEAT
from .whole import WholeTensors

OLDEST_TORCH = (2, 8)  # pipelining's schedules over gloo could hang before (pytorch#132644, fixed by #152938)


@dataclass(frozen=True)
class Layout:
    """The pipeline a run asks for: --stages, --split-at, --microbatches, --schedule (0: chosen). The schedules'
    rules are config.schedule_runs."""

    stages: int = 0
    split_at: tuple[str, ...] = ()
    microbatches: int = 0
    schedule: str = "1f1b"
    shard: bool = False  # --shard-stages: each stage sharded over its replicas (fsdp inside a stage)

    @classmethod
    def of(cls, r) -> "Layout":
        return cls(r.stages, tuple(r.split_at), r.microbatches, r.schedule, r.shard_stages)

    def stage_count(self, processes: int) -> int:
        """Stages of one pipeline: --stages, one more than the --split-at names, else every process."""
        return self.stages or (len(self.split_at) + 1 if self.split_at else processes)

    @property
    def chunks_per_process(self) -> int:
        """Model stages each process holds (two under interleaved 1F1B)."""
        return CHUNKS_PER_PROCESS[self.schedule]

    def replicas(self, processes: int, tp: int = 1) -> int:
        """Pipelines in a job of `processes` (each of `tp` processes under --tp); refused on one line when the
        stages do not divide them, when --microbatches is not one the schedule runs through them, or on a torch
        older than OLDEST_TORCH."""
        found = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if found < OLDEST_TORCH:
            raise UserError(f"--strategy pipeline needs torch {'.'.join(map(str, OLDEST_TORCH))} or later (its "
                            f"schedules could hang on gloo before); this is torch {torch.__version__}")
        stages = self.stage_count(processes)
        if processes < stages or processes % stages:
            each = f" of --tp {tp} processes each" if tp > 1 else ""
            raise UserError(f"--strategy pipeline with {stages} stages{each} needs a multiple of {stages * tp} "
                            f"processes (--nproc x --nnodes), got {processes * tp}")
        if self.microbatches:
            check_schedule(self.schedule, self.microbatches, stages)
        return processes // stages

    def cut(self, batch: int, stages: int) -> tuple[int, str]:
        """(micro-batches, schedule) for a batch of `batch` rows (config.microbatches_for): an epoch's short last
        batch that the schedule cannot run in micro-batches that divide it runs under GPipe's order."""
        return microbatches_for(batch, stages, self.schedule, self.microbatches)


class Pipeline(DDP):
    """Each process holds one stage of the model (two under interleaved 1F1B); see the module's doc."""

    name = "pipeline"
    sharded = True  # each process holds a part of the model
    builds_on_meta = True
    fuses_forward_backward = True
    checkpoint_format = "sharded"

    @classmethod
    def splits(cls, processes: int) -> bool:
        return True

    def __init__(self, runtime, layout: Layout | None = None, init_from: str = "", tp: int = 1):
        super().__init__(runtime, init_from)
        self.layout = layout or Layout()
        self.tp = tp  # processes each stage's layers are split over (--tp): a (pp, dp, tp) mesh
        self._mesh = None
        self.fused: list[str] = []  # the whole model's tensors split by heads, for the checkpoints
        if tp > 1:
            BEAT.role = f"tensor-parallel rank {self.tp_rank + 1} of {tp}"

    # -- the layout (the job's size is fixed: worked out once, not at every batch) ----------------------------
    # Ranks are laid out pp-outermost, as torchtitan's mesh: rank = stage * replicas + replica, so that a stage's
    # replicas (whose gradients are averaged at every step) are neighbours, on one node where they fit, and the
    # pipeline's hops, one activation per micro-batch, are what crosses nodes.
    @functools.cached_property
    def stages(self) -> int:
        return self.layout.stage_count(self.runtime.world_size // self.tp)

    @functools.cached_property
    def replicas(self) -> int:
        return self.layout.replicas(self.runtime.world_size // self.tp, self.tp)

    @property
    def replica(self) -> int:
        return self.runtime.rank // self.tp % self.replicas

    @property
    def stage(self) -> int:
        return self.runtime.rank // self.tp // self.replicas

    @property
    def tp_rank(self) -> int:
        return self.runtime.rank % self.tp

    def rank_of(self, stage: int, replica: int = 0) -> int:
        """The global rank of a stage's replica (this process's part of its split layers, under --tp)."""
        return (stage * self.replicas + replica) * self.tp + self.tp_rank

    @property
    def holds_outputs(self) -> bool:
        return self.stage == self.stages - 1 and self.tp_rank == 0

    @property
    def random_rank(self) -> int:
        return self.runtime.rank // self.tp  # the processes of a split layer draw alike

    @property
    def reads_inputs(self) -> bool:
        return self.stage == 0  # the first stage (under interleaved 1F1B too: it holds stage 0)

    @property
    def where(self) -> str:
        """What the stall watch names while this process passes batches through the pipeline."""
        return f"pipeline stage {self.stage + 1} of {self.stages}"

    @property
    def shards_stages(self) -> bool:
        """Whether each stage is sharded over its replicas (--shard-stages, with 2 or more replicas)."""
        return self.layout.shard and self.replicas > 1

    def mesh(self):
        """The job's (pp, dp) DeviceMesh, made at the first use."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            tp = ((self.tp,), ("tp",)) if self.tp > 1 else ((), ())
            self._mesh = init_device_mesh(self.runtime.device.type, (self.stages, self.replicas, *tp[0]),
                                          mesh_dim_names=("pp", "dp", *tp[1]))
        return self._mesh

    def group(self, dim: str):
        """This process's group along "pp" (its pipeline) or "dp" (its stage's replicas)."""
        return self.mesh().get_group(dim)

    # -- the data and the model ----------------------------------------------------------------------------
    def check_data(self, train_data, val_data) -> None:
        """Every stage of a pipeline reads the same batches (the first feeds the inputs, the last scores the
        targets), which a Dataset's indices give; a stream is dealt out per process, so refused."""
        from torch.utils.data import IterableDataset

        for where, data in (("train_data", train_data), ("val_data", val_data)):
            if isinstance(data, IterableDataset):
                raise UserError(f"--strategy pipeline reads a Dataset with len() and item access; {where} is an "
                                f"IterableDataset (a stream, dealt out per process, so stage 1 would feed one "
                                f"process's items and the last stage score another's): train it with --strategy "
                                f"ddp or fsdp, or give a Dataset")

    def check_model(self, model: nn.Module, batches, step=None) -> None:
        """Before the model is cut: its first training batch through the whole model on the meta device (shapes
        only), refused on one line unless its forward is its parts in order (split.check_chain), with BatchNorm
        while micro-batching, weights tied across stages and a Step of the user's refused too. Every process
        checks; the main process says why."""
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
        check_chain(model, split, x)
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
        micro, _ = self.layout.cut(len(x), self.stages)
        norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms and micro > 1:
            raise UserError(f"--strategy pipeline: {norms[0]} is a BatchNorm, whose statistics over {micro} "
                            f"micro-batches differ from the whole batch's; use --microbatches 1 --schedule gpipe "
                            f"(stages then take turns), or a norm of each sample (LayerNorm, GroupNorm)")

    def split(self, model: nn.Module) -> Split:
        return plan_split(model, self.stages * self.layout.chunks_per_process, self.layout.split_at)

    def wrap(self, model: nn.Module, make_optimizer, step=None):
        """This process's stage(s) of `model` (built on the meta device, or a whole model of the user's), alone
        materialised on its device with the weights training starts from, the same on every replica."""
        split = self.split(model)
        chunks = [self.stage + k * self.stages for k in range(self.layout.chunks_per_process)]
        order = {name: i for i, (name, _) in enumerate(model.named_parameters())}  # the whole model's order
        initial = self.initial_weights(model)  # checked against the whole model, before it is cut
        meta = on_meta(model)
        plan = self.agreed(lambda: plan_for(model, self.tp)) if self.tp > 1 else None  # the whole model's
        part = stage_model(model, split, chunks)
        if plan is not None:
            self.fused = [f"{n}.weight" for n, style in plan.styles.items() if style == "heads"]
            part = self.split_layers(part, plan.within(part), initial, meta)
        elif not (meta and self.shards_stages):  # a sharded stage is materialised shard by shard, below
            part = self.start_from(part, initial)
            self.equal_replicas(part)
        stage = Pipelined(part, split, chunks, _Runner(self))
        if self.shards_stages:
            self.shard_stage(stage, part, initial if meta else None, meta)
        stage.whole_index = [order[name] for name, _ in stage.named_parameters()]
        if self.runtime.is_main:
            built = f"built on the meta device, each process materialised only {'its part of ' if plan else ''}" \
                f"its stage(s)" if meta else \
                "the model object given whole, each process keeping its stage(s)"
            sharded = ", each stage sharded over its replicas" if self.shards_stages else \
                f", each stage's layers split over {self.tp} processes ({plan.describe()})" if plan else ""
            print(f"pipeline of {self.stages} stages x {self.replicas} replica(s){sharded}, schedule "
                  f"{self.layout.schedule}: {split.describe()}; {built}" +
                  (f", from {self.init_from}" if self.init_from else "") + (plan.note if plan else ""), flush=True)
        if self.accelerator.scaler is not None:  # fp16: an overflow on any stage skips the step on all of them
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.accelerator.scaler = ShardedGradScaler(device=self.runtime.device.type)
        return stage, self.accelerator.prepare(make_optimizer(stage))

    def shard_stage(self, stage: "Pipelined", part: nn.Module, initial, meta: bool) -> None:
        """fsdp inside the stage (--shard-stages): each chunk's blocks and the chunk itself sharded over the
        stage's replicas (torch's fully_shard on the "dp" dimension of the mesh, as torchtitan composes pipeline and
        fsdp; the pipeline's schedule reduces the gradients after a batch's last micro-batch). A stage still on the
        meta device is materialised shard by shard, each filled from --init-from's rows or from the replicas that
        replay its tensors."""
        from .materialise import Blueprint, fill
        from .strategies import shard_blocks

        shard_blocks([run for _, run in stage.chunks], self.mesh()["dp"], self.runtime.mixed_precision)
        if not meta:
            return
        members = [self.rank_of(self.stage, r) for r in range(self.replicas)]
        source = self.shard_source(stage, Blueprint.of(part), initial, self.replica, self.replicas, self.group("dp"),
                                   members)
        for _, run in stage.chunks:  # each chunk is an fsdp root: its shards are made through it
            run.to_empty(device=self.runtime.device)
        with BEAT.during("collective"):
            fill(stage, source, every=True)

    def split_layers(self, part: nn.Module, plan, initial, meta: bool) -> nn.Module:
        """--tp inside the stage: its layers split over the tensor-parallel processes as `plan` says, materialised
        part by part from the tensors its processes replay and broadcast (or --init-from's); a stage given whole
        is split from its first process's tensors, every replica from replica 0's."""
        first = self.runtime.rank - self.tp_rank  # of this stage's tensor-parallel processes
        if not meta:  # the stage's tensors, split or not, its first process's
            part = self.start_from(part, initial)
            broadcast_tensors(part, src=first, group=self.group("tp"))
        apply(part, plan, self.mesh()["tp"])
        if not meta:
            self.equal_replicas(part)
            return part
        return self.materialised(part, initial, self.tp_rank, self.tp, self.group("tp"),
                                 list(range(first, first + self.tp)))

    def equal_replicas(self, part: nn.Module) -> None:
        """Every replica of this stage starts from replica 0's tensors, as DistributedDataParallel's constructor
        makes them (a model built without a seed differs per process)."""
        if self.replicas > 1 and not on_meta(part):
            broadcast_tensors(part, src=self.rank_of(self.stage), group=self.group("dp"))

    def forward_backward(self, model: "Pipelined", x: torch.Tensor, y: Any, loss, weight: float, sync: bool):
        BEAT.mark("forward and backward, pipelined")
        out = model.runner.train_batch(model, x, y, loss, weight, sync, self.accelerator.scaler,
                                       self.runtime.autocast)
        return out if out is not None else torch.zeros((), device=self.runtime.device)

    def no_sync(self, model: nn.Module, skip: bool):
        return contextlib.nullcontext()  # the replicas' gradients are averaged by the runner's train_batch

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so that their global L2 norm, over all stages, is at most `max_norm`:
        torch's clip_grad_norm_ over the whole model, each parameter's norm gathered from its stage and taken in
        the whole model's order, so that the norm is the one a single process computes, to the bit."""
        self.accelerator.unscale_gradients()
        held = [(i, p.grad) for i, p in zip(model.whole_index, model.parameters()) if p.grad is not None]
        grads = [g for _, g in held]
        if grads and grads[0].device.type == "cuda" and not any(hasattr(g, "to_local") for g in grads):
            norms = torch._foreach_norm(grads, 2.0)  # what clip_grad_norm_ takes on a GPU (not on split layers')
        else:
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
        with BEAT.during("collective"):
            norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]  # a shard's: over the dp
            every: list = [None] * self.stages
            torch.distributed.all_gather_object(every, [(i, n.cpu()) for (i, _), n in zip(held, norms)],
                                                group=self.group("pp"))
        ordered = sorted((pair for stage in every for pair in stage), key=lambda pair: pair[0])
        total = torch.linalg.vector_norm(torch.stack([n for _, n in ordered]).to(self.runtime.device), 2.0)
        return clip_to_norm(grads, total, max_norm)

    def sync_buffers(self, model: nn.Module) -> None:
        """Each stage's buffers from its first replica."""
        if self.replicas > 1:
            with BEAT.during("collective"):
                for buf in model.buffers():
                    torch.distributed.broadcast(buf.data, src=self.rank_of(self.stage), group=self.group("dp"))

    def whole_tensors(self, model: nn.Module) -> WholeTensors | dict[str, torch.Tensor]:
        """Every stage's tensors under their names in the whole model, one at a time on the main process, each
        sent by replica 0 of its stage (by each replica its rows, where the stages are sharded)."""
        return WholeTensors.gathered(self.runtime, model.state_dict())

    def save(self, folder, model: nn.Module, optimizer) -> dict[str, Any]:
        _save_sharded(folder, model, optimizer, flat=True)
        # the optimizer state keyed by each parameter's name: no rank's overwrites another's
        return {"flat": True, **({"fused": self.fused} if self.fused else {})}

    def load(self, folder, model: nn.Module, optimizer, train: dict[str, Any]) -> None:
        _load_sharded(folder, model, optimizer, flat=_flat(train), fused=_fused(train))


class Pipelined(StageForward):
    """This process's stage(s) of the model, named as in the whole model. Its forward is evaluation through the
    whole pipeline (every stage returns the last stage's outputs); training goes through its runner's
    `train_batch`."""

    def __init__(self, model: nn.Module, split: Split, chunks: list[int], runner: "_Runner"):
        super().__init__(model, tuple(p for c in chunks for p in split.stage_parts(c)))
        modules = dict(self.named_modules())
        self.chunks = [(c, _Chunk([modules[p] for p in split.stage_parts(c)])) for c in chunks]  # list: unregistered
        self.num_chunks = len(split.starts)
        object.__setattr__(self, "runner", runner)  # not a module

    def forward(self, x: torch.Tensor):
        return self.runner.evaluate(self, x)


class _Runner:
    """Runs batches through the pipeline for one process's stage(s): the schedule in use for training and for
    evaluation (one of each at most: a batch of another shape replaces it), and what the loss on the last stage
    reads of the batch in flight."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
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

        p = self.pipeline
        micro, kind = p.layout.cut(len(x), p.stages)
        key = (tuple(x.shape), x.dtype, micro, kind)
        held = self.schedules.get(train)
        if held is None or held[0] != key:
            self.schedules.pop(train, None)  # its stages' receive buffers go with it
            stages = [pp.PipelineStage(run, index, stage.num_chunks, p.runtime.device, group=p.group("pp"))
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
        p = self.pipeline
        schedule, _ = self._schedule(stage, x, train=False)
        with BEAT.during(p.where):
            out = schedule.step(x) if p.stage == 0 else schedule.step()
            shared = [out.detach().cpu() if out is not None else None]
            torch.distributed.broadcast_object_list(shared, src=p.rank_of(p.stages - 1, p.replica),
                                                    group=p.group("pp"))
        return shared[0].to(p.runtime.device)

    def train_batch(self, stage: Pipelined, x: torch.Tensor, y: Any, loss, weight: float, sync: bool, scaler=None,
                    autocast=contextlib.nullcontext) -> torch.Tensor | None:
        """One batch's forward and backward through the pipeline, its gradients weighted by `weight` and added to
        the stage's own; the batch's mean loss on the last stage (None on the others). `sync`: the last batch of an
        accumulation group, after which the replicas' gradients are averaged."""
        p = self.pipeline
        schedule, micro = self._schedule(stage, x, train=True)
        self.batch.update(loss=loss, weight=weight, micro=micro, scaler=scaler, seen=[])
        with BEAT.during(p.where), autocast():
            if p.stage == 0:
                schedule.step(x, target=y if p.stages == 1 else None)
            else:
                schedule.step(target=y, losses=[] if p.holds_outputs else None)
        if sync and p.replicas > 1 and not p.shards_stages:  # a sharded stage's fsdp reduces them itself
            p.runtime.average_gradients(list(stage.parameters()), group=p.group("dp"))
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
