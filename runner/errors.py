"""How an error is said in one line: a rank's failure, a tracker's, a bad key's. Messages can
run to pages (a traceback of a remote call, a compiler's log); the console, summary.json and
a sweep's table carry the first line."""

from __future__ import annotations


class Explained(Exception):  # noqa: N818  (an error whose message is the whole story)
    """An error whose message tells the user all they need (a damaged checkpoint, named with
    its file and what is wrong): reported without a traceback."""


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message, blank lines around it dropped ('' for none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def describe(exc: BaseException) -> str:
    """`Type: first line` (the type alone when the message is empty)."""
    line = first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
