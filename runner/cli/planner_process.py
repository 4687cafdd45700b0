"""The planner's process (runner.layouts.planner), started as early as `runner` starts: its
torch import is most of a plan's time, and runs while the command line is read and Hydra
composes the config. Nothing here imports more than the standard library."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

from runner.cli import warm_start


class _Planner:
    prestarted: subprocess.Popen | warm_start.WarmProcess | None = None


def start() -> subprocess.Popen | warm_start.WarmProcess:
    """A planner process: it imports torch, then waits for its request on stdin. A fork of
    the warm server where one serves (runner.launch.warm_server: torch imported already)."""
    env = {**os.environ, "RUNNER_PARENT_PID": str(os.getpid())}
    warm = warm_start.start("runner.layouts.planner", [], env, pipes=3)
    if warm is not None:  # (the planner ignores warnings itself: PYTHONWARNINGS is read at load)
        return warm
    return subprocess.Popen(
        [sys.executable, "-m", "runner.layouts.planner"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONWARNINGS": "ignore"},
    )


def prestart(argv: list[str]) -> None:
    """Start the planner now where `argv` will plan (`runner plan`, or parallelism=auto on
    the command line). One the run never asks is ended when the parent exits."""
    if argv[:1] == ["plan"] or "parallelism=auto" in argv:
        _Planner.prestarted = start()
        atexit.register(_end_unasked)


def take() -> subprocess.Popen | warm_start.WarmProcess:
    """The prestarted planner, or a new one."""
    child, _Planner.prestarted = _Planner.prestarted or start(), None
    return child


def _end_unasked() -> None:
    child = _Planner.prestarted
    if child is not None and child.poll() is None:
        child.kill()
        child.wait()
