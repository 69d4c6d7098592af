"""The one exception type for mistakes a user can fix.

NOTE: this module imports nothing of ours, so every room may raise it. The CLI turns it
into one line on stderr and a non-zero exit code; anything else is a bug and keeps its
traceback.
"""


class TrainfastError(Exception):
    """A user-facing error: the message names the input and the reason."""
