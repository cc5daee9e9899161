"""The run folder and the files in it, each written atomically (temporary file, then os.replace), and reading
it back (`scaletrain report`).

A run folder explains itself: config.yaml (what was asked), metrics.csv (one row per epoch), best/last
.safetensors (weights plus what is needed to rebuild the model and its inputs), summary.json and curves.png.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
import yaml

from .errors import UserError

def metric_columns(row: dict[str, Any]) -> tuple[str, ...]:
    """A metrics row's columns: epoch, train_loss (and train_<name> for each named loss of a step), what
    validation measured (val_loss, val_accuracy for a classifier, val_<name> of the user's metrics; none without a
    validation set), lr, epoch_seconds, images_per_second, then the weight average's validation (ema_val_*, with
    --ema-decay). A stream's epochs say how many samples they trained on (train_samples)."""
    validation = tuple(k for k in row if k.startswith("val_") and k != "val_samples")
    parts = tuple(k for k in row if k.startswith("train_") and k not in ("train_loss", "train_samples"))
    counted = ("train_samples",) if "train_samples" in row else ()
    return ("epoch", "train_loss", *parts, *counted, *validation, "lr", "epoch_seconds", "images_per_second",
            *(k for k in row if k.startswith("ema_val_")))
META_KEY = "scaletrain"
# The version of what run folders, weights files and checkpoints hold: a newer one is refused by name, never misread.
FORMAT_VERSION = 1


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: the process's umask, restored at once


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Any]:
    """A binary file to write `path` through: a temporary file beside it, flushed to disk and renamed over `path`
    when the block ends, removed if it raises (`path` is then as it was)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would create it (mkstemp makes 0600)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 100) -> bytes:
    """A finished figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()


INITIAL_WEIGHTS = "initial.safetensors"  # --save-initial-weights: the weights training starts from
# safetensors' names for the dtypes a weights file holds
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def save_weights(path: Path | None, tensors, meta: dict[str, Any]) -> None:
    """Model weights as safetensors, with scaletrain's metadata (model, classes, preprocessing) as JSON, written
    tensor by tensor: the header first (every name, dtype and shape is known ahead), then each tensor as it is
    read, so no whole copy of the model is ever made. `tensors`: a state dict, or parallel.WholeTensors (every
    process calls this with it, in step; only the main process gives a `path`, the others send their pieces)."""
    if path is None:  # another process: its pieces sent when read (a state dict has none to send)
        for spec in getattr(tensors, "specs", ()):
            tensors.read(spec.name)
        return
    whole = tensors if hasattr(tensors, "specs") else _StateTensors(tensors)
    header: dict[str, Any] = {"__metadata__": {META_KEY: json.dumps({**meta, "format_version": FORMAT_VERSION})}}
    offset = 0
    for spec in whole.specs:
        size = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data begins 8-byte aligned, as safetensors writes it
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for spec in whole.specs:
            t = whole.read(spec.name).detach().to("cpu").contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


