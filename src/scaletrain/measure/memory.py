"""Will a model and batch fit on a device: per-device bytes of one training step, estimated before a run.

Weights, gradients, optimizer state and communication buffers follow from the parameter shapes and the strategy;
activations are measured by running real steps on the CPU and scaled to the batch. Nothing here trains or
touches a GPU.
"""

from __future__ import annotations

import contextlib
import math
import re
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import PER_DEVICE_STRATEGIES, PRECISIONS
from ..errors import UserError

ESTIMATED_STRATEGIES = (*PER_DEVICE_STRATEGIES, "pipeline")
OPTIMIZER_STATE_TENSORS = {"sgd": 1, "adam": 2, "adamw": 2}
"""fp32 tensors the optimizer keeps per parameter: SGD's momentum buffer; Adam's exp_avg and exp_avg_sq (their
scalar `step` counters live on the CPU)."""
MEASURED_BATCHES = (2, 4)
"""Batches at which activations are measured; small, so big models at 224 px take seconds."""
USABLE_SHARE = 0.9
"""Share of a device's memory a run can use; the rest goes to the CUDA context and allocator fragmentation."""
BUILTIN_INPUT = (1, 28)
"""Channels and image side of the built-in models' data (MNIST); timm models default to 3 channels."""
_SIZE_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9,
               "gb": 10 ** 9, "t": 10 ** 12, "tb": 10 ** 12, "ki": 2 ** 10, "kib": 2 ** 10, "mi": 2 ** 20,
               "mib": 2 ** 20, "gi": 2 ** 30, "gib": 2 ** 30, "ti": 2 ** 40, "tib": 2 ** 40}
FLOAT32_BYTES = 4


# -- sizes ------------------------------------------------------------------------------------------------------
def parse_memory(text: str, flag: str = "--device-memory") -> int:
    """Bytes from '80GB', '80G', '141GiB', '16000MB' or a plain byte count (GB = 1e9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{flag}: expected a positive size like 80GB, 80G, 141GiB, 16000MB or a number of bytes, "
                        f"got '{text}'")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def human_bytes(n: int) -> str:
    """GiB from 1 GiB up, MiB below, with two decimals."""
    return f"{n / 2 ** 30:.2f} GiB" if abs(n) >= 2 ** 30 else f"{n / 2 ** 20:.2f} MiB"


# -- weights, gradients, optimizer state ------------------------------------------------------------------------
def _parameters(model: nn.Module, trainable_only: bool = False) -> list[nn.Parameter]:
    """Each parameter once (shared ones are held once)."""
    return [p for p in model.parameters() if p.requires_grad or not trainable_only]


def shard_numel(p: torch.Tensor, nproc: int) -> int:
    """Elements of `p` on the device holding the most of it: FSDP2 splits dim 0 into `nproc` equal, padded
    chunks, so rank 0 holds ceil(dim0 / nproc) rows."""
    if p.ndim == 0 or nproc == 1:
        return p.numel()
    rows = p.shape[0]
    return math.ceil(rows / nproc) * (p.numel() // rows if rows else 0)


def _per_device_numel(params: list[torch.Tensor], strategy: str, nproc: int) -> int:
    shards = nproc if strategy == "fsdp" else 1
    return sum(shard_numel(p, shards) for p in params)


def state_bytes(model: nn.Module, strategy: str = "ddp", nproc: int = 1, optimizer: str = "sgd") -> dict[str, int]:
    """Per-device bytes of fp32 weights, buffers, fp32 gradients and optimizer state: whole under ddp, rank 0's
    shard of every parameter under fsdp; buffers are whole on every device."""
    every = _per_device_numel(_parameters(model), strategy, nproc)
    trainable = _per_device_numel(_parameters(model, trainable_only=True), strategy, nproc)
    return {
        "parameters": FLOAT32_BYTES * every,
        "buffers": sum(b.nbytes for b in model.buffers()),
        "gradients": FLOAT32_BYTES * trainable,
        "optimizer_state": FLOAT32_BYTES * trainable * OPTIMIZER_STATE_TENSORS[optimizer],
    }


def ddp_bucket_bytes(model: nn.Module) -> int:
    """DistributedDataParallel's communication buckets: a second fp32 copy of every gradient."""
    return FLOAT32_BYTES * sum(p.numel() for p in _parameters(model, trainable_only=True))


