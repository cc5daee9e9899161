"""The GPU suite's checks (gpu_suite.py runs them, as the pytest tests of test_gpu_rows.py): correctness on CUDA,
speed against seed 000's own script, the memory estimate against the CUDA allocator, and several GPUs when present.

Every check runs in a process of its own with its own time limit (run_check), so a crash or a hang is one failed
row, not a lost report; a check the suite's budget leaves no time for is a skipped row. Each row says its section,
check, figure and verdict: pass and fail (against the bound the row states), measured (no bound), skipped (with the
reason). In a dry run every check runs with tiny sizes on the CPU: CUDA rows are skipped, their code still runs.
"""

from __future__ import annotations

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
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import _data
import _harness as h
import _peers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CARRY = ROOT / ".carry"
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
        except Exception as e:  # noqa: BLE001  a broken check is a failed row with the error, never a lost report
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


def judged_accuracy(row: Row, run_: Trained, floor: float, where: str = "") -> None:
    """pass when the run's best validation accuracy reaches the workload's floor."""
    judged(row, run_.best >= floor, f"best val accuracy >= {floor:.0%}" + (f" on {where}" if where else ""))


def cuda_only(ctx: Ctx, row: Row) -> None:
    """In a run without CUDA a CUDA row is skipped; its figure, if any, is what its code did on the CPU."""
    if ctx.cuda:
        return
    row.verdict = "skipped"
    row.reason = f"needs CUDA ({ctx.no_cuda_reason()})" + ("; the figure is from its code run on the CPU"
                                                         if row.figure else "")


# -- running commands -----------------------------------------------------------------------------------------
def run(ctx: Ctx, cmd: list[str], name: str, env: dict[str, str] | None = None, timeout: float = 600,
        grace: float = 5.0) -> h.Run:
    """Run `cmd` in the work folder: its output lines timestamped in <name>.out, its stderr in <name>.err; a command
    that hangs, silent or not, is stopped on time with everything it started."""
    return h.run(cmd, cwd=ctx.work, env={**ctx.env, **(env or {})}, timeout=timeout, grace=grace, log=ctx.work / name)


def scaletrain(ctx: Ctx, name: str, *args: str, env: dict[str, str] | None = None, expect: int | None = 0) -> h.Run:
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
    run: h.Run

    @property
    def best(self) -> float:
        return self.summary["best_val_accuracy"]

    @property
    def train_seconds(self) -> float:
        return sum(m["epoch_seconds"] for m in self.metrics)

    def steady_images_per_second(self) -> float:
        """Training images/s over the epochs after the first (warm-up, kernel selection, compilation)."""
        return h.steady(self.metrics)

    def describe(self) -> str:
        return (f"best {self.best:.2%}, final {self.summary['final_val_accuracy']:.2%}, training "
                f"{self.train_seconds:.1f} s, whole command {self.run.seconds:.1f} s")


def train(ctx: Ctx, name: str, *args: str, env: dict[str, str] | None = None, reuse: bool = False) -> Trained:
    """`scaletrain train ARGS --output-dir <work>/<name>`; with `reuse`, a finished run of that name is read back."""
    folder = ctx.work / name
    if reuse and (folder / "summary.json").exists():
        saved = json.loads((ctx.work / f"{name}.run.json").read_text())
        return Trained(folder, json.loads((folder / "summary.json").read_text()), h.metrics(folder),
                       h.Run(saved["cmd"], 0, saved["seconds"], [tuple(x) for x in saved["lines"]], ""))
    if folder.exists():
        shutil.rmtree(folder)
    r = scaletrain(ctx, name, "train", *args, "--output-dir", str(folder), env=env)
    (ctx.work / f"{name}.run.json").write_text(json.dumps({"cmd": r.cmd, "seconds": r.seconds, "lines": r.lines}))
    return Trained(folder, json.loads((folder / "summary.json").read_text()), h.metrics(folder), r)


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
    return _data.digits_npz(ctx.work / "digits-1000.npz", 1000, 200)


def kaggle_digits(ctx: Ctx) -> Path:
    """The embedded digits in seed 000's format (a Kaggle digit-recognizer folder); in a dry run, 1,000 of them."""
    return _data.kaggle_digits(ctx.work / "digit-recognizer", 1000 if ctx.dry else None)


@dataclass(frozen=True)
class SpeedJob:
    """A photo-sized training job for throughput: synthetic 3-channel images, a timm model, bf16 on a GPU."""

    model: str
    size: int
    batch: int
    train_images: int
    epochs: int
    precision: str = "bf16"


def speed_job(ctx: Ctx) -> SpeedJob:
    # A dry run checks the code path in fp32: a CPU without bf16 kernels (AVX2 only) takes torch's slow convolution
    # in bf16, 27x fp32's time, for nothing the dry run judges.
    return SpeedJob("test_resnet", 32, 32, 128, 2, "no") if ctx.dry else SpeedJob("resnet50", 224, 128, 3072, 4)


def speed_data(ctx: Ctx, job: SpeedJob) -> Path:
    return _data.random_images_npz(ctx.work / f"photos-{job.size}.npz", job.train_images, job.size, job.batch * 2)


