"""torch.compile as the training loop runs it (--compile; what is compiled, and when in the model's
parallelization, is parallel/blocks.py's `compile_blocks` and parallel/engine.py's). A batch of another size than
the one compiled (an epoch's last) runs eagerly rather than compiling the model again: the same samples, the same
arithmetic up to the compiler's rounding. Validation runs eagerly too (the trained weights are evaluated as they
are)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def eager_unless(compiled_batch: int | None, x: Any = None):
    """A context running compiled code eagerly, unless the batch `x` is of the compiled size `compiled_batch`
    (None: nothing compiled, nothing changed; x None: always eagerly, for validation)."""
    if compiled_batch is None or (x is not None and len(x) == compiled_batch) or \
            not hasattr(torch.compiler, "set_stance"):  # torch before 2.6 compiles such a batch again
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent compiling in this process so far, by its own tally (None where this torch
    keeps none)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent()["total_wall_time"])
    except (ImportError, KeyError, TypeError, AttributeError):
        return None