class _Spec(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _StateTensors:
    """A state dict read as parallel.WholeTensors is: `specs` in name order, `read(name)`."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.specs = [_Spec(k, v.dtype, tuple(v.shape)) for k, v in sorted(state.items())]

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]


def copy_file(source: Path, path: Path) -> None:
    """`source` copied to `path` atomically (the copy written beside it, then renamed)."""
    with atomic_file(path) as f, source.open("rb") as src:
        shutil.copyfileobj(src, f, 2**24)


def load_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a safetensors file written by `save_weights`: (state dict, metadata). Never unpickles anything."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise UserError(f"{path}: no such weights file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt headers and truncated data
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    check_format(meta.get("format_version", 1), path)
    return weights, meta


def check_format(version: int, where: Path | str) -> None:
    """Refuse what a newer scaletrain wrote: its files may mean something this one would read wrongly."""
    if version > FORMAT_VERSION:
        raise UserError(f"{where}: written by a newer scaletrain (format {version}; this one reads up to "
                        f"{FORMAT_VERSION}); upgrade scaletrain to read it")


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of a run's metrics.csv as numbers ([] when there is none yet)."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return [{k: (int(v) if k == "epoch" else float(v)) for k, v in row.items()} for row in csv.DictReader(f)]


def default_run_folder() -> str:
    """A new folder under runs/ named after the time, for a run given no --output-dir; made here, so that two jobs
    started in the same second get a folder each (runs/20261123-101500, runs/20261123-101500-2)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    path, k = base, 1
    while True:
        try:
            path.mkdir()
            return str(path)
        except FileExistsError:
            k += 1
            path = base.with_name(f"{base.name}-{k}")


# -- one job per run folder ------------------------------------------------------------------------------------
OWNER_FILE = ".job.json"  # who holds the run folder: host, pid, since when, the command; written once checks pass
WORKERS_LOCK = ".workers.lock"  # held shared by every worker of the job while it lives
SKIPPED_FILE = "skipped_samples.txt"  # what --skip-bad-samples left out


class RunClaim:
    """A job's hold on its run folder: an exclusive flock on the folder itself, which the kernel releases when the
    holder dies however it dies (no stale lock after SIGKILL or a power cut). A job may take it only while no
    worker of another job lives: every worker holds .workers.lock shared (see `hold_as_worker`)."""

    def __init__(self, path: Path, fd: int, created: bool):
        self.path, self.fd, self.created = path, fd, created
        self.recorded = False

    @classmethod
    def take(cls, path: str | Path, made: bool = False) -> "RunClaim":
        """Hold the run folder (made if missing), or refuse on one line naming the job that holds it; nothing in
        the folder is written either way. `made`: the caller made the folder for this job just before."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise UserError(f"--output-dir {path}: exists and is not a folder")
        created = made or not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise UserError(f"--output-dir {path}: cannot make or open it ({e.strerror})") from None
        try:
            if not _lock(fd) and not (_leaving(path) and _lock(fd, _waited(path, "the job that held it"))):
                raise BlockingIOError
            workers = path / WORKERS_LOCK
            if workers.exists():  # the workers of a job whose launcher is gone may still be leaving
                wfd = os.open(workers, os.O_RDONLY)
                try:
                    if not _lock(wfd) and not _lock(wfd, _waited(path, "the workers of the job that held it")):
                        raise BlockingIOError
                finally:
                    os.close(wfd)  # (closing releases it again)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"--output-dir {path}: another job is training into it ({_holder(path)}); wait for it "
                            f"to end, or choose another --output-dir") from None
        return cls(path, fd, created)

    def record(self, command: str) -> None:
        """Say who holds the folder (read by a job that is refused); written once every check has passed."""
        import socket

        self.recorded = True
        launched = "RANK" in os.environ and "LOCAL_RANK" in os.environ  # a worker: its launcher is its parent
        atomic_write_text(self.path / OWNER_FILE, json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "launcher": os.getppid() if launched else os.getpid(),
             "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}) + "\n")

    def release(self, failed: bool = False) -> None:
        """Let the folder go; with `failed`, one this claim made and that is still empty goes too."""
        if self.recorded:  # (a job killed before this leaves it; the next job's record replaces it)
            (self.path / OWNER_FILE).unlink(missing_ok=True)
        os.close(self.fd)
        if failed and self.created and {p.name for p in self.path.iterdir()} <= {WORKERS_LOCK}:
            (self.path / WORKERS_LOCK).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:
                pass


def this_command() -> str:
    """The command line of this process as its user typed it (`scaletrain train ...`, or the script's)."""
    import sys

    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "scaletrain"):
        program = "scaletrain"
    return " ".join([program, *sys.argv[1:]])


LEAVING_WAIT = 60.0  # seconds: a worker whose launcher died checkpoints at the next step and leaves within 15 s


def _lock(fd: int, wait: float = 0.0) -> bool:
    """Take an exclusive flock on `fd`, trying for up to `wait` seconds; whether it was taken."""
    import fcntl

    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _leaving(path: Path) -> bool:
    """Whether the folder's holder is a worker of this host whose launcher is gone (it is leaving: see
    parallel.launch.exit_with_launcher); a job whose launcher lives is not."""
    import socket

    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        if owner["host"] != socket.gethostname() or owner.get("launcher", owner["pid"]) == owner["pid"]:
            return False
        os.kill(owner["launcher"], 0)
        return False  # its launcher lives
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError):
        return False


def _waited(path: Path, who: str) -> float:
    """Say, on one line, that this job waits for a job that is leaving the folder, and for how long at most."""
    print(f"--output-dir {path}: {who} lost its launcher and is leaving; waiting up to {LEAVING_WAIT:.0f} s for it "
          f"to end, then resuming", flush=True)
    return LEAVING_WAIT


def _holder(path: Path) -> str:
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        return f"pid {owner['pid']} on host {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError):
        return "a job that has not finished its checks yet"