# -- FSDP all-gathers -------------------------------------------------------------------------------------------
@dataclass
class ShardUnit:
    """One FSDP unit: the parameters it gathers itself (not those of units nested in it) and their dtype size."""

    parameter_elements: int
    gradient_elements: int
    compute_bytes: int

    @property
    def gathered_bytes(self) -> int:
        return self.parameter_elements * self.compute_bytes


def _own_parameters(module: nn.Module, nested: set[int]) -> list[nn.Parameter]:
    """Parameters of `module` not inside any of the modules whose ids are in `nested`."""
    own, stack = [], [module]
    while stack:
        m = stack.pop()
        own.extend(m.parameters(recurse=False))
        stack.extend(c for c in m.children() if id(c) not in nested)
    return own


def _compute_bytes(module: nn.Module, mixed_precision: str) -> int:
    """2 bytes under bf16/fp16, but 4 for a unit holding BatchNorm (scaletrain keeps those in fp32)."""
    from ..parallel import keeps_fp32_parameters

    return FLOAT32_BYTES if mixed_precision == "no" or keeps_fp32_parameters(module) else 2


def shard_units(model: nn.Module, mixed_precision: str = "no") -> tuple[ShardUnit, list[ShardUnit]]:
    """The root and the block units FSDP gathers one at a time (`parallel.block_units`)."""
    from ..parallel import block_units

    blocks = block_units(model)
    ids = {id(b) for b in blocks}

    def unit(module: nn.Module) -> ShardUnit:
        params = _own_parameters(module, ids - {id(module)})
        return ShardUnit(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
                         _compute_bytes(module, mixed_precision))

    return unit(model), [unit(b) for b in blocks]


def fsdp_gather_bytes(model: nn.Module, mixed_precision: str = "no") -> int:
    """Transient bytes of FSDP's all-gathers: the root (kept gathered from forward to backward), two copies of
    the largest unit (one computing, one prefetched) and its unsharded fp32 gradients for the reduce-scatter."""
    root, units = shard_units(model, mixed_precision)
    largest_params = max((u.gathered_bytes for u in units), default=0)
    largest_grads = max((u.gradient_elements for u in units), default=0)
    return root.gathered_bytes + 2 * largest_params + FLOAT32_BYTES * largest_grads


# -- activations ------------------------------------------------------------------------------------------------
class StorageTracker(TorchDispatchMode):
    """Every storage an op creates while active, with the running total of live bytes: each new storage is
    registered once and subtracted when freed (a weakref finalizer), and every change is kept in `events` so the
    peak can be recomputed without chosen storages."""

    def __init__(self, existing: list[torch.Tensor] = ()):
        super().__init__()
        self.live: dict[int, int] = {id(t.untyped_storage()): -1 for t in existing}  # id -> serial; -1: existed
        self.events: list[tuple[int, int]] = []  # (serial, +/- bytes)
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._register(t.untyped_storage())
        return out

    def _register(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in self.live or nbytes == 0:
            return
        serial = len(self.events)
        self.live[key] = serial
        self.events.append((serial, nbytes))
        weakref.finalize(storage, self._freed, key, serial, nbytes)

    def _freed(self, key: int, serial: int, nbytes: int) -> None:
        self.live.pop(key, None)
        self.events.append((serial, -nbytes))

    def serial_of(self, t: torch.Tensor) -> int | None:
        serial = self.live.get(id(t.untyped_storage()))
        return None if serial is None or serial < 0 else serial

    def timeline(self, excluded: set[int] = frozenset()) -> list[int]:
        """Total live bytes after each recorded change, leaving out the storages in `excluded`."""
        total, totals = 0, []
        for serial, delta in self.events:
            if serial not in excluded:
                total += delta
                totals.append(total)
        return totals

    @contextlib.contextmanager
    def paused(self):
        """Run ops without registering their outputs (inputs the step receives rather than creates)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True


def c_allocator_bytes():
    """A function returning the bytes glibc's malloc has handed out and not got back (torch's CPU tensors come
    from it; kernel workspaces too), or None without glibc 2.33+. An independent check of the tracker."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd  # small blocks in the heap + large ones mapped on their own

    return in_use


