"""One process's view of a job: who it is (rank, world size, device), its place in the layout (layout.py), its
precision, and the few collectives the training and inference code need. Built on one `accelerate.Accelerator`;
the model work (parallelizing it, a batch through it, clipping, whole tensors, checkpoint I/O) belongs to the
Engine it holds (engine.py), which these methods are the seam to: the training and inference code never see it."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .blocks import apply_activation_checkpointing
from .engine import Engine, StepModule, users_model
from .parallelize import broadcast_tensors
from .launch import available_gpus, exit_with_launcher, launched_world_size, mps_available
from .layout import Layout
from .syncbn import convert_sync_bn
from .threads import fit_threads
from .watch import BEAT, RankFailed, Watch, one_line


def _init_after_restart(backend: str, timeout: datetime.timedelta) -> None:
    """Join the process group under a key prefix of its own when torch's launcher has restarted the workers.

    The launcher keeps one key-value store across restarts, so workers of a new round can read the addresses
    the failed round left there and fail to connect ("Connection refused"). A prefix per restart round keeps
    the rounds apart; accelerate then finds the group already formed and uses it. Where each round has a store of
    its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, what elastic membership needs: a node that joins later counts
    its restarts from 0, so the counts cannot name the round), nothing stale can be read and no prefix is used.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fresh_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "false"
    if restart == 0 or fresh_store or (launched_world_size() or 1) == 1 or torch.distributed.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store, rank, world = next(torch.distributed.rendezvous("env://", timeout=timeout))
    store = torch.distributed.PrefixStore(f"scaletrain/restart_{restart}", store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _import_dynamo_before_the_group() -> None:
    """Import torch._dynamo before a multi-process group forms (DDP imports it when it wraps the model anyway).

    Imported after the group exists, it leaves references to the group's Python object that nothing releases:
    `destroy_process_group` then cannot free the group, and gloo's threads outlive the interpreter. Those threads
    can abort the process as it exits ("terminate called without an active exception", SIGABRT), after a run
    that finished and saved everything, and a launcher reports the job as failed."""
    if (launched_world_size() or 1) > 1 and not torch.distributed.is_initialized():
        importlib.import_module("torch._dynamo")


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"  # DDP's error for them


def runtime_for(r, scoring: bool = False) -> "Runtime":
    """The runtime a run section (RunConfig) asks for: precision, device, timeout, layout, determinism; `scoring`:
    for predict and evaluate, where a pipeline's processes each hold the model whole."""
    return Runtime(r.mixed_precision, r.cpu, r.timeout, r.strategy, r.deterministic, run=r, scoring=scoring)


BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket (bucket_cap_mb=25)


def buckets(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """The parameters in their order, cut into runs of one dtype and device of at most `limit` bytes each (a
    larger parameter alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out and out[-1][0].dtype == p.dtype and out[-1][0].device == p.device and size + nbytes <= limit:
            out[-1].append(p)
            size += nbytes
        else:
            out.append([p])
            size = nbytes
    return out


class Runtime:
    """One process's view of the job: device, rank, precision, its place in the layout, the model work on it (an
    Engine, engine.py) and the collectives it uses."""

    def __init__(self, mixed_precision: str = "no", cpu: bool = False, timeout_seconds: float = 1800.0,
                 strategy: str = "ddp", deterministic: bool = False, run=None, scoring: bool = False):
        """`run`: a run section (RunConfig) whose layout this job takes (--strategy, --tp, --stages...,
        --init-from); without one, `strategy` over every process."""
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        if mixed_precision == "fp16" and available_gpus(cpu) == 0:
            raise UserError("--mixed-precision fp16 needs a GPU; on the CPU use bf16 or no")
        if strategy == "dp" and (launched_world_size() or 1) > 1:
            raise UserError("--strategy dp runs one process that drives every visible GPU; launch it alone")
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
        # A group formed before this runtime (Ray Train forms one around its workers) is used as it is and left to
        # its owner at the end; accelerate finds it and forms none.
        self.owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        _import_dynamo_before_the_group()
        _init_after_restart("gloo" if cpu else "nccl", datetime.timedelta(seconds=timeout_seconds))
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers)
        self.mixed_precision = mixed_precision
        gpus = max(available_gpus(cpu), 1)
        self.layout = Layout.of(run, self.world_size, self.rank, gpus) if run is not None else \
            Layout(self.world_size, strategy, rank=self.rank, gpus_per_process=gpus if strategy == "dp" else 1)
        if scoring:
            self.layout = self.layout.for_scoring()
        self.engine = Engine(self, self.layout, getattr(run, "init_from", "") if not scoring else "")
        BEAT.role = self.layout.role
        self._watch: Watch | None = None
        self._cpu_group = None
        exit_with_launcher()  # a worker whose launcher dies stops too
        lowered = fit_threads()  # each process its share of the cores, whatever OMP_NUM_THREADS says
        if lowered and self.accelerator.is_local_main_process:
            print(lowered, flush=True)

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
        return self.engine.devices_per_process

    @property
    def devices(self) -> int:
        """Data-parallel replicas in the whole job."""
        return self.data_world * self.devices_per_process

    @property
    def data_rank(self) -> int:
        """Which shard of the data this process reads: its replica's (the processes of a split layer, the stages
        of a pipeline read alike)."""
        return self.layout.replica

    @property
    def data_world(self) -> int:
        """Shards the data is cut into: the data-parallel replicas."""
        return self.layout.dp

    @property
    def random_rank(self) -> int:
        """The rank this process's random draws are seeded with (Layout.random_rank)."""
        return self.layout.random_rank

    @property
    def holds_outputs(self) -> bool:
        """Whether this process counts the outputs: one process of each replica (Layout.holds_outputs)."""
        return self.layout.holds_outputs

    @property
    def reads_inputs(self) -> bool:
        """Whether this process's model reads the batches' inputs (not a pipeline's later stages)."""
        return self.layout.reads_inputs

    @property
    def checkpoint_format(self) -> str:
        return self.layout.checkpoint_format

    def seed(self, seed: int) -> None:
        """Seed Python, NumPy and torch (all devices) in this process."""
        from accelerate.utils import set_seed

        set_seed(seed)

    # -- the model (the Engine's: engine.py) ------------------------------------------------------------------
    @property
    def builds_on_meta(self) -> bool:
        return self.engine.builds_on_meta

    @property
    def forward_collective(self) -> bool:
        """Whether every process must take part in each forward (then validation and scoring run in lockstep)."""
        return self.engine.forward_collective

    @property
    def schedules_batches(self) -> bool:
        """Whether a batch's forward and backward are one call (`forward_backward`), a schedule running its
        micro-batches (through pipeline stages)."""
        return self.engine.pipelined

    @property
    def replicates(self) -> bool:
        """Whether DistributedDataParallel wraps the model (and so may look for parameters without gradients)."""
        return self.layout.replicates

    @property
    def splits_model(self) -> bool:
        """Whether any process holds only a part of the model."""
        return self.layout.splits_model

    def describe_layout(self) -> str:
        """The layout in words, for the start-up line."""
        return self.layout.describe()

    def build(self, factory, where: str = "model") -> torch.nn.Module:
        return self.engine.build(factory, where)

    def pretrained_from(self, path: str, model: torch.nn.Module) -> list[str]:
        return self.engine.pretrained_from(path, model)

    def check_data(self, train_data, val_data) -> None:
        self.engine.check_data(train_data, val_data)

    def check_model(self, model: torch.nn.Module, batches, step=None) -> None:
        self.engine.check_model(model, batches, step)

    def prepare(self, model: torch.nn.Module, make_optimizer, sync_bn: bool = False,
                activation_checkpointing: bool = False, find_unused_parameters: bool = False, step=None,
                compile_scope: str = ""):
        """Make `model` ready for training on this layout and its optimizer (`make_optimizer(model)`): SyncBN, the
        stage cut, tensor parallelism, activation checkpointing, compile (`compile_scope`: blocks or whole; '':
        none), fsdp, materialisation, then DDP (told to look for parameters without a gradient at each step with
        `find_unused_parameters`); see parallelize.py. With a user's `step(model, batch)`, what trains is a module
        whose forward is the step (StepModule)."""
        return self.engine.prepare(model, make_optimizer, step, sync_bn, activation_checkpointing, compile_scope,
                                   find_unused_parameters)

    @property
    def compiled(self) -> str:
        """--compile: what was compiled, in words."""
        return self.engine.compiled

    def prepare_unwrapped(self, model: torch.nn.Module, step, sync_bn: bool = False,
                          activation_checkpointing: bool = False) -> torch.nn.Module:
        """For a step that runs its optimizers itself (several of them): the model on the device with the main
        process's weights, inside a StepModule, not wrapped by DDP; its gradients are averaged by
        `average_gradients` before each optimizer steps."""
        if self.layout.splits_model or self.layout.strategy != "ddp":
            raise UserError(f"--strategy {self.layout.describe()}: a Step with several optimizers is trained with "
                            f"ddp (each process holds the whole model; its gradients are averaged before each "
                            f"optimizer steps)")
        if sync_bn and self.world_size > 1:
            model = convert_sync_bn(model, self.device)
        self.checkpointed_blocks = apply_activation_checkpointing(model) if activation_checkpointing else 0
        model = model.to(self.device)
        if self.world_size > 1:
            broadcast_tensors(model, src=0)
        return StepModule(model, step)

    def release(self) -> None:
        """Forget the models and optimizers prepared so far (accelerate keeps references to them), so that
        their memory is freed once the caller drops its own; the batch finder prepares one per trial."""
        self.accelerator.free_memory()

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this process's device for inference (this process's part of a copy where the layout
        splits it)."""
        return self.engine.place(model)

    def restore_whole(self, trained: torch.nn.Module) -> None:
        """The model object a user gave, which a layout that splits it trained a copy of, given the trained weights
        whole (a collective; nothing where the object itself trained)."""
        from .parallelize import restore_whole

        restore_whole(self.engine, trained)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's model inside the wrappers (DDP, compile, a StepModule)."""
        return users_model(self.accelerator.unwrap_model(model, keep_torch_compile=False))

    def autocast(self):
        return self.accelerator.autocast()

    def forward_backward(self, model, x, y, loss, weight: float, sync: bool) -> torch.Tensor:
        """A batch's forward and backward in one call through the pipeline (where `pipelined`)."""
        return self.engine.forward_backward(model, x, y, loss, weight, sync)

    def no_sync(self, model: torch.nn.Module, skip: bool):
        """Gradient synchronisation held for this backward when `skip` (inside gradient accumulation)."""
        return self.engine.no_sync(model, skip)

    def whole_tensors(self, model: torch.nn.Module):
        """The whole model's tensors, one at a time (engine.py), for a weights file."""
        return self.engine.whole_tensors(model)

    def grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The gradients' global L2 norm over every process's parts, as clipping takes it."""
        return self.engine.grad_norm(model)

    def capture(self, model: torch.nn.Module):
        """A context recording every module's input and output (capture.py); `captured` makes them whole."""
        from .capture import Capture

        return Capture(model)

    def captured(self, capture, reference: dict[str, tuple[int, ...]] | None) -> tuple[int, dict, dict] | None:
        """(this stage's number, every module's input and output whole, its split layers: {module: "colwise" |
        "rowwise"}) on the first process of each stage's first replica; None on the others (every process calls
        it). `reference`: the one-process shapes (capture.py)."""
        from .capture import split_layers

        tensors = capture.whole(self.engine.group("tp"), self.layout.tp, reference)
        L = self.layout
        return (L.stage, tensors, split_layers(capture.model)) if L.replica == 0 and L.tp_rank == 0 else None

    def held_bytes(self, model: torch.nn.Module, optimizer) -> dict[str, int]:
        return self.engine.held_bytes(model, optimizer)

    def save_state(self, folder: Path, model: torch.nn.Module, optimizer) -> dict[str, Any] | None:
        """Model and optimizer state into a checkpoint folder, in this layout's format (every process calls it)."""
        return self.engine.save(folder, model, optimizer)

    def load_state(self, folder: Path, model: torch.nn.Module, optimizer, train: dict[str, Any]) -> None:
        """A checkpoint's model and optimizer state, in whichever format it was written, read into this layout."""
        self.engine.load(folder, model, optimizer, train)

    def scaler_state(self) -> dict | None:
        return self.engine.scaler_state()

    def load_scaler_state(self, state: dict | None) -> None:
        self.engine.load_scaler_state(state)

    @contextlib.contextmanager
    def unused_parameters_named(self, model: torch.nn.Module):
        """DistributedDataParallel's error for parameters that got no gradient in the step before (some steps leave
        them unused) as one line naming them and the setting that fixes it; the run stops, its checkpoints kept."""
        try:
            yield
        except RuntimeError as e:
            if UNUSED_PARAMETERS not in str(e):
                raise
            found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(e))
            trainable = [n for n, p in self.unwrap(model).named_parameters() if p.requires_grad]
            names = [trainable[int(i)] for i in found.group(1).split() if int(i) < len(trainable)] if found else []
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UserError(f"rank {self.rank}: {len(names) or 'some'} parameter(s) got no gradient in the previous "
                            f"step ({shown or 'DistributedDataParallel did not say which'}), which some steps leave "
                            f"unused; train with --find-unused-parameters yes (config.model.find_unused_parameters = "
                            f"'yes')", quiet=not self.is_main) from None

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global L2 norm, over every process's parts, is at most `max_norm` (an fp16
        loss scale undone first); returns the norm before clipping."""
        return self.engine.clip_grad_norm(model, max_norm)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self.accelerator.optimizer_step_was_skipped

    # -- collectives ---------------------------------------------------------------------------------------
    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over all processes (every process gets the result)."""
        if self.world_size == 1:
            return values
        with BEAT.during("collective"):
            return self.accelerator.reduce(values.clone(), reduction="sum")

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over all processes (every process gets the result)."""
        if self.world_size == 1:
            return values
        values = values.clone()
        with BEAT.during("collective"):
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return values

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the data-parallel replicas, each counted once (by the process that holds its
        outputs: the processes of a replica read the same batches); every process gets the result."""
        return self.sum(values if self.holds_outputs else torch.zeros_like(values))

    def gather_strided(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """Reassemble per-sample results computed on strided shards (replica r owns items r, r+R, ...): exactly
        `total` rows, in input order, on every process. The shards' lengths follow from `total` (they differ by at
        most one)."""
        world = self.data_world
        if self.world_size == 1:
            return local
        return self._in_turns(local, -(-total // world), [len(range(r, total, world)) for r in range(world)])

    def gather_interleaved(self, local: torch.Tensor, capacity: int) -> torch.Tensor:
        """Every replica's rows of one step (at most `capacity` each, any number, gathered with the rows),
        interleaved: row 0 of replica 0, row 0 of replica 1, ..., row 1 of replica 0, ..., a replica that has no
        row j left out. For a stream dealt out item by item (replica r holds items r, r+R, ...), this is the
        stream's order."""
        if self.world_size == 1:
            return local
        with BEAT.during("collective"):
            counts = self.accelerator.gather(torch.tensor([len(local)], device=local.device)).tolist()
        return self._in_turns(local, capacity, [counts[r] for r in self._holders()])

    def _holders(self) -> list[int]:
        """The processes that hold each replica's outputs, in the replicas' order."""
        return [r for r in range(self.world_size) if self.layout.at(r).holds_outputs]

    def _in_turns(self, local: torch.Tensor, capacity: int, counts: list[int]) -> torch.Tensor:
        """Each replica's `local` (replica r's `counts[r]` rows, from the process that holds its outputs) padded to
        `capacity`, all-gathered, and read in turns: row j of every replica before row j + 1, the padding left
        out."""
        padded = local.new_zeros((capacity, *local.shape[1:]))
        padded[: len(local)] = local
        with BEAT.during("collective"):
            gathered = self.accelerator.gather(padded.contiguous())  # (world * capacity, ...), rank-major
        every = gathered.reshape(self.world_size, capacity, *local.shape[1:])
        holders = self._holders()
        if len(holders) != self.world_size:
            every = every[torch.tensor(holders, device=every.device)]
        turns = every.transpose(0, 1)
        kept = torch.arange(capacity)[:, None] < torch.tensor(counts)[None, :]  # (capacity, replicas)
        return turns[kept.to(turns.device)]

    def gather_objects(self, value: Any, group=None) -> list:
        """Every process's `value` (any picklable object; tensors on the CPU), in rank order, on every process (of
        `group`: None, all): one collective whatever each holds."""
        size = self.world_size if group is None else torch.distributed.get_world_size(group)
        if size == 1:
            return [value]
        gathered: list = [None] * size
        with BEAT.during("collective"):
            torch.distributed.all_gather_object(gathered, value, group=group)
        return gathered

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor` concatenated along the first dimension in rank order (its size may differ by
        process), keeping gradients: the backward pass sends each process the gradient of its own rows, summed
        over the processes' losses (DDP's average then makes it the gradient of their mean)."""
        return self.all_gather_rows(tensor)[0]

    def all_gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """`all_gather`, and where this process's rows are in it: (first, end, every process's rows)."""
        if self.world_size == 1:
            return tensor, (0, len(tensor), len(tensor))
        with BEAT.during("collective"):
            sizes = self.accelerator.gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
            most = max(sizes)
            padded = tensor if len(tensor) == most else \
                torch.cat([tensor, tensor.new_zeros((most - len(tensor), *tensor.shape[1:]))])
            gathered = _all_gather_autograd(padded.contiguous())
        start = sum(sizes[:self.rank])
        return torch.cat([part[:n] for part, n in zip(gathered.split(most), sizes)]), \
            (start, start + sizes[self.rank], sum(sizes))

    def average_gradients(self, parameters, group=None) -> None:
        """Average the gradients of `parameters` over the processes (a step that runs its optimizers itself), in
        buckets of at most BUCKET_BYTES with two in flight (the extra memory is two buckets, not a copy of every
        gradient; one bucket's all-reduce runs while the one before is copied back). A parameter that has no
        gradient on any process keeps none (an optimizer skips it, as on one process); only a process that lacks
        some gradients waits to learn which (the others never wait on the device here). `group`: over these
        processes only (a pipeline stage's replicas)."""
        size = self.world_size if group is None else torch.distributed.get_world_size(group)
        if size == 1:
            return
        params = list(parameters)
        if not params:
            return
        missing = [p.grad is None for p in params]
        with BEAT.during("collective"):
            has = torch.tensor([0.0 if m else 1.0 for m in missing], device=self.device)
            flags = torch.distributed.all_reduce(has, group=group, async_op=True)
            for p, m in zip(params, missing):
                if m:
                    p.grad = torch.zeros_like(p)
            pending = None
            for bucket in buckets(params, BUCKET_BYTES):  # in the parameters' order: alike on every rank
                one = len(bucket) == 1 and _grad(bucket[0]).is_contiguous()
                flat = _grad(bucket[0]) if one else torch.cat([_grad(p).reshape(-1) for p in bucket])
                work = torch.distributed.all_reduce(flat, group=group, async_op=True)
                if pending is not None:
                    self._averaged(*pending)
                pending = (work, flat, bucket, one, size)
            self._averaged(*pending)
            flags.wait()
            if any(missing):
                for p, anywhere in zip(params, has.tolist()):
                    if not anywhere:
                        p.grad = None

    def _averaged(self, work, flat: torch.Tensor, bucket: list[torch.Tensor], in_place: bool, size: int) -> None:
        work.wait()
        flat.div_(size)
        if not in_place:
            for p, part in zip(bucket, flat.split([_grad(p).numel() for p in bucket])):
                _grad(p).copy_(part.view_as(_grad(p)))

    def broadcast_object(self, value):
        """The main process's `value` on every process (any picklable object)."""
        if self.world_size == 1:
            return value
        from accelerate.utils import broadcast_object_list

        with BEAT.during("collective"):
            return broadcast_object_list([value], from_process=0)[0]

    def sync_buffers(self, model: torch.nn.Module) -> None:
        """Give every rank the main process's buffers (BatchNorm running statistics).

        Each rank updates its running statistics from its own batches, so after training they differ slightly;
        the main process's are the ones saved, so every rank evaluates with those.
        """
        if self.world_size == 1:
            return
        self.engine.sync_buffers(model)

    # -- experiment trackers (main process only) -----------------------------------------------------------
    def start_trackers(self, names: tuple[str, ...], run_dir: Path, experiment: str, config: dict[str, Any],
                       resume_step: int = 0, run_ids: dict[str, str] | None = None) -> dict[str, str]:
        """Start the trackers `names` (tensorboard, mlflow, wandb) with `config` as the run's hyperparameters;
        returns the MLflow / W&B run ids that continue the same runs on resume (`run_ids`). Other processes
        start none, so every later `log` is the main process's alone."""
        from .trackers import build_trackers, explain_start_failure, started_run_ids

        if not names or not self.is_main:
            return {}
        run_ids = run_ids or {}
        # The Accelerator exists before the run folder's resume step is known, so its trackers are named here.
        self.accelerator.log_with = build_trackers(names, Path(run_dir), experiment, resume_step, run_ids)
        try:
            self.accelerator.init_trackers(experiment)
        except Exception as e:
            explained = explain_start_failure(e, run_ids)
            if explained is None:
                raise
            raise explained from None
        for tracker in self.accelerator.trackers:
            if tracker.name not in run_ids:  # a continued run keeps its first settings: MLflow refuses a change
                tracker.store_init_configuration(config)
        return started_run_ids(self.accelerator.trackers)

    def log(self, values: dict[str, float], step: int) -> None:
        """Numbers to every started tracker at optimizer step `step`."""
        self.accelerator.log(values, step=step)

    def end_trackers(self) -> None:
        """Close the trackers (flush TensorBoard, end the MLflow and W&B runs); the process group stays."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers = []

    def cpu_group(self):
        """A process group that moves CPU tensors (weights written tensor by tensor): the default one when it is
        gloo, else a gloo group over every process, made at the first call (which every process makes at the same
        point)."""
        if torch.distributed.get_backend() == "gloo":
            return None
        if self._cpu_group is None:
            self._cpu_group = torch.distributed.new_group(backend="gloo")
        return self._cpu_group

    def barrier(self) -> None:
        if self.world_size > 1:
            with BEAT.during("collective"):
                self.accelerator.wait_for_everyone()

    # -- stalls and failures of other ranks (see watch.py) -------------------------------------------------
    def watch(self, stall_timeout: float) -> None:
        """In a job of 2 or more processes, start this process's watch: a rank that stalls for `stall_timeout`
        seconds (0: not watched) is named by every process, which then exits; a rank that fails is named by the
        others' `named_failure`."""
        if self.world_size == 1 or self._watch is not None:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self._watch = Watch(_get_default_store(), self.rank, self.world_size, stall_timeout).start()

    def unwatch(self) -> None:
        """Stop this process's watch (the job's training is over)."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def named_failure(self, error: Exception) -> Exception | None:
        """For an error that ended training on this rank: RankFailed naming the rank that failed first when
        `error` is this rank's collective breaking as that rank left; None when `error` is this rank's own (then
        reported to the others)."""
        if self._watch is None:
            return None
        other = self._watch.failure() if isinstance(error, RuntimeError) else None
        if other is None:
            self._watch.failed(error)
            return None
        return RankFailed(f"{other} (this rank's collective operation broke as it left: {one_line(error)[:160]})")

    def end(self) -> None:
        """Leave no accelerate state behind (a notebook may start another run). The process group goes too, but
        for one that existed before this runtime (its owner closes it) and one formed in a worker of a launcher
        (torchrun, accelerate launch, srun): the next runtime of that process, e.g. `predict` after `fit`, uses it
        again, since a second group formed over the launcher's store would wait for keys of the first; it is
        closed when the process exits."""
        from accelerate.state import AcceleratorState

        self.unwatch()
        keep = (launched_world_size() or 1) > 1
        if self.owns_process_group and not keep:
            self.accelerator.end_training()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        else:  # end_training would also destroy the group
            for tracker in self.accelerator.trackers:
                tracker.finish()
            if self.owns_process_group:
                atexit.register(_close_process_group)
        AcceleratorState._reset_state(reset_partial_state=True)
        self.layout.forget_meshes()  # their groups' objects are freed with the group, not held by this runtime
        self._cpu_group = None
        torch.use_deterministic_algorithms(self._was_deterministic)
        BEAT.role = ""  # the next runtime of this process says its own


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient as this process holds it (a split layer's: its own part)."""
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def _all_gather_autograd(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor` (the same shape on each) concatenated in rank order, its backward pass a reduce-scatter
    of the gradients: torch's functional collective under the name this torch version gives it."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    gathered = gather(tensor, 0, torch.distributed.group.WORLD)
    return funcol.wait_tensor(gathered) if hasattr(funcol, "wait_tensor") else gathered


def _close_process_group() -> None:
    """At the process's exit: the groups destroyed and their objects freed while the interpreter still runs, so that
    gloo's threads are joined by their groups' destructors, not left to the interpreter's teardown."""
    import gc

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
