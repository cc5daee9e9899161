"""A stalled rank named within a minute, wherever it stalls, and a rank that fails named on every rank.

Each process marks its progress in `BEAT` (a phase such as reading data, forward, backward, collective,
checkpoint, validation, and counts: attribute writes only). A `Watch` thread in every process of a job of two or
more publishes its process's heartbeat on the job's key-value store every few seconds and reads the others'.
Progress decides, not a list of phases: a rank with no progress for --stall-timeout seconds that is behind another
in the marks every rank makes alike has stalled (the others wait for it wherever they are: DDP's forward, a
backward's all-reduce, a collective of the user's, FSDP's all-gathers), and when no rank has progressed for that
long the job is stuck as a whole. A phase whose progress shows otherwise (the bytes of a checkpoint written) is not
a stall while it moves. The watch that sees it says so on the store; every process publishes its stack (and, when
it waits for a DataLoader worker, that worker's); a process whose Python threads cannot run (a C call that holds
the GIL) has its stack dumped by faulthandler's watchdog, which the watch keeps pushing back; the watch that saw the
stall prints one block with every rank's stack, and every process exits with STALL_EXIT. Checkpoints are written
whole or not at all, so the last one stays intact and the same command resumes.

A rank whose training raises puts its exception on the store (`Watch.failed`) before it leaves; the other ranks'
collectives then break, and `fit` raises `RankFailed` naming that rank and its exception instead of the
backend's connection error (`Watch.failure`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

from .stacks import (StackDump, awaited_worker, dumped_stack, innermost_frame, thread_stack, users_frame,
                     worker_stack)
from .launch import record_failure

STALL_EXIT = 6
FIRST_STEP_PATIENCE = 10  # a job stuck as a whole before any optimizer step: --stall-timeout x this (compiling)


class RankFailed(RuntimeError):
    """Another rank of the job raised; this rank's collective broke because it left."""


class Heartbeat:
    """This process's progress, as its training thread marks it (attribute writes only).

    `count` is its place in the sequence of marks every rank makes alike (each batch read, forward, backward,
    optimizer step, collective, validation batch, checkpoint): of two ranks of a job, the one with the smaller count
    is behind, and the other waits for it sooner or later. `ticks` grows with every mark and with progress of this
    process alone: a phase may carry a `probe` (the bytes of the checkpoint written so far) that the watch reads at
    each look, and a change of it counts. `phase`, `step` and `since` (the last progress) say where it is."""

    def __init__(self):
        self.count, self.ticks, self.phase, self.step, self.since = 0, 0, "starting", 0, time.time()
        self.probe: Callable[[], object] | None = None
        self.role = ""  # what this process is in a layout that needs saying (a tensor-parallel rank)

    def mark(self, phase: str, step: int | None = None, probe: Callable[[], object] | None = None) -> None:
        self.count += 1
        self.ticks += 1
        self.phase, self.since, self.probe = phase, time.time(), probe
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def during(self, phase: str, probe: Callable[[], object] | None = None):
        """`phase` (with its progress `probe`) while the block runs, then the phase before it again."""
        before = self.phase
        self.mark(phase, probe=probe)
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


def folder_bytes(path) -> Callable[[], int]:
    """A probe: the bytes of the files under `path` (a checkpoint being written)."""
    def size() -> int:
        total = 0
        for root, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(root, name)).st_size
        return total
    return size


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


