"""Multi-node runs on one machine: a free port, starting a node's `runner`, waiting for the
nodes, finding the run directory, and when a chaos fault struck."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

from tests.helpers.cli import HANG, child_env, runner_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(
    cwd: Path,
    node_rank: int | None,
    *overrides: str,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    rank = [] if node_rank is None else [f"node_rank={node_rank}"]
    return subprocess.Popen(
        [*prefix, *runner_command(*overrides, *rank)],
        cwd=cwd,
        env={**child_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(*procs: subprocess.Popen, timeout: float = HANG) -> list[tuple[int, str, float]]:
    """Wait for every process: (exit code, output, time it ended) each."""
    ended: dict[int, float] = {}
    deadline = time.time() + timeout
    while len(ended) < len(procs) and time.time() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return [(p.wait(), p.stdout.read(), ended.get(i, float("inf"))) for i, p in enumerate(procs)]


def only_run(cwd: Path) -> Path:
    runs = sorted((cwd / "runs").iterdir())
    assert len(runs) == 1, f"expected one run directory, found {runs}"
    return runs[0]


def chaos_time(run_dir: Path, rank: int) -> float:
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return float(
        re.search(r"chaos: rank \d+ (?:fails \(\w+\)|hangs) at step \d+ at t=([\d.]+)", log).group(
            1
        )
    )
