"""benchmarks/gpu_suite.py keeps working while no GPU is lent: its harness and its correctness checks in a dry run on
the CPU, as a user would start it (`--stage` dry-runs every check before a lease)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_python

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_suite.py"
SECTIONS = {"correctness", "speed", "memory", "multi-gpu"}
VERDICTS = {"pass", "fail", "skipped", "measured"}


def _suite(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """A dry run as a user starts it. Its pytest and the commands of its checks are forked (tests/forkserver.py),
    one check at a time on one thread, as this test worker shares the cores with the other one."""
    out = tmp_path / "suite.json"
    proc = run_python([sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--work-dir",
                       str(tmp_path / "work"), "--jobs", "1", "--threads", "1", *args], timeout=600, env=env)
    return proc, json.loads(out.read_text())


# The checks whose dry run the tests make: the correctness checks and one of each other section (about a minute
# of checks on 2 cores). The speed and multi-GPU checks' dry run (3-4 minutes more: DDP on 1 vs 2 processes, the
# speed pairs against seed 000, the photo rows) is what `gpu_suite.py --stage` ends with, before a GPU is leased.
CHECKED = "default,precisions,dp,fsdp,sync-bn,predict,evaluate,resume,stages,memory-resnet50,jpeg,own-code"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    proc, report = _suite(tmp_path_factory.mktemp("suite"), "--only", CHECKED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc, report


@pytest.fixture(scope="module")
def dry_rows(dry_run):
    return {r["check"]: r for r in dry_run[1]["rows"]}


@pytest.mark.slow
def test_dry_run_records_the_machine_and_that_it_was_a_dry_run(dry_run):
    _, report = dry_run
    assert {"gpu", "driver", "torch", "cuda", "date"} <= set(report["meta"]) and report["meta"]["dry_run"] is True


@pytest.mark.slow
def test_dry_run_reports_every_section_with_known_verdicts(dry_run):
    rows = dry_run[1]["rows"]
    assert {r["section"] for r in rows} == SECTIONS
    assert {r["verdict"] for r in rows} <= VERDICTS


@pytest.mark.slow
def test_dry_run_fails_no_check(dry_run):
    assert [r["check"] for r in dry_run[1]["rows"] if r["verdict"] == "fail"] == []


@pytest.mark.slow
def test_every_skipped_check_says_why(dry_run):
    assert [r["check"] for r in dry_run[1]["rows"] if r["verdict"] == "skipped" and not r["reason"]] == []


@pytest.mark.slow
def test_dry_run_prints_one_table_row_per_check_in_order(dry_run):
    proc, report = dry_run
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| verdict |" not in line]
    assert [line.split(" | ")[1] for line in printed] == [r["check"] for r in report["rows"]]


@pytest.mark.slow
@pytest.mark.parametrize("title", ["default run (fp32)", "bf16 vs fp32"])
def test_dry_run_judges_what_a_cpu_can(dry_rows, title):
    assert dry_rows[title]["verdict"] == "pass", dry_rows[title]


@pytest.mark.slow
def test_dry_run_resumes_a_sigkilled_run_bitwise_equal(dry_rows):
    resumed = dry_rows["SIGKILL + resume ends equal to the uninterrupted run"]
    assert resumed["verdict"] == "pass" and "bitwise equal" in resumed["figure"], resumed


@pytest.mark.slow
@pytest.mark.parametrize("title", [
    "--strategy dp on every GPU, fp32", "predict on CUDA vs the CPU (same weights)",
    "evaluate on CUDA vs the CPU (same weights)", "estimate-memory vs the CUDA allocator's peak: resnet50",
    "JPEG decoding: torchvision on the GPU (batched) vs the CPU"])
def test_cuda_checks_are_skipped_but_their_code_ran_on_the_cpu(dry_rows, title):
    """CUDA rows are skipped, but their code ran: the figure is what it measured on the CPU."""
    assert dry_rows[title]["verdict"] == "skipped" and "needs CUDA" in dry_rows[title]["reason"], dry_rows[title]
    assert dry_rows[title]["figure"], title


@pytest.mark.slow
@pytest.mark.parametrize("title", ["fp16 (loss scaler) vs fp32", "--strategy dp on every GPU, bf16",
                                   "--strategy fsdp, 2 processes (NCCL)",
                                   "--strategy pipeline, 2 stages (NCCL) vs the model whole, fp32"])
def test_what_the_cpu_cannot_stand_in_for_is_skipped_without_a_figure(dry_rows, title):
    assert dry_rows[title]["verdict"] == "skipped" and dry_rows[title]["figure"] == "", dry_rows[title]


@pytest.mark.slow
def test_checks_the_budget_leaves_no_time_for_are_skipped_not_lost(tmp_path):
    proc, report = _suite(tmp_path, "--only", "default,resume", "--budget", "1")
    assert proc.returncode == 0
    assert [r["verdict"] for r in report["rows"]] == ["skipped"] * 3
    assert all("budget" in r["reason"] for r in report["rows"])


@pytest.mark.slow
def test_a_hanging_check_is_stopped_on_time_with_its_commands_and_said_to_be_cut_by_the_budget(tmp_path):
    # Every `scaletrain train` the suite starts stops answering after its second batch; the budget gives each
    # check at most 16 s. The JPEG check runs beside it (a dry run runs 2 checks at a time). Stopped by what was
    # left of the suite's budget, not by its own limit, its rows are skipped saying so: on a loaded machine the
    # last check of a dry run was once a failed row for being cut short.
    _, report = _suite(tmp_path, "--only", "default,jpeg", "--budget", "16", "--jobs", "2",
                       env={"SCALETRAIN_FAULT": "hang:2"})
    rows = {r["check"]: r for r in report["rows"]}
    for title in ("default run (fp32)", "time to 99 % val accuracy (embedded digits)"):
        assert rows[title]["verdict"] == "skipped" and re.search(r"budget ran out 1\d s into this check",
                                                                 rows[title]["reason"]), rows[title]
    assert rows["JPEG decoding: torchvision on the GPU (batched) vs the CPU"]["figure"], "the other check ran"
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True, check=False).stdout
    assert left == "", "a process of the stopped check is still running"


def test_every_check_is_one_gpu_test_that_pytest_collects():
    """`pytest benchmarks/test_gpu_rows.py -m gpu` on a GPU machine runs each check of the suite as a test of its
    own, in the suite's order (the one alone-check only when named)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", str(SUITE.parent / "test_gpu_rows.py"), "-m", "gpu",
                           "--collect-only", "-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                          timeout=120, cwd=SUITE.parent.parent, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line.split("[", 1)[1].rstrip("]") for line in proc.stdout.splitlines() if "::test_check[" in line]
    sys.path.insert(0, str(SUITE.parent))
    try:
        import _gpu_suite as gpu_suite
    finally:
        sys.path.remove(str(SUITE.parent))
    assert collected == [c.name for c in gpu_suite.CHECKS if not c.alone]
