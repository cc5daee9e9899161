"""Jobs killed at random points by random signals and started again until they finish, against their twins that
were never interrupted: every run must end with weights bitwise equal to its twin's, no process may be left behind,
and no run folder may mix two jobs.

Each of `--jobs` jobs is a 2-process `scaletrain train` (tinycnn on 2,000 digits, 4 epochs, a checkpoint every
10 steps, a seed of its own). Each attempt is killed, after a random 2 to 9 seconds, by one of: SIGKILL of a
worker, SIGKILL of the launcher, SIGTERM to the launcher, SIGINT to the launcher; then the same command runs again
(up to `--max-kills` kills a job; the last attempt runs to the end). After every attempt, every process of that
attempt must be gone within 30 s.

    python benchmarks/stress_kills.py                 # 20 jobs: about 20 minutes on a 2-core CPU
    python benchmarks/stress_kills.py --jobs 3 --max-kills 2

`--scenario moves`: each job is killed (SIGKILL of a worker or of the launcher) at a random point on 2 processes,
resumed on 1, killed again, resumed on 2 and trained to the end (`--batch-size 16`: a global batch of 32 kept as
16 x 2 accumulated on 1 process); against its twin trained on 2 without interruption: the same global batch and
optimizer steps, every epoch logged once, and the final validation accuracy within a point.
`--scenario stalls`: each job's rank 0 or 1 (random) stops answering after a random batch (1 to 60) in a job with
or without gradient accumulation (so in the optimizer step or an accumulating backward), `--stall-timeout 20`:
the job must exit 6 with the stalled rank and its stack named, within 60 s of the stall's start.

    python benchmarks/stress_kills.py --scenario moves --jobs 4
    python benchmarks/stress_kills.py --scenario stalls --jobs 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIGNALS = ("SIGKILL worker", "SIGKILL launcher", "SIGTERM launcher", "SIGINT launcher")


def children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(proc.name))
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z":
                out.append(pid)
        except OSError:
            pass
    return out


def digits_npz(path: Path, n_train: int, n_val: int) -> Path:
    """The first n_train + n_val embedded digits as an .npz for `train --data` (made once)."""
    if not path.is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from scaletrain.data import embedded_mnist

        m = embedded_mnist()
        x, y = m.images[:, 0].numpy(), m.labels.numpy()
        n = n_train + n_val
        np.savez(path, images=x[:n_train], labels=y[:n_train], val_images=x[n_train:n], val_labels=y[n_train:n])
    return path


def command(data: Path, out: Path, seed: int, nproc: int = 2, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", "--data", str(data), "--nproc", str(nproc), "--model",
            "tinycnn", "--epochs", "4", "--batch-size", "16", "--checkpoint-every", "10", "--seed", str(seed),
            "--output-dir", str(out), *extra]


def run_to_end(cmd: list[str], env: dict) -> int:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900).returncode


def attempt(cmd: list[str], env: dict, rng: random.Random, kill: bool) -> dict:
    """One start of the job, killed at a random point when `kill`; what happened and who was left."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    record: dict = {"signal": None}
    if kill:
        time.sleep(rng.uniform(2.0, 9.0))
        workers = children(launcher.pid)
        if launcher.poll() is None:
            how = rng.choice(SIGNALS)
            record["signal"] = how
            if how == "SIGKILL worker" and workers:
                os.kill(rng.choice(workers), signal.SIGKILL)
            else:
                os.kill(launcher.pid, {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM,
                                       "SIGINT": signal.SIGINT}[how.split()[0]])
        everyone = [launcher.pid, *workers]
    else:
        everyone = [launcher.pid]
    try:
        launcher.wait(timeout=900)
    except subprocess.TimeoutExpired:
        launcher.kill()
        record["timed_out"] = True
    record["exit_code"] = launcher.returncode
    deadline = time.time() + 30
    while alive(everyone) and time.time() < deadline:
        time.sleep(0.2)
    record["left_behind"] = len(alive(everyone))
    for pid in alive(everyone):  # do not let one failure spoil the rest of the run
        os.kill(pid, signal.SIGKILL)
    return record


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file
    import torch

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def one_job(metrics: Path, twin: Path) -> bool:
    """No sign of two jobs in one folder: the epochs' training losses are the twin's, one row per epoch."""
    rows = [line.split(",")[:2] for line in metrics.read_text().splitlines()[1:]]
    twins = [line.split(",")[:2] for line in twin.read_text().splitlines()[1:]]
    return rows == twins


def last_row(metrics: Path) -> dict:
    import csv

    return list(csv.DictReader(metrics.open()))[-1]


