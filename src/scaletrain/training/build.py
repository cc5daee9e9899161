"""What `fit` builds once, before its loop: the runtime, the batch makers for each split, the model wrapped for the
strategy with its optimizer and schedule, the weight average and the checkpointer, gathered in one `Run`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from ..config import BatchPlan, TrainConfig, parse_augment, parse_randaugment, resolve_recipe
from ..data.batches import DeviceBatches, FillingBatches, LoaderBatches, decode_all, fits_on_device
from ..data.items import ItemCollate, kept_global_rng, layout_of
from ..data.regularise import Regularise
from ..data.transforms import Preprocess, default_preprocess
from ..data.types import ImageFiles, ImageSet, PreparedSet
from ..errors import UserError, describe
from ..models import is_user_model, logits_of, model_code, trust
from ..parallel import Runtime
from .checkpoint import Checkpointer, TrainState
from .ema import WeightAverage
from .hooks import Loss, UserCode
from .optim import make_optimizer, make_scheduler


FILE_SETS = (ImageFiles, PreparedSet)  # uint8 images read batch by batch (from image files, from shards)


def make_batches(data: ImageSet | ImageFiles | Dataset, runtime: Runtime, cfg: TrainConfig, plan: BatchPlan,
                 pre: Preprocess | None, train: bool, code: UserCode | None = None, where: str = "train_data"):
    """Batches for one split: built on the device when the decoded data fits there, else from a DataLoader; a
    user's own Dataset is read as its items are laid out (see data/items.py), each batch seeded."""
    common = dict(train=train, rank=runtime.rank, world=runtime.world_size, seed=cfg.run.seed,
                  channels_last=cfg.model.channels_last)
    batch_size = plan.batch_per_process  # DataParallel splits it over its GPUs
    reg = regularisation(cfg, len(getattr(data, "classes", None) or ())) if train else None
    if not isinstance(data, (ImageSet, *FILE_SETS)):  # a user's Dataset of model-ready tensors
        if reg is not None:
            raise ValueError("--randaugment, --random-erasing, --mixup and --cutmix work on scaletrain's image data "
                             "(ImageSet, image files, prepared shards); a Dataset of model-ready tensors does its own")
        code = code or UserCode()
        items = ItemCollate(read_layout(data, code.batch_keys, where), code.collate_fn, where)
        return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, items=items,
                             seed_fn=code.seed_fn, **common)
    augment = parse_augment(cfg.data.augment)
    choice = cfg.data.data_on_device
    if choice == "yes" or (choice == "auto" and fits_on_device(data.nbytes, runtime.device)):
        if isinstance(data, PreparedSet):
            data = ImageSet(data.read_all(), torch.from_numpy(data.labels.copy()), data.classes, data.recipe)
        elif isinstance(data, ImageFiles) and data.keep is not None and runtime.world_size == 1:
            # checked, not yet decoded (a folder's first run): decoded by the first pass, then held
            return FillingBatches(data, pre, runtime.device, batch_size, num_workers=cfg.data.num_workers,
                                  augment=augment, regularise=reg, **common)
        elif isinstance(data, ImageFiles):
            data = data.in_memory() if data.keep is not None else ImageSet(
                *decode_all(data, cfg.data.num_workers), data.classes, data.recipe)
        return DeviceBatches(data, pre, runtime.device, batch_size, augment=augment, regularise=reg, **common)
    if isinstance(data, ImageFiles) and data.keep is not None:  # wanted in memory, more than the device holds
        data = data.in_memory()
    on_device = isinstance(data, ImageFiles) and (cfg.data.decode == "device" or (
        cfg.data.decode == "auto" and runtime.device.type == "cuda"))
    return LoaderBatches(data, runtime.device, batch_size, num_workers=cfg.data.num_workers, pre=pre,
                         augment=augment, regularise=reg, decode_on_device=on_device, **common)


