"""--log-with: TensorBoard, MLflow (a local sqlite store) and W&B (offline) receive each epoch's metrics.csv values,
the run's settings, one run per training run, continued on resume; bad names and missing packages are refused."""

from __future__ import annotations

import csv
import glob
import json
import struct
from pathlib import Path

import pytest

from helpers import run_cli, train_cli
from scaletrain.cli import main

TINY = ["--model", "tinycnn", "--batch-size", "32", "--log-every", "4"]
EPOCH_METRICS = ["val_accuracy", "train_loss", "val_loss", "lr"]


def tracker_env(tmp: Path) -> dict[str, str]:
    """A local MLflow store and offline W&B, all inside `tmp`."""
    return {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp), "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}


def metrics_csv(run: Path) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader((run / "metrics.csv").open())]


def mlflow_runs(tmp: Path, experiment: str = "scaletrain"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id]) if found else []


def mlflow_history(client, run, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))


def wandb_records(path: Path):
    """The records of a W&B run file: W&B's log format (32 KiB blocks of checksummed chunks) holding its own
    protobuf Record messages."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B writes a key either way


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, small_npz):
    """One tiny 2-epoch run logged to all three trackers at once."""
    tmp = tmp_path_factory.mktemp("trackers")
    run = tmp / "run"
    train_cli(small_npz, run, *TINY, "--epochs", "2", "--log-with", "tensorboard,mlflow,wandb",
              env=tracker_env(tmp))
    return tmp, run


@pytest.mark.slow
@pytest.mark.parametrize("name", EPOCH_METRICS)
def test_mlflow_holds_each_epochs_value_of_metrics_csv_at_the_step_that_ended_it(tracked, name):
    tmp, run = tracked
    client, runs = mlflow_runs(tmp)
    assert len(runs) == 1
    # 400 training samples in batches of 32: 13 optimizer steps per epoch.
    assert mlflow_history(client, runs[0], name) == [(13 * r["epoch"], pytest.approx(r[name], rel=1e-6))
                                                      for r in metrics_csv(run)]


@pytest.mark.slow
def test_mlflow_run_has_the_settings_as_parameters_and_the_summary_and_is_finished(tracked):
    tmp, run = tracked
    _, (found,) = mlflow_runs(tmp)
    summary = json.loads((run / "summary.json").read_text())
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["optim.lr"] == "0.05" and found.data.params["model.model"] == "tinycnn"
    assert found.data.params["plan.global_batch"] == "32" and found.data.params["run.log_with"] == \
        "tensorboard,mlflow,wandb"
    assert found.data.metrics["summary/best_val_accuracy"] == pytest.approx(summary["best_val_accuracy"])
    assert json.loads((run / "trackers.json").read_text())["run_ids"]["mlflow"] == found.info.run_id


@pytest.mark.slow
def test_wandb_offline_run_holds_each_epochs_value_and_the_settings(tracked):
    tmp, run = tracked
    (wandb_file,) = glob.glob(str(tmp / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = list(wandb_records(Path(wandb_file)))
    history = [{item_key(i): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    epochs = [h for h in history if "val_accuracy" in h]
    for name in EPOCH_METRICS:
        assert [h[name] for h in epochs] == pytest.approx([r[name] for r in metrics_csv(run)], rel=1e-6)
    assert [h["_step"] for h in epochs] == [13, 26]
    config = {item_key(i): json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for i in r.config.update}
    assert config["optim.lr"] == 0.05 and config["plan.global_batch"] == 32
    assert json.loads((run / "trackers.json").read_text())["run_ids"]["wandb"] in wandb_file


@pytest.mark.slow
@pytest.mark.parametrize("name", EPOCH_METRICS)
def test_tensorboard_holds_each_epochs_value_of_metrics_csv(tracked, name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run = tracked
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(name)] == [
        (13 * r["epoch"], pytest.approx(r[name], rel=1e-6)) for r in metrics_csv(run)]


@pytest.mark.slow
def test_tensorboard_holds_the_settings_as_hparams(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _, run = tracked
    hparams = {}
    for folder in (run / "tensorboard").iterdir():  # accelerate writes them as a run of their own
        if folder.is_dir() and any(folder.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(folder))
            events.Reload()
            for content in events.PluginTagToContent("hparams").values():
                info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
                hparams.update({k: v.number_value or v.string_value for k, v in info.hparams.items()})
    assert hparams["optim.lr"] == pytest.approx(0.05) and hparams["model.model"] == "tinycnn"


def test_tensorboard_starts_with_the_first_values_logged_not_before_the_first_step(tmp_path):
    """Its import and writer are not on the way to the first step: nothing is written until values come, and then
    the run's settings come with them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from scaletrain.parallel.trackers import build_trackers

    (tracker,) = build_trackers(("tensorboard",), tmp_path, "scaletrain", 0, {})
    tracker.start()
    tracker.store_init_configuration({"optim.lr": 0.05})
    assert not (tmp_path / "tensorboard").exists()
    tracker.log({"train_loss": 1.5}, step=3)
    tracker.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(3, 1.5)]
    assert [p.read_text() for p in (tmp_path / "tensorboard").glob("*/hparams.yml")] == ["optim.lr: 0.05\n"]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_mlflow_run_without_duplicates(small_npz, tmp_path):
    env, run = tracker_env(tmp_path), tmp_path / "run"
    train_cli(small_npz, run, *TINY, "--epochs", "1", "--log-with", "mlflow", env=env)
    # No --log-with: auto continues the trackers the run was started with (trackers.json).
    train_cli(small_npz, run, *TINY, "--epochs", "2", "--resume", env=env)
    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    for name in EPOCH_METRICS:
        assert mlflow_history(client, runs[0], name) == [(13 * r["epoch"], pytest.approx(r[name], rel=1e-6))
                                                          for r in metrics_csv(run)]
    steps = [step for step, _ in mlflow_history(client, runs[0], "step/loss")]
    assert steps == [4, 8, 12, 13, 17, 21, 25, 26]


