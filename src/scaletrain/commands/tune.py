"""`scaletrain tune`: train's flags plus what to find, the checks made before any worker starts, and launching
as train does; the learning-rate range test and the batch search themselves are `scaletrain/measure/tune.py`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import _f, resolve
from ..errors import UserError
from .common import add_flags, field_like, flag
from .estimate_memory import MemoryOptions
from ..runfolder import JobHold, default_run_folder
from .train import add_train_flags, config_from_args, job_shape

FINDS = ("lr", "batch")


@dataclass(kw_only=True)
class TuneOptions:
    find: str = _f(None, "lr: the learning-rate range test (the loss over --num-steps optimizer steps at rates "
                   "growing from --min-lr to --max-lr); batch: the largest batch per device whose training steps "
                   "fit in memory", choices=FINDS, required=True)
    min_lr: float = _f(1e-6, "--find lr: the first step's learning rate")
    max_lr: float = _f(1.0, "--find lr: the last step's learning rate")
    num_steps: int = _f(100, "--find lr: optimizer steps of the sweep (fewer when the loss diverges first)")
    device_memory: str | None = field_like(
        MemoryOptions, "device_memory", help="--find batch: memory of one device to fit in, e.g. 16GB, 141GiB, "
        "16000MB or bytes; 90%% of it counts as usable, as for estimate-memory (needed on a CPU; on a GPU "
        "running out of its memory decides anyway)")


def add_parser(subparsers) -> None:
    tune = subparsers.add_parser(
        "tune", help="find a learning rate (range test) or the largest batch that fits, on N processes",
        description="Find a learning rate or a batch size for a training run: takes train's flags (data, model, "
                    "optimizer, batch, precision, --nproc) and runs as train would, then prints one last line, "
                    "'suggested lr X' or 'suggested batch N'. Writes lr_find.png/.json/.csv or batch_find.png/"
                    ".json/.csv into --output-dir; no weights, no checkpoints.")
    add_flags(tune.add_argument_group("tune"), TuneOptions)
    add_train_flags(tune)
    tune.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a worker: what its launcher settled


def _options(args: argparse.Namespace) -> TuneOptions:
    opts = TuneOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TuneOptions)
                          if hasattr(args, f.name)})
    if not opts.min_lr > 0:
        raise UserError(f"--min-lr must be a positive number, got {opts.min_lr}")
    if not opts.max_lr > opts.min_lr:
        raise UserError(f"--max-lr must be larger than --min-lr ({opts.min_lr:g}), got {opts.max_lr}")
    if opts.num_steps < 3:
        raise UserError(f"--num-steps must be at least 3, got {opts.num_steps}")
    if opts.device_memory is not None:
        from ..measure.memory import parse_memory

        parse_memory(opts.device_memory)
    return opts


def _worker_args(opts: TuneOptions) -> list[str]:
    return [word for f in dataclasses.fields(opts) if (value := getattr(opts, f.name)) is not None
            for word in (flag(f.name), repr(value) if isinstance(value, float) else str(value))]


def _finding(opts: TuneOptions) -> dict[str, Any]:
    """What measure.tune.run takes of tune's own flags, beside `find`."""
    from ..measure.memory import parse_memory

    memory = parse_memory(opts.device_memory) if opts.device_memory is not None else None
    return dict(min_lr=opts.min_lr, max_lr=opts.max_lr, num_steps=opts.num_steps, device_memory=memory)


def _check_output_dir(path: str) -> None:
    """A folder of tune's own: a training run's folder is left alone."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder")
    training = [n for n in ("state", "metrics.csv", "summary.json", "last.safetensors", "best.safetensors")
                if (folder / n).exists()]
    if training:
        raise UserError(f"--output-dir {path}: holds a training run ({training[0]}); tune writes into a folder of "
                        f"its own")


def run(args: argparse.Namespace) -> int:
    from ..measure.tune import run as find_in_this_process
    from ..training.job import launch_job, read_settings
    from ..models import check_model_name
    from ..parallel import available_gpus, launched_world_size, mps_available

    opts = _options(args)
    if args.job:  # a worker that scaletrain's launcher started: config and data were settled there
        find_in_this_process(read_settings(args.job), opts.find, args.job, **_finding(opts))
        return 0
    cfg = config_from_args(args)
    check_model_name(cfg.model.model)
    r = cfg.run
    if opts.find == "batch":
        if r.strategy != "ddp":
            raise UserError(f"--find batch measures one process per device (--strategy ddp), not --strategy "
                            f"{r.strategy}; `scaletrain estimate-memory --strategy fsdp` estimates fsdp")
        if opts.device_memory is None and (r.cpu or (available_gpus(False) == 0 and not mps_available())):
            raise UserError("--find batch on a CPU needs --device-memory SIZE (e.g. 16GB): the memory to fit in; "
                            "a CPU does not run out of it the way a GPU does")
    if launched_world_size() is not None:  # a worker of torchrun, accelerate launch or srun
        find_in_this_process(cfg, opts.find, **_finding(opts))
        return 0
    nproc, devices, per_process = job_shape(r)
    plan = cfg.plan(devices, per_process)  # refuses a global batch the job's devices cannot split
    made = not r.output_dir
    settings = resolve(cfg.replace_run(output_dir=r.output_dir or default_run_folder()), plan)
    r = settings.run
    with JobHold.launcher(r.output_dir, r.node_rank, made) as hold:  # one job per run folder
        _check_output_dir(r.output_dir)
        if nproc == 1 and r.nnodes == 1:
            find_in_this_process(settings, opts.find, hold=hold, **_finding(opts))
            return 0
        return launch_job(settings, nproc, ["tune", *_worker_args(opts)], hold)
