"""What `fit` builds once, before its loop: the runtime, the batch makers for each split, the model wrapped for the
strategy with its optimizer and schedule, the weight average and the checkpointer, gathered in one `Run`."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..config import AUTO_WORKERS, BatchPlan, DataConfig, ModelConfig, OptimConfig, Settings, TrainConfig, resolve
from ..data.batches import DeviceBatches, FillingBatches, LoaderBatches, decode_all, fits_on_device, model_input
from ..data.indices import SamplerOrder
from ..data.items import ItemCollate, kept_global_rng, layout_of, map_targets, workers_for
from ..data.regularise import Regularise
from ..data.sources.chunks import ChunkSet
from ..data.streams import StreamBatches, first_item, is_stream, item_zero, shards_itself
from ..data.transforms import Preprocess, augment_seed, default_preprocess
from ..data.types import ImageFiles, ImageSet, PreparedSet, StoredPixels, keep_in_memory
from ..errors import UserError, describe
from ..metrics import Loss, Measures, Monitor, check_batch_first, classifies
from ..models import is_user_model, model_code, model_name_of, trust
from ..parallel import Runtime, StepModule, on_meta
from ..steps import BatchCalls, StepJob, overrides, parts_of
from .checkpoint import Checkpointer, TrainState, newest_train_json, resumed_plan
from .ema import WeightAverage
from .hooks import UserCode
from .optim import make_optimizer, make_scheduler
from .own_step import NamedOptimizers, calls_for, check_several, optimizers_of, trial, trial_parts
from .schedules import Schedule, Stepping, check_monitor, constant, users_stepping
from .signals import LoopControls


# uint8 images read batch by batch (from image files, from shards, streamed from chunks)
FILE_SETS = (ImageFiles, PreparedSet, ChunkSet, StoredPixels)


@dataclass(frozen=True)
class Batching:
    """What the batch makers read of a run's settings: the data section, the batch plan, the run's seed (each
    batch's augmentation and order), whether the model takes channels_last inputs, and a stream's epoch length
    (--steps-per-epoch)."""

    data: DataConfig
    plan: BatchPlan
    seed: int
    channels_last: bool
    steps_per_epoch: int = 0
    decided_workers: dict[str, int] = field(default_factory=dict)  # --num-workers auto's decisions, kept on resume

    def with_plan(self, **changes: Any) -> "Batching":
        """The same with another batch plan (what `tune` tries)."""
        return replace(self, plan=replace(self.plan, **changes))


def make_batches(data: ImageSet | ImageFiles | Dataset, runtime: Runtime, b: Batching,
                 pre: Preprocess | None, train: bool, code: UserCode | None = None, where: str = "train_data",
                 whole: bool = False):
    """Batches for one split: built on the device when the decoded data fits there, else from a DataLoader; a
    user's own Dataset is read as its items are laid out (see data/items.py), each batch seeded; `whole`: its
    batches handed over as collated (data/items.Whole), for a step that takes them so."""
    d, code = b.data, code or UserCode()
    if isinstance(data, ChunkSet):  # scaletrain's own images, streamed
        return chunk_batches(data, runtime, b, pre, train)
    if is_stream(data):
        return stream_batches(data, runtime, b, train, code, where, whole)
    order = SamplerOrder(code.sampler, len(data), b.seed) if train and code.sampler is not None \
        else None  # type: ignore[arg-type]
    if order is not None and order.length < runtime.data_world:
        raise UserError(f"sampler: draws {order.length} indices per epoch, fewer than the {runtime.data_world} "
                        f"processes that share them")
    common = dict(train=train, rank=runtime.data_rank, world=runtime.data_world, seed=b.seed,
                  channels_last=b.channels_last, order=order)
    batch_size = b.plan.batch_per_process  # DataParallel splits it over its GPUs
    reg = regularisation(d, len(getattr(data, "classes", None) or ())) if train else None
    if not isinstance(data, (ImageSet, *FILE_SETS)):  # a user's Dataset of model-ready tensors
        if reg is not None:
            raise ValueError("--randaugment, --random-erasing, --mixup and --cutmix work on scaletrain's image data "
                             "(ImageSet, image files, prepared shards); a Dataset of model-ready tensors does its own")
        items = ItemCollate(read_layout(data, None if whole else code.batch_keys, where, whole), code.collate_fn,
                            where, whole)
        say = (lambda line: print(line, flush=True)) if runtime.is_main else None
        workers = workers_for(data, items, batch_size, d.num_workers, AUTO_WORKERS, where, say,
                              b.decided_workers.get(where))
        return LoaderBatches(data, runtime.device, batch_size, num_workers=workers, items=items,
                             seed_fn=code.seed_fn, **common)
    augment = d.augment
    on_device = isinstance(data, ImageFiles) and decodes_on_device(d.decode, runtime)
    if on_device and train and runtime.is_main and d.decode == "auto":
        print(f"{where}: JPEGs decoded on {runtime.device} in batches by torchvision's decoder (nvJPEG), a batch "
              f"ahead of the training (--decode auto on a GPU: 24.5x the CPU's decode on an H100; --decode workers "
              f"decodes with Pillow in the DataLoader workers)", flush=True)
    images = dict(pre=pre, augment=augment, regularise=reg)
    if isinstance(data, StoredPixels):  # larger than --cache-memory, decoded on disk: read batch by batch
        return LoaderBatches(data, runtime.device, batch_size, num_workers=d.workers(), **images, **common)
    if isinstance(data, ImageFiles) and data.keep is not None and not data.wanted_in_memory:
        if runtime.world_size == 1:  # larger than --cache-memory: the first pass decodes and keeps it on disk
            return FillingBatches(data, pre, runtime.device, batch_size, num_workers=d.workers(), held=False,
                                  augment=augment, regularise=reg, decode_on_device=on_device, **common)
        data = replace(data, keep=None)
    choice = d.data_on_device
    # a set of image files larger than --cache-memory is never decoded whole in host memory
    beyond = isinstance(data, ImageFiles) and data.keep is None and not keep_in_memory(d, data.nbytes)
    if choice == "yes" or (choice == "auto" and not beyond and fits_on_device(data.nbytes, runtime.device)):
        if isinstance(data, PreparedSet):
            data = ImageSet(data.read_all(), torch.from_numpy(data.labels.copy()), data.classes, data.recipe)
        elif isinstance(data, ImageFiles) and data.keep is not None and runtime.world_size == 1:
            # checked, not yet decoded (a folder's first run): decoded by the first pass as it trains, then held;
            # decoding the whole folder first would keep the first step waiting for it, at any folder size
            return FillingBatches(data, pre, runtime.device, batch_size, num_workers=d.workers(),
                                  augment=augment, regularise=reg, decode_on_device=on_device, **common)
        elif isinstance(data, ImageFiles):
            data = data.in_memory() if data.keep is not None else ImageSet(
                *decode_all(data, d.workers()), data.classes, data.recipe)
        return DeviceBatches(data, pre, runtime.device, batch_size, augment=augment, regularise=reg,
                             reads_inputs=runtime.reads_inputs, **common)
    if isinstance(data, ImageFiles) and data.keep is not None:  # wanted in memory, more than the device holds
        data = data.in_memory()
    return LoaderBatches(data, runtime.device, batch_size, num_workers=d.workers(), **images,
                         decode_on_device=on_device and isinstance(data, ImageFiles), **common)


def decodes_on_device(decode: str, runtime: Runtime) -> bool:
    """Whether JPEGs streamed from image files are decoded on the training device (--decode)."""
    return decode == "device" or (decode == "auto" and runtime.device.type == "cuda")


def stream_batches(data, runtime: Runtime, b: Batching, train: bool, code: UserCode,
                   where: str, whole: bool = False) -> StreamBatches:
    """Batches of a user's IterableDataset (see data/streams.py): the ranks agree before each batch whether every
    one of them has it."""
    if code.sampler is not None and train:
        raise UserError(f"sampler: {where} is an IterableDataset, which gives its items in its own order; a sampler "
                        f"draws indices of a Dataset with len() and item access")
    if shards_itself(data) and runtime.data_world != runtime.world_size:
        raise UserError(f"{where} reads its share of the stream by the process's rank (shards_by_rank), but the "
                        f"processes of one split layer must read the same items (--tp "
                        f"{runtime.world_size // runtime.data_world}); let scaletrain deal the items out "
                        f"(shards_by_rank = False), or train without --tp")
    layout = None if whole else layout_of(first_item(data, where), code.batch_keys, where=where)
    items = ItemCollate(layout, code.collate_fn, where, whole)
    batches = StreamBatches(data, runtime.device, b.plan.batch_per_process, items, train=train,
                            rank=runtime.data_rank, world=runtime.data_world, seed=b.seed,
                            total=runtime.sum_over_replicas,
                            num_workers=b.data.workers(), channels_last=b.channels_last,
                            steps_per_epoch=b.steps_per_epoch, grad_accum=b.plan.grad_accum)
    if train and batches.resumable and b.data.workers() and runtime.is_main:
        print(f"{where}: read in the training process (state_dict() must be the trained batches'), not in "
              f"--num-workers {b.data.workers()} DataLoader workers", flush=True)
    return batches


def chunk_batches(data: ChunkSet, runtime: Runtime, b: Batching, pre: Preprocess, train: bool
                  ) -> StreamBatches:
    """Batches of chunked data (see data/sources/chunks.py): streamed as a stream is, each batch of uint8 images
    made a model input on the device as the other image data's are; read in the training process (its state after
    each batch is what a resumed run continues from)."""
    d = b.data
    reg = regularisation(d, len(data.classes)) if train else None
    augment = d.augment if train else ()
    seed, rank = b.seed, runtime.data_rank
    recipe = lambda x, y, epoch, batch: model_input(  # noqa: E731
        x, y, pre, augment, reg, b.channels_last, augment_seed(seed, rank, epoch, batch))
    batch = b.plan.batch_per_process
    batches = StreamBatches(data.reading(train, seed), runtime.device, batch, default_collate, train=train, rank=rank,
                            world=runtime.data_world, seed=seed, total=runtime.sum_over_replicas, num_workers=0,
                            grad_accum=b.plan.grad_accum, recipe=recipe)
    if train:  # its length is known: every process reads as many batches
        batches.steps = data.steps(runtime.data_world, batch)
    return batches


def regularisation(d: DataConfig, num_classes: int) -> Regularise | None:
    """The batch regularisation the data settings ask for; None when all of it is off."""
    reg = Regularise(d.randaugment, d.random_erasing, d.mixup, d.cutmix, d.mixup_prob,
                     d.mixup_switch_prob, num_classes)
    return reg if reg.on_device or reg.mixes else None


def steps_per_epoch(batches, o: OptimConfig, grad_accum: int, code: UserCode) -> int:
    """Optimizer steps per epoch, for the schedule: counted from the batches (`grad_accum` micro-batches a step),
    or --steps-per-epoch for a stream (refused on one line when a schedule needs the run's length and it is not
    set)."""
    if batches.steps is not None:
        if o.steps_per_epoch:
            raise UserError(f"--steps-per-epoch {o.steps_per_epoch}: only for a stream (an IterableDataset given to "
                            f"fit); this training set gives {batches.steps} batches per epoch")
        return -(-batches.steps // grad_accum)
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


def read_layout(data: Dataset, batch_keys, where: str, whole: bool = False):
    """The layout of a user's Dataset, read from its first item (drawing nothing from the process's generators);
    None for batches taken whole."""
    if len(data) == 0:  # type: ignore[arg-type]
        raise UserError(f"{where}: the dataset is empty")
    if whole:
        return None
    with kept_global_rng():
        return layout_of(data[0], batch_keys, where=where)


def prepare_model(model: nn.Module, runtime: Runtime, m: ModelConfig, optim: OptimConfig, lr: float,
                  steps_per_epoch: int, code: UserCode | None = None, find_unused: bool = False,
                  calls: BatchCalls | None = None, several: NamedOptimizers | None = None):
    """(model to train, the same unwrapped for evaluation and saving, optimizer, its schedule (a Stepping)): the
    user's optimizer and scheduler when `code` brings them (or its Step, `several` when it runs its optimizers
    itself), else the optimizer settings' at peak rate `lr` (the batch plan's). `find_unused`: DDP looks for
    parameters without a gradient at each step. With a Step whose train_step takes the batch (`calls`), what
    trains is a module whose forward is that step."""
    code = code or UserCode()
    if m.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if several is not None:  # made over the model's parameters, which stay the same objects on the device
        wrapped = runtime.prepare_unwrapped(model, code.step.train_step, m.sync_bn,  # type: ignore[union-attr]
                                            m.activation_checkpointing)
        return wrapped, wrapped.model, several, constant(next(iter(several.optimizers.values())))
    if code.optimizer:
        make = lambda net: _users_optimizer(code.optimizer, net)  # noqa: E731
    elif code.step is not None and overrides(code.step, "optimizers"):
        make = lambda net: next(iter(optimizers_of(code.step, net).values()))  # noqa: E731
    else:
        make = lambda net: make_optimizer(net, optim, lr)  # noqa: E731
    step = code.step.train_step if calls is not None and calls.train_whole and not calls.keywords else None
    model, optimizer = runtime.prepare(model, make, sync_bn=m.sync_bn,
                                       activation_checkpointing=m.activation_checkpointing,
                                       find_unused_parameters=find_unused, step=step,
                                       compile_scope=m.compile_scope if m.compile else "")
    if code.scheduler is not None:
        schedule = users_stepping(Schedule.of(code.scheduler), optimizer, steps_per_epoch * optim.epochs,
                                  optim.epochs)
    elif code.optimizer or (code.step is not None and overrides(code.step, "optimizers")):
        schedule = constant(optimizer)  # the user's optimizer keeps its own rates, as in their loop without one
    else:
        schedule = Stepping(make_scheduler(optimizer, optim, steps_per_epoch), "step")
    plain = runtime.unwrap(model)  # evaluated and saved as it is; only training runs the compiled graph
    if m.compile and runtime.is_main:
        print(f"--compile: {runtime.compiled} compiled by torch.compile during the first steps, which wait for it; "
              f"a batch of another size (an epoch's last) and validation run eagerly", flush=True)
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
    monitor: Monitor | None  # what picks best.safetensors and early stopping; None without a validation set, or
    # when --monitor auto finds no validation value whose sense is known (best.safetensors: the last epoch's)
    code: UserCode
    controls: LoopControls  # stop requests, the failure tests' faults, the launch time: the loop's only outside
    calls: BatchCalls  # how a batch reaches the model: loss_fn(model(x), y), model(**batch), the user's Step
    job: StepJob  # what the user's Step is given while it runs (bound to it until close); its optimizers
    parts: list[str] = field(default_factory=list)  # the named losses a Step returns (train_<name>)
    workers: dict[str, int] = field(default_factory=dict)  # each split's DataLoader workers (summary.json)

    @property
    def loss(self) -> Loss:
        return self.measures.loss

    @property
    def plan(self):
        return self.settings.plan

    @property
    def compiled_batch(self) -> int | None:
        """The batch size the training model is compiled for (--compile), else None."""
        return self.plan.batch_per_process if self.settings.model.compile else None

    @property
    def validated(self) -> list[tuple[str, Callable[[], Any]]]:
        """(metrics column prefix, a context giving the model to validate) of what each epoch validates: the
        trained weights, then their average in their place."""
        return [("", lambda: contextlib.nullcontext(self.plain))] + \
            ([("ema_", self.ema.applied)] if self.ema is not None else [])

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
        self.job.unbind(self.code.step)


def settings_for(config: TrainConfig | Settings, train_data: ImageSet | ImageFiles | Dataset,
                 runtime: Runtime) -> Settings:
    """The run's settings, resolved once: by scaletrain's launcher (the workers read them back; here only the
    devices are checked), else here from the user's config, this job's devices and the data's recipe (the whole
    config: it resolves it)."""
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
              preprocess: Preprocess | None = None, code: UserCode | None = None,
              controls: LoopControls | None = None) -> Run:
    """Make both splits' batches and the model, optimizer and schedule, the weight average and the checkpointer:
    every rank alike, seeded per rank for dropout and data randomness. A user's Dataset and model are tried on the
    first item before anything trains. (The whole settings: each part gets the sections it reads, and the Run
    and the saved weights' metadata record them all.)"""
    code, plan = code or UserCode(), settings.plan
    newest = newest_train_json(settings.run.output_dir)  # a resumed run keeps --num-workers auto's decisions
    batching = Batching(settings.data, plan, settings.run.seed, settings.model.channels_last,
                        settings.optim.steps_per_epoch, (newest[1].get("num_workers") or {}) if newest else {})
    if settings.run.save_initial_weights and not settings.run.output_dir:
        raise UserError("--save-initial-weights writes initial.safetensors into the run folder: set "
                        "config.run.output_dir")
    if val_data is None and settings.optim.early_stopping:
        raise UserError("--early-stopping watches a validation value (--monitor): give a validation set (val_data)")
    runtime.check_data(train_data, val_data)
    model = model_of(model, runtime, settings.run.seed)
    model_name = model_name_of(model)  # before any wrapping renames it
    images = isinstance(train_data, (ImageSet, *FILE_SETS))
    preprocess = preprocess or (default_preprocess(train_data, settings.data) if images else None)
    if not is_stream(train_data) and len(train_data) < runtime.data_world:  # type: ignore[arg-type]
        raise ValueError(f"{len(train_data)} training samples cannot be shared among {runtime.data_world} "
                         f"processes")
    runtime.seed(settings.run.seed + runtime.random_rank)  # dropout and dataset randomness differ per process
    loss = Loss(code.loss_fn, settings.optim.label_smoothing, code.output_key)
    calls = calls_for(model, train_data, code, loss, images)
    train_batches = make_batches(train_data, runtime, batching, preprocess, True, code, "train_data",
                                 calls.train_whole)
    val_batches = None if val_data is None else \
        make_batches(val_data, runtime, batching, preprocess, False, code, "val_data", calls.eval_whole)
    named = optimizers_of(code.step, model) if code.step is not None else None
    several = NamedOptimizers(named) if named is not None and len(named) > 1 else None  # run by the step itself
    if several is not None:
        check_several(several.optimizers, plan.grad_accum, settings.model.compile, code)
    runtime.check_model(model, train_batches, code.step)  # a pipeline's: the model can be cut in stages
    job = StepJob(runtime, several, settings.optim.clip_grad_norm).bind(code.step, model)
    tried = calls.train_whole and not calls.keywords  # a Step's losses, named by a first trial
    whole = not on_meta(model)  # a model on the meta device is tried once its part is materialised
    with job.unbound_on_error(code.step):  # else bound until Run.close
        parts = trial_parts(calls, model.to(runtime.device), train_batches, runtime, job) if tried and whole else []
        find_unused = several is None and look_for_unused(model, train_batches, calls, runtime,
                                                          settings.model.find_unused_parameters)
        model, plain, optimizer, schedule = prepare_model(
            model, runtime, settings.model, settings.optim, plan.lr,
            steps_per_epoch(train_batches, settings.optim, plan.grad_accum, code), code, find_unused, calls, several)
        if tried and not whole:
            parts = trial_parts(calls, plain, train_batches, runtime, job)
        own = code.step is not None  # a Step's validation is tried on the validation set, the only one it scores
        scored = (images, True) if images else first_scored(
            calls, val_data if own else train_data, val_batches if own else train_batches, plain, runtime,
            "val_data" if own else "train_data", say=runtime.is_main)
        measures = Measures(loss, scored[0], code.metrics or {}, has_loss=scored[1])
        monitor = Monitor.of(settings.optim.monitor, settings.optim.monitor_mode, measures) \
            if val_data is not None else None
        if val_data is not None and monitor is None and settings.optim.early_stopping:
            raise UserError(f"--early-stopping watches a validation value whose sense is known, and none of "
                            f"{', '.join(f'val_{n}' for n in measures.names())} says it (a metric function does "
                            f"not): name one with --monitor and --monitor-mode max or min")
        check_monitor(schedule, [f"val_{n}" for n in measures.names()], measures.higher_is_better,
                      val_data is not None)
        ema = WeightAverage(plain, settings.optim.ema_decay) if settings.optim.ema_decay else None
        workers = {where: workers_of(batches) for where, batches in (("train_data", train_batches),
                                                                     ("val_data", val_batches)) if batches is not None}
        checkpointer = Checkpointer(Path(settings.run.output_dir), runtime, plain, optimizer, schedule, settings.run,
                                    settings.to_dict(), plan, ema, code.names(), code.step, workers) \
            if settings.run.output_dir else None
        meta = {"model": model_name, "classes": classes_of(train_data),
                "preprocess": asdict(preprocess) if preprocess else None, "config": settings.to_dict(),
                "plan": plan.to_dict(), **({"hooks": code.names()} if code.names() else {})}
        if is_user_model(model_name):  # the file and its SHA-256: what may rebuild it later
            meta["model_code"] = model_code(model_name).to_dict()
            if runtime.is_main:
                trust(model_code(model_name))
        return Run(settings, runtime, model, plain, optimizer, schedule, train_batches, val_batches, ema,
                   checkpointer, meta, samples(train_data, code.sampler),
                   samples(val_data) if val_data is not None else 0,
                   measures, monitor, code, controls or LoopControls.of_this_process(), calls, job, parts, workers)


def model_of(model: nn.Module | Callable[[], nn.Module], runtime: Runtime, seed: int) -> nn.Module:
    """The model to train: the user's object as it is, or what a function of no arguments returns, called after
    seeding every process with the run's seed (so that every process, on any layout, starts from the weights the
    whole model has at that seed), on the meta device where the strategy splits the model."""
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise UserError(f"model: expected a torch.nn.Module, or a function of no arguments that returns one; got "
                        f"{describe(model)}")
    runtime.seed(seed)
    return runtime.build(model)


def workers_of(batches) -> int:
    """The DataLoader workers that read a split's batches (0: read in the training process or on the device)."""
    return getattr(getattr(batches, "loader", None), "num_workers", 0)


def classes_of(data) -> list[str] | None:
    """The class names a dataset carries as torchvision's folders do (`classes`, a list of names), looked for
    through Subsets; None when it has none (or `classes` is something else, such as their count)."""
    while data is not None:
        classes = getattr(data, "classes", None)
        if isinstance(classes, (list, tuple)):
            return list(classes)
        data = getattr(data, "dataset", None)
    return None


def samples(data, sampler=None) -> int | None:
    """The samples of a split's epoch: the dataset's size, or the indices a sampler draws per epoch; None for a
    stream (counted as it is read)."""
    return None if is_stream(data) else len(sampler) if sampler is not None else len(data)


def look_for_unused(model: nn.Module, batches, calls: BatchCalls, runtime: Runtime, setting: str) -> bool:
    """Whether DistributedDataParallel must look for parameters without a gradient at each step: as
    --find-unused-parameters says, or with auto (2 or more DDP processes) when one forward and backward on the first
    training batch leaves any without a gradient on some process (the console names the first few)."""
    if setting != "auto":
        return setting == "yes"
    if not runtime.replicates:
        return False
    unused = unused_parameters(model.to(runtime.device), batches, calls, runtime)
    anywhere = runtime.sum(torch.tensor([float(bool(unused))], device=runtime.device)).item() > 0
    if anywhere and runtime.is_main:
        names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        which = f"{len(unused)} parameter(s) got no gradient on the first batch ({names})" if unused else \
            "some parameters got no gradient on another process's first batch"
        print(f"{which}: DistributedDataParallel looks for unused parameters at every step "
              f"(--find-unused-parameters no turns that off)", flush=True)
    return anywhere


def unused_parameters(model: nn.Module, batches, calls: BatchCalls, runtime: Runtime) -> list[str]:
    """The trainable parameters, by name, that get no gradient from one forward and backward on this rank's first
    training batch. Nothing of the run changes: no step is taken, the gradients are cleared, and the buffers
    (BatchNorm statistics) and every random generator are as they were."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    called = StepModule(model, calls.step.train_step) if calls.train_whole and not calls.keywords else model
    with trial(model, runtime, calls.step):
        x, y = batches.first_batch()
        with runtime.autocast():
            value = parts_of(calls.train_losses(called, x, y))[0] if calls.train_whole else \
                calls.train_losses(called, x, y)
        value.backward()
        return [name for name, p in trainable if p.grad is None]  # the gradients are cleared on leaving


@torch.no_grad()
def first_scored(calls: BatchCalls, data: Dataset | None, batches, model: nn.Module, runtime: Runtime, where: str,
                 say: bool) -> tuple[bool, bool]:
    """Read a user's first item as the batches will and score it as validation will (in evaluation mode, drawing
    nothing from any generator), so that an item, an output or a loss the loop cannot use is refused before the
    first step. Returns (whether the task is single-label classification, outputs N x classes against integer
    labels: what validation accuracy is measured for; whether validation has a loss)."""
    if data is None:  # a Step's, without a validation set
        return False, True
    item = item_zero(data, where)
    with kept_global_rng():
        x, y = batches.items([item])  # type: ignore[misc]
    layout = batches.items.layout  # type: ignore[attr-defined]
    raw = layout.parts(item)[0] if layout is not None and layout.image is not None else item
    if say and getattr(raw, "dtype", None) in (torch.uint8, np.uint8):
        print(f"{where}: uint8 images become float inputs in [0, 1]", flush=True)
    was_training = model.training
    model.eval()
    try:
        with runtime.autocast():
            scored = calls.score(model, x.to(runtime.device), map_targets(lambda t: t.to(runtime.device), y))
    finally:
        model.train(was_training)
    has_loss = scored.loss is not None or not (calls.eval_whole and not calls.keywords)
    has_loss = has_loss and not (calls.keywords and calls.loss.fn is None and scored.loss is None)
    out, y, loss = scored.outputs, scored.targets, calls.loss
    if not isinstance(out, torch.Tensor) or calls.eval_gathers:  # a structure for the Metrics alone (a detector's
        return False, has_loss  # boxes), or every rank's rows gathered by the step
    check_batch_first(out, where)
    if isinstance(y, torch.Tensor) and not y.is_floating_point() and out.ndim == y.ndim + 1 and out.ndim >= 2 \
            and out.shape[2:] == y.shape[1:] and not 0 <= int(y.min()) <= int(y.max()) < out.shape[1]:
        value = int(y.max()) if int(y.max()) >= out.shape[1] else int(y.min())
        raise UserError(f"{where}: item 0 has label {value}, but the model gives {out.shape[1]} classes "
                        f"(labels must be 0..{out.shape[1] - 1})")
    if y is not None and scored.loss is None and has_loss:
        loss.sum(out, y)  # a loss that gives neither a scalar nor values per sample is refused here
    return classifies(out, y) and not overrides(calls.step, "eval_step"), has_loss  # a Step's: what it says
