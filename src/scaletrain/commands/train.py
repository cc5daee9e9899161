"""`scaletrain train`: flags from `TrainConfig`, the checks made before any worker starts, the run folder, and
launching; the training itself is `training.worker.run`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from ..config import Settings, TrainConfig, parse_nproc, read_config_file, resolve
from ..errors import UserError
from ..runfolder import JobHold, default_run_folder
from .common import add_flags


def add_parser(subparsers) -> None:
    train = subparsers.add_parser(
        "train", help="train a classifier (default: the small CNN on the embedded 10k MNIST images)",
        description="Train a classifier. Batch size is per process; run the same command under torchrun, "
                    "accelerate launch, or with --nproc N.")
    add_train_flags(train)
    train.add_argument("--resume", nargs="?", const=".", default=None, metavar="RUN_DIR",
                       help="continue the run in RUN_DIR (or --output-dir) exactly where its last checkpoint "
                            "stopped, with the settings it was saved with (a change that alters the training is "
                            "refused; --epochs may be raised to train on); a run folder holding training state is "
                            "resumed even without this flag")
    train.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a worker: what its launcher settled


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` and one flag per `TrainConfig` field, grouped by section and stored as `section.name`
    (read back by `config_from_args`)."""
    parser.add_argument("--config", default="", metavar="FILE", help="YAML file of settings (any flag as a key; "
                        "`scaletrain config` writes a starter); flags given on the command line win")
    for section in dataclasses.fields(TrainConfig):
        add_flags(parser.add_argument_group(section.name), section.default_factory,  # type: ignore[arg-type]
                  prefix=f"{section.name}.", negatable=True)


def run(args: argparse.Namespace) -> int:
    from ..training.job import read_settings
    from ..training.worker import run as run_training

    if args.job:  # a worker that scaletrain's launcher started: settings and data were settled there
        run_training(read_settings(args.job), job=args.job)
        return 0
    return _train(config_from_args(args), args.resume)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The defaults, then --config FILE, then the flags given."""
    values: dict[str, dict] = read_config_file(args.config) if args.config else {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(values).validate()


def _check_output_dir(path: str, resume: bool, epochs: int) -> None:
    """A new run folder starts a run; one holding training state resumes it (a finished one only to train on,
    with more --epochs); anything else is left alone."""
    import json

    from ..training.checkpoint import step_folders

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder")
    has_state = bool(step_folders(folder))
    if (folder / "summary.json").exists():
        done = json.loads((folder / "summary.json").read_text()).get("epochs", 0)
        if not (has_state and epochs > done):
            raise UserError(f"--output-dir {path}: holds a finished run of {done} epoch(s); raise --epochs to train "
                            f"it on, or choose another folder")
    if resume and not has_state:
        raise UserError(f"--resume {path}: no training state (state/step-*) to resume from")
    if not has_state and any((folder / n).exists() for n in ("last.safetensors", "best.safetensors")):
        raise UserError(f"--output-dir {path}: holds weights but no training state to resume from; "
                        f"choose another folder")


def _check_resume(settings: Settings, world_size: int) -> None:
    """Refuse before any worker starts what the workers would refuse on resuming (see training/checkpoint.py). Reads the
    newest checkpoint's train.json without its checksums: every worker verifies them (and falls back) anyway."""
    from ..training.checkpoint import check_resumable, read_train_json, step_folders

    for folder in step_folders(Path(settings.run.output_dir)):
        try:
            train = read_train_json(folder)
        except (OSError, ValueError):  # damaged: the workers report it and take the one before
            continue
        check_resumable(folder, train, settings, world_size, settings.run.strategy == "fsdp" and world_size > 1)
        return


