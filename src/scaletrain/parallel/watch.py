"""A stalled rank named within a minute, and a rank that fails named on every rank.

Each process marks what it is doing in `BEAT` (a phase such as reading data, forward, backward, collective,
checkpoint, and a count that grows with every mark: attribute writes only). A `Watch` thread in every process of
a job of two or more publishes its process's heartbeat on the job's key-value store every few seconds and reads the
others'. A rank whose count has not moved for --stall-timeout seconds while it is *not* waiting for the others (a
collective, or the backward pass, where DDP reduces gradients) and another rank is waiting, has stalled: the first
watch to see it says so on the store, the stalled rank's own watch adds its Python stack (and, when it waits for a
DataLoader worker, that worker's), and every process prints the same block and exits with STALL_EXIT. Checkpoints
are written whole or not at all, so the last one stays intact and the same command resumes.

A rank whose training raises puts its exception on the store (`Watch.failed`) before it leaves; the other ranks'
collectives then break, and `fit` raises `RankFailed` naming that rank and its exception instead of the
backend's connection error (`Watch.failure`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from datetime import timedelta

from .stacks import awaited_worker, thread_stack, worker_stack
from .launch import record_failure

WAITING = ("collective", "backward")  # phases in which a rank waits for the others (not "backward, accumulating")
STALL_EXIT = 6


class RankFailed(RuntimeError):
    """Another rank of the job raised; this rank's collective broke because it left."""


class Heartbeat:
    """What this process is doing, as the training thread marks it: phase, step, since when, and a count of marks."""

    def __init__(self):
        self.count, self.phase, self.step, self.since = 0, "starting", 0, time.time()

    def mark(self, phase: str, step: int | None = None) -> None:
        self.count += 1
        self.phase, self.since = phase, time.time()
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def during(self, phase: str):
        """`phase` while the block runs, then the phase before it again."""
        before = self.phase
        self.mark(phase)
        try:
            yield
        finally:
            self.mark(before)

    def each(self, phase: str, items):
        """`items`, marking `phase` before each one is fetched."""
        it = iter(items)
        while True:
            self.mark(phase)
            try:
                item = next(it)
            except StopIteration:
                return
            yield item


BEAT = Heartbeat()  # the process's one training thread reports here


