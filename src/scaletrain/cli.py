"""The `scaletrain` command: dispatch to the subcommands of `scaletrain.commands`, and one-line errors.

User errors print one line and exit 2; a diverged run exits 3, a preempted one 75, a collective that timed out 4,
a job whose rank stalled 6 (see parallel/watch.py); a rank that failed because another one did says which, exit 1.
In a worker of torch's launcher the first cause is also written where the launcher reads it (record_failure).
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Sequence

from . import __version__
from .commands import COMMANDS
from .commands.common import Parser
from .errors import UserError


def build_parser() -> Parser:
    parser = Parser(prog="scaletrain", description="Train image classifiers on a CPU, one GPU or many processes.")
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(subparsers)
    parser.commands = subparsers.choices  # type: ignore[attr-defined]
    return parser


def _is_timeout(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def main(argv: Sequence[str] | None = None) -> int:
    code = 1
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        return code
    finally:
        if code:
            # An error raised mid-training leaves the model and its process group in reference cycles (through
            # the traceback's frames). Free them now: freed at interpreter exit instead, gloo's worker threads can
            # still be releasing tensors, and the process aborts. (A full collection walks every object torch and
            # timm made at import, 0.4 s here: not paid when the command succeeded.)
            gc.collect()


def entry() -> None:
    """The console command and `python -m scaletrain`: `main`, then the process ends at once. Tearing down every
    module that torch, timm and accelerate loaded takes over a second after the work is done and changes nothing
    on disk; what a normal exit does that matters happens first: atexit handlers (trackers, process groups, child
    processes) and flushing the output. While a thread of the process still works, the exit is the normal one."""
    import atexit
    import threading

    code = main()
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        gc.collect()  # the normal exit tears down every module: nothing in a cycle may be freed then (above)
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can reach it
            pass
    os._exit(code)


def _main(argv: list[str]) -> int:
    from .training.signals import Preempted, TrainingDiverged

    from .parallel import RankFailed, adopt_slurm, drop_legacy_local_rank
    from .parallel.launch import record_failure
    from .parallel.watch import one_line

    try:
        argv = drop_legacy_local_rank(argv)  # python -m torch.distributed.launch appends --local-rank=N
        if not any(a == "--nnodes" or a.startswith("--nnodes=") for a in argv):  # else: a launcher per node
            adopt_slurm()  # a task of `srun` becomes a worker like one that torchrun started
        parser = build_parser()
        passthrough: list[str] = []
        if "--" in argv:  # bench hands what follows '--' to every train it runs
            cut = argv.index("--")
            argv, passthrough = argv[:cut], argv[cut + 1:]
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, which knows its flags and can suggest one
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv, args.passthrough = argv[argv.index(args.command) + 1:], passthrough
        return COMMANDS[args.command].run(args)
    except UserError as e:
        if not e.quiet:  # a quiet one is reported by another process of the job
            print(f"scaletrain: error: {e}", file=sys.stderr)
            record_failure(str(e))
        return e.exit_code
    except RankFailed as e:  # the cause is another rank's, which said so itself
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 1
    except (TrainingDiverged, Preempted) as e:
        if os.environ.get("RANK", "0") == "0":  # raised on every rank at once; one of them says so
            print(f"scaletrain: {'error: ' if isinstance(e, TrainingDiverged) else ''}{e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:
        if not _is_timeout(e):
            record_failure(one_line(e))
            raise
        print(f"scaletrain: error: a process waited more than --timeout for the others in a collective operation "
              f"and gave up: another process stopped answering ({str(e).strip().splitlines()[0][:160]})",
              file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or the user's own code: the traceback follows, the launcher gets its name
        record_failure(one_line(e))
        raise
