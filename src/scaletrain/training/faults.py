"""Fault injection for the tests of failure handling: kill, stop, stall or fail one worker after a chosen batch.

Set SCALETRAIN_FAULT to "KIND:BATCH[:RANK]", where KIND is kill (SIGKILL), term (SIGTERM, as a preemption),
int (SIGINT, as Ctrl-C), hang (stop answering) or raise (an exception, as a corrupt record would), BATCH counts
the run's micro-batches from 1 across epochs, and RANK defaults to 0. Set SCALETRAIN_FAULT_ONCE to a file path
so that the fault fires once and not again after the restart it causes: it fires only while that file does not
exist, and creates it. Nothing happens when SCALETRAIN_FAULT is unset.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FaultInjector:
    """The fault a test asked for ("KIND:BATCH[:RANK]"; "" for none) and the file that makes it fire once."""

    spec: str = ""
    once: str = ""

    @classmethod
    def from_environment(cls) -> "FaultInjector":
        return cls(os.environ.get("SCALETRAIN_FAULT", ""), os.environ.get("SCALETRAIN_FAULT_ONCE", ""))

    def after_batch(self, batch: int, rank: int) -> None:
        if not self.spec:
            return
        kind, at, *who = self.spec.split(":")
        if batch != int(at) or rank != int(who[0] if who else 0):
            return
        if self.once:
            if Path(self.once).exists():
                return
            Path(self.once).write_text(self.spec)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "int":
            os.kill(os.getpid(), signal.SIGINT)
        elif kind == "raise":
            raise RuntimeError(f"fault injected after batch {batch} (SCALETRAIN_FAULT={self.spec})")
        elif kind == "hang":
            while True:
                time.sleep(3600)
