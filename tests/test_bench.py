"""scaletrain bench: the matrix, its table and files, and the projection formula."""

from __future__ import annotations

import csv
import json
import math

import pytest

from helpers import run_cli
from scaletrain.models import build_model
from scaletrain.measure.bench import (add_projections, add_speedups, markdown_table, project_seconds_per_epoch,
                              projection_rows, ring_allreduce_seconds)


def test_ring_allreduce_of_100mb_over_4_devices_at_10gbps_takes_15ms():
    # 2 * 3/4 * 1e8 bytes / 1e10 bytes/s
    assert ring_allreduce_seconds(1e8, 4, 10.0) == pytest.approx(0.015)


def test_ring_allreduce_on_one_device_costs_nothing():
    assert ring_allreduce_seconds(1e8, 1, 10.0) == 0.0


def test_projected_epoch_is_steps_times_compute_plus_the_exposed_communication():
    # 1000 samples, 50 per device on 4 devices -> 5 steps of (0.1 s compute + half of 15 ms exposed).
    sec = project_seconds_per_epoch(samples=1000, batch_per_device=50, step_compute_seconds=0.1,
                                    gradient_bytes=1e8, devices=4, intra_gbps=10.0, overlap=0.5)
    assert sec == pytest.approx(5 * (0.1 + 0.0075))


def test_on_two_nodes_the_slower_inter_node_link_sets_the_pace_of_the_ring():
    # 8 devices of 50: 3 steps; the ring of 8 runs at the 1 GB/s between nodes, none of it hidden.
    two = project_seconds_per_epoch(samples=1000, batch_per_device=50, step_compute_seconds=0.1,
                                    gradient_bytes=1e8, devices=4, nodes=2, intra_gbps=10.0, inter_gbps=1.0,
                                    overlap=0.0)
    assert two == pytest.approx(math.ceil(1000 / 400) * (0.1 + 2 * 7 / 8 * 1e8 / 1e9))


CELL = {"mixed_precision": "no", "batch_size_per_device": 32, "strategy": "ddp", "sync_bn": False, "fixed": "device"}


@pytest.fixture
def measured():
    """One, two and four devices of one setting: 10 s and 6.25 s per epoch, and a failed cell."""
    rows = [{**CELL, "devices": 1, "seconds_per_epoch": 10.0, "status": "ok", "train_samples": 3200},
            {**CELL, "devices": 2, "seconds_per_epoch": 6.25, "status": "ok", "train_samples": 3200},
            {**CELL, "devices": 4, "status": "failed: out of memory"}]
    add_speedups(rows)
    return rows


def test_speedup_and_efficiency_are_against_the_fewest_devices(measured):
    assert measured[1]["speedup"] == pytest.approx(10.0 / 6.25)
    assert measured[1]["efficiency"] == pytest.approx(10.0 / 6.25 / 2)


def test_a_failed_cell_gets_no_speedup(measured):
    assert "speedup" not in measured[2] and "efficiency" not in measured[2]


def test_markdown_table_has_a_header_a_row_per_cell_and_the_failure(measured):
    lines = markdown_table(measured).splitlines()
    assert lines[0].startswith("| #devices | mixed precision | batch size per device | seconds per epoch |")
    assert len(lines) == 2 + 3
    assert "| 2 | no | 32 | 6.25 | ddp |" in lines[3]
    assert "failed: out of memory" in lines[-1]


def test_projection_rows_for_unmeasured_device_and_node_counts():
    """From 10 s per epoch on one device (100 steps of 32 of 3200 samples, 0.1 s each), 100 MB of gradients at
    10 GB/s in a node and 1 GB/s between nodes, half of the all-reduce hidden:
    1 x 1: 100 x 0.1 = 10 s; 1 node x 2: 50 x (0.1 + 0.5 x 0.01) = 5.25 s; 2 nodes x 1: 50 x (0.1 + 0.5 x 0.1) = 7.5 s;
    2 nodes x 2: 25 x (0.1 + 0.5 x 0.15) = 4.375 s."""
    base = {**CELL, "devices": 1, "seconds_per_epoch": 10.0, "status": "ok", "train_samples": 3200}
    proj = projection_rows(base, [1, 2], [1, 2], gradient_bytes=1e8, intra_gbps=10.0, inter_gbps=1.0, overlap=0.5)
    assert [(p["nodes"], p["devices_per_node"]) for p in proj] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    seconds = [10.0, 5.25, 7.5, 4.375]
    assert [p["projected_seconds_per_epoch"] for p in proj] == pytest.approx(seconds)
    assert [p["projected_speedup"] for p in proj] == pytest.approx([10.0 / s for s in seconds])
    assert [p["projected_efficiency"] for p in proj] == pytest.approx([10.0 / s / n for s, n in zip(seconds,
                                                                                                     [1, 2, 2, 4])])


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