def speed_args(ctx: Ctx, job: SpeedJob) -> list[str]:
    return ["--data", str(speed_data(ctx, job)), "--model", job.model, "--batch-size", str(job.batch),
            "--epochs", str(job.epochs), "--mixed-precision", job.precision, "--augment", "none", "--optimizer", "sgd",
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
    """fsdp on 1 and 2 processes; on 2 the model is built on the meta device, each process materialising its
    shards (each parameter replayed by its owner and broadcast over NCCL), and last.safetensors is written through
    a gloo group beside NCCL: its initial weights must be bitwise the 1-process run's."""
    w = digits(ctx)
    for n in (1, 2):
        with out.row(f"--strategy fsdp, {n} process{'es' if n > 1 else ''} (NCCL)") as row:
            if n > max(ctx.gpus, 1):
                raise Skip(f"{ctx.gpus_text()}: not measured")
            r = train(ctx, f"fsdp{n}", *w.args, "--strategy", "fsdp", "--nproc", str(n), "--save-initial-weights")
            row.figure = r.describe()
            if ctx.cuda:
                judged_accuracy(row, r, w.accuracy_floor)
            else:
                cuda_only(ctx, row)
    with out.row("--strategy fsdp, 2 processes built on the meta device: initial weights vs 1 process's") as row:
        if (ctx.work / "fsdp2" / "summary.json").exists() and (ctx.work / "fsdp1" / "summary.json").exists():
            from safetensors.torch import load_file

            a, b = (load_file(str(ctx.work / n / "initial.safetensors")) for n in ("fsdp1", "fsdp2"))
            differ = [k for k in a if k not in b or not bool((a[k] == b[k]).all())]
            last = load_file(str(ctx.work / "fsdp2" / "last.safetensors"))
            row.figure = (f"{len(a) - len(differ)} of {len(a)} tensors bitwise equal; last.safetensors "
                          f"{len(last)} tensors")
            judged(row, not differ and last.keys() == a.keys(), "bitwise equal, last.safetensors whole")
        else:
            raise Skip(f"{ctx.gpus_text()}: needs both fsdp runs (on 2 CPU processes: tests/test_big_model.py)")


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
        worst, figures, names = 0.0, [], ("regression", "multilabel", "segmentation")
        root = ctx.work / "tasks"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        r = run(ctx, [sys.executable, str(ROOT / "tests" / "tasks.py"), ",".join(names), str(root)], "tasks")
        if r.returncode:
            raise Failed(f"tests/tasks.py exited {r.returncode}: {r.tail()}")
        for task in names:
            result = json.loads((root / task / "result.json").read_text())
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


OWN_STEPS = {  # name -> what its step does
    "nlp_bert": "a Transformers model called with its batch's keys, on its own loss",
    "detect_boxes": "a detector's dict of losses, mAP",
    "dcgan_digits": "two optimizers stepped by the step",
    "wgan_gp": "a gradient penalty by autograd.grad inside the step",
    "simclr_digits": "a contrastive loss over gathered embeddings",
}
OWN_STEP_ARGS = {"wgan_gp": ("dcgan_digits", "--loss", "wgan-gp")}  # the example and its flags, where not the name
OWN_STEP_NEEDS = {"nlp_bert": ("transformers", "transformers"), "detect_boxes": ("pycocotools", "pycocotools")}


def own_step_title(name: str) -> str:
    return f"own step: {name} ({OWN_STEPS[name]}) in fp32, fp16, bf16"


def own_step_run(ctx: Ctx, name: str, precision: str) -> tuple[str, str]:
    """One example with --quick at one precision: (its figure, what went wrong or "")."""
    label = "fp32" if precision == "no" else precision
    folder = ctx.work / f"step-{name}-{precision}"
    shutil.rmtree(folder, ignore_errors=True)
    script, *flags = OWN_STEP_ARGS.get(name, (name,))
    r = run(ctx, [sys.executable, str(ROOT / "examples" / f"{script}.py"), "--quick", "--out", str(folder),
                  "--mixed-precision", precision, *flags], f"step-{name}-{precision}")
    if r.returncode:
        return f"{label}: exited {r.returncode}", f"{label} exited {r.returncode}: {r.tail()}"
    last = h.metrics(folder)[-1]
    losses = {k: v for k, v in last.items() if k.startswith("train_") and k != "train_samples"}
    bad = "" if all(math.isfinite(v) for v in losses.values()) else f"{label}: losses {losses}"
    text = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("val_"))
    if name == "dcgan_digits" and precision == "fp16":
        state = json.loads(max((folder / "state").iterdir()).joinpath("train.json").read_text())
        batches, scaler = int(state["step"]), state["scaler"]
        text = f"scaler scale {scaler['scale']:g}, growth tracker {scaler['_growth_tracker']} after {batches} batches"
        if scaler["_growth_tracker"] > batches or (scaler["scale"] == 65536.0 and
                                                   scaler["_growth_tracker"] != batches):
            bad = f"fp16: {text} (the scaler is updated once per batch)"
    return f"{label}: train_loss {last['train_loss']:.4f}" + (f", {text}" if text else ""), bad


