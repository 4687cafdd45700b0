"""Submitting runner to the test cluster and watching its jobs, as a user would: sbatch,
squeue, scontrol, scancel and sacct."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.helpers.cli import FAST, child_env, runner_command

REPO = Path(__file__).resolve().parents[2]
TRAIN = [*FAST, "max_epochs=null", "max_steps=20", "checkpoint.interval=null"]


def env_for(slurm: dict[str, str]) -> dict[str, str]:
    return {**child_env(), "SLURM_CONF": slurm["SLURM_CONF"]}


def run(slurm: dict[str, str], *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, env=env_for(slurm), capture_output=True, text=True, timeout=timeout
    )


def runner(cwd: Path, slurm: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            runner_command(*overrides),
            cwd=cwd,
            env=env_for(slurm),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as late:
        message = f"runner timed out after {late.timeout} s\n{stuck(cwd, slurm)}"
        raise AssertionError(message) from None


def stuck(where: Path, slurm: dict[str, str]) -> str:
    """What a command that timed out left to read: the queue, the nodes, and the tail of
    every submitit job's log and runner's rank logs under `where`."""
    parts = [
        run(slurm, "squeue", "-o", "%i %T %R %N").stdout,
        run(slurm, "sinfo", "-N", "-o", "%N %T %C").stdout,
    ]
    logs = sorted(where.rglob("*.out")) + sorted(where.rglob("*.err"))
    logs += sorted(where.rglob("*.log"))
    for log in logs[:20]:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        parts.append(f"--- {log.relative_to(where)}\n" + "\n".join(tail))
    return "\n".join(parts)


def batch_script(where: Path, overrides: list[str], options: list[str], env: str = "") -> Path:
    """A job script: `srun runner OVERRIDES` on each node of the job (one task per node)."""
    command = " ".join(runner_command(*overrides))
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options)]
    lines += [
        f"#SBATCH -o {where}/job-%j.out",
        "#SBATCH --open-mode=append",  # a requeued job's output follows the first start's
        f"cd {where}",
        env,
        f"srun {command}",
    ]
    script = where / "job.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


def submit(slurm: dict[str, str], script: Path) -> str:
    done = run(slurm, "sbatch", "--parsable", str(script))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def state(slurm: dict[str, str], job: str) -> str:
    """The job's state in the queue (PENDING, RUNNING, ...), or "" once it left it."""
    return run(slurm, "squeue", "-h", "-j", job, "-o", "%T").stdout.strip()


def wait_until_gone(slurm: dict[str, str], job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while state(slurm, job):
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout} s"
        time.sleep(1)


def wait_for(what: str, check, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


def accounted_states(slurm: dict[str, str], job: str) -> list[str]:
    """Every state sacct (-c: the job completion log) recorded for the job, oldest first."""
    out = run(slurm, "sacct", "-c", "-n", "-X", "-o", "JobID,State", "-j", job).stdout
    return [line.split()[1] for line in out.splitlines() if line.split()[:1] == [job]]


def processes_with(marker: str) -> list[str]:
    """Command lines of this machine's processes that mention `marker` (a run directory)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


# The example in docs/multi-node.md: a sweep through submitit onto 2 nodes, one task (one
# runner) each
SUBMITIT_2_NODES = [
    "-m",
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.nodes=2",
    "hydra.launcher.tasks_per_node=1",
    "hydra.launcher.cpus_per_task=2",
    "hydra.launcher.timeout_min=10",
    "hydra.launcher.partition=debug",
    "nodes=auto",
]
