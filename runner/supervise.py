"""The parent's side of a launch: start the agent process, relay signals, wait.

The agent (runner.launch) runs in its own session so that Ctrl-C reaches it
exactly once, through us. A second Ctrl-C, or an agent that does not stop in
time, gets SIGKILL; the ranks die with it (they hold PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runner.procs import exit_code_for_signal

GRACE_S = 20.0


class _Relay:
    """Forwards the first signal to the agent; a second one, or a slow agent, gets SIGKILL."""

    def __init__(self, agent: subprocess.Popen):
        self.agent = agent
        self.first: int | None = None
        self.since = 0.0

    def __call__(self, signum: int, _frame: object) -> None:
        if self.first is not None:
            _kill(self.agent)
            return
        self.first, self.since = signum, time.monotonic()
        _send(self.agent, signum)

    def overdue(self) -> bool:
        return self.first is not None and time.monotonic() - self.since > GRACE_S


def run_agent(run_dir: Path, start_time: float) -> tuple[int, int | None]:
    """Run the agent for `run_dir` to the end. Returns (exit code, signal received or None)."""
    env = dict(os.environ)
    env["RUNNER_START_TIME"] = repr(start_time)
    env["RUNNER_PARENT_PID"] = str(os.getpid())
    agent = subprocess.Popen(
        [sys.executable, "-m", "runner.launch", str(run_dir)], env=env, start_new_session=True
    )
    relay = _Relay(agent)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, relay) for s in handled}
    try:
        while True:
            try:
                code = agent.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if relay.overdue():
                    _kill(agent)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if relay.first is not None and code < 0:
        code = exit_code_for_signal(relay.first)
    return code, relay.first


def _send(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _send(proc, signal.SIGKILL)
