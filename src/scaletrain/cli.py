"""The `scaletrain` command: argument parsing, process launching and one-line errors.

Flags are generated from the config dataclasses, so `--help`, config.yaml and the code agree. User errors print
one line and exit 2; a diverged run exits 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from . import __version__
from .config import (DATA_FORMATS, PER_DEVICE_STRATEGIES, PRECISIONS, STRATEGIES, RunConfig, TrainConfig,
                     parse_nproc, read_config_file, starter_config_text)
from .errors import UserError
from .bench import INTERCONNECTS
from .sources import Skipped


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on one line (no usage dump) and suggests the closest flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # '--epoch' must not silently mean '--epochs'
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            unknown = [w for w in message.split(":", 1)[1].split() if w.startswith("-")]
            for word in unknown:
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        raise UserError(message)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section, typed by its default."""
    for section in dataclasses.fields(TrainConfig):
        group = parser.add_argument_group(section.name)
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            flag = "--" + f.name.replace("_", "-")
            text = f.metadata["help"]
            if f.default is not None and "default" not in text and not isinstance(f.default, bool):
                text += f" [default: {f.default if f.default != '' else 'none'}]"
            kwargs = {"dest": f"{section.name}.{f.name}", "help": text, "default": argparse.SUPPRESS}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = float if (isinstance(f.default, float) or "float" in str(f.type)) else (
                    int if isinstance(f.default, int) else str)
                kwargs["metavar"] = f.name.upper()
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
                    kwargs["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
            group.add_argument(flag, **kwargs)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The defaults, then --config FILE, then the flags given."""
    values: dict[str, dict] = read_config_file(args.config) if args.config else {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(values).validate()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description="Train image classifiers on a CPU, one GPU or many processes.")
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    train = commands.add_parser(
        "train", help="train a classifier (default: the small CNN on the embedded 10k MNIST images)",
        description="Train a classifier. Batch size is per process; run the same command under torchrun, "
                    "accelerate launch, or with --nproc N.")
    train.add_argument("--config", default="", metavar="FILE", help="YAML file of settings (any flag as a key; "
                       "`scaletrain config` writes a starter); flags given on the command line win")
    _add_config_flags(train)
    train.add_argument("--resume", nargs="?", const=".", default=None, metavar="RUN_DIR",
                       help="continue the run in RUN_DIR (or --output-dir) exactly where its last checkpoint "
                            "stopped; a run folder holding training state is resumed even without this flag")

    report = commands.add_parser("report", help="print a run's summary and epochs, and redraw its curves.png",
                                 description="Print a run folder's settings, one row per epoch and the best "
                                             "accuracy, and draw its training curves again into curves.png.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (from scaletrain train)")
    commands.add_parser("env", help="versions, devices and launcher environment, for a bug report",
                        description="Print torch, CUDA, NCCL and accelerate versions, the devices and their "
                                    "memory, and the launcher environment this process sees.")
    config = commands.add_parser(
        "config", help="write a commented starter settings file for `scaletrain train --config`",
        description="Write every `scaletrain train` setting at its default, each with its help as a comment.")
    config.add_argument("path", nargs="?", default="scaletrain.yaml", help="file to write [default: "
                        "scaletrain.yaml]; an existing file is left alone")
    predict = commands.add_parser(
        "predict", help="predict labels for unlabelled inputs into a CSV (e.g. a Kaggle submission)",
        description="Predict with a trained checkpoint on 1..N processes; exactly one row per input, in input "
                    "order: ImageId,Label for Kaggle test.csv, path,label for image folders, index,label otherwise.")
    _add_inference_flags(predict)
    predict.add_argument("--output", default="submission.csv", help="CSV to write (atomically) [default: "
                         "submission.csv]")
    predict.add_argument("--top-k", type=int, default=1, help="also write the 2nd..k-th most likely labels")
    predict.add_argument("--probabilities", action="store_true", help="add one probability column per class")
    predict.add_argument("--logits", action="store_true", help="add one raw-score (logit) column per class, e.g. "
                         "to average models or compare devices")

    evaluate = commands.add_parser(
        "evaluate", help="loss, accuracy, per-class accuracy and confusion matrix of a checkpoint on labelled data",
        description="Evaluate a trained checkpoint on labelled data on 1..N processes; every sample counted once.")
    _add_inference_flags(evaluate)
    evaluate.add_argument("--split", default="auto", choices=("auto", "all", "train", "val"),
                          help="which samples of --data: all, or the train/val parts as training split them "
                               "(auto: val for the embedded default, all otherwise)")
    evaluate.add_argument("--output-dir", default="", help="where metrics.json, confusion_matrix.csv and .png go "
                          "[default: <checkpoint folder>/eval]")
    bench = commands.add_parser(
        "bench", help="the seeds' table: devices x precision x batch size -> seconds per epoch, speed-up, accuracy",
        description="Train every cell of a matrix in fresh processes and tabulate seconds per epoch (first epoch "
                    "excluded as warm-up), images/s, speed-up and efficiency against the fewest devices, and "
                    "validation accuracy; with a projection to device and node counts not at hand. Arguments "
                    "after '--' go to every `scaletrain train`.")
    bench.add_argument("--nproc", default="1", help="comma-separated process counts [default: 1]")
    bench.add_argument("--mixed-precision", default="no", help="comma-separated precisions [default: no]")
    bench.add_argument("--batch-size", default="128", help="comma-separated batch sizes per device [default: 128]")
    bench.add_argument("--global-batch-size", default="", help="comma-separated global batch sizes, instead of "
                       "--batch-size: the per-device batch is derived for each device count")
    bench.add_argument("--strategy", default="ddp", help="comma-separated strategies: ddp, dp, fsdp [default: ddp]")
    bench.add_argument("--sync-bn", default="no", help="comma-separated: no, yes (SyncBatchNorm) [default: no]")
    bench.add_argument("--epochs", type=int, default=2, help="epochs per cell [default: 2]")
    bench.add_argument("--model", default="smallcnn", help="model [default: smallcnn]")
    bench.add_argument("--data", default="default", help="dataset, as for train [default: default]")
    bench.add_argument("--output-dir", default="", help="where bench.csv, bench.json, bench.png and the cells' "
                       "run folders go [default: bench/<timestamp>]")
    bench.add_argument("--interconnect", default="pcie", help="for the projection: " + ", ".join(
        f"{k} ({v:g} GB/s)" for k, v in INTERCONNECTS.items()) + ", a bandwidth in GB/s, or 'measure' (a short "
        "all-reduce of the gradients' size between this machine's devices, or 2 CPU processes) [default: pcie]")
    bench.add_argument("--inter-node", default="infiniband", help="link between nodes for the projection, as "
                       "--interconnect [default: infiniband]")
    bench.add_argument("--overlap", type=float, default=0.5, help="share of gradient communication hidden behind "
                       "the backward pass, for the projection [default: 0.5]")
    bench.add_argument("--project-devices", default="1,2,4,8", help="device counts per node to project "
                       "[default: 1,2,4,8]")
    bench.add_argument("--project-nodes", default="1,2", help="node counts to project [default: 1,2]")
    bench.add_argument("--cell-timeout", type=float, default=3600, help="seconds before a cell counts as failed "
                       "[default: 3600]")
    _add_estimate_memory_parser(commands)
    parser.commands = commands.choices  # type: ignore[attr-defined]
    return parser


def _add_estimate_memory_parser(commands) -> None:
    """`scaletrain estimate-memory`: its flags mirror train's, plus the device to compare with."""
    from .memory import OPTIMIZER_STATE_TENSORS

    memory = commands.add_parser(
        "estimate-memory", help="will a model and batch fit on a device: per-device bytes of a training step",
        description="Estimate the per-device memory of training a model: weights, gradients and optimizer state "
                    "from the parameter shapes and the strategy, activations measured by real steps at batches 2 "
                    "and 4 on the CPU and scaled to --batch-size; then whether it fits --device-memory (90% of "
                    "it counted as usable) and the largest batch that does.")
    memory.add_argument("--model", required=True, help="built-in (smallcnn, tinycnn) or any timm model name")
    memory.add_argument("--image-size", type=int, default=None, help="image side in pixels [default: 28 for the "
                        "built-in models, the timm model's own input size]")
    memory.add_argument("--channels", type=int, default=None, help="input channels, 1 or 3 [default: 1 for the "
                        "built-in models, 3 for timm models]")
    memory.add_argument("--num-classes", type=int, default=10, help="classes [default: 10]")
    memory.add_argument("--batch-size", type=int, default=128, help="batch size per device [default: 128]")
    memory.add_argument("--mixed-precision", default="no", choices=PRECISIONS, help="[default: no]")
    memory.add_argument("--strategy", default="ddp", choices=PER_DEVICE_STRATEGIES, help="[default: ddp]")
    memory.add_argument("--nproc", type=int, default=1, help="processes (devices) [default: 1]")
    memory.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZER_STATE_TENSORS), help="sgd keeps one "
                        "momentum buffer per parameter, adam and adamw two moments [default: sgd]")
    memory.add_argument("--activation-checkpointing", action="store_true", help="recompute each block's "
                        "activations in the backward pass, as `train --activation-checkpointing` does")
    memory.add_argument("--device-memory", default=None, metavar="SIZE", help="device memory to compare with, "
                        "e.g. 80GB, 141GiB, 16000MB or bytes [default: the first GPU's, or no verdict without one]")
    memory.add_argument("--json", action="store_true", help="print the estimate as JSON (exact bytes)")


