"""Python stacks of a process that stopped making progress: its training thread's, and that of the DataLoader worker
it waits for.

A worker started by scaletrain's DataLoaders registers `faulthandler` for SIGUSR2 (`dump_stack_on_signal`), writing
into a file it unlinks at once: nothing is left on disk, and the process that waits for the worker reads the dump
through /proc (Linux). Used by the stall watch (watch.py); the data layer's DataLoaders start their workers with
`dump_stack_on_signal`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_MARK = "scaletrain-stack-"
_dump_file = None  # the worker's dump file, kept open for faulthandler


def dump_stack_on_signal(worker_id: int = 0) -> None:
    """In a DataLoader worker (its worker_init_fn): SIGUSR2 writes this process's Python stack to an unlinked file
    that `worker_stack` finds by its name. Does nothing where the signal or /proc is missing."""
    global _dump_file
    if not hasattr(signal, "SIGUSR2") or not Path("/proc/self/fd").is_dir():
        return
    _dump_file = tempfile.NamedTemporaryFile("w+", prefix=_MARK, suffix=".txt", delete=False)
    os.unlink(_dump_file.name)
    faulthandler.register(signal.SIGUSR2, file=_dump_file, all_threads=False)


def worker_stack(pid: int, wait: float = 1.0) -> str | None:
    """The Python stack of worker process `pid` (one that ran `dump_stack_on_signal`), or None."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        dump = next(p for p in fds.iterdir() if _MARK in os.readlink(p))
        os.kill(pid, signal.SIGUSR2)
    except (OSError, StopIteration):
        return None
    deadline = time.monotonic() + wait
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            text = dump.read_text()
        except OSError:
            return None
        if text.strip():
            break
    return text.strip() or None


def thread_stack(ident: int | None = None) -> str:
    """The Python stack of a thread of this process (the main thread by default), most recent call last."""
    frame = sys._current_frames().get(ident or threading.main_thread().ident)  # type: ignore[arg-type]
    return "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(the thread has ended)"


def awaited_worker(ident: int | None = None) -> tuple[int, int] | None:
    """(worker id, pid) of the DataLoader worker whose batch a thread of this process (the main thread by default)
    is waiting for, found in its stack; None when it waits for none."""
    frame = sys._current_frames().get(ident or threading.main_thread().ident)  # type: ignore[arg-type]
    while frame is not None:
        it = frame.f_locals.get("self")
        if type(it).__name__ == "_MultiProcessingDataLoaderIter":
            info = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", None))
            if info is None or len(info) != 1:  # the batch arrived already, or the pass is over
                return None
            worker = info[0]
            return worker, it._workers[worker].pid
        frame = frame.f_back
    return None
