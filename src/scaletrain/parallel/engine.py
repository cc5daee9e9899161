"""What one process does with the model on its layout, behind the seam the training and inference code use: build
it (on the meta device where the layout splits it), parallelize it (parallelize.py), run a batch through it (a
pipeline's schedule, or the model's forward and backward, gradient synchronisation held inside accumulation),
clip its gradients by one norm over any mix of placements, meshes and stages, make its buffers alike, give its
whole tensors one at a time, and save and load its checkpoints (saved.py). One class for every layout: what
differs is read off the Layout, never off a strategy's name."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .blocks import repeated_blocks
from .layout import Layout
from .materialise import WeightsFile, build_on_meta, checked_module
from .parallelize import AUTOCAST_DTYPES, local, parallelize
from .saved import inner_optimizer, load_sharded, load_whole, save_sharded, save_whole
from .watch import BEAT
from .whole import WholeTensors

class StepModule(nn.Module):
    """A module whose forward is one training step of the user's, `step(model, batch)`: DDP wraps it, so every call
    of the model inside the step (two views, a teacher and a student's heads, a detector's losses) is one forward,
    reduced once in the backward. It holds the model and nothing else (the step's own modules, a frozen teacher,
    stay outside DDP)."""

    def __init__(self, model: nn.Module, step):
        super().__init__()
        self.model = model
        object.__setattr__(self, "step", step)  # not a submodule

    def forward(self, batch):
        return self.step(self.model, batch)


def users_model(model: nn.Module) -> nn.Module:
    """The user's model inside a StepModule (the module itself otherwise)."""
    return model.model if isinstance(model, StepModule) else model


