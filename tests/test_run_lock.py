"""One job per run folder, and no worker outliving its launcher, with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fcntl
import pytest
import torch
from safetensors.torch import load_file

from helpers import children, run_cli, run_python, start_python, wait_for
from scaletrain.errors import UserError
from scaletrain.runfolder import OWNER_FILE, WORKERS_LOCK, RunClaim, default_run_folder

LONG = ["--model", "tinycnn", "--batch-size", "16", "--checkpoint-every", "10"]


def _start(*args: str, cwd: Path) -> subprocess.Popen:
    return start_python([sys.executable, "-m", "scaletrain", "train", *args], cwd=cwd, stderr=subprocess.STDOUT)


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_default_run_folders_made_in_the_same_second_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt, *a: "20261123-101500")
    folders = [default_run_folder() for _ in range(3)]
    assert folders == ["runs/20261123-101500", "runs/20261123-101500-2", "runs/20261123-101500-3"]
    assert all(Path(f).is_dir() for f in folders)


def test_a_folder_held_by_another_process_is_refused_naming_it_and_left_as_it_was(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from scaletrain.runfolder import RunClaim
claim = RunClaim.take({str(run)!r})
claim.record("scaletrain train --output-dir run")
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
        with pytest.raises(UserError, match=rf"--output-dir {run}: another job is training into it \(pid "
                                            rf"{holder.pid} on host .*\); wait for it to end, or choose another"):
            RunClaim.take(run)
        assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()
    RunClaim.take(run).release()  # the kernel let it go with the holder: no stale lock after SIGKILL


def test_a_folder_whose_workers_still_live_is_waited_for_then_refused(tmp_path, monkeypatch, capsys):
    """Workers holding the folder with no launcher holding it: their launcher is gone and they are leaving; the
    new job waits for them (one line, a bound) and is refused only when they outlive it."""
    monkeypatch.setattr("scaletrain.runfolder.LEAVING_WAIT", 1.0)
    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / WORKERS_LOCK, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as a live worker holds it
    try:
        with pytest.raises(UserError, match="another job is training into it"):
            RunClaim.take(run)
    finally:
        os.close(fd)
    assert capsys.readouterr().out == (f"--output-dir {run}: the workers of the job that held it lost its launcher "
                                       f"and is leaving; waiting up to 1 s for it to end, then resuming\n")
    RunClaim.take(run).release()


def test_a_folder_whose_workers_leave_while_waited_for_is_taken(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    worker = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; "
                               "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_SH); "
                               "print('held', flush=True); time.sleep(2)", str(run / WORKERS_LOCK)],
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "held\n"
    start = time.monotonic()
    RunClaim.take(run).release()  # waited for the worker to leave, then taken
    assert 0.5 < time.monotonic() - start < 20
    worker.wait()


@pytest.mark.slow
def test_a_second_job_is_refused_while_the_first_trains_and_reading_it_stays_allowed(small_npz, tmp_path):
    first = _start("--data", str(small_npz), *LONG, "--epochs", "30", "--output-dir", "run", cwd=tmp_path)
    run = tmp_path / "run"
    try:
        wait_for(lambda: (run / "metrics.csv").is_file(), 120, "the first job's first epoch")
        owner = json.loads((run / OWNER_FILE).read_text())
        second = run_cli("train", "--data", str(small_npz), *LONG, "--epochs", "30", "--lr", "0.2",
                         "--output-dir", "run", cwd=tmp_path)
        assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1
        assert f"another job is training into it (pid {owner['pid']} on host {owner['host']}" in second.stderr
        report = run_cli("report", "run", cwd=tmp_path)
        assert report.returncode == 0 and "| 1 |" in report.stdout
    finally:
        out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-2000:]
    assert "lr: 0.2" not in (run / "config.yaml").read_text()  # the refused job changed nothing
    assert not (run / OWNER_FILE).exists()  # let go at the end


@pytest.mark.slow
def test_a_refused_new_run_leaves_no_folder_behind(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("label,pixel0\n1,2\n")
    proc = run_cli("train", "--data", str(bad), "--output-dir", "new", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "new").exists()


@pytest.fixture(scope="module")
def killed_launcher(tmp_path_factory, small_npz):
    """A 2-process job whose launcher is SIGKILLed mid-training, the same command run again at once (the killed
    job's workers still leaving), and the same job never interrupted."""
    tmp = tmp_path_factory.mktemp("killed-launcher")
    args = ["--data", str(small_npz), "--nproc", "2", *LONG, "--epochs", "12"]
    launcher = _start(*args, "--output-dir", "run", cwd=tmp)
    run = tmp / "run"
    wait_for(lambda: len(list((run / "state").glob("step-*"))) >= 1 if (run / "state").is_dir() else False, 180,
              "a first checkpoint")
    workers = children(launcher.pid)
    assert len(workers) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    killed_at = time.time()
    again = _start(*args, "--output-dir", "run", cwd=tmp)  # no manual wait
    wait_for(lambda: not _alive(workers), 30, "the workers to go")
    gone_after = time.time() - killed_at
    out, _ = again.communicate(timeout=600)
    resumed = subprocess.CompletedProcess(again.args, again.returncode, out, out)
    whole = run_cli(*["train", *args, "--output-dir", "whole"], cwd=tmp, timeout=600)
    return tmp, gone_after, resumed, whole


@pytest.mark.slow
def test_workers_whose_launcher_is_killed_are_gone_within_30_seconds(killed_launcher):
    _, gone_after, _, _ = killed_launcher
    assert gone_after < 30


@pytest.mark.slow
def test_the_same_command_then_resumes_to_the_weights_of_a_run_never_interrupted(killed_launcher):
    tmp, _, resumed, whole = killed_launcher
    assert resumed.returncode == 0 and whole.returncode == 0, resumed.stderr[-2000:] + whole.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    a, b = load_file(tmp / "run" / "last.safetensors"), load_file(tmp / "whole" / "last.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


FIT = '''
import sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import scaletrain
g = torch.Generator().manual_seed(0)
x, y = torch.randn(2000, 1, 8, 8, generator=g), torch.randint(0, 3, (2000,), generator=g)
cfg = scaletrain.TrainConfig()
cfg.optim.epochs, cfg.optim.batch_size, cfg.run.checkpoint_every = 8, 16, 5
cfg.run.output_dir = sys.argv[1]
scaletrain.fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), TensorDataset(x, y), None, cfg)
'''


@pytest.mark.slow
def test_fit_under_torchrun_whose_agent_is_killed_is_resumed_by_the_next_torchrun_at_once(tmp_path):
    """The killed job's rank 0 holds the folder until it leaves; the next job waits for it instead of refusing."""
    (tmp_path / "fitme.py").write_text(FIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "fitme.py",
               "run"]
    first = start_python(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = tmp_path / "run" / "state"
    wait_for(lambda: state.is_dir() and any(state.glob("step-*")), 120, "a first checkpoint")
    first.send_signal(signal.SIGKILL)  # the agent: its workers are left to leave by themselves
    first.wait()
    again = run_python(command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "epoch 8/8" in again.stdout