def check_own_steps(ctx: Ctx, out: Sink) -> None:
    """Users' own steps on the GPU in fp32, fp16 and bf16 (examples/ with --quick), one row per example: every run
    finishes with finite losses; fp16's loss scaler is updated once per batch with two optimizers (its growth tracker
    counts batches, not optimizer steps). Nothing here is timed, so an example's three precisions run side by side.
    A dry run trains the GAN in fp32 on the CPU (bf16 convolutions take torch's slow path on a CPU without bf16
    kernels) and reports the other rows as needing CUDA without running them."""
    from concurrent.futures import ThreadPoolExecutor

    for name in OWN_STEPS:
        with out.row(own_step_title(name)) as row:
            if name in OWN_STEP_NEEDS and missing(ctx.env, (OWN_STEP_NEEDS[name],)):
                raise Skip(f"{OWN_STEP_NEEDS[name][1]} is not installed here")
            if not ctx.cuda and name != "dcgan_digits":
                cuda_only(ctx, row)
                continue
            with ThreadPoolExecutor(3) as pool:
                done = list(pool.map(lambda p: own_step_run(ctx, name, p), ("no", "fp16", "bf16") if ctx.cuda
                                     else ("no",)))
            bad = [b for _, b in done if b]
            row.figure = "; ".join(f for f, _ in done) + (f"; FAILED: {'; '.join(bad)}" if bad else "")
            if not ctx.cuda:
                if bad:
                    raise Failed("; ".join(bad))
                cuda_only(ctx, row)
                continue
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


def _pair(ctx: Ctx, row: Row, name: str, theirs: list[str], ours: list[str], images: int, folder: Path,
          text: str) -> None:
    """Two contenders' images/s over the epochs after the first, on a measured row: the peer's from its own
    lines, scaletrain's from metrics.csv; `text` formatted with both and their ratio."""
    rates = []
    for side, cmd in (("peer", theirs), ("scaletrain", ours)):
        r = run(ctx, cmd, f"{name}-{side}", timeout=90)
        if r.returncode or r.stopped:
            raise Failed(f"{name} {side}: {r.stopped or f'exit {r.returncode}'}: {r.tail()}")
        rates.append(h.images_per_second(h.epochs(r, _peers.SEED000_LINE), images) if side == "peer"
                     else h.steady(h.metrics(folder)))
    row.figure, row.verdict = text.format(rates[0], rates[1], rates[1] / rates[0]), "measured"
    cuda_only(ctx, row)


def check_peer(ctx: Ctx, out: Sink) -> None:
    """seed 000's own script against `scaletrain train` at its settings: model, per-device batch, optimizer."""
    model, size, batch, epochs = ("test_convnext", 56, 64, 2) if ctx.dry else ("convnext_small", 56, 256, 3)
    data = kaggle_digits(ctx)
    n_train = _peers.train_rows(data)
    for precision in ("no", "fp16"):
        with out.row(f"seed 000 vs scaletrain, {'fp32' if precision == 'no' else precision}, images/s") as row:
            if precision == "fp16" and not ctx.cuda:
                raise Skip(f"fp16 needs a GPU ({ctx.no_cuda_reason()})")
            need_peer(ctx)
            folder = ctx.work / f"peer-{precision}"
            shutil.rmtree(folder, ignore_errors=True)
            shape = {"model": model, "size": size, "batch": batch, "precision": precision}
            _pair(ctx, row, f"peer-{precision}", _peers.seed000(Path(ctx.peers), data, epochs, **shape),
                  _peers.scaletrain_as_seed000(data, epochs, str(folder), **shape), n_train // batch * batch, folder,
                  f"{model} {size} px, batch {batch}: seed 000 {{0:,.0f}}, scaletrain {{1:,.0f}} images/s: {{2:.2f}}x")


def check_own_code(ctx: Ctx, out: Sink) -> None:
    """seed 000's own script against its own Dataset and model through `scaletrain.fit`, at equal settings (as
    benchmarks/cpu_limit.py runs them on the CPU): what handing the loop to scaletrain costs on a GPU."""
    model, size, batch, epochs = "resnet18", 56, 256, 3
    with out.row("seed 000's own Dataset and model: its loop vs scaletrain.fit, fp32, images/s") as row:
        if ctx.dry:
            raise Skip("a speed pair for a GPU; on the CPU it is benchmarks/cpu_limit.py, and tests/test_own_code.py "
                       "trains seed 000's classes through fit")
        need_peer(ctx)
        data = kaggle_digits(ctx)
        folder = ctx.work / "own-code-fit"
        shutil.rmtree(folder, ignore_errors=True)
        n_train = _peers.train_rows(data)
        _pair(ctx, row, "own-code", _peers.seed000(Path(ctx.peers), data, epochs, model, size, batch),
              h.job(_peers.fit_seed000, peers=ctx.peers, data=str(data), out=str(folder), epochs=epochs, model=model,
                    image_size=size, batch_size=batch), n_train // batch * batch, folder,
              f"{model} {size} px, batch {batch}: seed 000's loop {{0:,.0f}}, scaletrain.fit {{1:,.0f}} images/s: "
              f"{{2:.2f}}x")

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
        row.figure = (f"{job.model} {job.size} px {job.precision} batch {job.batch}: "
                      f"{base.steady_images_per_second():,.0f} images/s x {flops / 1e9:.2f} GFLOP = "
                      f"{achieved / 1e12:.2f} TFLOP/s")
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
    """The seeds' training augmentation (flips, brightness/contrast, resize 28 -> 56, normalise) making batches of
    256 from the 8,000 embedded training digits, no model: scaletrain's batch pipeline (the data on the device, and
    uint8 batches from 2 DataLoader workers augmented after) against seed 000's per-sample albumentations
    DataLoader with 2 workers (its get_transform and MiniDataSet, unchanged). One pass each to warm up, then the
    contenders in turn."""
    with out.row("on-device input pipeline vs seed 000's albumentations DataLoader") as row:
        need_peer(ctx)
        import torch

        from scaletrain.data import load_image_sets, mean_std
        from scaletrain.data.batches import DeviceBatches, LoaderBatches
        from scaletrain.data.transforms import Preprocess

        sys.path.insert(0, ctx.peers)
        import seed000_accelerate as peer

        device = torch.device("cuda" if ctx.cuda else "cpu")
        train_set, _ = load_image_sets("default")
        pre, common = Preprocess(1, 56, *mean_std(train_set)), {
            "train": True, "rank": 0, "world": 1, "seed": 0, "channels_last": True,
            "augment": ("hflip", "vflip", "brightness", "contrast")}
        theirs = torch.utils.data.DataLoader(peer.MiniDataSet(train_set.images[:, 0].numpy(), train_set.labels.numpy(),
                                                              peer.get_transform(56, train=True)),
                                             batch_size=256, num_workers=2, shuffle=True, drop_last=True)
        made = {"on device": DeviceBatches(train_set, pre, device, 256, **common),
                "DataLoader + device augmentation": LoaderBatches(train_set, device, 256, num_workers=2, pre=pre,
                                                                  **common), "seed 000": theirs}
        rates: dict[str, list[float]] = {name: [] for name in made}
        for k in range(2 if ctx.dry else 6):  # the first pass warms up
            for name, batches in made.items():
                it = batches.epoch(k) if hasattr(batches, "epoch") else ((b["image"].to(device), b["label"])
                                                                           for b in batches)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0, n = time.perf_counter(), sum(len(x) for x, _ in it)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if k:
                    rates[name].append(n / (time.perf_counter() - t0))
        peer_rate = statistics.median(rates["seed 000"])
        row.figure = "; ".join(f"{name} {statistics.median(v):,.0f} images/s ({statistics.median(v) / peer_rate:.1f}x)"
                               for name, v in rates.items())
        row.verdict = "measured"
        cuda_only(ctx, row)


