"""Intra-op threads that fit the machine: each process of a job takes at most its share of the cores it may use.

The cores a process may use are its CPU affinity mask (`taskset`, SLURM's and Kubernetes' pinning), bounded by the
cgroup's CPU quota where one is set (containers: `docker --cpus`, Kubernetes limits); its share is that divided
by the job's processes on this machine. `OMP_NUM_THREADS` is commonly exported as the machine's or the job's core
count (HPC modules, conda activations, cluster defaults), and torchrun keeps it when it is set: with N processes,
N times that many threads then contend for the cores, and each step waits for the slowest. A value above the
share is lowered to it, with one line from the job's first process, unless SCALETRAIN_KEEP_THREADS=1 asks to keep
it; a value at or below the share is the user's and kept. DataLoader workers run one thread each (PyTorch sets it)
and, where the training runs on the CPU, at the lowest scheduling priority (`data_worker_start`): they are not
subtracted from the share, since a worker decodes for a small part of each step while the training's threads
would lose a core for all of it (one thread fewer for one worker trains at 0.54x: benchmarks/photo_schedule.py,
commit e04bcb9).
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import torch

from .stacks import dump_stack_on_signal

KEEP = "SCALETRAIN_KEEP_THREADS"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, bounded by the cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota) if quota else cores)


def _cgroup_quota() -> int | None:
    """The CPU quota of this process's cgroup, in cores rounded up (v2 cpu.max, or v1 cfs quota); None without."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 else None
    except (OSError, ValueError):
        return None


def processes_here() -> int:
    """The job's processes on this machine (LOCAL_WORLD_SIZE, which torchrun, accelerate launch and scaletrain's
    launcher set); 1 for a process started alone."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def share(processes: int | None = None) -> int:
    """One process's share of the usable cores."""
    return max(1, usable_cores() // (processes or processes_here()))


def fit_environment(processes: int) -> str | None:
    """In a launcher, before it starts `processes` workers here: OMP_NUM_THREADS lowered to one worker's share when
    it asks for more (not with SCALETRAIN_KEEP_THREADS=1), so each worker starts with it; the one line saying so,
    else None. Unset, it is left to the caller."""
    asked, fair = os.environ.get("OMP_NUM_THREADS"), share(processes)
    try:
        wanted = int(asked) if asked is not None else 0
    except ValueError:
        return None
    if wanted <= fair or os.environ.get(KEEP) == "1":
        return None
    os.environ["OMP_NUM_THREADS"] = str(fair)  # what this process and the workers it starts read
    return (f"OMP_NUM_THREADS={wanted} asks {processes} process(es) x {wanted} threads of {usable_cores()} usable "
            f"core(s); each process uses {fair} (set {KEEP}=1 to keep {wanted})")


def fit_threads() -> str | None:
    """In a process of a job (however it was started): its intra-op threads lowered to its share when
    OMP_NUM_THREADS asks for more (fit_environment), or set to it with several processes here and the variable
    unset; the one line saying so when OMP_NUM_THREADS was lowered, else None."""
    processes = processes_here()
    lowered = fit_environment(processes)
    fair = share(processes)
    if lowered or (processes > 1 and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > fair):
        torch.set_num_threads(fair)
    return lowered


def leave_stop_signals_to_the_training() -> None:
    """In a DataLoader worker of a process that catches SIGTERM or SIGUSR1 (a training, training/signals.py): such a
    signal from anyone but that process is ignored. Sent to the whole job (SLURM's scancel, `kill -- -PGID`), it
    reaches the workers too, whose own handler (torch's) would end them at once and the training with them, in a
    traceback and before its checkpoint; the training saves at its next step and then ends its workers itself. Its
    own SIGTERM (torch's shutdown of a worker that does not stop, multiprocessing's at exit) still ends the worker,
    as torch's handler does. Where signals cannot be told apart by sender (no sigwaitinfo: macOS, Windows), torch's
    handler stays."""
    import threading

    stops = {s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None))
             if s is not None and callable(signal.getsignal(s))}  # the handlers of the process it was forked from
    if not stops or not hasattr(signal, "sigwaitinfo"):
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # taken by the thread below only (threads started later inherit)

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(stops)
            if info.si_pid == parent and info.si_signo == signal.SIGTERM:
                os._exit(0)

    threading.Thread(target=wait, name="scaletrain-stop-signals", daemon=True).start()


def data_worker_start(worker_id: int, training_on_cpu: bool = False) -> None:
    """A DataLoader worker's start (its worker_init_fn, with functools.partial): its stack written on request
    (stacks.dump_stack_on_signal) and, when the training runs on this machine's CPU, the lowest scheduling priority
    (nice 19). The training's intra-op threads then keep the cores and the workers decode in the time they leave;
    at equal priority a worker preempts one of those threads, and every thread of the step waits for it (a bare
    loop decoding photos in 2 workers trained at 0.89x of the decoded images' speed, 0.90x at nice 19:
    benchmarks/photo_schedule.py, commit e04bcb9). A folder's first run decodes so in its first epoch rather than
    before it, so that its first step waits for one batch, not for the whole folder. A training that waits for its
    next batch leaves the cores idle, so the workers are never starved of them.

    A stop signal that the training catches (SIGTERM, SIGUSR1: training/signals.py) is left to it (see
    leave_stop_signals_to_the_training)."""
    dump_stack_on_signal(worker_id)
    leave_stop_signals_to_the_training()
    if training_on_cpu and hasattr(os, "nice"):
        try:
            os.nice(19 - os.nice(0))
        except OSError:  # raising one's own niceness is always allowed; a platform without it keeps the default
            pass
