"""`scaletrain train --cpu --nproc 2 --epochs 1` with OMP_NUM_THREADS set to the machine's core count (as clusters,
conda activations and HPC modules export it) against the variable unset, run alternately in fresh processes (the order reversed every other round):
training images/s (metrics.csv) and validation accuracy of each, medians, and their ratio; and the variable set
and kept (SCALETRAIN_KEEP_THREADS=1: each process runs that many threads, as before they were fitted). With the
threads fitted to each process's share, the first two should train at the same speed to the same weights.

    python benchmarks/threads_env.py --rounds 3
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


def train(out: Path, omp: str | None, keep: bool = False) -> dict:
    subprocess.run(["rm", "-rf", str(out)])
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src")
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    if keep:
        env["SCALETRAIN_KEEP_THREADS"] = "1"  # the variable as it was before threads were fitted
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--cpu", "--nproc", "2", "--epochs", "1",
                           "--log-with", "none", "--output-dir", str(out)], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = list(csv.DictReader((out / "metrics.csv").open()))[-1]
    summary = json.loads((out / "summary.json").read_text())
    return {"images_per_second": float(row["images_per_second"]), "val_accuracy": float(row["val_accuracy"]),
            "threads_per_process": summary.get("threads_per_process"),
            "said": [line for line in proc.stdout.splitlines() if line.startswith("OMP_NUM_THREADS=")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", default="/tmp/scaletrain-threads-env")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "threads_env.json"))
    args = p.parse_args()
    work, cores = Path(args.work_dir), str(len(os.sched_getaffinity(0)))
    work.mkdir(parents=True, exist_ok=True)
    arms = (("unset", None, False), (f"OMP_NUM_THREADS={cores}", cores, False),
            (f"OMP_NUM_THREADS={cores}, kept", cores, True))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    for k in range(args.rounds):
        for name, omp, keep in (arms if k % 2 == 0 else arms[::-1]):  # each arm first and last in turn
            runs[name].append(train(work / "run", omp, keep))
            print(f"round {k + 1} {name}: {runs[name][-1]}", flush=True)
    medians = {name: {"images_per_second": statistics.median(r["images_per_second"] for r in rs),
                      "val_accuracy": statistics.median(r["val_accuracy"] for r in rs)} for name, rs in runs.items()}
    unset, set_ = medians["unset"], medians[f"OMP_NUM_THREADS={cores}"]
    kept = medians[f"OMP_NUM_THREADS={cores}, kept"]
    summary = {**medians, "ratio_set_over_unset": round(set_["images_per_second"] / unset["images_per_second"], 3),
               "ratio_kept_over_unset": round(kept["images_per_second"] / unset["images_per_second"], 3)}
    print(json.dumps(summary, indent=1))
    Path(args.results).write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/threads_env.py", *sys.argv[1:]]), "summary": summary,
        "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
