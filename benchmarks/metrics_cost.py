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

`--memory` measures instead what merging the Metrics' states over 2 processes holds (metrics.merge_states, the
gather at the end of each validation pass), for two metrics whose states grow with the set: torchmetrics'
MeanAveragePrecision over 5,000 images (100 detections and 1 to 12 ground-truth boxes each: 2,500 images per
process), and a per-pixel BinaryAUROC (thresholds=None) over 400 masks of 128 x 128. Each process fills its metric
with its strided shard, then merges; measured per process: the bytes of its states before (`local_mb`) and of the
merged states after (`merged_mb`, every rank's), and the resident memory above the process's before the metric was
made: filled (`filled_rss_mb`), merged (`held_rss_mb`: the merged states with their tensors' own overhead, 45,000
small tensors for mAP) and at the peak of the merge (`peak_rss_mb`, /proc/self/status VmHWM reset through
/proc/self/clear_refs; glibc told to hand freed blocks back, so the figures are what was live). `extra_copies` =
(peak - held) / held: what the merge held beyond the merged states, in copies of them. The earlier merge (one
pickled gather of every state) is measured the same way beside it. The values themselves are not computed here
(tests/test_metric_collections.py checks them).

    python benchmarks/metrics_cost.py --memory --out benchmarks/results/metrics_merge_memory_cpu.json
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


CASES = [(metric, way) for metric in ("MeanAveragePrecision, 5,000 images", "BinaryAUROC, 400 x 128 x 128 pixels")
         for way in ("scaletrain", "one pickled gather (earlier)")]


def memory_job(case: int, out: str) -> None:
    """One of 2 processes: CASES[case]'s metric filled with this rank's shard and merged its way (a fresh job per
    case: memory one case freed stays with the process); the main process writes the figures as JSON to `out`."""
    import gc

    import torch
    import torch.distributed as dist
    from torchmetrics.classification import BinaryAUROC
    from torchmetrics.detection import MeanAveragePrecision

    from scaletrain.metrics import merge_states, metric_parts

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(value):
        gathered = [None] * world
        dist.all_gather_object(gathered, value)
        return gathered

    def detections(i: int):
        g = torch.Generator().manual_seed(i)
        n, m = 100, 1 + i % 12
        corner = torch.rand(n + m, 2, generator=g) * 600
        box = torch.cat([corner, corner + 4 + torch.rand(n + m, 2, generator=g) * 200], 1)
        labels = torch.randint(0, 80, (n + m,), generator=g)
        return ({"boxes": box[:n], "scores": torch.rand(n, generator=g), "labels": labels[:n]},
                {"boxes": box[n:], "labels": labels[n:]})

    def mean_ap():
        metric = MeanAveragePrecision()
        for i in range(rank, 5000, world):
            preds, target = detections(i)
            metric.update([preds], [target])
        return metric

    def auroc():
        metric, g = BinaryAUROC(thresholds=None), torch.Generator().manual_seed(rank)
        for _ in range(0, 400 // world, 8):  # batches of 8 masks
            target = torch.randint(0, 2, (8, 128, 128), generator=g)
            metric.update(torch.rand(8, 128, 128, generator=g) * 0.5 + target * 0.3, target)
        return metric

    def state_bytes(metric) -> int:
        """The bytes of the storages the metric's states hold, each storage once (views of one buffer share it)."""
        storages = {}
        for m in metric_parts(metric):
            for name in m._defaults:
                value = getattr(m, name)
                for t in value if isinstance(value, list) else [value]:
                    if isinstance(t, torch.Tensor):
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def status(key: str) -> int:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
        return int(line.split()[1]) * 1024

    def measured(make, merge) -> dict:
        gc.collect()
        empty = status("VmRSS:")
        metric = make()
        gc.collect()
        local, before = state_bytes(metric), status("VmRSS:")
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        start = time.perf_counter()
        merge(metric, gather)
        seconds, peak = time.perf_counter() - start, status("VmHWM:")
        gc.collect()
        merged, after = state_bytes(metric), status("VmRSS:")
        mb = 1 << 20
        del metric
        return {"local_mb": local / mb, "merged_mb": merged / mb, "filled_rss_mb": (before - empty) / mb,
                "held_rss_mb": (after - empty) / mb, "peak_rss_mb": (peak - empty) / mb,
                "extra_copies": (peak - after) / (after - empty), "seconds": seconds}

    metric, way = CASES[case]
    rows = gather(measured(mean_ap if metric.startswith("Mean") else auroc,
                           merge_states if way == "scaletrain" else pickled_merge))
    if rank == 0:
        Path(out).write_text(json.dumps({"metric": metric, "merge": way, "per_process": rows}))
    dist.destroy_process_group()


def pickled_merge(metric, gather) -> None:
    """The earlier merge, for comparison: every state gathered at once as pickled objects, then interleaved."""
    import torch

    names = list(metric._defaults)
    ranks = gather({name: getattr(metric, name) for name in names})
    for name in names:
        values, reduce = [r[name] for r in ranks], metric._reductions.get(name)
        if isinstance(values[0], list):
            merged = [v[j] for j in range(max(map(len, values))) for v in values if j < len(v)]
            merged = reduce(merged) if reduce is not None and merged else merged
        else:
            merged = torch.stack(values)
            merged = reduce(merged) if reduce is not None else merged
        setattr(metric, name, merged)
    metric.distributed_available_fn = lambda: False


def memory(out: str) -> None:
    """The 2-process job of --memory, its figures printed and written to `out` with the run's date and machine."""
    part, results = Path(f"{out}.part"), []
    for case in range(len(CASES)):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--memory-job", str(part), "--case", str(case)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                            "MALLOC_TRIM_THRESHOLD_": "0"})
        results.append(json.loads(part.read_text()))
        part.unlink()
    for r in results:
        for rank, p in enumerate(r["per_process"]):
            print(f"{r['metric']:<36} {r['merge']:<29} rank {rank}: states {p['local_mb']:.1f} MB "
                  f"({p['filled_rss_mb']:.1f} MB resident), merged {p['merged_mb']:.1f} MB ({p['held_rss_mb']:.1f} "
                  f"MB resident), peak {p['peak_rss_mb']:.1f} MB: {p['extra_copies']:.2f} extra copies, "
                  f"{p['seconds']:.2f} s")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "command": "python benchmarks/metrics_cost.py " + " ".join(sys.argv[1:])}
    Path(out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", help="default: benchmarks/results/metrics_cost_cpu.json, with --memory "
                                 "benchmarks/results/metrics_merge_memory_cpu.json")
    p.add_argument("--job", help=argparse.SUPPRESS)  # run as one process of a job, writing its timings here
    p.add_argument("--memory", action="store_true", help="measure the memory of merging states over 2 processes")
    p.add_argument("--memory-job", help=argparse.SUPPRESS)  # one process of --memory's job, writing here
    p.add_argument("--case", type=int, default=0, help=argparse.SUPPRESS)  # which of CASES that job measures
    args = p.parse_args()
    if args.job:
        return job(args.repeats, args.job)
    if args.memory_job:
        return memory_job(args.case, args.memory_job)
    if args.memory:
        return memory(args.out or "benchmarks/results/metrics_merge_memory_cpu.json")
    args.out = args.out or "benchmarks/results/metrics_cost_cpu.json"
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
