"""`scaletrain bench`: the seeds' table (devices x precision x batch size -> seconds per epoch, speed-up,
accuracy) measured for the user's model and data, with a projection for device counts not at hand.

Every cell is a separate `scaletrain train` in fresh processes through the launcher; its run folder's
metrics.csv gives the steady-state seconds per epoch (the first epoch, with its warm-up, is left out when there
are more). A cell that fails is reported in its row and the others go on.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..runfolder import atomic_write_bytes, atomic_write_text, png_bytes, pyplot, read_metrics

# Bandwidth a ring all-reduce sees per device, in GB/s (bus bandwidth, as nccl-tests reports it).
INTERCONNECTS = {"nvlink": 300.0, "pcie": 20.0, "ethernet": 1.1, "infiniband": 40.0}
COLUMNS = ("devices", "mixed_precision", "batch_size_per_device", "seconds_per_epoch", "strategy", "sync_bn",
           "global_batch_size", "images_per_second", "speedup", "efficiency", "val_accuracy",
           "projected_seconds_per_epoch", "projection_error", "status")


@dataclass
class Cell:
    devices: int
    mixed_precision: str
    batch_size_per_device: int | None  # None: derived from global_batch_size
    strategy: str = "ddp"
    sync_bn: bool = False
    global_batch_size: int | None = None
    tp: int = 1  # processes each layer is split over (--tp)

    @property
    def name(self) -> str:
        batch = f"g{self.global_batch_size}" if self.global_batch_size else f"b{self.batch_size_per_device}"
        return (f"n{self.devices}-{self.strategy}{f'-tp{self.tp}' if self.tp > 1 else ''}"
                f"{'-syncbn' if self.sync_bn else ''}-{self.mixed_precision}-{batch}")

    def command(self, train_args: list[str], run_dir: Path) -> tuple[list[str], dict[str, str] | None]:
        """The `scaletrain train` of this cell, and the environment it needs (None: this one)."""
        batch = (["--global-batch-size", str(self.global_batch_size)] if self.global_batch_size
                 else ["--batch-size", str(self.batch_size_per_device)])
        cmd = [sys.executable, "-m", "scaletrain", "train", *train_args, "--mixed-precision", self.mixed_precision,
               *batch, "--strategy", self.strategy, "--output-dir", str(run_dir)]
        if self.sync_bn:
            cmd.append("--sync-bn")
        if self.tp > 1:
            cmd += ["--tp", str(self.tp)]
        if self.strategy != "dp":  # a process per device (ddp, fsdp; a pipeline's stages)
            return [*cmd, "--nproc", str(self.devices)], None
        # DataParallel drives every visible GPU: show it the first `devices` of them.
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(self.devices))}
        return [*cmd, "--nproc", "1"], env


def parse_list(flag: str, text: str, kind=str) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected a comma-separated list, got '{text}'") from None
    if not values:
        raise UserError(f"{flag}: empty list")
    return values


def run_cell(cell: Cell, train_args: list[str], out: Path, timeout: float, gpus: int = 0) -> dict[str, Any]:
    """Train one cell in fresh processes and read its figures from the run folder."""
    run_dir = out / cell.name
    row: dict[str, Any] = {**asdict(cell), "fixed": "global" if cell.global_batch_size else "device", "status": "ok"}
    if cell.strategy == "dp" and cell.devices > max(gpus, 1):
        return {**row, "status": f"failed: dp on {cell.devices} devices needs {cell.devices} GPUs, {gpus} visible"}
    from ..parallel import Layout

    try:  # a layout its processes cannot take: said, not trained
        Layout(cell.devices, cell.strategy if cell.strategy != "dp" else "ddp", cell.tp).check()
    except UserError as e:
        return {**row, "status": f"skipped: {e}"}
    cmd, env = cell.command(train_args, run_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**row, "status": f"failed: over {timeout:.0f} s"}
    rows = read_metrics(run_dir)
    if proc.returncode != 0 or not rows:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("scaletrain")] or \
                proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {**row, "status": f"failed: {lines[-1][:160]}"}
    seconds = [r["epoch_seconds"] for r in rows]
    steady = statistics.median(seconds[1:] if len(seconds) > 1 else seconds)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**row, "seconds_per_epoch": steady, "images_per_second": summary["train_samples"] / steady,
            "val_accuracy": rows[-1]["val_accuracy"], "train_samples": summary["train_samples"],
            "batch_size_per_device": summary["batch_size_per_device"],
            "global_batch_size": summary["global_batch_size"], "run_dir": str(run_dir)}


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Speed-up and scaling efficiency against the fewest devices of the same precision and batch size."""
    for key, group in itertools.groupby(sorted(rows, key=_group_key), key=_group_key):
        group = [r for r in group if r["status"] == "ok"]
        if not group:
            continue
        base = min(group, key=lambda r: r["devices"])
        for r in group:
            r["speedup"] = base["seconds_per_epoch"] / r["seconds_per_epoch"]
            r["efficiency"] = r["speedup"] * base["devices"] / r["devices"]


