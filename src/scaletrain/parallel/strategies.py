"""Data-parallel strategies: one object per `--strategy`, each owning how the model is wrapped, how gradient
synchronisation is skipped inside accumulation, the whole model's state dict, checkpoint I/O of model and
optimizer, and the loss scaler.

- ddp: one process per device, DistributedDataParallel through accelerate;
- dp: one process driving every visible GPU, torch.nn.DataParallel (replicas in threads);
- fsdp: one process per device, parameters, gradients and optimizer state sharded (torch's fully_shard).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .blocks import block_units, keeps_fp32_parameters
from .heads import fused_names, viewed
from .materialise import (Blueprint, Broadcast, WeightsFile, build_on_meta, checked_module, completed, fill, on_meta,
                          start_from)
from .watch import BEAT
from .whole import WholeTensors

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (for safetensors) and plain data (for JSON)."""
    tensors, plain = {}, {"param_groups": state["param_groups"], "state": {}}
    for idx, slots in state["state"].items():
        plain["state"][str(idx)] = {}
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
                plain["state"][str(idx)][name] = {"tensor": f"{idx}.{name}"}
            else:
                plain["state"][str(idx)][name] = value
    return tensors, plain


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    state = {}
    for idx, slots in plain["state"].items():
        state[int(idx)] = {name: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
                           for name, v in slots.items()}
    return {"state": state, "param_groups": plain["param_groups"]}


class StepModule(torch.nn.Module):
    """A module whose forward is one training step of the user's, `step(model, batch)`: DDP wraps it, so every call
    of the model inside the step (two views, a teacher and a student's heads, a detector's losses) is one forward,
    reduced once in the backward. It holds the model and nothing else (the step's own modules, a frozen teacher,
    stay outside DDP)."""

    def __init__(self, model: torch.nn.Module, step):
        super().__init__()
        self.model = model
        object.__setattr__(self, "step", step)  # not a submodule

    def forward(self, batch):
        return self.step(self.model, batch)


def clip_to_norm(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grads_with_norm_ arithmetic on each gradient's own part (a shard's, a split layer's local
    tensor), `total` being the norm over every process's gradients; returns `total`."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:
        torch._foreach_mul_(local, coefficient.to(local[0].device))
    return total


@torch.no_grad()
def broadcast_tensors(module: torch.nn.Module, src: int, group=None) -> None:
    """Every parameter and buffer of `module` (each process's own part of a split one) made `src`'s, over `group`
    (None: every process), as DistributedDataParallel's constructor does: a model built without a seed differs
    per process."""
    with BEAT.during("collective"):
        for t in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(t.to_local() if hasattr(t, "to_local") else t.data, src=src, group=group)


