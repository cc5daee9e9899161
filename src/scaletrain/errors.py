"""The one exception type for mistakes a user can fix: bad flags, bad files, impossible requests.

The CLI prints its message on one line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback. `quiet`: another process of
    the job reports it; this one only exits with the same code."""

    exit_code = 2

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet
