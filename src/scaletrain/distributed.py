"""Everything that touches accelerate and torch.distributed lives here and nowhere else.

`Runtime` wraps one `accelerate.Accelerator` and hands the rest of the package plain answers (rank, world size,
device, is_main) plus the few collectives it needs (sums, ordered gathers, barriers). `launch` starts N local
worker processes through torch's own launcher (torchrun's elastic agent) when scaletrain is asked to.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import UserError

# Variables that a launcher (torchrun, accelerate launch, scaletrain --nproc) sets in each worker.
_WORKER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'node[01-03,07],gpu5' -> 'node01'."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    prefix, ranges, suffix = m.groups() if m else (nodelist, None, "")
    if ranges:
        return prefix + ranges.split(",")[0].split("-")[0] + suffix
    return prefix + suffix


def adopt_slurm() -> bool:
    """Under `srun` with several tasks, give each task the variables torch's launcher would have set.

    Rank, world size and local rank come from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the master address
    is the first host of SLURM_JOB_NODELIST (or SLURM_NODELIST) and the port is derived from the job id, unless
    MASTER_ADDR / MASTER_PORT are set already. Nothing changes when a launcher ran inside the allocation.
    """
    env = os.environ
    if "SLURM_PROCID" not in env or all(k in env for k in _WORKER_ENV) or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000))
    return True


def launched_world_size() -> int | None:
    """The world size a launcher gave this process, or None when it was started directly."""
    if all(k in os.environ for k in _WORKER_ENV):
        return int(os.environ["WORLD_SIZE"])
    return None


def backends_available() -> list[str]:
    """The torch.distributed backends this build of torch has."""
    if not torch.distributed.is_available():
        return []
    return [name for name in ("gloo", "nccl", "mpi") if getattr(torch.distributed, f"is_{name}_available")()]


def mps_available() -> bool:
    """Whether torch sees Apple's MPS device."""
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def available_gpus(cpu: bool) -> int:
    return 0 if cpu else torch.cuda.device_count()


def resolve_nproc(requested: int | None, cpu: bool) -> int:
    """Processes to start for `--nproc`: None ('auto') is one per GPU, 1 on CPU."""
    gpus = available_gpus(cpu)
    if requested is None:
        return max(gpus, 1)
    if gpus and requested > gpus:
        raise UserError(f"--nproc {requested} asks for more processes than the {gpus} GPU(s) present")
    return requested


class CpuSyncBatchNorm2d(torch.nn.BatchNorm2d):
    """BatchNorm2d whose training statistics span all processes, for gloo on the CPU.

    torch's SyncBatchNorm is refused by DistributedDataParallel on CPU modules. This computes the same thing:
    per-channel sums, sums of squares and counts are all-reduced with an autograd-aware all-reduce, so the
    gradient also flows through the global statistics, exactly as one process with the whole batch would see.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        with warnings.catch_warnings():  # its deprecation points to an API without autograd support yet
            warnings.simplefilter("ignore", FutureWarning)
            from torch.distributed.nn.functional import all_reduce

        c = x.shape[1]
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                           x.new_full((1,), x.numel() / c)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            total = all_reduce(local)
        count = total[-1]
        mean = total[:c] / count
        var = total[c:2 * c] / count - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 0.1
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * count / (count - 1).clamp_min(1), alpha=m)
                self.num_batches_tracked.add_(1)
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y


def convert_cpu_sync_bn(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every BatchNorm2d by CpuSyncBatchNorm2d, keeping the very same parameter and buffer tensors (an
    optimizer made before the conversion still updates them)."""
    if type(module) is torch.nn.BatchNorm2d:
        new = CpuSyncBatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        for name, p in module.named_parameters(recurse=False):
            setattr(new, name, p)
        for name, b in module.named_buffers(recurse=False):
            setattr(new, name, b)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_cpu_sync_bn(child))
    return module