def _bandwidth(flag: str, value: str) -> float:
    if value in INTERCONNECTS:
        return INTERCONNECTS[value]
    try:
        gbps = float(value)
    except ValueError:
        raise UserError(f"{flag}: expected one of {', '.join(INTERCONNECTS)} or GB/s, got '{value}'") from None
    if gbps <= 0:
        raise UserError(f"{flag}: bandwidth must be positive, got {value}")
    return gbps


def _report(run_dir: Path) -> int:
    from .report import report

    text, curves = report(run_dir)
    print(f"{text}\n\nwrote {curves}")
    return 0


def _write_starter_config(path: Path) -> int:
    from .runfolder import atomic_write_text

    if path.exists():
        raise UserError(f"{path}: exists; choose another path (an existing file is never overwritten)")
    try:
        atomic_write_text(path, starter_config_text())
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror})") from None
    print(f"wrote {path}; use it with: scaletrain train --config {path}")
    return 0


def _choices(flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    from .bench import parse_list

    values = parse_list(flag, text)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UserError(f"{flag}: unknown value '{bad[0]}'; choose from {', '.join(allowed)}")
    return values


def _bench(args: argparse.Namespace, train_args: list[str]) -> int:
    from .bench import (Cell, add_projections, add_speedups, markdown_table, parse_list, projection_rows,
                        run_cell, write_outputs)
    from .data import load_image_sets
    from .parallel import available_gpus, measure_allreduce_gbps
    from .models import build_model, check_model_name

    nprocs = parse_list("--nproc", args.nproc, int)
    precisions = parse_list("--mixed-precision", args.mixed_precision)
    global_batches = parse_list("--global-batch-size", args.global_batch_size, int) if args.global_batch_size \
        else []
    batches = [] if global_batches else parse_list("--batch-size", args.batch_size, int)
    strategies = _choices("--strategy", args.strategy, STRATEGIES)
    sync_bns = [v == "yes" for v in _choices("--sync-bn", args.sync_bn, ("no", "yes"))]
    if min(nprocs) <= 0 or min(batches or global_batches) <= 0 or args.epochs <= 0:
        raise UserError("--nproc, --batch-size, --global-batch-size and --epochs must be positive")
    _choices("--mixed-precision", args.mixed_precision, PRECISIONS)
    inter = _bandwidth("--inter-node", args.inter_node)
    check_model_name(args.model)
    train, _ = load_image_sets(args.data)
    model = build_model(args.model, train.channels, len(train.classes))
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    gbps = measure_allreduce_gbps(gradient_bytes) if args.interconnect == "measure" else \
        _bandwidth("--interconnect", args.interconnect)
    if args.interconnect == "measure":
        print(f"measured all-reduce bus bandwidth: {gbps:.3g} GB/s ({gradient_bytes / 1e6:.1f} MB)", flush=True)
    out = Path(args.output_dir or Path("bench") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    base = ["--model", args.model, "--data", args.data, "--epochs", str(args.epochs), *train_args]
    cells = [Cell(n, p, None, s, bn, g) for s in strategies for bn in sync_bns for p in precisions
             for g in global_batches for n in nprocs]
    cells += [Cell(n, p, b, s, bn) for s in strategies for bn in sync_bns for p in precisions for b in batches
              for n in nprocs]
    gpus = available_gpus(cpu="--cpu" in train_args)
    rows = []
    for k, cell in enumerate(cells, 1):
        row = run_cell(cell, base, out, args.cell_timeout, gpus)
        rows.append(row)
        figure = (f"{row['seconds_per_epoch']:.2f} s/epoch, {row['images_per_second']:,.0f} img/s, "
                  f"val accuracy {row['val_accuracy']:.4f}" if row["status"] == "ok" else row["status"])
        print(f"[{k}/{len(cells)}] {cell.name}: {figure}", flush=True)
    add_speedups(rows)
    add_projections(rows, gradient_bytes, gbps, args.overlap)
    ok = [r for r in rows if r["status"] == "ok" and r["devices"] == 1 and r["strategy"] == "ddp"]
    projections = projection_rows(ok[0], parse_list("--project-devices", args.project_devices, int),
                                  parse_list("--project-nodes", args.project_nodes, int), gradient_bytes, gbps,
                                  inter, args.overlap) if ok else []
    write_outputs(rows, projections, out, {"model": args.model, "data": args.data, "epochs": args.epochs,
                                           "gradient_bytes": gradient_bytes, "interconnect_gbps": gbps,
                                           "inter_node_gbps": inter, "overlap": args.overlap,
                                           "interconnect": args.interconnect})
    print()
    print(markdown_table(rows))
    if projections:
        print(f"\nprojected from 1 device ({ok[0]['mixed_precision']}, batch {ok[0]['batch_size_per_device']}), "
              f"{gradient_bytes / 1e6:.1f} MB of gradients, {gbps:g} GB/s within a node, {inter:g} GB/s between "
              f"nodes, {args.overlap:.0%} overlap:\n")
        print("| nodes | devices per node | projected s/epoch | speed-up | efficiency |\n|---|---|---|---|---|")
        for p in projections:
            print(f"| {p['nodes']} | {p['devices_per_node']} | {p['projected_seconds_per_epoch']:.2f} | "
                  f"{p['projected_speedup']:.2f} | {p['projected_efficiency']:.0%} |")
    print(f"\nwrote {out}/bench.csv, bench.json, bench.png")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def _add_inference_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run folder (its best.safetensors) or a .safetensors file")
    p.add_argument("--data", required=True, help="inputs: as for train, or a Kaggle test.csv folder/file, or a "
                   "folder of images")
    p.add_argument("--data-format", default="auto", choices=DATA_FORMATS, help="how to read --data [default: auto]")
    p.add_argument("--batch-size", type=int, default=256, help="batch size per process [default: 256]")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers for image files [default: 2]")
    p.add_argument("--mixed-precision", default="no", choices=PRECISIONS, help="autocast precision [default: no]")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when GPUs are present")
    p.add_argument("--nproc", default="auto", help="processes: 'auto' (one per GPU, 1 on CPU) or a number")
    p.add_argument("--strategy", default="ddp", choices=PER_DEVICE_STRATEGIES, help="ddp: every process holds the "
                   "whole model; fsdp: each holds a shard and gathers one block at a time (models larger than "
                   "one device) [default: ddp]")
    for f in dataclasses.fields(RunConfig):  # several machines: the same flags as train
        if f.name in ("nnodes", "node_rank", "master_addr", "master_port"):
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} [default: {f.default}]")


def _default_output_dir() -> str:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return str(path)


def _check_output_dir(path: str, resume: bool, epochs: int) -> None:
    """A new run folder starts a run; one holding training state resumes it (a finished one only to train on,
    with more --epochs); anything else is left alone."""
    import json

    from .checkpoint import step_folders

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


def _train(cfg: TrainConfig, argv: Sequence[str], resume: str | None = None) -> int:
    from .data import load_image_sets
    from .parallel import Nodes, available_gpus, launch, launched_world_size, resolve_nproc
    from .models import check_model_name, read_state_dict

    check_model_name(cfg.model.model)
    if launched_world_size() is None:
        # The launching (or only) process checks everything it can before any worker starts.
        nproc = 1 if cfg.run.strategy == "dp" else resolve_nproc(parse_nproc(cfg.run.nproc), cfg.run.cpu)
        # Refuses here what every worker would refuse: a global batch the job's devices (all nodes') cannot split.
        cfg.plan(max(available_gpus(cfg.run.cpu), 1) if cfg.run.strategy == "dp" else nproc * cfg.run.nnodes)
        if resume not in (None, "."):
            cfg.run.output_dir = resume
            argv = [*argv, "--output-dir", resume]
        if not cfg.run.output_dir:
            if resume:
                raise UserError("--resume needs the run folder: --resume RUN_DIR or --output-dir RUN_DIR")
            cfg.run.output_dir = _default_output_dir()
            argv = [*argv, "--output-dir", cfg.run.output_dir]
        _check_output_dir(cfg.run.output_dir, resume is not None, cfg.optim.epochs)
        r = cfg.run
        if nproc > 1 or r.nnodes > 1:  # one process alone checks these in run_training, without reading them twice
            if cfg.model.pretrained:
                read_state_dict(cfg.model.pretrained)
            load_image_sets(cfg.data, seed=r.seed, skipped=Skipped() if cfg.data.skip_bad_samples else None)
            return launch(nproc, ["train", *argv], r.max_restarts,
                          Nodes(r.nnodes, r.node_rank, r.master_addr, r.master_port))
    run_training(cfg)
    return 0


def run_training(cfg: TrainConfig):
    """Train from a config in this process (one of possibly many launched); returns fit's FitResult."""
    from .data import load_image_sets
    from .engine import STOP, fit, runtime_for
    from .models import build_model, freeze_backbone, load_matching, read_state_dict
    from .runfolder import atomic_write_text

    STOP.install()  # SIGTERM / SIGUSR1 (e.g. SLURM preemption): checkpoint at the next step, then stop
    runtime = runtime_for(cfg)
    try:
        skipped = Skipped() if cfg.data.skip_bad_samples else None
        train_set, val_set = load_image_sets(cfg.data, seed=cfg.run.seed, skipped=skipped)
        if skipped and skipped.entries and runtime.is_main:
            listing = Path(cfg.run.output_dir) / "skipped_samples.txt"
            atomic_write_text(listing, "\n".join(skipped.entries) + "\n")
            print(f"skipped {len(skipped.entries)} bad sample(s), listed in {listing}", flush=True)
        runtime.seed(cfg.run.seed)  # identical initial weights on every rank
        channels = cfg.data.channels or train_set.channels
        model = build_model(cfg.model.model, channels, len(train_set.classes))
        if cfg.model.pretrained:
            skipped_tensors = load_matching(model, read_state_dict(cfg.model.pretrained), cfg.model.pretrained)
            if runtime.is_main and skipped_tensors:
                listing = Path(cfg.run.output_dir) / "pretrained_skipped.txt"
                atomic_write_text(listing, "\n".join(skipped_tensors) + "\n")
                shown = "; ".join(skipped_tensors[:3]) + (f"; and {len(skipped_tensors) - 3} more"
                                                         if len(skipped_tensors) > 3 else "")
                print(f"--pretrained: {len(skipped_tensors)} tensor(s) not loaded ({shown}); "
                      f"all listed in {listing}", flush=True)
        if cfg.model.freeze == "backbone":
            trainable = freeze_backbone(model)
            if runtime.is_main:
                print(f"--freeze backbone: training {trainable} head parameters only", flush=True)
        return fit(model, train_set, val_set, cfg, model_name=cfg.model.model, runtime=runtime)
    finally:
        runtime.end()


def _inference(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """predict and evaluate: check everything in the first process, then launch or run."""
    from .parallel import Nodes, launch, launched_world_size, resolve_nproc
    from .inference import check_writable, load_checkpoint, resolve_checkpoint

    if args.batch_size <= 0:
        raise UserError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.command == "predict" and args.top_k <= 0:
        raise UserError(f"--top-k must be a positive integer, got {args.top_k}")
    if args.command == "evaluate" and not args.output_dir:
        args.output_dir = str(resolve_checkpoint(args.checkpoint).parent / "eval")
        argv = [*argv, "--output-dir", args.output_dir]
    if launched_world_size() is None:
        nproc = resolve_nproc(parse_nproc(args.nproc), args.cpu)
        if args.command == "predict":
            check_writable(Path(args.output))
        if nproc > 1 or args.nnodes > 1:  # one process alone loads these in run_inference, not twice
            _inference_inputs(args, load_checkpoint(args.checkpoint))
            return launch(nproc, [args.command, *argv], nodes=Nodes(args.nnodes, args.node_rank, args.master_addr,
                                                                    args.master_port))
    run_inference(args)
    return 0


def _inference_inputs(args: argparse.Namespace, ckpt):
    from .inference import check_sample_submission, labelled_set, load_inputs

    if args.command == "predict":
        inputs = load_inputs(args.data, ckpt.preprocess, args.data_format)
        check_sample_submission(inputs)
        return inputs
    return labelled_set(args.data, args.split, ckpt, args.data_format)


def run_inference(args: argparse.Namespace) -> None:
    """One process's part of predict or evaluate; the main process writes the outputs."""
    from .parallel import Runtime
    from .inference import classification_report, load_checkpoint, predict_logits, submission_csv, write_report
    from .runfolder import atomic_write_text

    runtime = Runtime(args.mixed_precision, args.cpu, strategy=args.strategy)
    try:
        ckpt = load_checkpoint(args.checkpoint)
        inputs = _inference_inputs(args, ckpt)
        data = inputs.images if args.command == "predict" else inputs
        logits = predict_logits(ckpt.model, data, ckpt.preprocess, runtime, args.batch_size, args.num_workers)
        if not runtime.is_main:
            return
        if args.command == "predict":
            atomic_write_text(Path(args.output), submission_csv(inputs, logits, ckpt.classes, args.top_k,
                                                                args.probabilities, args.logits))
            print(f"wrote {len(inputs.ids)} predictions to {args.output} ({runtime.world_size} process(es))")
            return
        report = classification_report(logits, torch.as_tensor(data.labels), ckpt.classes)
        report.update(checkpoint=str(args.checkpoint), data=args.data, split=args.split,
                      world_size=runtime.world_size)
        write_report(report, Path(args.output_dir))
        print(f"{report['samples']} samples: loss {report['loss']:.4f}  accuracy {report['accuracy']:.4f}  "
              f"({runtime.world_size} process(es)); wrote {args.output_dir}/metrics.json, confusion_matrix.csv/.png")
    finally:
        runtime.end()


def _estimate_memory(args: argparse.Namespace) -> int:
    """Print the per-device memory table (or JSON) and the verdict."""
    import json

    from .memory import estimate, render

    result = estimate(args.model, image_size=args.image_size, channels=args.channels, num_classes=args.num_classes,
                      batch_size=args.batch_size, mixed_precision=args.mixed_precision, strategy=args.strategy,
                      nproc=args.nproc, optimizer=args.optimizer,
                      activation_checkpointing=args.activation_checkpointing, device_memory=args.device_memory)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0


def _is_timeout(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        # An error raised mid-training leaves the model and its process group in reference cycles (through the
        # traceback's frames). Free them now: freed at interpreter exit instead, gloo's worker threads can
        # still be releasing tensors, and the process aborts.
        gc.collect()


def _main(argv: list[str]) -> int:
    from .engine import Preempted, TrainingDiverged

    from .parallel import adopt_slurm

    try:
        if not any(a == "--nnodes" or a.startswith("--nnodes=") for a in argv):  # else: a launcher per node
            adopt_slurm()  # a task of `srun` becomes a worker like one that torchrun started
        parser = build_parser()
        passthrough: list[str] = []
        if "--" in argv:  # bench hands what follows '--' to every train it runs
            cut = argv.index("--")
            argv, passthrough = argv[:cut], argv[cut + 1:]
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, which knows its flags and can suggest one
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        rest = argv[argv.index(args.command) + 1:]
        if args.command == "train":
            return _train(_config_from_args(args), rest, args.resume)
        if args.command == "bench":
            return _bench(args, passthrough)
        if args.command == "report":
            return _report(Path(args.run_dir))
        if args.command == "env":
            from .envinfo import render

            print(render())
            return 0
        if args.command == "config":
            return _write_starter_config(Path(args.path))
        if args.command == "estimate-memory":
            return _estimate_memory(args)
        return _inference(args, rest)
    except UserError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except (TrainingDiverged, Preempted) as e:
        if os.environ.get("RANK", "0") == "0":  # raised on every rank at once; one of them says so
            print(f"scaletrain: {'error: ' if isinstance(e, TrainingDiverged) else ''}{e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:
        if not _is_timeout(e):
            raise
        print(f"scaletrain: error: a process waited more than --timeout for the others in a collective operation "
              f"and gave up: another process stopped answering ({str(e).strip().splitlines()[0][:160]})",
              file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130
