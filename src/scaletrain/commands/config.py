"""`scaletrain config`: write a commented starter settings file, every `train` setting at its default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..config import _f, starter_config_text
from ..errors import UserError
from .common import LATER_CHOICES, add_flags, options_from_args


@dataclass(kw_only=True)
class ConfigOptions:
    path: str = _f("scaletrain.yaml", "file to write [default: scaletrain.yaml]; an existing file is left alone",
                   positional=True)


def add_parser(subparsers) -> None:
    config = subparsers.add_parser(
        "config", help="write a commented starter settings file for `scaletrain train --config`",
        description="Write every `scaletrain train` setting at its default, each with its help as a comment.")
    add_flags(config, ConfigOptions)


def run(args: argparse.Namespace) -> int:
    from ..runfolder import atomic_write_text

    path = Path(options_from_args(ConfigOptions, args).path)
    if path.exists():
        raise UserError(f"{path}: exists; choose another path (an existing file is never overwritten)")
    try:
        atomic_write_text(path, starter_config_text({name: of() for name, of in LATER_CHOICES.items()}))
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror})") from None
    print(f"wrote {path}; use it with: scaletrain train --config {path}")
    return 0