def regularisation(cfg: TrainConfig, num_classes: int) -> Regularise | None:
    """The batch regularisation the config asks for; None when all of it is off."""
    d = cfg.data
    reg = Regularise(parse_randaugment(d.randaugment), d.random_erasing, d.mixup, d.cutmix, d.mixup_prob,
                     d.mixup_switch_prob, num_classes)
    return reg if reg.on_device or reg.mixes else None


def read_layout(data: Dataset, batch_keys, where: str):
    """The layout of a user's Dataset, read from its first item (drawing nothing from the process's generators)."""
    if len(data) == 0:  # type: ignore[arg-type]
        raise UserError(f"{where}: the dataset is empty")
    with kept_global_rng():
        return layout_of(data[0], batch_keys, where=where)


def prepare_model(model: nn.Module, runtime: Runtime, cfg: TrainConfig, plan: BatchPlan, steps_per_epoch: int,
                  code: UserCode | None = None):
    """(model to train, the same unwrapped for evaluation and saving, optimizer, scheduler): the user's optimizer
    and scheduler when `code` brings them, else the config's."""
    code = code or UserCode()
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    make = (lambda m: _users_optimizer(code.optimizer, m)) if code.optimizer else \
        (lambda m: make_optimizer(m, cfg, plan.lr))
    model, optimizer = runtime.prepare(model, make, sync_bn=cfg.model.sync_bn,
                                       activation_checkpointing=cfg.model.activation_checkpointing)
    if code.scheduler:
        scheduler = code.scheduler(optimizer, steps_per_epoch * cfg.optim.epochs)
    elif code.optimizer:  # the user's optimizer keeps its own rates, as in their loop without a scheduler
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    else:
        scheduler = make_scheduler(optimizer, cfg, steps_per_epoch)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or not hasattr(scheduler, "step"):
        raise UserError(f"scheduler(optimizer, total_steps) returned {describe(scheduler)}; expected a scheduler "
                        f"stepped once per optimizer step without a metric (ReduceLROnPlateau needs one)")
    plain = runtime.unwrap(model)  # evaluated and saved as it is; only training runs the compiled graph
    if cfg.model.compile:
        model = torch.compile(model)
    return model, plain, optimizer, scheduler


