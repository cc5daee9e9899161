"""`scaletrain evaluate`: loss, accuracy, per-class accuracy and the confusion matrix of a checkpoint."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..config import _f
from ._inference import InferenceOptions, add_inference_parser, check, launch_or_run
from .common import options_from_args


@dataclass(kw_only=True)
class EvaluateOptions(InferenceOptions):
    split: str = _f("auto", "which samples of --data: all, or the train/val parts as training split them (auto: "
                    "val for the embedded default, all otherwise)", choices=("auto", "all", "train", "val"))
    output_dir: str = _f("", "where metrics.json, confusion_matrix.csv and .png go [default: <checkpoint "
                         "folder>/eval]")


def add_parser(subparsers) -> None:
    add_inference_parser(
        subparsers, "evaluate", EvaluateOptions,
        help="loss, accuracy, per-class accuracy and confusion matrix of a checkpoint on labelled data",
        description="Evaluate a trained checkpoint on labelled data on 1..N processes; every sample counted once.")


def run(args: argparse.Namespace) -> int:
    from ..inference.checkpoint import resolve_checkpoint

    opts: EvaluateOptions = options_from_args(EvaluateOptions, args)
    check(opts)
    argv = args.argv
    if not opts.output_dir:
        opts.output_dir = str(resolve_checkpoint(opts.checkpoint).parent / "eval")
        argv = [*argv, "--output-dir", opts.output_dir]
    return launch_or_run(opts, "evaluate", argv, lambda ckpt: _inputs(opts, ckpt),
                         lambda ckpt, data, logits, runtime: _write(opts, ckpt, data, logits, runtime))


def _inputs(opts: EvaluateOptions, ckpt):
    from ..inference.inputs import labelled_set

    data = labelled_set(opts.data, opts.split, ckpt, opts.data_format)
    return data, data


def _write(opts: EvaluateOptions, ckpt, data, logits, runtime) -> None:
    import torch

    from ..inference.predict import classification_report, write_report

    report = classification_report(logits, torch.as_tensor(data.labels), ckpt.classes)
    report.update(checkpoint=str(opts.checkpoint), data=opts.data, split=opts.split, world_size=runtime.world_size)
    write_report(report, Path(opts.output_dir))
    print(f"{report['samples']} samples: loss {report['loss']:.4f}  accuracy {report['accuracy']:.4f}  "
          f"({runtime.world_size} process(es)); wrote {opts.output_dir}/metrics.json, confusion_matrix.csv/.png")
