"""benchmarks/gpu_suite.py keeps working while no GPU is lent: its dry run on the CPU, as a user would start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_suite.py"
SECTIONS = {"correctness", "speed", "memory", "multi-gpu"}
VERDICTS = {"pass", "fail", "skipped", "measured"}


def _suite(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--work-dir",
                           str(tmp_path / "work"), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return _suite(tmp_path_factory.mktemp("suite"))


def test_dry_run_passes_and_reports_every_section(dry_run):
    proc, report = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {"gpu", "driver", "torch", "cuda", "date"} <= set(report["meta"]) and report["meta"]["dry_run"]
    rows = report["rows"]
    assert {r["section"] for r in rows} == SECTIONS
    assert {r["verdict"] for r in rows} <= VERDICTS
    assert [r["check"] for r in rows if r["verdict"] == "fail"] == []
    assert all(r["reason"] for r in rows if r["verdict"] == "skipped")
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| verdict |" not in line]
    assert [line.split(" | ")[1] for line in printed] == [r["check"] for r in rows]


def test_dry_run_judges_what_a_cpu_can_and_runs_the_code_of_the_rest(dry_run):
    rows = {r["check"]: r for r in dry_run[1]["rows"]}
    assert rows["default run (fp32)"]["verdict"] == "pass"
    assert rows["bf16 vs fp32"]["verdict"] == "pass"
    resumed = rows["SIGKILL + resume ends equal to the uninterrupted run"]
    assert resumed["verdict"] == "pass" and "bitwise equal" in resumed["figure"]
    # CUDA rows are skipped, but their code ran: the figure is what it measured on the CPU.
    ran = ["--strategy dp on every GPU, fp32", "predict on CUDA vs the CPU (same weights)",
           "evaluate on CUDA vs the CPU (same weights)", "estimate-memory vs the CUDA allocator's peak: resnet50",
           "model FLOPs utilisation of the training step", "JPEG decoding: torchvision on the GPU (batched) vs the CPU",
           "DDP on 1 vs every GPU"]
    peer_rows = ["seed 000 vs scaletrain, fp32, images/s",
                 "on-device input pipeline vs seed 000's albumentations DataLoader"]
    if (SUITE.parent.parent.parent / "shared" / "peers" / "seed000_accelerate.py").exists():
        ran += peer_rows
    else:  # a checkout without ../shared beside it: the seed's script is missing, and the suite says where to put it
        assert all("--stage" in rows[title]["reason"] for title in peer_rows)
    for title in ran:
        assert rows[title]["verdict"] == "skipped" and "needs CUDA" in rows[title]["reason"], rows[title]
        assert rows[title]["figure"], title
    # What needs a GPU the CPU cannot stand in for carries no figure at all.
    for title in ("fp16 (loss scaler) vs fp32", "--strategy dp on every GPU, bf16", "DP on every GPU vs DDP",
                  "--strategy fsdp, 2 processes (NCCL)"):
        assert rows[title]["verdict"] == "skipped" and rows[title]["figure"] == "", rows[title]


def test_checks_the_budget_leaves_no_time_for_are_skipped_not_lost(tmp_path):
    proc, report = _suite(tmp_path, "--only", "default,resume", "--budget", "1")
    assert proc.returncode == 0
    assert [r["verdict"] for r in report["rows"]] == ["skipped"] * 3
    assert all("budget" in r["reason"] for r in report["rows"])


def test_a_hanging_check_is_one_failed_row_stopped_on_time_with_its_commands(tmp_path):
    # Every `scaletrain train` the suite starts stops answering after its second batch; the budget gives each
    # check at most 16 s. The JPEG check runs beside it (a dry run runs 2 checks at a time).
    proc, report = _suite(tmp_path, "--only", "default,jpeg", "--budget", "16", env={"SCALETRAIN_FAULT": "hang:2"})
    assert proc.returncode == 1 and "**fail**" in proc.stdout
    rows = {r["check"]: r for r in report["rows"]}
    assert rows["default run (fp32)"]["verdict"] == "fail" and "timed out" in rows["default run (fp32)"]["reason"]
    assert rows["time to 99 % val accuracy (embedded digits)"]["verdict"] == "fail"
    assert rows["JPEG decoding: torchvision on the GPU (batched) vs the CPU"]["figure"], "the other check ran"
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True).stdout
    assert left == "", "a process of the stopped check is still running"
