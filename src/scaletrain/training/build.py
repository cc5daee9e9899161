"""What `fit` builds once, before its loop: the runtime, the batch makers for each split, the model wrapped for the
strategy with its optimizer and schedule, the weight average and the checkpointer, gathered in one `Run`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..config import DataConfig, Settings, TrainConfig, resolve
from ..data.batches import DeviceBatches, FillingBatches, LoaderBatches, decode_all, fits_on_device, model_input
from ..data.indices import SamplerOrder
from ..data.items import ItemCollate, kept_global_rng, layout_of, map_targets
from ..data.regularise import Regularise
from ..data.sources.chunks import ChunkSet
from ..data.streams import StreamBatches, first_item, is_stream, item_zero
from ..data.transforms import Preprocess, augment_seed, default_preprocess
from ..data.types import ImageFiles, ImageSet, PreparedSet
from ..errors import UserError, describe
from ..metrics import Loss, Measures, Monitor, check_batch_first, classifies
from ..models import is_user_model, model_code, trust
from ..parallel import Runtime
from .checkpoint import Checkpointer, TrainState, resumed_plan
from .ema import WeightAverage
from .hooks import UserCode
from .optim import make_optimizer, make_scheduler
from .schedules import Schedule, Stepping, check_monitor, constant, users_stepping
from .signals import LoopControls


# uint8 images read batch by batch (from image files, from shards, streamed from chunks)
FILE_SETS = (ImageFiles, PreparedSet, ChunkSet)


def make_batches(data: ImageSet | ImageFiles | Dataset, runtime: Runtime, settings: Settings,
                 pre: Preprocess | None, train: bool, code: UserCode | None = None, where: str = "train_data"):
    """Batches for one split: built on the device when the decoded data fits there, else from a DataLoader; a
    user's own Dataset is read as its items are laid out (see data/items.py), each batch seeded."""
    d, code = settings.data, code or UserCode()
    if isinstance(data, ChunkSet):  # scaletrain's own images, streamed
        return chunk_batches(data, runtime, settings, pre, train)
    if is_stream(data):
        return stream_batches(data, runtime, settings, train, code, where)
    order = SamplerOrder(code.sampler, len(data), settings.run.seed) if train and code.sampler is not None \
        else None  # type: ignore[arg-type]
    if order is not None and order.length < runtime.world_size:
        raise UserError(f"sampler: draws {order.length} indices per epoch, fewer than the {runtime.world_size} "
                        f"processes that share them")
    common = dict(train=train, rank=runtime.rank, world=runtime.world_size, seed=settings.run.seed,
                  channels_last=settings.model.channels_last, order=order)
    batch_size = settings.plan.batch_per_process  # DataParallel splits it over its GPUs
    reg = regularisation(d, len(getattr(data, "classes", None) or ())) if train else None
    if not isinstance(data, (ImageSet, *FILE_SETS)):  # a user's Dataset of model-ready tensors
        if reg is not None:
            raise ValueError("--randaugment, --random-erasing, --mixup and --cutmix work on scaletrain's image data "
                             "(ImageSet, image files, prepared shards); a Dataset of model-ready tensors does its own")
        items = ItemCollate(read_layout(data, code.batch_keys, where), code.collate_fn, where)
        return LoaderBatches(data, runtime.device, batch_size, num_workers=d.num_workers, items=items,
                             seed_fn=code.seed_fn, **common)
    augment = d.augment
    choice = d.data_on_device
    if choice == "yes" or (choice == "auto" and fits_on_device(data.nbytes, runtime.device)):
        if isinstance(data, PreparedSet):
            data = ImageSet(data.read_all(), torch.from_numpy(data.labels.copy()), data.classes, data.recipe)
        elif isinstance(data, ImageFiles) and data.keep is not None and runtime.world_size == 1:
            # checked, not yet decoded (a folder's first run): decoded by the first pass, then held
            return FillingBatches(data, pre, runtime.device, batch_size, num_workers=d.num_workers,
                                  augment=augment, regularise=reg, **common)
        elif isinstance(data, ImageFiles):
            data = data.in_memory() if data.keep is not None else ImageSet(
                *decode_all(data, d.num_workers), data.classes, data.recipe)
        return DeviceBatches(data, pre, runtime.device, batch_size, augment=augment, regularise=reg, **common)
    if isinstance(data, ImageFiles) and data.keep is not None:  # wanted in memory, more than the device holds
        data = data.in_memory()
    on_device = isinstance(data, ImageFiles) and (d.decode == "device" or (
        d.decode == "auto" and runtime.device.type == "cuda"))
    return LoaderBatches(data, runtime.device, batch_size, num_workers=d.num_workers, pre=pre,
                         augment=augment, regularise=reg, decode_on_device=on_device, **common)


