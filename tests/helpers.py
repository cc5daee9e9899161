"""Running scaletrain in a fresh process, as a user would; the digits as a user's own Dataset."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import Dataset


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None,
            module: str = "scaletrain", launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run scaletrain (or a launcher in front of it) in a fresh process, as a user would."""
    cmd = [*(launcher or [sys.executable, "-m"]), module, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


def train_cli(data, out, *args: str, env: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    """`scaletrain train --data DATA ... --output-dir OUT` in a fresh process, asserting its exit code."""
    proc = run_cli("train", "--data", str(data), *args, "--output-dir", str(out), env=env)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start scaletrain in the background (one of several processes of a job)."""
    return subprocess.Popen([sys.executable, "-m", "scaletrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                    **(env or {})})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, seconds: float, what: str) -> None:
    """Poll `condition()` every 0.2 s; fail naming `what` after `seconds`."""
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a launcher's workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if proc.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(proc.name))
    return found


class Digits(Dataset):
    """Items (1 x 28 x 28 float image in [0, 1], int label) of the embedded digits `start` to `stop` (`mnist`: the
    conftest fixture's ImageSet), as a user's own Dataset gives them."""

    def __init__(self, mnist, start, stop):
        self.x, self.y = mnist.images[start:stop].float() / 255, mnist.labels[start:stop]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

