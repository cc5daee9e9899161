"""How training stops early, the same way on every process: a diverged loss, or a stop signal (SIGTERM, SIGUSR1:
a preemption) noticed at a step boundary and answered with a checkpoint."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from .faults import FaultInjector
from .observe import StepObserver


class TrainingDiverged(Exception):
    """The loss became NaN or infinite on some process; every process raises it at the same step."""

    exit_code = 3


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1) arrived; every process checkpointed at the same step and stops."""

    exit_code = 75  # EX_TEMPFAIL: run the same command again to resume

    @classmethod
    def at_step(cls, step: int, received: str | None) -> "Preempted":
        return cls(f"stopped by {received or 'a signal to another process'} after saving the training state "
                   f"at optimizer step {step}; run the same command again to resume")


class StopSignals:
    """Remembers that SIGTERM or SIGUSR1 arrived, so training can stop at a step boundary after a checkpoint.

    A process that makes no progress after the signal (no batch done within `patience` seconds: stuck in a
    collective whose peer is gone, or hung) cannot reach that boundary; it then exits at once with 128 + the
    signal's number instead of waiting for the launcher's SIGKILL. The last checkpoint stays intact."""

    def __init__(self):
        self.received: str | None = None
        self.patience: float | None = None
        self.beats = 0  # batches done; the watchdog looks for a change
        self.stopping = False  # the loop reached the stop and is saving: no longer watched

    def beat(self) -> None:
        """A batch is done: the process is making progress."""
        self.beats += 1

    def install(self, patience: float | None = None) -> None:
        import signal
        import threading

        self.patience = patience
        if threading.current_thread() is not threading.main_thread():
            return  # handlers are set from the main thread only (Ray Train runs training in a thread of its own)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, num: int, frame) -> None:
        import signal
        import threading

        first = self.received is None
        self.received = signal.Signals(num).name
        if first and self.patience:
            threading.Thread(target=self._watch, args=(num, self.beats), daemon=True).start()

    def _watch(self, num: int, beats: int) -> None:
        import os

        time.sleep(self.patience)  # type: ignore[arg-type]
        if self.beats == beats and not self.stopping:
            print(f"scaletrain: {self.received} received and no progress for {self.patience:g} s (--timeout): this "
                  f"process is stuck; exiting without a new checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + num)


STOP = StopSignals()  # signal handlers are the process's: one receiver for it, handed to the loop by LoopControls


@dataclass(frozen=True)
class LoopControls:
    """What the step loop is told from outside the run, handed to it explicitly: stop requests (the process's
    signal receiver, which the loop also tells of its progress), the fault injector of the failure tests, and when
    the job was launched (its first step is timed from there), and what watches each step."""

    stop: StopSignals
    faults: FaultInjector
    launched_at: float
    observer: StepObserver = StepObserver()  # what watches each optimizer step (verify's recorder); nothing

    @classmethod
    def of_this_process(cls, observer: StepObserver | None = None) -> "LoopControls":
        from ..parallel.launch import launched_at

        return cls(STOP, FaultInjector.from_environment(), launched_at(), observer or StepObserver())