def stream_batches(data, runtime: Runtime, settings: Settings, train: bool, code: UserCode,
                   where: str) -> StreamBatches:
    """Batches of a user's IterableDataset (see data/streams.py): the ranks agree before each batch whether every
    one of them has it."""
    if code.sampler is not None and train:
        raise UserError(f"sampler: {where} is an IterableDataset, which gives its items in its own order; a sampler "
                        f"draws indices of a Dataset with len() and item access")
    items = ItemCollate(layout_of(first_item(data, where), code.batch_keys, where=where), code.collate_fn, where)
    o = settings.optim
    batches = StreamBatches(data, runtime.device, settings.plan.batch_per_process, items, train=train,
                            rank=runtime.rank, world=runtime.world_size, seed=settings.run.seed, total=runtime.sum,
                            num_workers=settings.data.num_workers, channels_last=settings.model.channels_last,
                            steps_per_epoch=o.steps_per_epoch, grad_accum=settings.plan.grad_accum)
    if train and batches.resumable and settings.data.num_workers and runtime.is_main:
        print(f"{where}: read in the training process (state_dict() must be the trained batches'), not in "
              f"--num-workers {settings.data.num_workers} DataLoader workers", flush=True)
    return batches


def chunk_batches(data: ChunkSet, runtime: Runtime, settings: Settings, pre: Preprocess, train: bool
                  ) -> StreamBatches:
    """Batches of chunked data (see data/sources/chunks.py): streamed as a stream is, each batch of uint8 images
    made a model input on the device as the other image data's are; read in the training process (its state after
    each batch is what a resumed run continues from)."""
    d = settings.data
    reg = regularisation(d, len(data.classes)) if train else None
    augment = d.augment if train else ()
    seed, rank = settings.run.seed, runtime.rank
    recipe = lambda x, y, epoch, batch: model_input(  # noqa: E731
        x, y, pre, augment, reg, settings.model.channels_last, augment_seed(seed, rank, epoch, batch))
    batch = settings.plan.batch_per_process
    batches = StreamBatches(data.reading(train, seed), runtime.device, batch, default_collate, train=train, rank=rank,
                            world=runtime.world_size, seed=seed, total=runtime.sum, num_workers=0,
                            grad_accum=settings.plan.grad_accum, recipe=recipe)
    if train:  # its length is known: every process reads as many batches
        batches.steps = data.steps(runtime.world_size, batch)
    return batches


def regularisation(d: DataConfig, num_classes: int) -> Regularise | None:
    """The batch regularisation the data settings ask for; None when all of it is off."""
    reg = Regularise(d.randaugment, d.random_erasing, d.mixup, d.cutmix, d.mixup_prob,
                     d.mixup_switch_prob, num_classes)
    return reg if reg.on_device or reg.mixes else None


