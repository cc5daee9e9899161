"""What a training run is asked to do: one dataclass per concern, composed into `TrainConfig`.

Each field carries its own one-line help; the CLI builds its flags from these fields and the run folder's
`config.yaml` is written from them, so the flags, the file and the code cannot drift apart.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from .errors import UserError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("onecycle", "cosine", "constant")
PRECISIONS = ("no", "fp16", "bf16")
AUGMENTATIONS = ("none", "crop", "rrc", "hflip", "vflip", "brightness", "contrast")
RECIPES = ("auto", "digits", "photo")
# What --augment auto means for each recipe.
RECIPE_AUGMENT = {"digits": "crop", "photo": "rrc,hflip"}
DEFAULT_LR = {"sgd": 0.05, "adam": 2e-3, "adamw": 2e-3}
DEFAULT_WARMUP_EPOCHS = 1.0  # capped at half the run (OptimConfig.warmup)
STRATEGIES = ("ddp", "dp", "fsdp", "pipeline")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # --strategy pipeline
CHUNKS_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}  # model stages each pipeline process holds
PER_DEVICE_STRATEGIES = ("ddp", "fsdp")  # one process per device: for inference and estimate-memory
LR_SCALINGS = ("none", "linear", "sqrt")
TRACKERS = ("tensorboard", "mlflow", "wandb")  # each is also the name of the package it needs
DEFAULT_CACHE_DIR = "~/.cache/scaletrain"  # $XDG_CACHE_HOME/scaletrain when that is set (see cache_root)


def cache_root(cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """--cache-dir as a path; the default follows XDG_CACHE_HOME when it is set."""
    if cache_dir == DEFAULT_CACHE_DIR and os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "scaletrain"
    return Path(cache_dir).expanduser()


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int, flag: str) -> int:
    """Bytes of a size such as 128MB, 10GB, 512MiB or a plain number of bytes; refused on one line naming `flag`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise UserError(f"{flag} {text}: expected a size such as 128MB, 10GB or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def schedule_runs(schedule: str, microbatches: int, stages: int) -> bool:
    """Whether torch.distributed.pipelining's schedule takes `microbatches` per batch through a pipeline of `stages`
    processes: 1F1B needs one per stage; interleaved 1F1B runs max(1, microbatches // stages) rounds of equal size;
    GPipe takes any number. The one place these rules are written (the settings' check, the batches' cuts and the
    memory estimate read it)."""
    if schedule == "1f1b":
        return microbatches >= stages
    if schedule == "interleaved-1f1b":
        return microbatches % max(1, microbatches // stages) == 0
    return microbatches >= 1


def microbatches_for(batch: int, stages: int, schedule: str, most: int = 0) -> tuple[int, str]:
    """(micro-batches, schedule) for a batch of `batch` rows: the most up to `most` (0: twice the stages) that divide
    the batch and that the schedule runs; when none does (an epoch's short last batch), the most that divide it,
    under GPipe's order, which runs any number."""
    most = most or 2 * stages
    dividing = [m for m in range(min(most, batch), 0, -1) if batch % m == 0]
    runs = [m for m in dividing if schedule_runs(schedule, m, stages)]
    return (runs[0], schedule) if runs else (dividing[0], "gpipe")


def check_schedule(schedule: str, microbatches: int, stages: int) -> None:
    """Refuse on one line --microbatches that --schedule cannot run through `stages` processes."""
    if schedule_runs(schedule, microbatches, stages):
        return
    if schedule == "1f1b":
        raise UserError(f"--schedule 1f1b needs at least as many --microbatches as stages ({stages}), got "
                        f"{microbatches}; raise it or use --schedule gpipe")
    rounds = max(1, microbatches // stages)
    raise UserError(f"--schedule {schedule} runs --microbatches in max(1, microbatches // stages) rounds of equal "
                    f"size: {microbatches} micro-batches over {stages} stages make {rounds} rounds, which do not "
                    f"divide them; give a multiple of {stages} (or fewer than {2 * stages}), or use --schedule "
                    f"gpipe")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class Kind:
    """A structured setting: written as text on the command line and in config files ('0.08,1.0', 'crop,hflip'),
    held as its typed value once resolved ((0.08, 1.0), ('crop', 'hflip')). `parse(flag, value)` takes the text
    or an already typed value and refuses anything else on one line naming the flag; `show(value)` writes the
    typed value back as the text that config.yaml records (and that `parse` reads again)."""

    parse: Callable[[str, Any], Any]
    show: Callable[[Any], str]


def _workers_value(flag: str, value: Any) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) and value >= 0 or
                                       isinstance(value, str) and value.isdigit()):
        raise UserError(f"{flag}: expected auto or a number of workers (0 or more), got {value!r}")
    return int(value)


WORKERS = Kind(_workers_value, str)
AUTO_WORKERS = 2  # what auto gives image files, prepared shards and streams (their reading costs: decoding)


def _kind(default: Any, help: str, kind: Kind, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, "kind": kind, **meta})