class AllocatorPeak(TorchDispatchMode):
    """The highest value of `in_use()` seen after any op while active."""

    def __init__(self, in_use):
        super().__init__()
        self.in_use, self.peak = in_use, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def _precision_context(mixed_precision: str):
    """bf16 autocast on the CPU for bf16 and fp16 alike (the same bytes per element), nothing for 'no'."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _image_hw(image_size: int | tuple[int, int]) -> tuple[int, int]:
    return (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)


def step_timeline(model: nn.Module, batch_size: int, channels: int, image_size: int | tuple[int, int],
                  mixed_precision: str = "no") -> list[int]:
    """Live bytes, after each allocation and free, of the tensors one real training step (forward,
    cross-entropy on random labels, backward) creates on the CPU beyond what existed before; the parameters'
    gradients are left out (they are counted as gradients)."""
    return inputs_timeline(model, torch.randn(batch_size, channels, *_image_hw(image_size)), mixed_precision)


def inputs_timeline(model: nn.Module, inputs: torch.Tensor, mixed_precision: str = "no", scored: bool = True,
                    ) -> list[int]:
    """step_timeline's for a batch of `inputs` of any shape: a pipeline stage's, whose output is scored by
    cross-entropy on the last stage (`scored`) and, on the others, gets a gradient of its own shape back."""
    model.train()
    params = list(model.parameters())
    for p in params:
        p.grad = None
    inputs = inputs.detach().requires_grad_(not scored)  # a later stage sends its input's gradient back
    tracker = StorageTracker([inputs, *params, *model.buffers()])
    with tracker:
        with _precision_context(mixed_precision):
            logits = model(inputs)
            with tracker.paused():
                target = torch.randint(0, logits.shape[-1], (len(inputs),)) if scored else \
                    torch.ones_like(logits)
            loss = nn.functional.cross_entropy(logits, target) if scored else None
        if scored:
            loss.backward()
        else:
            logits.backward(target)
        del logits, loss
    gradients = {tracker.serial_of(p.grad) for p in params if p.grad is not None} - {None}
    for p in params:
        p.grad = None
    return tracker.timeline(gradients)


def measure_activation_bytes(model: nn.Module, batch_size: int, channels: int, image_size: int | tuple[int, int],
                             mixed_precision: str = "no") -> int:
    """Peak bytes of activations and other temporaries of one real training step at `batch_size` on the CPU."""
    return max(step_timeline(model, batch_size, channels, image_size, mixed_precision), default=0)


@dataclass
class ActivationFit:
    """Activation bytes as a function of the batch: at each moment of the step the live bytes are
    constant + per_sample x batch, and the peak is the highest of these lines at the batch asked for."""

    lines: list[tuple[float, float]]
    """(constant, per_sample) of the moments that can be the peak at some batch."""
    batches: tuple[int, int] = MEASURED_BATCHES

    def line_at(self, batch_size: int) -> tuple[float, float]:
        return max(self.lines, key=lambda line: line[0] + line[1] * batch_size)

    def at(self, batch_size: int) -> int:
        constant, per_sample = self.line_at(batch_size)
        return max(0, math.ceil(constant + per_sample * batch_size))

    def largest_batch(self, budget: int) -> int | None:
        """The largest batch whose activations stay within `budget` bytes (None: no limit from the batch)."""
        if any(per_sample <= 0 and constant + per_sample > budget for constant, per_sample in self.lines):
            return 0
        limits = [math.floor((budget - constant) / per_sample) for constant, per_sample in self.lines
                  if per_sample > 0]
        return max(0, min(limits)) if limits else None


def _upper_lines(lines: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drop the lines below another one at every batch (smaller or equal constant and slope)."""
    kept, best_constant = [], -math.inf
    for constant, per_sample in sorted(set(lines), key=lambda line: (-line[1], -line[0])):
        if constant > best_constant:
            kept.append((constant, per_sample))
            best_constant = constant
    return kept