def steps_per_epoch(batches, settings: Settings, code: UserCode) -> int:
    """Optimizer steps per epoch, for the schedule: counted from the batches, or --steps-per-epoch for a stream
    (refused on one line when a schedule needs the run's length and it is not set)."""
    o = settings.optim
    if batches.steps is not None:
        if o.steps_per_epoch:
            raise UserError(f"--steps-per-epoch {o.steps_per_epoch}: only for a stream (an IterableDataset given to "
                            f"fit); this training set gives {batches.steps} batches per epoch")
        return -(-batches.steps // settings.plan.grad_accum)
    if o.steps_per_epoch:
        return o.steps_per_epoch
    schedule = Schedule.of(code.scheduler)
    if (schedule is not None and schedule.needs_run_length) or \
            (code.optimizer is None and schedule is None and (o.scheduler != "constant" or o.warmup() > 0)):
        what = "your scheduler(optimizer, total_steps)" if schedule is not None else \
            f"--scheduler {o.scheduler}" + (f" with --warmup-epochs {o.warmup():g}" if o.warmup() else "")
        raise UserError(f"train_data is an IterableDataset without len(): {what} needs the run's length; set "
                        f"steps_per_epoch (--steps-per-epoch, optimizer steps per epoch), or use --scheduler constant "
                        f"--warmup-epochs 0" + (" (or a Schedule stepped per epoch)" if schedule is not None else ""))
    return 1  # a constant rate: the schedule never reads it


def read_layout(data: Dataset, batch_keys, where: str):
    """The layout of a user's Dataset, read from its first item (drawing nothing from the process's generators)."""
    if len(data) == 0:  # type: ignore[arg-type]
        raise UserError(f"{where}: the dataset is empty")
    with kept_global_rng():
        return layout_of(data[0], batch_keys, where=where)


def prepare_model(model: nn.Module, runtime: Runtime, settings: Settings, steps_per_epoch: int,
                  code: UserCode | None = None, find_unused: bool = False):
    """(model to train, the same unwrapped for evaluation and saving, optimizer, its schedule (a Stepping)): the
    user's optimizer and scheduler when `code` brings them, else the settings'. `find_unused`: DDP looks for
    parameters without a gradient at each step."""
    code, m, optim = code or UserCode(), settings.model, settings.optim
    if m.channels_last:
        model = model.to(memory_format=torch.channels_last)
    make = (lambda net: _users_optimizer(code.optimizer, net)) if code.optimizer else \
        (lambda net: make_optimizer(net, optim, settings.plan.lr))
    model, optimizer = runtime.prepare(model, make, sync_bn=m.sync_bn,
                                       activation_checkpointing=m.activation_checkpointing,
                                       find_unused_parameters=find_unused)
    if code.scheduler is not None:
        schedule = users_stepping(Schedule.of(code.scheduler), optimizer, steps_per_epoch * optim.epochs,
                                  optim.epochs)
    elif code.optimizer:  # the user's optimizer keeps its own rates, as in their loop without a scheduler
        schedule = constant(optimizer)
    else:
        schedule = Stepping(make_scheduler(optimizer, optim, steps_per_epoch), "step")
    plain = runtime.unwrap(model)  # evaluated and saved as it is; only training runs the compiled graph
    if m.compile:
        model = torch.compile(model)
    return model, plain, optimizer, schedule


def _users_optimizer(make: Callable, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = make(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer(parameters) returned {describe(optimizer)}; expected a torch.optim.Optimizer")
    return optimizer


@dataclass
class Run:
    """What `fit` builds once, before its loop, and every phase reads."""

    settings: Settings  # resolved once, read-only: the data's recipe filled in, the batch plan
    runtime: Runtime
    model: nn.Module  # what training runs: wrapped for the strategy, compiled with --compile
    plain: nn.Module  # the same weights unwrapped: validated and saved
    optimizer: torch.optim.Optimizer
    schedule: Stepping  # the learning-rate scheduler and when it is stepped (per optimizer step, per epoch)
    train_batches: Any  # DeviceBatches or LoaderBatches
    val_batches: Any
    ema: WeightAverage | None  # with --ema-decay
    checkpointer: Checkpointer | None  # None without a run folder (the Python API's default)
    meta: dict[str, Any]  # saved with the weights: model name, classes, preprocessing, config, batch plan
    train_samples: int | None  # None: a stream, counted per epoch
    val_samples: int | None  # 0: no validation set; None: a stream
    measures: Measures  # what validation measures: the loss, accuracy for a classifier, the user's metrics
    monitor: Monitor | None  # what picks best.safetensors and early stopping; None without a validation set
    code: UserCode
    controls: LoopControls  # stop requests, the failure tests' faults, the launch time: the loop's only outside

    @property
    def loss(self) -> Loss:
        return self.measures.loss

    @property
    def plan(self):
        return self.settings.plan

    @property
    def validated(self) -> list[tuple[str, nn.Module]]:
        """(metrics column prefix, model) of what each epoch validates: the trained weights, then their average."""
        return [("", self.plain)] + ([("ema_", self.ema.model)] if self.ema is not None else [])

    def say(self, message: str) -> None:
        """Print on the main process only."""
        if self.runtime.is_main:
            print(message, flush=True)

    def resume(self) -> TrainState:
        """Where training stands: the newest good checkpoint of the run folder restored, else the beginning."""
        state = (self.checkpointer.resume(self.say) if self.checkpointer else None) or TrainState()
        if isinstance(self.train_batches, StreamBatches):
            self.train_batches.resume(state, self.say)
        return state

    def close(self) -> None:
        """End the batch makers' DataLoader workers now (see LoaderBatches.close)."""
        for batches in (self.train_batches, self.val_batches):
            if batches is not None:
                batches.close()


def settings_for(config: TrainConfig | Settings, train_data: ImageSet | ImageFiles | Dataset,
                 runtime: Runtime) -> Settings:
    """The run's settings, resolved once: by scaletrain's launcher (the workers read them back; here only the
    devices are checked), else here from the user's config, this job's devices and the data's recipe."""
    images = isinstance(train_data, (ImageSet, *FILE_SETS))
    recipe = (train_data.recipe if images else "") or "digits"  # type: ignore[union-attr]
    if isinstance(config, Settings):
        if (config.plan.devices, config.plan.devices_per_process) != (runtime.devices, runtime.devices_per_process):
            raise UserError(f"the job's batch plan was made for {config.plan.devices} device(s), this job has "
                            f"{runtime.devices}")
        return config.with_recipe(recipe)
    plan = resumed_plan(config.run.output_dir, config.plan(runtime.devices, runtime.devices_per_process),
                        bool(config.optim.global_batch_size))
    return resolve(config, plan, recipe)


def build_run(model: nn.Module, train_data: ImageSet | ImageFiles | Dataset,
              val_data: ImageSet | ImageFiles | Dataset | None, settings: Settings, runtime: Runtime,
              preprocess: Preprocess | None = None, model_name: str | None = None, classes: list[str] | None = None,
              code: UserCode | None = None, controls: LoopControls | None = None) -> Run:
    """Make both splits' batches and the model, optimizer and schedule, the weight average and the checkpointer:
    every rank alike, seeded per rank for dropout and data randomness. A user's Dataset and model are tried on the
    first item before anything trains."""
    code, plan = code or UserCode(), settings.plan
    model_name = model_name or type(model).__name__  # as the user's class is called, before any wrapping renames it
    if val_data is None and settings.optim.early_stopping:
        raise UserError("--early-stopping watches a validation value (--monitor): give a validation set (val_data)")
    images = isinstance(train_data, (ImageSet, *FILE_SETS))
    preprocess = preprocess or (default_preprocess(train_data, settings.data) if images else None)
    if not is_stream(train_data) and len(train_data) < runtime.world_size:  # type: ignore[arg-type]
        raise ValueError(f"{len(train_data)} training samples cannot be shared among {runtime.world_size} "
                         f"processes")
    runtime.seed(settings.run.seed + runtime.rank)  # dropout and dataset randomness differ per rank
    train_batches = make_batches(train_data, runtime, settings, preprocess, True, code, "train_data")
    val_batches = None if val_data is None else \
        make_batches(val_data, runtime, settings, preprocess, False, code, "val_data")
    loss = Loss(code.loss_fn, settings.optim.label_smoothing, code.output_key)
    find_unused = look_for_unused(model, train_batches, loss, runtime, settings.model.find_unused_parameters)
    model, plain, optimizer, schedule = prepare_model(model, runtime, settings,
                                                       steps_per_epoch(train_batches, settings, code), code,
                                                       find_unused)
    classifier = images or try_first_item(train_data, train_batches, plain, loss, runtime, "train_data",
                                          say=runtime.is_main)
    measures = Measures(loss, classifier, code.metrics or {})
    monitor = Monitor.of(settings.optim.monitor, settings.optim.monitor_mode, measures) if val_data is not None \
        else None
    check_monitor(schedule, [f"val_{n}" for n in measures.names()], measures.higher_is_better, val_data is not None)
    ema = WeightAverage(plain, settings.optim.ema_decay) if settings.optim.ema_decay else None
    checkpointer = Checkpointer(Path(settings.run.output_dir), runtime, plain, optimizer, schedule, settings, ema,
                                code.names()) if settings.run.output_dir else None
    meta = {"model": model_name, "classes": classes or getattr(train_data, "classes", None),
            "preprocess": asdict(preprocess) if preprocess else None, "config": settings.to_dict(),
            "plan": plan.to_dict(), **({"hooks": code.names()} if code.names() else {})}
    if is_user_model(model_name):  # the file and its SHA-256: what may rebuild it later
        meta["model_code"] = model_code(model_name).to_dict()
        if runtime.is_main:
            trust(model_code(model_name))
    return Run(settings, runtime, model, plain, optimizer, schedule, train_batches, val_batches, ema, checkpointer,
               meta, samples(train_data, code.sampler), samples(val_data) if val_data is not None else 0,
               measures, monitor, code, controls or LoopControls.of_this_process())


def samples(data, sampler=None) -> int | None:
    """The samples of a split's epoch: the dataset's size, or the indices a sampler draws per epoch; None for a
    stream (counted as it is read)."""
    return None if is_stream(data) else len(sampler) if sampler is not None else len(data)


def look_for_unused(model: nn.Module, batches, loss: Loss, runtime: Runtime, setting: str) -> bool:
    """Whether DistributedDataParallel must look for parameters without a gradient at each step: as
    --find-unused-parameters says, or with auto (2 or more DDP processes) when one forward and backward on the first
    training batch leaves any without a gradient on some process (the console names the first few)."""
    if setting != "auto":
        return setting == "yes"
    if runtime.world_size == 1 or runtime.strategy.name != "ddp":
        return False
    unused = unused_parameters(model.to(runtime.device), batches, loss, runtime)
    anywhere = runtime.sum(torch.tensor([float(bool(unused))], device=runtime.device)).item() > 0
    if anywhere and runtime.is_main:
        names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        which = f"{len(unused)} parameter(s) got no gradient on the first batch ({names})" if unused else \
            "some parameters got no gradient on another process's first batch"
        print(f"{which}: DistributedDataParallel looks for unused parameters at every step "
              f"(--find-unused-parameters no turns that off)", flush=True)
    return anywhere


def unused_parameters(model: nn.Module, batches, loss: Loss, runtime: Runtime) -> list[str]:
    """The trainable parameters, by name, that get no gradient from one forward and backward on this rank's first
    training batch. Nothing of the run changes: no step is taken, the gradients are cleared, and the buffers
    (BatchNorm statistics) and every random generator are as they were."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    was_training = model.training
    with kept_global_rng(), torch.random.fork_rng(devices=[runtime.device] if runtime.device.type == "cuda" else []):
        x, y = batches.first_batch()
        model.train()
        with runtime.autocast():
            value = loss(loss.outputs(model(x)), y)
        value.backward()
    unused = [name for name, p in trainable if p.grad is None]
    for _, p in trainable:
        p.grad = None
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    model.train(was_training)
    return unused


@torch.no_grad()
def try_first_item(data: Dataset, batches: LoaderBatches, model: nn.Module, loss: Loss, runtime: Runtime, where: str,
                   say: bool) -> bool:
    """Read a user's first item as the batches will, run the model and the loss on it (in evaluation mode, drawing
    nothing from any generator), so that an item, an output or a loss the loop cannot use is refused before the
    first step. Returns whether the task is single-label classification (outputs N x classes, integer labels):
    what validation accuracy is measured for."""
    item = item_zero(data, where)
    with kept_global_rng():
        x, y = batches.items([item])  # type: ignore[misc]
    raw = batches.items.layout.parts(item)[0] if batches.items.layout.image is not None else item  # type: ignore
    if say and getattr(raw, "dtype", None) in (torch.uint8, np.uint8):
        print(f"{where}: uint8 images become float inputs in [0, 1]", flush=True)
    was_training = model.training
    model.eval()
    try:
        with runtime.autocast():
            out = loss.outputs(model(x.to(runtime.device)))
    finally:
        model.train(was_training)
    check_batch_first(out, where)
    y = map_targets(lambda t: t.to(runtime.device), y)
    if isinstance(y, torch.Tensor) and not y.is_floating_point() and out.ndim == y.ndim + 1 and out.ndim >= 2 \
            and out.shape[2:] == y.shape[1:] and not 0 <= int(y.min()) <= int(y.max()) < out.shape[1]:
        value = int(y.max()) if int(y.max()) >= out.shape[1] else int(y.min())
        raise UserError(f"{where}: item 0 has label {value}, but the model gives {out.shape[1]} classes "
                        f"(labels must be 0..{out.shape[1] - 1})")
    if y is not None:
        loss.sum(out, y)  # a loss that gives neither a scalar nor values per sample is refused here
    return classifies(out, y)
