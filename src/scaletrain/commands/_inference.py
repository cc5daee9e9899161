"""What `predict` and `evaluate` share: their common options, the checks made before any worker starts,
launching, and one process's scoring; each command brings its inputs and writes its own outputs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from ..config import AUTO_WORKERS, PER_DEVICE_STRATEGIES, PRECISIONS, _f, parse_nproc
from ..errors import UserError
from .common import add_config_flag, add_flags, check_run_options, nodes_of, run_field


@dataclass(kw_only=True)
class InferenceOptions:
    checkpoint: str = _f(None, "a run folder (its best.safetensors) or a .safetensors file", required=True)
    data: str = _f(None, "inputs: as for train, or a Kaggle test.csv folder/file, or a folder of images",
                   required=True)
    data_format: str = _f("auto", "how to read --data")
    model: str = _f("", "for a checkpoint of a model from your own code: its factory, path/to/file.py:factory or "
                    "package.module:factory [default: the checkpoint's, when it is the unchanged file a run on this "
                    "machine trained with]", show_default=False)
    batch_size: int = _f(256, "batch size per process", from_config=True)
    num_workers: int = _f(AUTO_WORKERS, "DataLoader workers for image files",
                          from_config=lambda v: AUTO_WORKERS if v == "auto" else v)  # a training config's auto
    mixed_precision: str = _f("no", "autocast precision", choices=PRECISIONS, from_config=True)
    cpu: bool = run_field("cpu", help="run on the CPU even when GPUs are present")
    nproc: str = _f("auto", "processes: 'auto' (one per GPU, 1 on CPU) or a number", show_default=False,
                    from_config=True)
    strategy: str = _f("ddp", "ddp: every process holds the whole model; fsdp: each holds a shard and gathers one "
                       "block at a time (models larger than one device)", choices=PER_DEVICE_STRATEGIES,
                       from_config=True)
    nnodes: int = run_field("nnodes")
    node_rank: int = run_field("node_rank")
    master_addr: str = run_field("master_addr")
    master_port: int = run_field("master_port")
    seed: int = run_field("seed")
    timeout: float = run_field("timeout")


def add_inference_parser(subparsers, name: str, options: type, **texts: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, **texts)
    add_config_flag(parser, options)
    add_flags(parser, options)
    return parser


def check(opts: InferenceOptions) -> None:
    if opts.batch_size <= 0:
        raise UserError(f"--batch-size must be a positive integer, got {opts.batch_size}")
    if opts.num_workers < 0:
        raise UserError(f"--num-workers must not be negative, got {opts.num_workers}")
    check_run_options(opts)
    parse_nproc(opts.nproc)


def launch_or_run(opts: InferenceOptions, command: str, argv: list[str], inputs: Callable[[Any], Any],
                  write: Callable[[Any, Any, Any, Any], None]) -> int:
    """Launch workers running `command` again when the job has more than one process; else run it here.

    `inputs(ckpt)` loads the inputs and returns them with what of them is scored (the launching process loads
    them once first, to fail before any worker starts); `write(ckpt, inputs, logits, runtime)` runs on the main
    process only.
    """
    from ..inference.checkpoint import load_checkpoint
    from ..parallel import launch, launched_world_size, resolve_nproc

    if launched_world_size() is None:
        nproc = resolve_nproc(parse_nproc(opts.nproc), opts.cpu)
        if nproc > 1 or opts.nnodes > 1:  # one process alone loads these below, not twice
            inputs(load_checkpoint(opts.checkpoint, opts.model))
            return launch(nproc, [command, *argv], nodes=nodes_of(opts))
    _score(opts, inputs, write)
    return 0


def _score(opts: InferenceOptions, inputs: Callable[[Any], Any], write: Callable[[Any, Any, Any, Any], None]):
    """One process's part: score its shard of the inputs; the main process writes the outputs."""
    from ..inference.checkpoint import load_checkpoint
    from ..inference.predict import predict_logits
    from ..parallel import Runtime

    runtime = Runtime(opts.mixed_precision, opts.cpu, timeout_seconds=opts.timeout, strategy=opts.strategy)
    try:
        runtime.seed(opts.seed)
        ckpt = load_checkpoint(opts.checkpoint, opts.model)
        loaded, scored = inputs(ckpt)
        logits = predict_logits(ckpt.model, scored, ckpt.preprocess, runtime, opts.batch_size, opts.num_workers)
        if runtime.is_main:
            write(ckpt, loaded, logits, runtime)
    finally:
        runtime.end()