def one_line(error: BaseException) -> str:
    """'Type: the first line of its message', as a failure is named to the other ranks and the launcher."""
    lines = str(error).strip().splitlines()
    if lines and lines[0].startswith("Caught ") and "Original Traceback" in str(error):  # from a DataLoader worker
        return f"{lines[-1].strip()} ({lines[0].removeprefix('Caught ').split(' in ', 1)[-1].rstrip('.')})"
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def broken_collective(error: BaseException) -> bool:
    """Whether `error` is a collective operation failing because another process of the job left (gloo's
    'Connection closed by peer', NCCL's errors), rather than a failure of this process's own."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, getattr(dist, "DistError", ())) or (
        isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text or "Connection reset" in text))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


_watches = 0


class Watch:
    """One process's watch over the job (see the module's text): a daemon thread from `start()` to `stop()`."""

    def __init__(self, store, rank: int, world: int, stall_timeout: float, beat: Heartbeat = BEAT):
        import torch.distributed as dist

        global _watches
        _watches += 1  # each fit of a job has keys of its own: every rank starts its watches in the same order
        self.store = dist.PrefixStore(f"scaletrain/watch/{_watches}", store)
        self.rank, self.world, self.stall_timeout, self.beat = rank, world, stall_timeout, beat
        self.interval = max(0.2, min(5.0, stall_timeout / 10)) if stall_timeout else 5.0
        self.main_thread = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.others_failure: str | None = None  # "rank N failed: Type: message", once seen

    # -- the thread ------------------------------------------------------------------------------------------------
    def start(self) -> "Watch":
        self._thread = threading.Thread(target=self._run, name="scaletrain-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 5)

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when this watch saw it change)
        while not self._stop.wait(self.interval):
            try:
                self.poll(seen)
            except Exception:  # the store went away: the job is ending, and its processes report why
                return

    def poll(self, seen: dict[int, tuple[int, float]]) -> None:
        """One look: publish this process's heartbeat, note another rank's failure, report a stall declared, and
        declare one seen here."""
        b = self.beat
        self.store.set(f"beat/{self.rank}", json.dumps([b.count, b.step, b.phase, b.since]))
        if self.store.check(["failed"]):
            self._note_failure()
        if self.store.check(["stall"]):
            self._report(json.loads(self.store.get("stall")))
        keys = [f"beat/{r}" for r in range(self.world)]
        if not self.store.check(keys):  # a rank has not started beating yet
            return
        beats = [json.loads(v) for v in self.store.multi_get(keys)]
        now = time.monotonic()
        for r, (count, *_) in enumerate(beats):
            if seen.get(r, (None,))[0] != count:
                seen[r] = (count, now)
        stalled = self._stalled(beats, seen, now) if self.stall_timeout else None
        if stalled is not None and self.store.add("stall/claim", 1) == 1:
            count, step, phase, since = beats[stalled]
            waiting = {r: beats[r][2] for r in range(self.world) if r != stalled}
            self.store.set("stall", json.dumps({"rank": stalled, "phase": phase, "step": step, "since": since,
                                                "idle": now - seen[stalled][1], "waiting": waiting}))

    def _stalled(self, beats, seen, now: float) -> int | None:
        """The rank that stalled: no progress for --stall-timeout seconds while not waiting, with another rank
        waiting (for it); None when there is none."""
        idle = {r: now - t for r, (_, t) in seen.items()}
        for r in sorted(idle, key=idle.get, reverse=True):
            if idle[r] >= self.stall_timeout and beats[r][2] not in WAITING and \
                    any(beats[o][2] in WAITING for o in idle if o != r):
                return r
        return None

    # -- a stall: every process prints the block and leaves ------------------------------------------------------
    def _report(self, stall: dict) -> None:
        r = stall["rank"]
        if r == self.rank:
            self.store.set(f"stack/{r}", self._own_stack())
        try:
            self.store.wait([f"stack/{r}"], timedelta(seconds=10))
            stack = self.store.get(f"stack/{r}").decode()
        except Exception:
            stack = "    (its stack could not be read: the process does not answer)"
        waiting = ", ".join(f"rank {o} in {p}" for o, p in sorted(stall["waiting"].items(), key=lambda kv: int(kv[0])))
        print(f"scaletrain: rank {r} stalled: no progress for {stall['idle']:.0f} s (--stall-timeout "
              f"{self.stall_timeout:g}), in phase '{stall['phase']}' since {_clock(stall['since'])} at optimizer step "
              f"{stall['step']}, while the others wait for it ({waiting}). Rank {r}'s stack, most recent call last:\n"
              f"{stack}\nscaletrain: error: rank {r} stalled in {stall['phase']}; the job stops (exit {STALL_EXIT}); "
              f"checkpoints written so far are intact: run the same command again to resume",
              file=sys.stderr, flush=True)
        record_failure(f"rank {r} stalled in {stall['phase']} (no progress for {stall['idle']:.0f} s, "
                       f"--stall-timeout {self.stall_timeout:g}); every rank printed its stack")
        # Every process leaves once all have printed (or 10 s passed): a launcher stops the rest of the job as soon
        # as one worker exits, and the store may live in rank 0's process.
        self.store.add("stall/printed", 1)
        deadline = time.monotonic() + 10
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and int(self.store.add("stall/printed", 0)) < self.world:
                time.sleep(0.1)
        time.sleep(0.2 if self.rank == 0 else 0)
        for child in multiprocessing.active_children():  # DataLoader workers: one may be stuck, holding pipes open
            child.kill()
        os._exit(STALL_EXIT)

    def _own_stack(self) -> str:
        text = "\n".join("    " + line for line in thread_stack(self.main_thread).splitlines())
        worker = awaited_worker(self.main_thread)
        if worker is not None:
            wid, pid = worker
            dump = worker_stack(pid)
            text += (f"\n  waiting for the batch of DataLoader worker {wid} (pid {pid}), whose stack is:\n" +
                     ("\n".join("    " + line for line in dump.splitlines()) if dump else
                      "    (not readable: the worker did not answer SIGUSR2)"))
        return text

    # -- a rank that raises ------------------------------------------------------------------------------------
    def failed(self, error: BaseException) -> None:
        """This rank's training raised `error`: say so on the store for the others, unless it is another rank's
        failure seen here; give them a moment to read it (the store may live in this process)."""
        if isinstance(error, RankFailed) or self.others_failure is not None or broken_collective(error) or \
                getattr(error, "quiet", False):
            return  # not this rank's own failure (its collective broke as another left), or another one reports it
        text = json.dumps({"rank": self.rank, "error": one_line(error)})
        try:
            if self.store.add("failed/claim", 1) == 1:
                self.store.set("failed", text)
                if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # it hosts the store
                    deadline = time.monotonic() + self.interval + 1
                    while time.monotonic() < deadline and int(self.store.add("failed/seen", 0)) < self.world - 1:
                        time.sleep(0.05)
        except Exception:  # the store is gone already
            pass

    def _note_failure(self) -> None:
        if self.others_failure is None:
            failed = json.loads(self.store.get("failed"))
            if failed["rank"] != self.rank:
                self.others_failure = f"rank {failed['rank']} failed: {failed['error']}"
                self.store.add("failed/seen", 1)

    def failure(self) -> str | None:
        """Another rank's failure, as it reported it ("rank N failed: Type: message"), or None."""
        if self.others_failure is None:
            with contextlib.suppress(Exception):
                if self.store.check(["failed"]):
                    self._note_failure()
        return self.others_failure
