"""The one exception type for mistakes a user can fix: bad flags, bad files, impossible requests.

The CLI prints its message on one line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""

    exit_code = 2