def fit_activations(model: nn.Module, channels: int, image_size: int | tuple[int, int],
                    mixed_precision: str = "no", batches: tuple[int, int] = MEASURED_BATCHES,
                    timeline: Callable[[int], list[int]] | None = None) -> ActivationFit:
    """Measure steps at two small batches and put a line through each moment of them. The steps run the same
    ops in the same order, so moment k of one is moment k of the other; were they ever to differ, a single line
    through the two peaks is used. `timeline(batch)`: another step's timeline (a pipeline stage's)."""
    small, large = batches
    timeline = timeline or (lambda n: step_timeline(model, n, channels, image_size, mixed_precision))
    a, b = (timeline(n) for n in (small, large))
    if len(a) != len(b):
        a, b = [max(a, default=0)], [max(b, default=0)]
    slopes = [(y - x) / (large - small) for x, y in zip(a, b)]
    return ActivationFit(_upper_lines([(x - s * small, s) for x, s in zip(a, slopes)]), batches)


# -- the estimate -----------------------------------------------------------------------------------------------
@dataclass
class MemoryQuery:
    """What is asked: model and input shape, per-device batch, and how it would be trained."""

    model: str
    image_size: int | None = None
    """Square image side; default: 28 for the built-in models, the timm model's own input size otherwise."""
    channels: int | None = None
    """1 or 3; default: 1 for the built-in models, 3 for timm models."""
    num_classes: int = 10
    batch_size: int = 128
    """Per device."""
    mixed_precision: str = "no"
    strategy: str = "ddp"
    nproc: int = 1
    optimizer: str = "sgd"
    activation_checkpointing: bool = False
    stages: int = 0
    """--strategy pipeline: stages (0: every process)."""
    microbatches: int = 0
    """--strategy pipeline: micro-batches per batch (0: as train chooses)."""
    schedule: str = "1f1b"
    """--strategy pipeline: gpipe keeps every micro-batch's activations until its backward, 1f1b at most one per
    stage after it (interleaved-1f1b is counted as 1f1b)."""
    device_memory: int | str | None = None
    """Bytes or a size such as '80GB'; default: the first CUDA device's memory, or no verdict without one."""
    tp: int = 1
    """Processes each layer of the model's plan is split over (tensor parallelism); `strategy` over the rest."""

    @property
    def layout(self):
        """The layout of --nproc processes these settings make (parallel/layout.py)."""
        from ..parallel import Layout, Stages

        stages = Stages(self.stages, (), self.microbatches, self.schedule) if self.strategy == "pipeline" else Stages()
        return Layout(self.nproc, self.strategy, self.tp, stages)

    @property
    def replicas(self) -> int:
        """The data-parallel replicas: --nproc over --tp, or over a pipeline's --stages (0: every process)."""
        return self.layout.dp

    def validate(self) -> MemoryQuery:
        for flag, value in (("--batch-size", self.batch_size), ("--nproc", self.nproc),
                            ("--num-classes", self.num_classes), ("--image-size", self.image_size)):
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        if self.channels is not None and self.channels not in (1, 3):
            raise UserError(f"--channels must be 1 or 3, got {self.channels}")
        for flag, value, allowed in (("--mixed-precision", self.mixed_precision, PRECISIONS),
                                     ("--strategy", self.strategy, ESTIMATED_STRATEGIES),
                                     ("--optimizer", self.optimizer, tuple(OPTIMIZER_STATE_TENSORS))):
            if value not in allowed:
                raise UserError(f"{flag}: unknown value '{value}'; choose from {', '.join(allowed)}")
        if isinstance(self.device_memory, str):
            self.device_memory = parse_memory(self.device_memory)
        if self.tp != 1:  # (a pipeline is estimated stage by stage on any --nproc)
            self.layout.check()
        if self.tp > 1 and self.strategy == "pipeline":
            raise UserError("estimate-memory does not estimate --tp inside pipeline stages (train runs it); give "
                            "--strategy ddp or fsdp with --tp, or a pipeline without")
        return self


