"""`scaletrain report`: a run folder's settings, epochs and best accuracy, and its curves drawn again."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..config import _f
from .common import add_flags, options_from_args


@dataclass(kw_only=True)
class ReportOptions:
    run_dir: str = _f(None, "a run folder (from scaletrain train)", positional=True, metavar="RUN_DIR")


def add_parser(subparsers) -> None:
    report = subparsers.add_parser("report", help="print a run's summary and epochs, and redraw its curves.png",
                                   description="Print a run folder's settings, one row per epoch and the best "
                                               "accuracy, and draw its training curves again into curves.png.")
    add_flags(report, ReportOptions)


def run(args: argparse.Namespace) -> int:
    from ..runfolder import report

    text, curves = report(Path(options_from_args(ReportOptions, args).run_dir))
    print(f"{text}\n\nwrote {curves}")
    return 0
