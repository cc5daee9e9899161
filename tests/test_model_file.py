"""A model defined in the user's own file, named on the command line (`--model path/to/file.py:factory`), through
train, predict, evaluate, export, resume, tune and estimate-memory; and never imported by a checkpoint alone."""

from __future__ import annotations

import json
import textwrap

import pytest
from safetensors import safe_open

from helpers import run_cli

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    def make(num_classes, in_chans=1):
        return nn.Sequential(nn.Conv2d(in_chans, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, num_classes))


    def not_a_model(num_classes):
        return "a string"
''')


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_npz):
    """`scaletrain train --model mine.py:make` for one epoch, its own cache folder keeping what it trusts."""
    tmp = tmp_path_factory.mktemp("model-file")
    (tmp / "mine.py").write_text(MODELS)
    env = {"XDG_CACHE_HOME": str(tmp / "cache")}
    proc = run_cli("train", "--data", str(small_npz), "--model", str(tmp / "mine.py:make"), "--epochs", "1",
                   "--batch-size", "32", "--output-dir", str(tmp / "run"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, env


def _meta(path):
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["scaletrain"])


def test_the_run_records_the_factory_its_file_and_its_sha256(trained):
    tmp, _ = trained
    meta = _meta(tmp / "run" / "best.safetensors")
    assert meta["model"] == str(tmp / "mine.py:make")
    assert meta["model_code"]["file"] == str((tmp / "mine.py").resolve()) and len(meta["model_code"]["sha256"]) == 64
    assert f"model: {tmp / 'mine.py:make'}" in (tmp / "run" / "config.yaml").read_text()


@pytest.mark.parametrize("command", [["predict", "--output", "{tmp}/out.csv"], ["evaluate"],
                                     ["export", "--format", "torchscript", "--output", "{tmp}/model.pt"]])
def test_predict_evaluate_and_export_rebuild_it_from_the_unchanged_file_saying_so(trained, small_npz, command):
    tmp, env = trained
    args = [a.format(tmp=tmp) for a in command]
    proc = run_cli(*args[:1], "--checkpoint", str(tmp / "run"), *(["--data", str(small_npz)]), *args[1:], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"importing the model's code from {(tmp / 'mine.py').resolve()}" in proc.stderr


def test_a_checkpoint_alone_imports_nothing_on_a_machine_that_did_not_train_with_the_file(trained, small_npz,
                                                                                           tmp_path):
    tmp, _ = trained
    proc = run_cli("predict", "--checkpoint", str(tmp / "run"), "--data", str(small_npz), "--output",
                   str(tmp_path / "out.csv"), env={"XDG_CACHE_HOME": str(tmp_path / "elsewhere")})
    assert proc.returncode == 2
    assert "was not trained with on this machine: give --model path/to/file.py:factory" in proc.stderr
    named = run_cli("predict", "--checkpoint", str(tmp / "run"), "--data", str(small_npz), "--output",
                    str(tmp_path / "out.csv"), "--model", str(tmp / "mine.py:make"),
                    env={"XDG_CACHE_HOME": str(tmp_path / "elsewhere")})
    assert named.returncode == 0, named.stderr[-2000:]


def test_a_changed_file_is_refused_for_predict_and_for_resume_until_named_again(trained, small_npz, tmp_path):
    tmp, env = trained
    changed = tmp_path / "copy"
    changed.mkdir()
    (changed / "mine.py").write_text(MODELS + "\n# edited\n")
    run = tmp_path / "run"
    assert run_cli("train", "--data", str(small_npz), "--model", str(changed / "mine.py:make"), "--epochs", "1",
                   "--batch-size", "32", "--output-dir", str(run), env=env).returncode == 0
    (changed / "mine.py").write_text(MODELS + "\n# edited again\n")
    proc = run_cli("predict", "--checkpoint", str(run), "--data", str(small_npz), "--output",
                   str(tmp_path / "out.csv"), env=env)
    assert proc.returncode == 2 and "changed since training (its SHA-256 differs)" in proc.stderr
    resume = run_cli("train", "--data", str(small_npz), "--model", str(changed / "mine.py:make"), "--epochs", "2",
                     "--batch-size", "32", "--output-dir", str(run), env=env)
    assert resume.returncode == 2 and "the model's code changed since this checkpoint" in resume.stderr
    assert len(resume.stderr.strip().splitlines()) == 1


def test_a_module_on_the_python_path_works_as_a_file_does(tmp_path, small_npz):
    package = tmp_path / "lib" / "mypackage"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(MODELS)
    proc = run_cli("train", "--data", str(small_npz), "--model", "mypackage.nets:make", "--epochs", "1",
                   "--batch-size", "64", "--output-dir", str(tmp_path / "run"),
                   env={"PYTHONPATH": str(tmp_path / "lib"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("spec, expected", [
    ("{tmp}/nowhere.py:make", "--model {tmp}/nowhere.py:make: no such file"),
    ("{tmp}/mine.py:missing", "has no function or class missing"),
    ("{tmp}/mine.py:not_a_model", "returned a str; expected a torch.nn.Module"),
    ("no_such_package.nets:make", "--model no_such_package.nets:make: no module no_such_package.nets"),
])
def test_a_factory_that_cannot_be_used_is_refused_on_one_line(trained, small_npz, tmp_path, spec, expected):
    tmp, env = trained
    proc = run_cli("train", "--data", str(small_npz), "--model", spec.format(tmp=tmp), "--epochs", "1",
                   "--output-dir", str(tmp_path / "run"), env=env)
    assert proc.returncode == 2 and expected.format(tmp=tmp) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run" / "state").exists()


def test_estimate_memory_and_tune_take_it_too(trained, small_npz, tmp_path):
    tmp, env = trained
    spec = str(tmp / "mine.py:make")
    estimate = run_cli("estimate-memory", "--model", spec, "--image-size", "28", "--channels", "1", env=env)
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    tune = run_cli("tune", "--find", "lr", "--num-steps", "12", "--data", str(small_npz), "--model", spec,
                   "--batch-size", "32", "--output-dir", str(tmp_path / "tune"), env=env)
    assert tune.returncode == 0 and "suggested lr" in tune.stdout, tune.stderr[-2000:]
