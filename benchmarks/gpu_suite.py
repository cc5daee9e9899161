"""One command that checks scaletrain's GPU path and reports everything at once: correctness on CUDA, speed against
seed 000's own script, the memory estimate against the CUDA allocator, and several GPUs when present.

The checks are pytest tests (benchmarks/test_gpu_rows.py, marker `gpu`, one test per check of CHECKS below; its
conftest.py holds the options and the report); this script installs what the machine lacks and runs them with
pytest. Every check runs in a process of its own with its own time limit, so a crash or a hang is one failed row,
not a lost report. The whole suite keeps to a time budget (9 minutes): a check that cannot start inside it is
reported as skipped. It prints one Markdown table (section, check, figure, verdict) and writes the same as JSON:
{"meta": {gpu, driver, torch, cuda, date, ...}, "rows": [{section, check, figure, verdict, reason}]}. Verdicts:
pass and fail (against the bound the row states), measured (no bound), skipped (with the reason).

    python benchmarks/gpu_suite.py                   # on a GPU machine; JSON under benchmarks/results/
    python benchmarks/gpu_suite.py --dry-run         # every check with tiny sizes on the CPU (part of the tests)
    python benchmarks/gpu_suite.py --only default,memory-resnet50 --out suite.json
    python benchmarks/gpu_suite.py --stage           # copy what a GPU machine lacks into .carry/ (git-ignored)
    pytest benchmarks/test_gpu_rows.py -m gpu        # the same checks run by pytest directly, on a GPU machine

A GPU machine gets a copy of the repository only. The speed rows that run seed 000's script need the script and
albumentations, and scaletrain needs matplotlib, which that machine's image may lack: `--stage` copies the script
and the albumentations wheels from ../shared into `.carry/` and downloads matplotlib's and pytest's wheels for its
Python; carry
`.carry` along, and the suite installs from it, into its work folder, whatever is missing there (pip, no index).
It puts `src` on PYTHONPATH for every process it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = HERE / "test_gpu_rows.py"  # the checks as pytest tests, one per check (marker gpu)
CARRY = ROOT / ".carry"
SHARED = ROOT.parent / "shared"
VERDICTS = ("pass", "fail", "skipped", "measured")
BUDGET_SECONDS = 540.0  # the whole suite on a GPU machine: 9 minutes, inside a 10-minute command
DRY_BUDGET_SECONDS = 600.0  # a dry run stops no check for time; the tests hold it to its own timeout


# -- what one row says --------------------------------------------------------------------------------------------
@dataclass
class Row:
    section: str
    check: str
    figure: str = ""
    verdict: str = ""
    reason: str = ""


class Skip(Exception):
    """This row cannot be measured here; the message says why."""


class Failed(Exception):
    """This row's bound was missed or its command failed; the message says how."""


@dataclass
class Ctx:
    """What every check is told: where to work, what hardware there is, how big to make things."""

    dry: bool
    gpus: int
    work: Path
    env: dict[str, str]
    peers: str | None  # the folder holding seed000_accelerate.py, or None
    peer_unavailable: str  # why seed 000's script cannot run here ("" when it can)

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    def no_cuda_reason(self) -> str:
        return "dry run on the CPU" if self.dry else "no CUDA GPU on this machine"

    def gpus_text(self) -> str:
        """'no GPU', '1 GPU', '3 GPUs': for rows that need more GPUs than there are."""
        return f"{self.gpus or 'no'} GPU{'s' if self.gpus > 1 else ''}"


class Sink:
    """A check's rows, each appended to a JSON-lines file as soon as it is known."""

    def __init__(self, path: Path, titles: dict[str, str]):
        self.path, self.titles = path, titles

    @contextlib.contextmanager
    def row(self, title: str) -> Iterator[Row]:
        """Fill the yielded row; an exception inside marks it failed (Failed, or any error) or skipped (Skip)."""
        row = Row(self.titles[title], title)
        try:
            yield row
        except Skip as e:
            row.verdict, row.reason = "skipped", str(e)
        except Failed as e:
            row.verdict, row.reason = "fail", str(e)
        except Exception as e:  # a broken check is a failed row with the error, never a lost report
            row.verdict, row.reason = "fail", f"{type(e).__name__}: {e}".splitlines()[0][:400]
            traceback.print_exc()
        if row.verdict not in VERDICTS:
            row.verdict, row.reason = "fail", "the check gave this row no verdict"
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(row)) + "\n")


def judged(row: Row, ok: bool, bound: str) -> None:
    """pass or fail against a stated bound."""
    row.verdict = "pass" if ok else "fail"
    row.reason = bound if ok else f"outside the bound: {bound}"


def judged_accuracy(row: Row, run_: "Trained", floor: float, where: str = "") -> None:
    """pass when the run's best validation accuracy reaches the workload's floor."""
    judged(row, run_.best >= floor, f"best val accuracy >= {floor:.0%}" + (f" on {where}" if where else ""))


def cuda_only(ctx: Ctx, row: Row) -> None:
    """In a run without CUDA a CUDA row is skipped; its figure, if any, is what its code did on the CPU."""
    row.verdict = "skipped"
    row.reason = f"needs CUDA ({ctx.no_cuda_reason()})" + ("; the figure is from its code run on the CPU"
                                                         if row.figure else "")


# -- running commands -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One finished command: exit code, wall seconds, stdout lines with the second each was printed at."""

    cmd: list[str]
    returncode: int
    seconds: float
    lines: list[tuple[float, str]]
    stderr: str

    def tail(self) -> str:
        text = (self.stderr.strip() or "\n".join(line for _, line in self.lines[-5:])).splitlines()
        return text[-1][:300] if text else ""


_LIVE: set[int] = set()  # process groups of the commands running now


def _stop(pgid: int, grace: float = 5.0) -> None:
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
            except ProcessLookupError:  # the whole group is gone
                return


def _stop_commands_and_exit(signum, frame) -> None:
    """A check told to stop takes the commands it started with it (each runs in a process group of its own)."""
    for pgid in list(_LIVE):
        _stop(pgid)
    os._exit(128 + signum)


def run(ctx: Ctx, cmd: list[str], name: str, env: dict[str, str] | None = None, timeout: float = 600,
        grace: float = 5.0) -> Run:
    """Run `cmd` in the work folder, timestamping its output lines; stderr goes to <name>.err as well."""
    start = time.perf_counter()
    err_path = ctx.work / f"{name}.err"
    lines: list[tuple[float, str]] = []
    with err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ctx.work, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**ctx.env, **(env or {})}, start_new_session=True)
        _LIVE.add(proc.pid)
        # A command that hangs silently is stopped on time too, with everything it started.
        watchdog = threading.Timer(timeout, _stop, (proc.pid, grace))
        watchdog.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append((time.perf_counter() - start, line.rstrip("\n")))
        finally:
            watchdog.cancel()
            proc.wait()
            _LIVE.discard(proc.pid)
    (ctx.work / f"{name}.out").write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines) + "\n")
    return Run(cmd, proc.returncode, time.perf_counter() - start, lines, err_path.read_text())


def scaletrain(ctx: Ctx, name: str, *args: str, env: dict[str, str] | None = None, expect: int | None = 0) -> Run:
    r = run(ctx, [sys.executable, "-m", "scaletrain", *args], name, env)
    if expect is not None and r.returncode != expect:
        raise Failed(f"`scaletrain {' '.join(args[:1])}` ({name}) exited {r.returncode}: {r.tail()}")
    return r


@dataclass
class Trained:
    """A finished `scaletrain train`: its run folder, summary, metrics rows and the command's timing."""

    folder: Path
    summary: dict
    metrics: list[dict]
    run: Run

    @property
    def best(self) -> float:
        return self.summary["best_val_accuracy"]

    @property
    def train_seconds(self) -> float:
        return sum(m["epoch_seconds"] for m in self.metrics)

    def steady_images_per_second(self) -> float:
        """Training images/s over the epochs after the first (warm-up, kernel selection, compilation)."""
        rates = [m["images_per_second"] for m in self.metrics[1:]] or [self.metrics[0]["images_per_second"]]
        return statistics.median(rates)

    def describe(self) -> str:
        return (f"best {self.best:.2%}, final {self.summary['final_val_accuracy']:.2%}, training "
                f"{self.train_seconds:.1f} s, whole command {self.run.seconds:.1f} s")


def train(ctx: Ctx, name: str, *args: str, env: dict[str, str] | None = None, reuse: bool = False) -> Trained:
    """`scaletrain train ARGS --output-dir <work>/<name>`; with `reuse`, a finished run of that name is read back."""
    folder = ctx.work / name
    if reuse and (folder / "summary.json").exists():
        saved = json.loads((ctx.work / f"{name}.run.json").read_text())
        return Trained(folder, json.loads((folder / "summary.json").read_text()), _metrics(folder),
                       Run(saved["cmd"], 0, saved["seconds"], [tuple(x) for x in saved["lines"]], ""))
    if folder.exists():
        shutil.rmtree(folder)
    r = scaletrain(ctx, name, "train", *args, "--output-dir", str(folder), env=env)
    (ctx.work / f"{name}.run.json").write_text(json.dumps({"cmd": r.cmd, "seconds": r.seconds, "lines": r.lines}))
    return Trained(folder, json.loads((folder / "summary.json").read_text()), _metrics(folder), r)


