"""Fault injection for the tests of failure handling: kill, stop or stall one worker after a chosen batch.

Set SCALETRAIN_FAULT to "KIND:BATCH[:RANK]", where KIND is kill (SIGKILL), term (SIGTERM, as a preemption) or
hang (stop answering), BATCH counts the run's micro-batches from 1 across epochs, and RANK defaults to 0. Set
SCALETRAIN_FAULT_ONCE to a file path so that the fault fires once and not again after the restart it causes: it
fires only while that file does not exist, and creates it. Nothing happens when SCALETRAIN_FAULT is unset.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_SPEC = os.environ.get("SCALETRAIN_FAULT")


def after_batch(batch: int, rank: int) -> None:
    if not _SPEC:
        return
    kind, at, *who = _SPEC.split(":")
    if batch != int(at) or rank != int(who[0] if who else 0):
        return
    once = os.environ.get("SCALETRAIN_FAULT_ONCE")
    if once:
        if Path(once).exists():
            return
        Path(once).write_text(_SPEC)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "hang":
        while True:
            time.sleep(3600)
