"""Running a sweep's command again in its directory (`hydra.sweep.dir=DIR`) finishes it:
what each job's directory there says about an earlier start of the same job.

A completed job is kept (its number, directory and result), as is one a pruner stopped; an
interrupted one (stopped, killed, or its sweep killed under it) goes on from its last
checkpoint (resume=auto); a failed one is kept as it is unless the sweep asks for failed jobs again
(`hydra.launcher.rerun_failed=true`: they go on from their last checkpoint too). A job
directory whose overrides are not this job's means the directory holds another sweep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runner.cli.sweep import overrides_of
from runner.cli.sweep_progress import job_result
from runner.rundir.files import read_json
from runner.rundir.summary import Status

KEEP, RESUME, NEW = "keep", "resume", "new"


@dataclass(frozen=True)
class EarlierStart:
    action: str  # KEEP, RESUME or NEW
    status: str | None = None  # how the earlier start ended (None: never started here)
    value: float = math.nan  # a kept job's result for the sweeper


def earlier_start(job_dir: Path, rerun_failed: bool) -> EarlierStart:
    """What to do with a job, given what its directory holds."""
    if not (job_dir / ".hydra" / "overrides.yaml").is_file():
        return EarlierStart(NEW)
    summary = read_json(job_dir / "summary.json") or {}
    status = summary.get("status")
    if status in (Status.COMPLETED, Status.PRUNED):
        return EarlierStart(KEEP, status, job_result(job_dir, summary)[2])
    if status == Status.FAILED and not rerun_failed:
        return EarlierStart(KEEP, status)
    return EarlierStart(RESUME, status or Status.INTERRUPTED)


def resuming_line(sweep_dir: Path, starts: Iterable[EarlierStart]) -> str | None:
    """What a sweep started again in its directory says of its jobs; None when none of them
    had started before."""
    actions = [start.action for start in starts]
    if all(action == NEW for action in actions):
        return None
    kept, going_on, new = (actions.count(a) for a in (KEEP, RESUME, NEW))
    return (
        f"resuming the sweep in {sweep_dir}: {kept} job(s) kept as they ended, {going_on} "
        f"going on from their last checkpoint, {new} not started yet"
    )


def other_sweep_problem(
    sweep_dir: Path, job_dir: Path, idx: int, overrides: list[str]
) -> str | None:
    """A job directory of another sweep where this job would go, named with the difference."""
    if not (job_dir / ".hydra" / "overrides.yaml").is_file():
        return None
    there = overrides_of(job_dir)
    if there == list(overrides):
        return None
    only_there = [o for o in there if o not in overrides]
    only_here = [o for o in overrides if o not in there]
    return (
        f"hydra.sweep.dir={sweep_dir}: its job {idx} ran other overrides than this sweep's job "
        f"{idx} (there only: {' '.join(only_there) or '-'}; here only: "
        f"{' '.join(only_here) or '-'}); resume a sweep with its own command, or pick another "
        "hydra.sweep.dir"
    )


def not_a_sweep_problem(sweep_dir: Path) -> str | None:
    """A directory that holds a run, not a sweep's jobs."""
    if (sweep_dir / "config.yaml").is_file() or (sweep_dir / "summary.json").is_file():
        return (
            f"hydra.sweep.dir={sweep_dir}: this directory holds a run, not a sweep's jobs; "
            "pick another hydra.sweep.dir"
        )
    return None
