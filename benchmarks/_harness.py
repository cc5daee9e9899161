"""What every benchmark here shares: running a command as a whole process and reading it, contenders taking turns,
medians and ratios, one Markdown table and one JSON record with the machine and the commit, the environment of
the processes it starts, a function run in a process of its own, the bare loop, metrics.csv, and a checkout of an
earlier commit for A/B runs.

A benchmark script imports this module, `_data` and `_seeds` (its neighbours whose names start with `_`), the
scaletrain package and third-party packages, and no other script (tests/test_layout.py holds it to that).
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import inspect
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# scaletrain's per-epoch line (and the bare loop's, which prints the same): epoch, val accuracy, epoch seconds
EPOCH_LINE = r"^epoch (\d+)/\d+ .*val_accuracy ([\d.]+)\s+([\d.]+)s"
RESULT_MARK = "@result "  # a job's return value, on one stdout line
# a model file for --model FILE:make: timm's vit_tiny_patch16_224 cut to 4 blocks of 4 heads, patches of 4, at 32 px
VIT = '''import timm

def make(num_classes, in_chans):
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, num_heads=4, embed_dim=64,
                             num_classes=num_classes, in_chans=in_chans)
'''
_PEAK = ("import resource, subprocess, sys\n"
         "code = subprocess.call(sys.argv[1:])\n"
         "print(f'@peak_rss_kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
         "sys.exit(code)\n")


# -- the processes' environment ---------------------------------------------------------------------------------
def env(src: Path | None = None, **changes: str | None) -> dict[str, str]:
    """os.environ with `src` (this checkout's src/ unless given) first on PYTHONPATH, and `changes` applied (None
    removes a variable)."""
    out = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src or ROOT / "src"),
                                                                        os.environ.get("PYTHONPATH", "")]))}
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def launcher(nproc: int = 1) -> list[str]:
    """This Python (PYTHON_EXEC where set, as torch's launchers read it: a dry run's relay, gpu_suite.py), or
    torchrun with `nproc` processes on this machine."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [os.environ.get("PYTHON_EXEC") or sys.executable, *torchrun]


def scaletrain(*args: str, nproc: int = 1) -> list[str]:
    return [*launcher(nproc), "-m", "scaletrain", *args]


# -- a function of a benchmark run in a process of its own --------------------------------------------------------
def job(fn: Callable, nproc: int = 1, **kwargs: Any) -> list[str]:
    """The command that runs `fn(**kwargs)` (a function of a module of benchmarks/ that ends with `main(...)` naming
    it) in a fresh process, under torchrun for `nproc` > 1. What it returns comes back through Run.result()."""
    return [*launcher(nproc), inspect.getfile(fn), "--job", fn.__name__, json.dumps(kwargs)]


def main(entry: Callable[[], Any] | None, *jobs: Callable) -> None:
    """A script's `if __name__ == "__main__":`: `--job NAME KWARGS` runs one of `jobs` (see job()), else entry()."""
    if sys.argv[1:2] == ["--job"]:
        result = {j.__name__: j for j in jobs}[sys.argv[2]](**json.loads(sys.argv[3]))
        if result is not None and int(os.environ.get("RANK", "0")) == 0:
            print(RESULT_MARK + json.dumps(result), flush=True)
        return
    if entry is None:
        sys.exit(f"{sys.argv[0]} is run by the benchmarks (--job), not by hand")
    sys.exit(entry() or 0)


# -- running a command --------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One finished command: exit code, wall seconds from launch, each stdout line with the second it came at."""

    cmd: list[str]
    returncode: int
    seconds: float
    lines: list[tuple[float, str]]
    stderr: str
    peak_rss_mib: float | None = None  # the largest process's peak resident memory (run(memory=True))
    stopped: str = ""  # why it was stopped, if it was: "timeout", or the line that matched `stop`

    def first(self, pattern: str) -> float | None:
        """Seconds from launch to the first line matching `pattern` (the first step, say)."""
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def result(self) -> Any:
        """What the job returned (see job())."""
        return next((json.loads(line[len(RESULT_MARK):]) for _, line in reversed(self.lines)
                     if line.startswith(RESULT_MARK)), None)

    def tail(self, n: int = 1) -> str:
        text = (self.stderr.strip() or "\n".join(line for _, line in self.lines[-5:])).splitlines()
        return "\n".join(text[-n:])[-300 * n:]

    def check(self, what: str = "") -> Run:
        """This run, or SystemExit saying how it failed."""
        if self.returncode != 0 and self.stopped in ("", "timeout"):
            raise SystemExit(f"{what or ' '.join(self.cmd[:4])} exited {self.returncode}:\n{self.tail(20)}")
        return self


