"""What watching for stalls costs a training step: the heartbeat marks the training thread makes, and the watch
thread that shares them on the job's store and reads the others'.

Two measurements, in the same run:
1. The whole job, A/B: `scaletrain train --nproc 2` (tinycnn, 2,000 digits, batch 64, 3 epochs) from this checkout
   with --stall-timeout 2 (the watch polls every 0.2 s, 25x as often as with the default 60 s) against the same job
   from a checkout of the commit before the watch existed (`--base`, a git worktree made here), alternated
   `--rounds` times; the training images/s of epochs 2 and 3 (metrics.csv), median per side, and their ratio.
2. The marks alone: nanoseconds per `BEAT.mark` / `BEAT.during`, times the marks one training step makes; and one
   look of the watch thread (publish, re-arm faulthandler's watchdog, read every rank's progress).

    python benchmarks/watch_overhead.py --rounds 5
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

from stress_kills import digits_npz  # beside this script

ROOT = Path(__file__).resolve().parent.parent


def job(src: Path, data: Path, out: Path, extra: list[str]) -> float:
    subprocess.run(["rm", "-rf", str(out)])
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--data", str(data), "--nproc", "2",
                           "--model", "tinycnn", "--epochs", "3", "--batch-size", "32", "--log-with", "none",
                           "--output-dir", str(out), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    return statistics.median(float(r["images_per_second"]) for r in rows[1:])


def marks() -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from scaletrain.parallel.watch import Heartbeat

    beat, n = Heartbeat(), 200_000
    t = time.perf_counter()
    for _ in range(n):
        beat.mark("forward")
    mark_ns = (time.perf_counter() - t) / n * 1e9
    t = time.perf_counter()
    for _ in range(n):
        with beat.during("collective"):
            pass
    during_ns = (time.perf_counter() - t) / n * 1e9
    # One look of the watch thread, on a real store (this process hosts it) with 2 ranks' heartbeats.
    import torch.distributed as dist
    from scaletrain.parallel.stacks import StackDump
    from scaletrain.parallel.watch import Watch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    watch, other = Watch(store, 0, 2, 60.0, beat), Watch(store, 1, 2, 60.0, Heartbeat())
    other.store = watch.store  # the two ranks of one job's watch (in two processes, each counts its first as 1)
    watch._dump = StackDump()  # each look re-arms faulthandler's watchdog (a GIL-holding stall's stack), as started
    seen: dict = {}
    other.poll({})
    t = time.perf_counter()
    for _ in range(2000):
        watch.poll(seen)
    poll_us = (time.perf_counter() - t) / 2000 * 1e6
    return {"mark_ns": round(mark_ns, 1), "during_ns": round(during_ns, 1), "poll_us": round(poll_us, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base", default="36dbdb6", help="a commit without the watch")
    p.add_argument("--work-dir", default="/tmp/scaletrain-watch-overhead")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "watch_overhead.json"))
    args = p.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not base.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
    data = digits_npz(work / "digits.npz", 2000, 200)
    watched, unwatched = [], []
    for k in range(args.rounds):
        unwatched.append(job(base / "src", data, work / "base-run", []))
        watched.append(job(ROOT / "src", data, work / "run", ["--stall-timeout", "2"]))
        print(f"round {k + 1}: without the watch {unwatched[-1]:.0f} img/s, watched every 0.2 s {watched[-1]:.0f} "
              f"img/s", flush=True)
    step_ms = 32 / statistics.median(watched) * 1000  # one rank's step: 32 images
    micro = marks()
    per_step = 5  # reading data, forward, backward, optimizer step; a collective's 2 at each --log-every
    summary = {"images_per_second_without_watch": round(statistics.median(unwatched), 1),
               "images_per_second_watched": round(statistics.median(watched), 1),
               "ratio_watched_over_without": round(statistics.median(watched) / statistics.median(unwatched), 4),
               "step_ms": round(step_ms, 2), **micro,
               "marks_share_of_a_step": f"{per_step * micro['mark_ns'] / (step_ms * 1e6):.2e}",
               "polls_share_of_time_default": f"{micro['poll_us'] / 5e6:.2e}",  # one look every 5 s
               "polls_share_of_time_every_0.2s": f"{micro['poll_us'] / 0.2e6:.2e}"}
    print(json.dumps(summary, indent=1))
    record = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join(["python", "benchmarks/watch_overhead.py", *sys.argv[1:]]), "base": args.base,
              "summary": summary, "rounds": {"without": unwatched, "watched": watched}}
    Path(args.results).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
