"""The flags every command that runs a model carries over from train (--cpu, --seed, --timeout, --config, the
node flags), each command's --help, and one-line refusals of bad values."""

from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest
import yaml

import scaletrain.parallel
from scaletrain.cli import main
from scaletrain.config import RunConfig
from scaletrain.data import embedded_mnist

from helpers import run_cli

CARRIED = ["--cpu", "--seed", "--timeout", "--config", "--nnodes", "--node-rank", "--master-addr", "--master-port"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_npz):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "1", "--batch-size", "32",
                 "--output-dir", str(run)]) == 0
    return run


@pytest.fixture()
def runtimes(monkeypatch):
    """The arguments each `Runtime` was made with, in order."""
    made = []
    real = scaletrain.parallel.Runtime

    def recording(*args, **kwargs):
        made.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(scaletrain.parallel, "Runtime", recording)
    return made


def _npz(tmp_path):
    """40 unlabelled digits."""
    path = tmp_path / "inputs.npz"
    if not path.exists():
        np.savez(path, images=embedded_mnist().images[:40, 0].numpy())
    return path


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), err
    return lines[0]


@pytest.mark.parametrize("command, flags", [
    ("train", ["--data", "--epochs", "--resume", *CARRIED]),
    ("predict", ["--checkpoint", "--data", "--output", "--top-k", "--probabilities", "--logits", "--nproc",
                 "--strategy", "--mixed-precision", *CARRIED]),
    ("evaluate", ["--checkpoint", "--data", "--split", "--output-dir", "--batch-size", *CARRIED]),
    ("export", ["--checkpoint", "--format", "--output", "--data", "--check-samples", "--tolerance"]),
    ("bench", ["--nproc", "--mixed-precision", "--batch-size", "--global-batch-size", "--strategy", "--sync-bn",
               "--epochs", "--model", "--interconnect", "--project-nodes", "--cell-timeout", *CARRIED]),
    ("estimate-memory", ["--model", "--image-size", "--channels", "--device-memory", "--json"]),
    ("config", ["path"]),
    ("report", ["RUN_DIR"]),
    ("env", []),
])
def test_every_command_has_help_listing_its_flags(capsys, command, flags):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    for flag in flags:
        assert flag in out, flag
    if "--seed" in flags:  # the flags carried over from train say what train's say
        helps = {f.name: f.metadata["help"] for f in dataclasses.fields(RunConfig)}
        for name in ("seed", "timeout", "nnodes", "node_rank", "master_addr", "master_port"):
            assert helps[name] in out, name


@pytest.mark.slow
def test_bench_runs_cells_on_the_cpu_with_the_seed_and_timeout(small_npz, tmp_path):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--cpu", "--seed", "3", "--timeout", "60", "--model", "tinycnn", "--data", str(small_npz),
                   "--epochs", "1", "--batch-size", "32", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[1/1] n1-ddp-no-b32:" in proc.stdout
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["status"] for r in rows] == ["ok"]
    run = yaml.safe_load((out / "n1-ddp-no-b32" / "config.yaml").read_text())["run"]
    assert (run["cpu"], run["seed"], run["timeout"]) == (True, 3, 60.0)


def test_predict_takes_the_config_file_and_the_flags_win(trained, tmp_path, runtimes):
    settings = tmp_path / "predict.yaml"
    # batch-size applies to predict too; lr and epochs are training's and ignored.
    settings.write_text("mixed-precision: bf16\ncpu: true\nbatch-size: 16\noptim:\n  lr: 0.5\n  epochs: 9\n")
    common = ["predict", "--checkpoint", str(trained), "--data", str(_npz(tmp_path)), "--logits"]
    from_file, plain, flags_win = (tmp_path / n for n in ("file.csv", "plain.csv", "flags.csv"))
    assert main([*common, "--cpu", "--seed", "1", "--timeout", "60", "--config", str(settings),
                 "--output", str(from_file)]) == 0
    assert main([*common, "--config", str(settings), "--mixed-precision", "no", "--no-cpu",
                 "--output", str(flags_win)]) == 0
    assert main([*common, "--output", str(plain)]) == 0
    (precision, cpu), kwargs = runtimes[0]
    assert (precision, cpu, kwargs["timeout_seconds"]) == ("bf16", True, 60.0)
    assert runtimes[1][0] == ("no", False), "flags given on the command line win over the file"
    assert runtimes[2][0] == ("no", False) and runtimes[2][1]["timeout_seconds"] == 1800.0
    rows = [list(csv.reader(p.open())) for p in (from_file, flags_win, plain)]
    assert len(rows[0]) == 1 + 40
    assert rows[1] == rows[2], "with the file's precision overridden, the same logits as without the file"
    assert rows[0] != rows[2], "bf16 autocast (from the file) gives other logits than fp32"


def test_evaluate_takes_the_carried_flags(trained, tmp_path, small_npz, runtimes):
    out = tmp_path / "eval"
    assert main(["evaluate", "--checkpoint", str(trained), "--data", str(small_npz), "--split", "val", "--cpu",
                 "--seed", "2", "--timeout", "30", "--output-dir", str(out)]) == 0
    assert runtimes[0][1]["timeout_seconds"] == 30.0 and (out / "metrics.json").exists()


@pytest.mark.parametrize("text, expected", [
    ("batch-size: many\n", "batch-size: expected an integer, got 'many'"),
    ("cpu: 3\n", "cpu: expected true or false, got 3"),
    ("strategy: dp\n", "strategy: 'dp' is not one of ddp, fsdp here"),
    ("batch-sise: 8\n", "unknown key 'batch-sise'; did you mean batch-size?"),
])
def test_a_bad_config_file_is_refused_naming_the_file_and_key(capsys, trained, tmp_path, text, expected):
    settings = tmp_path / "bad.yaml"
    settings.write_text(text)
    out = tmp_path / "out.csv"
    line = _one_line_error(capsys, ["predict", "--checkpoint", str(trained), "--data", str(_npz(tmp_path)),
                                    "--config", str(settings), "--output", str(out)])
    assert f"--config {settings}" in line and expected in line
    assert not out.exists()


@pytest.mark.parametrize("argv, expected", [
    (["bench", "--nnodes", "2"], "--nnodes 2: bench runs its cells on this machine"),
    (["bench", "--cpu", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
    (["bench", "--seed", "one"], "argument --seed: invalid int value: 'one'"),
    (["bench", "--cpus"], "unrecognized arguments: --cpus (did you mean --cpu?)"),
    (["predict", "--checkpoint", "x", "--data", "y", "--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
    (["train", "--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
    (["predict", "--checkpoint", "x", "--data", "y", "--master-port", "70000"], "--master-port must be a port"),
    (["evaluate", "--checkpoint", "x", "--data", "y", "--nnodes", "2", "--node-rank", "2"],
     "--node-rank in 0..nnodes-1, got --nnodes 2 --node-rank 2"),
    (["evaluate", "--checkpoint", "x", "--data", "y", "--num-workers", "-1"], "--num-workers must not be negative"),
    (["predict", "--checkpoint", "x", "--data", "y", "--nproc", "two"], "--nproc must be 'auto' or a positive"),
    (["predict", "--checkpoint", "x", "--data", "y", "--config", "/no/such.yaml"], "--config /no/such.yaml: no such"),
])
def test_bad_values_are_one_line_naming_the_flag(capsys, argv, expected):
    assert expected in _one_line_error(capsys, argv)
