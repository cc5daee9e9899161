"""Running scaletrain in a fresh process, as a user would; the digits as a user's own Dataset."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import Dataset

import forkserver


def _target(cmd: list[str]) -> tuple[dict, list[str]] | None:
    """What the fork server runs for `cmd`: `python -m MODULE ARGS` or `python SCRIPT ARGS`; None for any other
    command line (a console script, interpreter flags)."""
    return forkserver.target_of(cmd[1:]) if cmd[0] == sys.executable else None


def start_python(cmd: list, env: dict | None = None, cwd: Path | None = None, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, new_session: bool = False):
    """Start `cmd` (sys.executable and its arguments) with OMP_NUM_THREADS=1 unless `env` says otherwise, its output
    as subprocess.Popen takes `stdout` and `stderr` (PIPE: read as text; DEVNULL; an open file), in a session of its
    own with `new_session`; used as a subprocess.Popen. Forked by this worker's fork server where it can be
    (tests/forkserver.py), else a fresh interpreter."""
    cmd = [str(c) for c in cmd]
    server = forkserver.server()
    relay = {"PYTHON_EXEC": server.relay} if server is not None else {}  # a launcher's workers forked too
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **relay, **(env or {})}
    target = _target(cmd)
    if target is not None and server is not None and server.accepts(full_env):
        return server.start(*target, env=full_env, cwd=cwd, stdout=stdout, stderr=stderr, new_session=new_session)
    forkserver.log_fresh(cmd, "no server" if server is None else "launcher or flags" if target is None else
                         f"command: {forkserver.differs(full_env, server.env)}")
    return subprocess.Popen(cmd, env=full_env, cwd=cwd, text=True, stdout=stdout, stderr=stderr,
                            start_new_session=new_session)


def run_python(cmd: list, timeout: float = 300, env: dict | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`cmd` run to its end as start_python starts it (subprocess.run with its output captured as text)."""
    proc = start_python(cmd, env, cwd)
    with proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None,
            module: str = "scaletrain", launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run scaletrain (or a launcher in front of it) in a fresh process, as a user would."""
    return run_python([*(launcher or [sys.executable, "-m"]), module, *args], timeout, env, cwd)


def train_cli(data, out, *args: str, env: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    """`scaletrain train --data DATA ... --output-dir OUT` in a fresh process, asserting its exit code."""
    proc = run_cli("train", "--data", str(data), *args, "--output-dir", str(out), env=env)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def start_cli(*args: str, env: dict | None = None):
    """Start scaletrain in the background (one of several processes of a job); used as a subprocess.Popen."""
    return start_python([sys.executable, "-m", "scaletrain", *args], env)


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


def digit_pngs(root: Path, mnist, rows) -> Path:
    """The embedded digits of `rows` saved as a class folder, root/<label>/<row>.png (lossless); `root`."""
    from PIL import Image

    for i in rows:
        folder = root / str(int(mnist.labels[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(mnist.images[i, 0].numpy()).save(folder / f"{i}.png")
    return root


class Digits(Dataset):
    """Items (1 x 28 x 28 float image in [0, 1], int label) of the embedded digits `start` to `stop` (`mnist`: the
    conftest fixture's ImageSet), as a user's own Dataset gives them."""

    def __init__(self, mnist, start, stop):
        self.x, self.y = mnist.images[start:stop].float() / 255, mnist.labels[start:stop]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

