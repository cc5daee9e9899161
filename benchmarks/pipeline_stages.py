"""A model cut into 2 pipeline stages on 2 CPU processes, against the same model whole on 1 process (1 thread and 2
threads), against ddp on 2 processes, and against torch.distributed.pipelining driven by a bare loop of its own:
images/s of the second epoch (the first includes start-up), the bubble each schedule leaves against
(S - 1) / (M + S - 1), and the parameters and optimizer state each process holds. Contenders are alternated, the
order reversed every round; medians of the rounds.

The model is examples/pipeline_blocks.py's BlockNet (residual MLP blocks), trained by that script unchanged; the
bubble is 1 - (one-thread whole time / S) / pipeline time, so it holds the stages' communication too.

    python benchmarks/pipeline_stages.py --rounds 3                                  # width 512: overheads show
    python benchmarks/pipeline_stages.py --rounds 2 --width 1024 --samples 1024      # 4x the work per sample
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
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pipeline_blocks.py"
DEPTH, BATCH = 4, 64


def bare(out: str, microbatches: int, schedule: str, width: int, samples: int) -> None:
    """torch.distributed.pipelining alone, in a worker of torchrun: the same model, data, optimizer and batches,
    cut where scaletrain cuts it; prints the second epoch's seconds."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    sys.path.insert(0, str(EXAMPLE.parent))
    from pipeline_blocks import BlockNet, data

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = BlockNet(width=width, depth=DEPTH)
    blocks = list(model.blocks)
    stage = torch.nn.Sequential(model.embed, *blocks[:2]) if rank == 0 else torch.nn.Sequential(*blocks[2:],
                                                                                                    model.head)
    x, y = data(samples, 1).tensors
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    run = cls(pp.PipelineStage(stage, rank, 2, torch.device("cpu")), microbatches,
              loss_fn=torch.nn.functional.cross_entropy)
    for epoch in range(2):
        t0 = time.perf_counter()
        for i in range(0, len(x), BATCH):
            if rank == 0:
                run.step(x[i:i + BATCH])
            else:
                run.step(target=y[i:i + BATCH])
            optimizer.step()
            optimizer.zero_grad()
        seconds = time.perf_counter() - t0
    if rank == 1:
        Path(out, "seconds.txt").write_text(f"{seconds}")
    dist.destroy_process_group()


def contenders(stages_only: bool) -> dict[str, tuple[int, list[str], dict]]:
    """name: (processes, the example's flags or ["bare", M, schedule], environment)."""
    found: dict[str, tuple[int, list[str], dict]] = {}
    if not stages_only:
        found["whole, 1 thread"] = (1, [], {"OMP_NUM_THREADS": "1"})
        found["whole, 2 threads"] = (1, [], {"OMP_NUM_THREADS": "2"})
        found["ddp, 2 processes"] = (2, [], {})
    for schedule, ms in (("gpipe", (1, 2, 4, 8)), ("1f1b", (2, 4, 8))):
        for m in ms:
            found[f"pipeline {schedule} M={m}"] = (2, ["--stages", "2", "--schedule", schedule, "--microbatches",
                                                       str(m)], {})
    found["torch pipelining alone, 1f1b M=4"] = (2, ["bare", "4", "1f1b"], {})
    found["torch pipelining alone, gpipe M=4"] = (2, ["bare", "4", "gpipe"], {})
    return found


def run_one(nproc: int, flags: list[str], env: dict, width: int, samples: int) -> dict:
    out = tempfile.mkdtemp(prefix="pipeline-")
    size = ["--width", str(width), "--samples", str(samples)]
    if flags[:1] == ["bare"]:
        script = [str(Path(__file__).resolve()), "--bare", out, "--microbatches", flags[1], "--schedule", flags[2],
                  *size]
    else:
        script = [str(EXAMPLE), "--out", out, *size, "--depth", str(DEPTH), "--batch-size", str(BATCH), "--epochs",
                  "2", *flags]
    command = [sys.executable, *script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                **env}
    proc = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if flags[:1] == ["bare"]:
        return {"epoch_seconds": float(Path(out, "seconds.txt").read_text())}
    with open(Path(out, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    summary = json.loads(Path(out, "summary.json").read_text())
    held = summary.get("bytes_per_device", {})
    return {"epoch_seconds": float(rows[-1]["epoch_seconds"]), "train_loss": float(rows[-1]["train_loss"]),
            "held_mb": (held.get("parameters", 0) + held.get("optimizer_state", 0)) / 2**20}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stages-only", action="store_true", help="leave out the whole model and ddp")
    p.add_argument("--width", type=int, default=512, help="the blocks' width (each block: 4 x width^2 weights)")
    p.add_argument("--samples", type=int, default=2048, help="samples per epoch")
    p.add_argument("--bare", help=argparse.SUPPRESS)  # torch's pipelining alone, in a worker
    p.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help="[default: benchmarks/results/pipeline_stages_cpu_w<width>.json]")
    args = p.parse_args()
    if args.bare:
        return bare(args.bare, args.microbatches, args.schedule, args.width, args.samples)
    ways = contenders(args.stages_only)
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    for k in range(args.rounds):
        names = list(ways) if k % 2 == 0 else list(ways)[::-1]
        for name in names:
            runs[name].append(run_one(*ways[name], args.width, args.samples))
            print(f"round {k + 1}: {name}: {runs[name][-1]['epoch_seconds']:.3f} s", flush=True)
    samples = args.samples
    median = {n: statistics.median(r["epoch_seconds"] for r in rs) for n, rs in runs.items()}
    one_thread = median.get("whole, 1 thread")
    lines = ["| way | images/s | vs whole, 2 threads | bubble measured | (S-1)/(M+S-1) | held MB per process |",
             "|---|---|---|---|---|---|"]
    table = {}
    for name, seconds in median.items():
        m = int(name.split("M=")[1]) if "M=" in name else None
        bubble = 1 - (one_thread / 2) / seconds if one_thread and m else None
        ideal = 1 / (m + 1) if m else None
        held = statistics.median(r.get("held_mb", 0) for r in runs[name]) or None
        ratio = median["whole, 2 threads"] / seconds if "whole, 2 threads" in median else None
        table[name] = {"images_per_second": round(samples / seconds, 1), "epoch_seconds": round(seconds, 3),
                       "speed_vs_whole_2_threads": round(ratio, 3) if ratio else None,
                       "bubble_measured": round(bubble, 3) if bubble is not None else None,
                       "bubble_ideal": round(ideal, 3) if ideal else None, "held_mb": round(held, 1) if held else None}
        cells = [f"{samples / seconds:.0f}", f"{ratio:.2f}" if ratio else "",
                 f"{bubble:.2f}" if bubble is not None else "", f"{ideal:.2f}" if ideal else "",
                 f"{held:.1f}" if held else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"pipeline_stages_cpu_w{args.width}.json")
    results.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{_cpu()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/pipeline_stages.py", *sys.argv[1:]]),
        "model": {"width": args.width, "depth": DEPTH, "samples": args.samples, "batch": BATCH}, "table": table,
        "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
