"""A run resumes with the settings it was saved with; only --epochs may change, and only upwards."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from helpers import run_cli, train_cli

pytestmark = pytest.mark.slow  # each test trains or resumes a run

RUN = ["--model", "tinycnn", "--batch-size", "32", "--log-every", "2", "--checkpoint-every", "2",
       "--scheduler", "cosine", "--warmup-epochs", "0"]  # 400 samples: 13 steps per epoch


def _snapshot(run_dir):
    """What a refused resume must leave alone: every file's bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def killed_in_epoch_2(small_npz, tmp_path_factory):
    """A 2-epoch run killed in its second epoch, with a checkpoint at step 20 (batch 7 of epoch 2)."""
    out = tmp_path_factory.mktemp("killed") / "run"
    proc = run_cli("train", "--data", str(small_npz), *RUN, "--epochs", "2", "--output-dir", str(out),
                   env={"SCALETRAIN_FAULT": "kill:22"})
    assert proc.returncode != 0
    assert (out / "state" / "step-00000020").is_dir()
    return out


@pytest.mark.parametrize("flag, value, key", [("--lr", "0.1", "lr"), ("--seed", "3", "seed"),
                                              ("--augment", "none", "augment")])
def test_a_resume_that_changes_the_training_is_refused_by_key(killed_in_epoch_2, small_npz, tmp_path, flag,
                                                              value, key):
    run = tmp_path / "run"
    shutil.copytree(killed_in_epoch_2, run)
    before = _snapshot(run)
    proc = run_cli("train", "--data", str(small_npz), *RUN, "--epochs", "2", flag, value, "--output-dir", str(run))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{key}: saved" in last and value in last and "Traceback" not in proc.stderr
    assert _snapshot(run) == before, "a refused resume deletes or rewrites nothing"


def test_lowering_epochs_below_those_done_is_refused(killed_in_epoch_2, small_npz, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(killed_in_epoch_2, run)
    proc = run_cli("train", "--data", str(small_npz), *RUN, "--epochs", "1", "--output-dir", str(run))
    assert proc.returncode == 2
    assert "--epochs 1" in proc.stderr and "already trained 2 epoch(s)" in proc.stderr


def test_raising_epochs_resumes_with_the_schedule_replanned_and_recorded(killed_in_epoch_2, small_npz, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(killed_in_epoch_2, run)
    proc = train_cli(small_npz, run, *RUN, "--epochs", "3")
    assert "--epochs 2 -> 3" in proc.stdout
    rows = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert rows[-1]["epochs"] == [2, 3] and rows[-1]["step"] == 20
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["epochs"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3
    lr = [float(line.split(",")[4]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]
    # cosine over 3 epochs ends at zero; kept over the saved 2 epochs it would have climbed back past its peak
    assert len(lr) == 3 and lr[2] == pytest.approx(0.0, abs=1e-6)


def test_a_finished_run_trains_on_when_epochs_are_raised(small_npz, tmp_path):
    run = tmp_path / "run"
    train_cli(small_npz, run, *RUN, "--epochs", "1")
    same = run_cli("train", "--data", str(small_npz), *RUN, "--epochs", "1", "--output-dir", str(run))
    assert same.returncode == 2 and "finished run of 1 epoch" in same.stderr
    train_cli(small_npz, run, *RUN, "--epochs", "2")
    assert len((run / "metrics.csv").read_text().splitlines()) == 3
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2
