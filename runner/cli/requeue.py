"""SLURM requeues, from the parent: after a graceful stop, and when the job starts again.

A graceful stop (SIGUSR1/SIGUSR2; runner.launch.stopping) inside a SLURM batch job means
"the job must leave now and come back": SLURM's warning before the time limit
(`--signal=USR1@120`) or before a preemption. Once every rank has stopped with a
checkpoint, node 0's `runner` requeues the job (`scontrol requeue`), unless another handler
owns the signal here: under submitit (hydra/launcher=submitit_slurm) its handler decides,
checkpointing the job's submission and requeueing it as its `max_num_timeout` allows.

When SLURM starts the job again (SLURM_RESTART_COUNT > 0: after runner's requeue,
`scontrol requeue`, or a preemption with PreemptMode=REQUEUE), runner goes on with the run
that job started: the same run directory (found by the job id in its env.json, when the
directory name holds a timestamp) and `resume=auto`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runner.rundir.files import read_json
from runner.spec import slurm

log = logging.getLogger("runner")
SCONTROL_TIMEOUT_S = 60


def first_run_dir(run_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """The directory this SLURM job's first start ran in: `run_dir` itself when its env.json
    names this job (a fixed hydra.run.dir, a submitit job's directory), else the newest
    sibling that does (the default runs/<timestamp>/), else `run_dir`."""
    job = slurm.job_key(environ)
    if job is None:
        return run_dir
    if (read_json(run_dir / "env.json") or {}).get("slurm_job") == job:
        return run_dir
    siblings = sorted((p for p in run_dir.parent.iterdir() if p.is_dir()), reverse=True)
    for candidate in siblings:
        if (
            candidate != run_dir
            and (read_json(candidate / "env.json") or {}).get("slurm_job") == job
        ):
            return candidate
    return run_dir


def continue_after_stop(
    asked: int,
    handler: Callable[..., Any] | None,
    node_rank: int,
    stopped_after: int | None,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """After a graceful stop asked by signal `asked`: hand over to the handler that owned the
    signal here (submitit's: it requeues and exits), or requeue this SLURM batch job
    (node 0 only; every node's job step ends with it)."""
    if handler is not None:
        handler(asked, None)
        return
    job = environ.get("SLURM_JOB_ID")
    if job is None or node_rank != 0:
        return
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            env=dict(environ),
        )
        problem = done.stderr.strip() if done.returncode else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    name = signal.Signals(asked).name
    if problem:
        log.warning(
            "runner: %s: could not requeue SLURM job %s (%s); to go on, start it again with "
            "resume=auto in the same run directory",
            name,
            job,
            problem,
        )
        return
    log.info(
        "runner: %s: requeued SLURM job %s; when it starts again it resumes after step %s",
        name,
        job,
        stopped_after,
    )
