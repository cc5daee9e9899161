"""Each process's intra-op threads fit its share of the usable cores, whatever OMP_NUM_THREADS says: real jobs of 2
processes under scaletrain's launcher and torchrun, with the variable set as clusters set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import run_cli
from scaletrain.parallel.threads import share, usable_cores

FAIR = share(2)  # one of 2 processes' share of this machine's usable cores
TOO_MANY = str(usable_cores())  # as a cluster exports it: the machine's core count, in every process


def test_the_usable_cores_follow_the_affinity_mask():
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from scaletrain.parallel.threads import share, usable_cores; print(usable_cores(), share(2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"]


@pytest.mark.slow
def test_an_oversubscribing_omp_num_threads_is_lowered_to_the_share_and_said_once(small_npz, tmp_path):
    proc = run_cli("train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "1", "--nproc", "2",
                   "--output-dir", str(tmp_path / "run"), env={"OMP_NUM_THREADS": TOO_MANY})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = (f"OMP_NUM_THREADS={TOO_MANY} asks 2 process(es) x {TOO_MANY} threads of {usable_cores()} usable core(s); "
            f"each process uses {FAIR} (set SCALETRAIN_KEEP_THREADS=1 to keep {TOO_MANY})")
    if int(TOO_MANY) > FAIR:
        assert proc.stdout.count(line) == 1, proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["threads_per_process"] == FAIR


SCRIPT = textwrap.dedent('''
    import os, sys, torch
    from scaletrain.parallel import Runtime
    Runtime(cpu=True)
    with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.txt"), "w") as f:  # (two ranks' stdout interleave)
        f.write(f"rank {os.environ['RANK']} threads {torch.get_num_threads()} omp {os.environ['OMP_NUM_THREADS']}")
''')


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["", "1"])
def test_every_process_under_torchrun_takes_its_share_unless_asked_to_keep(tmp_path, keep):
    (tmp_path / "threads.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "threads.py"), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": TOO_MANY, "SCALETRAIN_KEEP_THREADS": keep})
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = TOO_MANY if keep else str(FAIR)
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)] == [
        f"rank {r} threads {want} omp {want}" for r in (0, 1)]


class _Niceness(torch.utils.data.Dataset):
    """Each item: the scheduling priority (niceness) of the process that read it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(os.nice(0))]), 0


def test_data_workers_of_a_training_on_the_cpu_yield_the_cores_to_its_threads():
    from scaletrain.data.batches import LoaderBatches

    batches = LoaderBatches(_Niceness(), torch.device("cpu"), 4, train=True, rank=0, world=1, seed=0, num_workers=2)
    read = torch.cat([x for x, _ in batches.epoch(0)])
    batches.close()
    assert read.tolist() == [[19.0]] * 8  # the lowest priority, in every worker
    assert os.nice(0) != 19  # the training process keeps its own
