"""Fresh processes without a fresh interpreter's imports: a server that has imported torch (with torch._dynamo, which
an optimizer's first call imports), accelerate, timm and scaletrain once, and forks a new process for each command
a test starts. Each such process has its own pid, exit code, signals, working folder, environment, argv and
standard streams, as `python -m MODULE ...` or `python SCRIPT ...` would; the 6 s or so that every fresh Python
process spends importing before its first line of work is paid once per test worker instead of once per command.

The workers a launcher starts (`--nproc 2`, torchrun, accelerate launch: torch's elastic agent, which runs
`$PYTHON_EXEC -u -m MODULE ...` or `$PYTHON_EXEC -u SCRIPT ...`) are forked too: commands get PYTHON_EXEC pointing at
a relay, a small interpreter without torch that has the server fork the worker and stands in for it before the
launcher. The relay passes on its streams, environment and folder, forwards the signals it gets, exits as the worker
did, and its death (a SIGKILL of its process group) kills the worker; the worker's os.getppid() is the relay's parent,
so a worker still sees its launcher go (parallel/launch.exit_with_launcher). In a forked command, sys.executable
is that relay as well, so the `python -m scaletrain train` that `scaletrain bench` starts for each cell is forked
the same way (the relay runs the real interpreter for anything but `-m MODULE` or `SCRIPT`).

What a fork cannot give stays a fresh process (helpers.start_python and the server decide): other launchers in front
(a console script), other interpreter flags, and environments that change what is read at import (threads, Python's
own settings). So does every command when SCALETRAIN_TEST_FRESH=1, and every launcher's worker when
SCALETRAIN_TEST_FRESH_WORKERS=1.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read by Python, the OpenMP runtime, torch or huggingface_hub (its cache and offline constants) when they load: a
# command whose environment sets one differently from the server's needs an interpreter of its own.
READ_AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "CUDA", "TORCH", "NCCL", "GOMP", "MALLOC", "HF_",
                  "HUGGINGFACE", "XDG_", "HOME", "MPL")
# Set by launchers for their workers, or by the tests for the relay, and read only at run time.
RUN_TIME = ("PYTHON_EXEC", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "safetensors.torch", "accelerate", "timm",
           "torchvision", "scaletrain", "scaletrain.cli", "scaletrain.training.loop", "scaletrain.training.worker",
           "matplotlib.pyplot", "torch.utils.tensorboard")  # every run draws curves.png and logs to TensorBoard


def log_fresh(args: list[str], why: str) -> None:
    """With SCALETRAIN_TEST_FRESH_LOG=FILE: a line in FILE for each command given a fresh interpreter, and why (to
    find the imports still paid again)."""
    log = os.environ.get("SCALETRAIN_TEST_FRESH_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "why": why, "args": [str(a) for a in args][:4]}) + "\n")


def relay_beside(socket_path: str) -> str:
    """The relay's path (PYTHON_EXEC for launchers) of the server listening at `socket_path`."""
    return os.path.join(os.path.dirname(socket_path), "python")


def _send(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _read(conn: socket.socket, size: int) -> bytes | None:
    """Exactly `size` bytes, or None when the other side closed first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _recv(conn: socket.socket) -> dict | None:
    head = _read(conn, 4)
    data = None if head is None else _read(conn, struct.unpack("!I", head)[0])
    return None if data is None else json.loads(data)


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def signal_state() -> dict:
    """What a process started from here inherits of signals: the blocked ones and the ignored ones."""
    return {"blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "ignored": [int(s) for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN]}


def _take_signal_state(state: dict) -> None:
    """In the forked process: the signals as a fresh interpreter started by the requester would have them."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN if int(sig) in state["ignored"] else
                      signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, state["blocked"])


def target_of(args: list[str]) -> tuple[dict, list[str]] | None:
    """What the server runs for an interpreter's arguments `-m MODULE ARGS` or `SCRIPT ARGS`: ({"module": MODULE} or
    {"script": SCRIPT}, ARGS); None for any other (interpreter flags)."""
    if args[:1] == ["-m"] and len(args) > 1:
        return {"module": args[1]}, args[2:]
    if args and not args[0].startswith("-"):
        return {"script": args[0]}, args[1:]
    return None


def _shadows(entry: str) -> bool:
    """Whether a folder put on PYTHONPATH holds another copy of a package the server has imported (a fork would run
    the server's copy, not that one)."""
    import importlib.util

    for name in {p.split(".")[0] for p in PRELOAD}:
        for found in (Path(entry, name), Path(entry, f"{name}.py")):
            if found.exists():
                spec = importlib.util.find_spec(name)
                origin = spec and spec.origin and Path(spec.origin).resolve()
                if origin is None or found.resolve() not in (origin, origin.parent):
                    return True
    return False


# Read at import, XDG_CACHE_HOME gives huggingface_hub's and accelerate's cache (HF_HOME) and matplotlib's
# (MPLCONFIGDIR) where those are unset; scaletrain and torch read it at run time.
CACHE_HOMES = ("HF_HOME", "MPLCONFIGDIR")
NVIDIA = os.path.exists("/dev/nvidiactl")  # without an NVIDIA device, CUDA_* (CUDA_VISIBLE_DEVICES="") change nothing


