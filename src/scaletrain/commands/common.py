"""What every subcommand's parser shares: one-line errors, flags generated from an options dataclass, the flags
carried over from `train` (device, seed, timeout, nodes) and `--config FILE` as defaults.

A field's metadata drives its flag: `help`, `choices`, `required`, `positional`, `metavar`, `show_default`, and
`from_config` (True, or a function converting a settings file's value) for keys a settings file may supply.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Callable

from ..config import RunConfig, flag_of, read_config_file, setting_text, setting_type
from ..data.sources import formats
from ..errors import UserError

# Choices the config cannot know, being below the data layer: --data-format takes the data sources' formats.
LATER_CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {"data_format": formats}

# Flags of `train` that every command running a model understands the same way.
RUN_FLAGS = ("cpu", "seed", "timeout", "nnodes", "node_rank", "master_addr", "master_port")


class Parser(argparse.ArgumentParser):
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


def field_like(section: type, name: str, **meta: Any) -> Any:
    """A field declared as one of `train`'s config sections declares it (default, help, choices)."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return dataclasses.field(default=f.default, metadata={**f.metadata, **meta})


def run_field(name: str, **meta: Any) -> Any:
    """A field declared as `train`'s RunConfig declares it, for another command; a settings file may set it."""
    return field_like(RunConfig, name, from_config=True, **meta)


flag = flag_of  # a setting's flag, as every command names it

def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    return LATER_CHOICES[f.name]() if f.name in LATER_CHOICES else f.metadata.get("choices")


def add_flags(parser: argparse.ArgumentParser, options: type, prefix: str = "", negatable: bool = False,
              only: Callable[[str], bool] | None = None) -> None:
    """One flag per field of the dataclass `options` (those whose name `only` accepts), typed by its default;
    stored as `prefix + name` and only when given (so a settings file can supply the rest). A boolean a settings
    file can set (`negatable`, or `from_config`) also gets a --no- form, so the command line can turn it off
    again."""
    for f in dataclasses.fields(options):
        if only is not None and not only(f.name):
            continue
        meta = f.metadata
        text, default = meta["help"], setting_text(f, f.default)
        if (meta.get("show_default", True) and default is not None and "default" not in text
                and not isinstance(default, bool)):
            text += f" [default: {default if default != '' else 'none'}]"
        kwargs: dict[str, Any] = {"help": text, "default": argparse.SUPPRESS}
        if meta.get("positional"):
            kwargs.update(nargs="?" if f.default is not None else None, metavar=meta.get("metavar"))
            parser.add_argument(prefix + f.name, **kwargs)
            continue
        kwargs["dest"] = prefix + f.name
        if meta.get("required"):
            kwargs["required"] = True
        kind_of_value = setting_type(options, f)  # a structured setting's flag takes its text (see config.Kind)
        if kind_of_value is bool:
            kwargs["action"] = (argparse.BooleanOptionalAction if negatable or meta.get("from_config")
                                else "store_true")
        else:
            kwargs["type"] = kind_of_value
            kwargs["metavar"] = meta.get("metavar", f.name.upper())
            choices = choices_of(f)
            if choices:
                kwargs["choices"] = choices
                kwargs["metavar"] = "{" + ",".join(choices) + "}"
        parser.add_argument(flag(f.name), **kwargs)


def add_config_flag(parser: argparse.ArgumentParser, options: type) -> None:
    """`--config FILE` for a command other than train: which of the file's keys apply is read off `options`."""
    keys = [f.name.replace("_", "-") for f in dataclasses.fields(options) if f.metadata.get("from_config")]
    parser.add_argument("--config", default="", metavar="FILE", help="YAML file of settings as for train "
                        f"(`scaletrain config` writes one; a run folder's config.yaml works too): its "
                        f"{', '.join(keys)} apply here, its other keys (training's) are ignored; flags given on "
                        f"the command line win")


def options_from_args(options: type, args: argparse.Namespace) -> Any:
    """An `options` instance: its defaults, then the keys of `--config FILE` it takes, then the flags given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(options) if hasattr(args, f.name)}
    path = getattr(args, "config", "")
    values = _file_values(options, path, skip=set(given)) if path else {}
    return options(**{**values, **given})


def _file_values(options: type, path: str, skip: set[str]) -> dict[str, Any]:
    """The settings file's values for `options`' fields that take them, checked against this command's choices.
    Every key is checked by `read_config_file` (unknown keys, types), those for training only included."""
    settings = {name: value for section in read_config_file(path).values() for name, value in section.items()}
    out = {}
    for f in dataclasses.fields(options):
        take: bool | Callable[[Any], Any] = f.metadata.get("from_config", False)
        if not take or f.name in skip or f.name not in settings:
            continue
        value = settings[f.name] if take is True else take(settings[f.name])
        choices = choices_of(f)
        if choices and value not in choices:
            raise UserError(f"--config {path}: {f.name.replace('_', '-')}: '{value}' is not one of "
                            f"{', '.join(choices)} here (a flag given on the command line overrides it)")
        out[f.name] = value
    return out


def check_run_options(opts: Any) -> None:
    """The carried-over flags (`RUN_FLAGS`) refused as train refuses them, on one line naming the flag."""
    if not 0 <= opts.seed < 2**32:  # what NumPy's seeding accepts
        raise UserError(f"--seed must be between 0 and {2**32 - 1}, got {opts.seed}")
    if not opts.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {opts.timeout}")
    if opts.nnodes < 1 or not 0 <= opts.node_rank < opts.nnodes:
        raise UserError(f"--nnodes must be positive and --node-rank in 0..nnodes-1, got --nnodes {opts.nnodes} "
                        f"--node-rank {opts.node_rank}")
    if not 0 < opts.master_port < 65536:
        raise UserError(f"--master-port must be a port number (1-65535), got {opts.master_port}")


def nodes_of(opts: Any):
    """The `parallel.Nodes` the node flags describe."""
    from ..parallel import Nodes

    return Nodes(opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port)
