"""`scaletrain predict`: labels for unlabelled inputs, one CSV row per input in input order."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..config import _f
from ..errors import UserError
from ._inference import InferenceOptions, add_inference_parser, check, launch_or_run
from .common import options_from_args


@dataclass(kw_only=True)
class PredictOptions(InferenceOptions):
    output: str = _f("submission.csv", "CSV to write (atomically)")
    top_k: int = _f(1, "also write the 2nd..k-th most likely labels", show_default=False)
    probabilities: bool = _f(False, "add one probability column per class")
    logits: bool = _f(False, "add one raw-score (logit) column per class, e.g. to average models or compare "
                             "devices")


def add_parser(subparsers) -> None:
    add_inference_parser(
        subparsers, "predict", PredictOptions,
        help="predict labels for unlabelled inputs into a CSV (e.g. a Kaggle submission)",
        description="Predict with a trained checkpoint on 1..N processes; exactly one row per input, in input "
                    "order: ImageId,Label for Kaggle test.csv, path,label for image folders, index,label otherwise.")


def run(args: argparse.Namespace) -> int:
    from ..inference.predict import check_writable
    from ..parallel import launched_world_size

    opts: PredictOptions = options_from_args(PredictOptions, args)
    check(opts)
    if opts.top_k <= 0:
        raise UserError(f"--top-k must be a positive integer, got {opts.top_k}")
    if launched_world_size() is None:  # the launching (or only) process checks before any worker starts
        check_writable(Path(opts.output))
    return launch_or_run(opts, "predict", args.argv, lambda ckpt: _inputs(opts, ckpt),
                         lambda ckpt, inputs, logits, runtime: _write(opts, ckpt, inputs, logits, runtime))


def _inputs(opts: PredictOptions, ckpt):
    from ..inference.inputs import check_sample_submission, load_inputs

    inputs = load_inputs(opts.data, ckpt.preprocess, opts.data_format)
    check_sample_submission(inputs)
    return inputs, inputs.images


def _write(opts: PredictOptions, ckpt, inputs, logits, runtime) -> None:
    from ..inference.predict import submission_csv
    from ..runfolder import atomic_write_text

    atomic_write_text(Path(opts.output), submission_csv(inputs, logits, ckpt.classes, opts.top_k,
                                                        opts.probabilities, opts.logits))
    print(f"wrote {len(inputs.ids)} predictions to {opts.output} ({runtime.world_size} process(es))")
