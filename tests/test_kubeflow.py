"""Kubeflow's PyTorchJob and TrainJob start `torchrun` with no flags in every pod and describe the job in PET_*
variables, which torchrun reads as its flags of the same names: scaletrain runs under exactly that."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import free_port, run_cli

TORCHRUN_NO_FLAGS = [sys.executable, "-m", "torch.distributed.run", "-m"]


@pytest.mark.slow
def test_torchrun_with_only_kubeflows_pet_variables_runs_a_two_process_job(small_npz, tmp_path):
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(free_port())}
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "1", "--batch-size", "16",
                   "--output-dir", str(out), launcher=TORCHRUN_NO_FLAGS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["val_samples"]) == (2, 101)
    assert proc.stdout.count("2 process(es) on 2 cpu device(s)") == 1, proc.stdout
