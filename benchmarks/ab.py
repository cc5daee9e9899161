"""The same `scaletrain train` in two or more arms, alternated in fresh processes (the order reversed every other
round): this checkout against an earlier commit (a git worktree of it, its src/ on PYTHONPATH, the same Python and
packages), or against itself under another environment. Per arm: the whole command's seconds, training images/s
(metrics.csv, the epochs after the first), the final validation accuracy, its speed over the first arm's, and in
how many rounds it ended with bitwise the same last weights and the same metrics (every column but the timings) as
the first arm.

Cases:
- default: `scaletrain train` with no flag but the run folder (`--epochs` to shorten it), at `--commit` and here:
  the default run unchanged.
- watch: `scaletrain train --nproc 2` (tinycnn, 2,000 digits, batch 32, 3 epochs, one thread a process) at a commit
  before the stall watch and here with `--stall-timeout 2` (the watch looks every 0.2 s, 25x as often as by
  default); beside it, a heartbeat mark's and one look of the watch's cost, measured directly.
- threads: `scaletrain train --cpu --nproc 2 --epochs 1` here with OMP_NUM_THREADS unset, set to the core count (as
  clusters export it; lowered to each process's share), and set and kept (SCALETRAIN_KEEP_THREADS=1: each process
  runs that many threads); `--commit` adds that commit with the variable set.

    python benchmarks/ab.py default --commit 47b6ec2 --rounds 5          # about 5 minutes on 2 cores
    python benchmarks/ab.py default --commit HEAD~10 --rounds 2 --epochs 2
    python benchmarks/ab.py watch --rounds 5
    python benchmarks/ab.py threads --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from pathlib import Path

import _data
import _harness as h

TIMINGS = ("epoch_seconds", "images_per_second")
COMMITS = {"default": "47b6ec2", "watch": "36dbdb6", "threads": None}  # the commit each case compares with


def arms(case: str, base: Path | None, rev: str | None, work: Path, epochs: int | None) -> dict[str, tuple]:
    """name -> (src folder, environment changes, arguments after `scaletrain train`); the first arm is the
    reference of the others."""
    here, cores = h.ROOT / "src", str(len(os.sched_getaffinity(0)))
    if case == "default":
        args = ["--epochs", str(epochs)] if epochs else []
        return {rev: (base / "src", {}, args), "this checkout": (here, {}, args)}
    if case == "watch":
        args = ["--data", str(_data.digits_npz(work / "digits.npz", 2000, 200)), "--nproc", "2", "--model", "tinycnn",
                "--epochs", str(epochs or 3), "--batch-size", "32", "--log-with", "none"]
        return {f"{rev}, no watch": (base / "src", {"OMP_NUM_THREADS": "1"}, args),
                "this checkout, watched every 0.2 s": (here, {"OMP_NUM_THREADS": "1"}, [*args, "--stall-timeout", "2"])}
    args = ["--cpu", "--nproc", "2", "--epochs", str(epochs or 1), "--log-with", "none"]
    out = {"OMP_NUM_THREADS unset": (here, {"OMP_NUM_THREADS": None}, args),
           f"OMP_NUM_THREADS={cores}": (here, {"OMP_NUM_THREADS": cores}, args),
           f"OMP_NUM_THREADS={cores}, kept": (here, {"OMP_NUM_THREADS": cores, "SCALETRAIN_KEEP_THREADS": "1"}, args)}
    if base is not None:
        out[f"{rev}, OMP_NUM_THREADS={cores}"] = (base / "src", {"OMP_NUM_THREADS": cores}, args)
    return out


def marks() -> dict:
    """A heartbeat mark's cost (ns), `during`'s, and one look of the watch thread (us): publish this rank's progress
    on a real store, re-arm faulthandler's watchdog, read every rank's."""
    import torch.distributed as dist

    from scaletrain.parallel.stacks import StackDump
    from scaletrain.parallel.watch import Heartbeat, Watch

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
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    watch, other = Watch(store, 0, 2, 60.0, beat), Watch(store, 1, 2, 60.0, Heartbeat())
    other.store = watch.store  # the two ranks of one job's watch
    watch._dump = StackDump()  # each look re-arms faulthandler's watchdog, as started
    seen: dict = {}
    other.poll({})
    t = time.perf_counter()
    for _ in range(2000):
        watch.poll(seen)
    return {"mark_ns": round(mark_ns, 1), "during_ns": round(during_ns, 1),
            "poll_us": round((time.perf_counter() - t) / 2000 * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=list(COMMITS))
    p.add_argument("--commit", help="the earlier commit [default: default 47b6ec2, watch 36dbdb6 (before the "
                   "watch), threads none]")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, help="default: each case's own")
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/ab_<case>.json]")
    args = p.parse_args()
    rev = args.commit or COMMITS[args.case]
    work = h.work_dir(f"ab-{args.case}", args.work_dir)
    with h.checkout(rev, work) if rev else contextlib.nullcontext() as base:
        chosen = arms(args.case, base, rev, work, args.epochs)
        first = next(iter(chosen))
        runs: dict[str, list[dict]] = {name: [] for name in chosen}
        for k, name in h.turns(chosen, args.rounds):
            src, changes, extra = chosen[name]
            folder = work / f"run-{list(chosen).index(name)}"
            shutil.rmtree(folder, ignore_errors=True)
            r = h.run(h.scaletrain("train", *extra, "--output-dir", str(folder)), env=h.env(src, **changes),
                      cwd=work, log=work / f"{k}-{list(chosen).index(name)}", timeout=1800).check(name)
            rows = h.metrics(folder)
            runs[name].append({"seconds": r.seconds, "images_per_second": h.steady(rows),
                               "val_accuracy": rows[-1].get("val_accuracy"), "folder": folder,
                               "rows": [{c: v for c, v in row.items() if c not in TIMINGS} for row in rows]})
            if name == list(chosen)[-1 if k % 2 == 0 else 0]:  # the round's last arm: compare with the first's
                ref = runs[first][-1]
                for other in chosen:
                    got = runs[other][-1]
                    got["same_weights"] = h.same_weights(ref["folder"] / "last.safetensors",
                                                         got["folder"] / "last.safetensors")
                    got["same_metrics"] = got["rows"] == ref["rows"]
            print(f"round {k + 1}, {name}: {r.seconds:.1f} s, {runs[name][-1]['images_per_second']:.0f} images/s",
                  flush=True)
    speed = h.median(r["images_per_second"] for r in runs[first])
    table = [{"arm": name, "whole command, s": h.median(r["seconds"] for r in rs),
              "images/s": h.median(r["images_per_second"] for r in rs), f"vs {first}": h.ratio(
                  h.median(r["images_per_second"] for r in rs), speed),
              "val accuracy": h.median(r["val_accuracy"] for r in rs),
              "weights bitwise equal to the first arm's": f"{sum(r.get('same_weights', False) for r in rs)}/{len(rs)}",
              "metrics equal": f"{sum(r.get('same_metrics', False) for r in rs)}/{len(rs)}"}
             for name, rs in runs.items()]
    for rs in runs.values():
        for r in rs:
            r.pop("rows"), r.pop("folder")
    h.record(f"ab_{args.case}", table, args.out, title=f"{args.case}: medians of {args.rounds} round(s)",
             base=rev and f"{rev} ({h.git('rev-parse', '--short', rev)})",
             runs=runs, **({"marks": marks()} if args.case == "watch" else {}))


if __name__ == "__main__":
    h.main(main)
