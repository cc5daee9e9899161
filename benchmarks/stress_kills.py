"""Jobs killed at random points by random signals and started again until they finish, against their twins never
interrupted: every job must end with its twin's weights, bit for bit, leave no process behind and no run folder
holding two jobs. A stress test: what it adds to tests/test_resume.py's kills at fixed batches is many random
points and signals, which takes minutes.

`--scenario kills`: each of `--jobs` jobs is a 2-process `scaletrain train` (tinycnn on 2,000 digits, 4 epochs,
batch 16, a checkpoint every 10 steps, a seed of its own); each attempt is killed after a random 2 to 9 s by one of
SIGKILL of a worker, SIGKILL of the launcher, SIGTERM or SIGINT to the launcher, then the same command runs again
(at most `--max-kills` kills a job; the last attempt runs to the end). Every process of an attempt must be gone
within 30 s of it.
`--scenario moves`: each job is SIGKILLed (a worker or the launcher) after a random 1 to 8 checkpoints on 2
processes, resumed on 1, killed again, resumed on 2 to the end (a global batch of 32 kept as 16 x 2 accumulated on
1 process); against its twin on 2: the same global batch and optimizer steps, every epoch logged once, and the
final validation accuracy within a point.

    python benchmarks/stress_kills.py                              # 20 jobs: about 20 minutes on 2 cores
    python benchmarks/stress_kills.py --jobs 3 --max-kills 2
    python benchmarks/stress_kills.py --scenario moves --jobs 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import _data
import _harness as h

SIGNALS = ("SIGKILL worker", "SIGKILL launcher", "SIGTERM launcher", "SIGINT launcher")


def command(data: Path, out: Path, seed: int, nproc: int = 2) -> list[str]:
    return h.scaletrain("train", "--data", str(data), "--nproc", str(nproc), "--model", "tinycnn", "--epochs", "4",
                        "--batch-size", "16", "--checkpoint-every", "10", "--seed", str(seed), "--output-dir", str(out))


def children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except OSError:
            pass
    return out


def attempt(cmd: list[str], env: dict, rng: random.Random, kill: str, run: Path | None = None) -> dict:
    """One start of the job: killed after a random 2 to 9 s (`kill` "random"), after a random 1 to 8 new
    checkpoints of `run` and up to 0.1 s more (`kill` "checkpoints"), or run to the end (""). What happened and
    how many of its processes were left 30 s later."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    how = None
    if kill == "random":
        time.sleep(rng.uniform(2.0, 9.0))
    elif kill:
        def saved() -> set[Path]:
            return set((run / "state").glob("step-*")) if (run / "state").is_dir() else set()

        before, wanted, seen = saved(), rng.randint(1, 8), set()
        while launcher.poll() is None and len(seen) < wanted:
            seen |= saved() - before  # the run keeps 2: collect the new names as they appear
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.1))
    workers = children(launcher.pid)
    if kill and launcher.poll() is None:
        how = rng.choice(SIGNALS if kill == "random" else SIGNALS[:2])
        if how == "SIGKILL worker" and workers:
            os.kill(rng.choice(workers), signal.SIGKILL)
        else:  # moves: SIGKILL of the launcher and its workers at once
            for pid in [launcher.pid, *(workers if kill == "checkpoints" else [])]:
                os.kill(pid, getattr(signal, how.split()[0]))
    try:
        launcher.wait(timeout=900)
    except subprocess.TimeoutExpired:
        launcher.kill()
    everyone, deadline = [launcher.pid, *workers], time.time() + 30
    while alive(everyone) and time.time() < deadline:
        time.sleep(0.2)
    left = alive(everyone)
    for pid in left:  # one failure must not spoil the rest of the run
        os.kill(pid, signal.SIGKILL)
    return {"signal": how, "exit_code": launcher.returncode, "left_behind": len(left)}


def epochs_of(metrics: Path) -> list[str]:
    return [line.split(",")[0] for line in metrics.read_text().splitlines()[1:]] if metrics.is_file() else []