LIVE: set[int] = set()  # process groups of the commands running now


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to a command's process group (scaletrain saves and exits), SIGKILL `grace` seconds later."""
    for sig, wait_after in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_after
        while time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return


def stop_all_and_exit(signum: int, frame: Any) -> None:
    """A signal handler: the commands started here go too (each runs in a process group of its own)."""
    for pgid in list(LIVE):
        stop_group(pgid)
    os._exit(128 + signum)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float | None = None,
        grace: float = 5.0, log: Path | None = None, stop: str | Callable[[str], bool] | None = None,
        memory: bool = False, merge: bool = False) -> Run:
    """Run `cmd` in a process group of its own, timestamping its stdout lines (stderr too with `merge`). `stop`: a
    pattern or test of a line after which the command is stopped (SIGTERM, SIGKILL `grace` s later); `timeout`: the
    same after so many seconds; `memory`: measure the peak resident memory of its largest process; `log`:
    <log>.out (timestamped) and <log>.err are kept."""
    wanted = (lambda line: re.search(stop, line) is not None) if isinstance(stop, str) else stop
    full = [sys.executable, "-c", _PEAK, *cmd] if memory else cmd
    start = time.perf_counter()
    lines: list[tuple[float, str]] = []
    stopped = ""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(full, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1,
                                stderr=subprocess.STDOUT if merge else err, start_new_session=True)
        LIVE.add(proc.pid)
        watchdog = threading.Timer(timeout, stop_group, (proc.pid, grace)) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append((time.perf_counter() - start, line.rstrip("\n")))
                if wanted and not stopped and wanted(line):
                    stopped = line.strip()
                    threading.Thread(target=stop_group, args=(proc.pid, grace), daemon=True).start()
        finally:
            if watchdog:
                watchdog.cancel()
            proc.wait()
            LIVE.discard(proc.pid)
        seconds = time.perf_counter() - start
        err.seek(0)
        stderr = err.read()
    if timeout and seconds >= timeout and not stopped:
        stopped = "timeout"
    text = stderr + "".join(line + "\n" for _, line in lines) if merge else stderr
    peak = re.findall(r"@peak_rss_kib (\d+)", text)
    if log:
        Path(f"{log}.err").write_text(stderr)
        Path(f"{log}.out").write_text("".join(f"{t:8.2f} {line}\n" for t, line in lines))
    return Run(cmd, proc.returncode, seconds, lines, stderr, int(peak[-1]) / 1024 if peak else None, stopped)


