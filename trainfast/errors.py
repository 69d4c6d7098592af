"""The one exception type for mistakes a user can fix.

NOTE: this module imports nothing of ours, so every room may raise it. The CLI turns it
into one line on stderr and a non-zero exit code; anything else is a bug and keeps its
traceback.
"""


class TrainfastError(Exception):
    """A user-facing error: the message names the input and the reason."""


def in_words(e: BaseException, limit: int = 120) -> str:
    """Another library's exception in a few words, for a one-line message: its type and the first
    line of its message (at most `limit` characters); the type alone where the message is empty."""
    why = (str(e).strip().splitlines() or [""])[0][:limit]
    return f"{type(e).__name__}{': ' + why if why else ''}"


class Detail(str):
    """A log line that tells how a run adapts (threads, a resume's position), not what it
    found: `trainfast train -q` leaves these out. A plain str to any other log callback."""
