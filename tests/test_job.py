"""The data is checked once per job: the launcher (or the first process on a machine) checks it and writes the
result; every worker reads that and checks nothing again. A bad file is reported once."""

from __future__ import annotations

import sys

import pytest
import torch
from PIL import Image

from scaletrain.training import job
from scaletrain.config import TrainConfig, resolve

from helpers import run_cli


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory, mnist):
    """120 digits as PNG files, one subfolder per class."""
    root = tmp_path_factory.mktemp("photos") / "digits"
    for i in range(120):
        folder = root / str(int(mnist.labels[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(mnist.images[i, 0].numpy()).save(folder / f"{i}.png")
    return root


def _cfg(data, out) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.data, cfg.data.image_size, cfg.data.channels, cfg.run.output_dir = str(data), 28, 1, str(out)
    return cfg.validate()


def test_what_the_launcher_checked_reads_back_equal(photo_folder, small_npz, tmp_path):
    for data in (photo_folder, small_npz):
        cfg = _cfg(data, tmp_path / "run")
        train, val, _ = job.check_data(cfg.data, cfg.run.seed)
        folder = job.job_folder(cfg.run.output_dir)
        settings = resolve(cfg, cfg.plan(2), train.recipe or "digits")
        job.write_job(folder, train, val, cfg.data.cache_dir, settings.to_dict(), settings.plan)
        assert job.read_settings(folder) == settings
        train2, val2 = job.read_data(folder)
        for a, b in ((train, train2), (val, val2)):
            assert len(a) == len(b) > 0 and a.classes == b.classes
            assert [int(a[i][1]) for i in range(len(a))] == [int(b[i][1]) for i in range(len(b))]
            assert all(torch.equal(a[i][0], b[i][0]) for i in (0, len(a) - 1))


def test_a_worker_given_the_job_folder_checks_nothing(photo_folder, tmp_path, monkeypatch):
    cfg = _cfg(photo_folder, tmp_path / "run")
    train, val, _ = job.check_data(cfg.data, cfg.run.seed)
    folder = job.job_folder(cfg.run.output_dir)
    settings = resolve(cfg, cfg.plan(1), train.recipe)
    job.write_job(folder, train, val, cfg.data.cache_dir, settings.to_dict(), settings.plan)
    (photo_folder / "0" / "unreadable.png").write_bytes(b"not a png")  # would fail a new check
    try:
        monkeypatch.setattr(job, "load_image_sets", lambda *a, **k: pytest.fail("the worker checked again"))
        got_train, got_val, skipped = job.worker_data(cfg.data, cfg.run.seed, cfg.run.output_dir, runtime=None, job=str(folder))
        assert (len(got_train), len(got_val), skipped) == (len(train), len(val), [])
    finally:
        (photo_folder / "0" / "unreadable.png").unlink()


@pytest.mark.slow
def test_two_processes_train_on_a_photo_folder_and_leave_no_job_folder(photo_folder, tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(photo_folder), "--image-size", "28", "--channels", "1", "--model",
                   "tinycnn", "--epochs", "1", "--batch-size", "16", "--nproc", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "summary.json").is_file() and not (out / ".job").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["scaletrain", "torchrun"])
def test_a_bad_image_is_reported_once(photo_folder, tmp_path, launcher):
    bad = tmp_path / "digits"
    import shutil

    shutil.copytree(photo_folder, bad)
    (bad / "3" / "broken.png").write_bytes(b"\x89PNG but nothing else")
    args = ["train", "--data", str(bad), "--image-size", "28", "--model", "tinycnn", "--epochs", "1",
            "--output-dir", str(tmp_path / "run")]
    if launcher == "scaletrain":
        proc = run_cli(*args, "--nproc", "2")
    else:
        proc = run_cli(*args, launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node=2", "-m"])
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "broken.png" in line and not line.strip().startswith(
        "traceback :")]  # torchrun's report of the failed workers names the worker's error as its root cause
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), proc.stderr[-3000:]
    if launcher == "scaletrain":  # (torchrun prints its own report of the failed workers)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
