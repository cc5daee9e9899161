"""Fault injection for the tests of failure handling: kill or stall one worker at a chosen optimizer step.

Set SCALETRAIN_FAULT to "kill:STEP[:RANK]" or "hang:STEP[:RANK]" (RANK defaults to 0) and, so that the fault
fires once and not again after the restart it causes, SCALETRAIN_FAULT_ONCE to a file path: the fault fires only
while that file does not exist, and creates it. Nothing happens when SCALETRAIN_FAULT is unset.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def after_step(step: int, rank: int) -> None:
    spec = os.environ.get("SCALETRAIN_FAULT")
    if not spec:
        return
    kind, at, *who = spec.split(":")
    if step != int(at) or rank != int(who[0] if who else 0):
        return
    once = os.environ.get("SCALETRAIN_FAULT_ONCE")
    if once:
        if Path(once).exists():
            return
        Path(once).write_text(spec)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