def _train(cfg: TrainConfig, resume: str | None = None) -> int:
    """In the launching (or only) process: check everything that can be checked before any worker starts (the
    batch plan on all nodes' devices, the run folder, a resume's settings, the data once), then launch the
    workers or train here."""
    from ..models import check_model_name
    from ..parallel import launched_world_size
    from ..training.worker import run as run_training

    check_model_name(cfg.model.model)
    if launched_world_size() is not None:  # a worker of torchrun, accelerate launch or srun
        run_training(cfg)
        return 0
    nproc, plan = job_shape(cfg)
    run_dir, made = run_folder(cfg, resume)
    settings = resolve(cfg.replace_run(output_dir=run_dir), plan)  # the data's recipe once the data is read
    r = settings.run
    with JobHold.launcher(r.output_dir, r.node_rank, made) as hold:  # one job per run folder, to the workers' end
        _check_output_dir(r.output_dir, resume is not None, settings.optim.epochs)
        _check_resume(settings, nproc * r.nnodes)
        if nproc == 1 and r.nnodes == 1:  # in this process, which says it holds the folder once the data passed
            run_training(settings, hold=hold)
            return 0
        return launch_job(settings, nproc, ["train"], hold)


def run_folder(cfg: TrainConfig, resume: str | None) -> tuple[str, bool]:
    """The run folder (--resume RUN_DIR, else --output-dir, else a new runs/<timestamp>) and whether it was made
    here for this job."""
    if resume not in (None, "."):
        return resume, False  # type: ignore[return-value]
    if cfg.run.output_dir:
        return cfg.run.output_dir, False
    if resume:
        raise UserError("--resume needs the run folder: --resume RUN_DIR or --output-dir RUN_DIR")
    return default_run_folder(), True


def job_shape(cfg: TrainConfig):
    """(processes to start on this machine, the job's batch plan); refuses a global batch the job's devices
    cannot split."""
    from ..parallel import available_gpus, resolve_nproc

    r = cfg.run
    nproc = 1 if r.strategy == "dp" else resolve_nproc(parse_nproc(str(r.nproc)), r.cpu)
    dp_devices = max(available_gpus(r.cpu), 1) if r.strategy == "dp" else 1
    return nproc, cfg.plan(nproc * r.nnodes * dp_devices, dp_devices)


def launch_job(settings: Settings, nproc: int, command: list[str], hold: JobHold) -> int:
    """Start `nproc` workers running `scaletrain *command --job FOLDER`, where FOLDER holds the config and the
    data checked here once (and pretrained weights fetched once), then remove it."""
    from ..models import HUB_WEIGHTS, build_model, read_state_dict
    from ..parallel import LAUNCHED_AT, Nodes, launch
    from ..training.job import remove_job

    r, m = settings.run, settings.model
    if m.pretrained == HUB_WEIGHTS:  # fetched once here, so the workers find them in the cache
        build_model(m.model, 3, 2, hub_weights=True)
    elif m.pretrained:
        read_state_dict(m.pretrained)
    folder = _settle_job(settings, hold)
    hold.checks_passed()  # every check has passed: say who holds the folder
    os.environ["SCALETRAIN_LAUNCH_TIME"] = repr(LAUNCHED_AT)  # the workers count their first step from here
    try:
        code = launch(nproc, [*command, "--job", str(folder)], r.max_restarts,
                      Nodes(r.nnodes, r.node_rank, r.master_addr, r.master_port))
    finally:
        remove_job(folder)
    if code == 75 and _finished(Path(r.output_dir), settings.optim.epochs):  # the stop came as the workers finished
        print("scaletrain: the run had finished when the stop came; nothing to resume", file=sys.stderr)
        return 0
    return code


def _finished(run_dir: Path, epochs: int) -> bool:
    import json

    try:
        return json.loads((run_dir / "summary.json").read_text()).get("epochs") == epochs
    except (OSError, ValueError):
        return False


def _settle_job(settings: Settings, hold: JobHold) -> Path:
    """Check the data once for this machine's workers and write it with the settings, now resolved from the data's
    recipe too, and whether the folder is held for them (see training/job.py)."""
    from ..training.job import check_data, job_folder, write_job

    t0 = time.perf_counter()
    train, val, skipped = check_data(settings.data, settings.run.seed)
    folder = job_folder(settings.run.output_dir)
    write_job(folder, train, val, settings.data.cache_dir, settings.with_recipe(train.recipe or "digits"),
              held=hold.handed_on)
    print(f"checked {len(train)} training and {len(val)} validation samples in {time.perf_counter() - t0:.1f} s; "
          f"the workers read them from {folder}", flush=True)
    hold.list_skipped(skipped)
    return folder
