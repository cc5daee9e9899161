"""The default run (`scaletrain train`, no flags but the run folder) of this checkout against the same command of an
earlier commit, run alternately in fresh processes: whether both end with bitwise the same weights and the same
metrics (every column but the timings), and the ratio of their whole-command wall times.

    python benchmarks/default_unchanged.py --commit ca59d8b           # 5 pairs: about 5 minutes on a 2-core CPU
    python benchmarks/default_unchanged.py --commit ca59d8b --pairs 1 --epochs 2

The earlier commit's package is extracted with `git archive` into the work folder and run from there
(`PYTHONPATH`), with the same Python and installed packages as this checkout.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ("epoch_seconds", "images_per_second")


def extract(commit: str, work: Path) -> Path:
    """The commit's source tree under work/<commit>; its src/ folder."""
    target = work / commit
    if not (target / "src" / "scaletrain").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"


def run(src: Path, out: Path, epochs: int | None) -> float:
    """Seconds of one `scaletrain train` from `src`, its run folder `out` (made afresh)."""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "scaletrain", "train", "--output-dir", str(out),
           *(["--epochs", str(epochs)] if epochs else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={src}) failed: {proc.stderr[-2000:]}")
    return seconds


def same(a: Path, b: Path) -> dict:
    """Whether two run folders hold bitwise the same last weights and the same metrics but for the timings."""
    wa, wb = load_file(str(a / "last.safetensors")), load_file(str(b / "last.safetensors"))
    weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = [[{k: v for k, v in r.items() if k not in TIMINGS} for r in csv.DictReader((d / "metrics.csv").open())]
            for d in (a, b)]
    return {"weights_bitwise_equal": weights, "metrics_equal": rows[0] == rows[1],
            "final_val_accuracy": float(rows[1][-1]["val_accuracy"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", default="ca59d8b")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--epochs", type=int, default=None, help="default: the default run's own")
    p.add_argument("--work-dir", default="/tmp/scaletrain-default-unchanged")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "default_unchanged_cpu.json"))
    args = p.parse_args()
    work = Path(args.work_dir)
    sides = {args.commit: extract(args.commit, work), "this checkout": ROOT / "src"}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    checks = []
    for k in range(args.pairs):
        order = list(sides) if k % 2 == 0 else list(sides)[::-1]  # each side goes first in turn
        for name in order:
            seconds[name].append(run(sides[name], work / f"run-{name.replace(' ', '-')}", args.epochs))
        checks.append(same(work / f"run-{args.commit}", work / "run-this-checkout"))
        print(f"pair {k + 1}: " + ", ".join(f"{n} {s[-1]:.1f} s" for n, s in seconds.items()) + f"; {checks[-1]}",
              flush=True)
    old, new = statistics.median(seconds[args.commit]), statistics.median(seconds["this checkout"])
    print(f"\n| side | wall seconds (median of {args.pairs}) |\n|---|---|\n| {args.commit} | {old:.2f} |\n"
          f"| this checkout | {new:.2f} |\n\nspeed ratio (theirs / ours, >= 1 is as fast or faster): "
          f"{old / new:.3f}; weights bitwise equal in every pair: {all(c['weights_bitwise_equal'] for c in checks)}; "
          f"metrics equal: {all(c['metrics_equal'] for c in checks)}")
    record = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(),
              "command": " ".join(["python", "benchmarks/default_unchanged.py", *sys.argv[1:]]),
              "commit": args.commit, "seconds": seconds, "median_seconds": {args.commit: old, "this checkout": new},
              "speed_ratio": old / new, "checks": checks}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