def _users_optimizer(make: Callable, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = make(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer(parameters) returned {describe(optimizer)}; expected a torch.optim.Optimizer")
    return optimizer


@dataclass
class Run:
    """What `fit` builds once, before its loop, and every phase reads."""

    cfg: TrainConfig  # resolved: the data's recipe filled in
    runtime: Runtime
    plan: BatchPlan
    model: nn.Module  # what training runs: wrapped for the strategy, compiled with --compile
    plain: nn.Module  # the same weights unwrapped: validated and saved
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_batches: Any  # DeviceBatches or LoaderBatches
    val_batches: Any
    ema: WeightAverage | None  # with --ema-decay
    checkpointer: Checkpointer | None  # None without a run folder (the Python API's default)
    meta: dict[str, Any]  # saved with the weights: model name, classes, preprocessing, config, batch plan
    train_samples: int
    val_samples: int  # 0: no validation set
    loss: Loss
    code: UserCode

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
        return (self.checkpointer.resume(self.say) if self.checkpointer else None) or TrainState()

    def close(self) -> None:
        """End the batch makers' DataLoader workers now (see LoaderBatches.close)."""
        for batches in (self.train_batches, self.val_batches):
            if batches is not None:
                batches.close()


def build_run(model: nn.Module, train_data: ImageSet | ImageFiles | Dataset,
              val_data: ImageSet | ImageFiles | Dataset | None, cfg: TrainConfig, runtime: Runtime,
              preprocess: Preprocess | None = None, model_name: str | None = None, classes: list[str] | None = None,
              code: UserCode | None = None) -> Run:
    """Resolve the config from the data, make both splits' batches and the model, optimizer and schedule, the
    weight average and the checkpointer: every rank alike, seeded per rank for dropout and data randomness. A
    user's Dataset and model are tried on the first item before anything trains."""
    code = code or UserCode()
    model_name = model_name or type(model).__name__  # as the user's class is called, before any wrapping renames it
    if val_data is None and cfg.optim.early_stopping:
        raise UserError("--early-stopping watches the validation accuracy: give a validation set (val_data)")
    plan = cfg.plan(runtime.devices, runtime.devices_per_process)
    images = isinstance(train_data, (ImageSet, *FILE_SETS))
    resolve_recipe(cfg, (train_data.recipe if images else "") or "digits")  # type: ignore[union-attr]
    preprocess = preprocess or (default_preprocess(train_data, cfg) if images else None)
    if len(train_data) < runtime.world_size:  # type: ignore[arg-type]
        raise ValueError(f"{len(train_data)} training samples cannot be shared among {runtime.world_size} "
                         f"processes")
    runtime.seed(cfg.run.seed + runtime.rank)  # dropout and dataset randomness differ per rank
    train_batches = make_batches(train_data, runtime, cfg, plan, preprocess, True, code, "train_data")
    val_batches = None if val_data is None else \
        make_batches(val_data, runtime, cfg, plan, preprocess, False, code, "val_data")
    model, plain, optimizer, scheduler = prepare_model(model, runtime, cfg, plan,
                                                       -(-len(train_batches) // plan.grad_accum), code)
    if not images:
        try_first_item(train_data, train_batches, plain, runtime, "train_data", say=runtime.is_main)
    ema = WeightAverage(plain, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
    checkpointer = Checkpointer(Path(cfg.run.output_dir), runtime, plain, optimizer, scheduler, cfg, plan, ema,
                                code.names()) if cfg.run.output_dir else None
    meta = {"model": model_name, "classes": classes or getattr(train_data, "classes", None),
            "preprocess": asdict(preprocess) if preprocess else None, "config": cfg.to_dict(),
            "plan": plan.to_dict(), **({"hooks": code.names()} if code.names() else {})}
    if is_user_model(model_name):  # the file and its SHA-256: what may rebuild it later
        meta["model_code"] = model_code(model_name).to_dict()
        if runtime.is_main:
            trust(model_code(model_name))
    return Run(cfg, runtime, plan, model, plain, optimizer, scheduler, train_batches, val_batches, ema, checkpointer,
               meta, len(train_data), len(val_data) if val_data is not None else 0,  # type: ignore[arg-type]
               Loss(code.loss_fn, cfg.optim.label_smoothing), code)


@torch.no_grad()
def try_first_item(data: Dataset, batches: LoaderBatches, model: nn.Module, runtime: Runtime, where: str,
                   say: bool) -> None:
    """Read a user's first item as the batches will and run the model on it (in evaluation mode, drawing nothing
    from any generator), so that an item or an output the loop cannot read is refused before the first step."""
    with kept_global_rng():
        item = data[0]
        x, y = batches.items([item])  # type: ignore[misc]
    raw = batches.items.layout.parts(item)[0] if batches.items.layout.image is not None else item  # type: ignore
    if say and getattr(raw, "dtype", None) in (torch.uint8, np.uint8):
        print(f"{where}: uint8 images become float inputs in [0, 1]", flush=True)
    was_training = model.training
    model.eval()
    try:
        with runtime.autocast():
            logits = logits_of(model(x.to(runtime.device)))
    finally:
        model.train(was_training)
    if logits.ndim != 2 or len(logits) != 1:
        raise UserError(f"the model returned {describe(logits)} for one item of {where}; expected logits N x classes")
    if y is not None and not y.is_floating_point() and not 0 <= int(y[0]) < logits.shape[1]:
        raise UserError(f"{where}: item 0 has label {int(y[0])}, but the model gives {logits.shape[1]} classes "
                        f"(labels must be 0..{logits.shape[1] - 1})")