def differs(env: dict, server_env: dict) -> str | None:
    """The first variable read at import that `env` sets otherwise than the server's environment, or None. PYTHONPATH
    may differ (the fork puts it on sys.path) unless a folder it adds holds another copy of a preloaded package; CUDA_*
    may where there is no NVIDIA device; XDG_CACHE_HOME may where both set CACHE_HOMES alike."""
    keys = {k for k in set(env) | set(server_env) if k.startswith(READ_AT_IMPORT) and not k.startswith(RUN_TIME)}
    for key in sorted(keys):
        if env.get(key) == server_env.get(key):
            continue
        if key.startswith("CUDA") and not NVIDIA:
            continue
        if key == "XDG_CACHE_HOME" and all(env.get(k) and env.get(k) == server_env.get(k) for k in CACHE_HOMES):
            continue
        if key == "PYTHONPATH":
            ours = set(server_env.get(key, "").split(os.pathsep))
            if not any(_shadows(e) for e in env.get(key, "").split(os.pathsep) if e and e not in ours):
                continue
        return key
    return None


def _as_launched_by(relay: int) -> None:
    """In a worker forked for a relay: os.getppid() is the relay's parent (the launcher; 1 once it is gone). Not in
    the processes it forks (DataLoader workers): theirs is the worker, whose end they must see."""
    worker, real = os.getpid(), os.getppid

    def getppid() -> int:
        if os.getpid() != worker:
            return real()
        try:
            with open(f"/proc/{relay}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 1

    os.getppid = getppid


def _die_with(lifeline: int) -> None:
    """In a worker forked for a relay: the end of the relay (its pipe's end closes) ends this process, as a SIGKILL
    of the relay's process group would have ended a fresh worker."""
    import threading

    def watch() -> None:
        while os.read(lifeline, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-lifeline", daemon=True).start()


# -- the server ----------------------------------------------------------------------------------------------------
def _child(request: dict, fds: list[int], relay: str) -> None:
    """In the forked process: become `python [-m] TARGET ARGS` with the request's streams, folder and environment."""
    import io
    import runpy
    import traceback

    code = 1
    try:
        streams, lifeline = fds[:3], fds[3:]
        for fd, target in zip(streams, (0, 1, 2)):
            os.dup2(fd, target)
        for fd in set(streams) - {0, 1, 2}:
            os.close(fd)
        _take_signal_state(request["signals"])
        if request.get("new_session"):
            os.setsid()
        if request.get("relay"):
            _as_launched_by(request["relay"])
            _die_with(lifeline[0])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHON_EXEC") == relay:  # commands it starts with sys.executable are relayed too
            sys.executable = relay
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                                      write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        module, script = request.get("module"), request.get("script")
        first = os.getcwd() if module else str(Path(script).resolve().parent)
        sys.path[:] = [first, *extra, *[p for p in sys.path if p not in extra]]
        if module:
            sys.argv = [module, *request["args"]]  # runpy puts the module's file first, as -m does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str, also: tuple[str, ...] = ()) -> None:
    """Import once (PRELOAD, then `also`), then fork a process per request; report each one's pid, then its exit
    status. Writes the relay beside `path` first and prints "ready RELAY" once it listens; ends with its parent."""
    import importlib

    relay = relay_beside(path)
    with open(relay, "w") as f:
        f.write(f"#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                f"import forkserver\nforkserver.relay({path!r})\n")
    os.chmod(relay, 0o755)
    started_with = dict(os.environ)  # before the imports, which set some (TORCHINDUCTOR_CACHE_DIR)
    sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).parent))]  # the server's own, not theirs
    for name in (*PRELOAD, *also):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What was imported lives as long as the process: out of the collector's sight, so that each full collection
    # of a forked command (scaletrain's own at its end, Python's on its way) walks only what the command made,
    # not the 0.4 s of torch's, timm's and matplotlib's objects a fresh interpreter would walk too.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", relay, flush=True)  # the relay's path: PYTHON_EXEC for the commands' launchers
    running: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
            request = json.loads(message)
            refused = differs(request["env"], started_with) if request.get("relay") else None
            if refused:  # the relay runs the worker in a fresh interpreter instead
                for fd in set(fds):
                    os.close(fd)
                _send(conn, {"refused": refused})
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in running.values():
                    other.close()
                _child(request, fds, relay)
            for fd in set(fds):
                os.close(fd)
            _send(conn, {"pid": pid})
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


