"""scaletrain bench: the matrix, its table and files, and the projection formula."""

from __future__ import annotations

import csv
import json
import math

import pytest

from helpers import run_cli
from scaletrain.bench import (add_projections, add_speedups, markdown_table, project_seconds_per_epoch,
                              projection_rows, ring_allreduce_seconds)


def test_ring_allreduce_cost_on_known_numbers():
    # 100 MB of gradients over 4 devices at 10 GB/s: 2 * 3/4 * 1e8 / 1e10 = 15 ms.
    assert ring_allreduce_seconds(1e8, 4, 10.0) == pytest.approx(0.015)
    assert ring_allreduce_seconds(1e8, 1, 10.0) == 0.0
    # 1000 samples, 50 per device on 4 devices -> 5 steps of (0.1 s compute + half of 15 ms exposed).
    sec = project_seconds_per_epoch(samples=1000, batch_per_device=50, step_compute_seconds=0.1,
                                    gradient_bytes=1e8, devices=4, intra_gbps=10.0, overlap=0.5)
    assert sec == pytest.approx(5 * (0.1 + 0.0075))
    # Two nodes: the slower inter-node link sets the pace of the 8-device ring.
    two = project_seconds_per_epoch(samples=1000, batch_per_device=50, step_compute_seconds=0.1,
                                    gradient_bytes=1e8, devices=4, nodes=2, intra_gbps=10.0, inter_gbps=1.0,
                                    overlap=0.0)
    assert two == pytest.approx(math.ceil(1000 / 400) * (0.1 + 2 * 7 / 8 * 1e8 / 1e9))


def test_speedup_efficiency_and_projection_rows():
    cell = {"mixed_precision": "no", "batch_size_per_device": 32, "strategy": "ddp", "sync_bn": False,
            "fixed": "device"}
    rows = [{**cell, "devices": 1, "seconds_per_epoch": 10.0, "status": "ok", "train_samples": 3200},
            {**cell, "devices": 2, "seconds_per_epoch": 6.25, "status": "ok", "train_samples": 3200},
            {**cell, "devices": 4, "status": "failed: out of memory"}]
    add_speedups(rows)
    assert rows[1]["speedup"] == pytest.approx(1.6) and rows[1]["efficiency"] == pytest.approx(0.8)
    table = markdown_table(rows)
    assert table.splitlines()[0].startswith("| #devices | mixed precision | batch size per device | seconds per epoch |")
    assert "failed: out of memory" in table.splitlines()[-1]
    assert "| 2 | no | 32 | 6.25 | ddp |" in table
    proj = projection_rows(rows[0], [1, 2], [1], gradient_bytes=0.0, intra_gbps=10.0, inter_gbps=1.0, overlap=0.5)
    assert [round(p["projected_speedup"], 6) for p in proj] == [1.0, 2.0]


def test_projection_with_a_fixed_global_batch_splits_the_compute():
    cell = {"mixed_precision": "no", "strategy": "ddp", "sync_bn": False, "fixed": "global", "global_batch_size": 64}
    rows = [{**cell, "devices": 1, "batch_size_per_device": 64, "seconds_per_epoch": 10.0, "status": "ok",
             "train_samples": 6400},
            {**cell, "devices": 4, "batch_size_per_device": 16, "seconds_per_epoch": 3.0, "status": "ok",
             "train_samples": 6400}]
    # 100 steps of 0.1 s on one device; on 4, still 100 steps, each a quarter of the compute, plus the
    # exposed half of a ring all-reduce of 1e8 bytes at 10 GB/s (2 * 3/4 * 1e8 / 1e10 = 15 ms).
    add_projections(rows, gradient_bytes=1e8, gbps=10.0, overlap=0.5)
    assert rows[0]["projected_seconds_per_epoch"] == pytest.approx(10.0)
    assert rows[1]["projected_seconds_per_epoch"] == pytest.approx(100 * (0.025 + 0.0075))
    assert rows[1]["projection_error"] == pytest.approx(3.25 / 3.0 - 1)


def test_bench_runs_a_tiny_cpu_matrix(small_npz, tmp_path):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--nproc", "1,2", "--batch-size", "32", "--epochs", "2", "--model", "tinycnn",
                   "--data", str(small_npz), "--output-dir", str(out), "--", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[1/2] n1-ddp-no-b32:" in proc.stdout and "[2/2] n2-ddp-no-b32:" in proc.stdout
    assert "| #devices | mixed precision | batch size per device | seconds per epoch |" in proc.stdout
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["devices"], r["status"]) for r in rows] == [("1", "ok"), ("2", "ok")]
    one, two = (float(r["seconds_per_epoch"]) for r in rows)
    assert one > 0 and two > 0
    assert float(rows[1]["speedup"]) == pytest.approx(one / two, rel=1e-4)
    assert float(rows[1]["efficiency"]) == pytest.approx(one / two / 2, rel=1e-4)
    assert 0 < float(rows[1]["val_accuracy"]) <= 1
    record = json.loads((out / "bench.json").read_text())
    assert record["gradient_bytes"] > 0 and len(record["projections"]) == 8
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # Each cell kept its own run folder, trained on its own process count.
    assert json.loads((out / "n2-ddp-no-b32" / "summary.json").read_text())["world_size"] == 2


def test_a_failing_cell_is_reported_and_the_others_kept(small_npz, tmp_path):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--nproc", "1", "--mixed-precision", "no,fp16", "--batch-size", "32", "--epochs", "1",
                   "--model", "tinycnn", "--data", str(small_npz), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"].startswith("failed:") and "fp16 needs a GPU" in rows[1]["status"]


def test_bench_with_a_global_batch_both_strategies_and_a_measured_link(small_npz, tmp_path):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--nproc", "1,2", "--global-batch-size", "32", "--strategy", "ddp,dp", "--epochs", "1",
                   "--model", "tinycnn", "--data", str(small_npz), "--interconnect", "measure",
                   "--output-dir", str(out), "--", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {(r["strategy"], r["devices"]): r for r in csv.DictReader((out / "bench.csv").open())}
    # The per-device batch is derived from the global one for each device count.
    assert (by["ddp", "1"]["batch_size_per_device"], by["ddp", "2"]["batch_size_per_device"]) == ("32", "16")
    assert by["ddp", "2"]["global_batch_size"] == "32" and by["ddp", "2"]["status"] == "ok"
    assert by["dp", "1"]["status"] == "ok"
    assert by["dp", "2"]["status"] == "failed: dp on 2 devices needs 2 GPUs, 0 visible"
    # Projections are for DDP; DataParallel's scatter and gather are not modelled.
    assert by["ddp", "2"]["projected_seconds_per_epoch"] and not by["dp", "1"]["projected_seconds_per_epoch"]
    record = json.loads((out / "bench.json").read_text())
    assert record["interconnect"] == "measure" and record["interconnect_gbps"] > 0
    assert "measured all-reduce bus bandwidth" in proc.stdout
    summary = json.loads((out / "n1-dp-no-g32" / "summary.json").read_text())
    assert summary["strategy"] == "dp" and summary["devices"] == 1
