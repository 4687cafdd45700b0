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

from runner.processes import WARM_SERVER_ENV

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
    """Run `runner OVERRIDES hydra.run.dir=tmp_path/name` to completion: a fork of the warm
    server where the module has one (warm_command), else a new interpreter."""
    run_dir = tmp_path / name
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    env = child_env()
    if env.get(WARM_SERVER_ENV):
        returncode, stdout, stderr = _warm_command(tmp_path, args, env, timeout)
    else:
        proc = subprocess.run(
            runner_command(*args), cwd=tmp_path, capture_output=True, text=True,
            timeout=timeout, env=env,
        )  # fmt: skip
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    served_warm(stderr)
    return CliResult(returncode, stdout, stderr, run_dir)


def _warm_command(
    cwd: Path, args: list[str], env: dict[str, str], timeout: float
) -> tuple[int, str, str]:
    """The command as a fork of the warm server: the interpreter's start and the imports a
    command makes (about 0.5 CPU-seconds a run) saved, its code the same. Tests of how the
    command itself starts and stops (signals, a terminal, a first run) start it anew."""
    from runner.cli import warm_start
    from runner.processes import EXTENSIONS_ENV
    from tests.helpers import cost

    cost.note_started(runner_command(*args))
    if sys.prefix != sys.base_prefix:  # what the command sets first, as the server did
        env = {EXTENSIONS_ENV: os.path.join(sys.prefix, "torch_extensions"), **env}
    proc = warm_start.start("tests.helpers.warm_command", args, env, pipes=3, cwd=str(cwd))
    assert proc is not None, "the warm server did not serve the command (stderr says why)"
    try:
        stdout, stderr = proc.communicate("", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode if proc.returncode is not None else proc.wait(), stdout, stderr


def served_warm(stderr: str) -> None:
    """A command of a module with a warm server (tests/helpers/warm.py) was served by it: a
    new interpreter instead costs the suite 3 CPU-seconds a run, and says so on stderr."""
    from runner.cli.warm_start import FALLBACK

    assert FALLBACK not in stderr, stderr[stderr.index(FALLBACK) :].split("\n")[0]


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
    served_warm(proc.stderr)
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


# The environment the suite started in, as a user's shell gives it to a command. The test
# process's own imports add to os.environ what a library sets as it loads (torch's compiler
# its cache directory, scikit-learn KMP_DUPLICATE_LIB_OK, DeepSpeed
# PYTORCH_NVML_BASED_CUDA_CHECK): a command passed those would differ from the warm server,
# started before them, in what a library reads at load, and its agent would be a new
# interpreter (3 CPU-seconds a run) from the first such import on.
_SHELL = dict(os.environ)


def child_env() -> dict[str, str]:
    """The environment of the commands a test runs: os.environ (a test's own variables
    included), with what is read at load as the suite started, one thread a rank."""
    from runner.launch.warm_server import READ_AT_LOAD

    env = {k: v for k, v in os.environ.items() if not k.startswith(READ_AT_LOAD)}
    env.update((k, v) for k, v in _SHELL.items() if k.startswith(READ_AT_LOAD))
    env.update(ONE_THREAD)
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
