"""What a training run is asked to do: one dataclass per concern, composed into `TrainConfig`.

Each field carries its own one-line help; the CLI builds its flags from these fields and the run folder's
`config.yaml` is written from them, so the flags, the file and the code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("onecycle", "cosine", "constant")
PRECISIONS = ("no", "fp16", "bf16")
DATA_FORMATS = ("auto", "idx", "csv", "folder", "npz")
AUGMENTATIONS = ("none", "crop", "hflip", "vflip", "brightness", "contrast")
DEFAULT_LR = {"sgd": 0.05, "adam": 2e-3, "adamw": 2e-3}


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(kw_only=True)
class DataConfig:
    data: str = _f("default", "dataset: 'default' (embedded 10k MNIST), 'mnist' (full MNIST, see --download), "
                   "an MNIST IDX folder, a Kaggle digit-recognizer folder or .csv, a folder of class subfolders "
                   "of images, or an .npz file")
    data_format: str = _f("auto", "how to read --data (auto: detected from the path)", choices=DATA_FORMATS)
    download: bool = _f(False, "with --data mnist: download full MNIST into --cache-dir if it is not there")
    cache_dir: str = _f("~/.cache/scaletrain", "where --data mnist is kept")
    image_size: int = _f(0, "square input size: images are resized to it (0: native; image folders 224)")
    channels: int = _f(0, "input channels, 1 (grey) or 3 (RGB); 0: as the data is (image folders 3)")
    augment: str = _f("crop", "training augmentations, comma-separated from: " + ",".join(AUGMENTATIONS))
    val_fraction: float = _f(0.2, "fraction split off (stratified, seeded) when the data has no validation set")
    data_on_device: str = _f("auto", "keep the decoded uint8 data on the training device and build batches "
                             "there (auto: when it fits)", choices=("auto", "yes", "no"))
    num_workers: int = _f(2, "DataLoader workers per process, when the data is not kept on the device")
    skip_bad_samples: bool = _f(False, "leave out unreadable rows and images (listed in skipped_samples.txt in the "
                                "run folder) instead of stopping")


@dataclass(kw_only=True)
class ModelConfig:
    model: str = _f("smallcnn", "built-in model (smallcnn, tinycnn) or any timm model name, e.g. resnet18")
    pretrained: str = _f("", "initial weights: a .safetensors or torch state-dict file; tensors whose names and "
                         "shapes match are loaded, the others listed (e.g. a head of another size)")
    freeze: str = _f("none", "train only the classifier head (backbone) or everything (none)",
                     choices=("none", "backbone"))
    sync_bn: bool = _f(False, "convert BatchNorm to SyncBatchNorm so statistics span all processes")
    channels_last: bool = _f(True, "use channels_last memory format (faster convolutions on CPU and GPU)")


@dataclass(kw_only=True)
class OptimConfig:
    epochs: int = _f(8, "number of passes over the training set")
    batch_size: int = _f(128, "batch size per process (the global batch is this x processes x grad-accum)")
    lr: float | None = _f(None, "peak learning rate (default: sgd 0.05, adam/adamw 2e-3)")
    optimizer: str = _f("sgd", "optimizer", choices=OPTIMIZERS)
    momentum: float = _f(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = _f(5e-4, "weight decay (decoupled for adamw)")
    scheduler: str = _f("onecycle", "learning-rate schedule after warm-up", choices=SCHEDULERS)
    warmup_epochs: float = _f(1.0, "epochs of linear learning-rate warm-up from near zero")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss")


@dataclass(kw_only=True)
class RunConfig:
    output_dir: str = _f("", "run folder (default runs/<timestamp>)")
    seed: int = _f(0, "random seed shared by all processes (augmentation adds the rank)")
    mixed_precision: str = _f("no", "autocast precision; fp16 needs a GPU", choices=PRECISIONS)
    cpu: bool = _f(False, "train on the CPU even when GPUs are present")
    nproc: str = _f("auto", "processes to start: 'auto' (one per GPU, 1 on CPU) or a number")
    log_every: int = _f(20, "steps between progress updates (each one reduces the loss across processes)")
    checkpoint_every: int = _f(0, "also save the training state every N optimizer steps (0: at epoch ends only)")
    keep_checkpoints: int = _f(2, "training-state checkpoints kept in <run folder>/state")
    max_restarts: int = _f(0, "with --nproc N: restart all workers up to this many times after a failure; each "
                           "restart resumes from the last checkpoint")
    timeout: float = _f(1800.0, "seconds a process waits for the others in a collective before the job fails")


@dataclass(kw_only=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "TrainConfig":
        """Raise UserError naming the flag for every value that cannot work."""
        o, d, r = self.optim, self.data, self.run
        positive = {"--epochs": o.epochs, "--batch-size": o.batch_size, "--grad-accum": o.grad_accum,
                    "--log-every": r.log_every, "--keep-checkpoints": r.keep_checkpoints}
        for flag, value in positive.items():
            if value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        if o.lr is None:
            o.lr = DEFAULT_LR[o.optimizer]  # resolved here so config.yaml records the rate actually used
        if not o.lr > 0:
            raise UserError(f"--lr must be a positive number, got {o.lr}")
        for flag, value in {"--weight-decay": o.weight_decay, "--warmup-epochs": o.warmup_epochs,
                            "--momentum": o.momentum, "--num-workers": d.num_workers,
                            "--checkpoint-every": r.checkpoint_every, "--max-restarts": r.max_restarts,
                            "--image-size": d.image_size}.items():
            if value < 0:
                raise UserError(f"{flag} must not be negative, got {value}")
        if d.channels not in (0, 1, 3):
            raise UserError(f"--channels must be 1 or 3, got {d.channels}")
        if not r.timeout > 0:
            raise UserError(f"--timeout must be a positive number of seconds, got {r.timeout}")
        if not 0 < d.val_fraction < 1:
            raise UserError(f"--val-fraction must be between 0 and 1, got {d.val_fraction}")
        if not 0 <= o.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1), got {o.label_smoothing}")
        parse_augment(d.augment)
        parse_nproc(r.nproc)
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

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