def _say(text: str) -> None:
    """`text` and its newline on stderr in one write: print() writes a text and its end separately, and a text
    with newlines in it is flushed before its end, leaving room for another process's line in between."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


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
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dump: StackDump | None = None
        self._probed: object = None
        self._frozen: list[int] = []  # processes of this host whose Python threads do not run, once a stall is seen
        self.others_failure: str | None = None  # "rank N failed: Type: message", once seen

    # -- the thread ------------------------------------------------------------------------------------------------
    def start(self) -> "Watch":
        """Publish this process's heartbeat and arm its watchdog now (the thread's first look comes an interval
        later: a C call holding the GIL before it would leave this rank unseen), then start the thread."""
        if self.stall_timeout:
            self._dump = StackDump()
            self._dump.arm(self.stall_timeout + 2 * self.interval)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="scaletrain-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 5)
        if self._dump is not None:
            self._dump.close()

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (ticks, when this watch saw them change)
        while not self._stop.wait(self.interval):
            try:
                self.poll(seen)
            except Exception:  # the store went away: the job is ending, and its processes report why
                return

    def _publish(self) -> None:
        b = self.beat
        phase = f"{b.phase}, {b.role}" if b.role else b.phase  # as the other ranks will name it
        self.store.set(f"beat/{self.rank}", json.dumps([b.count, b.ticks, b.step, phase, b.since, os.getpid(),
                                                        self.host]))

    def poll(self, seen: dict[int, tuple[int, float]]) -> None:
        """One look: publish this process's progress, note another rank's failure, report a stall declared, and
        declare one seen here."""
        b = self.beat
        if self._dump is not None:  # dumped only if the next look does not come: no Python thread runs here
            self._dump.arm(self.stall_timeout + 2 * self.interval)
        if b.probe is not None:
            with contextlib.suppress(Exception):
                value = b.probe()
                if value != self._probed:
                    self._probed = value
                    b.ticks += 1
                    b.since = time.time()
        self._publish()
        if self.store.check(["failed"]):
            self._note_failure()
        if self.store.check(["stall"]):
            self._report(json.loads(self.store.get("stall")))
        keys = [f"beat/{r}" for r in range(self.world)]
        if not self.store.check(keys):  # a rank has not started beating yet
            return
        beats = [json.loads(v) for v in self.store.multi_get(keys)]
        now = time.monotonic()
        for r, (_, ticks, *_) in enumerate(beats):
            if seen.get(r, (None,))[0] != ticks:
                seen[r] = (ticks, now)
        stalled = self._stalled(beats, {r: now - t for r, (_, t) in seen.items()}) if self.stall_timeout else None
        if stalled and self.store.add("stall/claim", 1) == 1:
            self.store.set("stall", json.dumps({
                "ranks": stalled, "whole": len(stalled) == self.world, "reporter": self.rank,
                "beats": {r: {"phase": b[3], "step": b[2], "since": b[4], "idle": now - seen[r][1], "pid": b[5],
                              "host": b[6]} for r, b in enumerate(beats)}}))

    def _stalled(self, beats, idle: dict[int, float]) -> list[int]:
        """The ranks that stalled: no progress for --stall-timeout seconds while behind another rank in the marks
        every rank makes (the others wait for them, or soon will), the furthest behind first; else, when no rank
        has progressed for that long (before the first optimizer step: FIRST_STEP_PATIENCE times as long), every
        rank (the job is stuck as a whole). Empty when none."""
        counts = [b[0] for b in beats]
        behind = [r for r in range(self.world) if idle[r] >= self.stall_timeout and counts[r] < max(counts)]
        if behind:
            last = min(counts[r] for r in behind)
            return [r for r in behind if counts[r] == last]
        patience = self.stall_timeout * (1 if all(b[2] > 0 for b in beats) else FIRST_STEP_PATIENCE)
        return list(range(self.world)) if all(t >= patience for t in idle.values()) else []

    # -- a stall: the block, once, and every process leaves ------------------------------------------------------
    def _report(self, stall: dict) -> None:
        self.store.set(f"stack/{self.rank}", json.dumps(self._own_stack()))
        stalled, beats = stall["ranks"], stall["beats"]
        phases = ", ".join(f"rank {r} in {beats[str(r)]['phase']}" for r in stalled)
        what = (f"rank {stalled[0]} stalled in {beats[str(stalled[0])]['phase']}" if len(stalled) == 1 else
                f"the job is stuck, every rank stalled ({phases})" if stall["whole"] else
                f"ranks {', '.join(map(str, stalled))} stalled ({phases})")
        beat = beats[str(stalled[0])]
        # The watch that saw it prints the block, the others one line each once it is out (up to 10 s), so that no
        # line of theirs lands inside it: every process writes to the same terminal or log.
        if stall["reporter"] == self.rank:
            _say(self._block(stall))
            self.store.set("stall/block", "1")
        else:
            with contextlib.suppress(Exception):  # waited for up to 10 s
                self.store.wait(["stall/block"], timedelta(seconds=10))
        _say(f"scaletrain: error: {what}; the job stops (exit {STALL_EXIT}); checkpoints written so far are intact: "
             f"run the same command again to resume")
        record_failure(f"{what} (no progress for {beat['idle']:.0f} s, --stall-timeout "
                       f"{self.stall_timeout:g}); every rank's stack is printed above")
        # Every process leaves once all have printed (or 15 s passed): a launcher stops the rest of the job as soon
        # as one worker exits, and the store may live in rank 0's process.
        self.store.add("stall/printed", 1 + len(self._frozen))  # (the frozen ones print nothing: counted here)
        deadline = time.monotonic() + 15
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and int(self.store.add("stall/printed", 0)) < self.world:
                time.sleep(0.1)
        time.sleep(0.2 if self.rank == 0 else 0)
        for pid in self._frozen:  # it cannot act on the launcher's SIGTERM: not waiting out the launcher's grace
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for child in multiprocessing.active_children():  # DataLoader workers: one may be stuck, holding pipes open
            child.kill()
        os._exit(STALL_EXIT)

    def _block(self, stall: dict) -> str:
        """The stall's block: who stalled, since when, in what (phase, the innermost frame of the user's code), and
        every rank's stack (read from the store; a process whose Python threads cannot run, from its watchdog's
        dump), with what to do."""
        stacks = self._stacks(stall)
        stalled, beats = stall["ranks"], stall["beats"]
        lines = []
        if stall["whole"]:
            lines.append(f"scaletrain: the job is stuck: no rank has made progress for "
                         f"{min(b['idle'] for b in beats.values()):.0f} s (--stall-timeout {self.stall_timeout:g}).")
        for r in stalled:
            b, st = beats[str(r)], stacks[r]
            mine = f", in your code at {st['user']}" if st.get("user") else ""
            phase = (f"its Python threads stopped (last heard of in phase '{b['phase']}' at optimizer step "
                     f"{b['step']})" if st.get("frozen") else
                     f"in phase '{b['phase']}' since {_clock(b['since'])} at optimizer step {b['step']}")
            lines.append(f"scaletrain: rank {r} stalled: no progress for {b['idle']:.0f} s (--stall-timeout "
                         f"{self.stall_timeout:g}), {phase}{mine}.")
        waiting = [r for r in range(self.world) if r not in stalled]
        if waiting:
            lines.append("The others wait for it: " + ", ".join(
                f"rank {r} in {beats[str(r)]['phase']}" + (f" at {stacks[r]['inner']}" if stacks[r].get("inner")
                                                            else "") for r in waiting) + ".")
        for r in [*stalled, *waiting]:
            lines.append(f"Rank {r}'s stack ({'stalled' if r in stalled else 'waiting'}), "
                         f"{stacks[r].get('order', 'most recent call last')}:\n{stacks[r]['stack']}")
        lines.append("What to do: fix the code in the stalled rank's stack; if that phase is legitimately slower than "
                     f"--stall-timeout {self.stall_timeout:g} s (a very large checkpoint, a slow upload, compiling), "
                     "raise --stall-timeout (0 turns the watch off).")
        return "\n".join(lines)

    def _stacks(self, stall: dict) -> dict[int, dict]:
        """Every rank's stack as it published it; for a rank whose Python threads cannot run, its watchdog's dump
        once written (on this host); up to 10 s."""
        deadline, stacks = time.monotonic() + 10, {}
        while len(stacks) < self.world:
            for r in set(range(self.world)) - set(stacks):
                if self.store.check([f"stack/{r}"]):
                    stacks[r] = json.loads(self.store.get(f"stack/{r}"))
                    continue
                beat = stall["beats"][str(r)]
                dump = dumped_stack(beat["pid"], wait=0) if beat["host"] == self.host else None
                if dump or time.monotonic() > deadline:
                    stacks[r] = {
                        "stack": _indent(dump) if dump else "    (not readable: its Python threads do not run, and it "
                                                            "runs on another host)",
                        "user": users_frame(dump, most_recent_first=True) if dump else None, "frozen": True,
                        "order": "dumped by faulthandler, as no Python thread of it runs (a C call that holds the GIL)"
                                 ", most recent call first"}
            if len(stacks) < self.world:
                time.sleep(0.1)
        self._frozen = [stall["beats"][str(r)]["pid"] for r, st in stacks.items()
                        if st.get("frozen") and stall["beats"][str(r)]["host"] == self.host]
        return stacks

    def _own_stack(self) -> dict:
        """This process's training thread's stack (and the DataLoader worker's it waits for), the innermost frame
        of the user's code in them, and the innermost frame of all (where it waits)."""
        main = thread_stack(self.main_thread)
        text = _indent(main)
        user = users_frame(main)
        worker = awaited_worker(self.main_thread)
        if worker is not None:
            wid, pid = worker
            dump = worker_stack(pid)
            text += (f"\n  waiting for the batch of DataLoader worker {wid} (pid {pid}), whose stack is:\n" +
                     (_indent(dump) if dump else "    (not readable: the worker did not answer SIGUSR2)"))
            user = (users_frame(dump, most_recent_first=True) if dump else None) or user
        return {"stack": text, "user": user, "inner": innermost_frame(main)}


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


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