def _group_key(r: dict[str, Any]) -> tuple:
    """Cells that differ only in their device count: the same strategy, SyncBN, precision and batch setting
    (a fixed per-device batch, or a fixed global batch)."""
    batch = ("global", r["global_batch_size"]) if r["fixed"] == "global" else ("device", r["batch_size_per_device"])
    return (r["strategy"], r.get("tp", 1), r["sync_bn"], r["mixed_precision"], batch)


# -- projection ------------------------------------------------------------------------------------------------
def ring_allreduce_seconds(nbytes: float, devices: int, gbps: float) -> float:
    """Time of a ring all-reduce of `nbytes` over `devices` at `gbps` GB/s: 2(N-1)/N x bytes / bandwidth."""
    if devices <= 1:
        return 0.0
    return 2 * (devices - 1) / devices * nbytes / (gbps * 1e9)


def project_seconds_per_epoch(*, samples: int, batch_per_device: int, step_compute_seconds: float,
                              gradient_bytes: float, devices: int, nodes: int = 1, intra_gbps: float,
                              inter_gbps: float | None = None, overlap: float = 0.5) -> float:
    """Seconds per epoch on `devices` per node x `nodes`, from one device's compute time per step.

    Each step computes as on one device and then all-reduces the gradients over every device; the slowest link
    in the ring sets the pace (the inter-node one when nodes > 1). `overlap` is the share of that communication
    hidden behind the backward pass by DDP's gradient buckets.
    """
    world = devices * nodes
    link = intra_gbps if nodes == 1 else min(intra_gbps, inter_gbps or intra_gbps)
    comm = ring_allreduce_seconds(gradient_bytes, world, link)
    steps = math.ceil(samples / (world * batch_per_device))
    return steps * (step_compute_seconds + (1 - overlap) * comm)


def _step_seconds(one: dict[str, Any], batch: int) -> float:
    """Compute time of one step at `batch` per device, from a measured 1-device row (proportional to the batch)."""
    steps = math.ceil(one["train_samples"] / one["batch_size_per_device"])
    return one["seconds_per_epoch"] / steps * batch / one["batch_size_per_device"]


def add_projections(rows: list[dict[str, Any]], gradient_bytes: float, gbps: float, overlap: float) -> None:
    """Project every DDP row from the 1-device row of its group, and give the error where both exist."""
    for key, group in itertools.groupby(sorted(rows, key=_group_key), key=_group_key):
        group = list(group)
        ones = [r for r in group if r["devices"] == 1 and r["status"] == "ok"]
        if not ones or key[0] != "ddp":  # DataParallel's per-step scatter and gather are not modelled
            continue
        one = ones[0]
        for r in group:
            batch = r["batch_size_per_device"] or r["global_batch_size"] // r["devices"]
            projected = project_seconds_per_epoch(
                samples=one["train_samples"], batch_per_device=batch, step_compute_seconds=_step_seconds(one, batch),
                gradient_bytes=gradient_bytes, devices=r["devices"], intra_gbps=gbps, overlap=overlap)
            r["projected_seconds_per_epoch"] = projected
            if r["status"] == "ok":
                r["projection_error"] = projected / r["seconds_per_epoch"] - 1


