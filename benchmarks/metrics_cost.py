"""What three torchmetrics metrics add to validation, on 1 and 2 processes, measured side by side in one run.

Two tasks on the embedded digits (the 2,000 digits 8000-9999 as the validation set):

- classification: a small CNN (10 classes); the metrics MulticlassF1Score, MulticlassPrecision, MulticlassRecall
  (macro averages over 10 classes);
- segmentation: examples/segment_digits.py's net (N x 11 x 28 x 28 logits against 28 x 28 masks); the metrics
  MulticlassJaccardIndex (mean IoU), MulticlassAccuracy (pixels, micro) and MulticlassF1Score (Dice, macro).

Each process count is one job (`python` for 1, `torchrun --nproc-per-node 2` for 2, gloo on the CPU) that times
`scaletrain.evaluate` (the same tally as fit's validation: metrics.Measures) on the untrained, seeded net, with and
without the metrics, taking turns, `--repeats` times each after one untimed pass of each; a pass is timed from a
barrier to the last process's end (evaluate returns the values reduced over every process, so every process ends
it together). A pass includes what `evaluate` sets up each call (the runtime, the DataLoader), as a user's call does;
fit's validation pays that once per run, so `added_s` (with - without, the metrics' own cost per pass of 2,000
digits) is the figure to carry over. Reported: the median seconds of each, `ratio` = with / without and `added_s`,
in the same job.

    python benchmarks/metrics_cost.py --out benchmarks/results/metrics_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job(repeats: int, out: str) -> None:
    """One process of a job: every timing, written by the main process as JSON to `out`."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import Dataset
    from torchmetrics.classification import MulticlassF1Score, MulticlassPrecision, MulticlassRecall

    import scaletrain
    from segment_digits import DigitMasks, make_net, metrics as segmentation_metrics

    class Digits(Dataset):
        def __init__(self, start: int, stop: int):
            digits = scaletrain.data.embedded_mnist()
            self.x, self.y = digits.images[start:stop].float() / 255, digits.labels[start:stop]

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], int(self.y[i])

    def classification_metrics():
        return {"f1": MulticlassF1Score(10), "precision": MulticlassPrecision(10), "recall": MulticlassRecall(10)}

    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    cases = {"classification": (cnn, Digits(8000, 10000), classification_metrics),
             "segmentation": (make_net(32), DigitMasks(8000, 10000), segmentation_metrics)}
    config = scaletrain.TrainConfig()
    config.optim.batch_size, config.data.num_workers = 256, 0

    def timed(model, data, metrics) -> float:
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        scaletrain.evaluate(model, data, config, nn.CrossEntropyLoss(), metrics=metrics)
        return time.perf_counter() - start

    results = {}
    for name, (model, data, metrics) in cases.items():
        seconds: dict[str, list[float]] = {"without": [], "with": []}
        for round_ in range(repeats + 1):
            for kind in ("without", "with"):
                s = timed(model, data, metrics() if kind == "with" else None)
                if round_:  # the first round warms up
                    seconds[kind].append(s)
        without, with_ = statistics.median(seconds["without"]), statistics.median(seconds["with"])
        results[name] = {"without_s": without, "with_s": with_, "ratio": with_ / without,
                         "added_s": with_ - without, "seconds": seconds}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/metrics_cost_cpu.json")
    p.add_argument("--job", help=argparse.SUPPRESS)  # run as one process of a job, writing its timings here
    args = p.parse_args()
    if args.job:
        return job(args.repeats, args.job)
    rows = []
    for processes in (1, 2):
        part = Path(f"{args.out}.{processes}.part")
        launcher = [sys.executable] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        subprocess.run([*launcher, __file__, "--repeats", str(args.repeats), "--job", str(part)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))})
        for task, r in json.loads(part.read_text()).items():
            rows.append({"processes": processes, "task": task, **r})
        part.unlink()
    for r in rows:
        print(f"{r['processes']} process(es)  {r['task']:<14} without {r['without_s']:.3f} s  with three metrics "
              f"{r['with_s']:.3f} s  ratio {r['ratio']:.2f}  added {r['added_s'] * 1000:.0f} ms")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(), "repeats": args.repeats,
            "command": "python benchmarks/metrics_cost.py " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