STAGES_EXAMPLE = ROOT / "examples" / "pipeline_blocks.py"


SPLITS = {"stages": ("--strategy pipeline, 2 stages (NCCL)", ["--stages", "2"], "tests/test_pipeline.py"),
          "tp": ("--tp 2, each block's MLP split (NCCL)", ["--tp", "2"], "tests/test_tensor_parallel.py")}


def check_stages(ctx: Ctx, out: Sink, split: str = "stages") -> None:
    """examples/pipeline_blocks.py as 2 pipeline stages (or with each block's MLP split, --tp 2) on 2 GPUs (NCCL)
    against the model whole on one, in fp32, bf16 and fp16: the per-epoch losses alike (fp32 within 1e-4; 16 bits
    within 5e-2, as bf16 on the CPU differs by 1.6e-2). Needs 2 GPUs; the 2-process CPU form is the tests'."""
    title, flags, tests = SPLITS[split]
    for precision in ("no", "bf16", "fp16"):
        with out.row(f"{title} vs the model whole, {'fp32' if precision == 'no' else precision}") as row:
            if ctx.gpus < 2 and not (ctx.dry and split == "tp" and precision == "no"):  # (a dry run: on gloo)
                raise Skip(f"{ctx.gpus_text()}: needs 2 GPUs ({tests} runs it on 2 CPU processes)")
            losses = {}
            for name, launcher, args in (("whole", [sys.executable], []), (
                    split, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                    flags)):
                folder = ctx.work / f"{split}-{name}-{precision}"
                shutil.rmtree(folder, ignore_errors=True)
                size = ["--width", "128", "--samples", "512"] if ctx.dry else ["--width", "256", "--samples", "2048"]
                r = run(ctx, [*launcher, str(STAGES_EXAMPLE), "--out", str(folder), "--mixed-precision", precision,
                              *size, *args], f"{split}-{name}-{precision}")
                if r.returncode != 0:
                    raise Failed(f"{name} exited {r.returncode}: {r.tail()}")
                losses[name] = [m["train_loss"] for m in h.metrics(folder)]
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses[split], losses["whole"]))
            row.figure = (f"train losses whole {', '.join(f'{v:.5f}' for v in losses['whole'])}; {' '.join(flags)} "
                          f"{', '.join(f'{v:.5f}' for v in losses[split])}; largest relative difference "
                          f"{worst:.1e}")
            judged(row, worst <= (1e-4 if precision == "no" else 5e-2),
                   "within 1e-4" if precision == "no" else "within 5e-2")


FOREACH = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from scaletrain.parallel.engine import foreach_where_it_can
device = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl" if device == "cuda" else "gloo")
mesh = init_device_mesh(device, (1,))
split = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4, device=device), mesh, [Shard(0)]))
whole = torch.nn.Parameter(torch.randn(4, device=device))
said = []
for fixed in (False, True):  # torch's default (foreach on a GPU; asked for on the CPU), then as scaletrain leaves it
    opt = torch.optim.AdamW([split, whole], lr=0.1, foreach=None if device == "cuda" else True)
    if fixed:
        foreach_where_it_can(opt)
    (split.full_tensor().sum() + whole.sum()).backward()
    try:
        opt.step()
        said.append("stepped")
    except Exception as e:
        said.append(type(e).__name__)
    opt.zero_grad()
