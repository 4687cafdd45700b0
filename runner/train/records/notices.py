"""Lines a rank has for the user, beside its log: rank 0 also prints them on the terminal
(a build that takes minutes, a damaged checkpoint skipped), where the other ranks stay quiet."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("runner")

Say = Callable[[str], None]


def notices(terminal: TextIO | None) -> Say:
    """`say(line)`: the line in this rank's log, and on the terminal where it has one."""

    def say(line: str) -> None:
        log.info("%s", line)
        if terminal is not None:
            with contextlib.suppress(OSError, ValueError):  # gone: the log has it
                print(f"runner: {line}", file=terminal, flush=True)

    return say