@pytest.mark.slow
def test_tensorboard_drops_the_steps_a_killed_run_logged_after_its_checkpoint(small_npz, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    # Killed at step 20, in epoch 2: step 17 was logged after the checkpoint at the end of epoch 1 (step 13).
    train_cli(small_npz, run, *TINY, "--epochs", "2", env={"SCALETRAIN_FAULT": "kill:20"}, expect=-9)
    train_cli(small_npz, run, *TINY, "--epochs", "2")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == [4, 8, 12, 13, 17, 21, 25, 26]
    assert [e.step for e in events.Scalars("val_accuracy")] == [13, 26]


@pytest.mark.slow
def test_two_processes_make_one_mlflow_run_with_each_epoch_logged_once(small_npz, tmp_path):
    run = tmp_path / "run"
    train_cli(small_npz, run, *TINY, "--epochs", "2", "--nproc", "2", "--log-with", "mlflow",
              env=tracker_env(tmp_path))
    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1
    # 2 processes x 32 per device: a global batch of 64, 7 optimizer steps per epoch.
    assert mlflow_history(client, runs[0], "val_accuracy") == [
        (7 * r["epoch"], pytest.approx(r["val_accuracy"], rel=1e-6)) for r in metrics_csv(run)]


def test_log_with_none_writes_no_tracker_files(small_npz, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", str(small_npz), *TINY, "--epochs", "1", "--log-with", "none",
                 "--output-dir", str(run)]) == 0
    assert not (run / "tensorboard").exists() and not (run / "trackers.json").exists()
    assert (run / "config.yaml").read_text().count("log_with: none") == 1


def test_an_unknown_tracker_is_one_line_naming_the_flag_and_the_choices(small_npz, tmp_path):
    proc = run_cli("train", "--data", str(small_npz), "--log-with", "tensorboard,foo", "--output-dir",
                   str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["scaletrain: error: --log-with: unknown tracker 'foo'; choose from "
                                                "tensorboard, mlflow, wandb (comma-separated), or auto, or none"]
    assert not (tmp_path / "run").exists()


def test_a_tracker_whose_package_is_missing_names_the_extra_before_training(small_npz, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setattr("scaletrain.config.tracker_installed", lambda name: name != "wandb")
    assert main(["train", "--data", str(small_npz), "--log-with", "tensorboard,wandb",
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == ("scaletrain: error: --log-with wandb needs the wandb package: "
                                               "pip install 'scaletrain[wandb]'")
    assert not (tmp_path / "run").exists()


def test_log_with_is_not_a_change_that_blocks_a_resume():
    from scaletrain.config import TrainConfig, trajectory_changes

    saved, new = TrainConfig().to_dict(), TrainConfig().to_dict()
    new["run"].update(log_with="mlflow", experiment="other")
    assert trajectory_changes(saved, new) == []
