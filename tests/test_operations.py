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


@pytest.fixture(scope="module")
def events(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(finished_run / "tensorboard"))
    accumulator.Reload()
    return accumulator


def _metrics(run):
    return list(csv.DictReader((run / "metrics.csv").open()))


@pytest.mark.parametrize("name", ["val_accuracy", "val_loss", "train_loss", "lr"])
def test_each_epoch_value_is_logged_at_the_optimizer_step_that_ended_the_epoch(events, name):
    # 400 training samples in batches of 32: 13 optimizer steps per epoch.
    assert [e.step for e in events.Scalars(name)] == [13, 26, 39]


@pytest.mark.parametrize("name", ["val_accuracy", "val_loss", "train_loss", "lr"])
def test_each_epoch_value_in_tensorboard_is_the_one_in_metrics_csv(events, finished_run, name):
    logged = [e.value for e in events.Scalars(name)]
    assert logged == pytest.approx([float(r[name]) for r in _metrics(finished_run)], rel=1e-6)


def test_train_loss_is_logged_every_4_steps_and_at_each_epochs_end(events):
    # --log-every 4 with 13 steps per epoch: steps 4, 8, 12, 13 in epoch one, and so on.
    assert [e.step for e in events.Scalars("step/loss")] == [4, 8, 12, 13, 17, 21, 25, 26, 30, 34, 38, 39]


def test_throughput_is_logged_with_each_train_loss(events):
    speeds = events.Scalars("step/images_per_second")
    assert [e.step for e in speeds] == [e.step for e in events.Scalars("step/loss")]
    assert all(e.value > 0 for e in speeds)


def test_training_draws_the_curves_picture(finished_run):
    assert (finished_run / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def reported(finished_run, tmp_path, capsys):
    """`scaletrain report` on a copy of the finished run whose curves.png was deleted; its output."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "curves.png").unlink()
    assert main(["report", str(run)]) == 0
    return run, capsys.readouterr().out


def test_report_prints_one_row_per_epoch_from_metrics_csv(reported):
    run, out = reported
    rows = _metrics(run)
    assert "| epoch | train loss | val loss | val accuracy |" in out
    for epoch, row in enumerate(rows, 1):
        assert f"| {epoch} | {float(row['train_loss']):.4f} | {float(row['val_loss']):.4f} |" in out


def test_report_names_the_best_validation_accuracy(reported):
    run, out = reported
    best = max(float(r["val_accuracy"]) for r in _metrics(run))
    assert f"best val accuracy {best:.4f}" in out


def test_report_draws_the_curves_again(reported):
    run, _ = reported
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_report_on_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.csv" in capsys.readouterr().err


def _env(env=None) -> tuple[str, dict[str, str]]:
    proc = run_cli("env", env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())


def test_env_names_this_torch_accelerate_devices_backends_and_no_launcher():
    _, lines = _env()
    assert lines["torch"].split()[0] == torch.__version__
    import accelerate

    assert lines["accelerate"].split()[0] == accelerate.__version__
    expected = f"yes, driver sees {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no"
    assert lines["CUDA available"] == expected
    assert lines["launcher"] == "none (a single process)"
    assert "gloo" in lines["distributed backends"]


def test_env_recognises_a_slurm_task():
    stdout, lines = _env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"})
    assert "SLURM srun (task 1 of 2)" in lines["launcher"]
    assert re.search(r"^SLURM_JOB_ID\s+7$", stdout, re.M)
