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
from typing import Any

import yaml

from runner.rundir.files import RunDir, holds_a_run
from runner.rundir.summary import Status, how_it_ended
from runner.sweeps.job_dirs import job_dirs, overrides_of
from runner.sweeps.progress import job_result

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
    ending = how_it_ended(job_dir)
    status = ending.status
    if status in (Status.COMPLETED, Status.PRUNED):
        return EarlierStart(KEEP, status, job_result(job_dir, ending)[2])
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
    if (sweep_dir / "config.yaml").is_file() or RunDir(sweep_dir).summary.is_file():
        return (
            f"hydra.sweep.dir={sweep_dir}: this directory holds a run, not a sweep's jobs; "
            "pick another hydra.sweep.dir"
        )
    return None


# Launchers and sweepers that decide themselves what a sweep directory's earlier jobs become
# (hydra/launcher=runner and =tune, hydra/sweeper=runner's study).
_RESUMING_PLUGINS = ("RunnerLauncher", "TuneLauncher", "RunnerSweeper")


def sweep_dir_problem(config: Any) -> str | None:
    """A sweep started in a directory it must not write into, under any other launcher (the
    default one, joblib, submitit), found before Hydra writes anything there: a run's
    directory, or another sweep's (other overrides, or a sweeper whose jobs are drawn
    afresh). The same command again is resumed, each job by its own start (runner.cli.main)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    targets = [
        str(config.hydra.launcher.get("_target_", "")),
        str(config.hydra.sweeper.get("_target_", "")),
    ]
    if any(t.endswith(_RESUMING_PLUGINS) for t in targets):
        return None
    if not sweep_dir.is_dir():
        return None
    problem = not_a_sweep_problem(sweep_dir)
    if problem or not job_dirs(sweep_dir):
        return problem
    if not targets[1].endswith("BasicSweeper"):
        return (
            f"hydra.sweep.dir={sweep_dir} holds a sweep's jobs, and this sweeper draws its "
            "jobs afresh; pick another hydra.sweep.dir (hydra/sweeper=runner resumes a study "
            "in its directory)"
        )
    earlier = _earlier_overrides(sweep_dir / "multirun.yaml")
    here = [str(o) for o in config.hydra.overrides.task]
    if earlier is None or earlier == here:
        return None  # the same sweep: its jobs go on (each job checks its own directory)
    only_there = [o for o in earlier if o not in here]
    only_here = [o for o in here if o not in earlier]
    return (
        f"hydra.sweep.dir={sweep_dir} holds another sweep (there only: "
        f"{' '.join(only_there) or '-'}; here only: {' '.join(only_here) or '-'}); resume a "
        "sweep with its own command, or pick another hydra.sweep.dir"
    )


def _earlier_overrides(multirun: Path) -> list[str] | None:
    """The sweep's overrides as its multirun.yaml records them, or None where it cannot."""
    try:
        record = yaml.safe_load(multirun.read_text())
        return [str(o) for o in record["hydra"]["overrides"]["task"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class EarlierJob:
    """What a sweep's job directory says before the job writes anything: a problem (it holds
    another job), or how this job's earlier start ended."""

    problem: str | None
    start: EarlierStart


def earlier_job(job_dir: Path, overrides: list[str], resume: Any) -> EarlierJob:
    """How a job of a sweep goes on in `job_dir`: NEW where nothing ran; the earlier start's
    action where the same overrides ran (a failed job is kept, unless its launcher asked for
    it again with resume=auto); a problem where other overrides did."""
    if not holds_a_run(job_dir):
        return EarlierJob(None, EarlierStart(NEW))
    there = overrides_of(job_dir)
    if there != overrides:
        only_there = [o for o in there if o not in overrides]
        only_here = [o for o in overrides if o not in there]
        problem = (
            f"{job_dir} holds another job (there only: {' '.join(only_there) or '-'}; here "
            f"only: {' '.join(only_here) or '-'}); it is left as it is: resume a sweep with "
            "its own command, or pick another hydra.sweep.dir"
        )
        return EarlierJob(problem, EarlierStart(NEW))
    return EarlierJob(None, earlier_start(job_dir, rerun_failed=resume == "auto"))
