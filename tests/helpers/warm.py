"""The suite's warm server (runner.launch.warm_server): one a test process, started when its
first module with a run begins, so that each run's agent is a fork with torch imported (about
3 CPU-seconds a run fewer). Modules that say `COLD_START = True` and tests marked
`cold_start` run their commands as a user does without one, each agent a new interpreter
(test_run: the first run's path; the tests that read the command's process tree)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runner.processes import WARM_SERVER_ENV as SERVER_ENV
from tests.helpers.cli import HANG, child_env

_server: list[subprocess.Popen] = []


def server_pid() -> int | None:
    """The running server's pid (for the cost ledger), or None."""
    return _server[0].pid if _server and _server[0].poll() is None else None


def start() -> str:
    """The socket of this process's server, started (and waited for) on the first call."""
    if _server and _server[0].poll() is None:
        return _server[0].args[-1]
    path = str(Path(tempfile.mkdtemp(prefix="runner-warm-")) / "server.sock")
    env = {**child_env(), "RUNNER_WARM_SERVER_PARENT": str(os.getpid())}
    env.pop(SERVER_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "runner.launch.warm_server", path], env=env)
    deadline = time.monotonic() + HANG
    while not os.path.exists(path):
        assert proc.poll() is None, f"the warm server ended with {proc.returncode}"
        assert time.monotonic() < deadline, "the warm server never listened"
        time.sleep(0.05)
    _server[:] = [proc]
    return path


def stop() -> None:
    for proc in _server:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(Path(proc.args[-1]).parent, ignore_errors=True)
    _server.clear()