def kills(k: int, data: Path, work: Path, env: dict, rng: random.Random, max_kills: int) -> dict:
    twin, run = work / f"twin-{k}", work / f"run-{k}"
    h.run(command(data, twin, k), env=env).check(f"twin {k}")
    attempts: list[dict] = []
    while len(attempts) <= max_kills + 3:
        attempts.append(attempt(command(data, run, k), env, rng,
                                "random" if sum(a["signal"] is not None for a in attempts) < max_kills else ""))
        if attempts[-1]["exit_code"] == 0 or (run / "summary.json").is_file():
            break
    rows, twins = (h.metrics(f) if (f / "metrics.csv").is_file() else [] for f in (run, twin))
    return {"job": k, "kills": [a["signal"] for a in attempts if a["signal"]],
            "exit_codes": [a["exit_code"] for a in attempts], "finished": (run / "summary.json").is_file(),
            "left_behind": sum(a["left_behind"] for a in attempts),
            "bitwise_equal": (run / "last.safetensors").is_file() and h.same_weights(run / "last.safetensors",
                                                                                    twin / "last.safetensors"),
            "one_job": [(r["epoch"], r["train_loss"]) for r in rows] == [(r["epoch"], r["train_loss"]) for r in twins]}


def moves(k: int, data: Path, work: Path, env: dict, rng: random.Random, max_kills: int) -> dict:
    twin, run = work / f"twin-{k}", work / f"moved-{k}"
    h.run(command(data, twin, k), env=env).check(f"twin {k}")
    attempts = [attempt(command(data, run, k, nproc), env, rng, "checkpoints", run) for nproc in (2, 1)]
    attempts.append(attempt(command(data, run, k, 2), env, rng, ""))
    summary, twin_summary = (json.loads((f / "summary.json").read_text()) if (f / "summary.json").is_file() else {}
                             for f in (run, twin))
    steps = [max(p.name for p in (f / "state").iterdir()) for f in (run, twin)]
    acc, twin_acc = (h.metrics(f)[-1]["val_accuracy"] for f in (run, twin))
    return {"job": k, "kills": [a["signal"] for a in attempts if a["signal"]],
            "exit_codes": [a["exit_code"] for a in attempts], "finished": bool(summary),
            "same_global_batch": summary.get("global_batch_size") == twin_summary.get("global_batch_size"),
            "same_optimizer_steps": steps[0] == steps[1],
            "one_job": epochs_of(run / "metrics.csv") == [str(e) for e in range(1, 5)],
            "within_a_point": abs(acc - twin_acc) <= 0.01 + 1e-9, "accuracy_gap": abs(acc - twin_acc),
            "left_behind": sum(a["left_behind"] for a in attempts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("kills", "moves"), default="kills")
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--max-kills", type=int, default=4, help="kills: per job at most; then it runs to the end")
    p.add_argument("--seed", type=int, default=0, help="of the kill times and signals")
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/stress_<scenario>.json]")
    args = p.parse_args()
    rng, work = random.Random(args.seed), h.work_dir(f"stress-{args.scenario}", args.work_dir)
    data = _data.digits_npz(work / "digits.npz", 2000, 300)
    env = h.env(OMP_NUM_THREADS="1")
    jobs = []
    for k in range(args.jobs):
        jobs.append((kills if args.scenario == "kills" else moves)(k, data, work, env, rng, args.max_kills))
        print(json.dumps(jobs[-1]), flush=True)
        for folder in work.glob(f"*-{k}"):
            shutil.rmtree(folder, ignore_errors=True)
    checks = [key for key, v in jobs[0].items() if isinstance(v, bool)] if jobs else []
    row = {"jobs": len(jobs), "kills": sum(len(j["kills"]) for j in jobs),
           **({"by signal": ", ".join(f"{s} {sum(j['kills'].count(s) for j in jobs)}" for s in SIGNALS)}
              if args.scenario == "kills" else {"largest accuracy gap": max((j["accuracy_gap"] for j in jobs),
                                                                            default=None)}),
           **{key.replace("_", " "): sum(j[key] for j in jobs) for key in checks},
           "processes left behind": sum(j["left_behind"] for j in jobs)}
    h.record(f"stress_{args.scenario}", [row], args.out, title=f"stress: {args.scenario}", jobs=jobs)


if __name__ == "__main__":
    h.main(main)