@dataclass
class MemoryEstimate:
    """Per-device bytes of each part of a training step, and whether and up to which batch it fits."""

    query: MemoryQuery
    image_hw: tuple[int, int]
    parts: dict[str, int]
    """Part name -> bytes per device, in display order; 'activations' is the only one that grows with the batch."""
    activations: ActivationFit
    device_memory: int | None = None
    usable_memory: int | None = field(init=False, default=None)
    stages: list[dict] = field(default_factory=list)
    """--strategy pipeline: each stage's parts and bytes; `parts` and `activations` are the largest stage's."""

    def __post_init__(self):
        if self.device_memory is not None:
            self.usable_memory = int(self.device_memory * USABLE_SHARE)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.usable_memory is None else self.total <= self.usable_memory

    @property
    def fixed_bytes(self) -> int:
        """Everything but the activations: what does not grow with the batch."""
        return self.total - self.parts["activations"]

    @property
    def largest_batch_size(self) -> int | None:
        """The largest per-device batch whose step fits in the usable memory (0: not even 1)."""
        if self.usable_memory is None:
            return None
        return self.activations.largest_batch(self.usable_memory - self.fixed_bytes)

    def to_dict(self) -> dict:
        q = asdict(self.query)
        q.update(image_size=list(self.image_hw), device_memory=self.device_memory)
        constant, per_sample = self.activations.line_at(self.query.batch_size)
        return {**q, "bytes": {**self.parts, "total": self.total},
                "activations_constant": round(constant), "activations_per_sample": math.ceil(per_sample),
                "measured_batches": list(self.activations.batches), "usable_memory": self.usable_memory,
                "usable_share": USABLE_SHARE, "fits": self.fits, "largest_batch_size": self.largest_batch_size,
                **({"stages": self.stages} if self.stages else {})}


def default_image_hw(model_name: str, model: nn.Module) -> tuple[int, int]:
    """The image size the model is usually trained at: MNIST's 28 px for the built-in ones, the timm model's
    pretrained configuration otherwise."""
    from ..models import BUILTIN

    if model_name in BUILTIN:
        return BUILTIN_INPUT[1], BUILTIN_INPUT[1]
    size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))
    return size[-2], size[-1]


def cuda_memory() -> int | None:
    """Total memory of the first CUDA device, or None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _build(query: MemoryQuery) -> tuple[nn.Module, int, tuple[int, int]]:
    """The model for the query's channels, and the resolved channels and image size."""
    from ..models import BUILTIN, build_model

    channels = query.channels or (BUILTIN_INPUT[0] if query.model in BUILTIN else 3)
    model = build_model(query.model, channels, query.num_classes, image_size=query.image_size)
    hw = (query.image_size, query.image_size) if query.image_size else default_image_hw(query.model, model)
    return model, channels, hw


def _communication_parts(model: nn.Module, query: MemoryQuery) -> dict[str, int]:
    """Buffers that exist only with several data-parallel processes."""
    if query.replicas == 1:
        return {}
    if query.strategy == "ddp":
        return {"gradient_buckets": ddp_bucket_bytes(model)}
    return {"gathered_parameters": fsdp_gather_bytes(model, query.mixed_precision)}


def estimate(model: str, **settings) -> MemoryEstimate:
    """Per-device memory of training `model` with the settings of `MemoryQuery` (batch_size, strategy, ...)."""
    query = MemoryQuery(model, **settings).validate()
    net, channels, hw = _build(query)
    query.channels = channels
    device_memory = query.device_memory if query.device_memory is not None else cuda_memory()
    if query.strategy == "pipeline":
        return _pipeline_estimate(query, net, channels, hw, device_memory)
    if query.tp > 1:  # what one process of each split layer holds and computes
        from ..parallel.tensor import one_process

        net = one_process(net, query.tp)
    parts = {**state_bytes(net, query.strategy, query.replicas, query.optimizer), **_communication_parts(net, query)}
    if query.activation_checkpointing:
        from ..parallel import apply_activation_checkpointing

        apply_activation_checkpointing(net)
    activations = fit_activations(net, channels, hw, query.mixed_precision)
    parts["activations"] = activations.at(query.batch_size)
    return MemoryEstimate(query, hw, parts, activations, device_memory)


