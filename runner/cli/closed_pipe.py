"""A command's output piped into a reader that leaves early (`runner plan --json | head`,
`runner-report ... | head`)."""

from __future__ import annotations

import os
import sys


def reader_left() -> None:
    """After a BrokenPipeError on stdout: point stdout at /dev/null, so that the
    interpreter's last flush on the way out is quiet (no second traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
