"""`scaletrain train`: flags from `TrainConfig`, the checks made before any worker starts, the run folder, and
launching; the training itself is `training.run`."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Sequence

from ..config import TrainConfig, parse_nproc, read_config_file
from ..errors import UserError
from ..sources import Skipped
from .common import add_flags


def add_parser(subparsers) -> None:
    train = subparsers.add_parser(
        "train", help="train a classifier (default: the small CNN on the embedded 10k MNIST images)",
        description="Train a classifier. Batch size is per process; run the same command under torchrun, "
                    "accelerate launch, or with --nproc N.")
    train.add_argument("--config", default="", metavar="FILE", help="YAML file of settings (any flag as a key; "
                       "`scaletrain config` writes a starter); flags given on the command line win")
    for section in dataclasses.fields(TrainConfig):  # one group per section, each flag stored as section.name
        add_flags(train.add_argument_group(section.name), section.default_factory,  # type: ignore[arg-type]
                  prefix=f"{section.name}.", negatable=True)
    train.add_argument("--resume", nargs="?", const=".", default=None, metavar="RUN_DIR",
                       help="continue the run in RUN_DIR (or --output-dir) exactly where its last checkpoint "
                            "stopped; a run folder holding training state is resumed even without this flag")


def run(args: argparse.Namespace) -> int:
    return _train(_config_from_args(args), args.argv, args.resume)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The defaults, then --config FILE, then the flags given."""
    values: dict[str, dict] = read_config_file(args.config) if args.config else {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(values).validate()


def _default_output_dir() -> str:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return str(path)


def _check_output_dir(path: str, resume: bool) -> None:
    """A new run folder starts a run; one holding training state resumes it; anything else is left alone."""
    from ..checkpoint import step_folders

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder")
    if (folder / "summary.json").exists():
        raise UserError(f"--output-dir {path}: holds a finished run; choose another folder")
    has_state = bool(step_folders(folder))
    if resume and not has_state:
        raise UserError(f"--resume {path}: no training state (state/step-*) to resume from")
    if not has_state and any((folder / n).exists() for n in ("last.safetensors", "best.safetensors")):
        raise UserError(f"--output-dir {path}: holds weights but no training state to resume from; "
                        f"choose another folder")


def _train(cfg: TrainConfig, argv: Sequence[str], resume: str | None = None) -> int:
    from ..data import load_image_sets
    from ..parallel import Nodes, available_gpus, launch, launched_world_size, resolve_nproc
    from ..models import check_model_name, read_state_dict
    from ..training import run as run_training

    check_model_name(cfg.model.model)
    if launched_world_size() is None:
        # The launching (or only) process checks everything it can before any worker starts.
        nproc = 1 if cfg.run.strategy == "dp" else resolve_nproc(parse_nproc(cfg.run.nproc), cfg.run.cpu)
        # Refuses here what every worker would refuse: a global batch the job's devices (all nodes') cannot split.
        cfg.for_devices(max(available_gpus(cfg.run.cpu), 1) if cfg.run.strategy == "dp" else nproc * cfg.run.nnodes)
        if resume not in (None, "."):
            cfg.run.output_dir = resume
            argv = [*argv, "--output-dir", resume]
        if not cfg.run.output_dir:
            if resume:
                raise UserError("--resume needs the run folder: --resume RUN_DIR or --output-dir RUN_DIR")
            cfg.run.output_dir = _default_output_dir()
            argv = [*argv, "--output-dir", cfg.run.output_dir]
        _check_output_dir(cfg.run.output_dir, resume is not None)
        r = cfg.run
        if nproc > 1 or r.nnodes > 1:  # one process alone checks these in training.run, without reading them twice
            if cfg.model.pretrained:
                read_state_dict(cfg.model.pretrained)
            load_image_sets(cfg.data, seed=r.seed, skipped=Skipped() if cfg.data.skip_bad_samples else None)
            return launch(nproc, ["train", *argv], r.max_restarts,
                          Nodes(r.nnodes, r.node_rank, r.master_addr, r.master_port))
    run_training(cfg)
    return 0
