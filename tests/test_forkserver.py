"""The tests' fork server (tests/forkserver.py) gives a command what a fresh interpreter would: its argv, folder,
environment, import path, streams, exit code and signals, and the same trained weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import forkserver
from helpers import run_python, start_python, train_cli, wait_for

# the server these tests hold to account is not started when every command gets a fresh interpreter
pytestmark = pytest.mark.skipif(os.environ.get("SCALETRAIN_TEST_FRESH") == "1",
                                reason="SCALETRAIN_TEST_FRESH=1 starts no fork server")

SHOW = """
import json, os, sys
import mine
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "flag": os.environ.get("FLAG"), "path0": sys.path[0],
                  "mine": mine.__file__, "main": __name__}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture()
def script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mine.py").write_text("")
    path = tmp_path / "show.py"
    path.write_text(SHOW)
    return path


def test_a_forked_script_sees_its_argv_folder_environment_and_pythonpath(script, tmp_path):
    assert forkserver.server() is not None
    proc = run_python([sys.executable, script, "a", "b"], env={"FLAG": "on", "CODE": "3",
                                                               "PYTHONPATH": str(tmp_path / "lib")},
                      cwd=tmp_path / "lib")
    seen = json.loads(proc.stdout)
    assert proc.returncode == 3 and proc.stderr == "to stderr\n"
    assert seen == {"argv": [str(script), "a", "b"], "cwd": str(tmp_path / "lib"), "flag": "on", "path0": str(tmp_path),
                    "mine": str(tmp_path / "lib" / "mine.py"), "main": "__main__"}


def test_a_forked_command_is_a_process_of_its_own_that_a_signal_ends(tmp_path):
    (tmp_path / "wait.py").write_text("import sys, time\nprint('waiting', flush=True)\ntime.sleep(60)\n")
    proc = start_python([sys.executable, tmp_path / "wait.py"])
    assert proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    merged = start_python([sys.executable, "-c", "import sys; print('x'); print('y', file=sys.stderr)"],
                          stderr=subprocess.STDOUT)
    assert isinstance(merged, subprocess.Popen), "interpreter flags (-c) get a fresh interpreter"
    assert sorted(merged.communicate(timeout=60)[0].split()) == ["x", "y"]


def test_a_forked_command_can_lead_a_session_of_its_own_writing_to_a_file(tmp_path):
    (tmp_path / "sid.py").write_text("import os\nprint(os.getsid(0) == os.getpid() == os.getpgid(0))\n")
    with open(tmp_path / "log", "w") as log:
        proc = start_python([sys.executable, tmp_path / "sid.py"], stdout=log, stderr=subprocess.STDOUT,
                            new_session=True)
        assert not isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 0
    assert (tmp_path / "log").read_text() == "True\n"


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tmp_path):
    server = forkserver.server()
    assert not server.accepts({**server.env, "OMP_NUM_THREADS": "2"})
    assert not server.accepts({**server.env, "HF_HUB_OFFLINE": "1"}), "huggingface_hub reads it at import"
    assert server.accepts({**server.env, "SCALETRAIN_FAULT": "kill:3"})
    # scaletrain reads XDG_CACHE_HOME at run time; huggingface_hub and matplotlib at import, unless their own is set
    assert server.accepts({**server.env, "XDG_CACHE_HOME": str(tmp_path)})
    assert not server.accepts({**{k: v for k, v in server.env.items() if k != "HF_HOME"}, "XDG_CACHE_HOME": "x"})
    (tmp_path / "scaletrain").mkdir()  # another copy of a package the server has imported
    assert not server.accepts({**server.env, "PYTHONPATH": str(tmp_path)})
    src = Path(forkserver.__file__).parents[1] / "src"  # the copy it has imported: the fork puts it on sys.path
    assert server.accepts({**server.env, "PYTHONPATH": f"{src}{os.pathsep}{tmp_path / 'lib'}"})


@pytest.mark.slow
def test_a_forked_training_ends_with_the_weights_of_a_fresh_interpreters(small_npz, tmp_path, monkeypatch):
    args = ["--model", "tinycnn", "--epochs", "1", "--batch-size", "32"]
    train_cli(small_npz, tmp_path / "forked", *args)
    monkeypatch.setenv("SCALETRAIN_TEST_FRESH", "1")
    train_cli(small_npz, tmp_path / "fresh", *args)
    forked, fresh = (load_file(tmp_path / name / "last.safetensors") for name in ("forked", "fresh"))
    assert forked.keys() == fresh.keys() and all(torch.equal(forked[k], fresh[k]) for k in forked)


RELAYED = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
print(os.environ["RANK"], "torch" in sys.modules, os.getppid(), os.getpid(), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(os.environ["RANK"]) + 3)
"""


def test_a_launchers_workers_are_forked_and_see_the_launcher_as_their_parent(tmp_path):
    """torchrun starts its workers through PYTHON_EXEC, the server's relay: each worker has torch imported before
    its first line, its exit code reaches the launcher, and its parent is the launcher."""
    (tmp_path / "worker.py").write_text(RELAYED)
    proc = start_python([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         tmp_path / "worker.py", "3"])  # both print before either ends
    out, err = proc.communicate(timeout=120)
    seen = sorted(line.split()[:3] for line in out.splitlines())
    assert seen == [["0", "True", str(proc.pid)], ["1", "True", str(proc.pid)]], out
    assert proc.returncode == 1 and "exitcode  : 3" in err  # the first worker's own code, as torchrun reports it


def test_a_relay_passes_signals_on_and_its_end_ends_the_worker(tmp_path):
    (tmp_path / "worker.py").write_text(RELAYED)
    relay = [forkserver.server().relay, "-u", str(tmp_path / "worker.py"), "60"]
    env = {**forkserver.server().env, "RANK": "0"}
    termed = subprocess.Popen(relay, env=env, stdout=subprocess.PIPE, text=True)
    assert termed.stdout.readline().split()[1] == "True"
    termed.send_signal(signal.SIGTERM)
    assert termed.wait(timeout=30) == 75, "the worker's SIGTERM handler ran and its exit code came back"
    killed = subprocess.Popen(relay, env=env, stdout=subprocess.PIPE, text=True)
    worker = int(killed.stdout.readline().split()[3])
    killed.kill()  # as torch's elastic agent ends a worker that does not stop: SIGKILL to its process group
    killed.wait()
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "the worker to end with its relay")


def test_the_processes_a_relayed_worker_forks_see_it_as_their_parent(tmp_path):
    """A worker is shown its launcher as its parent; what it forks (DataLoader workers, which watch os.getppid() for
    its end) is shown the worker: else they would outlive it, holding its output open."""
    (tmp_path / "forks.py").write_text("import os\npid = os.fork()\nif pid == 0:\n    print(os.getppid(), flush=True)\n"
                                       "    os._exit(0)\nos.waitpid(pid, 0)\nprint(os.getpid(), os.getppid())\n")
    relay = [forkserver.server().relay, "-u", str(tmp_path / "forks.py")]
    proc = subprocess.run(relay, env=forkserver.server().env, capture_output=True, text=True, timeout=60)
    child_sees, worker, worker_sees = proc.stdout.split()
    assert child_sees == worker and worker_sees == str(os.getpid()), proc.stdout + proc.stderr
