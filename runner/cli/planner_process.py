"""The planner's process (runner.layouts.planner), started as early as `runner` starts: its
torch import is most of a plan's time, and runs while the command line is read and Hydra
composes the config. Nothing here imports more than the standard library."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys


class _Planner:
    prestarted: subprocess.Popen | None = None


def start() -> subprocess.Popen:
    """A planner process: it imports torch, then waits for its request on stdin."""
    return subprocess.Popen(
        [sys.executable, "-m", "runner.layouts.planner"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "RUNNER_PARENT_PID": str(os.getpid())},
    )


def prestart(argv: list[str]) -> None:
    """Start the planner now where `argv` will plan (`runner plan`, or parallelism=auto on
    the command line). One the run never asks is ended when the parent exits."""
    if argv[:1] == ["plan"] or "parallelism=auto" in argv:
        _Planner.prestarted = start()
        atexit.register(_end_unasked)


def take() -> subprocess.Popen:
    """The prestarted planner, or a new one."""
    child, _Planner.prestarted = _Planner.prestarted or start(), None
    return child


def _end_unasked() -> None:
    child = _Planner.prestarted
    if child is not None and child.poll() is None:
        child.kill()
        child.wait()