@pytest.fixture(scope="module")
def tiny_matrix(small_npz, tmp_path_factory):
    """`scaletrain bench` on 1 and 2 CPU processes, 2 epochs each."""
    out = tmp_path_factory.mktemp("bench") / "bench"
    proc = run_cli("bench", "--nproc", "1,2", "--batch-size", "32", "--epochs", "2", "--model", "tinycnn",
                   "--data", str(small_npz), "--output-dir", str(out), "--", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc, list(csv.DictReader((out / "bench.csv").open()))


@pytest.mark.slow
def test_bench_prints_each_cell_as_it_runs_and_the_table(tiny_matrix):
    _, proc, _ = tiny_matrix
    assert "[1/2] n1-ddp-no-b32:" in proc.stdout and "[2/2] n2-ddp-no-b32:" in proc.stdout
    assert "| #devices | mixed precision | batch size per device | seconds per epoch |" in proc.stdout


@pytest.mark.slow
def test_bench_csv_has_one_ok_row_per_process_count(tiny_matrix):
    _, _, rows = tiny_matrix
    assert [(r["devices"], r["status"]) for r in rows] == [("1", "ok"), ("2", "ok")]


def _cell_metrics(out, name):
    return list(csv.DictReader((out / name / "metrics.csv").open()))


@pytest.mark.slow
def test_bench_times_the_steady_second_epoch_and_reports_its_accuracy(tiny_matrix):
    """Epoch 1 pays for warming up; the figure is epoch 2's time, and the accuracy that of the last epoch."""
    out, _, rows = tiny_matrix
    for row, name in zip(rows, ["n1-ddp-no-b32", "n2-ddp-no-b32"]):
        metrics = _cell_metrics(out, name)
        assert float(row["seconds_per_epoch"]) == pytest.approx(float(metrics[1]["epoch_seconds"]), rel=1e-6)
        assert float(row["val_accuracy"]) == pytest.approx(float(metrics[-1]["val_accuracy"]), rel=1e-6)


@pytest.mark.slow
def test_bench_speedup_and_efficiency_are_the_measured_ratios(tiny_matrix):
    _, _, rows = tiny_matrix
    one, two = (float(r["seconds_per_epoch"]) for r in rows)
    assert float(rows[1]["speedup"]) == pytest.approx(one / two, rel=1e-4)
    assert float(rows[1]["efficiency"]) == pytest.approx(one / two / 2, rel=1e-4)


@pytest.mark.slow
def test_bench_json_projects_from_the_models_gradient_bytes(tiny_matrix):
    out, _, _ = tiny_matrix
    record = json.loads((out / "bench.json").read_text())
    assert record["gradient_bytes"] == 4 * sum(p.numel() for p in build_model("tinycnn", 1, 10).parameters())
    # the default --project-devices 1,2,4,8 on --project-nodes 1,2
    assert [(p["nodes"], p["devices_per_node"]) for p in record["projections"]] == [
        (m, n) for m in (1, 2) for n in (1, 2, 4, 8)]


@pytest.mark.slow
def test_bench_draws_a_png(tiny_matrix):
    out, _, _ = tiny_matrix
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_each_bench_cell_keeps_its_own_run_folder_trained_on_its_process_count(tiny_matrix):
    out, _, _ = tiny_matrix
    assert [json.loads((out / name / "summary.json").read_text())["world_size"]
            for name in ("n1-ddp-no-b32", "n2-ddp-no-b32")] == [1, 2]


@pytest.mark.slow
def test_a_failing_cell_is_reported_and_the_others_kept(small_npz, tmp_path):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--nproc", "1", "--mixed-precision", "no,fp16", "--batch-size", "32", "--epochs", "1",
                   "--model", "tinycnn", "--data", str(small_npz), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"].startswith("failed:") and "fp16 needs a GPU" in rows[1]["status"]


@pytest.fixture(scope="module")
def global_matrix(small_npz, tmp_path_factory):
    """`scaletrain bench` with a global batch of 32, DDP and DataParallel on 1 and 2 devices, link measured."""
    out = tmp_path_factory.mktemp("bench-global") / "bench"
    proc = run_cli("bench", "--nproc", "1,2", "--global-batch-size", "32", "--strategy", "ddp,dp", "--epochs", "1",
                   "--model", "tinycnn", "--data", str(small_npz), "--interconnect", "measure",
                   "--output-dir", str(out), "--", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc, {(r["strategy"], r["devices"]): r for r in csv.DictReader((out / "bench.csv").open())}


@pytest.mark.slow
def test_bench_derives_the_per_device_batch_from_the_global_one(global_matrix):
    _, _, by = global_matrix
    assert (by["ddp", "1"]["batch_size_per_device"], by["ddp", "2"]["batch_size_per_device"]) == ("32", "16")
    assert by["ddp", "2"]["global_batch_size"] == "32" and by["ddp", "2"]["status"] == "ok"


@pytest.mark.slow
def test_bench_runs_dataparallel_on_one_device_and_refuses_two_without_gpus(global_matrix):
    out, _, by = global_matrix
    assert by["dp", "1"]["status"] == "ok"
    summary = json.loads((out / "n1-dp-no-g32" / "summary.json").read_text())
    assert summary["strategy"] == "dp" and summary["devices"] == 1
    assert by["dp", "2"]["status"] == "failed: dp on 2 devices needs 2 GPUs, 0 visible"


@pytest.mark.slow
def test_bench_projects_ddp_cells_only(global_matrix):
    """DataParallel's scatter and gather are not modelled, so its cells carry no projection."""
    _, _, by = global_matrix
    assert by["ddp", "1"]["projected_seconds_per_epoch"] and by["ddp", "2"]["projected_seconds_per_epoch"]
    assert not by["dp", "1"]["projected_seconds_per_epoch"]


@pytest.mark.slow
def test_bench_measures_the_all_reduce_bandwidth_it_projects_with(global_matrix):
    out, proc, _ = global_matrix
    record = json.loads((out / "bench.json").read_text())
    assert record["interconnect"] == "measure" and record["interconnect_gbps"] > 0
    assert f"measured all-reduce bus bandwidth: {record['interconnect_gbps']:.3g} GB/s" in proc.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_a_cell_runs_on_the_processes_it_names(strategy, tmp_path):
    from scaletrain.measure.bench import Cell

    cmd, env = Cell(2, "no", 16, strategy).command([], tmp_path)
    assert cmd[cmd.index("--nproc") + 1] == "2" and cmd[cmd.index("--strategy") + 1] == strategy and env is None


def test_a_tensor_parallel_cell_runs_train_with_tp_and_one_its_processes_cannot_split_is_skipped(tmp_path):
    from pathlib import Path

    from scaletrain.measure.bench import Cell, run_cell

    cell = Cell(4, "bf16", 16, "fsdp", tp=2)
    cmd, _ = cell.command(["--model", "m"], Path("out"))
    assert cell.name == "n4-fsdp-tp2-bf16-b16" and cmd[-4:] == ["--tp", "2", "--nproc", "4"]
    row = run_cell(Cell(3, "no", 16, "ddp", tp=2), [], tmp_path, timeout=1)
    assert row["status"] == "skipped: --tp 2 needs a multiple of 2 processes (--nproc x --nnodes), got 3"
    assert not (tmp_path / "n3-ddp-tp2-no-b16").exists()
    table = markdown_table([{**row, "seconds_per_epoch": None}])
    assert "| ddp + tp 2 |" in table
