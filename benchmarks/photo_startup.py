"""Start-up and throughput on a folder of photos: scaletrain against timm's train.py, in the same run.

Builds (once, reused) a class folder of photo-like JPEGs of 400 x 300 px (smooth colour fields, edges and
grain, quality 90: about ImageNet's shape and file size), in train/ and val/ with one subfolder per class. Reads
every file once so both contenders find the page cache warm, then runs each for one epoch of resnet18 at 64 px,
batch 64, SGD lr 0.05 on the CPU, and records:

- first step: seconds from launching the command to the end of its first optimizer step, as the contender's
  output shows it (scaletrain's `first step done` line, timm's first `Train: 0 [` line) and as seen from here;
- training images/s: timm's running average over the epoch, scaletrain's epoch figure (metrics.csv);
- the whole command's seconds and the peak resident memory of its largest process;
- beforehand, the milliseconds per file on one core of the first run's check and of decoding (`per_file_ms`).

timm's train.py is not part of the timm package: take it from huggingface/pytorch-image-models at the commit
that matches the installed timm (aa4b5850 for timm 1.0.x here) and pass its path:

    python benchmarks/photo_startup.py --timm-train /path/to/train.py            # 20,000 files
    python benchmarks/photo_startup.py --timm-train /path/to/train.py --files 400 --out /tmp/smoke.json
    python benchmarks/photo_startup.py --timm-train /path/to/train.py --files 8000 --rounds 3 --no-streamed

With `--rounds N`, timm and scaletrain (a first run over an empty cache, then a second) run in turn N times, the
order reversed every other round, and the ratios are of the medians. The first run's lines saying how much of
the folder's cache is written are timed too (`cache_complete_s`: when its last one came).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLASSES = 10
MEASURE = ("import resource, subprocess, sys\n"
           "code = subprocess.call(sys.argv[1:])\n"
           "print(f'peak_rss_kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
           "sys.exit(code)\n")


# -- the data --------------------------------------------------------------------------------------------------
def _photo(seed: int, label: int, width: int = 400, height: int = 300) -> np.ndarray:
    """A photo-like RGB image: a smooth colour field tinted by the class, a few hard-edged shapes, and grain."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, (6, 8, 3))
    small[..., label % 3] = 0.6 * small[..., label % 3] + 100  # the class shows in the colour balance
    field = np.kron(small, np.ones((height // 6 + 1, width // 8 + 1, 1)))[:height, :width]
    y, x = np.mgrid[:height, :width]
    for _ in range(4):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(15, 80)
        field[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    field += rng.normal(0, 14, field.shape)  # sensor grain: what makes photos cost bytes
    return np.clip(field, 0, 255).astype(np.uint8)


def _write(job: tuple[Path, int, int, int, int]) -> int:
    from PIL import Image, ImageFilter

    path, seed, label, width, height = job
    img = Image.fromarray(_photo(seed, label, width, height)).filter(ImageFilter.GaussianBlur(0.5))
    img.save(path, quality=90)
    return path.stat().st_size


def make_photo_folder(root: Path, files: int, val_fraction: float = 0.2, size: tuple[int, int] = (400, 300)) -> dict:
    """`files` JPEGs of `size` (width, height) in root/train/<class>/ and root/val/<class>/; kept and reused when
    already complete."""
    stamp = root / "made.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("files") == files and \
            tuple(json.loads(stamp.read_text()).get("size", (400, 300))) == tuple(size):
        return json.loads(stamp.read_text())
    jobs = []
    for i in range(files):
        split = "val" if (i // CLASSES) % round(1 / val_fraction) == 0 else "train"
        label = i % CLASSES
        folder = root / split / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((folder / f"{i:07d}.jpg", i, label, *size))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        sizes = list(pool.map(_write, jobs, chunksize=64))
    made = {"files": files, "size": list(size), "train": sum(1 for j in jobs if j[0].parts[-3] == "train"),
            "mean_kb": sum(sizes) / len(sizes) / 1024, "seconds_to_make": time.perf_counter() - t0}
    stamp.write_text(json.dumps(made))
    return made


def warm_page_cache(root: Path) -> float:
    """Read every file once; returns the MB read."""
    total = 0
    for path in root.rglob("*.jpg"):
        total += len(path.read_bytes())
    return total / 1e6


def per_file_ms(root: Path, count: int = 2000) -> dict:
    """Milliseconds per file on one core, over `count` evenly spaced files (page cache warm): the check a large
    folder's first run gives each file (its header and end marker), the 1/8-scale decode that checks any other
    file, and the decodes to the stored size of a 64 px and of a 224 px crop."""
    sys.path.insert(0, str(HERE.parent / "src"))
    from scaletrain.data.images import check_image, read_image

    files = sorted(root.rglob("*.jpg"))
    files = files[::max(1, len(files) // count)][:count]
    ways = {"header and end marker": lambda f: check_image(f),
            "decoded at 1/8 scale": lambda f: read_image(f),
            "decoded to 73 px (photo recipe, 64 px crop)": lambda f: read_image(f, 3, 73, "photo"),
            "decoded to 256 px (photo recipe, 224 px crop)": lambda f: read_image(f, 3, 256, "photo")}
    times = {}
    for name, way in ways.items():
        t0 = time.perf_counter()
        for f in files:
            way(f)
        times[name] = 1000 * (time.perf_counter() - t0) / len(files)
    return times


# -- the contenders --------------------------------------------------------------------------------------------
FIRST_STEP_ONLY = False  # --first-step-only: each command is stopped once its first step is done


def _run(cmd: list[str], first_step: re.Pattern, cwd: Path, env: dict) -> dict:
    """Run `cmd` under a peak-memory wrapper; note when its output first matches `first_step`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    seen, said, lines, cached = None, None, [], None
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.rstrip())
        if seen is None and first_step.search(line):
            seen, said = time.perf_counter() - t0, line.strip()
            if FIRST_STEP_ONLY:  # the command and everything it started
                os.killpg(proc.pid, signal.SIGKILL)
        if "the next runs start from them" in line:  # a scaletrain first run's cache of a split is complete
            cached = time.perf_counter() - t0
    code = 0 if FIRST_STEP_ONLY and seen is not None else proc.wait()
    proc.wait()
    rss = next((int(x.split()[1]) for x in reversed(lines) if x.startswith("peak_rss_kib")), 0)
    return {"exit_code": code, "first_step_seen_s": seen, "first_step_line": said, "cache_complete_s": cached, "whole_command_s": time.perf_counter() - t0,
            "peak_rss_mib": rss / 1024, "log_tail": lines[-15:], "lines": lines}


@dataclass(frozen=True)
class Job:
    """What both contenders train: the CPU comparison's resnet18 at 64 px by default; the GPU suite's photo row
    asks for resnet50 at 224 px in bf16."""

    model: str = "resnet18"
    size: int = 64
    batch: int = 64
    lr: float = 0.05
    workers: int = 2
    epochs: int = 1
    cuda: bool = False  # bf16 autocast and channels_last on the GPU; the CPU runs fp32

    def timm_args(self) -> list[str]:
        device = ["--amp", "--amp-dtype", "bfloat16", "--channels-last", "--device", "cuda"] if self.cuda else [
            "--device", "cpu", "--no-prefetcher"]
        return ["--model", self.model, "--num-classes", str(CLASSES), "--img-size", str(self.size), "-b",
                str(self.batch), "--lr", str(self.lr), "--opt", "sgd", "--epochs", str(self.epochs), "--warmup-epochs",
                "0", "-j", str(self.workers), "--log-interval", "10", *device]

    def scaletrain_args(self) -> list[str]:
        return ["--model", self.model, "--image-size", str(self.size), "--batch-size", str(self.batch), "--lr",
                str(self.lr), "--epochs", str(self.epochs), "--num-workers", str(self.workers),
                *(["--mixed-precision", "bf16"] if self.cuda else [])]


def run_timm(train_py: Path, root: Path, work: Path, env: dict, job: Job = Job(), name: str = "timm") -> dict:
    cmd = [sys.executable, str(train_py), "--data-dir", str(root), "--train-split", "train", "--val-split", "val",
           *job.timm_args(), "--output", str(work / name)]
    r = _run(cmd, re.compile(r"Train: 0 \["), work, env)
    rates = [float(m.group(1)) for m in (re.search(r"\(\s*[\d.]+s,\s*([\d.]+)/s\)", line)
                                         for line in r.pop("lines") if line.startswith("Train: 0 [")) if m]
    r["images_per_second"] = rates[-1] if rates else None
    r["first_step_s"] = r["first_step_seen_s"]  # timm prints no time since launch: the moment its line appears
    return r


def run_scaletrain(root: Path, work: Path, env: dict, extra: list[str], name: str, job: Job = Job()) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "scaletrain", "train", "--data", str(root), *job.scaletrain_args(), "--output-dir",
           str(out), *extra]
    r = _run(cmd, re.compile(r"first step done"), work, env)
    r["cache_lines"] = sum(1 for line in r["lines"] if "decoded images kept" in line)
    r.pop("lines")
    r["first_step_s"] = r["first_step_seen_s"]  # as for timm; the line also says its own count from launch
    metrics = out / "metrics.csv"
    if metrics.is_file():
        header, row = metrics.read_text().splitlines()[:2]
        r["images_per_second"] = float(dict(zip(header.split(","), row.split(",")))["images_per_second"])
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timm-train", required=True, type=Path, help="timm's train.py (see above)")
    p.add_argument("--files", type=int, default=20000, help="JPEGs to make [default: 20000]")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "scaletrain-photos",
                   help="where the folder is made and kept [default: <tmp>/scaletrain-photos-<files>]")
    p.add_argument("--out", type=Path, default=HERE / "results" / "photo_startup_cpu.json")
    p.add_argument("--rounds", type=int, default=1, help="timm, then scaletrain's first and second runs, in turn "
                   "this many times [default: 1]")
    p.add_argument("--no-streamed", dest="streamed", action="store_false",
                   help="leave out scaletrain's streamed run (--data-on-device no)")
    p.add_argument("--first-step-only", action="store_true", help="stop each command once its first step is done "
                   "(the first-step figures alone, on a busy machine)")
    p.add_argument("--nproc2", action="store_true", help="also run scaletrain with --nproc 2 (peak memory per "
                   "process of a 2-process job)")
    args = p.parse_args()
    global FIRST_STEP_ONLY
    FIRST_STEP_ONLY = args.first_step_only
    if not args.timm_train.is_file():
        sys.exit(f"--timm-train {args.timm_train}: no such file")
    root = args.data_dir.with_name(f"{args.data_dir.name}-{args.files}")
    made = make_photo_folder(root, args.files)
    print(f"folder {root}: {made['files']} JPEGs ({made['train']} train), {made['mean_kb']:.1f} KB each", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    results = {}

    def record(name: str, r: dict) -> None:
        results[name] = r
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'log_tail'})}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"page cache warmed: {warm_page_cache(root):.0f} MB read", flush=True)
        costs = per_file_ms(root)
        print("per file, one core: " + ", ".join(f"{k} {v:.3f} ms" for k, v in costs.items()), flush=True)
        for k in range(args.rounds):
            at = f", round {k + 1}" if args.rounds > 1 else ""
            cache = ["--cache-dir", str(work / f"cache{k}")]  # empty at first: the first run checks every file
            for side in ("timm", "scaletrain") if k % 2 == 0 else ("scaletrain", "timm"):
                if side == "timm":
                    record(f"timm train.py{at}", run_timm(args.timm_train, root, work, env, name=f"timm{k}"))
                else:
                    record(f"scaletrain, first run{at}", run_scaletrain(root, work, env, cache, f"first{k}"))
                    record(f"scaletrain, second run{at}", run_scaletrain(root, work, env, cache, f"second{k}"))
        if args.streamed:
            record("scaletrain, streaming (--data-on-device no)",
                   run_scaletrain(root, work, env, [*cache, "--data-on-device", "no"], "streaming"))
        if args.nproc2:
            record("scaletrain, --nproc 2, second run", run_scaletrain(root, work, env, [*cache, "--nproc", "2"],
                                                                       "nproc2"))
        if args.rounds == 1:
            record("timm train.py, again", run_timm(args.timm_train, root, work, env))
    timm = [r for name, r in results.items() if name.startswith("timm")]
    timm_first = sorted(r["first_step_s"] for r in timm if r.get("first_step_s"))
    timm_rate = sorted(r["images_per_second"] for r in timm if r.get("images_per_second"))
    print("\n| | first training step, after launch | training images/s | whole command | peak RSS, largest process |"
          "\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['first_step_s'] or float('nan'):.1f} s | {r.get('images_per_second') or float('nan'):.0f} "
              f"| {r['whole_command_s']:.0f} s | {r['peak_rss_mib']:.0f} MiB |")
    ratios = {}
    if timm_first:
        # timm's best of its runs: the strict comparison
        timm_best_first, timm_best_rate = min(timm_first), max(timm_rate or [float("nan")])
        for name, r in results.items():
            if name.startswith("scaletrain") and r.get("first_step_s"):
                ratios[name] = {"first_step_vs_timm": r["first_step_s"] / timm_best_first,
                                "images_per_second_vs_timm": (r.get("images_per_second") or 0) / timm_best_rate}
                print(f"{name} / timm: first step {ratios[name]['first_step_vs_timm']:.2f}x, images/s "
                      f"{ratios[name]['images_per_second_vs_timm']:.2f}x")
        print(f"(against timm's best runs: first step {timm_best_first:.1f} s, {timm_best_rate:.0f} images/s)")
        if args.rounds > 1:  # the medians of each side's runs, measured in turn
            median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
            for kind in ("scaletrain, first run", "scaletrain, second run"):
                runs = [r for name, r in results.items() if name.startswith(kind)]
                first = median([r["first_step_s"] for r in runs if r.get("first_step_s")])
                rate = median([r["images_per_second"] for r in runs if r.get("images_per_second")])
                ratios[f"{kind}, medians"] = {"first_step_s": first, "images_per_second": rate,
                                              "first_step_vs_timm": first / median(timm_first),
                                              "images_per_second_vs_timm": rate / median(timm_rate)}
                print(f"{kind}, medians of {len(runs)}: first step {first:.1f} s "
                      f"({first / median(timm_first):.2f}x timm's median {median(timm_first):.1f} s), {rate:.0f} "
                      f"images/s ({rate / median(timm_rate):.2f}x timm's {median(timm_rate):.0f})")
    results["ratios"] = ratios  # type: ignore[assignment]
    from cpu_limit import cpu_name

    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_cores": os.cpu_count(), "files": args.files,
            "made": made, "command": " ".join(sys.argv), "per_file_ms_one_core": costs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["exit_code"] == 0 for name, r in results.items() if name != "ratios") else 1


if __name__ == "__main__":
    sys.exit(main())