def _metrics(folder: Path) -> list[dict]:
    """metrics.csv's rows, as scaletrain.runfolder.read_metrics reads them, without importing torch into a check
    that only runs commands."""
    with (folder / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


# -- workloads ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The training job a group of checks runs: full size on a GPU, tiny in a dry run."""

    args: tuple[str, ...]
    accuracy_floor: float  # best validation accuracy the run must reach
    precision_tolerance: float  # largest drop of best accuracy from fp32 to fp16/bf16


def digits(ctx: Ctx) -> Workload:
    """The default run on the embedded digits; in a dry run, 1,000 of them and a tiny CNN."""
    if not ctx.dry:
        return Workload(("--data", "default"), 0.99, 0.003)
    return Workload(("--data", str(dry_digits(ctx)), "--model", "tinycnn", "--epochs", "3", "--batch-size", "32"),
                    0.6, 0.10)


def dry_digits(ctx: Ctx) -> Path:
    path = ctx.work / "digits-1000.npz"
    if not path.exists():
        import numpy as np

        from scaletrain.data import embedded_mnist

        m = embedded_mnist()
        x, y = m.images[:, 0].numpy(), m.labels.numpy()
        np.savez(path, images=x[:1000], labels=y[:1000], val_images=x[1000:1200], val_labels=y[1000:1200])
    return path


def kaggle_digits(ctx: Ctx) -> Path:
    """The embedded digits as a Kaggle digit-recognizer folder (train.csv 80 %, test.csv 20 %), the format seed
    000's script reads; in a dry run, 1,000 of them."""
    folder = ctx.work / "digit-recognizer"
    if (folder / "sample_submission.csv").exists():
        return folder
    import numpy as np

    from scaletrain.data import embedded_mnist

    m = embedded_mnist()
    order = np.random.default_rng(0).permutation(len(m.labels))[: 1000 if ctx.dry else None]
    x, y = m.images[:, 0].numpy().reshape(len(m.labels), -1)[order], m.labels.numpy()[order]
    n = len(order) * 4 // 5
    folder.mkdir(parents=True, exist_ok=True)
    pixels = ",".join(f"pixel{i}" for i in range(x.shape[1]))
    np.savetxt(folder / "train.csv", np.column_stack([y[:n], x[:n]]), fmt="%d", delimiter=",",
               header="label," + pixels, comments="")
    np.savetxt(folder / "test.csv", x[n:], fmt="%d", delimiter=",", header=pixels, comments="")
    ids = np.arange(1, len(x) - n + 1)
    np.savetxt(folder / "sample_submission.csv", np.column_stack([ids, 0 * ids]), fmt="%d", delimiter=",",
               header="ImageId,Label", comments="")
    return folder


@dataclass(frozen=True)
class SpeedJob:
    """A photo-sized training job for throughput: synthetic 3-channel images, a timm model, bf16."""

    model: str
    size: int
    batch: int
    train_images: int
    epochs: int


def speed_job(ctx: Ctx) -> SpeedJob:
    return SpeedJob("test_resnet", 32, 32, 256, 2) if ctx.dry else SpeedJob("resnet50", 224, 128, 3072, 4)


def speed_data(ctx: Ctx, job: SpeedJob) -> Path:
    """Random uint8 images of the job's size (content does not matter for throughput), 10 classes."""
    path = ctx.work / f"photos-{job.size}.npz"
    if not path.exists():
        import numpy as np

        rng = np.random.default_rng(0)
        n, val = job.train_images, job.batch * 2
        np.savez(path, images=rng.integers(0, 256, (n, job.size, job.size, 3), dtype=np.uint8),
                 labels=rng.integers(0, 10, n), val_images=rng.integers(0, 256, (val, job.size, job.size, 3),
                                                                         dtype=np.uint8),
                 val_labels=rng.integers(0, 10, val))
    return path


def speed_args(ctx: Ctx, job: SpeedJob) -> list[str]:
    return ["--data", str(speed_data(ctx, job)), "--model", job.model, "--batch-size", str(job.batch),
            "--epochs", str(job.epochs), "--mixed-precision", "bf16", "--augment", "none", "--optimizer", "sgd",
            "--lr", "0.01"]


# -- correctness ----------------------------------------------------------------------------------------------
def check_default(ctx: Ctx, out: Sink) -> None:
    w = digits(ctx)
    run_ = None
    with out.row("default run (fp32)") as row:
        run_ = train(ctx, "default-fp32", *w.args)
        row.figure = run_.describe()
        device = run_.summary["device"]
        if ctx.cuda and device != "cuda":
            raise Failed(f"trained on {device}, not on the GPU")
        judged_accuracy(row, run_, w.accuracy_floor, device)
    with out.row("time to 99 % val accuracy (embedded digits)") as row:
        if run_ is None:
            raise Failed("the default run failed")
        reached = [(m, t) for m in run_.metrics for t, line in run_.run.lines
                   if line.startswith(f"epoch {int(m['epoch'])}/") and m["val_accuracy"] >= 0.99]
        if not reached:
            raise Skip(f"99 % not reached (best {run_.best:.2%})" + (" in the dry run's 3 tiny epochs"
                                                                   if ctx.dry else ""))
        m, t = reached[0]
        upto = sum(x["epoch_seconds"] for x in run_.metrics if x["epoch"] <= m["epoch"])
        row.figure = f"epoch {int(m['epoch'])}: {upto:.1f} s training, {t:.1f} s whole command"
        row.verdict = "measured"


def check_precisions(ctx: Ctx, out: Sink) -> None:
    w = digits(ctx)
    base = train(ctx, "default-fp32", *w.args, reuse=True)
    for precision, title in (("fp16", "fp16 (loss scaler) vs fp32"), ("bf16", "bf16 vs fp32")):
        with out.row(title) as row:
            if precision == "fp16" and not ctx.cuda:
                raise Skip(f"fp16 needs a GPU ({ctx.no_cuda_reason()})")
            low = train(ctx, f"default-{precision}", *w.args, "--mixed-precision", precision)
            gap = base.best - low.best
            row.figure = f"best {low.best:.2%} vs {base.best:.2%} ({-gap * 100:+.2f} points); {low.describe()}"
            judged(row, round(gap, 6) <= w.precision_tolerance,  # accuracies are counts/n: no float residue
                   f"at most {w.precision_tolerance * 100:.1f} points below fp32"
                   + (" (dry run: 200 validation images)" if ctx.dry else ""))


def check_dp(ctx: Ctx, out: Sink) -> None:
    """DataParallel over every GPU, in fp32 and in bf16 (each replica runs in a thread of its own, where autocast
    must still be bf16)."""
    w = digits(ctx)
    for precision in ("no", "bf16"):
        with out.row(f"--strategy dp on every GPU, {'fp32' if precision == 'no' else precision}") as row:
            if precision != "no" and not ctx.cuda:  # on the CPU it would be the bf16 row above it again
                raise Skip(f"needs CUDA ({ctx.no_cuda_reason()}): replicas in threads exist only on GPUs")
            r = train(ctx, f"dp-{precision}", *w.args, "--strategy", "dp", "--mixed-precision", precision)
            row.figure = f"{r.summary['devices']} {r.summary['device']} device(s); {r.describe()}"
            if not ctx.cuda:
                cuda_only(ctx, row)
            elif r.summary["devices"] != ctx.gpus:
                raise Failed(f"drove {r.summary['devices']} GPU(s) of {ctx.gpus}")
            else:
                judged_accuracy(row, r, w.accuracy_floor, f"{ctx.gpus} GPU(s)")


def check_fsdp(ctx: Ctx, out: Sink) -> None:
    w = digits(ctx)
    for n in (1, 2):
        with out.row(f"--strategy fsdp, {n} process{'es' if n > 1 else ''} (NCCL)") as row:
            if n > max(ctx.gpus, 1):
                raise Skip(f"{ctx.gpus_text()}: not measured")
            r = train(ctx, f"fsdp{n}", *w.args, "--strategy", "fsdp", "--nproc", str(n))
            row.figure = r.describe()
            if ctx.cuda:
                judged_accuracy(row, r, w.accuracy_floor)
            else:
                cuda_only(ctx, row)


def check_sync_bn(ctx: Ctx, out: Sink) -> None:
    w = digits(ctx)
    with out.row("--sync-bn on every GPU (SyncBatchNorm, NCCL)") as row:
        if ctx.gpus < 2:
            raise Skip(f"{ctx.gpus_text()}: SyncBatchNorm needs 2 or more processes; not measured")
        r = train(ctx, "sync-bn", *w.args, "--nproc", str(ctx.gpus), "--sync-bn")
        row.figure = f"{ctx.gpus} processes; {r.describe()}"
        judged_accuracy(row, r, w.accuracy_floor)


def _csv_rows(path: Path) -> list[list[str]]:
    with path.open() as f:
        return list(csv.reader(f))


def _inference_devices(ctx: Ctx) -> tuple[tuple[str, list[str]], ...]:
    return (("cuda", []), ("cpu", ["--cpu"])) if ctx.cuda else (("cpu", ["--cpu"]),)


def check_predict(ctx: Ctx, out: Sink) -> None:
    weights = train(ctx, "default-fp32", *digits(ctx).args, reuse=True).folder
    with out.row("predict on CUDA vs the CPU (same weights)") as row:
        logits = {}
        for device, flag in _inference_devices(ctx):
            csv_path = ctx.work / f"predict-{device}.csv"
            scaletrain(ctx, f"predict-{device}", "predict", "--checkpoint", str(weights), "--data",
                       str(kaggle_digits(ctx)), "--output", str(csv_path), "--logits", *flag)
            logits[device] = [[float(v) for v in r[2:]] for r in _csv_rows(csv_path)[1:]]
        if not ctx.cuda:
            row.figure = f"{len(logits['cpu'])} rows with logits"
            return cuda_only(ctx, row)
        gpu, cpu = logits["cuda"], logits["cpu"]
        agree = sum(max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
                    for a, b in zip(gpu, cpu)) / len(cpu)
        largest = max(abs(x - y) for a, b in zip(gpu, cpu) for x, y in zip(a, b))
        row.figure = f"argmax equal on {agree:.2%} of {len(cpu)} rows; largest logit difference {largest:.2e}"
        judged(row, len(gpu) == len(cpu) and agree >= 0.999 and largest <= 1e-2,
               "argmax equal on >= 99.9 % of rows, logits within 1e-2")


def check_evaluate(ctx: Ctx, out: Sink) -> None:
    w = digits(ctx)
    weights = train(ctx, "default-fp32", *w.args, reuse=True).folder
    with out.row("evaluate on CUDA vs the CPU (same weights)") as row:
        reports = {}
        for device, flag in _inference_devices(ctx):
            folder = ctx.work / f"evaluate-{device}"
            scaletrain(ctx, f"evaluate-{device}", "evaluate", "--checkpoint", str(weights), "--data", w.args[1],
                       "--output-dir", str(folder), *flag)
            reports[device] = json.loads((folder / "metrics.json").read_text())
        if not ctx.cuda:
            row.figure = f"{reports['cpu']['samples']} samples, accuracy {reports['cpu']['accuracy']:.2%}"
            return cuda_only(ctx, row)
        g, c = reports["cuda"], reports["cpu"]
        row.figure = (f"{g['samples']} samples: accuracy {g['accuracy']:.2%} vs {c['accuracy']:.2%}, loss "
                      f"{g['loss']:.5f} vs {c['loss']:.5f}")
        judged(row, g["samples"] == c["samples"] and abs(g["accuracy"] - c["accuracy"]) <= 0.001,
               "same samples, accuracy within 0.1 points")


def check_tasks(ctx: Ctx, out: Sink) -> None:
    """Regression, multi-label and segmentation through `fit` on the device (tests/tasks.py): their torchmetrics
    metrics, updated on the GPU, equal to the same metrics over the whole set computed on the CPU from `predict`'s
    outputs, and no accuracy reported."""
    with out.row("any task through fit: torchmetrics on the device vs the whole set") as row:
        worst, figures = 0.0, []
        for task in ("regression", "multilabel", "segmentation"):
            folder = ctx.work / f"task-{task}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            r = run(ctx, [sys.executable, str(ROOT / "tests" / "tasks.py"), task, str(folder)], f"task-{task}")
            if r.returncode:
                raise Failed(f"tests/tasks.py {task} exited {r.returncode}: {r.tail()}")
            result = json.loads((folder / "result.json").read_text())
            last = result["history"][-1]
            if any("accuracy" in k for k in last):
                raise Failed(f"{task}: an accuracy was reported: {sorted(last)}")
            for name, value in result["whole_set"].items():
                worst = max(worst, abs(last[f"val_{name}"] - value) / max(abs(value), 1e-6))
            figures.append(f"{task} " + ", ".join(f"{n} {last['val_' + n]:.4f}" for n in result["whole_set"]))
        row.figure = "; ".join(figures) + f"; largest relative difference {worst:.1e}"
        if not ctx.cuda:
            return cuda_only(ctx, row)
        judged(row, worst <= 1e-4, "every metric within 1e-4 (relative) of the whole set's")


OWN_STEPS = ("nlp_bert", "detect_boxes", "dcgan_digits", "wgan_gp", "simclr_digits")
OWN_STEP_ARGS = {"wgan_gp": ("dcgan_digits", "--loss", "wgan-gp")}  # the example and its flags, where not the name
OWN_STEP_NEEDS = {"nlp_bert": ("transformers", "transformers"), "detect_boxes": ("pycocotools", "pycocotools")}


def check_own_steps(ctx: Ctx, out: Sink) -> None:
    """Users' own steps on the GPU in fp32, fp16 and bf16 (examples/ with --quick): a Transformers model called with
    its batch's keys on its own loss, a detector's dict of losses and mAP, two optimizers stepped by the step, a
    WGAN-GP's gradient penalty taken with autograd.grad inside the step, a contrastive loss over gathered
    embeddings. Every run finishes with finite losses; fp16's loss scaler is updated
    once per batch with two optimizers (its growth tracker counts batches, not optimizer steps). A dry run trains
    the GAN in bf16 on the CPU."""
    with out.row("own steps (BERT, Faster R-CNN, DCGAN, WGAN-GP, SimCLR) in fp32, fp16, bf16") as row:
        names, precisions = (OWN_STEPS, ("no", "fp16", "bf16")) if ctx.cuda else (("dcgan_digits",), ("bf16",))
        figures, bad = [], []
        for name in names:
            if name in OWN_STEP_NEEDS and _missing(ctx.env, (OWN_STEP_NEEDS[name],)):
                figures.append(f"{name}: not run ({OWN_STEP_NEEDS[name][1]} is not installed here)")
                continue
            for precision in precisions:
                folder = ctx.work / f"step-{name}-{precision}"
                shutil.rmtree(folder, ignore_errors=True)
                script, *flags = OWN_STEP_ARGS.get(name, (name,))
                r = run(ctx, [sys.executable, str(ROOT / "examples" / f"{script}.py"), "--quick", "--out",
                              str(folder), "--mixed-precision", precision, *flags], f"step-{name}-{precision}")
                if r.returncode:
                    bad.append(f"{name} {precision} exited {r.returncode}: {r.tail()}")
                    continue
                last = _metrics(folder)[-1]
                losses = {k: v for k, v in last.items() if k.startswith("train_") and k != "train_samples"}
                if not all(math.isfinite(v) for v in losses.values()):
                    bad.append(f"{name} {precision}: losses {losses}")
                text = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("val_"))
                if name == "dcgan_digits" and precision == "fp16":
                    state = json.loads(max((folder / "state").iterdir()).joinpath("train.json").read_text())
                    batches, scaler = int(state["step"]), state["scaler"]
                    text = f"scaler scale {scaler['scale']:g}, growth tracker {scaler['_growth_tracker']} after " \
                           f"{batches} batches"
                    if scaler["_growth_tracker"] > batches or (scaler["scale"] == 65536.0 and
                                                               scaler["_growth_tracker"] != batches):
                        bad.append(f"fp16 GAN: {text} (the scaler is updated once per batch)")
                figures.append(f"{name} {precision}: train_loss {last['train_loss']:.4f}" + (f", {text}" if text
                                                                                              else ""))
        row.figure = "; ".join(figures) + (f"; FAILED: {'; '.join(bad)}" if bad else "")
        if not ctx.cuda:
            if bad:
                raise Failed("; ".join(bad))
            return cuda_only(ctx, row)
        judged(row, not bad, "every run exits 0 with finite losses; fp16's scaler updated once per batch")