class Section:
    """A section of settings (data, model, optim, run): a user's config changes it freely; once resolved (see
    `Settings`) it is read-only, and assigning to it raises FrozenInstanceError."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_resolved"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to {type(self).__name__}.{name}: resolved settings are read-only; change the "
                f"TrainConfig and resolve it again")
        if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            raise UnknownSetting(_unknown_setting(_SECTION_OF.get(type(self).__name__, "?"), name))
        super().__setattr__(name, value)

    def typed(self) -> "Section":
        """A resolved, read-only copy: every structured setting as its typed value."""
        values = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = f.metadata.get("kind")
            values[f.name] = kind.parse(flag_of(f.name), value) if kind else value
        return type(self)(**values).frozen()

    def frozen(self) -> "Section":
        object.__setattr__(self, "_resolved", True)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The values as config.yaml records them: structured settings as their text."""
        return {f.name: setting_text(f, getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore


class UnknownSetting(UserError, AttributeError):
    """A setting's name that no section has, assigned in Python (`config.optim.epocs = 5`): refused at once, as an
    unknown key of a settings file and an unknown flag are, and not silently kept beside the real ones."""


_SECTION_OF = {"DataConfig": "data", "ModelConfig": "model", "OptimConfig": "optim", "RunConfig": "run"}


def _unknown_setting(section: str, name: str) -> str:
    """The one line refusing config.<section>.<name>: the setting of that name in another section, else the
    nearest names."""
    import difflib

    every = {f.name: s for s, cls in (("data", DataConfig), ("model", ModelConfig), ("optim", OptimConfig),
                                      ("run", RunConfig)) for f in dataclasses.fields(cls)}
    where = f"config.{section}.{name}" if section else f"config.{name}"
    if name in every:
        return f"{where}: no such setting; {name} is config.{every[name]}.{name} ({flag_of(name)})"
    if not section:  # a section's name
        close = difflib.get_close_matches(name, ["data", "model", "optim", "run"], n=1)
        return f"{where}: no such section (data, model, optim, run)" + (f"; did you mean config.{close[0]}?"
                                                                          if close else "")
    own = [n for n, s in every.items() if s == section]
    close = difflib.get_close_matches(name, own, n=1) or difflib.get_close_matches(name, list(every), n=1)
    hint = f"; did you mean config.{every[close[0]]}.{close[0]} ({flag_of(close[0])})?" if close else \
        "; `scaletrain config FILE` writes every setting with its help"
    return f"{where}: no such setting{hint}"


def setting_text(f: dataclasses.Field, value: Any) -> Any:
    """A setting's value as flags, config files and `--help` write it: a structured one's typed value as its text
    (a value still given as text stays as given); any other as it is."""
    kind = f.metadata.get("kind")
    return kind.show(value) if kind is not None and not isinstance(value, str) else value


def flag_of(name: str) -> str:
    """A setting's flag: crop_scale -> --crop-scale."""
    return "--" + name.replace("_", "-")


# -- the structured settings' kinds (their parsers are below, with the config files' reading) ------------------
def _range_value(flag: str, value: Any) -> tuple[float, float]:
    if isinstance(value, str):
        return parse_range(flag, value)
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise UserError(f"{flag} must be two numbers 'low,high', got {value!r}") from None
    return low, high


def _augment_value(flag: str, value: Any) -> tuple[str, ...] | Literal["auto"]:
    if value is None:
        raise UserError(f"{flag}: expected augmentations (or auto, or none), got nothing")
    if isinstance(value, str):
        return "auto" if value.strip() == "auto" else parse_augment(value)
    return parse_augment(",".join(value) or "none")


def _randaugment_value(flag: str, value: Any) -> tuple[int, int] | None:
    """None: off; (1, -1): TrivialAugment; (N, M): N operations at magnitude M of 10."""
    try:
        if value is None or isinstance(value, str):
            return parse_randaugment(value or "")
        if any(isinstance(v, bool) or not float(v).is_integer() for v in value):
            raise ValueError(value)
        n, m = (int(v) for v in value)
        if (n, m) != (1, -1) and (n < 1 or not 0 <= m <= 10):
            raise ValueError(value)
        return (n, m)
    except (TypeError, ValueError):
        raise UserError(f"{flag} must be 'N,M' (N >= 1 operations, magnitude M from 0 to 10), 'trivial' or '' "
                        f"for off, got {value!r}") from None


def _show_randaugment(value: tuple[int, int] | None) -> str:
    return "" if value is None else "trivial" if value == (1, -1) else f"{value[0]},{value[1]}"


def _nproc_value(flag: str, value: Any) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UserError(f"{flag} must be 'auto' or a positive integer, got '{value}'")
    return parse_nproc(str(value))  # type: ignore[return-value]


def _log_with_value(flag: str, value: Any) -> tuple[str, ...] | Literal["auto", "none"]:
    if value is None:
        raise UserError(f"{flag}: name a tracker ({', '.join(TRACKERS)}), or auto, or none; got nothing")
    text = value if isinstance(value, str) else ",".join(value)
    if text.strip() in ("auto", "none"):
        return text.strip()  # type: ignore[return-value]
    return parse_log_with(text)


RANGE = Kind(_range_value, lambda v: f"{float(v[0])!r},{float(v[1])!r}")
AUGMENT = Kind(_augment_value, lambda v: v if isinstance(v, str) else ",".join(v) or "none")
RANDAUGMENT = Kind(_randaugment_value, _show_randaugment)
NPROC = Kind(_nproc_value, str)
LOG_WITH = Kind(_log_with_value, lambda v: v if isinstance(v, str) else ",".join(v))


def _names_value(flag: str, value: Any) -> tuple[str, ...]:
    """Module names, comma-separated ('layer3,layer4'); '' or none: no names."""
    if value is None:
        return ()
    names = tuple(n.strip() for n in (value.split(",") if isinstance(value, str) else value))
    if any(not isinstance(n, str) or not re.fullmatch(r"[A-Za-z_0-9]+(\.[A-Za-z_0-9]+)*", n) for n in names) \
            and names != ("",):
        raise UserError(f"{flag} must be module names separated by commas (layer3,layer4 or blocks.4), got {value!r}")
    return () if names == ("",) else names


NAMES = Kind(_names_value, lambda v: ",".join(v))


@dataclass(kw_only=True)
class DataConfig(Section):
    data: str = _f("default", "dataset: 'default' (embedded 10k MNIST), 'mnist' (full MNIST, see --download), "
                   "cifar10, cifar100, fashion_mnist, kmnist or svhn (torchvision's files, see --download), "
                   "hf:<hub name> (a Hugging Face hub dataset), a `save_to_disk` folder or parquet file(s) of a "
                   "Hugging Face dataset, a CIFAR python folder, an MNIST IDX folder, a Kaggle digit-recognizer "
                   "folder or .csv, a folder of class subfolders of images, an .npz file, or a folder "
                   "`scaletrain prepare` wrote (local or s3://bucket/prefix)")
    # Its choices are the sources' formats (scaletrain.data.sources), which the commands give the flag.
    data_format: str = _f("auto", "how to read --data (auto: detected from the path; hf: a save_to_disk folder, or "
                          "a hub name when no such path exists)")
    download: bool = _f(False, "with --data mnist, cifar10, cifar100, fashion_mnist, kmnist or svhn: download it "
                        "into --cache-dir if it is not there (needs internet)")
    cache_dir: str = _f(DEFAULT_CACHE_DIR, "where --data mnist (and the other named datasets, under torchvision/) "
                        "is kept, and what runs learned about image folders (each file's check, decoded pixels) "
                        "for the next run over them ($XDG_CACHE_HOME/scaletrain when that is set)")
    cache_limit: str = _f("10GB", "--data s3://...: the most the chunks streamed to this machine may take under "
                          "--cache-dir (all its processes together; chunks already read are deleted to stay within "
                          "it), e.g. 512MB, 10GB")
    cache_memory: str = _f("auto", "the most host memory decoded images may take (auto: a quarter of this "
                           "machine's memory; or a size such as 8GB): a folder or prepared set that decodes to more is "
                           "read batch by batch, a folder's decoded pixels from --cache-dir on disk once its first "
                           "run has written them (else decoded again each epoch)")
    image_column: str = _f("", "Hugging Face data: the column holding the images (default: the Image feature, "
                           "else a column of encoded image bytes or of uint8 arrays)")
    label_column: str = _f("", "Hugging Face data: the column holding the labels (default: the one named label, "
                           "labels, target, fine_label, ... or the only ClassLabel feature)")
    image_size: int = _f(0, "square input size of the model (0: native; image folders 224; photos: the central "
                         "--crop-pct of the native size)")
    channels: int = _f(0, "input channels, 1 (grey) or 3 (RGB); 0: as the data is (image folders 3)")
    recipe: str = _f("auto", "how images become inputs. digits: the whole image resized to --image-size. photo: "
                     "kept at shorter side --image-size / --crop-pct (aspect kept, central square), "
                     "RandomResizedCrop for training, center crop for evaluation. auto: photo for colour images "
                     "whose shorter side is at least 64 px, else digits", choices=RECIPES)
    crop_pct: float = _f(0.875, "photo recipe: evaluation crops this central fraction of the stored image")
    crop_scale: tuple[float, float] = _kind((0.08, 1.0), "rrc: range of the crop's share of the image area "
                                            "('low,high')", RANGE)
    crop_ratio: tuple[float, float] = _kind((0.75, 1.3333), "rrc: range of the crop's aspect ratio (width / "
                                            "height, 'low,high')", RANGE)
    augment: tuple[str, ...] | Literal["auto"] = _kind(
        "auto", "training augmentations, comma-separated from: " + ",".join(AUGMENTATIONS) +
        " (rrc: RandomResizedCrop); auto: " + "; ".join(f"{k} {v}" for k, v in RECIPE_AUGMENT.items()), AUGMENT)
    randaugment: tuple[int, int] | None = _kind(
        None, "RandAugment after the flips: 'N,M' applies N operations per image at magnitude M of 10 (timm's "
        "rand-mM-nN, e.g. 2,9), each image its own; 'trivial': TrivialAugment (one operation, magnitude drawn per "
        "image); '': off", RANDAUGMENT)
    random_erasing: float = _f(0.0, "probability that a training image gets a random rectangle of noise after "
                               "normalisation (timm's RandomErasing, mode pixel); 0: off")
    mixup: float = _f(0.0, "mixup alpha: training batches blended with themselves reversed, weight from "
                      "Beta(alpha, alpha), soft targets; 0: off")
    cutmix: float = _f(0.0, "cutmix alpha: a box of the reversed batch pasted in, soft targets by its area; 0: off")
    mixup_prob: float = _f(1.0, "share of training batches that mixup / cutmix mix")
    mixup_switch_prob: float = _f(0.5, "with both --mixup and --cutmix: share of mixed batches that use cutmix")
    val_fraction: float = _f(0.2, "fraction split off (stratified, seeded) when the data has no validation set")
    data_on_device: str = _f("auto", "keep the decoded uint8 data on the training device and build batches "
                             "there (auto: when it fits: at most a quarter of a GPU's memory, and on the CPU within "
                             "--cache-memory)", choices=("auto", "yes", "no"))
    num_workers: int | Literal["auto"] = _kind(
        "auto", "DataLoader workers per process, when the data is not kept on the device; auto: for your own "
        "Dataset, none when its first batch reads in under 2 ms in the training process (items already in memory: "
        "workers would only add their hand-over), else 2; 2 for image files, prepared shards and streams", WORKERS)

    def workers(self) -> int:
        """The DataLoader workers for image files, prepared shards and streams (auto: AUTO_WORKERS); a user's
        Dataset decides auto from its first batch (data.items.workers_for)."""
        return AUTO_WORKERS if self.num_workers == "auto" else self.num_workers
    decode: str = _f("auto", "where JPEGs streamed from image files are decoded: workers (Pillow, in the DataLoader "
                     "workers), device (torchvision's batched decoder on the training device: nvJPEG on a GPU); "
                     "auto: device on a GPU, else workers", choices=("auto", "workers", "device"))
    skip_bad_samples: bool = _f(False, "leave out unreadable rows and images (listed in skipped_samples.txt in the "
                                "run folder) instead of stopping")


@dataclass(kw_only=True)
class ModelConfig(Section):
    model: str = _f("smallcnn", "built-in model (smallcnn, tinycnn) or any timm model name, e.g. resnet18")
    pretrained: str = _f("", "initial weights: 'timm' (timm's pretrained weights for --model, through the Hugging "
                         "Face hub and its cache; normalised as they expect), or a .safetensors or torch state-dict "
                         "file; tensors whose names and "
                         "shapes match are loaded, the others listed (e.g. a head of another size)")
    freeze: str = _f("none", "train only the classifier head (backbone) or everything (none)",
                     choices=("none", "backbone"))
    sync_bn: bool = _f(False, "convert BatchNorm to SyncBatchNorm so statistics span all processes")
    channels_last: bool = _f(True, "use channels_last memory format: measured faster for CNNs on the CPU (1.05-1.7x "
                                   "a step, 1.22x seed 000's whole run) and equal for ViT and ConvNeXt (0.98-1.05x); "
                                   "1.01x for resnet50 on an H100")
    compile: bool = _f(False, "compile the training model with torch.compile (the first steps wait for it; pays "
                       "on GPUs, rarely on CPUs); a batch of another size (an epoch's last) and validation run "
                       "eagerly, so it compiles once")
    compile_scope: str = _f("blocks", "--compile: blocks (the model's repeated blocks compiled in place, each kind "
                            "once: a shorter wait; the whole model where it has none) or whole (the whole model as "
                            "one graph)", choices=("blocks", "whole"))
    activation_checkpointing: bool = _f(False, "keep only each block's input from the forward pass and recompute "
                                        "the rest in the backward: less memory for about a third more compute")
    find_unused_parameters: str = _f("auto", "with 2 or more DDP processes: have DistributedDataParallel look for "
                                     "parameters that get no gradient at each step (a head used on some steps "
                                     "only, a layer never called). auto: when one forward and backward on the first "
                                     "batch, before training, leaves any without a gradient", choices=("auto", "yes",
                                                                                                        "no"))


@dataclass(kw_only=True)
class OptimConfig(Section):
    epochs: int = _f(8, "number of passes over the training set; raised on resume, the run trains on with its "
                    "learning-rate schedule re-planned over the new total from the saved step")
    batch_size: int = _f(128, "batch size per device (the global batch is this x devices x grad-accum)")
    global_batch_size: int = _f(0, "global batch; the per-device batch is derived from it, so that a run on "
                                "another device count optimises the same way (0: use --batch-size)")
    lr_scaling: str = _f("none", "scale --lr with the device count, for runs that fix the per-device batch "
                         "instead: linear (x devices) or sqrt", choices=LR_SCALINGS)
    lr: float | None = _f(None, "peak learning rate (default: sgd 0.05, adam/adamw 2e-3)")
    optimizer: str = _f("sgd", "optimizer", choices=OPTIMIZERS)
    momentum: float = _f(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = _f(5e-4, "weight decay (decoupled for adamw)")
    scheduler: str = _f("onecycle", "learning-rate schedule after warm-up", choices=SCHEDULERS)
    warmup_epochs: float | None = _f(None, "epochs of linear learning-rate warm-up from near zero (default: 1, "
                                     "at most half of --epochs, so a short run still decays after its warm-up)")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    steps_per_epoch: int = _f(0, "optimizer steps per epoch of a stream (fit with an IterableDataset): what a "
                                 "schedule over the run's length needs, and where each epoch ends at the latest; "
                                 "0: until the stream runs dry")
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss")
    early_stopping: int = _f(0, "stop when the monitored validation value (--monitor) has not improved for this many "
                             "epochs (every process at once; best.safetensors keeps the best weights); 0: off")
    monitor: str = _f("auto", "the validation value that picks best.safetensors and that --early-stopping watches: "
                      "a metrics.csv column (val_accuracy, val_loss, or val_<name> of the Python API's metrics); "
                      "auto: val_accuracy for a single-label classifier, else val_loss")
    monitor_mode: str = _f("auto", "whether a higher or lower --monitor is better; auto: higher for accuracy, lower "
                           "for the loss, a torchmetrics Metric's own higher_is_better", choices=("auto", "max", "min"))
    ema_decay: float = _f(0.0, "keep an exponential moving average of the weights (and BatchNorm statistics), "
                          "updated every optimizer step with this decay (e.g. 0.999), validated each epoch beside "
                          "the raw weights and saved as last_ema/best_ema.safetensors; 0: off")
    clip_grad_norm: float = _f(0.0, "clip the gradients' global L2 norm to this before each optimizer step (after "
                               "the fp16 loss scale is undone; over every process's gradients); 0: off")

    def warmup(self) -> float:
        """The warm-up in epochs: --warmup-epochs, or by default 1 epoch but at most half the run."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return min(DEFAULT_WARMUP_EPOCHS, self.epochs / 2)


@dataclass(kw_only=True)
class RunConfig(Section):
    output_dir: str = _f("", "run folder (default runs/<timestamp>)")
    seed: int = _f(0, "random seed shared by all processes (augmentation adds the rank)")
    mixed_precision: str = _f("no", "autocast precision; fp16 needs a GPU", choices=PRECISIONS)
    cpu: bool = _f(False, "train on the CPU even when GPUs are present")
    deterministic: bool = _f(False, "on GPUs, use deterministic kernels (cuDNN, cuBLAS and torch's deterministic "
                             "algorithms; an op without one warns) so a run repeats bit for bit, at some cost "
                             "in speed; CPU runs repeat without it")
    nproc: int | Literal["auto"] = _kind("auto", "processes to start: 'auto' (one per GPU, 1 on CPU) or a number",
                                         NPROC)
    nnodes: int = _f(1, "machines in the job; start the same command on each with its own --node-rank")
    node_rank: int = _f(0, "this machine's rank among --nnodes (0 hosts the rendezvous)")
    master_addr: str = _f("127.0.0.1", "with --nnodes above 1: address of the --node-rank 0 machine")
    master_port: int = _f(29500, "with --nnodes above 1: a free port on the --node-rank 0 machine")
    strategy: str = _f("ddp", "data parallelism: ddp (one process per device, DistributedDataParallel), dp "
                       "(one process driving every visible GPU, torch.nn.DataParallel) or fsdp (one process per "
                       "device, parameters, gradients and optimizer state sharded across them; for models "
                       "larger than one device) or pipeline (the model split into --stages run one after another "
                       "on their own processes, torch.distributed.pipelining; with more processes than stages, "
                       "the pipeline is replicated)", choices=STRATEGIES)
    stages: int = _f(0, "--strategy pipeline: stages the model is split into, each on its own process; 0: one "
                     "more than the names of --split-at, else every process of the job")
    split_at: tuple[str, ...] = _kind((), "--strategy pipeline: the modules where each later stage begins, "
                                      "comma-separated (layer3,layer4 or blocks.4); default: stages balanced by "
                                      "parameter count over the model's blocks in order", NAMES)
    microbatches: int = _f(0, "--strategy pipeline: micro-batches each batch is cut into as it passes the stages; "
                           "0: twice the stages, or the most up to that which divide the batch")
    shard_stages: bool = _f(False, "--strategy pipeline with more processes than stages: each stage's parameters, "
                            "gradients and optimizer state sharded over its replicas (fsdp inside a stage) instead "
                            "of held whole by each")
    schedule: str = _f("1f1b", "--strategy pipeline: the order of the micro-batches' forward and backward passes "
                       "(torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)",
                       choices=SCHEDULES)
    tp: int = _f(1, "tensor parallelism: each layer of the model's plan (timm's vision transformers, a Transformers "
                 "model's _tp_plan, your model's tp_plan attribute) split over this many processes, on torch's "
                 "DTensor; --strategy ddp, fsdp or pipeline over the job's other processes (1: off)")
    init_from: str = _f("", "a whole model's weights (.safetensors, the tensors under the model's names, as "
                        "safetensors.torch.save_file(model.state_dict()) writes them) to start from; each process "
                        "reads only its own tensors or rows (under fsdp and pipeline the model is never whole)")
    save_initial_weights: bool = _f(False, "write the weights training starts from into the run folder as "
                                    "initial.safetensors, for --init-from: runs on other layouts then start from "
                                    "the very same weights")
    log_every: int = _f(20, "steps between progress updates (each one reduces the loss across processes)")
    checkpoint_every: int = _f(0, "also save the training state every N optimizer steps (0: at epoch ends only)")
    keep_checkpoints: int = _f(2, "training-state checkpoints kept in <run folder>/state")
    max_restarts: int = _f(0, "with --nproc N: restart all workers up to this many times after a failure; each "
                           "restart resumes from the last checkpoint")
    timeout: float = _f(1800.0, "seconds a process waits for the others in a collective before the job fails")
    stall_timeout: float = _f(60.0, "with 2 or more processes: a rank that makes no progress for this many seconds "
                              "while behind the others has stalled (no rank with any: the job is stuck); it is named "
                              "with every rank's stack and the job stops with exit code 6 (0: not watched)")
    log_with: tuple[str, ...] | Literal["auto", "none"] = _kind(
        "auto", "experiment trackers the main process logs to, comma-separated from: " + ", ".join(TRACKERS) +
        "; auto: tensorboard when it is installed (and on resume also the trackers the run was started with); "
        "none: no tracker", LOG_WITH)
    experiment: str = _f("scaletrain", "MLflow experiment and W&B project the run is logged under "
                         "(MLFLOW_EXPERIMENT_NAME, when set, wins for MLflow)")


@dataclass(kw_only=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("data", "model", "optim", "run"):  # config.epochs = 5: a setting is in a section
            raise UnknownSetting(_unknown_setting("", name))
        super().__setattr__(name, value)

    def validate(self) -> "TrainConfig":
        """Raise UserError naming the flag for every value that cannot work; changes nothing (see `resolve`)."""
        for name in ("data", "model", "optim", "run"):
            _check_values(name, getattr(self, name))
        self._check(self.data.typed(), self.optim.typed(), self.run.typed())  # type: ignore[arg-type]
        return self

    def _check(self, d: "DataConfig", o: "OptimConfig", r: "RunConfig") -> None:
        positive = {"--epochs": o.epochs, "--batch-size": o.batch_size, "--grad-accum": o.grad_accum,
                    "--log-every": r.log_every, "--keep-checkpoints": r.keep_checkpoints}
        for flag, value in positive.items():
            if value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        if not (DEFAULT_LR[o.optimizer] if o.lr is None else o.lr) > 0:
            raise UserError(f"--lr must be a positive number, got {o.lr}")
        for flag, value in {"--weight-decay": o.weight_decay, "--warmup-epochs": o.warmup(),
                            "--momentum": o.momentum,
                            "--checkpoint-every": r.checkpoint_every, "--max-restarts": r.max_restarts,
                            "--steps-per-epoch": o.steps_per_epoch,
                            "--image-size": d.image_size}.items():
            if value < 0:
                raise UserError(f"{flag} must not be negative, got {value}")
        if not 0 <= r.seed < 2**32:
            raise UserError(f"--seed must be between 0 and {2**32 - 1}, got {r.seed}")
        if d.channels not in (0, 1, 3):
            raise UserError(f"--channels must be 1 or 3, got {d.channels}")
        parse_size(d.cache_limit, "--cache-limit")
        if d.cache_memory != "auto":
            parse_size(d.cache_memory, "--cache-memory")
        if r.init_from and not Path(r.init_from).is_file():
            raise UserError(f"--init-from {r.init_from}: no such file")
        if not r.timeout > 0:
            raise UserError(f"--timeout must be a positive number of seconds, got {r.timeout}")
        if not r.stall_timeout >= 0:
            raise UserError(f"--stall-timeout must be 0 (off) or a positive number of seconds, got {r.stall_timeout}")
        if not 0 < d.val_fraction < 1:
            raise UserError(f"--val-fraction must be between 0 and 1, got {d.val_fraction}")
        if o.monitor != "auto" and not o.monitor.startswith("val_"):
            raise UserError(f"--monitor must be auto or a validation column (val_accuracy, val_loss, val_<name>), "
                            f"got {o.monitor}")
        if o.early_stopping < 0:
            raise UserError(f"--early-stopping must be a number of epochs, or 0 for off, got {o.early_stopping}")
        if not o.clip_grad_norm >= 0:
            raise UserError(f"--clip-grad-norm must be a positive number, or 0 for off, got {o.clip_grad_norm}")
        if not 0 <= o.ema_decay < 1:
            raise UserError(f"--ema-decay must be in [0, 1) (e.g. 0.999), or 0 for off, got {o.ema_decay}")
        for flag, value in {"--random-erasing": d.random_erasing, "--mixup-prob": d.mixup_prob,
                            "--mixup-switch-prob": d.mixup_switch_prob}.items():
            if not 0 <= value <= 1:
                raise UserError(f"{flag} must be a probability in [0, 1], got {value}")
        for flag, value in {"--mixup": d.mixup, "--cutmix": d.cutmix}.items():
            if not value >= 0:
                raise UserError(f"{flag} must be a Beta alpha > 0, or 0 for off, got {value}")
        if not 0 <= o.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1), got {o.label_smoothing}")
        if o.global_batch_size < 0:
            raise UserError(f"--global-batch-size must not be negative, got {o.global_batch_size}")
        if o.global_batch_size and o.lr_scaling != "none":
            raise UserError("--lr-scaling is for a fixed per-device batch; with --global-batch-size the global "
                            "batch, and so the learning rate, stay the same on any device count")
        if r.nnodes < 1 or not 0 <= r.node_rank < r.nnodes:
            raise UserError(f"--nnodes must be positive and --node-rank in 0..nnodes-1, got --nnodes {r.nnodes} "
                            f"--node-rank {r.node_rank}")
        if not 0 < r.master_port < 65536:
            raise UserError(f"--master-port must be a port number (1-65535), got {r.master_port}")
        if r.strategy == "dp":
            if r.nproc != "auto" and r.nproc > 1:
                raise UserError("--strategy dp runs one process that drives every visible GPU; use --nproc 1")
            if self.model.sync_bn:
                raise UserError("--sync-bn needs --strategy ddp: torch's SyncBatchNorm does not work inside "
                                "DataParallel replicas")
            if self.model.activation_checkpointing:
                raise UserError("--activation-checkpointing needs --strategy ddp or fsdp: DataParallel replicas "
                                "run in threads that would share each block's checkpointing state")
        self._check_pipeline(o, r)
        self._check_tp(o, r)
        if not 0 < d.crop_pct <= 1:
            raise UserError(f"--crop-pct must be in (0, 1], got {d.crop_pct}")
        low, high = d.crop_scale
        if not 0 < low <= high <= 1:
            raise UserError(f"--crop-scale must be two fractions 0 < low <= high <= 1, got {low!r},{high!r}")
        low, high = d.crop_ratio
        if not 0 < low <= high:
            raise UserError(f"--crop-ratio must be two positive numbers low <= high, got {low!r},{high!r}")
        for name in r.log_with if isinstance(r.log_with, tuple) else ():
            if not tracker_installed(name):
                raise UserError(f"--log-with {name} needs the {name} package: pip install 'scaletrain[{name}]'")
        if not r.experiment.strip():
            raise UserError("--experiment must name an MLflow experiment / W&B project, got an empty name")

    def _check_pipeline(self, o: "OptimConfig", r: "RunConfig") -> None:
        """--strategy pipeline's own flags, and what it cannot be combined with (see parallel/pipeline.py)."""
        if r.strategy != "pipeline":
            given = [f for f, v in (("--stages", r.stages), ("--split-at", r.split_at),
                                    ("--microbatches", r.microbatches), ("--shard-stages", r.shard_stages)) if v]
            if given:
                raise UserError(f"{given[0]} is for --strategy pipeline (a model split into stages); this run's "
                                f"strategy is {r.strategy}")
            return
        if r.stages < 0 or r.stages == 1:
            raise UserError(f"--stages must be 2 or more (or 0: from --split-at, else every process), got {r.stages}")
        if r.microbatches < 0:
            raise UserError(f"--microbatches must be a positive number (or 0: chosen), got {r.microbatches}")
        if r.split_at and r.stages and len(r.split_at) + 1 != r.stages:
            raise UserError(f"--split-at {','.join(r.split_at)} begins {len(r.split_at) + 1} stages, --stages says "
                            f"{r.stages}; give one name fewer than the stages")
        if r.microbatches and not o.global_batch_size and o.batch_size % r.microbatches:
            raise UserError(f"--batch-size {o.batch_size} cannot be cut into --microbatches {r.microbatches} of one "
                            f"size; give a batch size they divide")
        stages = r.stages or (len(r.split_at) + 1 if r.split_at else 0)
        if r.microbatches and stages:
            check_schedule(r.schedule, r.microbatches, stages)


    def _check_tp(self, o: "OptimConfig", r: "RunConfig") -> None:
        """--tp: with ddp, fsdp or pipeline over the rest (see parallel/tensor.py); the process count it divides is
        parallel/layout.py's check."""
        if r.tp < 1:
            raise UserError(f"--tp must be 1 (off) or a number of processes each layer is split over, got {r.tp}")
        if r.tp == 1:
            return
        if r.strategy == "dp":
            raise UserError("--tp is not available with --strategy dp; use ddp, fsdp or pipeline over the processes "
                            "--tp leaves")

    def plan(self, devices: int, devices_per_process: int = 1) -> "BatchPlan":
        """How this job makes its batches on `devices` data-parallel replicas (processes on every node times the
        GPUs each drives): the per-device batch from --global-batch-size or --batch-size, the global batch, and
        the learning rate after --lr-scaling. Refuses a global batch the devices cannot split."""
        o = self.optim
        per_device = o.batch_size
        if o.global_batch_size:
            per_device, rest = divmod(o.global_batch_size, devices * o.grad_accum)
            if rest or not per_device:
                raise UserError(f"--global-batch-size {o.global_batch_size} cannot be shared evenly by {devices} "
                                f"device(s) x --grad-accum {o.grad_accum}")
        lr = o.lr if o.lr is not None else DEFAULT_LR[o.optimizer]
        if o.lr_scaling != "none":
            lr *= devices if o.lr_scaling == "linear" else math.sqrt(devices)
        return BatchPlan(devices, devices_per_process, per_device, o.grad_accum, per_device * devices * o.grad_accum,
                         lr)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The settings as config files and `from_dict` take them (structured ones as their text)."""
        return {f.name: getattr(self, f.name).to_dict() for f in dataclasses.fields(self)}

    def replace_run(self, **values: Any) -> "TrainConfig":
        """A copy with these run settings changed (the launcher's run folder); this config stays as it is."""
        return dataclasses.replace(copy.deepcopy(self), run=dataclasses.replace(copy.deepcopy(self.run), **values))

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> "TrainConfig":
        parts = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # type: ignore[misc]
            known = {sf.name for sf in dataclasses.fields(section_cls)}
            given = values.get(f.name, {})
            unknown = set(given) - known
            if unknown:
                raise UserError(f"unknown config key {f.name}.{sorted(unknown)[0]}")
            parts[f.name] = section_cls(**given)
        return cls(**parts)


# Settings that change how a run is carried out but not what it computes: a resumed run may change them.
# (--batch-size, --global-batch-size and --lr-scaling are compared through the batch plan: the global batch and
# the learning rate they give; --epochs may be raised to train on.)
OPERATIONAL = {
    "data": {"download", "cache_dir", "cache_limit", "cache_memory", "data_on_device", "num_workers"},
    "model": {"channels_last", "compile", "compile_scope", "activation_checkpointing", "find_unused_parameters"},
    "optim": {"epochs", "batch_size", "global_batch_size", "lr_scaling"},
    "run": {"output_dir", "cpu", "deterministic", "nproc", "strategy", "stages", "split_at", "microbatches",
            "schedule", "shard_stages", "tp", "nnodes", "node_rank", "master_addr", "master_port",
            "save_initial_weights", "log_every", "checkpoint_every", "keep_checkpoints", "max_restarts", "timeout",
            "stall_timeout", "log_with",
            "experiment"},
}


def trajectory_changes(saved: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """'key: saved -> new' for every setting that differs between two configs and changes what training
    computes (data, model, seed, optimizer, learning rate, schedule, warm-up, augmentation, precision, ...)."""
    changes = []
    for section, values in new.items():
        for key, value in values.items():
            if key in OPERATIONAL.get(section, ()) or key not in saved.get(section, {}):
                continue
            if value == "auto" and key in ("recipe", "augment"):  # resolved from the data: compared once read
                continue
            if (section, key) == ("optim", "warmup_epochs"):  # the default is resolved against the saved run
                saved_epochs = saved["optim"].get("epochs", 1)
                before, value = (OptimConfig(epochs=saved_epochs, warmup_epochs=v).warmup()
                                 for v in (saved[section][key], value))
                if before != value:
                    changes.append(f"{key}: saved {before!r}, now {value!r}")
                continue
            if not _same(section, key, saved[section][key], value):
                changes.append(f"{key}: saved {saved[section][key]!r}, now {value!r}")
    return changes


def _same(section: str, key: str, saved: Any, new: Any) -> bool:
    """Whether two recorded values of a setting mean the same (a structured one compared as its typed value, so
    'crop, hflip' saved by an earlier version equals 'crop,hflip')."""
    if saved == new:
        return True
    kind = _fields().get(key, (None, None))[1]
    kind = kind.metadata.get("kind") if kind is not None else None
    try:
        return kind is not None and kind.parse(flag_of(key), saved) == kind.parse(flag_of(key), new)
    except UserError:
        return False


@dataclass(frozen=True)
class BatchPlan:
    """A job's batches, computed once from the config and the devices: what the launcher checks, the batch makers
    use, checkpoints and summary.json record."""

    devices: int  # data-parallel replicas in the job: processes on all nodes x devices per process
    devices_per_process: int  # every visible GPU under --strategy dp, else 1
    batch_per_device: int
    grad_accum: int
    global_batch: int  # samples per optimizer step over the job
    lr: float  # peak learning rate, after --lr-scaling

    @property
    def batch_per_process(self) -> int:
        """What one process's batch maker yields (DataParallel splits it over its GPUs)."""
        return self.batch_per_device * self.devices_per_process

    def continuing(self, saved: "BatchPlan", where: str) -> "BatchPlan":
        """This job's plan for continuing a run that `saved` planned on another device count: the run's global
        batch and learning rate kept, shared among this job's devices with each device's batch at most this plan's
        (what --batch-size says fits here), accumulating as many micro-batches as that takes. Unchanged on the
        same device count, or when this plan already has the saved global batch; refused on one line when these
        devices cannot share that batch evenly. `where`: the checkpoint, as the message names it."""
        if saved.devices == self.devices or saved.global_batch == self.global_batch:
            return self
        total, per_step = saved.global_batch, saved.global_batch // self.devices
        if total % self.devices:
            raise UserError(f"{where}: saved with a global batch of {total} on {saved.devices} device(s), which "
                            f"{self.devices} device(s) cannot share evenly; resume on a device count that divides "
                            f"{total}")
        accum = next(a for a in range(1, per_step + 1) if per_step % a == 0 and per_step // a <= self.batch_per_device)
        return BatchPlan(self.devices, self.devices_per_process, per_step // accum, accum, total, saved.lr)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Settings:
    """A run's settings resolved once: read-only sections holding typed values (ranges as tuples, lists as tuples
    of names), the learning rate's default, the data's recipe and its augmentations once known, and the batch plan
    on the job's devices. The run folder's config.yaml and every checkpoint record `to_dict()`; workers started by
    scaletrain's launcher read it back (`from_dict`) instead of resolving again. Each part of the training reads
    the section it concerns: the data layer `data`, the optimizer `optim` and `plan`, the outputs `run`."""

    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    run: RunConfig
    plan: BatchPlan

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections as config.yaml records them (without the plan, which is recorded beside them)."""
        return {name: getattr(self, name).to_dict() for name in SECTIONS}

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]], plan: dict[str, Any]) -> "Settings":
        config = TrainConfig.from_dict(values)
        return cls(**{name: getattr(config, name).typed() for name in SECTIONS}, plan=BatchPlan(**plan))

    def with_plan(self, **changes: Any) -> "Settings":
        """These settings with another batch plan (what `tune` tries)."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, **changes))

    def with_recipe(self, recipe: str) -> "Settings":
        """These settings once the data's recipe is known: the recipe the data was read with, and the
        augmentations of `auto` (--augment auto with a --recipe given too)."""
        augment = AUGMENT.parse("--augment", RECIPE_AUGMENT[recipe] if self.data.augment == "auto"
                                else self.data.augment)
        if (self.data.recipe, self.data.augment) == (recipe, augment):
            return self
        data = dataclasses.replace(self.data, recipe=recipe, augment=augment)
        return dataclasses.replace(self, data=data.frozen())


SECTIONS = ("data", "model", "optim", "run")


def resolve(config: TrainConfig, plan: BatchPlan, recipe: str | None = None) -> Settings:
    """`config` checked and resolved into read-only `Settings` for a job with this batch plan (see
    `TrainConfig.plan`), and for data of this recipe when it is known already. `config` itself is not changed. (The
    whole config: it resolves all of it.)"""
    data, model, optim, run = (getattr(config, name).typed() for name in SECTIONS)
    config._check(data, optim, run)  # what validate() checks, on these typed sections
    if optim.lr is None:  # resolved here so config.yaml records the rate actually used
        optim = dataclasses.replace(optim, lr=DEFAULT_LR[optim.optimizer]).frozen()
    settings = Settings(data, model, optim, run, plan)  # type: ignore[arg-type]
    return settings.with_recipe(recipe) if recipe else settings


def parse_range(flag: str, spec: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in spec.split(","))
    except ValueError:
        raise UserError(f"{flag} must be two numbers 'low,high', got {spec!r}") from None
    return low, high


def parse_augment(spec: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    for name in names:
        if name not in AUGMENTATIONS:
            raise UserError(f"--augment: unknown augmentation '{name}'; choose from {', '.join(AUGMENTATIONS)}")
    if "none" in names:
        if len(names) > 1:
            raise UserError("--augment: 'none' cannot be combined with other augmentations")
        return ()
    return names


def parse_randaugment(spec: str) -> tuple[int, int] | None:
    """'' -> None; 'trivial' -> (1, -1); 'N,M' -> (N, M). Raises ValueError for anything else."""
    spec = spec.strip().lower()
    if not spec:
        return None
    if spec == "trivial":
        return (1, -1)
    n, m = (int(v) for v in spec.split(","))
    if n < 1 or not 0 <= m <= 10:
        raise ValueError(spec)
    return (n, m)


def parse_log_with(spec: str) -> tuple[str, ...]:
    """The trackers --log-with names explicitly: () for 'auto' (decided when the run starts) and 'none'."""
    names = tuple(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    if names in (("auto",), ("none",)):
        return ()
    if "auto" in names or "none" in names:
        raise UserError(f"--log-with: auto and none stand alone, got {spec!r}")
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"--log-with: unknown tracker '{name}'; choose from {', '.join(TRACKERS)} "
                            f"(comma-separated), or auto, or none")
    if not names:
        raise UserError(f"--log-with: name a tracker ({', '.join(TRACKERS)}), or auto, or none")
    return names


def tracker_installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def parse_nproc(value: str) -> int | None:
    """'auto' gives None (decided by the hardware); otherwise a positive process count."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise UserError(f"--nproc must be 'auto' or a positive integer, got '{value}'") from None
    if n <= 0:
        raise UserError(f"--nproc must be 'auto' or a positive integer, got '{value}'")
    return n


# -- config files ----------------------------------------------------------------------------------------------
def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every setting by name: name -> (section, field)."""
    return {f.name: (section.name, f) for section in dataclasses.fields(TrainConfig)
            for f in dataclasses.fields(section.default_factory)}  # type: ignore[arg-type]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def setting_type(cls: type, f: dataclasses.Field) -> type:
    """The plain type of a setting's flag and config-file value, read from its declared type: bool, int, float
    or str (a structured setting's text, which its Kind parses). Optional types give their other member."""
    if "kind" in f.metadata:
        return str
    hint = _hints(cls)[f.name]
    members = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) in (Union, UnionType) \
        else [hint]
    if len(members) != 1 or members[0] not in (bool, int, float, str):
        raise TypeError(f"{cls.__name__}.{f.name}: a setting is a bool, int, float or str, or has a Kind; got {hint}")
    return members[0]


def _coerce(source: str, name: str, f: dataclasses.Field, value: Any, section: type) -> Any:
    """A file's value as the field's type, or a one-line error naming the file and key."""
    where = f"{source}: {name}"
    kind, kind_of_value = f.metadata.get("kind"), setting_type(section, f)
    if kind is not None:  # its text, or a YAML list for a range or a list of names
        try:
            return kind.parse(flag_of(f.name), str(value) if isinstance(value, (int, float)) else value)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
    if value is None and f.default is None:
        return None
    if kind_of_value is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind_of_value is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        return value
    if kind_of_value is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if isinstance(value, bool):  # YAML reads a bare yes/no as a boolean
        value = "yes" if value else "no"
    if isinstance(value, (dict, list)) or value is None:
        raise UserError(f"{where}: expected a single value, got {value!r}")
    value = str(value)
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise UserError(f"{where}: '{value}' is not one of {', '.join(f.metadata['choices'])}")
    return value


def _check_values(name: str, section: Section) -> None:
    """Refuse on one line a value set in Python (config.run.strategy = ...) that the flag would refuse: one outside
    its choices, or not of its type (a structured setting's text is parsed by its Kind, in `typed`)."""
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        value, where = getattr(section, f.name), f"config.{name}.{f.name} ({flag_of(f.name)})"
        if "kind" in f.metadata or (value is None and f.default is None):
            continue
        kind = setting_type(type(section), f)
        accepted = {bool: bool, int: numbers.Integral, float: numbers.Real,
                    str: (str, os.PathLike)}[kind]  # a Path, a NumPy number: as the flag's text would give them
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise UserError(f"{where}: expected {_KIND_WORDS[kind]}, got {value!r}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise UserError(f"{where}: {value!r} is not one of {', '.join(f.metadata['choices'])}")


_KIND_WORDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def read_config_file(path: str) -> dict[str, dict[str, Any]]:
    """Settings from a YAML file, as {section: {name: value}}.

    Keys are the flags' names (`batch-size` or `batch_size`), at the top level or under their section
    (data, model, optim, run), so a run folder's config.yaml can be given back as it is.
    """
    import yaml

    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--config {path}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"--config {path}: not valid YAML{line}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"--config {path}: expected keys and values (a YAML mapping)")
    known, sections = _fields(), {f.name for f in dataclasses.fields(TrainConfig)}
    flat: dict[str, Any] = {}
    for key, value in loaded.items():
        if key == "plan":  # a run folder's config.yaml records the batch plan derived from the rest
            continue
        if key in sections and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        name = str(key).replace("-", "_")
        if name not in known:
            import difflib

            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean {close[0].replace('_', '-')}?" if close else ""
            raise UserError(f"--config {path}: unknown key '{key}'{hint}")
        section, f = known[name]
        section_cls = next(s.default_factory for s in dataclasses.fields(TrainConfig) if s.name == section)
        out.setdefault(section, {})[name] = _coerce(f"--config {path}", str(key), f, value, section_cls)
    return out


def starter_config_text(choices: dict[str, tuple[str, ...]] | None = None) -> str:
    """A commented YAML file holding every setting at its default; `choices` adds those of fields that the config
    leaves to a layer above it (--data-format)."""
    import yaml

    lines = ["# scaletrain train settings. Any flag of `scaletrain train --help` can be a key (batch-size or",
             "# batch_size). Precedence: the defaults, then this file, then flags on the command line.",
             "# Use it with: scaletrain train --config THIS_FILE [more flags]"]
    for section in dataclasses.fields(TrainConfig):
        lines += ["", f"# -- {section.name} " + "-" * (70 - len(section.name))]
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            lines.append(f"# {f.metadata['help']}")
            allowed = (choices or {}).get(f.name) or f.metadata.get("choices")
            if allowed:
                lines.append(f"# one of: {', '.join(allowed)}")
            value = yaml.safe_dump({f.name.replace("_", "-"): setting_text(f, f.default)}, default_flow_style=True,
                                   width=1000)
            lines.append(value.strip()[1:-1])
    return "\n".join(lines) + "\n"