def moves(k: int, data: Path, work: Path, env: dict, rng: random.Random) -> dict:
    """Killed on 2, resumed on 1, killed, resumed on 2 to the end; against its twin on 2."""
    twin, run = work / f"twin-{k}", work / f"moved-{k}"
    for folder in (twin, run):
        subprocess.run(["rm", "-rf", str(folder)])
    assert run_to_end(command(data, twin, k), env) == 0, f"twin {k} failed"
    attempts = [killed_after_a_checkpoint(command(data, run, k, nproc), run, env, rng) for nproc in (2, 1)]
    attempts.append(attempt(command(data, run, k, 2), env, rng, kill=False))
    resumes = [json.loads(line)["world_size"] for line in (run / "resumes.jsonl").read_text().splitlines()] \
        if (run / "resumes.jsonl").is_file() else []
    summary, twin_summary = (json.loads((f / "summary.json").read_text()) if (f / "summary.json").is_file() else {}
                             for f in (run, twin))
    steps = [sorted(p.name for p in (f / "state").iterdir())[-1] for f in (run, twin)]
    acc, twin_acc = (float(last_row(f / "metrics.csv")["val_accuracy"]) for f in (run, twin))
    return {"job": k, "kills": [a["signal"] for a in attempts if a["signal"]],
            "exit_codes": [a["exit_code"] for a in attempts], "resumed_on": resumes,
            "finished": bool(summary), "same_global_batch": summary.get("global_batch_size") ==
            twin_summary.get("global_batch_size"), "same_optimizer_steps": steps[0] == steps[1],
            "one_job": one_job_epochs(run / "metrics.csv"), "val_accuracy": acc, "twin_val_accuracy": twin_acc,
            "within_a_point": abs(acc - twin_acc) <= 0.01 + 1e-9,  # a point: 3 of the 300 images
            "left_behind": sum(a["left_behind"] for a in attempts)}


def killed_after_a_checkpoint(cmd: list[str], run: Path, env: dict, rng: random.Random) -> dict:
    """One start of the job on cmd's process count, SIGKILLed (a worker, or the launcher and its workers) when it
    has written a random 1 to 8 new checkpoints (one each 10 steps) and up to 0.1 s more: mid-epoch, whatever the
    machine's speed."""
    def saved() -> set[Path]:
        return set((run / "state").glob("step-*")) if (run / "state").is_dir() else set()

    before, wanted = saved(), rng.randint(1, 8)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    seen: set[Path] = set()
    while launcher.poll() is None and len(seen) < wanted:
        seen |= saved() - before  # the run keeps 2: collect the new names as they appear
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.1))
    how, workers = None, children(launcher.pid)
    if launcher.poll() is None:
        how = rng.choice(("SIGKILL worker", "SIGKILL launcher"))
        for pid in ([rng.choice(workers)] if how == "SIGKILL worker" and workers else [launcher.pid, *workers]):
            os.kill(pid, signal.SIGKILL)
    launcher.wait(timeout=900)
    time.sleep(1)
    return {"signal": how, "exit_code": launcher.returncode, "left_behind": len(alive(workers))}


def one_job_epochs(metrics: Path) -> bool:
    rows = [line.split(",")[0] for line in metrics.read_text().splitlines()[1:]]
    return rows == [str(e) for e in range(1, len(rows) + 1)]


