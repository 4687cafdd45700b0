"""What the sweep launchers share (hydra/launcher=runner: runner.sweeps.side_by_side;
hydra/launcher=tune: runner.sweeps.tune_sweep): a sweep's job as both hold it, composed
the way Hydra's own launchers compose it, its result handed back to the sweeper, and the
signals that stop a whole sweep, with what the sweep says of jobs that never started.

And what hydra/sweeper=runner asks of whichever launcher runs its jobs (`traits_of`): a
launcher declares its `sweep_traits`; Hydra's own launchers have the defaults, but for
submitit's SLURM launcher, whose jobs run on other hosts."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Each stops every running job once (SIGUSR1: runner's graceful stop, with a checkpoint);
# no queued job starts.
SWEEP_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@dataclass
class SweepJob:
    """One job of a sweep: its number, its overrides, its composed config (Hydra's keys
    included) and the devices it takes (hydra/launcher=runner's slots)."""

    idx: int
    overrides: Sequence[str]
    config: Any
    size: int = 1
    beside_others: bool = False  # runs side by side with others: no progress bar (NO_BAR_ENV)

    @property
    def dir(self) -> Path:
        return Path(str(self.config.hydra.sweep.dir)) / str(self.config.hydra.sweep.subdir)

    @property
    def nproc(self) -> int:
        """Its ranks (`nproc=auto`: one, on the node its launcher picks)."""
        nproc = self.config.get("nproc", 1)
        return nproc if isinstance(nproc, int) else 1


def compose_job(launcher: Any, idx: int, overrides: Sequence[str]) -> SweepJob:
    """Job `idx` of a launcher set up by Hydra (its config and context), composed as Hydra's
    launchers compose a job."""
    from omegaconf import open_dict

    loader = launcher.hydra_context.config_loader
    config = loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(config):
        config.hydra.job.id = idx
        config.hydra.job.num = idx
    return SweepJob(idx, overrides, config)


def job_return(job: SweepJob, value: float) -> Any:
    """The JobReturn the sweeper gets for `job`: its final value of sweep.metric (NaN: none,
    and its summary.json says how it ended)."""
    from hydra.core.utils import JobReturn, JobStatus

    result = JobReturn(overrides=list(job.overrides), cfg=job.config, status=JobStatus.COMPLETED)
    result._return_value = value
    result.working_dir = str(job.dir)
    return result


@contextlib.contextmanager
def stopping_on_signals(handler: Callable[[int, Any], None]) -> Iterator[dict[int, Any]]:
    """`handler` for every stop signal while the sweep runs; yields the handlers it replaced
    (what a job's own process puts back), restored at the end."""
    replaced = {sig: signal.signal(sig, handler) for sig in SWEEP_STOP_SIGNALS}
    try:
        yield replaced
    finally:
        for sig, previous in replaced.items():
            signal.signal(sig, previous)


def never_started_line(jobs: Iterable[int]) -> str | None:
    """What a stopped sweep says of its queued jobs (the sweep table lists only jobs that
    ran); None when there were none."""
    never = sorted(jobs)
    if not never:
        return None
    return f"{len(never)} queued job(s) never started: {', '.join(map(str, never))}"


@dataclass(frozen=True)
class LauncherTraits:
    """What a sweeper asks of the launcher of its jobs."""

    goes_on_with_trials: bool = False  # runs a study's interrupted trials on from where they were
    # where its jobs' reports go when not to the sweep's study (pruning): what to do instead
    reports_elsewhere: str = ""


def traits_of(launcher: Any) -> LauncherTraits:
    declared = getattr(launcher, "sweep_traits", None)
    if isinstance(declared, LauncherTraits):
        return declared
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
    except ImportError:  # submitit's plugin is not installed: no such launcher either
        return LauncherTraits()
    if isinstance(launcher, SlurmLauncher):
        return LauncherTraits(
            reports_elsewhere="the jobs of hydra/launcher=submitit_slurm run on other hosts, "
            "where the study cannot hear their reports; prune on one node "
            "(hydra/launcher=runner)"
        )
    return LauncherTraits()