print("@said", " ".join(said))
dist.destroy_process_group()
"""


def check_foreach(ctx: Ctx, out: Sink) -> None:
    """A parameter group that mixes split parameters (DTensors, as --tp leaves a model with one replica, and every
    pipeline stage under --tp) and whole ones, under AdamW with torch's default on CUDA (foreach kernels, which
    refuse the mix): scaletrain's optimizer steps it. One process, one GPU (a mesh of one); the dry run asks for
    foreach on the CPU."""
    with out.row("an optimizer's foreach over split and whole parameters mixed (one GPU)") as row:
        if not ctx.cuda and not ctx.dry:
            raise Skip(ctx.no_cuda_reason())
        r = run(ctx, [sys.executable, "-c", FOREACH, "cuda" if ctx.cuda else "cpu", str(29400 + os.getpid() % 1000)],
                "foreach")
        said = next((line.split()[1:] for _, line in r.lines if line.startswith("@said")), None)
        if r.returncode != 0 or said is None:
            raise Failed(f"exited {r.returncode}: {r.tail()}")
        row.figure = f"torch's default: {said[0]}; as scaletrain leaves the optimizer: {said[1]}"
        judged(row, said[1] == "stepped", "steps")


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
    """A folder of photo-like JPEGs (_data.photo_folder) through the photo recipe on CUDA: decoded in the checking
    pass and held on the device, found in the cache by a second run, and prepared into shards and streamed."""
    files, model, size, batch = (60, "tinycnn", 32, 8) if ctx.dry else (4000, "resnet18", 128, 128)
    folder = ctx.work / "photo-folder"
    _data.photo_folder(folder, files)
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
                  "photos: --compile (blocks, whole) vs off: first step, steady images/s, whole command",
                  "photos streamed: --decode device vs --decode workers",
                  "--decode device: the first batches' pixels against the workers' decode")


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
    cores = os.cpu_count() or 2
    if ctx.dry:
        files, shape, job = 120, (100, 75), _peers.PhotoJob("test_resnet", 32, 16, 0.1, 2, 1)
    else:
        files, shape, job = 20000, (500, 375), _peers.PhotoJob("resnet50", 224, 256, 0.1, cores, 2, cuda=True)
    folder = ctx.work / f"imagenet-shaped-{files}"
    made = _data.photo_folder(folder, files, size=shape)
    _data.warm(folder)  # both contenders find the files in the page cache
    cache = ["--cache-dir", str(ctx.work / "imagenet-shaped-cache")]
    settings = f"{files} JPEGs of {shape[0]}x{shape[1]} ({made['mean_kb']:.0f} KB), {job.model} {job.size} px, " \
               f"batch {job.batch}, {job.workers} workers, {job.epochs} epoch(s)"

    def measured(name: str, cmd: list[str], first: str, folder: Path | None = None) -> dict:
        r = h.run(cmd, cwd=ctx.work, env=ctx.env, memory=True, merge=True, log=ctx.work / name)
        if r.returncode:
            raise Failed(f"{name} exited {r.returncode}: {r.tail()}")
        return {"first_step_s": r.first(first), "peak_rss_mib": r.peak_rss_mib or 0.0, "images_per_second":
                h.metrics(folder)[0]["images_per_second"] if folder else _peers.timm_images_per_second(r),
                "steady": h.steady(h.metrics(folder)) if folder else None, "seconds": r.seconds}

    def said(r: dict, name: str) -> str:
        return (f"{name} {r['images_per_second'] or float('nan'):,.0f} images/s, first step "
                f"{r['first_step_s'] or float('nan'):.1f} s, peak host memory {r['peak_rss_mib']:,.0f} MiB")

    def ours(name: str, *extra: str) -> dict:
        return measured(name, job.scaletrain(folder, ctx.work / name, *cache, *extra), _peers.FIRST_STEP,
                        ctx.work / name)

    first: dict = {}
    with out.row(PHOTOS_VS_TIMM[0]) as row:
        first = ours("photos-timm-scaletrain")
        row.figure = f"{settings}: {said(first, 'scaletrain (first run)')}"
        if ctx.dry:
            raise Skip("timm's side runs on a GPU only (dry run on the CPU); benchmarks/photo_startup.py is the "
                       "CPU comparison")
        train_py = timm_train_py()
        if train_py is None:
            raise Skip("timm's train.py not in .carry/timm: run `python benchmarks/gpu_suite.py --stage "
                       "--timm-train <train.py>` and carry .carry")
        theirs = measured("photos-timm-timm", job.timm(train_py, folder, ctx.work / "photos-timm-timm"),
                          _peers.TIMM_FIRST_STEP)
        row.figure += f"; {said(theirs, 'timm')}"
        ratio = (first["images_per_second"] or 0) / (theirs["images_per_second"] or float("inf"))
        row.figure += (f": {ratio:.2f}x timm's images/s, first step "
                       f"{first['first_step_s'] / theirs['first_step_s']:.2f}x")
        judged(row, ratio >= 1.0, "scaletrain's images/s at least timm's")
    with out.row(PHOTOS_VS_TIMM[1]) as row:
        if not first.get("images_per_second"):
            raise Failed("the photo run failed")
        synthetic = SpeedJob(job.model, job.size, job.batch, job.batch * (2 if ctx.dry else 12), 3)
        limit = train(ctx, "photos-timm-limit", "--data", str(speed_data(ctx, synthetic)), *job.scaletrain_args()[:8],
                      "--epochs", "3", *(["--mixed-precision", "bf16"] if job.cuda else []))
        ratio = first["images_per_second"] / limit.steady_images_per_second()
        row.figure = (f"photos {first['images_per_second']:,.0f} images/s, synthetic on the device "
                      f"{limit.steady_images_per_second():,.0f}: {ratio:.2f} of the limit")
        if ctx.cuda:
            judged(row, ratio >= 0.9, "photos at least 0.9 of the limit")
        else:
            cuda_only(ctx, row)
    with out.row(PHOTOS_VS_TIMM[2]) as row:
        if not ctx.cuda:
            raise Skip(f"not run on the CPU ({ctx.no_cuda_reason()}): compiling takes minutes on 2 cores")
        runs = {flag: ours(f"photos-timm-{flag}", *extra) for flag, extra in (
            ("off", []), ("blocks", ["--compile"]), ("whole", ["--compile", "--compile-scope", "whole"]))}
        row.figure = "; ".join(f"--compile {flag} (second run): first step {r['first_step_s'] or float('nan'):.1f} s, "
                               f"steady {r['steady']:,.0f} images/s, whole command {r['seconds']:.0f} s"
                               for flag, r in runs.items())
        off = runs["off"]
        row.figure += "; " + ", ".join(f"{flag} {r['steady'] / off['steady']:.2f}x steady, "
                                       f"{off['seconds'] / r['seconds']:.2f}x the whole command"
                                       for flag, r in runs.items() if flag != "off")
        row.verdict = "measured"
    with out.row(PHOTOS_VS_TIMM[3]) as row:
        if not ctx.cuda:  # the CPU's "device" decoder is the workers' own: nothing to compare
            raise Skip(f"needs CUDA ({ctx.no_cuda_reason()}): not measured")
        runs = {how: ours(f"photos-timm-decode-{how}", "--data-on-device", "no", "--decode", how)
                for how in ("workers", "device")}
        row.figure = "; ".join(said(r, f"--decode {how}") for how, r in runs.items())
        row.figure += f": {runs['device']['images_per_second'] / runs['workers']['images_per_second']:.2f}x"
        losses = [m["train_loss"] for m in h.metrics(ctx.work / "photos-timm-decode-device")]
        row.figure += f"; --decode device's training losses {', '.join(f'{v:.3f}' for v in losses)}"
        judged(row, all(math.isfinite(v) for v in losses), "--decode device trains (finite losses)")
    with out.row(PHOTOS_VS_TIMM[4]) as row:
        gap = decoded_pixels_gap(folder, job.size, 8 if ctx.dry else 64, "cuda" if ctx.cuda else "cpu")
        row.figure = f"mean |device - workers| over the first 2 batches: {gap:.2f} pixel levels of 255"
        judged(row, gap < 4, "within the JPEG decoders' rounding (mean under 4 levels)")
        if not ctx.cuda:
            row.reason += "; on the CPU (torchvision's batched CPU decoder stands in for nvJPEG)"


def decoded_pixels_gap(folder: Path, size: int, batch: int, device: str) -> float:
    """Mean absolute difference, in pixel levels, between the stored images of the first 2 training batches as
    --decode device makes them (on `device`, a batch ahead on its own stream) and as the workers decode them."""
    import torch

    from scaletrain.config import DataConfig
    from scaletrain.data import load_image_sets
    from scaletrain.data.batches import LoaderBatches

    files, _ = load_image_sets(DataConfig(data=str(folder), image_size=size, data_on_device="no"))
    common = dict(train=True, rank=0, world=1, seed=0, channels_last=False)
    made = {how: LoaderBatches(files, torch.device(device), batch, num_workers=2, decode_on_device=how == "device",
                               **common) for how in ("device", "workers")}
    gaps = []
    for (xd, _), (xw, _) in zip(*(made[how].epoch(0) for how in ("device", "workers"))):
        gaps.append((xd.float() - xw.to(xd.device).float()).abs().mean().item())
        if len(gaps) == 2:
            break
    for m in made.values():
        m.close()
    return sum(gaps) / len(gaps)


# -- memory ---------------------------------------------------------------------------------------------------
MEMORY_CASES = {"resnet50": ("resnet50", 224, 128), "convnext_small": ("convnext_small", 224, 64),
                "vit_base_patch16_224": ("vit_base_patch16_224", 224, 64)}
DRY_MEMORY_CASES = {"resnet50": ("test_resnet", 64, 8), "convnext_small": ("test_convnext", 64, 8),
                    "vit_base_patch16_224": ("test_vit", 64, 8)}
MEMORY_BOUND = (0.8, 1.25)


def measured_peak(name: str, size: int, batch: int, device) -> int:
    """Peak bytes in use during one real AdamW training step in bf16 autocast, optimizer step included, above what
    was in use before the model and the batch: on a GPU torch.cuda.max_memory_allocated, on the CPU the C
    allocator's bytes in use, sampled after every op. One warm-up step first (optimizer state, kernel caches); the
    measured step starts with the gradients set to None, as training does."""
    import gc

    import torch
    import torch.nn.functional as F

    from scaletrain.config import TrainConfig
    from scaletrain.measure.memory import AllocatorPeak, c_allocator_bytes
    from scaletrain.models import build_model
    from scaletrain.training.optim import make_optimizer

    cuda = device.type == "cuda"
    in_use = torch.cuda.memory_allocated if cuda else c_allocator_bytes()
    gc.collect()
    base = in_use()
    model = build_model(name, 3, 10).to(device).train()
    opt = make_optimizer(model, TrainConfig.from_dict({"optim": {"optimizer": "adamw"}}).optim)
    images, labels = torch.randn(batch, 3, size, size, device=device), torch.randint(0, 10, (batch,), device=device)
    base += images.nbytes + labels.nbytes  # the batch is data, not the step's memory

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if not cuda:
        sampler = AllocatorPeak(in_use)
        with sampler:
            step()
        return sampler.peak - base
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory_check(key: str) -> Callable[[Ctx, Sink], None]:
    def check(ctx: Ctx, out: Sink) -> None:
        with out.row(f"estimate-memory vs the CUDA allocator's peak: {key}") as row:
            import torch

            from scaletrain.measure.memory import estimate

            name, size, batch = (DRY_MEMORY_CASES if ctx.dry else MEMORY_CASES)[key]
            est = estimate(name, image_size=size, channels=3, batch_size=batch, mixed_precision="bf16",
                           optimizer="adamw")
            peak = measured_peak(name, size, batch, torch.device("cuda" if ctx.cuda else "cpu"))
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
              "--mixed-precision", job.precision, "--batch-size", str(job.batch)]
    link = "pcie" if ctx.dry else "measure"  # 2 more CPU processes would only measure loopback
    ddp = _bench(ctx, "bench-ddp", *common, "--nproc", f"1,{n}", "--interconnect", link,
                 "--project-devices", str(n), "--project-nodes", "1")
    one, many = (next(r for r in ddp["cells"] if r["devices"] == k) for k in (1, n))
    with out.row(titles[0]) as row:
        row.figure = (f"{job.model} {job.precision} batch {job.batch} per {unit}: {one['seconds_per_epoch']:.2f} "
                      f"s/epoch on 1, {many['seconds_per_epoch']:.2f} on {n}: speed-up {many['speedup']:.2f}x "
                      f"({many['efficiency']:.0%})")
        row.verdict = "measured"
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
    Check("fsdp", _rows("correctness", "--strategy fsdp, 1 process (NCCL)", "--strategy fsdp, 2 processes (NCCL)",
                        "--strategy fsdp, 2 processes built on the meta device: initial weights vs 1 process's"),
          check_fsdp, 120),
    Check("sync-bn", _rows("correctness", "--sync-bn on every GPU (SyncBatchNorm, NCCL)"), check_sync_bn, 60),
    Check("predict", _rows("correctness", "predict on CUDA vs the CPU (same weights)"), check_predict, 60,
          after=("default",)),
    Check("evaluate", _rows("correctness", "evaluate on CUDA vs the CPU (same weights)"), check_evaluate, 60,
          after=("default",)),
    Check("tasks", _rows("correctness", "any task through fit: torchmetrics on the device vs the whole set"),
          check_tasks, 120),
    Check("resume", _rows("correctness", "SIGKILL + resume ends equal to the uninterrupted run"), check_resume, 120),
    Check("own-steps", _rows("correctness", *map(own_step_title, OWN_STEPS)), check_own_steps, 180),
    Check("multi-gpu", _rows("multi-gpu", "DDP on 1 vs every GPU", "DP on every GPU vs DDP",
                             "NCCL all-reduce bandwidth vs bench's projection"), check_multi_gpu, 300),
    Check("stages", _rows("multi-gpu", *(f"--strategy pipeline, 2 stages (NCCL) vs the model whole, {p}"
                                         for p in ("fp32", "bf16", "fp16"))), check_stages, 150),
    Check("foreach", _rows("correctness", "an optimizer's foreach over split and whole parameters mixed (one GPU)"),
          check_foreach, 60),
    Check("tp", _rows("multi-gpu", *(f"{SPLITS['tp'][0]} vs the model whole, {p}" for p in ("fp32", "bf16", "fp16"))),
          lambda ctx, out: check_stages(ctx, out, "tp"), 150),
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
def run_child(name: str, ctx: str, rows: str) -> None:
    """Inside a check's own process (h.job): run it, its rows going to `rows`, then leave without tearing down the
    modules it imported (about a second)."""
    check = next(c for c in CHECKS if c.name == name)
    spec = json.loads(Path(ctx).read_text())
    signal.signal(signal.SIGTERM, h.stop_all_and_exit)  # a check told to stop takes its commands with it
    check.run(Ctx(**{**spec, "work": Path(spec["work"])}), Sink(Path(rows), {t: s for s, t in check.rows}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_check(check: Check, ctx: Ctx, timeout: float, by_budget: bool = False) -> list[Row]:
    """Run one check in a fresh process; whatever it did not report (a crash, a time-out) is a failed row, but for
    a check stopped by the suite's budget (`by_budget`: what was left of it, not the check's own limit, set
    `timeout`): its unreported rows are skipped, saying so (a slow machine is not a failing check)."""
    rows_path = ctx.work / f"{check.name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    spec = ctx.work / "ctx.json"
    spec.write_text(json.dumps({**asdict(ctx), "work": str(ctx.work)}))
    r = run(ctx, h.job(run_child, name=check.name, ctx=str(spec), rows=str(rows_path)), f"check-{check.name}",
            timeout=timeout, grace=10.0)  # a grace longer than its commands'
    got = {row["check"]: Row(**row) for row in map(json.loads, rows_path.read_text().splitlines())} \
        if rows_path.exists() else {}
    if r.returncode == 0:
        why = "the check ended without reporting this row"
    elif r.stopped == "timeout" and by_budget:
        return [got.get(title) or Row(section, title, "", "skipped", f"the suite's budget ran out {timeout:.0f} s "
                                      f"into this check, before its own limit") for section, title in check.rows]
    elif r.stopped == "timeout":
        why = f"the check timed out after {timeout:.0f} s"
    else:
        why = f"the check's process exited {r.returncode}: {r.tail()}"
    return [got.get(title) or Row(section, title, "", "fail", why) for section, title in check.rows]


NEEDED = (("accelerate", "accelerate"), ("timm", "timm"), ("safetensors", "safetensors"), ("yaml", "PyYAML"),
          ("tqdm", "tqdm"), ("PIL", "pillow"), ("matplotlib", "matplotlib"))
RUNNER_NEEDS = (("pytest", "pytest"), ("pluggy", "pluggy"), ("iniconfig", "iniconfig"), ("pygments", "pygments"),
                ("packaging", "packaging"))  # the suite's runner and what it needs
PEER_NEEDS = (("albumentations", "albumentations"), ("pandas", "pandas"), ("cv2", "opencv-python-headless"))
TASK_NEEDS = (("torchmetrics", "torchmetrics"), ("lightning_utilities", "lightning-utilities"),  # tests/tasks.py
              ("pycocotools", "pycocotools"), ("transformers", "transformers"))  # examples/ of own steps
def missing(env: dict[str, str], needs) -> list[str]:
    """Distributions whose module does not import in a process started with `env`."""
    code = ("import importlib.util, sys\n"
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([sys.executable, "-c", code, *(m for m, _ in needs)], env=env, capture_output=True,
                         text=True, check=False).stdout.split()
    return [d for m, d in needs if m in out]

def peer_unavailable(missing: list[str]) -> str:
    """Why seed 000's script cannot run here ("" when it can)."""
    lacking = [d for _, d in PEER_NEEDS if d in missing]
    return (f"{', '.join(lacking)} not importable: run `python benchmarks/gpu_suite.py --stage` and carry .carry "
            "(or pip install -e '.[peers]')") if lacking else ""