@dataclass
class Candidate:
    """One way to train on the devices: its flags and its estimate (None: it cannot run the model, `why`)."""

    name: str
    flags: dict
    estimate: MemoryEstimate | None
    why: str = ""

    @property
    def fits(self) -> bool:
        return self.estimate is not None and bool(self.estimate.fits)


MOST_TP = 8  # a layer split within a node: 8 GPUs at most
PICK_ORDER = "ddp, fsdp, then tensor parallelism from the smallest --tp (ddp, then fsdp over the rest), then a pipeline"


def layouts(model: str, devices: int, **settings) -> tuple[list[Candidate], Candidate | None]:
    """Every layout of `devices` processes, each estimated with `settings` (MemoryQuery's) at the same global
    batch, --batch-size x `devices` (each data-parallel replica's share: a tensor-parallel replica's processes,
    a pipeline's stages, hold the same batch), and the one picked: the first that fits in PICK_ORDER, the order of
    what each step communicates (ddp: the gradients once; fsdp: the parameters gathered and the gradients
    scattered; tensor parallelism: activations in every split layer, each way; a pipeline: its stages wait for one
    another)."""
    settings = {k: v for k, v in settings.items() if k not in ("strategy", "nproc", "tp", "stages")}
    total = settings.pop("batch_size", 128) * devices
    candidates = [("ddp", {"strategy": "ddp"}), ("fsdp", {"strategy": "fsdp"})]
    for tp in (t for t in range(2, min(devices, MOST_TP) + 1) if devices % t == 0):
        over = ("ddp", "fsdp") if devices > tp else ("ddp",)  # alone, tp has no data parallelism to choose
        candidates += [(f"tp {tp} x {data} {devices // tp}" if devices > tp else f"tp {tp}",
                        {"strategy": data, "tp": tp}) for data in over]
    if devices > 1:
        candidates.append((f"pipeline of {devices} stages", {"strategy": "pipeline", "stages": devices}))
    found = []
    for name, flags in candidates:
        replicas = MemoryQuery(model, nproc=devices, **flags).replicas
        try:
            found.append(Candidate(name, flags, estimate(model, nproc=devices, batch_size=total // replicas, **flags,
                                                      **settings)))
        except UserError as e:  # no plan for tensor parallelism, a model that cannot be cut in stages
            found.append(Candidate(name, flags, None, str(e)))
    return found, next((layout for layout in found if layout.fits), None)


def render_layouts(model: str, devices: int, found: list[Candidate], picked: Candidate | None) -> str:
    """The table of layouts and the pick."""
    some = next((layout.estimate for layout in found if layout.estimate is not None), None)
    if some is None:
        return f"no layout of {devices} devices can train {model}: {found[0].why}"
    q = some.query
    total = q.batch_size * q.replicas
    lines = [f"model {model}, image {some.image_hw[0]}x{some.image_hw[1]}x{q.channels}, global batch {total} "
             f"(--batch-size x --devices) in every layout, precision {q.mixed_precision}, optimizer {q.optimizer}, "
             f"{devices} devices", "",
             "| layout | batch per replica | per device | largest global batch that fits | fits |",
             "|---|---:|---:|---:|---|"]
    for layout in found:
        est = layout.estimate
        if est is None:
            lines.append(f"| {layout.name} | - | - | - | cannot run: {layout.why} |")
            continue
        verdict = "-" if est.fits is None else "yes" if est.fits else "no"
        largest = "-" if est.largest_batch_size is None else est.largest_batch_size * est.query.replicas
        lines.append(f"| {layout.name} | {est.query.batch_size} | {human_bytes(est.total)} | {largest} | {verdict} |")
    lines.append("")
    if some.device_memory is None:
        return "\n".join(lines + ["no pick: no GPU here; give --device-memory (e.g. 80GB) to compare with a device"])
    usable = f"{human_bytes(some.usable_memory)} usable of {some.device_memory / 1e9:.4g} GB"
    if picked is None:
        return "\n".join(lines + [f"none fits in {usable}: lower --batch-size, use --activation-checkpointing or "
                                  f"bf16, or more devices"])
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in picked.flags.items())
    return "\n".join(lines + [f"picks {picked.name} ({flags} --nproc {devices}): {human_bytes(picked.estimate.total)} "
                              f"of {usable}; the first that fits in the order {PICK_ORDER}, from the least each "
                              f"step communicates (docs/parallel.md)"])


