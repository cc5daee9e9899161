"""The `scaletrain` subcommands, one module each: `add_parser(subparsers)` declares its flags (generated from an
options dataclass by `common.add_flags`) and `run(args)` carries it out and returns the exit code.

`run` gets the parsed namespace with `args.argv`, the command's own arguments (to start workers running it
again), and `args.passthrough`, what followed '--'. Dispatch and error handling are in `scaletrain/cli.py`.
"""

from . import (bench, config, env, estimate_memory, evaluate, export, predict, prepare, report, train, tune,
               verify)

# In the order `scaletrain --help` lists them.
COMMANDS = {"train": train, "prepare": prepare, "report": report, "env": env, "config": config, "predict": predict,
            "evaluate": evaluate, "export": export, "bench": bench, "tune": tune, "estimate-memory": estimate_memory,
            "verify": verify}
