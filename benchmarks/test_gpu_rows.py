"""The GPU suite's checks as pytest tests: one test per check (benchmarks/gpu_suite.py's CHECKS), each run in a
process of its own with its own time limit, its rows saved for the report; the test fails when a row does.

    python benchmarks/gpu_suite.py [--dry-run] [--only a,b]    # the usual way: sets every option below
    pytest benchmarks/test_gpu_rows.py -m gpu                  # on a GPU machine, directly
"""

from __future__ import annotations

import _gpu_suite as gpu_suite
import pytest


@pytest.mark.gpu
def test_check(check: gpu_suite.Check, ctx: gpu_suite.Ctx, deadline: float):
    """`check` (parametrized by conftest.py from --gpu-only), in a process of its own for at most its time limit."""
    rows = gpu_suite.run_rows(check, ctx, deadline)
    gpu_suite.save_rows(ctx.work, check, rows)
    for r in rows:  # shown as each check ends (pytest -s, as gpu_suite.py runs it on a GPU), not only at the end
        print(f"\n  {r.check}: {r.verdict} {r.figure}" + (f" ({r.reason})" if r.verdict in ("fail", "skipped") else ""),
              flush=True)
    failed = [f"{r.check}: {r.reason}" for r in rows if r.verdict == "fail"]
    assert not failed, "; ".join(failed)
