"""The all-reduce bandwidth between this machine's devices, measured in fresh processes (for `bench`)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..errors import UserError


def measure_allreduce_gbps(nbytes: int, repeats: int = 10) -> float:
    """Bus bandwidth (GB/s, as nccl-tests reports it: 2(N-1)/N x bytes / time) of an all-reduce of `nbytes`
    between this machine's GPUs, or between 2 CPU processes over gloo when there is no GPU.

    Runs in fresh processes through torch's launcher; the median of `repeats` timed all-reduces counts.
    """
    gpus = torch.cuda.device_count()
    if gpus == 1:
        raise UserError("--interconnect measure: one GPU has no link to measure; give a preset or a GB/s figure")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gbps")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={max(gpus, 2)}",
               "-m", "scaletrain.parallel.probe", str(nbytes), str(repeats), out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if proc.returncode != 0 or not os.path.exists(out):
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise UserError(f"--interconnect measure: the all-reduce probe failed ({last[:160]})")
        with open(out) as f:
            return float(f.read())


def _probe(nbytes: int, repeats: int, out: str) -> None:
    from .runtime import Runtime

    runtime = Runtime(cpu=torch.cuda.device_count() == 0)
    try:
        x = torch.ones(max(1, nbytes // 4), device=runtime.device)
        seconds = []
        for _ in range(repeats + 2):  # the first two set up connections and buffers
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.distributed.all_reduce(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        world = runtime.world_size
        gbps = 2 * (world - 1) / world * x.numel() * 4 / statistics.median(seconds[2:]) / 1e9
        if runtime.is_main:
            with open(out, "w") as f:
                f.write(repr(gbps))
    finally:
        runtime.end()


if __name__ == "__main__":
    _probe(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