def stalls(k: int, data: Path, work: Path, env: dict, rng: random.Random) -> dict:
    """A rank that stops answering after a random batch: named, with its stack, within 60 s of the stall."""
    import re

    run = work / f"stalled-{k}"
    subprocess.run(["rm", "-rf", str(run)])
    batch, rank, accum = rng.randint(1, 60), rng.randint(0, 1), rng.choice([1, 2])
    proc = subprocess.run(command(data, run, k, 2, "--stall-timeout", "20", "--grad-accum", str(accum)),
                          capture_output=True, text=True, timeout=600,
                          env={**env, "SCALETRAIN_FAULT": f"hang:{batch}:{rank}"})
    ended = time.time()
    saved = sorted((run / "state").glob("step-*")) if (run / "state").is_dir() else []  # none before the first
    block = re.search(r"rank (\d+) stalled: no progress for (\d+) s .*?in phase '([^']+)' since (\d\d:\d\d:\d\d)",
                      proc.stderr)
    since = None
    if block:
        h, m, sec = map(int, block.group(4).split(":"))
        t = time.localtime(ended)
        since = time.mktime((t.tm_year, t.tm_mon, t.tm_mday, h, m, sec, 0, 0, -1))
    return {"job": k, "hang_after_batch": batch, "rank": rank, "grad_accum": accum, "exit_code": proc.returncode,
            "named_rank": int(block.group(1)) if block else None, "phase": block.group(3) if block else None,
            "stack_printed": proc.stderr.count("in after_batch"), "seconds_from_stall_to_exit":
            round(ended - since, 1) if since else None,
            "checkpoints": len(saved), "checkpoints_intact": all((p / "manifest.json").is_file() for p in saved)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("kills", "moves", "stalls"), default="kills")
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--max-kills", type=int, default=4, help="kills per job at most; then it runs to the end")
    p.add_argument("--seed", type=int, default=0, help="of the kill times and signals")
    p.add_argument("--work-dir", default="/tmp/scaletrain-stress")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "stress_kills_cpu.json"))
    args = p.parse_args()
    rng, work = random.Random(args.seed), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = digits_npz(work / "digits.npz", 2000, 300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    if args.scenario != "kills":
        other_scenario(args, data, work, env, rng)
        return
    jobs = []
    for k in range(args.jobs):
        twin, run = work / f"twin-{k}", work / f"run-{k}"
        for folder in (twin, run):
            subprocess.run(["rm", "-rf", str(folder)])
        assert run_to_end(command(data, twin, k), env) == 0, f"twin {k} failed"
        attempts = []
        while True:
            kill = sum(a["signal"] is not None for a in attempts) < args.max_kills
            record = attempt(command(data, run, k), env, rng, kill)
            attempts.append(record)
            if record["exit_code"] == 0 or (run / "summary.json").is_file():
                break
            if len(attempts) > args.max_kills + 3:
                break
        job = {"job": k, "kills": [a["signal"] for a in attempts if a["signal"]],
               "exit_codes": [a["exit_code"] for a in attempts], "finished": (run / "summary.json").is_file(),
               "left_behind": sum(a["left_behind"] for a in attempts),
               "bitwise_equal": (run / "last.safetensors").is_file() and
               same_weights(run / "last.safetensors", twin / "last.safetensors"),
               "one_job": (run / "metrics.csv").is_file() and one_job(run / "metrics.csv", twin / "metrics.csv")}
        jobs.append(job)
        print(f"job {k}: {len(job['kills'])} kill(s) {job['kills']}, exits {job['exit_codes']}, "
              f"bitwise {job['bitwise_equal']}, left behind {job['left_behind']}", flush=True)
    summary = {"jobs": len(jobs), "finished": sum(j["finished"] for j in jobs),
               "bitwise_equal": sum(j["bitwise_equal"] for j in jobs), "one_job_per_folder": sum(j["one_job"] for j in jobs),
               "kills": sum(len(j["kills"]) for j in jobs), "processes_left": sum(j["left_behind"] for j in jobs),
               "kills_by_signal": {s: sum(j["kills"].count(s) for j in jobs) for s in SIGNALS}}
    print(json.dumps(summary, indent=1))
    record = {"date": date.today().isoformat(), "machine": platform.machine(), "cores": os.cpu_count(),
              "command": " ".join(["python", "benchmarks/stress_kills.py", *sys.argv[1:]]), "summary": summary,
              "jobs": jobs}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=1) + "\n")


def other_scenario(args, data: Path, work: Path, env: dict, rng: random.Random) -> None:
    jobs = []
    for k in range(args.jobs):
        job = (moves if args.scenario == "moves" else stalls)(k, data, work, env, rng)
        jobs.append(job)
        print(json.dumps(job), flush=True)
    if args.scenario == "moves":
        summary = {key: sum(bool(j[key]) for j in jobs) for key in
                   ("finished", "same_global_batch", "same_optimizer_steps", "one_job", "within_a_point")}
        summary["max_accuracy_gap"] = max(abs(j["val_accuracy"] - j["twin_val_accuracy"]) for j in jobs)
        summary["processes_left"] = sum(j["left_behind"] for j in jobs)
    else:
        summary = {"exit_6": sum(j["exit_code"] == 6 for j in jobs),
                   "stalled_rank_named": sum(j["named_rank"] == j["rank"] for j in jobs),
                   "stack_printed": sum(j["stack_printed"] == 1 for j in jobs),  # once, in the one block
                   "checkpoints_intact": sum(j["checkpoints_intact"] for j in jobs),
                   "phases": sorted({j["phase"] for j in jobs if j["phase"]}),
                   "max_seconds_from_stall_to_exit": max((j["seconds_from_stall_to_exit"] or 1e9) for j in jobs)}
    summary["jobs"] = len(jobs)
    print(json.dumps(summary, indent=1))
    results = Path(args.results).with_name(f"stress_{args.scenario}_cpu.json") if args.results.endswith(
        "stress_kills_cpu.json") else Path(args.results)
    results.write_text(json.dumps({"date": date.today().isoformat(), "machine": platform.machine(),
                                   "cores": os.cpu_count(), "command": " ".join(["python", "benchmarks/stress_kills.py",
                                                                                 *sys.argv[1:]]),
                                   "summary": summary, "jobs": jobs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
