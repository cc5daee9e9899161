"""`scaletrain estimate-memory`: will a model and batch fit on a device; its flags mirror train's, plus the device
memory to compare with. The estimate itself is `scaletrain/measure/memory.py`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from ..config import PRECISIONS, SCHEDULES, _f
from ..measure.memory import ESTIMATED_STRATEGIES, OPTIMIZER_STATE_TENSORS
from .common import add_flags, options_from_args


@dataclass(kw_only=True)
class MemoryOptions:
    model: str = _f(None, "built-in (smallcnn, tinycnn) or any timm model name", required=True)
    image_size: int | None = _f(None, "image side in pixels [default: 28 for the built-in models, the timm model's "
                                "own input size]")
    channels: int | None = _f(None, "input channels, 1 or 3 [default: 1 for the built-in models, 3 for timm "
                              "models]")
    num_classes: int = _f(10, "classes")
    batch_size: int = _f(128, "batch size per device")
    mixed_precision: str = _f("no", "", choices=PRECISIONS)
    strategy: str = _f("ddp", "pipeline: each stage's bytes (--stages, --microbatches, --schedule as train takes "
                       "them)", choices=ESTIMATED_STRATEGIES)
    stages: int = _f(0, "--strategy pipeline: stages [default: --nproc]")
    microbatches: int = _f(0, "--strategy pipeline: micro-batches per batch [default: as train chooses]")
    schedule: str = _f("1f1b", "--strategy pipeline", choices=SCHEDULES)
    nproc: int = _f(1, "processes (devices)")
    tp: int = _f(1, "tensor parallelism: each layer of the model's plan split over this many of the processes "
                 "(--strategy over the rest)")
    optimizer: str = _f("sgd", "sgd keeps one momentum buffer per parameter, adam and adamw two moments",
                        choices=tuple(OPTIMIZER_STATE_TENSORS))
    activation_checkpointing: bool = _f(False, "recompute each block's activations in the backward pass, as "
                                        "`train --activation-checkpointing` does")
    devices: int = _f(0, "estimate every layout of this many devices (ddp, fsdp, tensor parallelism with ddp or "
                      "fsdp over the rest, a pipeline) instead of one, and pick the first that fits in the order of "
                      "what each step communicates (0: the one layout --strategy, --nproc and --tp give)")
    device_memory: str | None = _f(None, "device memory to compare with, e.g. 80GB, 141GiB, 16000MB or bytes "
                                   "[default: the first GPU's, or no verdict without one]", metavar="SIZE")
    json: bool = _f(False, "print the estimate as JSON (exact bytes)")


def add_parser(subparsers) -> None:
    memory = subparsers.add_parser(
        "estimate-memory", help="will a model and batch fit on a device: per-device bytes of a training step",
        description="Estimate the per-device memory of training a model: weights, gradients and optimizer state "
                    "from the parameter shapes and the strategy, activations measured by real steps at batches 2 "
                    "and 4 on the CPU and scaled to --batch-size; then whether it fits --device-memory (90% of "
                    "it counted as usable) and the largest batch that does.")
    add_flags(memory, MemoryOptions)


def run(args: argparse.Namespace) -> int:
    """Print the per-device memory table (or JSON) and the verdict."""
    from ..measure.memory import estimate, render

    opts: MemoryOptions = options_from_args(MemoryOptions, args)
    settings = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("model", "json", "devices")}
    if opts.devices:
        return _layouts(opts, settings)
    result = estimate(opts.model, **settings)
    print(json.dumps(result.to_dict(), indent=2) if opts.json else render(result))
    return 0


def _layouts(opts: MemoryOptions, settings: dict) -> int:
    from ..errors import UserError
    from ..measure.memory import layouts, render_layouts

    if opts.devices < 1:
        raise UserError(f"--devices must be a positive number of devices, got {opts.devices}")
    found, picked = layouts(opts.model, opts.devices, **settings)
    if opts.json:
        print(json.dumps({"layouts": [{"layout": layout.name, "flags": layout.flags, "why_not": layout.why or None,
                                       **({"estimate": layout.estimate.to_dict()} if layout.estimate else {})}
                                      for layout in found], "picked": picked.name if picked else None}, indent=2))
    else:
        print(render_layouts(opts.model, opts.devices, found, picked))
    return 0
