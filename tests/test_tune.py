"""`scaletrain tune`: the learning-rate range test and the batch search, on one process and on two."""

from __future__ import annotations

import json
import re

import pytest

from helpers import run_cli
from scaletrain.cli import main
from scaletrain.measure.tune import largest_fitting, smoothed, steepest_descent

# 320 digits = 10 global batches of 32, so one process and two see the same batches at every step.
SWEEP = ["--find", "lr", "--model", "tinycnn", "--global-batch-size", "32", "--augment", "none",
         "--no-channels-last", "--num-steps", "40"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def digits320(tmp_path_factory, mnist):
    from conftest import write_npz

    return write_npz(tmp_path_factory.mktemp("tune") / "s320.npz", mnist, 320, 50)


def _suggestion(proc, what: str) -> str:
    """The value of the one 'suggested ...' line, which must be stdout's last."""
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("suggested ") for line in lines) == 1, proc.stdout
    match = re.fullmatch(rf"suggested {what} (\S+)", lines[-1])
    assert match, proc.stdout
    return match.group(1)


@pytest.fixture(scope="module")
def sweeps(digits320, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    runs = {"one": [], "two": ["--nproc", "2", "--sync-bn"]}
    out = {}
    for name, extra in runs.items():
        proc = run_cli("tune", "--data", str(digits320), *SWEEP, *extra, "--output-dir", str(root / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = (proc, root / name)
    return out


@pytest.mark.slow
def test_the_lr_sweep_prints_one_suggestion_within_the_range_and_writes_plot_and_losses(sweeps):
    proc, folder = sweeps["one"]
    lr = float(_suggestion(proc, "lr"))
    assert 1e-6 <= lr <= 1.0
    assert (folder / "lr_find.png").read_bytes().startswith(PNG_SIGNATURE)
    found = json.loads((folder / "lr_find.json").read_text())
    assert len(found["steps"]) == found["steps_run"] > 10
    assert all(step["loss"] > 0 for step in found["steps"])
    assert f"{found['suggested_lr']:.3g}" == f"{lr:.3g}"
    assert (folder / "lr_find.csv").read_text().startswith("step,lr,loss,smoothed_loss")
    assert not list(folder.glob("*.safetensors")) and not (folder / "state").exists()


@pytest.mark.slow
def test_two_processes_sweep_like_one_with_the_same_global_batch(sweeps):
    """Same suggestion, same losses. Not bit for bit: a 32-sample batch and two 16-sample halves sum in another
    order (differences of 1e-7); the largest rates then amplify them, so the losses are compared up to 0.01."""
    one, two = (json.loads((sweeps[k][1] / "lr_find.json").read_text()) for k in ("one", "two"))
    assert _suggestion(sweeps["one"][0], "lr") == _suggestion(sweeps["two"][0], "lr")
    assert one["suggested_lr"] == two["suggested_lr"]
    assert two["world_size"] == 2 and two["batch_size_per_device"] == 16
    pairs = [(a["loss"], b["loss"]) for a, b in zip(one["steps"], two["steps"]) if a["lr"] <= 0.01]
    assert len(pairs) > 20
    assert max(abs(a - b) / a for a, b in pairs) < 1e-5


@pytest.mark.slow
def test_a_larger_device_memory_gives_a_larger_batch_that_fits(digits320, tmp_path):
    batches = {}
    for memory in ("24MB", "64MB"):
        proc = run_cli("tune", "--find", "batch", "--data", str(digits320), "--model", "tinycnn", "--device-memory",
                       memory, "--output-dir", str(tmp_path / memory))
        assert proc.returncode == 0, proc.stderr[-3000:]
        batches[memory] = int(_suggestion(proc, "batch"))
        found = json.loads((tmp_path / memory / "batch_find.json").read_text())
        tried = {t["batch"]: t for t in found["trials"]}
        assert tried[batches[memory]]["fits"]
        assert tried[batches[memory]]["peak_bytes"] <= found["usable_memory"]
        assert all(not t["fits"] for t in found["trials"] if t["batch"] > batches[memory])
        assert (tmp_path / memory / "batch_find.png").read_bytes().startswith(PNG_SIGNATURE)
    assert 8 <= batches["24MB"] < batches["64MB"]
    assert batches["64MB"] % 8 == 0


@pytest.mark.parametrize("args, message", [
    (["--find", "speed"], "--find"),
    (["--find", "lr", "--min-lr", "0"], "--min-lr must be a positive number"),
    (["--find", "lr", "--max-lr", "1e-7"], "--max-lr must be larger than --min-lr"),
    (["--find", "lr", "--num-steps", "2"], "--num-steps must be at least 3"),
    (["--find", "batch", "--cpu"], "--find batch on a CPU needs --device-memory"),
    (["--find", "batch", "--device-memory", "lots"], "--device-memory: expected a positive size"),
    (["--find", "batch", "--strategy", "fsdp", "--device-memory", "1GB"], "--strategy ddp"),
    (["--max-lr", "1"], "--find"),
])
def test_bad_flags_are_refused_on_one_line(args, message, tmp_path, capsys):
    assert main(["tune", *args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_training_run_folder_is_left_alone(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("epoch\n")
    assert main(["tune", "--find", "lr", "--output-dir", str(tmp_path / "run")]) == 2
    assert "holds a training run" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.csv"]


def test_the_suggestion_is_where_the_smoothed_loss_falls_fastest():
    lrs = [10 ** (k / 10 - 6) for k in range(50)]
    losses = [2.0] * 20 + [2.0 - 0.1 * k for k in range(1, 11)] + [1.0 + 0.01 * k for k in range(20)]
    smooth = smoothed(losses, beta=0.0)  # no smoothing: the fall is steepest from step 21 to step 30
    assert 20 <= steepest_descent(lrs, smooth) <= 29
    assert smoothed([3.0, 3.0, 3.0]) == pytest.approx([3.0, 3.0, 3.0])  # bias-corrected: no pull towards 0


@pytest.mark.parametrize("first", [1, 7, 100, 1000, 5000])
@pytest.mark.parametrize("largest", [0, 1, 5, 9, 1000, 1003])
def test_the_batch_search_finds_the_largest_that_fits_from_any_first_guess(first, largest):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= largest

    expected = largest if largest < 8 else largest // 8 * 8
    assert largest_fitting(first, fits) == expected
    assert len(tried) <= 2 * max(first, largest, 2).bit_length() + 2