def users_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a StepModule (the module itself otherwise)."""
    return model.model if isinstance(model, StepModule) else model


class DDP:
    """One process per device; every process holds the whole model (DistributedDataParallel on 2 or more)."""

    name = "ddp"
    sharded = False  # whether each process holds only a shard of parameters and optimizer state
    forward_collective = False  # whether every process must take part in each forward (fsdp's gathers)
    fuses_forward_backward = False  # whether a batch's forward and backward are one call (`forward_backward`)
    checkpoint_format = "whole"  # model.safetensors + optimizer.safetensors, written by the main process

    def __init__(self, runtime, init_from: str = ""):
        self.runtime = runtime
        self.init_from = init_from  # --init-from: the whole model's weights file training starts from
        self._pretrained: WeightsFile | None = None  # --pretrained's matching tensors, until the model is placed

    @classmethod
    def splits(cls, processes: int) -> bool:
        """Whether each of `processes` processes holds only a part of the model (a shard, a stage), so that the
        checkpoints are sharded (read before any process starts)."""
        return False

    @property
    def builds_on_meta(self) -> bool:
        """Whether a model built here (by name, or by a function given to `fit`) is built on the meta device and
        materialised part by part: where the strategy splits the model."""
        return False

    @property
    def accelerator(self):
        return self.runtime.accelerator

    @property
    def devices_per_process(self) -> int:
        return 1

    # -- the data's shards: one per process (a pipeline's stages share theirs) ---------------------------------
    @property
    def replicas(self) -> int:
        return self.runtime.world_size

    @property
    def replica(self) -> int:
        return self.runtime.rank

    @property
    def holds_outputs(self) -> bool:
        """Whether this process's model gives the outputs that validation scores (not a pipeline's early stage)."""
        return True

    @property
    def random_rank(self) -> int:
        """The rank this process's random draws (dropout, after a resume) are seeded with: its own, except where
        processes must draw alike (a tensor-parallel replica's)."""
        return self.runtime.rank

    @property
    def reads_inputs(self) -> bool:
        """Whether this process's model reads the batches' inputs (not a pipeline's later stages)."""
        return True

    # -- model -------------------------------------------------------------------------------------------
    def build(self, factory, where: str = "model") -> torch.nn.Module:
        """The model `factory()` returns: built whole, or on the meta device (with its Blueprint) where the
        strategy splits it, each process later materialising only its part (materialise.py)."""
        return build_on_meta(factory, where) if self.builds_on_meta else checked_module(factory(), where)

    def pretrained_from(self, path: str, model: torch.nn.Module) -> list[str]:
        """--pretrained FILE (.safetensors) for a model still on the meta device: its tensors whose names and shapes
        match the model's are what each process's part starts from, read tensor by tensor when it is materialised
        (the rest as the model makes them); one line per tensor not loaded, as models.load_matching says them."""
        weights = self.agreed(lambda: WeightsFile(path, "--pretrained"))
        self._pretrained = weights
        return weights.match(model)

    def initial_weights(self, model: torch.nn.Module) -> WeightsFile | None:
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

    def start_from(self, model: torch.nn.Module, initial: WeightsFile | None) -> torch.nn.Module:
        """`model` (or this process's part of it) on the device with the weights training starts from."""
        return self.agreed(lambda: start_from(model, self.runtime.device, initial))

    def shard_source(self, model: torch.nn.Module, blueprint: Blueprint, initial: WeightsFile | None, rank: int,
                     world: int, group=None, ranks: list[int] | None = None):
        """Where fsdp shards still on the meta device (of the whole model, or of a pipeline stage sharded over its
        `world` replicas) are filled from, row by row: --init-from's file (completed by the replay), else each
        parameter replayed by its owner and broadcast (materialise.Broadcast); agreed by every process."""
        if initial is None:
            return self.agreed(lambda: Broadcast(model, blueprint, rank, world, self.runtime.device, group, ranks))
        return self.agreed(lambda: completed(initial, blueprint, model))

    def materialised(self, model: torch.nn.Module, initial: WeightsFile | None, rank: int, world: int, group=None,
                     ranks: list[int] | None = None) -> torch.nn.Module:
        """`model`, sharded or split while on the meta device, materialised on this process's device with each
        part filled from `shard_source` (its arguments), tensor by tensor: a collective."""
        source = self.shard_source(model, Blueprint.of(model), initial, rank, world, group, ranks)
        model.to_empty(device=self.runtime.device)
        with BEAT.during("collective"):
            fill(model, source, every=True)
        return model

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
            failed = self.runtime.sum(torch.tensor([float(failed)], device=self.runtime.device)).item() > 0
        if error is not None:
            raise error
        if failed:
            raise UserError("another process refused the model (its line above says why)", quiet=True)
        return result

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this process's device, for inference."""
        return model.to(self.runtime.device)

    def wrap(self, model: torch.nn.Module, make_optimizer, step=None):
        """The model ready to train and its optimizer over the parameters that result; with a user's `step`, the
        module whose forward is the step (StepModule) is what trains."""
        model = self.start_from(model, self.initial_weights(model))
        optimizer = make_optimizer(model)
        return self.accelerator.prepare(model if step is None else StepModule(model, step), optimizer)

    def check_data(self, train_data, val_data) -> None:
        """Refuse, before anything trains, data this strategy cannot read (a pipeline's streams); here nothing."""

    def check_model(self, model: torch.nn.Module, batches, step=None) -> None:
        """Refuse, before anything trains, a model this strategy cannot train (a pipeline's check); here nothing."""

    def forward_backward(self, model, x, y, loss, weight: float, sync: bool) -> torch.Tensor:
        """A batch's forward and backward in one call, for a strategy whose `fuses_forward_backward` (a
        pipeline's); the others run the model's forward, then the backward."""
        raise NotImplementedError

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def sync_buffers(self, model: torch.nn.Module) -> None:
        """Give every process the main process's buffers (BatchNorm running statistics)."""
        from accelerate.utils import broadcast

        for buf in model.buffers():
            buf.copy_(broadcast(buf.detach().clone(), from_process=0))

    def no_sync(self, model: torch.nn.Module, skip: bool):
        """Skip the gradient all-reduce for this backward (inside gradient accumulation)."""
        if skip and self.runtime.world_size > 1:
            return self.accelerator.no_sync(model)
        return contextlib.nullcontext()

    def whole_tensors(self, model: torch.nn.Module) -> WholeTensors | dict[str, torch.Tensor]:
        """The whole model's weights for a weights file, read tensor by tensor (runfolder.save_weights; every
        process calls it): here the main process's own state dict."""
        return model.state_dict()

    # -- loss scaler (fp16) ------------------------------------------------------------------------------
    def scaler_state(self) -> dict | None:
        scaler = self.accelerator.scaler
        return scaler.state_dict() if scaler is not None else None

    def load_scaler_state(self, state: dict | None) -> None:
        if self.accelerator.scaler is not None and state is not None:
            self.accelerator.scaler.load_state_dict(state)

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, folder: Path, model: torch.nn.Module, optimizer) -> dict[str, Any] | None:
        """Write model and optimizer state into `folder`; every process calls it. Returns what train.json
        records beside the files (the optimizer's non-tensor state)."""
        from safetensors.torch import save_file

        if not self.runtime.is_main:
            return None
        weights = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(weights, str(folder / "model.safetensors"))
        tensors, plain = _flatten_optimizer(optimizer.state_dict())
        save_file(tensors, str(folder / "optimizer.safetensors"))
        return plain

    def load(self, folder: Path, model: torch.nn.Module, optimizer, train: dict[str, Any]) -> None:
        """Read what `save` wrote (`train`: the checkpoint's train.json)."""
        from safetensors.torch import load_file

        if train.get("format") == "sharded":  # torch.distributed.checkpoint's files read on any strategy
            return _load_sharded(folder, model, optimizer, flat=_flat(train), fused=_fused(train))
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        optimizer.load_state_dict(_unflatten_optimizer(load_file(str(folder / "optimizer.safetensors")),
                                                       train["optimizer"]))

    # -- what a process holds ----------------------------------------------------------------------------
    def held_bytes(self, model: torch.nn.Module, optimizer) -> dict[str, int]:
        """Bytes of parameters and optimizer state held by one process (its shards under fsdp): the most held by
        any process. The optimizer's step counters are left out (scalars, kept on the CPU)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard

        optimizer_state = [v for slots in inner_optimizer(optimizer).state.values() for k, v in slots.items()
                           if isinstance(v, torch.Tensor) and k != "step"]
        held = torch.tensor([sum(local(p).nbytes for p in model.parameters()),
                             sum(local(t).nbytes for t in optimizer_state)], dtype=torch.float64,
                            device=self.runtime.device)
        held = self.runtime.max(held)
        return {"parameters": int(held[0].item()), "optimizer_state": int(held[1].item())}


class DP(DDP):
    """One process driving every visible GPU with torch.nn.DataParallel: each forward scatters the batch."""

    name = "dp"

    @property
    def devices_per_process(self) -> int:
        return torch.cuda.device_count() if self.runtime.device.type == "cuda" else 1

    def wrap(self, model: torch.nn.Module, make_optimizer, step=None):
        if step is not None:
            raise UserError("--strategy dp splits each batch of inputs over the GPUs; a Step of your own takes its "
                            "batch whole: train it with --strategy ddp (one process per GPU)")
        model, optimizer = self.accelerator.prepare(model, make_optimizer(model))
        if self.devices_per_process > 1:
            # accelerate's autocast forward is bound to this module: replicas would all call it, on GPU 0's
            # weights. They run the class's forward, each in the job's precision (_ReplicaPrecision).
            model.__dict__.pop("forward", None)
            model = _ReplicaPrecision(model, AUTOCAST_DTYPES.get(self.runtime.mixed_precision))
        return model, optimizer


class FSDP(DDP):
    """One process per device; under 2 or more, each holds a shard of parameters, gradients and optimizer state
    and gathers one block at a time."""

    name = "fsdp"
    checkpoint_format = "sharded"  # sharded/, written by every process with torch.distributed.checkpoint

    @classmethod
    def splits(cls, processes: int) -> bool:
        return processes > 1

    @property
    def sharded(self) -> bool:  # type: ignore[override]
        return self.runtime.world_size > 1

    @property
    def forward_collective(self) -> bool:  # type: ignore[override]
        return self.sharded

    @property
    def builds_on_meta(self) -> bool:  # type: ignore[override]
        return self.sharded

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._sharded(model, None)

    def _sharded(self, model: torch.nn.Module, initial: WeightsFile | None) -> torch.nn.Module:
        """Move the model to this process's device; on several processes, keep only this rank's shard. A model
        still on the meta device is sharded there and only the shards are materialised: each filled, row by row,
        from --init-from's file or from the replayed constructor (materialise.Broadcast), so no process ever
        holds the model whole.

        Each block (`block_units`) becomes one FSDP unit, gathered just before its forward and backward and
        freed after; the root holds the rest (stem, head) and stays gathered from forward to backward. With
        mixed precision, blocks compute with bf16/fp16 parameters and reduce gradients in fp32; blocks holding
        BatchNorm keep fp32 parameters (autocast still runs their convolutions in low precision).
        """
        meta = on_meta(model)
        if not meta:
            model = self.start_from(model, initial)
        if not self.sharded:
            return model
        # FSDP shards contiguous parameters only; channels_last inputs still pick channels_last convolutions.
        model = model.to(memory_format=torch.contiguous_format)
        shard_blocks([model], None, self.runtime.mixed_precision)
        if meta:
            self.materialised(model, initial, self.runtime.rank, self.runtime.world_size)
            if self.runtime.is_main:
                print(f"fsdp over {self.runtime.world_size} processes: built on the meta device, each process "
                      f"materialised only its shards" + (f", from {self.init_from}" if self.init_from else ""),
                      flush=True)
        return model

    def wrap(self, model: torch.nn.Module, make_optimizer, step=None):
        model = self._sharded(model, self.initial_weights(model))
        if self.sharded and self.accelerator.scaler is not None:
            # fp16: an overflow in one rank's gradient shard must make every rank skip the step, so the loss
            # scaler reduces its inf/NaN check over the processes.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.accelerator.scaler = ShardedGradScaler(device=self.runtime.device.type)
        optimizer = self.accelerator.prepare(make_optimizer(model))
        return (model if step is None else StepModule(model, step)), optimizer  # the root sharded, not around it

    @property
    def fully_sharded(self) -> bool:
        """Whether torch's fully_shard wraps the model (and so reduces its gradients)."""
        return self.sharded

    def no_sync(self, model: torch.nn.Module, skip: bool):
        if self.fully_sharded:  # the reduce-scatter of gradients waits for the last micro-batch
            users_model(model).set_requires_gradient_sync(not skip)
            return contextlib.nullcontext()
        return super().no_sync(model, skip)

    def whole_tensors(self, model: torch.nn.Module) -> WholeTensors | dict[str, torch.Tensor]:
        """Gathered from the shards onto the CPU of the main process, tensor by tensor."""
        return WholeTensors.gathered(self.runtime, model.state_dict()) if self.sharded else model.state_dict()

    def save(self, folder: Path, model: torch.nn.Module, optimizer) -> None:
        """Each process writes its own shard with torch.distributed.checkpoint (a single process writes whole
        tensors), readable on any number of processes."""
        _save_sharded(folder, model, optimizer)

    def load(self, folder: Path, model: torch.nn.Module, optimizer, train: dict[str, Any]) -> None:
        """Read what `save` wrote, resharded for this job's processes."""
        _load_sharded(folder, model, optimizer, flat=_flat(train), fused=_fused(train))