def _holds_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def block_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, innermost last: what FSDP shards as units and activation checkpointing wraps.

    A block is an element of an nn.Sequential or nn.ModuleList holding at least two elements with parameters:
    timm's ResNet bottlenecks, ConvNeXt stages and their blocks, ViT blocks. When no such element has
    sub-modules (a plain stack of layers, like the built-in CNNs), the parameterised layers of the stack are
    the blocks.
    """
    composite, layers = [], []
    for container in model.modules():
        if not isinstance(container, (torch.nn.Sequential, torch.nn.ModuleList)):
            continue
        elements = [m for m in container if _holds_parameters(m)]
        if len(elements) < 2:
            continue
        for m in elements:
            (composite if any(True for _ in m.children()) else layers).append(m)
    return composite or layers


def keeps_fp32_parameters(unit: torch.nn.Module) -> bool:
    """Whether an FSDP unit computes with fp32 parameters under mixed precision: when it holds BatchNorm, whose
    kernels expect fp32 weights beside fp32 running statistics."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in unit.modules())


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Keep only each innermost block's input and recompute the rest of its activations in the backward pass
    (per block, as is usual for transformers and ResNets); returns how many blocks (none for a plain stack of
    layers, such as the built-in CNNs). Parameter names do not change, so weights and checkpoints stay
    interchangeable."""
    from torch.distributed._composable import checkpoint

    blocks = [b for b in block_units(model) if any(True for _ in b.children())]  # single layers gain nothing
    ids = {id(b) for b in blocks}
    innermost = [b for b in blocks if not any(id(m) in ids for m in b.modules() if m is not b)]
    for block in innermost:
        checkpoint(block)
        for m in block.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.register_forward_pre_hook(_freeze_running_stats_when_recomputed)
    return len(innermost)


_NOT_FROZEN = object()


def _freeze_running_stats_when_recomputed(bn: torch.nn.Module, args) -> None:
    """Let a BatchNorm that the backward pass runs again (recomputation) leave its running statistics alone:
    the real forward updated them once. Momentum 0 keeps them exactly and the step counter is taken back by the
    one its forward adds; the momentum returns at the next forward. (No post-hook: torch may stop a
    recomputation in the middle of a layer once it has what the backward needs.)"""
    momentum = bn.__dict__.pop("_scaletrain_momentum", _NOT_FROZEN)
    if momentum is not _NOT_FROZEN:
        bn.momentum = momentum
    if bn.training and torch._C._current_graph_task_id() != -1:
        bn._scaletrain_momentum, bn.momentum = bn.momentum, 0.0
        bn.num_batches_tracked.sub_(1)


@dataclass
class Nodes:
    """The machines of a job: how many, this one's rank among them, and where their workers meet."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def launcher_args(self) -> list[str]:
        if self.count == 1:
            return ["--standalone"]
        return [f"--nnodes={self.count}", f"--node-rank={self.rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def launch(nproc: int, argv: Sequence[str], max_restarts: int = 0, nodes: Nodes | None = None) -> int:
    """Run `python -m scaletrain *argv` in `nproc` workers on this machine through torch's elastic launcher
    (one of `nodes.count` machines, each running the same command with its own `nodes.rank`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # One thread per process per core share; set here so the launcher does not warn and pick 1 by itself.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = parse_args([*(nodes or Nodes()).launcher_args(), f"--nproc-per-node={nproc}",
                       f"--max-restarts={max_restarts}", "--module", "scaletrain"])
    args.training_script_args = list(argv)  # set after parsing: the launcher's parser would claim our flags
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run(args)
    except SignalException as e:  # the launcher was told to stop; its workers got the signal and checkpointed
        print(f"scaletrain: launcher received {e.sigval.name}; workers were asked to checkpoint and stop",
              file=sys.stderr)
        return 75
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"scaletrain: worker rank {rank} failed with exit code {failure.exitcode}; "
              f"the message above comes from it", file=sys.stderr)
        return code
    return 0


def _init_after_restart(backend: str, timeout: datetime.timedelta) -> None:
    """Join the process group under a key prefix of its own when torch's launcher has restarted the workers.

    The launcher keeps one key-value store across restarts, so workers of a new round can read the addresses
    the failed round left there and fail to connect ("Connection refused"). A prefix per restart round keeps
    the rounds apart; accelerate then finds the group already formed and uses it.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or (launched_world_size() or 1) == 1 or torch.distributed.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store, rank, world = next(torch.distributed.rendezvous("env://", timeout=timeout))
    store = torch.distributed.PrefixStore(f"scaletrain/restart_{restart}", store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


class Runtime:
    """One process's view of the job: device, rank, precision and the collectives the engine uses."""

    def __init__(self, mixed_precision: str = "no", cpu: bool = False, timeout_seconds: float = 1800.0,
                 strategy: str = "ddp", deterministic: bool = False):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        if mixed_precision == "fp16" and available_gpus(cpu) == 0:
            raise UserError("--mixed-precision fp16 needs a GPU; on the CPU use bf16 or no")
        if strategy == "dp" and (launched_world_size() or 1) > 1:
            raise UserError("--strategy dp runs one process that drives every visible GPU; launch it alone")
        self.strategy = strategy
        self._was_deterministic = torch.are_deterministic_algorithms_enabled()
        if deterministic:
            # cuBLAS reduces in a fixed order only with a fixed workspace, read at its first use in this process.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.checkpointed_blocks = 0  # blocks whose activations are recomputed (--activation-checkpointing)
        # accelerate only forms a CPU process group when told it runs on the CPU; gloo is the CPU backend.
        # Otherwise accelerate picks the device: CUDA, or Apple's MPS.
        cpu = cpu or (available_gpus(cpu) == 0 and not mps_available())
        handlers = [
            InitProcessGroupKwargs(backend="gloo" if cpu and (launched_world_size() or 1) > 1 else None,
                                   timeout=datetime.timedelta(seconds=timeout_seconds)),
            # No buffer broadcast before every forward: BatchNorm statistics stay per rank while training (as
            # on one GPU) and are made equal once per epoch by `sync_buffers`, before evaluation and saving.
            DistributedDataParallelKwargs(broadcast_buffers=False),
        ]
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*is deprecated", category=FutureWarning)
        _init_after_restart("gloo" if cpu else "nccl", datetime.timedelta(seconds=timeout_seconds))
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers)
        self.mixed_precision = mixed_precision

    # -- who and where -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def devices_per_process(self) -> int:
        """Model replicas each process drives: every visible GPU under DataParallel, else one."""
        if self.strategy == "dp" and self.device.type == "cuda":
            return torch.cuda.device_count()
        return 1

    @property
    def devices(self) -> int:
        """Data-parallel replicas in the whole job."""
        return self.world_size * self.devices_per_process

    def seed(self, seed: int) -> None:
        """Seed Python, NumPy and torch (all devices) in this process."""
        from accelerate.utils import set_seed

        set_seed(seed)

    @property
    def sharded(self) -> bool:
        """Whether parameters, gradients and optimizer state are split across the processes (fsdp on 2 or more)."""
        return self.strategy == "fsdp" and self.world_size > 1

    # -- model wrapping ------------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, make_optimizer, sync_bn: bool = False,
                activation_checkpointing: bool = False):
        """Make `model` ready for training and its optimizer (`make_optimizer(model)`), in this order: SyncBN,
        activation checkpointing, then sharding (fsdp) or moving to the device, the optimizer over the parameters
        that result (FSDP replaces them with shards), and last the DDP or DataParallel wrapper."""
        if sync_bn and self.world_size > 1:
            if self.device.type == "cpu":
                model = convert_cpu_sync_bn(model)
            else:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.checkpointed_blocks = apply_activation_checkpointing(model) if activation_checkpointing else 0
        if self.strategy == "fsdp":
            model = self.place(model)
            if self.sharded and self.accelerator.scaler is not None:
                # fp16: an overflow in one rank's gradient shard must make every rank skip the step, so the
                # loss scaler reduces its inf/NaN check over the processes.
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.accelerator.scaler = ShardedGradScaler(device=self.device.type)
            return model, self.accelerator.prepare(make_optimizer(model))
        model, optimizer = self.accelerator.prepare(model, make_optimizer(model))
        if self.devices_per_process > 1:  # DataParallel: each forward scatters the batch over the GPUs
            # accelerate's autocast forward is bound to this module: replicas would all call it, on GPU 0's
            # weights. They run the class's forward, each in the job's precision (_ReplicaPrecision).
            model.__dict__.pop("forward", None)
            model = _ReplicaPrecision(model, AUTOCAST_DTYPES.get(self.mixed_precision))
        return model, optimizer

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to this process's device; under fsdp on several processes, keep only this rank's shard.

        Each block (`block_units`) becomes one FSDP unit, gathered just before its forward and backward and
        freed after; the root holds the rest (stem, head) and stays gathered from forward to backward. With
        mixed precision, blocks compute with bf16/fp16 parameters and reduce gradients in fp32; blocks holding
        BatchNorm keep fp32 parameters (autocast still runs their convolutions in low precision).
        """
        model = model.to(self.device)
        if not self.sharded:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP shards contiguous parameters only; channels_last inputs still pick channels_last convolutions.
        model = model.to(memory_format=torch.contiguous_format)
        low = AUTOCAST_DTYPES.get(self.mixed_precision)

        def policy(module: torch.nn.Module) -> MixedPrecisionPolicy:
            return MixedPrecisionPolicy(param_dtype=None if keeps_fp32_parameters(module) else low,
                                        reduce_dtype=torch.float32)

        for unit in reversed(block_units(model)):  # inner blocks before the blocks that hold them
            fully_shard(unit, mp_policy=policy(unit))
        fully_shard(model, mp_policy=policy(model), reshard_after_forward=False)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights for a weights file. Under fsdp the shards are gathered onto the CPU of the
        main process (the others get an empty dict), so every process must call it."""
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_sharded(self, path, model: torch.nn.Module, optimizer) -> None:
        """Write model and optimizer state with torch.distributed.checkpoint: each process writes its own shard
        (a DDP or single-process model writes whole tensors), readable on any number of processes."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, _inner_optimizer(optimizer))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process" without a group
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))

    def load_sharded(self, path, model: torch.nn.Module, optimizer) -> None:
        """Read what `save_sharded` wrote, resharded for this job's processes."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        inner = _inner_optimizer(optimizer)
        model_state, optim_state = get_state_dict(model, inner)
        state = {"model": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model)

    def autocast(self):
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def no_sync(self, model: torch.nn.Module, skip: bool):
        """Skip the gradient all-reduce (reduce-scatter under fsdp) for this backward, inside gradient
        accumulation."""
        if self.sharded:
            model.set_requires_gradient_sync(not skip)
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model) if skip and self.world_size > 1 else contextlib.nullcontext()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self.accelerator.optimizer_step_was_skipped

    # -- collectives ---------------------------------------------------------------------------------------
    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over all processes (every process gets the result)."""
        if self.world_size == 1:
            return values
        return self.accelerator.reduce(values.clone(), reduction="sum")

    def gather_strided(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """Reassemble per-sample results computed on strided shards (rank r owns items r, r+W, ...).

        Shards differ in length by at most one, so each is padded to the longest before the all-gather and
        the padding is cut off afterwards: the result has exactly `total` rows, in input order.
        """
        world = self.world_size
        if world == 1:
            return local
        longest = -(-total // world)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: len(local)] = local
        gathered = self.accelerator.gather(padded.contiguous())  # (world * longest, ...), rank-major
        interleaved = gathered.reshape(world, longest, *local.shape[1:]).transpose(0, 1)
        return interleaved.reshape(world * longest, *local.shape[1:])[:total]

    def held_bytes(self, model: torch.nn.Module, optimizer) -> dict[str, int]:
        """Bytes of parameters and optimizer state held by one process (its shards under fsdp): the most held by
        any process. The optimizer's step counters are left out (scalars, kept on the CPU)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard

        optimizer_state = [v for slots in _inner_optimizer(optimizer).state.values() for k, v in slots.items()
                           if isinstance(v, torch.Tensor) and k != "step"]
        held = torch.tensor([sum(local(p).nbytes for p in model.parameters()),
                             sum(local(t).nbytes for t in optimizer_state)], dtype=torch.float64,
                            device=self.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
        return {"parameters": int(held[0].item()), "optimizer_state": int(held[1].item())}

    def sync_buffers(self, model: torch.nn.Module) -> None:
        """Give every rank the main process's buffers (BatchNorm running statistics).

        Each rank updates its running statistics from its own batches, so after training they differ slightly;
        the main process's are the ones saved, so every rank evaluates with those.
        """
        if self.world_size == 1:
            return
        from accelerate.utils import broadcast

        for buf in model.buffers():
            buf.copy_(broadcast(buf.detach().clone(), from_process=0))

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def end(self) -> None:
        """Leave no process group or accelerate state behind (a notebook may start another run)."""
        from accelerate.state import AcceleratorState

        self.accelerator.end_training()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.use_deterministic_algorithms(self._was_deterministic)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


def _inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def measure_allreduce_gbps(nbytes: int, repeats: int = 10) -> float:
    """Bus bandwidth (GB/s, as nccl-tests reports it: 2(N-1)/N x bytes / time) of an all-reduce of `nbytes`
    between this machine's GPUs, or between 2 CPU processes over gloo when there is no GPU.

    Runs in fresh processes through torch's launcher; the median of `repeats` timed all-reduces counts.
    """
    import subprocess
    import tempfile

    gpus = torch.cuda.device_count()
    if gpus == 1:
        raise UserError("--interconnect measure: one GPU has no link to measure; give a preset or a GB/s figure")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gbps")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={max(gpus, 2)}",
               "-m", "scaletrain.distributed", "allreduce-probe", str(nbytes), str(repeats), out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if proc.returncode != 0 or not os.path.exists(out):
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise UserError(f"--interconnect measure: the all-reduce probe failed ({last[:160]})")
        with open(out) as f:
            return float(f.read())


def _allreduce_probe(nbytes: int, repeats: int, out: str) -> None:
    import statistics
    import time

    runtime = Runtime(cpu=torch.cuda.device_count() == 0)
    try:
        x = torch.ones(max(1, nbytes // 4), device=runtime.device)
        seconds = []
        for _ in range(repeats + 2):  # the first two set up connections and buffers
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.distributed.all_reduce(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        world = runtime.world_size
        gbps = 2 * (world - 1) / world * x.numel() * 4 / statistics.median(seconds[2:]) / 1e9
        if runtime.is_main:
            with open(out, "w") as f:
                f.write(repr(gbps))
    finally:
        runtime.end()


if __name__ == "__main__" and sys.argv[1:2] == ["allreduce-probe"]:
    _allreduce_probe(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
