"""The `scaletrain` command: argument parsing, process launching and one-line errors.

Flags are generated from the config dataclasses, so `--help`, config.yaml and the code agree. User errors print
one line and exit 2; a diverged run exits 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from . import __version__
from .config import TrainConfig, parse_nproc
from .errors import UserError
from .sources import Skipped


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on one line (no usage dump) and suggests the closest flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # '--epoch' must not silently mean '--epochs'
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            unknown = [w for w in message.split(":", 1)[1].split() if w.startswith("-")]
            for word in unknown:
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        raise UserError(message)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section, typed by its default."""
    for section in dataclasses.fields(TrainConfig):
        group = parser.add_argument_group(section.name)
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            flag = "--" + f.name.replace("_", "-")
            text = f.metadata["help"]
            if f.default is not None and "default" not in text and not isinstance(f.default, bool):
                text += f" [default: {f.default if f.default != '' else 'none'}]"
            kwargs = {"dest": f"{section.name}.{f.name}", "help": text, "default": argparse.SUPPRESS}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = float if (isinstance(f.default, float) or "float" in str(f.type)) else (
                    int if isinstance(f.default, int) else str)
                kwargs["metavar"] = f.name.upper()
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
                    kwargs["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
            group.add_argument(flag, **kwargs)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(values).validate()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description="Train image classifiers on a CPU, one GPU or many processes.")
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    train = commands.add_parser(
        "train", help="train a classifier (default: the small CNN on the embedded 10k MNIST images)",
        description="Train a classifier. Batch size is per process; run the same command under torchrun, "
                    "accelerate launch, or with --nproc N.")
    _add_config_flags(train)
    parser.commands = commands.choices  # type: ignore[attr-defined]
    return parser


def _default_output_dir() -> str:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return str(path)


def _check_output_dir(path: str) -> None:
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder")
    if any((folder / name).exists() for name in ("summary.json", "last.safetensors", "best.safetensors")):
        raise UserError(f"--output-dir {path}: already holds a finished or started run; choose another folder")


def _train(cfg: TrainConfig, argv: Sequence[str]) -> int:
    from .data import load_image_sets
    from .distributed import available_gpus, check_sync_bn, launch, launched_world_size, resolve_nproc
    from .models import check_model_name

    check_model_name(cfg.model.model)
    if launched_world_size() is None:
        # The launching (or only) process checks everything it can before any worker starts.
        nproc = resolve_nproc(parse_nproc(cfg.run.nproc), cfg.run.cpu)
        if not cfg.run.output_dir:
            cfg.run.output_dir = _default_output_dir()
            argv = [*argv, "--output-dir", cfg.run.output_dir]
        _check_output_dir(cfg.run.output_dir)
        if nproc > 1:
            if cfg.model.sync_bn:
                check_sync_bn(available_gpus(cfg.run.cpu) == 0)
            load_image_sets(cfg.data, seed=cfg.run.seed, skipped=Skipped() if cfg.data.skip_bad_samples else None)
            return launch(nproc, ["train", *argv])
    run_training(cfg)
    return 0


def run_training(cfg: TrainConfig):
    """Train from a config in this process (one of possibly many launched)."""
    from .data import load_image_sets
    from .distributed import Runtime
    from .engine import fit
    from .models import build_model
    from .runfolder import atomic_write_text

    runtime = Runtime(cfg.run.mixed_precision, cfg.run.cpu)
    try:
        skipped = Skipped() if cfg.data.skip_bad_samples else None
        train_set, val_set = load_image_sets(cfg.data, seed=cfg.run.seed, skipped=skipped)
        if skipped and skipped.entries and runtime.is_main:
            listing = Path(cfg.run.output_dir) / "skipped_samples.txt"
            atomic_write_text(listing, "\n".join(skipped.entries) + "\n")
            print(f"skipped {len(skipped.entries)} bad sample(s), listed in {listing}", flush=True)
        runtime.seed(cfg.run.seed)  # identical initial weights on every rank
        channels = cfg.data.channels or train_set.channels
        model = build_model(cfg.model.model, channels, len(train_set.classes))
        return fit(model, train_set, val_set, cfg, model_name=cfg.model.model, runtime=runtime)
    finally:
        runtime.end()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .engine import TrainingDiverged

    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, which knows its flags and can suggest one
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "train":
            return _train(_config_from_args(args), argv[argv.index("train") + 1:])
        raise AssertionError(args.command)
    except UserError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except TrainingDiverged as e:
        if os.environ.get("RANK", "0") == "0":  # raised on every rank at once; one of them says so
            print(f"scaletrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130
