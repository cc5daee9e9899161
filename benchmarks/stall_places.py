"""Seconds from a stall's beginning to the block that names it, for every place a rank can stall.

Each place is the user's script of tests/test_watch.py (2 processes under torchrun, gloo, `stall_timeout` given
here), stalling on one rank as it says "stalling at <time>": its Dataset's __getitem__ with num_workers 0 (the
other rank waits in DDP's forward) and in a DataLoader worker, the model's forward, a collective of the user's step
that the other rank never enters, validation, the checkpoint's write, a C call that holds the GIL, and both ranks
at once (the job stuck as a whole). The time is taken when the block's first line reaches this process's pipe.
Each place `--repeats` times; the median per place, and whether every run named the expected rank.

    python benchmarks/stall_places.py --stall-timeout 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

from test_watch import PLACES, torchrun_stall  # noqa: E402  (the tests' script and runner)

NAMED = {**{mode: f"scaletrain: rank {rank} stalled: no progress" for mode, (rank, _, _) in PLACES.items()},
         "getitem-both": "scaletrain: the job is stuck: no rank has made progress"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stall-timeout", type=float, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "stall_places.json"))
    args = p.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    rows = {}
    for mode in NAMED:
        seconds, named, head = [], 0, []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                code, stderr, s = torchrun_stall(Path(tmp), mode, args.stall_timeout)
                stderr = stderr.replace(tmp + "/", "")
            seconds.append(round(s, 2))
            named += code != 0 and NAMED[mode] in stderr and "exitcode  : 6" in stderr
            lines = stderr.splitlines()
            first = next((i for i, line in enumerate(lines) if line.startswith(NAMED[mode])), None)
            head = head or ([] if first is None else  # the block's lines up to the first stack
                            [line for line in lines[first:first + 6] if not line.startswith(" ")][:4])
        rows[mode] = {"seconds": seconds, "median": statistics.median(seconds), "named": f"{named}/{args.repeats}",
                      "block_begins": head}
        print(f"{mode:16s} median {rows[mode]['median']:5.1f} s  ({', '.join(map(str, seconds))})  named "
              f"{rows[mode]['named']}", flush=True)
    record = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join(["python", "benchmarks/stall_places.py", *sys.argv[1:]]),
              "stall_timeout": args.stall_timeout, "places": rows}
    Path(args.results).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
