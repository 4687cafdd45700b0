"""Running the real `runner` command in a subprocess and reading what it leaves: what the
tests share for that (the conftest's fixtures build on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"

# Small, fast runs: the mlp on digits, few steps, no progress bar noise.
# A further case of a claim `make test` proves in another case (another split, engine, mesh or
# option of the same code path): `make test-matrix` runs these, and CI runs both.
MATRIX = pytest.mark.matrix

FAST = ["model=mlp", "data=digits", "precision=fp32", "progress_bar=false"]

# 12 steps on 2 ranks with a checkpoint every 2: what the restart and resume tests train.
RESTARTABLE = [*FAST, "max_epochs=null", "max_steps=12", "log_interval=2", "checkpoint.interval=2"]
ZERO2_OFFLOAD = ["parallelism=zero2", "parallelism.offload_optimizer=cpu"]

# Seconds after which a test takes a run (or a wait for one) as hung. A guard against a hang,
# never a speed check: a run that takes 30 s alone took over 240 s in the suite on a busy
# 2-core machine (Ray's tests, next to two other workers), so every limit is this one.
HANG = 900


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def rank_log(self, rank: int) -> str:
        return (self.run_dir / "logs" / f"rank{rank}.log").read_text()

    def metrics(self) -> list[dict]:
        return [
            json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
        ]


def runner_command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "runner.cli.entry", *overrides]


def run_cli(tmp_path: Path, *overrides: str, name: str = "run", timeout: float = HANG) -> CliResult:
    """Run `runner OVERRIDES hydra.run.dir=tmp_path/name` to completion."""
    run_dir = tmp_path / name
    proc = subprocess.run(
        runner_command(*overrides, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


def run_sweep(
    tmp_path: Path, *overrides: str, timeout: float = HANG, root: Path | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `runner -m OVERRIDES hydra.sweep.dir=ROOT` (tmp_path/sweep) to its end."""
    root = tmp_path / "sweep" if root is None else root
    proc = subprocess.run(
        runner_command("-m", *overrides, f"hydra.sweep.dir={root}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    return proc, root


# One intra-op thread a rank, as a user sets it for runs side by side (runner keeps a
# user's OMP_NUM_THREADS): the suite runs three workers' runs at once on 2 cores, and a rank
# of a 1-rank run would otherwise take 2 threads, whose OpenMP team spins while the other is
# off its core (3 such runs at once: 82 CPU-seconds where one thread each took 12). Inductor
# builds its kernels in the rank, not in a pool of worker processes that each import torch
# (the mlp's compiled 2-rank run: 30 CPU-seconds where the pool took 33).
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


def child_env() -> dict[str, str]:
    env = {**os.environ, **ONE_THREAD}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_runner(tmp_path: Path, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """Start `runner` in the background (for tests that signal it mid-run)."""
    return subprocess.Popen(
        runner_command(*overrides, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(proc: subprocess.Popen, ready, timeout: float = HANG) -> None:
    """Poll `ready()` while `proc` runs; fail with its output if it exits or time runs out."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
