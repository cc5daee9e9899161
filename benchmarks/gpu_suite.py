"""One command that checks scaletrain's GPU path and reports everything at once: correctness on CUDA, speed against
seed 000's own script, the memory estimate against the CUDA allocator, and several GPUs when present.

The checks are pytest tests (test_gpu_rows.py, marker `gpu`, one test per check of _gpu_suite.CHECKS; conftest.py
holds the options and the report); this script installs what the machine lacks and runs them with pytest. Every
check runs in a process of its own with its own time limit, so a crash or a hang is one failed row, not a lost
report. The whole suite keeps to a time budget (9 minutes): a check that cannot start inside it is reported as
skipped. It prints one Markdown table (section, check, figure, verdict) and writes the same as JSON:
{"meta": {gpu, driver, torch, cuda, date, ...}, "rows": [{section, check, figure, verdict, reason}]}, with the
machine and the commit.

    python benchmarks/gpu_suite.py                   # on a GPU machine; JSON under benchmarks/results/
    python benchmarks/gpu_suite.py --dry-run         # every check with tiny sizes on the CPU (what --stage ends with)
    python benchmarks/gpu_suite.py --only default,memory-resnet50 --out suite.json
    python benchmarks/gpu_suite.py --stage           # copy what a GPU machine lacks into .carry/, then --dry-run
    pytest benchmarks/test_gpu_rows.py -m gpu        # the same checks run by pytest directly, on a GPU machine

A GPU machine gets a copy of the repository only: `--stage` puts in `.carry/` what its image may lack (seed 000's
script, the albumentations, matplotlib and pytest wheels for its Python); carry `.carry` along, and the suite
installs from it into its work folder what is missing there (pip, no index). Every process gets `src` on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import _gpu_suite as suite
from _gpu_suite import CARRY, NEEDED, PEER_NEEDS, RUNNER_NEEDS, TASK_NEEDS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = HERE / "test_gpu_rows.py"  # the checks as pytest tests, one per check (marker gpu)
SHARED = ROOT.parent / "shared"
STAGED_FOR_GPU = ("matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing",  # not in its image
                  "pytest", "pluggy", "iniconfig", "pygments", "packaging", "torchmetrics", "lightning-utilities",
                  "pycocotools")  # examples/detect_boxes.py's mAP


# Distributions the GPU machine's image has (torch's, accelerate's, timm's, pandas') and staging leaves out.
IN_GPU_IMAGE = {"numpy", "pyyaml", "safetensors", "tqdm", "filelock", "fsspec", "packaging", "typing-extensions",
                "pillow", "requests", "jinja2", "markupsafe", "certifi", "idna", "urllib3", "charset-normalizer"}


def _distribution(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-")


def install_carried(env: dict[str, str], work: Path) -> dict[str, list[str]]:
    """Make what the checks import importable: from .carry/wheels (no index, no network) into the work folder,
    only the wheels of distributions this Python lacks, so nothing installed is shadowed. Puts that folder on
    env's PYTHONPATH. Returns what was installed and what is still missing."""
    needs = NEEDED + PEER_NEEDS + RUNNER_NEEDS + TASK_NEEDS
    missing = suite.missing(env, needs)
    installed: list[str] = []
    if missing:
        code = "import importlib.metadata as m\nprint(' '.join(d.metadata['Name'] for d in m.distributions()))"
        present = {n.lower().replace("_", "-") for n in subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False).stdout.split()}
        wheels = [w for w in sorted((CARRY / "wheels").glob("*.whl")) if _distribution(w) not in present]
        site = work / "site"
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--no-cache-dir", "--target", str(site), *map(str, wheels)],
                             capture_output=True, text=True, check=False) if wheels else None
        if pip is not None and pip.returncode == 0:
            env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
            installed = [w.name.split("-")[0] for w in wheels]
        elif pip is not None:
            print(f"gpu_suite: the carried wheels did not install: "
                  f"{(pip.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
        missing = suite.missing(env, needs)
    return {"installed": installed, "missing": missing}


def stage(python: str, timm_train: str, dry_run: bool = True) -> int:
    """Copy the seed scripts and the albumentations wheels from ../shared into .carry/ (ignored by git), timm's
    train.py (given) into .carry/timm/, and download the wheels of what else the GPU machine's image lacks
    (matplotlib) for its Python; then a dry run of every check (`dry_run`): its exit code."""
    if timm_train:
        if not Path(timm_train).is_file():
            print(f"gpu_suite: --timm-train {timm_train}: no such file", file=sys.stderr)
            return 2
        (CARRY / "timm").mkdir(parents=True, exist_ok=True)
        shutil.copy(timm_train, CARRY / "timm" / "train.py")
    for source, target in ((SHARED / "peers", CARRY / "peers"), (SHARED / "wheels-h200", CARRY / "wheels")):
        if not source.is_dir():
            print(f"gpu_suite: {source} not found; nothing staged from it", file=sys.stderr)
            return 2
        shutil.copytree(source, target, dirs_exist_ok=True)
    for names, target, deps in ((STAGED_FOR_GPU, CARRY / "wheels", False),  # the transformers wheels with theirs
                                (("transformers",), CARRY / "transformers", True)):  # (examples/nlp_bert.py)
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *([] if deps else ["--no-deps"]),
                              "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
                              f"--abi=cp{python.replace('.', '')}", *(f"--platform={p}" for p in (
                                  "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")),
                              "-d", str(target), *names], capture_output=True, text=True, check=False)
        if pip.returncode:
            print(f"gpu_suite: could not download {', '.join(names)} for Python {python}: "
                  f"{(pip.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
            return 1
    have = {_distribution(w) for w in (CARRY / "wheels").glob("*.whl")} | IN_GPU_IMAGE
    for wheel in (CARRY / "transformers").glob("*.whl"):  # the carry's 64 MiB: not what is there already
        if _distribution(wheel) not in have:
            shutil.move(str(wheel), CARRY / "wheels" / wheel.name)
    shutil.rmtree(CARRY / "transformers")
    size = sum(f.stat().st_size for f in CARRY.rglob("*") if f.is_file()) / 2**20
    print(f"staged {CARRY}/peers and {CARRY}/wheels ({size:.0f} MiB) for Python {python}; carry '.carry' to the "
          "GPU machine with the repository")
    if not dry_run:
        return 0
    # a check broken since the last lease fails here, not on the GPU's clock (tests/test_gpu_suite.py: a few)
    print("gpu_suite: a dry run of every check on the CPU (--stage-no-dry-run leaves it out)", flush=True)
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dry-run"], check=False).returncode


def fork_commands(env: dict[str, str]) -> None:
    """A dry run's checks and commands forked from a server that has imported torch, timm and scaletrain once (the
    tests' own, tests/forkserver.py), not each importing them (~6 s); SCALETRAIN_TEST_FRESH=1: fresh interpreters."""
    if env.get("PYTHON_EXEC") or env.get("SCALETRAIN_TEST_FRESH") == "1":  # already forked (the tests), or not asked
        return
    folder = tempfile.mkdtemp(prefix="gpu-suite-forks-")  # short: a socket's path has at most 107 characters
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py"), folder], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    ready, _, relay = server.stdout.readline().strip().partition(" ")  # the server ends with this process
    if ready == "ready":
        env["PYTHON_EXEC"] = relay  # the relay: `-m X` and `SCRIPT` forked, anything else run fresh


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: CUDA rows skipped, code exercised")
    p.add_argument("--out", default="", help="JSON file to write [default: benchmarks/results/gpu_suite_<date>_<gpu>"
                   ".json on a GPU, none in a dry run]")
    p.add_argument("--only", default="", help="comma-separated check names: " + ", ".join(c.name for c in suite.CHECKS)
                   + "; without it, every check but " + ", ".join(c.name for c in suite.CHECKS if c.alone)
                   + " (which needs a call of its own; a dry run runs it too)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole suite [default: 540; dry 600]")
    p.add_argument("--jobs", type=int, default=0, help="checks run at once (pytest-xdist workers) [default: 1 on a "
                   "GPU, where timings must not share the machine; 2 in a dry run]")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every process a check starts in a dry "
                   "run [default: the cores shared among the checks run at once]")
    p.add_argument("--work-dir", default="", help="where run folders and logs go [default: a temporary folder]")
    p.add_argument("--stage", action="store_true", help="copy ../shared/peers and the albumentations wheels into "
                   ".carry/, download matplotlib's and pytest's wheels for the GPU machine's Python there, and stop")
    p.add_argument("--stage-python", default="3.12", help="with --stage: the GPU machine's Python version, for "
                   "the wheels [default: 3.12]")
    p.add_argument("--stage-no-dry-run", action="store_true", help="with --stage: stop after staging, without "
                   "the dry run of every check that --stage ends with")
    p.add_argument("--timm-train", default="", help="with --stage: timm's train.py (from huggingface/"
                   "pytorch-image-models at the commit of the GPU machine's timm), for the photos-timm check")
    args = p.parse_args()
    if args.threads < 0 or args.jobs < 0:
        p.error(f"--threads and --jobs take a count of at least 1 (0: the default), got {args.threads}, {args.jobs}")
    if args.stage:
        return stage(args.stage_python, args.timm_train, not args.stage_no_dry_run)
    try:
        suite.chosen_checks(args.only, args.dry_run)
    except ValueError as e:
        p.error(str(e))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    env = suite.suite_env(args.dry_run)
    imports = install_carried(env, work)
    (work / suite.CARRIED_FILE).write_text(json.dumps({**imports, "site": str(work / "site") if imports["installed"]
                                                 else ""}))
    if any(d in imports["missing"] for _, d in NEEDED + RUNNER_NEEDS):
        print(f"gpu_suite: this machine lacks {', '.join(imports['missing'])}: the checks that need them will fail; "
              f"run --stage where a package index is reachable and carry .carry", file=sys.stderr)
    if "pytest" in imports["missing"]:
        print("gpu_suite: the suite's checks are pytest tests: pip install pytest pytest-xdist (or -e '.[test]'), or "
              "carry .carry (--stage) to a machine without an index", file=sys.stderr)
        return 2
    budget = args.budget or (suite.DRY_BUDGET_SECONDS if args.dry_run else suite.BUDGET_SECONDS)
    jobs = args.jobs or (2 if args.dry_run else 1)
    if jobs > 1 and suite.missing(env, (("xdist", "pytest-xdist"),)):
        print("gpu_suite: pytest-xdist is not installed: the checks run one at a time", file=sys.stderr)
        jobs = 1
    if args.dry_run:  # its checks' processes share the cores, whatever OMP_NUM_THREADS the caller exported
        env["OMP_NUM_THREADS"] = str(args.threads or max(1, len(os.sched_getaffinity(0)) // jobs))
        fork_commands(env)
    print(f"gpu suite: {'dry run on the CPU' if args.dry_run else 'GPU run'}, work folder {work}, budget "
          f"{budget:.0f} s, {jobs} check(s) at a time; pytest -m gpu {HERE.name}/{TESTS.name}", flush=True)
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(ROOT), "--gpu-work-dir", str(work), "--gpu-budget", str(budget),
           f"--gpu-out={args.out}", f"--gpu-only={args.only}",  # not "", which pytest would take for the root's tests
           *(["--gpu-dry-run"] if args.dry_run else []),
           *(["-n", str(jobs), "--dist", "loadgroup"] if jobs > 1 else ["-s"])]  # -s: each row as its check ends
    return subprocess.run(cmd, env=env, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
