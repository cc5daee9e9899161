"""The command line: defaults, help, and one-line errors for bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from scaletrain.cli import main

from helpers import run_cli


def _error(capsys, *argv) -> str:
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain"), err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--model", "resnet181"], "unknown model 'resnet181'; did you mean resnet18"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--epochs", "-1"], "--epochs must be a positive integer, got -1"),
    (["--lr", "0"], "--lr must be a positive number, got 0"),
    (["--lr", "-0.1"], "--lr must be a positive number"),
    (["--epoch", "3"], "unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
    (["--batch-size", "many"], "argument --batch-size: invalid int value: 'many'"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--data", "/no/such/folder"], "--data /no/such/folder: no such file or folder"),
    (["--mixed-precision", "fp16", "--epochs", "1"], "fp16 needs a GPU"),
    (["--nproc", "two"], "--nproc must be 'auto' or a positive integer, got 'two'"),
    (["--augment", "rotate"], "unknown augmentation 'rotate'"),
    (["--strategy", "dp", "--nproc", "2"], "--strategy dp runs one process that drives every visible GPU"),
    (["--strategy", "dp", "--sync-bn"], "--sync-bn needs --strategy ddp"),
    (["--strategy", "dp", "--activation-checkpointing"], "--activation-checkpointing needs --strategy ddp or fsdp"),
    (["--global-batch-size", "64", "--lr-scaling", "linear"], "--lr-scaling is for a fixed per-device batch"),
    (["--global-batch-size", "100", "--grad-accum", "3"], "--global-batch-size 100 cannot be shared evenly by 1 "
                                                           "device(s) x --grad-accum 3"),
    (["--global-batch-size", "-8"], "--global-batch-size must not be negative"),
    (["--global-batch-size", "6", "--nproc", "2", "--nnodes", "2"], "--global-batch-size 6 cannot be shared evenly "
                                                                      "by 4 device(s)"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, expected):
    assert expected in _error(capsys, "--output-dir", str(tmp_path / "run"), *argv)


def test_more_processes_than_gpus_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = _error(capsys, "--nproc", "3", "--output-dir", str(tmp_path))
    assert "--nproc 3 asks for more processes than the 2 GPU(s) present" in line


def test_a_folder_holding_weights_but_no_state_is_never_overwritten(capsys, tmp_path):
    (tmp_path / "best.safetensors").write_bytes(b"precious")
    assert "holds weights but no training state" in _error(capsys, "--output-dir", str(tmp_path))
    assert (tmp_path / "best.safetensors").read_bytes() == b"precious"


def test_a_finished_run_is_never_overwritten(capsys, tmp_path):
    (tmp_path / "best.safetensors").write_bytes(b"precious")
    (tmp_path / "summary.json").write_text("{}")
    assert "holds a finished run" in _error(capsys, "--output-dir", str(tmp_path))
    assert (tmp_path / "best.safetensors").read_bytes() == b"precious"


def test_resume_from_a_folder_without_training_state_is_refused(capsys, tmp_path):
    assert "no training state" in _error(capsys, "--resume", str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ["--data", "--model", "--epochs", "--batch-size", "--lr", "--optimizer", "--scheduler",
                 "--weight-decay", "--mixed-precision", "--seed", "--output-dir", "--num-workers", "--cpu",
                 "--nproc", "--sync-bn", "--grad-accum", "--image-size", "--warmup-epochs", "--augment"]:
        assert flag in out, flag
    assert "onecycle,cosine,constant" in out and "sgd,adam,adamw" in out


def test_real_process_error_has_no_traceback(tmp_path):
    proc = run_cli("train", "--model", "convnext_smal", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("scaletrain: error: --model: unknown model 'convnext_smal'; did you mean convnext_small")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`scaletrain train --epochs 1` with nothing else: the embedded digits and the default model."""
    cwd = tmp_path_factory.mktemp("default")
    proc = run_cli("train", "--epochs", "1", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd, proc


@pytest.mark.slow
def test_default_run_goes_into_one_timestamped_folder_under_runs(default_run):
    cwd, _ = default_run
    (run,) = (cwd / "runs").iterdir()
    assert re.fullmatch(r".*\d{8}-\d{6}.*", run.name), run.name
    assert sorted(p.name for p in run.iterdir()) == [".workers.lock", "best.safetensors", "config.yaml",
                                                     "curves.png", "last.safetensors", "metrics.csv", "state",
                                                     "summary.json", "tensorboard"]


@pytest.mark.slow
def test_default_run_trains_smallcnn_on_the_embedded_8000_2000_split_to_over_80_percent(default_run):
    cwd, _ = default_run
    (run,) = (cwd / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["train_samples"], summary["val_samples"]) == (8000, 2000)
    assert summary["model"] == "smallcnn" and summary["best_val_accuracy"] > 0.8


@pytest.mark.slow
def test_default_run_logs_progress_without_a_traceback(default_run):
    _, proc = default_run
    assert "train_loss" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_python_dash_m_trains_a_timm_model_by_name(tmp_path, small_npz):
    proc = run_cli("train", "--data", str(small_npz), "--model", "resnet10t", "--epochs", "1", "--batch-size",
                   "50", "--image-size", "32", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["model"] == "resnet10t"


@pytest.fixture(scope="module")
def from_config(tmp_path_factory, small_npz):
    """A run from a config file with --batch-size and --log-every also given as flags; its saved config.yaml."""
    tmp = tmp_path_factory.mktemp("config")
    path = tmp / "run.yaml"
    path.write_text(f"data: {small_npz}\nmodel: tinycnn\nepochs: 1\nbatch-size: 16\n"
                    "optim:\n  lr: 0.02\n  weight_decay: 0.0\naugment: none\ndata-on-device: yes\n")
    out = tmp / "run"
    assert main(["train", "--config", str(path), "--batch-size", "32", "--output-dir", str(out),
                 "--log-every", "5"]) == 0
    return out, yaml.safe_load((out / "config.yaml").read_text())


def test_a_flag_beats_the_config_file(from_config):
    _, saved = from_config
    assert saved["optim"]["batch_size"] == 32


def test_the_config_file_beats_the_defaults_flat_or_nested(from_config):
    _, saved = from_config
    assert (saved["optim"]["lr"], saved["optim"]["weight_decay"], saved["optim"]["epochs"]) == (0.02, 0.0, 1)
    assert saved["model"]["model"] == "tinycnn"
    assert saved["data"]["data_on_device"] == "yes" and saved["data"]["augment"] == "none"


def test_what_neither_the_file_nor_a_flag_sets_keeps_its_default(from_config):
    from scaletrain.config import TrainConfig

    _, saved = from_config
    defaults = TrainConfig().validate()
    assert saved["optim"]["momentum"] == defaults.optim.momentum
    assert saved["optim"]["optimizer"] == defaults.optim.optimizer


def test_a_run_folders_config_yaml_is_itself_a_valid_config(from_config, tmp_path):
    out, saved = from_config
    again = tmp_path / "again"
    assert main(["train", "--config", str(out / "config.yaml"), "--output-dir", str(again)]) == 0
    assert yaml.safe_load((again / "config.yaml").read_text())["optim"] == saved["optim"]


@pytest.mark.parametrize("text, expected", [
    ("batchsize: 64\n", "unknown key 'batchsize'; did you mean batch-size?"),
    ("epochs: many\n", "epochs: expected an integer, got 'many'"),
    ("optimizer: lion\n", "optimizer: 'lion' is not one of sgd, adam, adamw"),
    ("sync-bn: 3\n", "sync-bn: expected true or false, got 3"),
    ("epochs: [1\n", "not valid YAML at line"),
    ("- 1\n- 2\n", "expected keys and values"),
])
def test_a_bad_config_file_is_one_line_naming_file_and_key(capsys, tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = _error(capsys, "--config", str(path), "--output-dir", str(tmp_path / "run"))
    assert str(path) in line and expected in line
    assert not (tmp_path / "run").exists()


def test_scaletrain_config_writes_a_commented_starter(tmp_path):
    path = tmp_path / "starter.yaml"
    assert main(["config", str(path)]) == 0
    text = path.read_text()
    assert "# batch size per device" in text and "\nbatch-size: 128\n" in text and "\nlr: null\n" in text


def test_the_starter_config_is_the_defaults(tmp_path):
    from scaletrain.config import TrainConfig, read_config_file

    path = tmp_path / "starter.yaml"
    assert main(["config", str(path)]) == 0
    assert TrainConfig.from_dict(read_config_file(str(path))).validate() == TrainConfig().validate()


def test_scaletrain_config_never_overwrites_a_file(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("mine\n")
    assert main(["config", str(path)]) == 2
    assert path.read_text() == "mine\n" and "exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["train", "--epochs", "1", "--local-rank=1"], ["train", "--epochs", "1"]),
    (["train", "--local_rank=0", "--epochs", "1"], ["train", "--epochs", "1"]),
    (["train", "--local_rank", "0", "--epochs", "1"], ["train", "--epochs", "1"]),
])
def test_the_legacy_launchers_local_rank_argument_is_taken_from_a_launched_worker(monkeypatch, argv, expected):
    from scaletrain.parallel import drop_legacy_local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")
    assert drop_legacy_local_rank(argv) == expected


def test_local_rank_outside_a_launcher_is_an_unknown_flag(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["train", "--local-rank=0"]) == 2
    assert "unrecognized arguments: --local-rank=0" in capsys.readouterr().err