REGULARISED = ["--randaugment", "2,9", "--random-erasing", "0.25", "--mixup", "0.2", "--cutmix", "1.0",
               "--label-smoothing", "0.1", "--ema-decay", "0.99"]


def check_resume(ctx: Ctx, out: Sink) -> None:
    """SIGKILL mid-epoch, resume, and compare with the same run uninterrupted, with deterministic kernels."""
    _killed_and_resumed(ctx, out, "SIGKILL + resume ends equal to the uninterrupted run", "resume", [],
                        ["last.safetensors"])


def check_resume_regularised(ctx: Ctx, out: Sink) -> None:
    """The same with every regulariser drawing on the device and the weight average kept: both end equal."""
    _killed_and_resumed(ctx, out, "SIGKILL + resume with RandAugment, erasing, mixup/cutmix and EMA ends equal",
                        "resume-reg", REGULARISED, ["last.safetensors", "last_ema.safetensors"])


def _killed_and_resumed(ctx: Ctx, out: Sink, title: str, name: str, extra: list[str], files: list[str]) -> None:
    w = digits(ctx)
    args = [*w.args, "--epochs", "3", "--checkpoint-every", "10", "--deterministic", *extra]
    with out.row(title) as row:
        reference = train(ctx, f"{name}-reference", *args)
        steps = -(-reference.summary["train_samples"] // reference.summary["global_batch_size"])  # per epoch
        kill_at = steps + steps // 2 + 3  # mid-epoch 2, a few batches after a periodic checkpoint
        folder = ctx.work / f"{name}-killed"
        if folder.exists():
            shutil.rmtree(folder)
        killed = scaletrain(ctx, f"{name}-killed", "train", *args, "--output-dir", str(folder),
                            env={"SCALETRAIN_FAULT": f"kill:{kill_at}"}, expect=None)
        if killed.returncode != -signal.SIGKILL:
            raise Failed(f"the run to be killed at batch {kill_at} exited {killed.returncode}: {killed.tail()}")
        resumed = scaletrain(ctx, f"{name}-resumed", "train", *args, "--output-dir", str(folder))
        if not any("resuming from" in line for _, line in resumed.lines):
            raise Failed("the second run did not resume from the killed run's checkpoint")
        largest = max(_largest_difference(reference.folder / f, folder / f) for f in files)
        where = f"killed at batch {kill_at} of {3 * steps}, resumed on {reference.summary['device']}"
        if largest == 0:
            row.figure, row.verdict = f"{where}: {' and '.join(files)} bitwise equal", "pass"
            row.reason = "bitwise equal (--deterministic)"
            return
        again = train(ctx, f"{name}-reference-2", *args)
        noise = max(_largest_difference(reference.folder / f, again.folder / f) for f in files)
        row.figure = f"{where}: largest weight difference {largest:.2e}; two uninterrupted runs differ by {noise:.2e}"
        judged(row, noise > 0 and largest <= max(10 * noise, 1e-5),
               "not bitwise: kernels are not repeatable here, so within 10x the difference of two uninterrupted "
               "runs (or 1e-5)")


def _largest_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    if wa.keys() != wb.keys():
        raise Failed(f"{a} and {b} hold different tensors")
    return max(((wa[k].double() - wb[k].double()).abs().max().item() for k in wa if wa[k].numel()), default=0.0)


# -- speed ----------------------------------------------------------------------------------------------------
def need_peer(ctx: Ctx) -> None:
    if not ctx.peers:
        raise Skip("seed000_accelerate.py not found in .carry/peers or ../shared/peers: run `python "
                   "benchmarks/gpu_suite.py --stage` and carry .carry")
    if ctx.peer_unavailable:
        raise Skip(ctx.peer_unavailable)


def check_peer(ctx: Ctx, out: Sink) -> None:
    """seed 000's own script against `scaletrain train` at its settings: model, per-device batch, optimizer."""
    sys.path.insert(0, str(HERE))
    from peers import SCALETRAIN_LINE, SEED000_LINE, Contender
    from peers import run as run_contender

    model, size, batch, epochs = ("test_convnext", 56, 64, 2) if ctx.dry else ("convnext_small", 56, 256, 3)
    data = kaggle_digits(ctx)
    with (data / "train.csv").open() as f:
        n_train = (sum(1 for _ in f) - 1) * 4 // 5  # both train on 80 % of train.csv's rows
    for precision in ("no", "fp16"):
        with out.row(f"seed 000 vs scaletrain, {'fp32' if precision == 'no' else precision}, images/s") as row:
            if precision == "fp16" and not ctx.cuda:
                raise Skip(f"fp16 needs a GPU ({ctx.no_cuda_reason()})")
            need_peer(ctx)
            log = ctx.work / f"peer-{precision}"
            log.mkdir(exist_ok=True)
            peer = run_contender(Contender(f"seed000-{precision}", [
                sys.executable, str(Path(ctx.peers) / "seed000_accelerate.py"), "--data", str(data), "--out", ".",
                "--model", model, "--image_size", str(size), "--bs", str(batch), "--ep", str(epochs),
                "--mixed_precision", precision], SEED000_LINE, n_train // batch * batch), 90, log, ctx.env)
            ours = run_contender(Contender(f"scaletrain-{precision}", [
                sys.executable, "-m", "scaletrain", "train", "--data", str(data), "--model", model, "--image-size",
                str(size), "--batch-size", str(batch), "--optimizer", "adam", "--lr", "5e-5", "--weight-decay", "0",
                "--scheduler", "constant", "--warmup-epochs", "0", "--augment", "hflip,vflip,brightness,contrast",
                "--epochs", str(epochs), "--mixed-precision", precision, "--output-dir", "run"],
                SCALETRAIN_LINE, n_train), 90, log, ctx.env)
            _throughputs(ctx, row, peer, ours, f"{model} {size} px, batch {batch}: seed 000 {{0:,.0f}}, scaletrain "
                                                f"{{1:,.0f}} images/s: {{2:.2f}}x")


def _throughputs(ctx: Ctx, row: Row, first, second, text: str) -> None:
    """Two contenders' steady images/s on a measured row: `text` formatted with both and their ratio."""
    from peers import throughput

    for c in (first, second):
        if c.status != "ok":
            raise Failed(f"{c.name}: {c.status}")
    a, b = throughput(first), throughput(second)
    row.figure, row.verdict = text.format(a, b, b / a), "measured"
    if not ctx.cuda:
        cuda_only(ctx, row)


def check_own_code(ctx: Ctx, out: Sink) -> None:
    """seed 000's own script against its own Dataset and model through `scaletrain.fit`, at equal settings (see
    benchmarks/own_code.py): what handing the loop to scaletrain costs on a GPU."""
    sys.path.insert(0, str(HERE))
    from peers import SCALETRAIN_LINE, SEED000_LINE, Contender
    from peers import run as run_contender

    model, size, batch, epochs = "resnet18", 56, 256, 3
    with out.row("seed 000's own Dataset and model: its loop vs scaletrain.fit, fp32, images/s") as row:
        if ctx.dry:
            raise Skip("a speed pair for a GPU; on the CPU it is benchmarks/own_code.py, and tests/test_own_code.py "
                       "trains seed 000's classes through fit")
        need_peer(ctx)
        data = kaggle_digits(ctx)
        with (data / "train.csv").open() as f:
            n_train = (sum(1 for _ in f) - 1) * 4 // 5
        log = ctx.work / "own-code"
        log.mkdir(exist_ok=True)
        theirs = run_contender(Contender("seed000-loop", [
            sys.executable, str(Path(ctx.peers) / "seed000_accelerate.py"), "--data", str(data), "--out", ".",
            "--model", model, "--image_size", str(size), "--bs", str(batch), "--ep", str(epochs)], SEED000_LINE,
            n_train // batch * batch), 90, log, ctx.env)
        ours = run_contender(Contender("scaletrain-fit", [
            sys.executable, str(HERE / "own_code.py"), "fit-job", "--peers", str(ctx.peers), "--data", str(data),
            "--out", "fit", "--epochs", str(epochs), "--model", model, "--image-size", str(size), "--batch-size",
            str(batch), "--channels-last"], SCALETRAIN_LINE, n_train), 90, log, ctx.env)
        _throughputs(ctx, row, theirs, ours, f"{model} {size} px, batch {batch}: seed 000's loop {{0:,.0f}}, "
                                             f"scaletrain.fit {{1:,.0f}} images/s: {{2:.2f}}x")


# Dense 16-bit tensor-core peak FLOP/s by GPU name (the makers' data sheets, without sparsity).
PEAK_16BIT_FLOPS = {"H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12,
                    "L40S": 362e12, "L4": 121e12, "A10G": 70e12}


def _train_flops_per_image(job: SpeedJob) -> float:
    """Forward and backward FLOPs of one image through the job's model, by torch's FLOP counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from scaletrain.models import build_model

    model = build_model(job.model, 3, 10)
    x = torch.randn(2, 3, job.size, job.size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2


def check_step_speed(ctx: Ctx, out: Sink) -> None:
    job = speed_job(ctx)
    args = speed_args(ctx, job)
    base = None
    with out.row("model FLOPs utilisation of the training step") as row:
        base = train(ctx, "speed-base", *args)
        flops = _train_flops_per_image(job)
        achieved = flops * base.steady_images_per_second()
        row.figure = (f"{job.model} {job.size} px bf16 batch {job.batch}: {base.steady_images_per_second():,.0f} "
                      f"images/s x {flops / 1e9:.2f} GFLOP = {achieved / 1e12:.2f} TFLOP/s")
        row.verdict = "measured"
        if not ctx.cuda:
            cuda_only(ctx, row)
        else:
            import torch

            name = torch.cuda.get_device_name(0)
            peak = next((v for k, v in PEAK_16BIT_FLOPS.items() if k in name), None)
            if peak is None:
                row.reason = f"no 16-bit peak on record for {name}"
            else:
                row.figure += f" of {peak / 1e12:.0f} peak: MFU {achieved / peak:.1%}"
    with out.row("channels_last on vs off") as row:
        if base is None or not base.metrics:
            raise Failed("the base run failed")
        off = train(ctx, "speed-contiguous", *args, "--no-channels-last")
        a, b = base.steady_images_per_second(), off.steady_images_per_second()
        row.figure = f"on {a:,.0f}, off {b:,.0f} images/s: {a / b:.2f}x"
        row.verdict = "measured"
    with out.row("torch.compile on vs off") as row:
        if not ctx.cuda:
            raise Skip(f"not run on the CPU ({ctx.no_cuda_reason()}): compiling takes minutes on 2 cores")
        compiled = train(ctx, "speed-compiled", *args, "--compile")
        a, b = compiled.steady_images_per_second(), base.steady_images_per_second()
        first = compiled.metrics[0]["epoch_seconds"] - base.metrics[0]["epoch_seconds"]
        row.figure = f"on {a:,.0f}, off {b:,.0f} images/s: {a / b:.2f}x (first epoch {first:+.0f} s for compiling)"
        row.verdict = "measured"


def check_pipeline(ctx: Ctx, out: Sink) -> None:
    with out.row("on-device input pipeline vs seed 000's albumentations DataLoader") as row:
        need_peer(ctx)
        device = "cuda" if ctx.cuda else "cpu"
        r = run(ctx, [sys.executable, str(HERE / "input_pipeline.py"), "--device", device, "--repeats",
                      "1" if ctx.dry else "5", "--peers", ctx.peers, "--out", str(ctx.work)], "input-pipeline")
        if r.returncode:
            raise Failed(f"input_pipeline.py exited {r.returncode}: {r.tail()}")
        rows = json.loads((ctx.work / f"input_pipeline_{device}.json").read_text())["rows"]
        row.figure = "; ".join(f"{x['pipeline']} {x['images_per_second_median']:,.0f} images/s "
                               f"({x['ratio_vs_peer']:.1f}x)" for x in rows)
        row.verdict = "measured"
        if not ctx.cuda:
            cuda_only(ctx, row)


STAGES_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipeline_blocks.py"


def check_stages(ctx: Ctx, out: Sink) -> None:
    """examples/pipeline_blocks.py as 2 pipeline stages on 2 GPUs (NCCL) against the model whole on one, in fp32,
    bf16 and fp16: the per-epoch losses alike (fp32 within 1e-4; 16 bits within 5e-2, as bf16 on the CPU differs
    by 1.6e-2). Needs 2 GPUs; the 2-process CPU form is tests/test_pipeline.py's."""
    for precision in ("no", "bf16", "fp16"):
        with out.row(f"--strategy pipeline, 2 stages (NCCL) vs the model whole, "
                     f"{'fp32' if precision == 'no' else precision}") as row:
            if ctx.gpus < 2:
                raise Skip(f"{ctx.gpus_text()}: 2 stages need 2 GPUs (tests/test_pipeline.py runs them on 2 CPU "
                           f"processes)")
            losses = {}
            for name, launcher, flags in (("whole", [sys.executable], []), (
                    "stages", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                    ["--stages", "2"])):
                folder = ctx.work / f"stages-{name}-{precision}"
                shutil.rmtree(folder, ignore_errors=True)
                r = run(ctx, [*launcher, str(STAGES_EXAMPLE), "--out", str(folder), "--mixed-precision", precision,
                              "--width", "256", "--samples", "2048", *flags], f"stages-{name}-{precision}")
                if r.returncode != 0:
                    raise Failed(f"{name} exited {r.returncode}: {r.tail()}")
                losses[name] = [m["train_loss"] for m in _metrics(folder)]
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses["stages"], losses["whole"]))
            row.figure = (f"train losses whole {', '.join(f'{v:.5f}' for v in losses['whole'])}; 2 stages "
                          f"{', '.join(f'{v:.5f}' for v in losses['stages'])}; largest relative difference "
                          f"{worst:.1e}")
            judged(row, worst <= (1e-4 if precision == "no" else 5e-2),
                   "within 1e-4" if precision == "no" else "within 5e-2")


def check_jpeg(ctx: Ctx, out: Sink) -> None:
    with out.row("JPEG decoding: torchvision on the GPU (batched) vs the CPU") as row:
        import torch
        import torchvision
        from torchvision.io import decode_jpeg, encode_jpeg

        n, h, w = (16, 64, 48) if ctx.dry else (256, 375, 500)
        g = torch.Generator().manual_seed(0)
        # Smooth shapes plus noise: closer to a photo's compressed size than pure noise or a flat colour.
        base = torch.nn.functional.interpolate(torch.rand(n, 3, h // 16, w // 16, generator=g), size=(h, w),
                                               mode="bicubic").clamp(0, 1)
        images = ((base + 0.05 * torch.rand(n, 3, h, w, generator=g)).clamp(0, 1) * 255).to(torch.uint8)
        files = [encode_jpeg(im, quality=90) for im in images]

        def rate(device: str, repeats: int = 3) -> float:
            decode_jpeg(files[:4], device=device)  # warm-up: decoder handles, allocations
            seconds = []
            for _ in range(repeats):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                decode_jpeg(files, device=device)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - t0)
            return n / statistics.median(seconds)

        cpu = rate("cpu")
        row.figure = (f"{n} JPEGs of {w}x{h}: CPU {cpu:,.0f} images/s (one process, torchvision "
                      f"{torchvision.__version__})")
        if not ctx.cuda:
            return cuda_only(ctx, row)
        gpu = rate("cuda")
        row.figure += f", GPU {gpu:,.0f} images/s: {gpu / cpu:.1f}x"
        row.verdict = "measured"
        row.reason = "torchvision's decoders; scaletrain decodes streamed JPEGs this way on a GPU (--decode)"


def check_photos(ctx: Ctx, out: Sink) -> None:
    """A folder of photo-like JPEGs (photo_startup.py's) through the photo recipe on CUDA: decoded in the checking
    pass and held on the device, found in the cache by a second run, and prepared into shards and streamed."""
    sys.path.insert(0, str(HERE))
    from photo_startup import make_photo_folder

    files, model, size, batch = (60, "tinycnn", 32, 8) if ctx.dry else (4000, "resnet18", 128, 128)
    folder = ctx.work / "photo-folder"
    make_photo_folder(folder, files)
    cache = ["--cache-dir", str(ctx.work / "photo-cache")]
    epochs = "1" if ctx.dry else "2"
    common = ["--model", model, "--image-size", str(size), "--batch-size", str(batch), "--epochs", epochs,
              "--deterministic", *cache]
    runs: dict[str, Trained] = {}
    with out.row("photo folder: in memory, second run and prepared shards train to the same bits") as row:
        runs["first run"] = train(ctx, "photos-first", "--data", str(folder), *common)
        runs["second run"] = train(ctx, "photos-second", "--data", str(folder), *common)
        prepared = ctx.work / "photo-shards"
        shutil.rmtree(prepared, ignore_errors=True)
        scaletrain(ctx, "photos-prepare", "prepare", "--data", str(folder), "--image-size", str(size), *cache,
                   "--output", str(prepared))
        runs["prepared, streamed"] = train(ctx, "photos-prepared", "--data", str(prepared), "--data-on-device",
                                           "no", *common)
        from safetensors.torch import load_file

        weights = {k: load_file(str(r.folder / "last.safetensors")) for k, r in runs.items()}
        base = weights["first run"]
        same = all(w.keys() == base.keys() and all(w[t].equal(base[t]) for t in w) for w in weights.values())
        devices = {r.summary["device"] for r in runs.values()}
        where = ", ".join(sorted(devices))
        row.figure = (f"{files} JPEGs of 400x300, {model} at {size} px, {epochs} epoch(s) on {where}: "
                      f"best {runs['first run'].best:.2%}; weights {'bitwise equal' if same else 'differ'}")
        if ctx.cuda and devices != {"cuda"}:
            raise Failed(f"trained on {devices}, not on the GPU")
        judged(row, same, "the three runs' last weights bitwise equal (--deterministic)")
    with out.row("photo folder: first step after launch and images/s") as row:
        if not runs:
            raise Failed("the photo runs failed")
        parts = []
        for name, r in runs.items():
            said = next((line for _, line in r.run.lines if "first step done" in line), "")
            first = said.split("first step done ")[1].split(" s")[0] if said else "?"
            parts.append(f"{name} {first} s, {r.steady_images_per_second():,.0f} images/s")
        row.figure = "; ".join(parts)
        row.verdict = "measured"
    with out.row("photo folder streamed: JPEGs decoded on the device vs by DataLoader workers") as row:
        if not ctx.cuda:  # the CPU's "device" decoder is the workers' own: nothing to compare
            raise Skip(f"needs CUDA ({ctx.no_cuda_reason()}): not measured; tests/test_recipes.py trains with "
                       f"--decode device on the CPU")
        workers = "8"
        rates = {}
        for how in ("workers", "device"):
            r = train(ctx, f"photos-decode-{how}", "--data", str(folder), *common, "--data-on-device", "no",
                      "--decode", how, "--num-workers", workers)
            rates[how] = r.steady_images_per_second()
        row.figure = (f"{workers} workers decoding: {rates['workers']:,.0f} images/s; the device decoding: "
                      f"{rates['device']:,.0f} images/s: {rates['device'] / rates['workers']:.2f}x")
        row.verdict = "measured"


PHOTOS_VS_TIMM = ("photos vs timm's train.py: images/s, first step after launch, peak host memory",
                  "photos vs the model's limit (the same step on synthetic data already on the GPU)",
                  "photos: --compile on vs off (first step, images/s)",
                  "photos streamed: --decode device vs --decode workers")


def timm_train_py() -> Path | None:
    """timm's train.py as --stage carried it (it is not part of the timm package)."""
    path = CARRY / "timm" / "train.py"
    return path if path.is_file() else None


def check_photos_vs_timm(ctx: Ctx, out: Sink) -> None:
    """What a user with a GPU and a folder of photos pays: an ImageNet-shaped folder (20,000 JPEGs of 500 x 375,
    train/ and val/) trained by scaletrain with its defaults and by timm's train.py at the same settings (resnet50
    at 224 px, bf16, channels_last, batch 256, one worker per core, 2 epochs), in the same call; beside them the
    same step on synthetic data held on the GPU (the limit), --compile, and the two ways of decoding streamed
    JPEGs. Runs alone (`--only photos-timm`): it needs most of a 10-minute call."""
    sys.path.insert(0, str(HERE))
    from photo_startup import Job, make_photo_folder, run_scaletrain, run_timm, warm_page_cache

    cores = os.cpu_count() or 2
    if ctx.dry:
        files, shape, job = 120, (100, 75), Job("test_resnet", 32, 16, 0.1, 2, 1)
    else:
        files, shape, job = 20000, (500, 375), Job("resnet50", 224, 256, 0.1, cores, 2, cuda=True)
    folder = ctx.work / f"imagenet-shaped-{files}"
    made = make_photo_folder(folder, files, size=shape)
    warm_page_cache(folder)  # both contenders find the files in the page cache
    cache = ["--cache-dir", str(ctx.work / "imagenet-shaped-cache")]
    settings = f"{files} JPEGs of {shape[0]}x{shape[1]} ({made['mean_kb']:.0f} KB), {job.model} {job.size} px, " \
               f"batch {job.batch}, {job.workers} workers, {job.epochs} epoch(s)"

    def said(r: dict, name: str) -> str:
        if r["exit_code"]:
            last = [line for line in r["log_tail"] if not line.startswith("peak_rss_kib")] or [""]
            raise Failed(f"{name} exited {r['exit_code']}: {last[-1][:200]}")
        return (f"{name} {r.get('images_per_second') or float('nan'):,.0f} images/s, first step "
                f"{r['first_step_s'] or float('nan'):.1f} s, peak host memory {r['peak_rss_mib']:,.0f} MiB")

    ours: dict = {}
    with out.row(PHOTOS_VS_TIMM[0]) as row:
        ours = run_scaletrain(folder, ctx.work, ctx.env, cache, "photos-timm-scaletrain", job)
        row.figure = f"{settings}: {said(ours, 'scaletrain (first run)')}"
        if ctx.dry:
            raise Skip("timm's side runs on a GPU only (dry run on the CPU); benchmarks/photo_startup.py is the "
                       "CPU comparison")
        train_py = timm_train_py()
        if train_py is None:
            raise Skip("timm's train.py not in .carry/timm: run `python benchmarks/gpu_suite.py --stage "
                       "--timm-train <train.py>` and carry .carry")
        theirs = run_timm(train_py, folder, ctx.work, ctx.env, job, "photos-timm-timm")
        row.figure += f"; {said(theirs, 'timm')}"
        ratio = (ours.get("images_per_second") or 0) / (theirs.get("images_per_second") or float("inf"))
        row.figure += f": {ratio:.2f}x timm's images/s, first step {ours['first_step_s'] / theirs['first_step_s']:.2f}x"
        judged(row, ratio >= 1.0, "scaletrain's images/s at least timm's")
    with out.row(PHOTOS_VS_TIMM[1]) as row:
        if not ours.get("images_per_second"):
            raise Failed("the photo run failed")
        synthetic = SpeedJob(job.model, job.size, job.batch, job.batch * (2 if ctx.dry else 12), 3)
        limit = train(ctx, "photos-timm-limit", "--data", str(speed_data(ctx, synthetic)), *job.scaletrain_args()[:8],
                      "--epochs", "3", *(["--mixed-precision", "bf16"] if job.cuda else []))
        ratio = ours["images_per_second"] / limit.steady_images_per_second()
        row.figure = (f"photos {ours['images_per_second']:,.0f} images/s, synthetic on the device "
                      f"{limit.steady_images_per_second():,.0f}: {ratio:.2f} of the limit")
        if ctx.cuda:
            judged(row, ratio >= 0.9, "photos at least 0.9 of the limit")
        else:
            cuda_only(ctx, row)
    with out.row(PHOTOS_VS_TIMM[2]) as row:
        if not ctx.cuda:
            raise Skip(f"not run on the CPU ({ctx.no_cuda_reason()}): compiling takes minutes on 2 cores")
        runs = {flag: run_scaletrain(folder, ctx.work, ctx.env, [*cache, *extra], f"photos-timm-{flag}", job)
                for flag, extra in (("eager", []), ("compiled", ["--compile"]))}
        row.figure = "; ".join(said(r, f"--compile {'on' if flag == 'compiled' else 'off'} (second run)")
                               for flag, r in runs.items())
        row.figure += f": {runs['compiled']['images_per_second'] / runs['eager']['images_per_second']:.2f}x"
        row.verdict = "measured"
    with out.row(PHOTOS_VS_TIMM[3]) as row:
        if not ctx.cuda:  # the CPU's "device" decoder is the workers' own: nothing to compare
            raise Skip(f"needs CUDA ({ctx.no_cuda_reason()}): not measured")
        runs = {how: run_scaletrain(folder, ctx.work, ctx.env, [*cache, "--data-on-device", "no", "--decode", how],
                                    f"photos-timm-decode-{how}", job) for how in ("workers", "device")}
        row.figure = "; ".join(said(r, f"--decode {how}") for how, r in runs.items())
        row.figure += f": {runs['device']['images_per_second'] / runs['workers']['images_per_second']:.2f}x"
        row.verdict = "measured"


# -- memory ---------------------------------------------------------------------------------------------------
MEMORY_CASES = {"resnet50": ("resnet50", 224, 128), "convnext_small": ("convnext_small", 224, 64),
                "vit_base_patch16_224": ("vit_base_patch16_224", 224, 64)}
DRY_MEMORY_CASES = {"resnet50": ("test_resnet", 64, 8), "convnext_small": ("test_convnext", 64, 8),
                    "vit_base_patch16_224": ("test_vit", 64, 8)}
MEMORY_BOUND = (0.8, 1.25)


def memory_check(key: str) -> Callable[[Ctx, Sink], None]:
    def check(ctx: Ctx, out: Sink) -> None:
        with out.row(f"estimate-memory vs the CUDA allocator's peak: {key}") as row:
            import torch

            sys.path.insert(0, str(HERE))
            from memory_estimate import measured_peak

            from scaletrain.measure.memory import estimate

            name, size, batch = (DRY_MEMORY_CASES if ctx.dry else MEMORY_CASES)[key]
            est = estimate(name, image_size=size, channels=3, batch_size=batch, mixed_precision="bf16",
                           optimizer="adamw")
            device = torch.device("cuda" if ctx.cuda else "cpu")
            peak = measured_peak(name, size, batch, "bf16", False, device, "adamw")
            ratio = est.total / peak
            row.figure = (f"{name} {size} px batch {batch} bf16 AdamW: estimate {est.total / 2**20:,.0f} MiB, "
                          f"measured {peak / 2**20:,.0f} MiB: {ratio:.2f}")
            if not ctx.cuda:
                row.figure += " (glibc's allocator)"
                return cuda_only(ctx, row)
            judged(row, MEMORY_BOUND[0] <= ratio <= MEMORY_BOUND[1],
                   f"estimate / torch.cuda.max_memory_allocated in {MEMORY_BOUND[0]}..{MEMORY_BOUND[1]}")
    return check


# -- several GPUs ---------------------------------------------------------------------------------------------
def check_multi_gpu(ctx: Ctx, out: Sink) -> None:
    """DDP on 1 vs N GPUs with bench's projection from a measured all-reduce, and DataParallel on N. A dry run
    exercises the DDP half on 2 CPU processes (gloo)."""
    titles = ("DDP on 1 vs every GPU", "DP on every GPU vs DDP", "NCCL all-reduce bandwidth vs bench's projection")
    n = ctx.gpus if ctx.gpus >= 2 else 2 if ctx.dry else 0
    if not n:
        for title in titles:
            with out.row(title) as row:
                raise Skip(f"{ctx.gpus_text()}: not measured")
        return
    job = speed_job(ctx)
    unit = "GPU" if ctx.cuda else "CPU process"
    common = ["--model", job.model, "--data", str(speed_data(ctx, job)), "--epochs", str(job.epochs),
              "--mixed-precision", "bf16", "--batch-size", str(job.batch)]
    link = "pcie" if ctx.dry else "measure"  # 2 more CPU processes would only measure loopback
    ddp = _bench(ctx, "bench-ddp", *common, "--nproc", f"1,{n}", "--interconnect", link,
                 "--project-devices", str(n), "--project-nodes", "1")
    one, many = (next(r for r in ddp["cells"] if r["devices"] == k) for k in (1, n))
    with out.row(titles[0]) as row:
        row.figure = (f"{job.model} bf16 batch {job.batch} per {unit}: {one['seconds_per_epoch']:.2f} s/epoch on 1, "
                      f"{many['seconds_per_epoch']:.2f} on {n}: speed-up {many['speedup']:.2f}x "
                      f"({many['efficiency']:.0%})")
        row.verdict = "measured"
        if not ctx.cuda:
            cuda_only(ctx, row)
    with out.row(titles[1]) as row:
        if not ctx.cuda:
            raise Skip(f"needs 2 or more GPUs ({ctx.no_cuda_reason()}): not measured")
        dp = _bench(ctx, "bench-dp", *common, "--nproc", str(n), "--strategy", "dp")["cells"][0]
        row.figure = (f"DataParallel {dp['seconds_per_epoch']:.2f} s/epoch, DDP {many['seconds_per_epoch']:.2f} "
                      f"s/epoch on {n} GPUs: DDP {dp['seconds_per_epoch'] / many['seconds_per_epoch']:.2f}x faster")
        row.verdict = "measured"
    with out.row(titles[2]) as row:
        row.figure = (f"{'measured' if link == 'measure' else link + ' preset'} {ddp['interconnect_gbps']:.3g} GB/s "
                      f"bus bandwidth; projected "
                      f"{many['projected_seconds_per_epoch']:.2f} s/epoch on {n} vs measured "
                      f"{many['seconds_per_epoch']:.2f} ({many['projection_error']:+.0%})")
        row.verdict = "measured"
        if not ctx.cuda:
            cuda_only(ctx, row)


def _bench(ctx: Ctx, name: str, *args: str) -> dict:
    """`scaletrain bench ARGS`'s bench.json; a cell that failed fails the rows that need it."""
    folder = ctx.work / name
    scaletrain(ctx, name, "bench", *args, "--output-dir", str(folder))
    result = json.loads((folder / "bench.json").read_text())
    failed = [c for c in result["cells"] if c["status"] != "ok"]
    if failed:
        raise Failed(f"bench cell {failed[0]['devices']} device(s) {failed[0]['strategy']}: {failed[0]['status']}")
    return result


# -- the checks, in the order they run (most important first, since the budget may end the list) ----------------
@dataclass(frozen=True)
class Check:
    name: str
    rows: tuple[tuple[str, str], ...]  # (section, title) of each row it reports
    run: Callable[[Ctx, Sink], None]
    cap_seconds: float  # on a GPU machine
    after: tuple[str, ...] = ()  # checks whose run folders it reads (it trains them itself if they were not run)
    alone: bool = False  # on a GPU, run only when named in --only (it needs a call of its own); dry runs run it


def _rows(section: str, *titles: str) -> tuple[tuple[str, str], ...]:
    return tuple((section, t) for t in titles)


CHECKS = [
    Check("default", _rows("correctness", "default run (fp32)") + _rows(
        "speed", "time to 99 % val accuracy (embedded digits)"), check_default, 90),
    Check("precisions", _rows("correctness", "fp16 (loss scaler) vs fp32", "bf16 vs fp32"), check_precisions, 90,
          after=("default",)),
    Check("dp", _rows("correctness", "--strategy dp on every GPU, fp32", "--strategy dp on every GPU, bf16"),
          check_dp, 90),
    Check("fsdp", _rows("correctness", "--strategy fsdp, 1 process (NCCL)", "--strategy fsdp, 2 processes (NCCL)"),
          check_fsdp, 120),
    Check("sync-bn", _rows("correctness", "--sync-bn on every GPU (SyncBatchNorm, NCCL)"), check_sync_bn, 60),
    Check("predict", _rows("correctness", "predict on CUDA vs the CPU (same weights)"), check_predict, 60,
          after=("default",)),
    Check("evaluate", _rows("correctness", "evaluate on CUDA vs the CPU (same weights)"), check_evaluate, 60,
          after=("default",)),
    Check("tasks", _rows("correctness", "any task through fit: torchmetrics on the device vs the whole set"),
          check_tasks, 120),
    Check("resume", _rows("correctness", "SIGKILL + resume ends equal to the uninterrupted run"), check_resume, 120),
    Check("own-steps", _rows("correctness",
                             "own steps (BERT, Faster R-CNN, DCGAN, WGAN-GP, SimCLR) in fp32, fp16, bf16"),
          check_own_steps, 240),
    Check("multi-gpu", _rows("multi-gpu", "DDP on 1 vs every GPU", "DP on every GPU vs DDP",
                             "NCCL all-reduce bandwidth vs bench's projection"), check_multi_gpu, 300),
    Check("stages", _rows("multi-gpu", *(f"--strategy pipeline, 2 stages (NCCL) vs the model whole, {p}"
                                         for p in ("fp32", "bf16", "fp16"))), check_stages, 150),
    *[Check(f"memory-{key}", _rows("memory", f"estimate-memory vs the CUDA allocator's peak: {key}"),
            memory_check(key), 90) for key in MEMORY_CASES],
    Check("pipeline", _rows("speed", "on-device input pipeline vs seed 000's albumentations DataLoader"),
          check_pipeline, 90),
    Check("jpeg", _rows("speed", "JPEG decoding: torchvision on the GPU (batched) vs the CPU"), check_jpeg, 60),
    Check("step-speed", _rows("speed", "model FLOPs utilisation of the training step", "channels_last on vs off",
                              "torch.compile on vs off"), check_step_speed, 300),  # compiling takes a while
    Check("peer", _rows("speed", "seed 000 vs scaletrain, fp32, images/s", "seed 000 vs scaletrain, fp16, images/s"),
          check_peer, 250),
    Check("own-code", _rows("speed", "seed 000's own Dataset and model: its loop vs scaletrain.fit, fp32, images/s"),
          check_own_code, 150),
    Check("photos", _rows("correctness", "photo folder: in memory, second run and prepared shards train to the same "
                          "bits") + _rows("speed", "photo folder: first step after launch and images/s",
                                          "photo folder streamed: JPEGs decoded on the device vs by DataLoader "
                                          "workers"), check_photos, 240),
    Check("resume-reg", _rows("correctness", "SIGKILL + resume with RandAugment, erasing, mixup/cutmix and EMA ends "
                              "equal"), check_resume_regularised, 120),
    Check("photos-timm", _rows("speed", *PHOTOS_VS_TIMM), check_photos_vs_timm, 560, alone=True),
]


# -- the driver -----------------------------------------------------------------------------------------------
def run_child(name: str, ctx: Ctx, rows_path: Path) -> None:
    """Inside a check's own process: run it, its rows going to `rows_path`."""
    check = next(c for c in CHECKS if c.name == name)
    signal.signal(signal.SIGTERM, _stop_commands_and_exit)
    check.run(ctx, Sink(rows_path, {title: section for section, title in check.rows}))


def run_check(check: Check, ctx: Ctx, timeout: float, by_budget: bool = False) -> list[Row]:
    """Run one check in a fresh process; whatever it did not report (a crash, a time-out) is a failed row, but for
    a check stopped by the suite's budget (`by_budget`: what was left of it, not the check's own limit, set
    `timeout`): its unreported rows are skipped, saying so (a slow machine is not a failing check)."""
    rows_path = ctx.work / f"{check.name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    spec = ctx.work / "ctx.json"
    spec.write_text(json.dumps({**asdict(ctx), "work": str(ctx.work)}))
    r = run(ctx, [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--ctx", str(spec),
                  "--rows", str(rows_path)], f"check-{check.name}", timeout=timeout, grace=10.0)  # > its commands
    got = {row["check"]: Row(**row) for row in map(json.loads, rows_path.read_text().splitlines())} \
        if rows_path.exists() else {}
    if r.returncode == 0:
        why = "the check ended without reporting this row"
    elif r.seconds >= timeout and by_budget:
        return [got.get(title) or Row(section, title, "", "skipped", f"the suite's budget ran out {timeout:.0f} s "
                                      f"into this check, before its own limit") for section, title in check.rows]
    elif r.seconds >= timeout:
        why = f"the check timed out after {timeout:.0f} s"
    else:
        why = f"the check's process exited {r.returncode}: {r.tail()}"
    return [got.get(title) or Row(section, title, "", "fail", why) for section, title in check.rows]


# What scaletrain's processes import beyond torch, and what the seed's script adds: (module, distribution).
NEEDED = (("accelerate", "accelerate"), ("timm", "timm"), ("safetensors", "safetensors"), ("yaml", "PyYAML"),
          ("tqdm", "tqdm"), ("PIL", "pillow"), ("matplotlib", "matplotlib"))
RUNNER_NEEDS = (("pytest", "pytest"), ("pluggy", "pluggy"), ("iniconfig", "iniconfig"), ("pygments", "pygments"),
                ("packaging", "packaging"))  # the suite's runner and what it needs
PEER_NEEDS = (("albumentations", "albumentations"), ("pandas", "pandas"), ("cv2", "opencv-python-headless"))
TASK_NEEDS = (("torchmetrics", "torchmetrics"), ("lightning_utilities", "lightning-utilities"),  # tests/tasks.py
              ("pycocotools", "pycocotools"), ("transformers", "transformers"))  # examples/ of own steps
STAGED_FOR_GPU = ("matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing",  # not in its image
                  "pytest", "pluggy", "iniconfig", "pygments", "packaging", "torchmetrics", "lightning-utilities",
                  "pycocotools")  # examples/detect_boxes.py's mAP


# Distributions the GPU machine's image has (torch's, accelerate's, timm's, pandas') and staging leaves out.
IN_GPU_IMAGE = {"numpy", "pyyaml", "safetensors", "tqdm", "filelock", "fsspec", "packaging", "typing-extensions",
                "pillow", "requests", "jinja2", "markupsafe", "certifi", "idna", "urllib3", "charset-normalizer"}


def _distribution(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-")


def _missing(env: dict[str, str], needs) -> list[str]:
    """Distributions whose module does not import in a process started with `env`."""
    code = ("import importlib.util, sys\n"
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([sys.executable, "-c", code, *(m for m, _ in needs)], env=env, capture_output=True,
                         text=True).stdout.split()
    return [d for m, d in needs if m in out]


def install_carried(env: dict[str, str], work: Path) -> dict[str, list[str]]:
    """Make what the checks import importable: from .carry/wheels (no index, no network) into the work folder,
    only the wheels of distributions this Python lacks, so nothing installed is shadowed. Puts that folder on
    env's PYTHONPATH. Returns what was installed and what is still missing."""
    needs = NEEDED + PEER_NEEDS + RUNNER_NEEDS + TASK_NEEDS
    missing = _missing(env, needs)
    installed: list[str] = []
    if missing:
        code = "import importlib.metadata as m\nprint(' '.join(d.metadata['Name'] for d in m.distributions()))"
        present = {n.lower().replace("_", "-") for n in subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.split()}
        wheels = [w for w in sorted((CARRY / "wheels").glob("*.whl")) if _distribution(w) not in present]
        site = work / "site"
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--no-cache-dir", "--target", str(site), *map(str, wheels)],
                             capture_output=True, text=True) if wheels else None
        if pip is not None and pip.returncode == 0:
            env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
            installed = [w.name.split("-")[0] for w in wheels]
        elif pip is not None:
            print(f"gpu_suite: the carried wheels did not install: "
                  f"{(pip.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
        missing = _missing(env, needs)
    return {"installed": installed, "missing": missing}


def peer_unavailable(missing: list[str]) -> str:
    """Why seed 000's script cannot run here ("" when it can)."""
    lacking = [d for _, d in PEER_NEEDS if d in missing]
    return (f"{', '.join(lacking)} not importable: run `python benchmarks/gpu_suite.py --stage` and carry .carry "
            "(or pip install -e '.[peers]')") if lacking else ""


def peers_folder() -> str | None:
    for folder in (CARRY / "peers", SHARED / "peers"):
        if (folder / "seed000_accelerate.py").exists():
            return str(folder)
    return None


def meta_info(gpus: int, dry: bool) -> dict:
    import torch

    driver = None
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True)
        driver = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    return {"gpu": torch.cuda.get_device_name(0) if gpus else None, "gpus": gpus, "driver": driver,
            "torch": torch.__version__, "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
            "dry_run": dry, "cpu_cores": os.cpu_count()}


def markdown(rows: list[Row]) -> str:
    lines = ["| section | check | figure | verdict |", "|---|---|---|---|"]
    for r in rows:
        verdict = r.verdict if r.verdict in ("pass", "measured") else f"**{r.verdict}**: {r.reason}"
        lines.append(f"| {r.section} | {r.check} | {r.figure or '-'} | {verdict} |".replace("\n", " "))
    return "\n".join(lines)


def stage(python: str, timm_train: str) -> int:
    """Copy the seed scripts and the albumentations wheels from ../shared into .carry/ (ignored by git), timm's
    train.py (given) into .carry/timm/, and download the wheels of what else the GPU machine's image lacks
    (matplotlib) for its Python."""
    if timm_train:
        if not Path(timm_train).is_file():
            print(f"gpu_suite: --timm-train {timm_train}: no such file", file=sys.stderr)
            return 2
        (CARRY / "timm").mkdir(parents=True, exist_ok=True)
        shutil.copy(timm_train, CARRY / "timm" / "train.py")
    for source, target in ((SHARED / "peers", CARRY / "peers"), (SHARED / "wheels-h200", CARRY / "wheels")):
        if not source.is_dir():
            print(f"gpu_suite: {source} not found; nothing staged from it", file=sys.stderr)
            return 2
        shutil.copytree(source, target, dirs_exist_ok=True)
    tag = python.replace(".", "")
    pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}",
                          *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                         "manylinux2014_x86_64")),
                          "-d", str(CARRY / "wheels"), *STAGED_FOR_GPU], capture_output=True, text=True)
    if pip.returncode:
        print(f"gpu_suite: could not download {', '.join(STAGED_FOR_GPU)} for Python {python}: "
              f"{(pip.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
        return 1
    # transformers (examples/nlp_bert.py) with what it needs; install_carried skips what the image already has
    pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                          "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}",
                          *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                         "manylinux2014_x86_64")),
                          "-d", str(CARRY / "transformers"), "transformers"], capture_output=True, text=True)
    if pip.returncode:
        print(f"gpu_suite: could not download transformers for Python {python}: "
              f"{(pip.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
        return 1
    have = {_distribution(w) for w in (CARRY / "wheels").glob("*.whl")} | IN_GPU_IMAGE
    for wheel in (CARRY / "transformers").glob("*.whl"):  # the carry's 64 MiB: not what is there already
        if _distribution(wheel) not in have:
            shutil.move(str(wheel), CARRY / "wheels" / wheel.name)
    shutil.rmtree(CARRY / "transformers")
    size = sum(f.stat().st_size for f in CARRY.rglob("*") if f.is_file()) / 2**20
    print(f"staged {CARRY}/peers and {CARRY}/wheels ({size:.0f} MiB) for Python {python}; carry '.carry' to the "
          "GPU machine with the repository")
    return 0


def chosen_checks(only: str, dry: bool) -> list[Check]:
    """The checks `--only` names (comma-separated), else every one but those that need a call of their own (a dry
    run runs those too). Refuses an unknown name."""
    names = [n for n in only.split(",") if n]
    unknown = set(names) - {c.name for c in CHECKS}
    if unknown:
        raise ValueError(f"--only: unknown check {sorted(unknown)[0]}; choose from {', '.join(c.name for c in CHECKS)}")
    return [c for c in CHECKS if c.name in names or not names and (dry or not c.alone)]


def suite_env(dry: bool) -> dict[str, str]:
    """The environment of every process the suite starts: src/ and benchmarks/ importable; in a dry run no GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(HERE),
                                                                       os.environ.get("PYTHONPATH", "")]))}
    if dry:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def make_ctx(dry: bool, work: Path) -> Ctx:
    """What every check of one runner process is told, with the data the checks share made in `work`."""
    import torch

    env = suite_env(dry)
    carried = json.loads((work.parent / CARRIED_FILE).read_text()) if (work.parent / CARRIED_FILE).exists() else {}
    if carried.get("site"):
        env["PYTHONPATH"] = os.pathsep.join([carried["site"], env["PYTHONPATH"]])
    work.mkdir(parents=True, exist_ok=True)
    gpus = 0 if dry else torch.cuda.device_count()
    ctx = Ctx(dry, gpus, work, env, peers_folder(), peer_unavailable(carried.get("missing", [])))
    if ctx.dry:
        dry_digits(ctx)  # made once per runner process rather than in every check's process
    kaggle_digits(ctx)
    return ctx


def run_rows(check: Check, ctx: Ctx, deadline: float) -> list[Row]:
    """One check's rows: run in a process of its own for at most its cap (4x in a dry run); skipped when the
    suite's budget leaves no time to start it."""
    left = deadline - time.time()
    if left < 15:
        return [Row(s, t, "", "skipped", "the suite's budget was spent before this check could start")
                for s, t in check.rows]
    limit = check.cap_seconds * (4 if ctx.dry else 1)
    return run_check(check, ctx, min(left, limit), by_budget=left < limit)


ROWS_DIR = "rows"  # in each runner's work folder: one JSON file of rows per check
CARRIED_FILE = "carried.json"  # in the suite's work folder: what was installed from .carry, and what is missing


def save_rows(work: Path, check: Check, rows: list[Row]) -> None:
    (work / ROWS_DIR).mkdir(exist_ok=True)
    (work / ROWS_DIR / f"{check.name}.json").write_text(json.dumps([asdict(r) for r in rows]))


def report(suite_work: Path, chosen: list[Check], dry: bool, seconds: float, out: str) -> list[Row]:
    """Every runner's rows in the order of the checks, printed as one table and written as JSON (by default, on a
    GPU, to results/gpu_suite_<date>_<gpu>.json)."""
    import torch

    found = {p.stem: [Row(**r) for r in json.loads(p.read_text())] for p in suite_work.glob(f"*/{ROWS_DIR}/*.json")}
    rows = [row for check in chosen for row in found.get(check.name) or [
        Row(sec, title, "", "fail", "the check reported nothing (its runner stopped)") for sec, title in check.rows]]
    gpus = 0 if dry else torch.cuda.device_count()
    meta = meta_info(gpus, dry)
    carried = suite_work / CARRIED_FILE
    if carried.exists():
        c = json.loads(carried.read_text())
        meta.update(installed_from_carry=c["installed"], missing=c["missing"])
    meta["seconds"] = round(seconds, 1)
    print(f"\n{meta['date']}, {meta['gpu'] or 'no GPU'} (x{gpus}), driver {meta['driver']}, torch {meta['torch']}, "
          f"CUDA {meta['cuda']}, {meta['seconds']:.0f} s{' (dry run)' if dry else ''}\n\n{markdown(rows)}", flush=True)
    out = out or ("" if dry else str(HERE / "results" / "gpu_suite_{}_{}.json".format(
        meta["date"], (meta["gpu"] or "cpu").replace("NVIDIA ", "").replace(" ", "-"))))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
        print(f"\nwrote {out}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: CUDA rows skipped, code exercised")
    p.add_argument("--out", default="", help="JSON file to write [default: benchmarks/results/gpu_suite_<date>_<gpu>"
                   ".json on a GPU, none in a dry run]")
    p.add_argument("--only", default="", help="comma-separated check names: " + ", ".join(c.name for c in CHECKS)
                   + "; without it, every check but " + ", ".join(c.name for c in CHECKS if c.alone)
                   + " (which needs a call of its own; a dry run runs it too)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole suite [default: 540; dry 600]")
    p.add_argument("--jobs", type=int, default=0, help="checks run at once (pytest-xdist workers) [default: 1 on a "
                   "GPU, where timings must not share the machine; 2 in a dry run]")
    p.add_argument("--work-dir", default="", help="where run folders and logs go [default: a temporary folder]")
    p.add_argument("--stage", action="store_true", help="copy ../shared/peers and the albumentations wheels into "
                   ".carry/, download matplotlib's and pytest's wheels for the GPU machine's Python there, and stop")
    p.add_argument("--stage-python", default="3.12", help="with --stage: the GPU machine's Python version, for "
                   "the wheels [default: 3.12]")
    p.add_argument("--timm-train", default="", help="with --stage: timm's train.py (from huggingface/"
                   "pytorch-image-models at the commit of the GPU machine's timm), for the photos-timm check")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ctx", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        return stage(args.stage_python, args.timm_train)
    if args.child:
        spec = json.loads(Path(args.ctx).read_text())
        run_child(args.child, Ctx(**{**spec, "work": Path(spec["work"])}), Path(args.rows))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # its rows are written: skip tearing down the modules it imported (about a second)
    try:
        chosen_checks(args.only, args.dry_run)
    except ValueError as e:
        p.error(str(e))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    env = suite_env(args.dry_run)
    imports = install_carried(env, work)
    (work / CARRIED_FILE).write_text(json.dumps({**imports, "site": str(work / "site") if imports["installed"]
                                                 else ""}))
    if any(d in imports["missing"] for _, d in NEEDED + RUNNER_NEEDS):
        print(f"gpu_suite: this machine lacks {', '.join(imports['missing'])}: the checks that need them will fail; "
              f"run --stage where a package index is reachable and carry .carry", file=sys.stderr)
    if "pytest" in imports["missing"]:
        print("gpu_suite: the suite's checks are pytest tests: pip install pytest pytest-xdist (or -e '.[test]'), or "
              "carry .carry (--stage) to a machine without an index", file=sys.stderr)
        return 2
    budget = args.budget or (DRY_BUDGET_SECONDS if args.dry_run else BUDGET_SECONDS)
    jobs = args.jobs or (2 if args.dry_run else 1)
    if jobs > 1 and _missing(env, (("xdist", "pytest-xdist"),)):
        print("gpu_suite: pytest-xdist is not installed: the checks run one at a time", file=sys.stderr)
        jobs = 1
    if args.dry_run:  # its checks' processes share the cores, whatever OMP_NUM_THREADS the caller exported
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // jobs))
    print(f"gpu suite: {'dry run on the CPU' if args.dry_run else 'GPU run'}, work folder {work}, budget "
          f"{budget:.0f} s, {jobs} check(s) at a time; pytest -m gpu {HERE.name}/{TESTS.name}", flush=True)
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(ROOT), "--gpu-work-dir", str(work), "--gpu-budget", str(budget),
           "--gpu-out", args.out, "--gpu-only", args.only,
           *(["--gpu-dry-run"] if args.dry_run else []),
           *(["-n", str(jobs), "--dist", "loadgroup"] if jobs > 1 else ["-s"])]  # -s: each row as its check ends
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