def shard_blocks(roots: list[torch.nn.Module], mesh, mixed_precision: str, placement=None) -> None:
    """torch's fully_shard over `mesh` (None: every process) applied to each root's blocks (`block_units`), inner
    blocks first, then to the root, which stays gathered from forward to backward. With mixed precision, blocks
    compute with bf16/fp16 parameters and reduce gradients in fp32; blocks holding BatchNorm keep fp32
    parameters. `placement(parameter)`: the dimension a parameter is sharded on (fully_shard's
    shard_placement_fn; None: the first)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = AUTOCAST_DTYPES.get(mixed_precision)
    placed = {"shard_placement_fn": placement} if placement is not None else {}

    def policy(module: torch.nn.Module) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=None if keeps_fp32_parameters(module) else low,
                                    reduce_dtype=torch.float32)

    for root in roots:
        for unit in reversed(block_units(root)):  # inner blocks before the blocks that hold them
            fully_shard(unit, mesh=mesh, mp_policy=policy(unit), **placed)
        fully_shard(root, mesh=mesh, mp_policy=policy(root), reshard_after_forward=False, **placed)


def _flat(train: dict[str, Any]) -> bool:
    """Whether a sharded checkpoint keys its optimizer state by parameter name, step hyperparameters included (a
    pipeline's: each stage's optimizer holds other parameters)."""
    return bool((train.get("optimizer") or {}).get("flat"))


def _fused(train: dict[str, Any]) -> list[str]:
    """The tensors a sharded checkpoint holds as (3, rows / 3, ...): q, k and v split by heads (heads.py)."""
    return list((train.get("optimizer") or {}).get("fused", []))


def _state_dicts(model: torch.nn.Module, optimizer, flat: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, inner_optimizer(optimizer),
                          options=StateDictOptions(flatten_optimizer_state_dict=flat))


def _save_sharded(folder: Path, model: torch.nn.Module, optimizer, flat: bool = False) -> list[str]:
    """The model's tensors split by heads are written through their checkpoint views (heads.py); returns their
    names."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _state_dicts(model, optimizer, flat)
    fused = fused_names(model)
    with viewed(model_state, optim_state, fused, fused, flat).swapped(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process" without a group
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "sharded"))
    return fused


def _load_sharded(folder: Path, model: torch.nn.Module, optimizer, flat: bool = False, fused=()) -> None:
    """`fused`: the tensors the checkpoint holds through their views (heads.py), read into this layout's, whose
    own tensors split by heads are read whole from a checkpoint that holds them unsplit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state, optim_state = _state_dicts(model, optimizer, flat)
    state = {"model": model_state, "optimizer": optim_state}
    with viewed(model_state, optim_state, fused, fused_names(model), flat).swapped(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder / "sharded"))
    set_state_dict(model, inner_optimizer(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=StateDictOptions(flatten_optimizer_state_dict=flat))


STRATEGIES = {s.name: s for s in (DDP, DP, FSDP)}


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
