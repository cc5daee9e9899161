"""`scaletrain bench`: the matrix of `scaletrain train` cells, timed in fresh processes, tabulated and projected
to device and node counts not at hand; the cells, table and projection themselves are in
`scaletrain/measure/bench.py`."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..config import PRECISIONS, STRATEGIES, _f
from ..errors import UserError
from ..measure.bench import INTERCONNECTS
from .common import add_config_flag, add_flags, check_run_options, options_from_args, run_field


@dataclass(kw_only=True)
class BenchOptions:
    # A settings file's single value becomes a one-value list; its nproc ('auto' or a count to launch) and epochs
    # (a full training's) are not a benchmark's, and are ignored.
    nproc: str = _f("1", "comma-separated process counts")
    mixed_precision: str = _f("no", "comma-separated precisions", from_config=True)
    batch_size: str = _f("128", "comma-separated batch sizes per device", from_config=str)
    global_batch_size: str = _f("", "comma-separated global batch sizes, instead of --batch-size: the per-device "
                                "batch is derived for each device count", show_default=False,
                                from_config=lambda v: str(v) if v else "")
    strategy: str = _f("ddp", "comma-separated strategies: ddp, dp, fsdp", from_config=True)
    tp: str = _f("1", "comma-separated tensor-parallel degrees (--tp): each layer of the model's plan split over "
                 "that many of a cell's processes; a cell whose processes it does not divide is skipped",
                 from_config=str)
    sync_bn: str = _f("no", "comma-separated: no, yes (SyncBatchNorm)",
                      from_config=lambda v: "yes" if v else "no")
    epochs: int = _f(2, "epochs per cell")
    model: str = _f("smallcnn", "model", from_config=True)
    data: str = _f("default", "dataset, as for train", from_config=True)
    output_dir: str = _f("", "where bench.csv, bench.json, bench.png and the cells' run folders go [default: "
                         "bench/<timestamp>]")
    interconnect: str = _f("pcie", "for the projection: " + ", ".join(f"{k} ({v:g} GB/s)" for k, v in
                           INTERCONNECTS.items()) + ", a bandwidth in GB/s, or 'measure' (a short all-reduce of "
                           "the gradients' size between this machine's devices, or 2 CPU processes)")
    inter_node: str = _f("infiniband", "link between nodes for the projection, as --interconnect")
    overlap: float = _f(0.5, "share of gradient communication hidden behind the backward pass, for the projection")
    project_devices: str = _f("1,2,4,8", "device counts per node to project")
    project_nodes: str = _f("1,2", "node counts to project")
    cell_timeout: float = _f(3600, "seconds before a cell counts as failed")
    # train's flags, given to every cell
    cpu: bool = run_field("cpu")
    seed: int = run_field("seed")
    timeout: float = run_field("timeout")
    nnodes: int = run_field("nnodes")
    node_rank: int = run_field("node_rank")
    master_addr: str = run_field("master_addr")
    master_port: int = run_field("master_port")


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="the seeds' table: devices x precision x batch size -> seconds per epoch, speed-up, accuracy",
        description="Train every cell of a matrix in fresh processes and tabulate seconds per epoch (first epoch "
                    "excluded as warm-up), images/s, speed-up and efficiency against the fewest devices, and "
                    "validation accuracy; with a projection to device and node counts not at hand. Arguments "
                    "after '--' go to every `scaletrain train`.")
    add_config_flag(bench, BenchOptions)
    add_flags(bench, BenchOptions)


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


def _choices(flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    from ..measure.bench import parse_list

    values = parse_list(flag, text)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UserError(f"{flag}: unknown value '{bad[0]}'; choose from {', '.join(allowed)}")
    return values


def run(args: argparse.Namespace) -> int:
    from ..data.read import load_image_sets
    from ..measure.bench import (add_projections, add_speedups, markdown_table, parse_list, projection_rows,
                                 run_cell, write_outputs)
    from ..parallel import available_gpus, measure_allreduce_gbps
    from ..models import build_model, check_model_name

    opts: BenchOptions = options_from_args(BenchOptions, args)
    train_args: list[str] = args.passthrough
    check_run_options(opts)
    if opts.nnodes > 1:
        raise UserError(f"--nnodes {opts.nnodes}: bench runs its cells on this machine; to time several machines, "
                        f"run `scaletrain train --nnodes {opts.nnodes}` on each")
    cells = _cells(opts)
    inter = _bandwidth("--inter-node", opts.inter_node)
    check_model_name(opts.model)
    train, _ = load_image_sets(opts.data)
    model = build_model(opts.model, train.channels, len(train.classes))
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    gbps = measure_allreduce_gbps(gradient_bytes) if opts.interconnect == "measure" else \
        _bandwidth("--interconnect", opts.interconnect)
    if opts.interconnect == "measure":
        print(f"measured all-reduce bus bandwidth: {gbps:.3g} GB/s ({gradient_bytes / 1e6:.1f} MB)", flush=True)
    out = Path(opts.output_dir or Path("bench") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    # Arguments after '--' come last, so that they win over bench's own.
    base = ["--model", opts.model, "--data", opts.data, "--epochs", str(opts.epochs), "--seed", str(opts.seed),
            "--timeout", str(opts.timeout), *(["--cpu"] if opts.cpu else []), *train_args]
    gpus = available_gpus(cpu=opts.cpu or "--cpu" in train_args)
    rows = []
    for k, cell in enumerate(cells, 1):
        row = run_cell(cell, base, out, opts.cell_timeout, gpus)
        rows.append(row)
        figure = (f"{row['seconds_per_epoch']:.2f} s/epoch, {row['images_per_second']:,.0f} img/s, "
                  f"val accuracy {row['val_accuracy']:.4f}" if row["status"] == "ok" else row["status"])
        print(f"[{k}/{len(cells)}] {cell.name}: {figure}", flush=True)
    add_speedups(rows)
    add_projections(rows, gradient_bytes, gbps, opts.overlap)
    ok = [r for r in rows if r["status"] == "ok" and r["devices"] == 1 and r["strategy"] == "ddp"]
    projections = projection_rows(ok[0], parse_list("--project-devices", opts.project_devices, int),
                                  parse_list("--project-nodes", opts.project_nodes, int), gradient_bytes, gbps,
                                  inter, opts.overlap) if ok else []
    write_outputs(rows, projections, out, {"model": opts.model, "data": opts.data, "epochs": opts.epochs,
                                           "gradient_bytes": gradient_bytes, "interconnect_gbps": gbps,
                                           "inter_node_gbps": inter, "overlap": opts.overlap,
                                           "interconnect": opts.interconnect})
    print()
    print(markdown_table(rows))
    if projections:
        print(f"\nprojected from 1 device ({ok[0]['mixed_precision']}, batch {ok[0]['batch_size_per_device']}), "
              f"{gradient_bytes / 1e6:.1f} MB of gradients, {gbps:g} GB/s within a node, {inter:g} GB/s between "
              f"nodes, {opts.overlap:.0%} overlap:\n")
        print("| nodes | devices per node | projected s/epoch | speed-up | efficiency |\n|---|---|---|---|---|")
        for p in projections:
            print(f"| {p['nodes']} | {p['devices_per_node']} | {p['projected_seconds_per_epoch']:.2f} | "
                  f"{p['projected_speedup']:.2f} | {p['projected_efficiency']:.0%} |")
    print(f"\nwrote {out}/bench.csv, bench.json, bench.png")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def _cells(opts: BenchOptions) -> list:
    """The matrix's cells from its comma-separated axes, each axis checked: fixed global batches first, then fixed
    per-device batches; within each, by strategy, SyncBN, precision, batch, then device count."""
    from ..measure.bench import Cell, parse_list

    nprocs = parse_list("--nproc", opts.nproc, int)
    precisions = parse_list("--mixed-precision", opts.mixed_precision)
    global_batches = parse_list("--global-batch-size", opts.global_batch_size, int) if opts.global_batch_size \
        else []
    batches = [] if global_batches else parse_list("--batch-size", opts.batch_size, int)
    strategies = _choices("--strategy", opts.strategy, STRATEGIES)
    sync_bns = [v == "yes" for v in _choices("--sync-bn", opts.sync_bn, ("no", "yes"))]
    if min(nprocs) <= 0 or min(batches or global_batches) <= 0 or opts.epochs <= 0:
        raise UserError("--nproc, --batch-size, --global-batch-size and --epochs must be positive")
    _choices("--mixed-precision", opts.mixed_precision, PRECISIONS)
    tps = parse_list("--tp", opts.tp, int)
    if min(tps) <= 0:
        raise UserError("--tp must be positive")
    cells = [Cell(n, p, None, s, bn, g, t) for s in strategies for t in tps for bn in sync_bns for p in precisions
             for g in global_batches for n in nprocs]
    return cells + [Cell(n, p, b, s, bn, None, t) for s in strategies for t in tps for bn in sync_bns
                    for p in precisions for b in batches for n in nprocs]
