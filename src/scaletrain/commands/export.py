"""`scaletrain export`: a trained checkpoint as an ONNX or TorchScript file for serving, checked against PyTorch
before it is written. The work is in `scaletrain/inference/export.py`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..config import _f
from ..errors import UserError
from .common import add_flags, options_from_args

FORMATS = ("onnx", "torchscript")  # as scaletrain.inference.export.FORMATS, not imported for --help


@dataclass(kw_only=True)
class ExportOptions:
    checkpoint: str = _f(None, "a run folder (its best.safetensors, else last.safetensors) or a .safetensors file, "
                         "as for predict", required=True)
    format: str = _f(None, "onnx (needs scaletrain[export]) or torchscript", choices=FORMATS, required=True)
    output: str = _f(None, "file to write (atomically, and only when the export matches PyTorch)", required=True)
    data: str = _f("", "images to check the export on, read as predict reads --data [default: the validation "
                   "part of the run's own data]")
    data_format: str = _f("auto", "how to read --data")
    check_samples: int = _f(256, "how many of those images to compare PyTorch and the export on (0: all)")
    batch_size: int = _f(64, "batch size of the check (the first image is also checked alone)")
    tolerance: float = _f(1e-4, "largest logit difference accepted, relative to the largest logit (at least 1)")
    model: str = _f("", "for a checkpoint of a model from your own code: its factory, path/to/file.py:factory or "
                    "package.module:factory [default: the checkpoint's, when it is the unchanged file a run on this "
                    "machine trained with]", show_default=False)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint as ONNX or TorchScript for serving, with its preprocessing",
        description="Export a trained checkpoint to a file that takes float32 N x C x H x W (N free) and returns "
                    "logits, with the input size, channels, mean, std, crop and class names recorded in it "
                    "(ONNX: metadata_props['scaletrain']; TorchScript: extra file scaletrain.json). It is written "
                    "only after its logits and labels have matched PyTorch's on real images.")
    add_flags(parser, ExportOptions)


def run(args: argparse.Namespace) -> int:
    from ..inference.checkpoint import load_checkpoint
    from ..inference.export import check_images, export_checkpoint, require_packages
    from ..inference.predict import check_writable

    opts: ExportOptions = options_from_args(ExportOptions, args)
    if opts.batch_size <= 0:
        raise UserError(f"--batch-size must be a positive integer, got {opts.batch_size}")
    if opts.check_samples < 0:
        raise UserError(f"--check-samples must be 0 (all) or a positive integer, got {opts.check_samples}")
    if not opts.tolerance > 0:
        raise UserError(f"--tolerance must be a positive number, got {opts.tolerance}")
    require_packages(opts.format)
    output = Path(opts.output)
    check_writable(output)
    ckpt = load_checkpoint(opts.checkpoint, opts.model)
    images = check_images(ckpt, opts.data, opts.data_format, opts.check_samples)
    print(export_checkpoint(ckpt, opts.checkpoint, opts.format, output, images, opts.batch_size, opts.tolerance))
    return 0
