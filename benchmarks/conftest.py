"""pytest's side of the GPU suite (benchmarks/test_gpu_rows.py): its options, one context per runner process, and
the report the controlling process writes at the end. `python benchmarks/gpu_suite.py` runs it with every option
filled in; on a GPU machine `pytest benchmarks/test_gpu_rows.py -m gpu` works as well."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "src")]
import _gpu_suite as gpu_suite


def pytest_addoption(parser):
    group = parser.getgroup("gpu suite")
    group.addoption("--gpu-dry-run", action="store_true", help="tiny sizes on the CPU: CUDA rows skipped")
    group.addoption("--gpu-work-dir", default="", help="where run folders, logs and rows go")
    group.addoption("--gpu-only", default="", help="comma-separated check names (default: all but alone ones)")
    group.addoption("--gpu-budget", type=float, default=0.0, help="seconds for the whole suite (default 540; dry 600)")
    group.addoption("--gpu-out", default="", help="the JSON report (default on a GPU: results/gpu_suite_*.json)")


def _work(config) -> Path:
    given = config.getoption("gpu_work_dir")
    return Path(given) if given else Path(tempfile.gettempdir()) / "scaletrain-gpu-suite"


def pytest_configure(config):
    # registered here too: pytest-xdist's runners do not all read pyproject.toml's markers
    config.addinivalue_line("markers", "gpu: one check of the GPU suite (benchmarks/test_gpu_rows.py)")
    config.addinivalue_line("markers", "xdist_group(name): checks run by the same pytest-xdist runner")
    config.gpu_start = time.time()
    if not hasattr(config, "workerinput") and not config.option.collectonly:
        for old in _work(config).glob(f"*/{gpu_suite.ROWS_DIR}"):  # an earlier run's rows are not this run's
            shutil.rmtree(old)


def pytest_generate_tests(metafunc):
    """One test per chosen check; the checks that read the default run's folder share a group with it, so that
    pytest-xdist (--dist loadgroup) runs them in the same runner, after it."""
    if "check" in metafunc.fixturenames:
        chosen = gpu_suite.chosen_checks(metafunc.config.getoption("gpu_only"),
                                         metafunc.config.getoption("gpu_dry_run"))
        metafunc.parametrize("check", [pytest.param(c, id=c.name, marks=[pytest.mark.xdist_group(
            "default" if c.name == "default" or "default" in c.after else c.name)]) for c in chosen])


@pytest.fixture(scope="session")
def ctx(request) -> gpu_suite.Ctx:
    """This runner's context: its own work folder inside the suite's (checks that read another's run folder run
    in the same runner, see the xdist groups)."""
    dry = request.config.getoption("gpu_dry_run")
    if dry:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    worker = getattr(request.config, "workerinput", {}).get("workerid", "main")
    return gpu_suite.make_ctx(dry, _work(request.config) / worker)


@pytest.fixture(scope="session")
def deadline(request, ctx) -> float:
    """When this runner starts no more checks: --gpu-budget seconds after its context was made."""
    config = request.config
    dry = config.getoption("gpu_dry_run")
    budget = config.getoption("gpu_budget") or (gpu_suite.DRY_BUDGET_SECONDS if dry else gpu_suite.BUDGET_SECONDS)
    return time.time() + budget


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or not session.testscollected or config.option.collectonly:
        return  # a runner reports to the controlling process; nothing ran, nothing to report
    dry = config.getoption("gpu_dry_run")
    chosen = gpu_suite.chosen_checks(config.getoption("gpu_only"), dry)
    gpu_suite.report(_work(config), chosen, dry, time.time() - config.gpu_start, config.getoption("gpu_out"))
