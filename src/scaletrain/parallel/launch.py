"""Starting a job: when it was launched, what the hardware offers, SLURM's variables, and torch's elastic launcher
for N workers."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

# Where there is no /proc: this process's first import of scaletrain, before torch's (scaletrain imports this first).
_IMPORTED_AT = time.time()


def process_start() -> float:
    """When this process began (its start in /proc, to 10 ms): also right for a process forked from one that
    imported scaletrain long before. Where there is no /proc, when it first imported scaletrain."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as since_boot:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            uptime = float(since_boot.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def launched_at() -> float:
    """When this job was launched: the launcher's own start, handed to its workers (SCALETRAIN_LAUNCH_TIME), or this
    process's start."""
    return float(os.environ.get("SCALETRAIN_LAUNCH_TIME") or process_start())

import torch  # noqa: E402

from ..errors import UserError  # noqa: E402
from .threads import fit_environment, share  # noqa: E402

# Variables that a launcher (torchrun, accelerate launch, scaletrain --nproc) sets in each worker.
_WORKER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'node[01-03,07],gpu5' -> 'node01'."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    prefix, ranges, suffix = m.groups() if m else (nodelist, None, "")
    if ranges:
        return prefix + ranges.split(",")[0].split("-")[0] + suffix
    return prefix + suffix


def adopt_slurm() -> bool:
    """Under `srun` with several tasks, give each task the variables torch's launcher would have set.

    Rank, world size and local rank come from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the master address
    is the first host of SLURM_JOB_NODELIST (or SLURM_NODELIST) and the port is derived from the job id, unless
    MASTER_ADDR / MASTER_PORT are set already. Nothing changes when a launcher ran inside the allocation.
    """
    env = os.environ
    if "SLURM_PROCID" not in env or all(k in env for k in _WORKER_ENV) or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000))
    return True


LEGACY_LOCAL_RANK = re.compile(r"--local[-_]rank(=(\d+))?$")


def drop_legacy_local_rank(argv: list[str]) -> list[str]:
    """`argv` without the `--local-rank=N` (`--local_rank N` before torch 2.0) that `python -m
    torch.distributed.launch` appends without --use-env: the worker's environment (LOCAL_RANK) says the same, and
    is what counts. Left in place when no launcher set LOCAL_RANK (the parser then refuses it as unknown)."""
    if "LOCAL_RANK" not in os.environ:
        return argv
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        match = LEGACY_LOCAL_RANK.match(word)
        if match is None:
            out.append(word)
        elif match.group(2) is None:  # `--local_rank 0`: its value is the next word
            skip = i + 1 < len(argv) and argv[i + 1].isdigit()
    return out


def launched_world_size() -> int | None:
    """The world size a launcher gave this process, or None when it was started directly."""
    if all(k in os.environ for k in _WORKER_ENV):
        return int(os.environ["WORLD_SIZE"])
    return None


def backends_available() -> list[str]:
    """The torch.distributed backends this build of torch has."""
    if not torch.distributed.is_available():
        return []
    return [name for name in ("gloo", "nccl", "mpi") if getattr(torch.distributed, f"is_{name}_available")()]


def mps_available() -> bool:
    """Whether torch sees Apple's MPS device."""
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def available_gpus(cpu: bool) -> int:
    return 0 if cpu else torch.cuda.device_count()


def resolve_nproc(requested: int | None, cpu: bool) -> int:
    """Processes to start for `--nproc`: None ('auto') is one per GPU, 1 on CPU."""
    gpus = available_gpus(cpu)
    if requested is None:
        return max(gpus, 1)
    if gpus and requested > gpus:
        raise UserError(f"--nproc {requested} asks for more processes than the {gpus} GPU(s) present")
    return requested


@dataclass
class Nodes:
    """The machines of a job: how many, this one's rank among them, and where their workers meet."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def launcher_args(self) -> list[str]:
        if self.count == 1:
            return ["--standalone"]
        return [f"--nnodes={self.count}", f"--node-rank={self.rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def launch(nproc: int, argv: Sequence[str], max_restarts: int = 0, nodes: Nodes | None = None) -> int:
    """Run `python -m scaletrain *argv` in `nproc` workers on this machine through torch's elastic launcher
    (one of `nodes.count` machines, each running the same command with its own `nodes.rank`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # One process's share of the usable cores, set here so the launcher does not warn and pick 1 by itself, and
    # lowered to it when the user's asks for more: each worker starts with it (threads.py).
    lowered = fit_environment(nproc)
    if lowered and (nodes is None or nodes.rank == 0):
        print(lowered, flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(share(nproc)))
    args = parse_args([*(nodes or Nodes()).launcher_args(), f"--nproc-per-node={nproc}",
                       f"--max-restarts={max_restarts}", "--module", "scaletrain"])
    args.training_script_args = list(argv)  # set after parsing: the launcher's parser would claim our flags
    try:
        run(args)
    except SignalException as e:  # the launcher was told to stop; its workers got the signal and checkpointed
        print(f"scaletrain: launcher received {e.sigval.name}; workers were asked to checkpoint and stop",
              file=sys.stderr)
        return 75
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        said = failure.message.get("message") if isinstance(failure.message, dict) else None
        if said is None:
            print(f"scaletrain: worker rank {rank} failed with exit code {failure.exitcode}; "
                  f"the message above comes from it", file=sys.stderr)
        else:  # the worker's own words (record_failure): its exception, or a stall it saw named
            print(f"scaletrain: error: {said if said.startswith('rank ') else f'rank {rank} failed: {said}'}",
                  file=sys.stderr)
        return code
    return 0


def first_failure(failures: dict) -> tuple[int, Any]:
    """The worker that failed first: the earliest that said why (record_failure), else the earliest to exit."""
    said = {r: f for r, f in failures.items() if isinstance(f.message, dict)}
    pool = said or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def record_failure(message: str) -> None:
    """In a worker of torch's elastic launcher (torchrun, scaletrain --nproc): why this process fails, in the
    error file the launcher reads (TORCHELASTIC_ERROR_FILE), so its summary names it. Nothing elsewhere, nor when a
    message is recorded already (the first cause stays)."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


_watching = False


def exit_with_launcher(grace: float = 15.0, poll: float = 0.5) -> None:
    """In a worker that a launcher started (scaletrain --nproc, torchrun, accelerate launch): when that launcher dies,
    however it dies (SIGKILL, a closed terminal, an OOM kill), this process is orphaned; then it is asked to stop
    as a preemption is (SIGTERM: a checkpoint at the next step boundary all processes reach, then exit 75), and
    leaves at the latest `grace` seconds later, without a new checkpoint, waiting on nothing the launcher hosted."""
    global _watching
    parent = os.getppid()
    if _watching or parent == 1 or launched_world_size() is None:
        return
    _watching = True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        print(f"scaletrain: the launcher of this worker (pid {parent}) is gone; stopping", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(75)

    threading.Thread(target=watch, name="scaletrain-launcher-watch", daemon=True).start()
