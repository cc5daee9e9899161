"""A stalled rank named by every process with its stack, and a rank that raises named on the others and in the
launcher's last line: real jobs of 2 processes on gloo, started by torchrun and by `scaletrain train --nproc 2`."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import free_port, run_cli, train_cli

# A user's own script: its Dataset's item 150 is corrupt (MODE=raise) or never returns (MODE=stall) on rank 1.
SCRIPT = textwrap.dedent('''
    import os
    import sys
    import time

    import torch
    from torch import nn
    from torch.utils.data import Dataset

    import scaletrain


    class Records(Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            if i == 150 and os.environ["RANK"] == "1":
                if os.environ["MODE"] == "raise":
                    raise ValueError(f"record {i} is corrupt")
                time.sleep(3600)
            return self.x[i], self.y[i]


    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers = 2, 16, 2
    cfg.run.output_dir, cfg.run.stall_timeout = sys.argv[1], 5
    try:
        scaletrain.fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), Records(400), Records(64), cfg)
    except Exception as e:  # each rank says what it caught
        print(f"rank {os.environ['RANK']} caught {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
''')


def _torchrun(tmp_path, mode: str):
    (tmp_path / "mine.py").write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "mine.py"), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "MODE": mode, "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - start


@pytest.mark.slow
def test_a_rank_stalled_in_the_users_getitem_is_named_by_every_process_with_the_workers_stack(tmp_path):
    proc, seconds = _torchrun(tmp_path, "stall")
    assert proc.returncode != 0 and seconds < 60, proc.stderr[-3000:]
    blocks = proc.stderr.split("scaletrain: rank 1 stalled: no progress for ")[1:]
    assert len(blocks) == 2, proc.stderr[-3000:]  # one from each process
    for block in blocks:
        assert "in phase 'reading data'" in block and "while the others wait for it (rank 0 in" in block
        assert "waiting for the batch of DataLoader worker" in block
        assert "in __getitem__" in block.split("whose stack is:")[1]  # the worker's own stack
        assert "scaletrain: error: rank 1 stalled in reading data; the job stops (exit 6)" in block
    assert "exitcode  : 6" in proc.stderr  # the first to leave exits with the stall's code (torchrun stops the rest)


@pytest.mark.slow
def test_a_rank_that_raises_is_named_on_the_other_rank_instead_of_the_connection_error(tmp_path):
    """Two processes started by hand (no launcher to stop rank 0 first), each catching what fit raises."""
    (tmp_path / "mine.py").write_text(SCRIPT)
    env = {**os.environ, "MODE": "raise", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "mine.py"), str(tmp_path / "run")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    out = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert "rank 1 caught ValueError: Caught ValueError in DataLoader worker process 1" in out[1]
    assert ("rank 0 caught RankFailed: rank 1 failed: ValueError: record 150 is corrupt (DataLoader worker process "
            "1) (this rank's collective operation broke as it left") in out[0]


BASE = ["--model", "tinycnn", "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "2", "--nproc", "2"]


@pytest.mark.slow
def test_a_stalled_rank_stops_the_job_with_exit_6_and_the_same_command_resumes(small_npz, tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    proc = train_cli(small_npz, out, *BASE, "--stall-timeout", "5", env={"SCALETRAIN_FAULT": "hang:5:1"}, expect=6)
    assert time.monotonic() - start < 60
    assert proc.stderr.strip().splitlines()[-1] == (
        "scaletrain: error: rank 1 stalled in optimizer step (no progress for 5 s, --stall-timeout 5); every rank "
        "printed its stack")
    assert proc.stderr.count('in after_batch') == 2  # the stalled rank's stack, printed by both processes
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-00000002", "step-00000004"]
    resumed = train_cli(small_npz, out, *BASE, "--stall-timeout", "5")
    assert "resuming from" in resumed.stdout and "optimizer step 4" in resumed.stdout
    assert [r["epoch"] for r in csv.DictReader((out / "metrics.csv").open())] == ["1", "2"]


@pytest.mark.slow
def test_the_launchers_last_line_names_the_rank_that_raised_and_its_exception(small_npz, tmp_path):
    proc = run_cli("train", "--data", str(small_npz), *BASE, "--output-dir", str(tmp_path / "run"),
                   env={"SCALETRAIN_FAULT": "raise:5:1"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "scaletrain: error: rank 1 failed: RuntimeError: fault injected after batch 5 (SCALETRAIN_FAULT=raise:5:1)")
    assert proc.stderr.count("scaletrain: error: rank 1 failed: RuntimeError: fault injected") == 2  # rank 0's too

