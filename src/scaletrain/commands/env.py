"""`scaletrain env`: versions, devices and the launcher environment, for a bug report."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    subparsers.add_parser("env", help="versions, devices and launcher environment, for a bug report",
                          description="Print torch, CUDA, NCCL and accelerate versions, the devices and their "
                                      "memory, and the launcher environment this process sees.")


def run(args: argparse.Namespace) -> int:
    from ..envinfo import render

    print(render())
    return 0
