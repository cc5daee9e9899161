"""`scaletrain verify`: train's flags, then each layout trained for a few steps beside one process and compared
step by step; the comparison and the localisation are in `scaletrain/measure/verify.py`, a job's recording in
`scaletrain/training/verify.py`."""

from __future__ import annotations

import argparse

from ..config import OptimConfig, RunConfig
from ..errors import UserError
from .train import add_train_flags, config_from_args

DEFAULT_LAYOUTS = "ddp2,fsdp2,tp2,pp2"


def add_parser(subparsers) -> None:
    verify = subparsers.add_parser(
        "verify", help="prove a model trains the same on each layout as on one process, or name the first module "
                       "that differs",
        description="Train a few optimizer steps on one process and on each layout (each a job of its own "
                    "processes: CPU processes over gloo with --cpu, GPUs otherwise), from the same initial weights on "
                    "the same batches, deterministic, with dropout, drop-path and augmentation off; compare the loss, "
                    "the gradient norm and every weight at every step. At the first step beyond the tolerances, name "
                    "the innermost module whose input agrees and whose output differs. Exit 0 when every layout is "
                    "equal, 1 when one differs or cannot run, 2 for bad input. Takes train's flags "
                    "(--model file.py:make, --data, the optimizer, ...).")
    group = verify.add_argument_group("verify")
    group.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                       help="comma-separated layouts, each its dimensions and degrees joined by x (ddp2, fsdp2, tp2, "
                            "pp2, tp2xfsdp2, pp2xtp2, pp2xddp2, pp2xfsdp2); its processes are their product "
                            f"[default: {DEFAULT_LAYOUTS}]")
    group.add_argument("--steps", type=int, default=3, help="optimizer steps compared [default: 3]")
    group.add_argument("--json", default="", metavar="FILE", help="also write the results to FILE")
    group.add_argument("--devices", type=int, default=0,
                       help="instead of --layouts: the layouts of this many devices that estimate-memory finds fit "
                            "--device-memory (a model by name), each verified")
    group.add_argument("--device-memory", default=None, metavar="SIZE",
                       help="with --devices: each device's memory, e.g. 80GB [default: the first GPU's]")
    add_train_flags(verify)


def run(args: argparse.Namespace) -> int:
    from ..parallel import layout_settings
    from ..training.verify import VerifyJob, run_command_job

    config = config_from_args(args)
    job = VerifyJob.from_environment()
    if job is not None:  # a process of one layout's job
        run_command_job(job, config)
        return 0
    from ..measure.verify import Program, finish, folder_for, verify
    from ..models import check_model_name

    check_model_name(config.model.model)
    if args.steps < 1:
        raise UserError(f"--steps: expected 1 or more, got {args.steps}")
    layouts = fitting_layouts(config.model.model, config.optim, config.run, config.data.image_size, args.devices,
                              args.device_memory) if args.devices else \
        [t.strip() for t in args.layouts.split(",") if t.strip()]
    if not layouts:
        raise UserError("--layouts: expected one layout or more, e.g. ddp2,tp2")
    for text in layouts:
        layout_settings(text)  # refused here, by name, before anything runs
    folder = folder_for(config.run.output_dir)
    reference, results, tolerance = verify(Program.this_command(["verify", *args.argv]), layouts, args.steps,
                                           folder, timeout=max(config.run.timeout, 600.0))
    finish(reference, results, args.steps, tolerance, folder, args.json)
    if reference.get("quieted"):
        print(f"turned off, as no layout can draw them as one process does: {', '.join(reference['quieted'])}")
    print(f"gaps per step: {folder / 'verify.png'}; every job's output under {folder}")
    return 0 if all(r.equal for r in results) else 1


def fitting_layouts(model: str, o: OptimConfig, r: RunConfig, image_size: int, devices: int,
                    device_memory: str | None) -> list[str]:
    """The layouts of `devices` devices that `estimate-memory --devices` finds fit, as verify writes them; the
    others said, with why."""
    from ..measure.memory import OPTIMIZER_STATE_TENSORS, layouts
    from ..measure.verify import layout_text

    if devices < 2:
        raise UserError(f"--devices: expected 2 or more devices to lay out, got {devices}")
    optimizer = o.optimizer if o.optimizer in OPTIMIZER_STATE_TENSORS else "adamw"
    found, _ = layouts(model, devices, batch_size=max(1, (o.global_batch_size or o.batch_size) // devices),
                       mixed_precision=r.mixed_precision, optimizer=optimizer, image_size=image_size or None,
                       device_memory=device_memory)
    fit = [layout_text(c.flags, devices) for c in found if c.fits]
    for c in found:
        if not c.fits:
            print(f"verify: {c.name} left out: " + (c.why or "does not fit --device-memory"), flush=True)
    if not fit:
        raise UserError(f"--devices {devices}: no layout fits --device-memory; `scaletrain estimate-memory --model "
                        f"{model} --devices {devices}` shows each one's bytes")
    return fit
