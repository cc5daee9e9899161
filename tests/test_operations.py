"""Seeing a run: TensorBoard events, the curves picture, `scaletrain report` and `scaletrain env`."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from helpers import run_cli
from scaletrain.cli import main


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_npz):
    out = tmp_path_factory.mktemp("ops") / "run"
    assert main(["train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "3", "--batch-size", "32",
                 "--log-every", "4", "--output-dir", str(out)]) == 0
    return out


def test_event_files_hold_the_logged_values(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(finished_run / "tensorboard"))
    events.Reload()
    rows = list(csv.DictReader((finished_run / "metrics.csv").open()))
    for name in ("val_accuracy", "val_loss", "train_loss", "lr"):
        logged = events.Scalars(f"epoch/{name}")
        assert [e.step for e in logged] == [13, 26, 39], "at the optimizer step that ended each epoch"
        assert [e.value for e in logged] == pytest.approx([float(r[name]) for r in rows], rel=1e-6)
    # 400 training samples in batches of 32: 13 optimizer steps per epoch, a value every 4 steps and at each
    # epoch's end (steps 4, 8, 12, 13 in epoch one, and so on).
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [4, 8, 12, 13, 17, 21, 25, 26, 30, 34, 38, 39]
    assert all(e.value > 0 for e in events.Scalars("train/images_per_second"))


def test_curves_picture_and_report(finished_run, capsys):
    curves = finished_run / "curves.png"
    assert curves.read_bytes()[:4] == b"\x89PNG"
    curves.unlink()
    assert main(["report", str(finished_run)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader((finished_run / "metrics.csv").open()))
    assert "| epoch | train loss | val loss | val accuracy |" in out
    assert f"| 3 | {float(rows[2]['train_loss']):.4f} | {float(rows[2]['val_loss']):.4f} |" in out
    best = max(float(r["val_accuracy"]) for r in rows)
    assert f"best val accuracy {best:.4f}" in out
    assert curves.read_bytes()[:4] == b"\x89PNG", "report draws the curves again"


def test_report_on_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.csv" in capsys.readouterr().err


def test_env_names_versions_devices_and_the_launcher():
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())
    assert lines["torch"].split()[0] == torch.__version__ and "accelerate" in lines and "CUDA available" in lines
    assert lines["launcher"] == "none (a single process)"
    assert "gloo" in lines["distributed backends"]
    slurm = run_cli("env", env={"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"})
    assert "SLURM srun (task 1 of 2)" in slurm.stdout and re.search(r"^SLURM_JOB_ID\s+7$", slurm.stdout, re.M)
