"""Python stacks of a process that stopped making progress: its training thread's, that of the DataLoader worker
it waits for, and that of a process whose Python threads cannot run at all.

A worker started by scaletrain's DataLoaders registers `faulthandler` for SIGUSR2 (`dump_stack_on_signal`), writing
into a file it unlinks at once: nothing is left on disk, and the process that waits for the worker reads the dump
through /proc (Linux). A training process keeps `faulthandler`'s watchdog armed (`StackDump`): its watch thread
pushes the deadline back at every look, so the dump is written only when that thread cannot run (a C call that
holds the GIL), from faulthandler's own C thread, into an unlinked file another process of the host reads through
/proc (`dumped_stack`). Used by the stall watch (watch.py); the data layer's DataLoaders start their workers with
`dump_stack_on_signal`.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_MARK = "scaletrain-stack-"
_GIL_MARK = "scaletrain-watchdog-"  # (a worker forked from the process inherits its file: a name of its own)
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
    dump = _dump_file(pid, _MARK)
    try:
        if dump is None:
            return None
        os.kill(pid, signal.SIGUSR2)
    except OSError:
        return None
    return _read_dump(dump, wait)


def _dump_file(pid: int, mark: str) -> Path | None:
    """Process `pid`'s open file (through /proc) whose name carries `mark`: one of the unlinked dump files."""
    try:
        return next(p for p in Path(f"/proc/{pid}/fd").iterdir() if mark in os.readlink(p))
    except (OSError, StopIteration):
        return None


def _read_dump(dump: Path, wait: float) -> str | None:
    """What `dump` holds, waiting up to `wait` seconds for something to be written; None when nothing is."""
    deadline = time.monotonic() + wait
    while True:
        try:
            text = dump.read_text().strip()
        except OSError:
            return None
        if text or time.monotonic() > deadline:
            return text or None
        time.sleep(0.1)


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


class StackDump:
    """faulthandler's watchdog in this process: `arm(seconds)` at every look of the watch; when the next look does
    not come in time (no Python thread runs), every thread's stack is written to an unlinked file of this process
    that `dumped_stack(os.getpid())` reads from another process. Linux only (through /proc); elsewhere nothing."""

    def __init__(self):
        self.file = None
        if Path("/proc/self/fd").is_dir():
            self.file = tempfile.NamedTemporaryFile("w+", prefix=_GIL_MARK, suffix=".txt", delete=False)
            os.unlink(self.file.name)

    def arm(self, seconds: float) -> None:
        if self.file is None:
            return
        if os.fstat(self.file.fileno()).st_size:  # it fired during a long C call that has ended: start afresh
            self.file.truncate(0)
            self.file.seek(0)
        faulthandler.dump_traceback_later(seconds, repeat=False, file=self.file, exit=False)

    def close(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()
            self.file = None


def dumped_stack(pid: int, wait: float = 5.0) -> str | None:
    """What the watchdog of process `pid` of this host (a `StackDump`) wrote, waiting up to `wait` seconds for it;
    None when there is nothing (the process is elsewhere, or its Python threads run)."""
    dump = _dump_file(pid, _GIL_MARK)
    return None if dump is None else _read_dump(dump, wait)


_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_NOT_USERS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # scaletrain's own
                    os.path.dirname(os.__file__) + os.sep,  # the standard library, site-packages within it
                    *(p.rstrip(os.sep) + os.sep for p in sys.path if p.endswith("-packages"))})


def users_frame(stack: str, most_recent_first: bool = False) -> str | None:
    """The innermost frame of the user's own code in a stack's text ('mine.py:27 in __getitem__'): the first one
    that is neither scaletrain's, nor the standard library's, nor an installed package's."""
    frames = _FRAME.findall(stack)
    for path, line, func in (frames if most_recent_first else reversed(frames)):
        if not path.startswith(_NOT_USERS) and not path.startswith("<"):
            return f"{path}:{line} in {func}"
    return None


def innermost_frame(stack: str) -> str | None:
    """The innermost frame of a stack's text, most recent call last ('distributed_c10d.py:2501 in all_reduce')."""
    frames = _FRAME.findall(stack)
    return f"{os.path.basename(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else None
