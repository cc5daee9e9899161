"""`scaletrain.train` as Ray Train's training function: 2 CPU workers on a local Ray, every epoch reported to Ray
with a checkpoint, and a killed worker's job continued from the last epoch."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

import forkserver
import scaletrain
from conftest import write_npz

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
# What Ray's worker processes import besides torch and scaletrain (Ray Train imports pandas and pyarrow). Not Ray
# itself: its configuration and authentication token are read at import, and a worker forked after that fails to
# connect.
RAY_IMPORTS = ("pandas", "pyarrow", "pyarrow.compute", "scaletrain.training.ray_worker")


@pytest.fixture(scope="module")
def local_ray():
    # Offline: no usage report. 4 logical CPUs whatever the machine has: 2 workers and Ray's own actors each take one.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.setenv("OMP_NUM_THREADS", "1")
        # no idle workers started ahead for this driver: the trainer's actors start their own (60-61 s for this
        # file alone against 66-75 s, two runs each, 2026-11-27)
        env.setenv("RAY_prestart_worker_first_driver", "0")
        # Ray's worker processes (the trainer's controller, its helper actors and the training workers: 13 with the
        # restart) forked from a server that has imported torch, scaletrain, pandas and pyarrow, instead of 13 fresh
        # interpreters importing them (tests/forkserver.py): Ray starts each one as `py_executable default_worker.py
        # ...`, here the server's relay. This file alone: 108 s of CPU to 57 s, 2026-11-27
        server = None if os.environ.get("SCALETRAIN_TEST_FRESH") == "1" else forkserver.Server(also=RAY_IMPORTS)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"py_executable": server.relay} if server else None)
        yield
        ray.shutdown()
        if server:
            server.close()


def _fit(config: scaletrain.TrainConfig, storage, env: dict):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(scaletrain.train, train_loop_config=config.to_dict(),
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name="mnist", storage_path=str(storage),
                                                failure_config=FailureConfig(max_failures=1),
                                                worker_runtime_env={"env_vars": env}))
    return trainer.fit()


def _rows(run_dir):
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


@pytest.fixture(scope="module")
def ray_run(local_ray, tmp_path_factory, mnist):
    """Two epochs on 2 Ray workers, rank 1 killed in the second once (Ray starts the workers again, once)."""
    root = tmp_path_factory.mktemp("ray")
    config = scaletrain.TrainConfig()
    config.data.data = str(write_npz(root / "d.npz", mnist, 300, 101))
    config.model.model, config.optim.epochs, config.optim.batch_size = "tinycnn", 2, 16
    config.run.output_dir, config.run.log_every = str(root / "run"), 5
    # the run has 20 batches (10 per epoch): rank 1 dies after the 15th
    fault = {"SCALETRAIN_FAULT": "kill:15:1", "SCALETRAIN_FAULT_ONCE": str(root / "fault-fired")}
    return root, _fit(config, root / "ray", env=fault)


def test_ray_receives_each_epochs_metrics_csv_row(ray_run):
    root, result = ray_run
    last = _rows(root / "run")[-1]
    assert set(result.metrics) == set(last)
    assert result.metrics["epoch"] == 2
    assert result.metrics["val_accuracy"] == float(last["val_accuracy"])


def test_two_ray_workers_form_one_job_validating_on_the_whole_set(ray_run):
    root, _ = ray_run
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["val_samples"]) == (2, 101)
    # nothing left behind but the workers' lock file every run folder keeps (see docs/checkpoints.md)
    assert [p.name for p in (root / "run").iterdir() if p.name.startswith(".")] == [".workers.lock"]


def test_a_killed_worker_restarts_from_the_last_reported_epoch_not_from_scratch(ray_run):
    root, result = ray_run
    assert (root / "fault-fired").exists() and result.error is None
    assert [r["epoch"] for r in _rows(root / "run")] == ["1", "2"]
    resumes = [json.loads(line) for line in (root / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [(r["checkpoint"], r["epoch"], r["batch"]) for r in resumes] == [("step-00000010", 1, 0)]


def test_ray_checkpoints_hold_the_training_state_a_resume_reads(ray_run):
    _, result = ray_run
    with result.checkpoint.as_directory() as folder:
        assert sorted(os.listdir(folder)) == ["metrics.csv", "state"]
        assert os.listdir(os.path.join(folder, "state")) == ["step-00000020"]


def test_a_run_folder_takes_rays_checkpoint_only_when_that_is_newer(ray_run, tmp_path):
    """What a worker of a later Ray run does before training (another run folder, or one that lost its state)."""
    from scaletrain.training.checkpoint import find_resumable
    from scaletrain.training.ray_worker import restore
    from scaletrain.runfolder import read_metrics

    root, result = ray_run
    with result.checkpoint.as_directory() as folder:
        assert restore(Path(folder), tmp_path / "new")
        assert find_resumable(tmp_path / "new").name == "step-00000020"  # whole, checksums and all
        assert read_metrics(tmp_path / "new") == read_metrics(root / "run")
        assert not restore(Path(folder), root / "run")  # the run folder holds that step already