# -- what a run says ----------------------------------------------------------------------------------------------
def metrics(folder: Path) -> list[dict[str, float]]:
    """A run folder's metrics.csv, one dict of floats per epoch."""
    with (Path(folder) / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def steady(rows: list[dict[str, float]], key: str = "images_per_second") -> float:
    """The median of `key` over the epochs after the first (warm-up, kernel selection), the first if alone."""
    return statistics.median(r[key] for r in (rows[1:] or rows))


def epochs(r: Run, pattern: str = EPOCH_LINE, percent: bool = False) -> list[dict[str, float]]:
    """The per-epoch lines of a run's output: `pattern`'s groups are epoch, val accuracy, training seconds."""
    return [{"epoch": int(m.group(1)), "val_accuracy": float(m.group(2)) / (100 if percent else 1),
             "train_seconds": float(m.group(3)), "wall_seconds": t} for t, line in r.lines
            if (m := re.search(pattern, line))]


def images_per_second(rows: list[dict[str, float]], images_per_epoch: int) -> float | None:
    """Training images/s over the epochs after the first, from per-epoch seconds."""
    seconds = [e["train_seconds"] for e in (rows[1:] or rows)]
    return images_per_epoch / statistics.median(seconds) if seconds else None


# -- taking turns, medians, ratios ----------------------------------------------------------------------------------
def turns(names: Iterable[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, name) for `rounds` rounds, the order reversed every other round, so that a machine's drift favours
    no contender."""
    names = list(names)
    for k in range(rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            yield k, name


def median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- one table, one record --------------------------------------------------------------------------------------
def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) >= 10 \
            else f"{v:.3f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(cell(x) for x in v)
    return str(v).replace("|", "/").replace("\n", " ")


def markdown(rows: list[dict]) -> str:
    """The rows as one Markdown table, their keys as its columns. (scaletrain.measure.bench.markdown_table is
    `scaletrain bench`'s fixed columns; these tables' columns are each benchmark's own.)"""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                     ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows])


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False).stdout.strip()


def commit(root: Path = ROOT) -> str:
    """The checkout's commit, with `+changes` when its tracked files differ from it."""
    changed = git("status", "--porcelain", "--untracked-files=no", cwd=root)
    return git("rev-parse", "--short", "HEAD", cwd=root) + ("+changes" if changed else "")


def machine() -> dict:
    """CPU model, cores, memory, GPUs and the versions that move the figures."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    memory = next((int(line.split()[1]) / 2**20 for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal")), None)
    gpus = []
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        gpus = [line.strip() for line in q.stdout.splitlines() if line.strip()] if q.returncode == 0 else []
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
        return None

    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(memory, 1) if memory else None, "gpus": gpus, "python": platform.python_version(),
            "torch": ver("torch"), "load_average": os.getloadavg()[0]}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def record(name: str, rows: list[dict], out: Path | str | None = None, title: str = "", shown: list[dict] | None = None,
           **extra: Any) -> Path:
    """Print `rows` (or `shown`, the same rows worded for reading) as one Markdown table under `title`, and write
    them, with the machine, the commit, the command and `extra`, as one JSON record: `out`, else
    results/<name>.json."""
    print(f"\n{title}\n" if title else "", markdown(shown or rows), sep="\n", flush=True)
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"benchmark": name, "date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine(),
            "command": " ".join(["python", *sys.argv]), **extra, "rows": rows}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"\nwrote {path}")
    return path


def work_dir(name: str, given: str | None = None, fresh: bool = True) -> Path:
    """A benchmark's work folder (run folders, logs, data it makes): `given`, else <tmp>/scaletrain-<name>;
    emptied first with `fresh` (a finished run folder would be refused)."""
    path = Path(given) if given else Path(tempfile.gettempdir()) / f"scaletrain-{name}"
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- A/B against an earlier commit --------------------------------------------------------------------------------
@contextlib.contextmanager
def checkout(rev: str, work: Path) -> Iterator[Path]:
    """A git worktree of `rev` under `work`, removed afterwards: run the same command with its src/ on PYTHONPATH
    (env(src=...)) beside this checkout's."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if not sha:
        raise SystemExit(f"no commit {rev!r} in {ROOT}")
    path = work / f"at-{sha[:10]}"
    git("worktree", "remove", "--force", str(path))
    shutil.rmtree(path, ignore_errors=True)
    made = subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    if made.returncode:
        raise SystemExit(f"git worktree add {rev}: {made.stderr.strip()}")
    try:
        yield path
    finally:
        git("worktree", "remove", "--force", str(path))


def same_weights(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold bitwise the same tensors."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# -- the bare loop: the model's own step, the limit a training path is measured against -----------------------------
def bare_loop(model: str, size: int, batch: int, images: int, epochs: int, opt: str = "adam",
              channels_last: bool = False, lr: float | None = None) -> None:
    """A timm model's training step on random tensors already at its size, shuffled, no augmentation; prints
    scaletrain's epoch line (EPOCH_LINE) with each epoch's seconds. Run it with job(bare_loop, ...)."""
    import timm
    import torch
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(images, 3, size, size), torch.randint(0, 10, (images,))
    net = timm.create_model(model, num_classes=10)
    if channels_last:
        net, x = net.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr or 5e-5) if opt == "adam" else \
        torch.optim.SGD(net.parameters(), lr=lr or 0.05, momentum=0.9, nesterov=True)
    net.train()
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        for idx in torch.randperm(images).split(batch):
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}/{epochs} bare val_accuracy 0 {time.perf_counter() - t0:.3f}s", flush=True)


if __name__ == "__main__":
    main(None, bare_loop)