# -- a launcher's side: the relay it starts as a worker ----------------------------------------------------------------
def relay(path: str) -> None:
    """Run as PYTHON_EXEC: `-u -m MODULE ARGS` or `-u SCRIPT ARGS` forked by the server at `path`, standing in for it
    (signals forwarded, its exit status as ours); anything else, or a refusal, runs the real interpreter in place."""
    args = sys.argv[1:]
    unbuffered = args[:1] == ["-u"]
    parsed = target_of(args[1:] if unbuffered else args)
    reply = None
    fresh = os.environ.get("SCALETRAIN_TEST_FRESH_WORKERS") == "1"
    if parsed is not None and not fresh:
        target, rest = parsed
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            lifeline, held = os.pipe()
            request = {**target, "args": rest, "env": dict(os.environ),
                       "cwd": os.getcwd(), "relay": os.getpid(), "unbuffered": unbuffered,
                       "signals": signal_state()}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, lifeline])
            os.close(lifeline)
            reply = _recv(conn)
        except OSError:
            reply = None
    if not reply or "pid" not in reply:
        why = ("interpreter flags" if parsed is None else "fresh workers asked" if fresh else
               (reply or {}).get("refused") or "server unreachable")
        log_fresh(args, f"worker: {why}")
        os.execv(sys.executable, [sys.executable, *args])
    pid = reply["pid"]

    def forward(number: int, _frame) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:  # it has ended; its status is on the way
            pass

    for sig in SIGNALS:
        signal.signal(sig, forward)
    done = _recv(conn)
    code = done["returncode"] if done else -signal.SIGKILL
    if code < 0:  # ended by a signal: so are we
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# -- the test's side -----------------------------------------------------------------------------------------------
class Forked:
    """A command forked by the server, used as a subprocess.Popen is (pid, stdout, stderr, poll, wait, communicate,
    send_signal, kill, terminate)."""

    def __init__(self, conn: socket.socket, stdout, stderr, args: list[str]):
        self._conn, self.stdout, self.stderr, self.args = conn, stdout, stderr, args
        self.pid = _recv(conn)["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        message = _recv(self._conn)
        self.returncode = message["returncode"] if message else -signal.SIGKILL  # the server was killed
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both streams to their end, then the exit status (as subprocess.Popen.communicate)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        parts: dict = {s: [] for s in (self.stdout, self.stderr) if s is not None}
        open_ = list(parts)
        while open_:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for stream in select.select(open_, [], [], left)[0]:
                data = os.read(stream.fileno(), 1 << 16)
                if data:
                    parts[stream].append(data)
                else:
                    open_.remove(stream)
                    stream.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        text = {s: b"".join(p).decode("utf-8", "replace") for s, p in parts.items()}
        return text.get(self.stdout, None), text.get(self.stderr, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.returncode is None:
            self.kill()
            self.wait()


class Server:
    """This test worker's fork server, started at the first command."""

    def __init__(self, also: tuple[str, ...] = ()) -> None:
        """`also`: modules imported beside PRELOAD (a server of one test file's own)."""
        self.folder = tempfile.mkdtemp(prefix="scaletrain-forks-")
        self.path = os.path.join(self.folder, "socket")
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, self.folder, *also],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     env=self.env, text=True)
        ready, _, self.relay = self.proc.stdout.readline().strip().partition(" ")  # PYTHON_EXEC for launchers
        if ready != "ready":
            raise RuntimeError("the fork server did not start")
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the server as the test worker ends (it would stop by itself once its parent is gone)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def accepts(self, env: dict) -> bool:
        """Whether a command with this environment can be forked (nothing read at import differs)."""
        return self.proc.poll() is None and differs(env, self.env) is None

    def start(self, target: dict, args: list[str], env: dict, cwd: Path | None, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, new_session: bool = False) -> Forked:
        """Fork `python -m MODULE ARGS` (target {"module": ...}) or `python SCRIPT ARGS` ({"script": ...}); `stdout`
        and `stderr` as subprocess.Popen takes them (PIPE: read as text from the returned Forked; DEVNULL; an open
        file; STDOUT for stderr); `new_session` as Popen's start_new_session."""
        ours, theirs = [], []  # the read ends the test keeps; the fds the command gets, closed here once sent

        def stream(kind) -> int:
            if kind == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
            elif kind != subprocess.PIPE:
                theirs.append(os.dup(kind.fileno()))
            else:
                read, write = os.pipe()
                ours.append(open(read, encoding="utf-8", errors="replace"))
                theirs.append(write)
            return theirs[-1]

        fds = [os.open(os.devnull, os.O_RDONLY), stream(stdout)]
        fds.append(fds[1] if stderr == subprocess.STDOUT else stream(stderr))
        theirs.append(fds[0])
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {**target, "args": list(args), "env": env, "cwd": str(cwd or os.getcwd()), "signals": signal_state(),
                   "new_session": new_session}
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        for fd in theirs:
            os.close(fd)
        out = ours.pop(0) if stdout == subprocess.PIPE else None
        err = ours.pop(0) if stderr == subprocess.PIPE else None
        return Forked(conn, out, err, [target.get("module") or target["script"], *args])


_server: Server | None = None


def server() -> Server | None:
    """This worker's server, or None where commands get fresh interpreters (SCALETRAIN_TEST_FRESH=1)."""
    global _server
    if os.environ.get("SCALETRAIN_TEST_FRESH") == "1":
        return None
    if _server is None or _server.proc.poll() is not None:
        _server = Server()
    return _server


if __name__ == "__main__":  # python tests/forkserver.py FOLDER [MODULE ...]: serve at FOLDER/socket, relay FOLDER/python
    serve(os.path.join(sys.argv[1], "socket"), tuple(sys.argv[2:]))
