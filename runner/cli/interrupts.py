"""The Ctrl-Cs this command has taken (runner.cli.entry counts them): an error raised after
one (a library's own, from where the interruption cut its code short) is that
interruption, which the command reports as such. Nothing here imports anything."""

from __future__ import annotations

taken: list[int] = []  # SIGINTs taken while no agent ran


def interrupted() -> bool:
    """Whether a Ctrl-C reached this command."""
    return bool(taken)