def hold_as_worker(path: str | Path) -> int:
    """Hold .workers.lock shared for as long as this process lives (returns its descriptor): while any worker of
    the job lives, no other job may take the folder, even when the launcher is gone."""
    import fcntl

    fd = os.open(Path(path) / WORKERS_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


class JobHold:
    """A job's hold on its run folder, owned by this one object from the job's first check to its workers' end.

    The first machine's launcher takes it before its checks (`launcher`), or, for a job another launcher started
    (torchrun, accelerate launch, srun, Ray), the job's main process does (`workers`). Whoever took it says who
    holds the folder in .job.json once the job's checks have passed (`checks_passed`), tells the workers it
    starts that the folder is held for them (`handed_on`, recorded in what the job settled), lists the samples
    --skip-bad-samples left out (`list_skipped`), and lets the folder go at the end, removing .job.json, and the
    folder itself when it made it for a job refused before anything was written into it. Every worker holds the
    workers' lock for as long as it lives (see `hold_as_worker`).
    """

    def __init__(self, path: Path | None, claim: RunClaim | None = None):
        self.path, self.claim = path, claim
        self.worker_fd: int | None = None  # this process's hold of the workers' lock, while it has one

    @property
    def handed_on(self) -> bool:
        """Whether the workers this process starts find the folder held for them."""
        return self.claim is not None

    @classmethod
    @contextlib.contextmanager
    def launcher(cls, run_dir: str | Path, node_rank: int = 0, made: bool = False) -> Iterator["JobHold"]:
        """The launcher's hold while the block runs: taken by the first machine's launcher for every machine (the
        others hold nothing themselves); `made`: the launcher made the folder (a new runs/<timestamp>)."""
        if node_rank != 0:
            yield cls(Path(run_dir))
            return
        claim = RunClaim.take(run_dir, made)
        try:
            yield cls(claim.path, claim)
        except BaseException:
            claim.release(failed=True)
            raise
        claim.release()

    @classmethod
    @contextlib.contextmanager
    def workers(cls, run_dir: str, runtime, held: "JobHold | bool" = False) -> Iterator["JobHold"]:
        """Every process's hold while the block runs. `held`: this job's launcher holds the folder (its JobHold,
        when training runs in the launcher's own process; True in the workers it started). Otherwise the main
        process takes it, and every process refuses at once, on one line from the main process, when another job
        holds it."""
        if not run_dir:  # the Python API's default: no run folder, nothing to hold
            yield cls(None)
            return
        if isinstance(held, JobHold) and held.worker_fd is not None:  # entered already (the worker, then fit)
            yield held
            return
        claim, error = None, None
        if runtime.is_main and not held:
            try:
                claim = RunClaim.take(run_dir)
            except UserError as e:
                error = str(e)
        if runtime.sum(torch.tensor([float(error is not None)], device=runtime.device)).item():
            raise UserError(error or "", quiet=not runtime.is_main)
        hold = held if isinstance(held, JobHold) else cls(Path(run_dir), claim)
        hold.worker_fd = hold_as_worker(run_dir)
        try:
            yield hold
        finally:
            os.close(hold.worker_fd)
            hold.worker_fd = None
            if claim is not None:
                claim.release()

    def checks_passed(self) -> None:
        """Say who holds the folder (.job.json), once, when this process took it."""
        if self.claim is not None and not self.claim.recorded:
            self.claim.record(this_command())

    def list_skipped(self, skipped: list[str]) -> None:
        """skipped_samples.txt: what --skip-bad-samples left out, written by the process holding the folder."""
        if skipped and self.claim is not None:
            listing = self.path / SKIPPED_FILE
            atomic_write_text(listing, "\n".join(skipped) + "\n")
            print(f"skipped {len(skipped)} bad sample(s), listed in {listing}", flush=True)


class RunFolder:
    """Writes a run's files; only the main process makes one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []

    def start(self, config: dict[str, Any], plan: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """config.yaml (the settings, then the batch plan derived from them) and the epochs done so far."""
        self.rows = [{k: r[k] for k in metric_columns(r)} for r in history]
        self.write_config({**config, "plan": plan})

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def append_metrics(self, row: dict[str, Any]) -> None:
        self.rows.append({k: row[k] for k in metric_columns(row)})
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=metric_columns(row), lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path / "metrics.csv", buf.getvalue())

    def end_epoch(self, row: dict[str, Any], weights: dict[str, torch.Tensor], meta: dict[str, Any],
                  best: bool) -> None:
        """An epoch's metrics row, last.safetensors, and best.safetensors when it is the best so far."""
        self.append_metrics(row)
        save_weights(self.path / "last.safetensors", weights, {**meta, "epoch": row["epoch"]})
        if best:  # the same bytes: copied, not gathered again
            copy_file(self.path / "last.safetensors", self.path / "best.safetensors")

    def end_epoch_average(self, row: dict[str, Any], weights: dict[str, torch.Tensor], meta: dict[str, Any],
                          best: bool) -> None:
        """The weight average's last_ema.safetensors, and best_ema.safetensors when its accuracy is the best."""
        save_weights(self.path / "last_ema.safetensors", weights, {**meta, "epoch": row["epoch"], "ema": True})
        if best:  # the same bytes: copied, not gathered again
            copy_file(self.path / "last_ema.safetensors", self.path / "best_ema.safetensors")

    def finish(self, summary: dict[str, Any], curves_title: str) -> None:
        """summary.json and curves.png."""
        self.write_summary(summary)
        write_curves(self.path, self.rows, curves_title)

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")


# -- reading it back --------------------------------------------------------------------------------------------
def curves_png(rows: list[dict[str, Any]], title: str = "") -> bytes:
    """Loss (train and validation) and the validation metrics (accuracy in %) against epoch, as a PNG."""
    epochs = [r["epoch"] for r in rows]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    if all("val_loss" in r for r in rows):
        ax1.plot(epochs, [r["val_loss"] for r in rows], marker="o", label="validation")
    ax1.set(xlabel="epoch", ylabel="loss", title="loss")
    measured = [k for k in rows[-1] if k.startswith("val_") and k not in ("val_loss", "val_samples")]
    for k in measured:
        if all(k in r for r in rows):
            scale = 100 if k == "val_accuracy" else 1
            ax2.plot(epochs, [scale * r[k] for r in rows], marker="o", label=k[len("val_"):],
                     color="tab:green" if k == "val_accuracy" else None)
    ax2.set(xlabel="epoch", ylabel="validation accuracy (%)" if measured == ["val_accuracy"] else "validation",
            title="accuracy" if measured == ["val_accuracy"] else "validation metrics")
    if len(measured) > 1 or measured[:1] not in ([], ["val_accuracy"]):
        ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax1.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return png_bytes(fig)


def write_curves(run_dir: Path, rows: list[dict[str, Any]], title: str = "") -> Path:
    path = Path(run_dir) / "curves.png"
    atomic_write_bytes(path, curves_png(rows, title))
    return path


def curves_title(model: str, devices: int) -> str:
    return f"{model}, {devices} device(s)"


def report(run_dir: Path) -> tuple[str, Path]:
    """What `scaletrain report` prints (the run's settings, each epoch, the outcome), and curves.png drawn
    again from the same metrics."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise UserError(f"{run_dir}: no metrics.csv with any epoch; not a scaletrain run folder, or not "
                        f"one epoch done yet")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    lines = [f"run {run_dir}"]
    if summary:
        lines.append(f"model {summary.get('model')}, {summary.get('train_samples')} training samples, "
                     f"{summary.get('world_size')} process(es) on {summary.get('device')}, precision "
                     f"{summary.get('mixed_precision')}, global batch {summary.get('global_batch_size', '?')}, "
                     f"{summary.get('total_seconds', 0):.1f} s")
    else:
        lines.append("unfinished: no summary.json yet (resume it with scaletrain train --resume RUN_DIR)")
    measured = [k for k in rows[-1] if k.startswith("val_")] or ["val_loss", "val_accuracy"]
    lines += ["", "| epoch | train loss | " + "".join(f"{k.replace('_', ' ')} | " for k in measured)
              + "lr | seconds | images/s |",
              "|---|---|" + "---|" * len(measured) + "---|---|---|"]
    for r in rows:
        lines.append(f"| {r['epoch']} | {r['train_loss']:.4f} | "
                     + "".join(f"{r.get(k, float('nan')):.4f} | " for k in measured)
                     + f"{r['lr']:.3g} | {r['epoch_seconds']:.1f} | {r['images_per_second']:,.0f} |")
    monitor = summary.get("monitor") or next((k for k in ("val_accuracy", "val_loss") if k in rows[-1]), None)
    if monitor and all(monitor in r for r in rows):
        best = next((r for r in rows if r["epoch"] == summary.get("best_epoch")), None) or (
            max if monitor == "val_accuracy" else min)(rows, key=lambda r: r[monitor])
        lines += ["", f"best {monitor.replace('_', ' ')} {best[monitor]:.4f} at epoch {best['epoch']}; "
                      f"final {rows[-1][monitor]:.4f}"]
    else:
        lines += ["", "trained without validation"]
    title = curves_title(summary["model"], summary.get("devices", summary["world_size"])) if summary else ""
    try:
        curves = write_curves(run_dir, rows, title)
    except OSError as e:
        raise UserError(f"{run_dir}: cannot write curves.png there ({e.strerror})") from None
    return "\n".join(lines), curves
