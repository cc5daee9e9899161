"""What a step of the user's costs over fit's own step when it computes the same thing: `fit(...)` against
`fit(..., step=Plain())` whose `train_step` returns `F.nll_loss(model(x), y)` (the same weights, bit for bit), on
PyTorch's MNIST example network (examples/mnist_steplr.py: 8,000 digits, batch 64, Adadelta, no validation), on
1 process and on 2 under torchrun. Each run is a fresh process; the two run alternately, `--pairs` times; the
figure is each run's median training seconds per epoch after the first, and the ratio default / step.

    python benchmarks/step_overhead.py                 # 5 pairs on 1 and on 2 processes: about 12 minutes
    python benchmarks/step_overhead.py --pairs 3 --processes 1
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
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def job(way: str, out: str, epochs: int) -> None:
    """One training run, in this process (a worker of torchrun for 2)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F
    from mnist_steplr import Digits, Net

    import scaletrain

    class Plain(scaletrain.Step):
        def train_step(self, model, batch):
            x, y = batch
            return F.nll_loss(model(x), y)

    torch.manual_seed(1)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = epochs, 64, 0
    config.run.output_dir = out
    scaletrain.fit(Net(), Digits(0, 8000), None, config, loss_fn=F.nll_loss,
                   optimizer=lambda p: torch.optim.Adadelta(p, lr=1.0), step=Plain() if way == "step" else None)


def measure(way: str, processes: int, work: Path, k: int, epochs: int) -> float:
    out = work / f"{way}-{processes}-{k}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    launcher = [sys.executable] if processes == 1 else [*TORCHRUN, str(processes)]
    proc = subprocess.run([*launcher, __file__, "--job", way, "--out", str(out), "--epochs", str(epochs)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if proc.returncode:
        raise SystemExit(f"{way} on {processes} failed: {proc.stderr[-2000:]}")
    with (out / "metrics.csv").open() as f:
        return statistics.median(float(r["epoch_seconds"]) for r in list(csv.DictReader(f))[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--processes", default="1,2")
    p.add_argument("--work-dir", default="/tmp/scaletrain-step-overhead")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "step_overhead_cpu.json"))
    args = p.parse_args()
    if args.job:
        return job(args.job, args.out, args.epochs)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for processes in map(int, args.processes.split(",")):
        seconds: dict[str, list[float]] = {"default": [], "step": []}
        for k in range(args.pairs):
            for way in (("default", "step") if k % 2 == 0 else ("step", "default")):
                seconds[way].append(measure(way, processes, work, k, args.epochs))
            print(f"{processes} process(es), pair {k + 1}: default {seconds['default'][-1]:.3f} s, step "
                  f"{seconds['step'][-1]:.3f} s", flush=True)
        default, step = statistics.median(seconds["default"]), statistics.median(seconds["step"])
        rows.append({"processes": processes, "seconds": seconds, "median_default": default, "median_step": step,
                     "ratio_default_over_step": default / step})
    print("\n| processes | fit's step, s/epoch | a Step computing the same, s/epoch | default / step |\n"
          "|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['median_default']:.3f} | {r['median_step']:.3f} | "
              f"{r['ratio_default_over_step']:.3f} |")
    record = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "command": " ".join(["python", "benchmarks/step_overhead.py", *sys.argv[1:]]),
              "rows": rows}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