def projection_rows(base: dict[str, Any], devices: list[int], nodes: list[int], gradient_bytes: float,
                    intra_gbps: float, inter_gbps: float, overlap: float) -> list[dict[str, Any]]:
    """Projected rows for device counts and node counts that were not measured (base's per-device batch)."""
    out = []
    for m in nodes:
        for n in devices:
            sec = project_seconds_per_epoch(samples=base["train_samples"],
                                            batch_per_device=base["batch_size_per_device"],
                                            step_compute_seconds=_step_seconds(base, base["batch_size_per_device"]),
                                            gradient_bytes=gradient_bytes, devices=n, nodes=m,
                                            intra_gbps=intra_gbps, inter_gbps=inter_gbps, overlap=overlap)
            speedup = base["seconds_per_epoch"] / sec
            out.append({"nodes": m, "devices_per_node": n, "projected_seconds_per_epoch": sec,
                        "projected_speedup": speedup, "projected_efficiency": speedup / (n * m)})
    return out


# -- output ----------------------------------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The seeds' four columns first (#GPU, fp16, batch size per GPU, seconds per epoch), then the rest."""
    head = ("| #devices | mixed precision | batch size per device | seconds per epoch | strategy | global batch | "
            "images/s | speed-up | efficiency | val accuracy | projected s/epoch | projection error | status |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        strategy = r["strategy"] + (f" + tp {r['tp']}" if r.get("tp", 1) > 1 else "") + (" + SyncBN" if r["sync_bn"]
                                                                                    else "")
        lines.append(
            f"| {r['devices']} | {r['mixed_precision']} | {r['batch_size_per_device'] or ''} | "
            f"{_fmt(r.get('seconds_per_epoch'))} | {strategy} | {r.get('global_batch_size') or ''} | "
            f"{_fmt(r.get('images_per_second'), ',.0f')} | {_fmt(r.get('speedup'))} | "
            f"{_fmt(r.get('efficiency'), '.0%')} | {_fmt(r.get('val_accuracy'), '.4f')} | "
            f"{_fmt(r.get('projected_seconds_per_epoch'))} | {_fmt(r.get('projection_error'), '+.0%')} | "
            f"{r['status']} |")
    return "\n".join(lines)


def write_outputs(rows: list[dict[str, Any]], projections: list[dict[str, Any]], out: Path,
                  meta: dict[str, Any]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "bench.csv", buf.getvalue())
    atomic_write_text(out / "bench.json", json.dumps({**meta, "cells": rows, "projections": projections},
                                                     indent=2) + "\n")
    atomic_write_bytes(out / "bench.png", _chart(rows))


def _chart(rows: list[dict[str, Any]]) -> bytes:
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    for key, group in itertools.groupby(sorted(rows, key=_group_key), key=_group_key):
        group = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["devices"])
        if not group:
            continue
        label = f"{key[0]}{' + SyncBN' if key[1] else ''}, {key[2]}, {key[3][0]} batch {key[3][1]}"
        n = [r["devices"] for r in group]
        ax1.plot(n, [r["images_per_second"] for r in group], marker="o", label=label)
        ax2.plot(n, [r.get("efficiency", 0) * 100 for r in group], marker="o", label=label)
    ax1.set(xlabel="devices", ylabel="images / s", title="throughput")
    ax2.set(xlabel="devices", ylabel="scaling efficiency (%)", title="efficiency", ylim=(0, 110))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)
