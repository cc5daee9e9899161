"""A stalled rank named by every process with its stack, and a rank that raises named on the others and in the
launcher's last line: real jobs of 2 processes on gloo, started by torchrun and by `scaletrain train --nproc 2`."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import free_port, run_cli, start_python, train_cli

# A user's own script that stalls on rank 1 (or where MODE says): its Dataset's __getitem__ never returns (MODE
# getitem with num_workers 0, getitem-workers in a DataLoader worker, getitem-both on both ranks, validation in the
# validation set's), its model's forward sleeps (forward) or calls C code that holds the GIL (gil), its step's
# all_reduce on a group of its own runs on rank 0 only (skipped), the checkpoint's write never returns (checkpoint);
# MODE raise: item 150 on rank 1 is corrupt. It says "stalling at <time>" on stderr as the stall begins.
SCRIPT = textwrap.dedent('''
    import ctypes
    import ctypes.util
    import os
    import sys
    import time

    import torch
    from torch import nn
    from torch.utils.data import Dataset

    MODE, RANK = os.environ["MODE"], int(os.environ["RANK"])
    if MODE == "checkpoint" and RANK == 1:  # the checkpoint's write never returns (a hung filesystem)
        import safetensors.torch

        def hung_write(*args, **kwargs):
            print(f"stalling at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(3600)

        safetensors.torch.save_file = hung_write

    import scaletrain


    def stall():
        print(f"stalling at {time.time():.3f}", file=sys.stderr, flush=True)
        if MODE == "gil":  # a C call that holds the GIL
            ctypes.PyDLL(ctypes.util.find_library("c")).sleep(3600)
        time.sleep(3600)


    class Records(Dataset):
        def __init__(self, n, stalls):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
            self.stalls, self.calls = stalls, 0

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            self.calls += 1
            if MODE == "raise" and i == 150 and RANK == 1:
                raise ValueError(f"record {i} is corrupt")
            if self.stalls and self.calls == 40 and (RANK == 1 or MODE == "getitem-both"):
                stall()
            return self.x[i], self.y[i]


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.calls = nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), 0

        def forward(self, x):
            self.calls += self.training
            if MODE in ("forward", "gil") and self.calls == 5 and RANK == 1:
                stall()
            return self.body(x)


    class Skips(scaletrain.Step):
        calls, group = 0, None

        def train_step(self, model, batch):
            x, y = batch
            if Skips.group is None:  # a group of its own, made by every rank at its first batch
                Skips.group = torch.distributed.new_group()
            Skips.calls += 1
            if Skips.calls == 5 and RANK == 0:
                print(f"stalling at {time.time():.3f}", file=sys.stderr, flush=True)
                torch.distributed.all_reduce(torch.ones(1), group=Skips.group)  # rank 1 never enters it
            return nn.functional.cross_entropy(model(x), y)


    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.run.checkpoint_every = 2, 16, 4
    cfg.data.num_workers = 2 if MODE in ("getitem-workers", "raise") else 0
    cfg.run.output_dir, cfg.run.stall_timeout = sys.argv[1], float(os.environ.get("STALL_TIMEOUT", "5"))
    try:
        scaletrain.fit(Net(), Records(400, MODE.startswith("getitem")), Records(64, MODE == "validation"), cfg,
                       step=Skips() if MODE == "skipped" else None)
    except Exception as e:  # each rank says what it caught
        print(f"rank {os.environ['RANK']} caught {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
''')


# Workers in fresh interpreters, not forked by the tests' server (tests/forkserver.py): the script replaces
# safetensors' save_file before it imports scaletrain, which a worker forked after scaletrain's import would not see;
# and a stall that holds the GIL has every thread's stack dumped, the fork's own lifeline thread among them.
FRESH_WORKERS = ("checkpoint", "gil")


def torchrun_stall(tmp_path, mode: str, stall_timeout: float = 5) -> tuple[int, str, float]:
    # The script under torchrun: (its exit code, its stderr, seconds from the stall's beginning to the block).
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    proc = start_python([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         str(script), str(tmp_path / "run")], stdout=subprocess.DEVNULL,
                        env={"MODE": mode, "STALL_TIMEOUT": str(stall_timeout),
                             **({"SCALETRAIN_TEST_FRESH_WORKERS": "1"} if mode in FRESH_WORKERS else {})})
    lines, stalled, named = [], None, None
    for line in proc.stderr:  # read as it comes: when each line arrived
        lines.append(line)
        if stalled is None and line.startswith("stalling at "):
            stalled = float(line.split()[-1])
        # the block's first line (anywhere in a line: a C++ warning of another process, written in pieces, can
        # still end after the block began)
        if named is None and ("scaletrain: rank " in line or "scaletrain: the job is stuck" in line):
            named = time.time()
    proc.wait(timeout=60)
    text = "".join(lines)
    assert stalled is not None and named is not None, text[-3000:]
    return proc.returncode, text, named - stalled


# mode: (the rank named, the user's function named as where it is, what its stack shows)
PLACES = {
    "getitem": (1, "stall", "in __getitem__"),  # num_workers 0: rank 0 waits in DDP's forward
    "getitem-workers": (1, "stall", "waiting for the batch of DataLoader worker"),
    "forward": (1, "stall", "in forward"),
    "skipped": (0, "train_step", "in all_reduce"),
    "validation": (1, "stall", "in __getitem__"),
    "checkpoint": (1, "hung_write", "in _save"),
    "gil": (1, "stall", "dumped by faulthandler, as no Python thread of it runs"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", PLACES)
def test_a_stall_is_named_with_the_stalled_ranks_stack_wherever_it_happens(tmp_path, mode):
    code, stderr, seconds = torchrun_stall(tmp_path, mode)
    rank, function, stack = PLACES[mode]
    assert code != 0 and "exitcode  : 6" in stderr, stderr[-3000:]
    assert seconds <= 5 + 15, seconds
    block = stderr.split(f"scaletrain: rank {rank} stalled: no progress for ")[1:]
    assert len(block) == 1, stderr[-3000:]  # one block, from the process that saw the stall
    # whole, before any process's one-line error (they wait for it): no line of theirs inside it
    assert stderr.index(f"scaletrain: rank {rank} stalled: no") < stderr.index("scaletrain: error: "), stderr[-3000:]
    assert "scaletrain: error: " not in block[0].split("What to do: ")[0]
    head, rest = block[0].split("\n", 1)
    assert "mine.py:" in head and head.endswith(f" in {function}."), head  # the innermost frame of the user's code
    assert f"The others wait for it: rank {1 - rank} in " in rest
    stalled, waiting = rest.split(f"Rank {1 - rank}'s stack (waiting)")
    assert stack in stalled, stalled[:3000]
    assert "What to do: " in waiting and "raise --stall-timeout" in waiting
    # one line from each process (not from one whose Python threads do not run)
    assert stderr.count(f"scaletrain: error: rank {rank} stalled in ") == (1 if mode == "gil" else 2)


@pytest.mark.slow
def test_a_job_stuck_as_a_whole_names_every_rank_with_its_stack(tmp_path):
    code, stderr, seconds = torchrun_stall(tmp_path, "getitem-both")
    assert code != 0 and seconds <= 5 + 15
    assert "scaletrain: the job is stuck: no rank has made progress for " in stderr
    for rank in (0, 1):
        assert f"scaletrain: rank {rank} stalled: no progress for " in stderr
        assert f"Rank {rank}'s stack (stalled)" in stderr
    assert ("scaletrain: error: the job is stuck, every rank stalled (rank 0 in reading data, rank 1 in reading data)"
            "; the job stops (exit 6)") in stderr


@pytest.mark.slow
def test_a_rank_that_raises_is_named_on_the_other_rank_instead_of_the_connection_error(tmp_path):
    """Two processes started by hand (no launcher to stop rank 0 first), each catching what fit raises."""
    (tmp_path / "mine.py").write_text(SCRIPT)
    env = {"MODE": "raise", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [start_python([sys.executable, tmp_path / "mine.py", tmp_path / "run"],
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
        "scaletrain: error: rank 1 stalled in optimizer step (no progress for 5 s, --stall-timeout 5); every rank's "
        "stack is printed above")
    assert proc.stderr.count('in after_batch') == 1  # the stalled rank's stack, in the one block
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