def chosen_checks(only: str, dry: bool) -> list[Check]:
    """The checks `--only` names (comma-separated), else every one but those that need a call of their own (a dry
    run runs those too). Refuses an unknown name."""
    names = [n for n in only.split(",") if n]
    unknown = set(names) - {c.name for c in CHECKS}
    if unknown:
        raise ValueError(f"--only: unknown check {min(unknown)}; choose from {', '.join(c.name for c in CHECKS)}")
    return [c for c in CHECKS if c.name in names or not names and (dry or not c.alone)]


def suite_env(dry: bool) -> dict[str, str]:
    """The environment of every process the suite starts: src/ importable; in a dry run no GPU."""
    env = h.env()
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
    peers = _peers.peers()
    ctx = Ctx(dry, gpus, work, env, str(peers) if peers else None, peer_unavailable(carried.get("missing", [])))
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
    """Every runner's rows in the order of the checks, printed as one table and written as JSON with the machine
    and the commit (by default, on a GPU, to results/gpu_suite_<date>_<gpu>.json; a dry run only with `out`)."""
    import torch

    found = {p.stem: [Row(**r) for r in json.loads(p.read_text())] for p in suite_work.glob(f"*/{ROWS_DIR}/*.json")}
    rows = [row for check in chosen for row in found.get(check.name) or [
        Row(sec, title, "", "fail", "the check reported nothing (its runner stopped)") for sec, title in check.rows]]
    gpus = 0 if dry else torch.cuda.device_count()
    machine = h.machine()
    meta = {"gpu": torch.cuda.get_device_name(0) if gpus else None, "gpus": gpus,
            "driver": machine["gpus"][0].rsplit(", ", 1)[-1] if machine["gpus"] else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
            "dry_run": dry, "cpu_cores": os.cpu_count(), "seconds": round(seconds, 1)}
    carried = suite_work / CARRIED_FILE
    if carried.exists():
        c = json.loads(carried.read_text())
        meta.update(installed_from_carry=c["installed"], missing=c["missing"])
    title = (f"{meta['date']}, {meta['gpu'] or 'no GPU'} (x{gpus}), driver {meta['driver']}, torch {meta['torch']}, "
             f"CUDA {meta['cuda']}, {meta['seconds']:.0f} s{' (dry run)' if dry else ''}")
    table = [{"section": r.section, "check": r.check, "figure": r.figure or None, "verdict": r.verdict
              if r.verdict in ("pass", "measured") else f"**{r.verdict}**: {r.reason}"} for r in rows]
    out = out or ("" if dry else str(HERE / "results" / "gpu_suite_{}_{}.json".format(
        meta["date"], (meta["gpu"] or "cpu").replace("NVIDIA ", "").replace(" ", "-"))))
    if out:
        h.record("gpu_suite", [asdict(r) for r in rows], out, title, shown=table, meta=meta)
    else:
        print(f"\n{title}\n\n{h.markdown(table)}", flush=True)
    return rows


if __name__ == "__main__":
    h.main(None, run_child)