def _pipeline_estimate(query: MemoryQuery, net: nn.Module, channels: int, hw: tuple[int, int],
                       device_memory: int | None) -> MemoryEstimate:
    """Each pipeline process's bytes: its stages' weights, gradients and optimizer state, and the activations of
    the micro-batches it holds at once (every one under GPipe; under 1F1B one per stage from it to the last, so the
    first holds the most; under interleaved 1F1B, where each process holds stages s and s + N of 2N, the
    micro-batches of its warm-up, as torch's schedule orders them), each stage's step measured on the inputs the
    stages before it give. The estimate's parts are the largest process's."""
    import copy

    from ..parallel.split import StageForward, plan_split, stage_model

    pipeline = query.layout.stages
    count = query.layout.pp  # processes in one pipeline
    micro, schedule = pipeline.cut(query.batch_size, count)
    per_process = pipeline.chunks_per_process
    split = plan_split(net, count * per_process)
    inputs = {n: torch.randn(n, channels, *hw) for n in MEASURED_BATCHES}
    chunks = []  # (state bytes, activation fit of one micro-batch of the batch) per model stage, in order
    for c in range(count * per_process):
        stage = StageForward(stage_model(copy.deepcopy(net), split, [c]), split.stage_pieces(c))
        last = c == count * per_process - 1
        fit = fit_activations(stage, channels, hw, query.mixed_precision, timeline=lambda n: inputs_timeline(
            stage, inputs[n], query.mixed_precision, scored=last))
        with torch.no_grad(), _precision_context(query.mixed_precision):
            inputs = {n: stage(x).float() for n, x in inputs.items()}
        chunks.append((state_bytes(stage, "ddp", 1, query.optimizer), fit))
    stages, largest = [], None
    for s in range(count):
        mine = [s + k * count for k in range(per_process)]
        held = _micro_batches_held(schedule, micro, count, per_process, s)
        # at a batch b each of `held` micro-batches of b / micro samples, each through one of this process's
        # stages: counted as through the one that holds the most
        fit = max((chunks[c][1] for c in mine), key=lambda f: f.at(query.batch_size))
        scaled = ActivationFit([(held * c, held * p / micro) for c, p in fit.lines], fit.batches)
        state = {k: sum(chunks[c][0][k] for c in mine) for k in chunks[mine[0]][0]}
        parts = {**state, "activations": scaled.at(query.batch_size)}
        stages.append({"stage": s + 1, "parts": [split.stage_parts(mine[0])[0], split.stage_parts(mine[-1])[-1]],
                       "chunks": [[split.stage_parts(c)[0], split.stage_parts(c)[-1]] for c in mine],
                       "micro_batches_held": held, "bytes": {**parts, "total": sum(parts.values())}})
        if largest is None or sum(parts.values()) > sum(largest[0].values()):
            largest = (parts, scaled)
    return MemoryEstimate(query, hw, largest[0], largest[1], device_memory, stages=stages)


