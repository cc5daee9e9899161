"""Elastic membership with torchrun: two agents on this machine act as two nodes (`--nnodes 1:2`, c10d rendezvous on
loopback). One node is killed mid-epoch (its agent and its worker), the other restarts smaller from the last
checkpoint and trains on; the node is started again, the job grows back at the next restart, and both finish."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import children, free_port, start_python, wait_for

# What elastic membership needs (docs/parallel.md): a store per rendezvous round, and keep-alives that notice a
# lost node within 5 s.
RDZV_CONF = "join_timeout=60,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"


def _kill_node(agent) -> None:
    """The whole node: its agent and its workers (torchrun starts each worker in a session of its own)."""
    groups = {agent.pid}
    for pid in children(agent.pid):  # the workers; each leads its own session, with its DataLoader workers
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    agent.wait()


def _worlds(out: Path) -> list[int]:
    lines = (out / "resumes.jsonl").read_text().splitlines() if (out / "resumes.jsonl").is_file() else []
    return [json.loads(line)["world_size"] for line in lines]


@pytest.mark.slow
def test_a_lost_node_shrinks_the_job_and_a_node_back_grows_it_and_it_finishes(mnist, tmp_path):
    from conftest import write_npz

    data = write_npz(tmp_path / "digits.npz", mnist, 1600, 200)
    out = tmp_path / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
           "--rdzv-conf", RDZV_CONF, "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "scaletrain", "train",
           "--data", str(data), "--model", "tinycnn", "--epochs", "10", "--batch-size", "16",
           "--checkpoint-every", "5", "--log-with", "none", "--output-dir", str(out)]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("a", "b", "b-again")]

    def node(log):
        return start_python(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, new_session=True)

    a = node(logs[0])  # started first: it hosts the rendezvous store, so the other one is the node to lose
    time.sleep(1)
    b = node(logs[1])
    try:
        wait_for(lambda: (out / "state").is_dir() and any((out / "state").glob("step-*")), 120,
                 "a checkpoint on 2 nodes")
        _kill_node(b)
        wait_for(lambda: _worlds(out)[-1:] == [1], 120, "the survivor resuming on its own")
        b = node(logs[2])
        wait_for(lambda: _worlds(out)[-1:] == [2], 120, "the job growing back to 2 nodes")
        assert a.wait(timeout=300) == 0 and b.wait(timeout=60) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for agent in (a, b):
            if agent.poll() is None:
                _kill_node(agent)
        for log in logs:
            log.close()
    assert _worlds(out) == [1, 2]
    assert [r["epoch"] for r in csv.DictReader((out / "metrics.csv").open())] == [str(e) for e in range(1, 11)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_batch_size"] == 32  # the run's own, kept on 1 node (16 x 2 accumulated)
    assert "continuing on 1 device(s) by 1 process(es): the global batch stays 32" in (tmp_path / "a.log").read_text()
