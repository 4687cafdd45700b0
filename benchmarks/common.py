"""What every benchmark suite shares: a configuration, how commands run, metric names.

Run from benchmarks/ as scripts (`make bench`), so suites import it as `common`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
WARMUP = 5  # steps excluded from every timing
STEP = "s/step"
SPS = "samples/s"
FIRST = "s to first step"
STATE = "state MB/rank"  # parameters + gradients + optimizer state (summary.json state_bytes)
MB = 1024 * 1024


def thread_env(nproc: int, threads: int | None = None) -> dict[str, str]:
    """Identical threading for runner and the baseline: cores split among local ranks.

    torchrun sets only OMP_NUM_THREADS; MKL would otherwise start threads of its own
    in every rank and oversubscribe the cores (measured here: 0.60 vs 0.49 s/step).
    """
    count = str(threads or max(1, (os.cpu_count() or 1) // nproc))
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {**os.environ, **dict.fromkeys(names, count)}


@dataclass
class Config:
    name: str
    measure: Callable[[], dict[str, float]]  # metrics of one run
    baseline: str | None = None  # the configuration ratios compare with (default: the first)


def venv_tool(name: str) -> str:
    """A console script of this environment (`runner`, `torchrun`), as a user would call it."""
    return str(Path(sys.executable).parent / name)


def run(command: list[str], env: dict[str, str], cwd: str | None = None) -> str:
    """Run one benchmarked command; its stdout. A failure stops the suite with its stderr."""
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        sys.exit(f"benchmark command failed (exit {proc.returncode}): {' '.join(command)}\n{tail}")
    return proc.stdout


def time_command(command: list[str], cwd: str, nproc: int) -> tuple[float, float, str]:
    """Wall seconds of the whole command, its start as unix time, and its stdout."""
    start = time.time()
    stdout = run(command, thread_env(nproc), cwd=cwd)
    return time.time() - start, start, stdout