def _micro_batches_held(schedule: str, micro: int, count: int, per_process: int, s: int) -> int:
    """Micro-batches whose activations process `s` of a pipeline of `count` holds at once: every one under GPipe;
    under 1F1B those of its warm-up, one per stage from it to the last; under interleaved 1F1B its warm-up's
    forwards over its stages, as torch's ScheduleInterleaved1F1B orders them, and the one in its steady state."""
    if schedule == "gpipe":
        return micro * per_process
    if schedule == "1f1b":
        return min(micro, count - s)
    per_round = micro // max(1, micro // count)
    return min(micro * per_process, (per_process - 1) * per_round + 2 * (count - 1 - s) + 1)


# -- text -------------------------------------------------------------------------------------------------------
PART_LABELS = {
    "parameters": "parameters (fp32)",
    "buffers": "buffers",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state",
    "gradient_buckets": "gradient buckets (DDP)",
    "gathered_parameters": "gathered parameters (transient)",
    "activations": "activations",
}


def render(est: MemoryEstimate) -> str:
    """The header, the table of parts, how activations were measured, and the verdict."""
    q, (h, w), act = est.query, est.image_hw, est.activations
    lines = [f"model {q.model}, image {h}x{w}x{q.channels}, {q.num_classes} classes, batch {q.batch_size} per "
             f"device, precision {q.mixed_precision}, strategy {q.strategy}, {q.nproc} process(es)"
             f"{f' (each layer split over --tp {q.tp})' if q.tp > 1 else ''}, optimizer "
             f"{q.optimizer}, activation checkpointing {'on' if q.activation_checkpointing else 'off'}", "",
             "| part | per device | bytes |", "|---|---:|---:|"]
    lines += [f"| {PART_LABELS[k]} | {human_bytes(v)} | {v:,} |" for k, v in est.parts.items()]
    lines += [f"| **total** | **{human_bytes(est.total)}** | **{est.total:,}** |", ""]
    small, large = act.batches
    constant, per_sample = act.line_at(q.batch_size)
    lines.append(f"activations: measured at batches {small} and {large} on the CPU (one real forward and backward "
                 f"each), scaled linearly to batch {q.batch_size}: {human_bytes(round(constant))} + "
                 f"{human_bytes(math.ceil(per_sample))} per sample")
    if est.stages:
        held = len(est.stages[0]["chunks"])
        lines[0] = lines[0].replace(f"{q.nproc} process(es)", f"{len(est.stages)} pipeline processes" +
                                    (f" of {held} stages each" if held > 1 else "") + f", schedule {q.schedule}")
        lines[2] = "| part | largest process | bytes |"
        lines.append("per pipeline process (the first and last part of each stage it holds: total, of which "
                     "activations of the micro-batches it holds at once):")
        lines += [f"  process {st['stage']} ({' + '.join(f'{a} .. {b}' for a, b in st['chunks'])}): "
                  f"{human_bytes(st['bytes']['total'])}"
                  f", activations {human_bytes(st['bytes']['activations'])} ({st['micro_batches_held']} micro-batch"
                  f"{'es' if st['micro_batches_held'] > 1 else ''})" for st in est.stages]
    return "\n".join(lines + _verdict_lines(est))


def _verdict_lines(est: MemoryEstimate) -> list[str]:
    if est.device_memory is None:
        return ["no verdict: no GPU here; give --device-memory (e.g. 80GB) to compare with a device"]
    device = f"{est.device_memory / 1e9:.4g} GB = {human_bytes(est.device_memory)}"
    usable = (f"{human_bytes(est.usable_memory)} usable ({USABLE_SHARE:.0%} of {device}; the rest is left to the "
              f"CUDA context and allocator fragmentation)")
    verdict = f"fits: uses {human_bytes(est.total)} of {usable}" if est.fits else \
        f"does not fit: needs {human_bytes(est.total)}, has {usable}"
    largest = est.largest_batch_size
    if largest is None:
        return [verdict]
    if largest == 0:
        return [verdict, f"not even batch 1 per device fits: {human_bytes(est.fixed_bytes)} do not grow with the "
                         f"batch, and batch 1 adds {human_bytes(est.activations.at(1))} of activations"]
    return [verdict, f"largest batch per device that fits: {largest}"]
