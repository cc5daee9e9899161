"""Exact resumption after failures, with real processes: SIGKILL (with restarts), SIGTERM, a stalled rank,
and damaged checkpoints. The yardstick is always the same run without interruption, compared bit for bit."""

from __future__ import annotations

import pickle
import shutil
import time
import warnings

import pytest
import torch

import scaletrain
from safetensors.torch import load_file

from helpers import run_cli, train_cli

# 400 samples in batches of 16: 25 micro-batches per epoch on one process, 13 on each of two.
# Every fault below fires within these 2 epochs, and the resumed runs carry on across the epoch boundary.
BASE = ["--model", "tinycnn", "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "2", "--log-every", "1"]


def _train(data, out, *extra, env=None, expect=0):
    return train_cli(data, out, *BASE, *extra, env=env, expect=expect)


def _same_weights(a, b) -> bool:
    wa, wb = load_file(a / "last.safetensors"), load_file(b / "last.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_npz):
    """Uninterrupted runs for each setting the tests interrupt."""
    root = tmp_path_factory.mktemp("reference")
    settings = {"1": [], "1-accum": ["--grad-accum", "3"], "2": ["--nproc", "2"],
                "2-accum": ["--nproc", "2", "--grad-accum", "2"]}
    for name, extra in settings.items():
        _train(small_npz, root / name, *extra)
    return root, settings


@pytest.mark.parametrize("setting, batch", [
    ("1", 7),          # mid-epoch
    ("1", 25),         # the last batch of an epoch, before its end-of-epoch checkpoint
    ("1-accum", 8),    # inside a gradient-accumulation group of 3
    ("2-accum", 9),    # two processes, inside an accumulation group
])
def test_killed_and_resumed_run_ends_bitwise_equal(references, small_npz, tmp_path, setting, batch):
    root, settings = references
    out = tmp_path / "run"
    _train(small_npz, out, *settings[setting], env={"SCALETRAIN_FAULT": f"kill:{batch}"},
           expect=1 if setting.startswith("2") else -9)
    assert not (out / "summary.json").exists() and any((out / "state").iterdir()), "killed before any checkpoint"
    resumed = _train(small_npz, out, *settings[setting])
    assert "resuming from" in resumed.stdout
    assert _same_weights(out, root / setting)
    assert (out / "metrics.csv").read_text().count("\n") == 3  # the header and one row per epoch


def test_sigkill_under_max_restarts_recovers_by_itself(references, small_npz, tmp_path):
    root, settings = references
    out = tmp_path / "run"
    proc = _train(small_npz, out, *settings["2"], "--max-restarts", "1",
                  env={"SCALETRAIN_FAULT": "kill:17:1", "SCALETRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert (tmp_path / "fired").exists() and "resuming from" in proc.stdout
    assert _same_weights(out, root / "2")


def test_torchrun_restart_also_resumes(references, small_npz, tmp_path):
    import sys

    root, settings = references
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m"]
    proc = run_cli("train", "--data", str(small_npz), *BASE, "--output-dir", str(out), launcher=launcher,
                   env={"SCALETRAIN_FAULT": "kill:10:0", "SCALETRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _same_weights(out, root / "2")


def test_sigterm_checkpoints_stops_with_75_and_the_same_command_resumes(references, small_npz, tmp_path):
    root, settings = references
    out = tmp_path / "run"
    proc = _train(small_npz, out, *settings["2"], env={"SCALETRAIN_FAULT": "term:11:1"}, expect=75)
    assert proc.stderr.count("stopped by") == 1 and "run the same command again to resume" in proc.stderr
    # The signal came after batch 11; every rank checkpointed at the next step boundary, step 12.
    assert sorted(p.name for p in (out / "state").iterdir())[-1] == "step-00000012"
    _train(small_npz, out, *settings["2"])
    assert _same_weights(out, root / "2")


def test_a_stalled_rank_fails_the_job_within_the_timeout(small_npz, tmp_path):
    start = time.monotonic()
    proc = run_cli("train", "--data", str(small_npz), *BASE, "--nproc", "2", "--timeout", "5",
                   "--output-dir", str(tmp_path / "run"), env={"SCALETRAIN_FAULT": "hang:4:1"}, timeout=150)
    assert proc.returncode != 0
    assert "waited more than --timeout for the others" in proc.stderr
    assert time.monotonic() - start < 120


def _damage_newest_and_resume(references, small_npz, tmp_path, damage):
    root, settings = references
    out = tmp_path / "run"
    _train(small_npz, out, env={"SCALETRAIN_FAULT": "kill:12"}, expect=-9)
    newest = sorted((out / "state").iterdir())[-1]
    damage(newest)
    proc = _train(small_npz, out)
    assert f"checkpoint {newest} is unusable" in proc.stdout
    assert _same_weights(out, root / "1")
    return proc


def test_truncated_checkpoint_falls_back_to_the_previous_one(references, small_npz, tmp_path):
    def truncate(folder):
        f = folder / "rank-0.safetensors"
        f.write_bytes(f.read_bytes()[:100])

    proc = _damage_newest_and_resume(references, small_npz, tmp_path, truncate)
    assert "does not match its checksum" in proc.stdout


def test_crafted_pickle_in_a_checkpoint_is_never_run(references, small_npz, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    def plant(folder):
        (folder / "model.safetensors").write_bytes(pickle.dumps(Exploit()))

    _damage_newest_and_resume(references, small_npz, tmp_path, plant)
    assert not marker.exists()


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from scaletrain import checkpoint
    from scaletrain.parallel import Runtime

    runtime = Runtime()
    try:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        cfg = scaletrain.TrainConfig()
        ckpt = checkpoint.Checkpointer(tmp_path, runtime, model, opt, sched, cfg.validate(), cfg.plan(1))
        ckpt.save(checkpoint.TrainState(0, 1, 1))
        import safetensors.torch
        real_save = safetensors.torch.save_file

        def disk_full(tensors, path):
            if path.endswith("optimizer.safetensors"):
                raise OSError(28, "No space left on device")
            real_save(tensors, path)

        monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.save(checkpoint.TrainState(0, 2, 2))
        assert any("No space left on device" in str(w.message) for w in caught)
        assert [p.name for p in (tmp_path / "state").iterdir()] == ["step-00000001"]
        assert checkpoint.find_resumable(tmp_path) == tmp_path / "state" / "step-00000001"
    finally:
        runtime.end()


def test_a_stop_at_the_last_batch_of_an_epoch_still_saves_first(references, small_npz, tmp_path):
    root, _ = references
    out = tmp_path / "run"
    proc = _train(small_npz, out, env={"SCALETRAIN_FAULT": "term:24"}, expect=75)
    assert "after saving the training state at optimizer step 25" in proc.stderr
    assert sorted(p.name for p in (out / "state").iterdir())[-1] == "step-00000025"
    _train(small_npz, out)
    assert _same_weights(out, root / "1")