class Engine:
    """This process's model work on its `layout` (see the module's doc)."""

    def __init__(self, runtime, layout: Layout, init_from: str = ""):
        self.runtime, self.layout = runtime, layout
        self.init_from = init_from  # --init-from: the whole model's weights file training starts from
        self._pretrained: WeightsFile | None = None  # --pretrained's matching tensors, until the model is placed
        self.fused: list[str] = []  # the whole model's tensors split by heads (checkpoints hold them viewed)
        self.compiled = ""  # --compile: what was compiled, in words
        self.replicated = False  # whether DistributedDataParallel (or DataParallel) wraps the model
        if layout.tp > 1:  # DTensor's note that a weight split by tp and fsdp is gathered in two steps
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def accelerator(self):
        return self.runtime.accelerator

    # -- what the layout makes of the model --------------------------------------------------------------------
    @property
    def builds_on_meta(self) -> bool:
        """Whether a model built here (by name, or by a function given to `fit`) is built on the meta device and
        materialised part by part: where the layout splits it."""
        return self.layout.splits_model

    @property
    def forward_collective(self) -> bool:
        """Whether every process must take part in each forward (fsdp's gathers, a split layer's sums)."""
        return self.layout.tp > 1 or self.layout.dp_shard > 1

    @property
    def pipelined(self) -> bool:
        """Whether a batch's forward and backward are one call through the pipeline's schedule."""
        return self.layout.pp > 1

    @property
    def fully_shards(self) -> bool:
        """Whether torch's fully_shard wraps the model: sharded over the replicas (fsdp, --shard-stages), or, where
        layers are split, replicated over them (HSDP with shards of one), which reduces their gradients."""
        L = self.layout
        return L.dp_shard > 1 or (L.tp > 1 and L.dp > 1)

    @property
    def devices_per_process(self) -> int:
        """Model replicas each process drives: every visible GPU under DataParallel, else one."""
        if self.layout.strategy == "dp" and self.device.type == "cuda":
            return torch.cuda.device_count()
        return 1

    # -- groups of this process ----------------------------------------------------------------------------
    def group(self, *dims: str):
        """This process's group along `dims` of the layout's mesh; None where it is every process."""
        L = self.layout
        size = {"pp": L.pp, "dp_replicate": L.dp_replicate, "dp_shard": L.dp_shard, "tp": L.tp}
        if int(torch.tensor([size[d] for d in dims]).prod()) == L.world:
            return None
        return L.group(self.device.type, *dims)

    @property
    def stage_group(self):
        """The processes that hold parts of this process's stage (the whole model where there is one stage)."""
        return self.group("dp_replicate", "dp_shard", "tp")

    @property
    def replica_group(self):
        """This process's stage's processes of the same part in the other replicas (whose gradients it averages)."""
        return self.group("dp_replicate", "dp_shard")

    def mesh(self, *dims: str):
        return self.layout.mesh(self.device.type)[dims if len(dims) > 1 else dims[0]]

    # -- building ----------------------------------------------------------------------------------------
    def build(self, factory, where: str = "model") -> nn.Module:
        """The model `factory()` returns: built whole, or on the meta device (with its Blueprint) where the layout
        splits it, each process later materialising only its part (materialise.py)."""
        return build_on_meta(factory, where) if self.builds_on_meta else checked_module(factory(), where)

    def pretrained_from(self, path: str, model: nn.Module) -> list[str]:
        """--pretrained FILE (.safetensors) for a model still on the meta device: its tensors whose names and shapes
        match the model's are what each process's part starts from, read tensor by tensor when it is materialised
        (the rest as the model makes them); one line per tensor not loaded, as models.load_matching says them."""
        weights = self.agreed(lambda: WeightsFile(path, "--pretrained"))
        self._pretrained = weights
        return weights.match(model)

    def initial_weights(self, model: nn.Module) -> WeightsFile | None:
        """--init-from's file, checked against the whole model (before it is cut or sharded), or --pretrained's
        matching tensors; None without either."""
        if self._pretrained is not None:
            weights, self._pretrained = self._pretrained, None  # read once, then closed with its part's fill
            return weights
        if not self.init_from:
            return None

        def opened() -> WeightsFile:
            weights = WeightsFile(self.init_from)
            weights.check(model)
            return weights

        return self.agreed(opened)

    def agreed(self, make):
        """`make()` on every process, a refusal on any of them a refusal on all (said by the processes it came
        from), so that none is left waiting in a collective for the others."""
        error = None
        try:
            result = make()
        except UserError as e:
            error, result = e, None
        failed = error is not None
        if self.runtime.world_size > 1:
            failed = self.runtime.sum(torch.tensor([float(failed)], device=self.device)).item() > 0
        if error is not None:
            raise UserError(str(error), quiet=error.quiet or not self.runtime.is_main) from None
        if failed:
            raise UserError("another process refused the model (its line above says why)", quiet=True)
        return result

    def check_data(self, train_data, val_data) -> None:
        """Refuse, before anything trains, data this layout cannot read (pipeline.check_data)."""
        from .pipeline import check_data

        check_data(self.layout, train_data, val_data)

    def check_model(self, model: nn.Module, batches, step=None) -> None:
        """Refuse, before anything trains, a model this layout cannot train: stages that cannot be cut
        (pipeline.check_model)."""
        if self.pipelined:
            from .pipeline import check_model

            try:
                check_model(model, self.layout, batches, step)
            except UserError as e:
                raise UserError(str(e), quiet=not self.runtime.is_main) from None

    # -- the model ready to train --------------------------------------------------------------------------
    def prepare(self, model: nn.Module, make_optimizer, step=None, sync_bn: bool = False,
                activation_checkpointing: bool = False, compile_scope: str = "",
                find_unused_parameters: bool = False):
        """The model ready to train on this layout (parallelize.py's fixed order) and its optimizer over the
        parameters that result; with a user's `step`, the module whose forward is the step (StepModule) is what
        trains."""
        L = self.layout
        if L.strategy == "dp" and step is not None:
            raise UserError("--strategy dp splits each batch of inputs over the GPUs; a Step of your own takes its "
                            "batch whole: train it with --strategy ddp (one process per GPU)")
        self.accelerator.ddp_handler.find_unused_parameters = find_unused_parameters
        model = parallelize(model, self, self.initial_weights(model), sync_bn, activation_checkpointing,
                            compile_scope)
        if self.accelerator.scaler is not None and L.world > 1 and (L.splits_model or L.strategy == "fsdp"):
            # fp16: an overflow in any process's gradients skips the step on all of them
            self.accelerator.scaler = PartsGradScaler(device=self.device.type)
        optimizer = make_optimizer(model)
        foreach_where_it_can(optimizer)
        if not L.splits_model and L.strategy in ("ddp", "dp"):  # 7. replicated: DDP (or DataParallel) wraps it
            model, optimizer = self.accelerator.prepare(model if step is None else StepModule(model, step),
                                                        optimizer)
            self.replicated = L.world > 1
            if L.strategy == "dp" and self.devices_per_process > 1:
                # accelerate's autocast forward is bound to this module: replicas would all call it, on GPU 0's
                # weights. They run the class's forward, each in the job's precision (_ReplicaPrecision).
                model.__dict__.pop("forward", None)
                model = _ReplicaPrecision(model, AUTOCAST_DTYPES.get(self.runtime.mixed_precision))
        else:
            optimizer = self.accelerator.prepare(optimizer)
            model = model if step is None else StepModule(model, step)
        if compile_scope and not self.compiled:  # the whole training module
            note = " (its repeated blocks hold less than half of it)" if compile_scope == "blocks" and \
                repeated_blocks(users_model(model)) else ""
            model, self.compiled = torch.compile(model), "the whole model" + note
        return model, optimizer

    def place(self, model: nn.Module) -> nn.Module:
        """The model on this process's device for inference: whole, or this process's part of it (parallelize.py
        without an optimizer)."""
        if not self.layout.splits_model:
            return model.to(self.device)
        return parallelize(model, self, None)

    # -- a batch, a step ---------------------------------------------------------------------------------
    def forward_backward(self, model, x: torch.Tensor, y: Any, loss, weight: float, sync: bool) -> torch.Tensor:
        """A batch's forward and backward through the pipeline's schedule, its gradients weighted by `weight`."""
        BEAT.mark("forward and backward, pipelined")
        out = model.runner.train_batch(model, x, y, loss, weight, sync, self.accelerator.scaler,
                                       self.runtime.autocast)
        return out if out is not None else torch.zeros((), device=self.device)

    def no_sync(self, model: nn.Module, skip: bool):
        """Gradient synchronisation held for this backward (inside gradient accumulation), released again by the
        group's last."""
        if self.fully_shards:  # the reduce-scatter of gradients waits for the last micro-batch
            users_model(model).set_requires_gradient_sync(not skip)
        elif skip and self.replicated:
            return self.accelerator.no_sync(model)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before. An fp16
        loss scale is undone first."""
        self.accelerator.unscale_gradients()
        total, grads = self._grad_norm(model)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        parts = [local(g) for g in grads]
        if parts:
            torch._foreach_mul_(parts, coefficient.to(parts[0].device))
        return total

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The gradients' global L2 norm, as clipping takes it (every process calls it; fp32 gradients)."""
        return self._grad_norm(model)[0]

    def _grad_norm(self, model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the global L2 norm, this process's gradients). As torch's clip_grad_norm_ computes it on one process
        (the norm of the parameters' norms, in the whole model's order), each parameter's norm taken over all its
        parts: one reduction per placement of split gradients, and the stages' norms gathered in order."""
        params = list(users_model(model).parameters())
        order = getattr(users_model(model), "whole_index", None) or range(len(params))
        held = [(i, p.grad) for i, p in zip(order, params) if p.grad is not None]
        grads = [g for _, g in held]
        norms = parameter_norms(grads)
        if self.pipelined:  # every stage's norms, in the whole model's order
            every: list = [None] * self.layout.pp
            with BEAT.during("collective"):
                torch.distributed.all_gather_object(every, [(i, n.cpu()) for (i, _), n in zip(held, norms)],
                                                    group=self.group("pp"))
            norms = [n.to(self.device) for _, n in sorted((pair for stage in every for pair in stage),
                                                          key=lambda pair: pair[0])]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros((), device=self.device)
        return total, grads

    def sync_buffers(self, model: nn.Module) -> None:
        """Every process of a stage given the buffers (BatchNorm running statistics) of its first replica's first
        process: the ones saved."""
        if self.layout.world == 1:
            return
        src = self.layout.rank_of(replica=0, tp_rank=0)
        with BEAT.during("collective"):
            for buf in users_model(model).buffers():
                torch.distributed.broadcast(buf.data, src=src, group=self.stage_group)

    # -- what is written ---------------------------------------------------------------------------------
    def whole_tensors(self, model: nn.Module) -> WholeTensors | dict[str, torch.Tensor]:
        """The whole model's weights for a weights file, read tensor by tensor (runfolder.save_weights; every
        process calls it): on one process its state dict; else gathered from stages, shards and split layers."""
        return WholeTensors.gathered(self.runtime, users_model(model).state_dict())

    def scaler_state(self) -> dict | None:
        scaler = self.accelerator.scaler
        return scaler.state_dict() if scaler is not None else None

    def load_scaler_state(self, state: dict | None) -> None:
        if self.accelerator.scaler is not None and state is not None:
            self.accelerator.scaler.load_state_dict(state)

    def save(self, folder: Path, model: nn.Module, optimizer) -> dict[str, Any] | None:
        """Model and optimizer state into `folder` in the layout's format (saved.py); every process calls it.
        Returns what train.json records of the optimizer."""
        if self.layout.checkpoint_format == "whole":
            return save_whole(folder, model, optimizer, self.runtime.is_main)
        return save_sharded(folder, model, optimizer, self.fused)

    def load(self, folder: Path, model: nn.Module, optimizer, train: dict[str, Any]) -> None:
        """Read what `save` wrote on any layout (`train`: the checkpoint's train.json)."""
        recorded = train.get("optimizer") or {}
        if train.get("format") == "sharded":
            agree = lambda n: int(self.runtime.max(torch.tensor([n], device=self.device)).item())  # noqa: E731
            load_sharded(folder, model, optimizer, recorded, agree)
        else:
            load_whole(folder, model, optimizer, recorded)
        foreach_where_it_can(optimizer)  # (the checkpoint's groups say what its layout chose)

    def held_bytes(self, model: nn.Module, optimizer) -> dict[str, int]:
        """Bytes of parameters and optimizer state held by one process (its parts): the most held by any process.
        The optimizer's step counters are left out (scalars, kept on the CPU)."""
        state = [v for slots in inner_optimizer(optimizer).state.values() for k, v in slots.items()
                 if isinstance(v, torch.Tensor) and k != "step"]
        held = torch.tensor([sum(local(p).nbytes for p in model.parameters()), sum(local(t).nbytes for t in state)],
                            dtype=torch.float64, device=self.device)
        held = self.runtime.max(held)
        return {"parameters": int(held[0].item()), "optimizer_state": int(held[1].item())}


def parameter_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm over all its parts, in order: whole ones by torch's foreach norm (what
    clip_grad_norm_ takes), split ones (DTensors) by one reduction per mesh and placement."""
    whole = [i for i, g in enumerate(grads) if not hasattr(g, "to_local")]
    norms: list = [None] * len(grads)
    if whole:
        for i, n in zip(whole, torch._foreach_norm([grads[i] for i in whole], 2.0)):
            norms[i] = n
    by_placement: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if norms[i] is None:
            by_placement.setdefault((g.device_mesh, g.placements), []).append(i)
    with BEAT.during("collective"):
        for members in by_placement.values():  # each a DTensor partial over its split: summed in one reduction
            full = torch.stack([torch.linalg.vector_norm(grads[i], 2.0, dtype=torch.float32)
                                for i in members]).full_tensor()
            for i, n in zip(members, full):
                norms[i] = n
    return norms


def foreach_where_it_can(optimizer) -> None:
    """Torch's foreach kernels (its optimizers' default on GPUs) take a list of one kind of tensor only: a parameter
    group that mixes split parameters (DTensors) with whole ones steps them one by one; the others keep their
    choice. (The groups themselves stay as made: a learning-rate schedule and a checkpoint count them.)"""
    for group in inner_optimizer(optimizer).param_groups:
        kinds = {hasattr(p, "to_local") for p in group["params"]}
        if len(kinds) > 1 and "foreach" in group:
            group["foreach"] = False


class PartsGradScaler:
    """Made in place of accelerate's fp16 loss scaler where the model is split or sharded: torch's
    ShardedGradScaler (an overflow on any process skips the step on all), each gradient unscaled on this process's
    own part, so that split and whole gradients mix (a stage under --tp, one replica of --tp)."""

    def __new__(cls, device: str):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        class _Scaler(ShardedGradScaler):
            def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
                by_device: dict = {}
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for p in group["params"]:
                            if p.grad is not None:
                                g = local(p.grad)
                                by_device.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
                    infs = {}
                    for device, per_dtype in by_device.items():
                        infs[device] = found_inf.to(device) if device != found_inf.device else found_inf
                        for grads in per_dtype.values():
                            torch._amp_foreach_non_finite_check_and_unscale_(grads, infs[device],
                                                                             inv_scale.to(device))
                return infs or {found_inf.device: found_inf}

        return _Scaler(device=device)


def in_autocast(replica, device_type: str, dtype: torch.dtype):
    """`replica` called under autocast to `dtype`, whatever autocast the calling thread has."""
    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return replica(*args, **kwargs)
    return forward


class _ReplicaPrecision(torch.nn.DataParallel):
    """DataParallel whose replicas compute in the job's autocast dtype.

    torch runs each replica in a thread of its own and enters autocast there with the device's default dtype
    (fp16 on CUDA), so a bf16 job would compute in fp16, with no loss scaler; each replica enters the job's dtype.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None):
        super().__init__(module)
        self.autocast_dtype = dtype

    def parallel_apply(self, replicas, inputs, kwargs):
        if self.autocast_dtype is not None:
            replicas = [in_autocast(r, "cuda", self.autocast_dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)
