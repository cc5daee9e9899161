"""The one exception type for mistakes a user can fix: bad flags, bad files, impossible requests; and `describe`,
how such a message names a value it was given.

The CLI prints its message on one line and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback. `quiet`: another process of
    the job reports it; this one only exits with the same code."""

    exit_code = 2

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def describe(value: Any) -> str:
    """What a value is, as a message names it: type, dtype and shape; a dict's keys; a tuple's parts."""
    if isinstance(value, dict):
        parts = [f"{k!r}: {describe(v)}" for k, v in list(value.items())[:6]]
        return "a dict {" + ", ".join(parts) + (", ..." if len(value) > 6 else "") + "}"
    if isinstance(value, (tuple, list)):
        parts = [describe(v) for v in value[:4]]
        return f"a {type(value).__name__} of {len(value)} (" + ", ".join(parts) + (", ..." if len(value) > 4 else "") + ")"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:  # a tensor or an array, without importing either library here
        kind = "tensor" if type(value).__module__.startswith("torch") else "array"
        dims, name = " x ".join(map(str, shape)), str(dtype).removeprefix("torch.")
        return f"{_a(name)} {name} {kind} {dims}" if dims else f"{_a(name)} {name} {kind} of one value (no dimensions)"
    return f"{_a(type(value).__name__)} {type(value).__name__}"


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeio" else "a"
