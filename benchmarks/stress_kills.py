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


def command(data: Path, out: Path, seed: int) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", "--data", str(data), "--nproc", "2", "--model", "tinycnn",
            "--epochs", "4", "--batch-size", "16", "--checkpoint-every", "10", "--seed", str(seed), "--output-dir",
            str(out)]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--max-kills", type=int, default=4, help="kills per job at most; then it runs to the end")
    p.add_argument("--seed", type=int, default=0, help="of the kill times and signals")
    p.add_argument("--work-dir", default="/tmp/scaletrain-stress")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "stress_kills_cpu.json"))
    args = p.parse_args()
    rng, work = random.Random(args.seed), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "digits.npz"
    if not data.is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from scaletrain.data import embedded_mnist

        m = embedded_mnist()
        x, y = m.images[:, 0].numpy(), m.labels.numpy()
        np.savez(data, images=x[:2000], labels=y[:2000], val_images=x[2000:2300], val_labels=y[2000:2300])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
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


if __name__ == "__main__":
    main()
