"""`scaletrain train`: flags from `TrainConfig`, the checks made before any worker starts, the run folder, and
launching; the training itself is `training.worker.run`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os

from ..config import RunConfig, TrainConfig, parse_nproc, read_config_file, resolve
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


# The run settings that say how the processes divide the model: a group of their own in --help.
LAYOUT_FLAGS = ("strategy", "tp", "stages", "split_at", "microbatches", "schedule", "shard_stages", "init_from")
GROUPS = (  # (title, TrainConfig section, which of its fields, description)
    ("data", "data", None, "what is read and how it becomes batches"),
    ("model", "model", None, "which model, and how it runs"),
    ("optimisation", "optim", None, "epochs, batch, learning rate, optimizer, schedule, regularisation"),
    ("layout", "run", LAYOUT_FLAGS.__contains__,
     "how the processes divide the model: ddp (the default) gives each a whole copy; --strategy fsdp shards it "
     "when it does not fit one device; --tp N splits each layer of a transformer over N (GPUs joined by NVLink); "
     "--strategy pipeline cuts it into stages (across nodes); they compose. `scaletrain estimate-memory --devices "
     "N` picks one, `scaletrain verify` proves your model the same on each"),
    ("run", "run", lambda name: name not in LAYOUT_FLAGS,
     "processes and machines, precision, the run folder, checkpoints, logging, seeds, timeouts"),
)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` and one flag per `TrainConfig` field, grouped by concern (GROUPS) and stored as
    `section.name` (read back by `config_from_args`)."""
    parser.add_argument("--config", default="", metavar="FILE", help="YAML file of settings (any flag as a key; "
                        "`scaletrain config` writes a starter); flags given on the command line win")
    sections = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
    for title, section, only, description in GROUPS:
        add_flags(parser.add_argument_group(title, description), sections[section],  # type: ignore[arg-type]
                  prefix=f"{section}.", negatable=True, only=only)


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


def _train(cfg: TrainConfig, resume: str | None = None) -> int:
    """In the launching (or only) process: check everything that can be checked before any worker starts (the
    batch plan on all nodes' devices, the run folder, a resume's settings, the data once), then launch the
    workers or train here. (The whole config: it resolves it for the job.)"""
    from ..data import read_ahead
    from ..models import check_model_name
    from ..parallel import launched_world_size
    from ..training.checkpoint import check_run_folder, resumed_plan
    from ..training.job import launch_job
    from ..training.worker import run as run_training

    with contextlib.ExitStack() as ahead:
        # The process that checks the data begins it now: a large folder's first check runs on worker processes
        # while the model's code imports (timm's takes seconds).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            ahead.enter_context(read_ahead(cfg.data.typed()))
        check_model_name(cfg.model.model)
        if launched_world_size() is not None:  # a worker of torchrun, accelerate launch or srun
            run_training(cfg)
            return 0
        nproc, devices, per_process = job_shape(cfg.run)
        plan = cfg.plan(devices, per_process)  # refuses a global batch the job's devices cannot split
        run_dir, made = run_folder(cfg.run.output_dir, resume)
        plan = resumed_plan(run_dir, plan, bool(cfg.optim.global_batch_size))  # on another count: the run's batch
        settings = resolve(cfg.replace_run(output_dir=run_dir), plan)  # the data's recipe once the data is read
        r = settings.run
        with JobHold.launcher(r.output_dir, r.node_rank, made) as hold:  # one job a run folder, to its end
            check_run_folder(r, settings.to_dict(), settings.plan, resume is not None, nproc * r.nnodes)
            if nproc == 1 and r.nnodes == 1:  # in this process, which says it holds the folder once the data passed
                run_training(settings, hold=hold)
                return 0
            return launch_job(settings, nproc, ["train"], hold)


def run_folder(output_dir: str, resume: str | None) -> tuple[str, bool]:
    """The run folder (--resume RUN_DIR, else --output-dir, else a new runs/<timestamp>) and whether it was made
    here for this job."""
    if resume not in (None, "."):
        return resume, False  # type: ignore[return-value]
    if output_dir:
        return output_dir, False
    if resume:
        raise UserError("--resume needs the run folder: --resume RUN_DIR or --output-dir RUN_DIR")
    return default_run_folder(), True


def job_shape(r: RunConfig) -> tuple[int, int, int]:
    """(processes to start on this machine, the job's data-parallel devices, the devices each process drives):
    what the job's batch plan is made for (TrainConfig.plan)."""
    from ..parallel import Layout, available_gpus, resolve_nproc

    nproc = 1 if r.strategy == "dp" else resolve_nproc(parse_nproc(str(r.nproc)), r.cpu)
    layout = Layout.of(r, nproc * r.nnodes, gpus=max(available_gpus(r.cpu), 1))
    return nproc, layout.devices, layout.gpus_per_process
