"""hydra/launcher=runner: a sweep's jobs side by side on this node, each on its own devices
(a slot: runner.sweeps.slots) and in its own process tree (runner.sweeps.job_process).

The launcher's plugin (hydra_plugins/runner_launcher) hands each launch here: its jobs are
composed and checked, those an earlier start of the sweep ended are kept (its directory
resumed: runner.sweeps.resume), and the rest start in order as slots free up. A failed job
is reported as it ends; with `fail_fast=true` it also ends the sweep: running jobs are
stopped (SIGTERM: interrupted, with their summary) and queued ones never start.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, configure_log, filter_overrides, setup_globals
from omegaconf import open_dict

from runner.rundir.summary import how_it_ended
from runner.sweeps.job_dirs import shown
from runner.sweeps.job_process import job_process
from runner.sweeps.launched import (
    SweepJob,
    compose_job,
    job_return,
    never_started_line,
    stopping_on_signals,
)
from runner.sweeps.progress import stopped_line
from runner.sweeps.resume import (
    KEEP,
    NEW,
    RESUME,
    earlier_start,
    not_a_sweep_problem,
    other_sweep_problem,
    resuming_line,
)
from runner.sweeps.slots import (
    Slots,
    declared_devices,
    device_pool,
    device_problems,
    multi_node_problems,
    pool_problems,
    slot_size,
)
from runner.sweeps.tables import SweepTable, refuse_sweep, say


def launch(
    launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> list[JobReturn]:
    """Run one launch's jobs side by side on the launcher's devices (its `devices`, set up
    by Hydra: its `config` and `hydra_context`); their JobReturns, in job order."""
    setup_globals()
    assert launcher.config is not None and launcher.hydra_context is not None
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    declared = declared_devices(launcher.devices)
    problems = device_problems(declared)
    if problems:
        refuse_sweep(problems, sweep_dir)
    pool = device_pool(declared)
    jobs = [_job(launcher, initial_job_idx + i, o, pool) for i, o in enumerate(job_overrides)]
    problems = pool_problems(pool, [job.size for job in jobs])
    problems += multi_node_problems([job.config.get("nodes", 1) for job in jobs])
    problems += _resume_problems(sweep_dir, jobs)
    if problems:
        refuse_sweep(problems, sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    returns = _resume(jobs, launcher.rerun_failed, sweep_dir)
    to_run = [job for job in jobs if job.idx not in returns]
    if len(to_run) > 1 and 2 * min(job.size for job in to_run) <= len(pool.devices):
        for job in to_run:  # side by side, their bars would share one terminal line
            job.beside_others = True
    say(f"{len(to_run)} job(s) on {pool.describe()}, side by side")
    returns.update(_Sweep(launcher, pool).run(to_run))
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    return [returns[idx] for idx in sorted(returns)]


def _job(launcher: Any, idx: int, overrides: Sequence[str], pool: Any) -> SweepJob:
    job = compose_job(launcher, idx, overrides)
    job.size = slot_size(job.config.get("nproc", 1), pool)
    return job


class _Sweep:
    """The jobs of one launch: started as slots free up, collected as they end."""

    def __init__(self, launcher: Any, pool: Any):
        self.launcher = launcher
        self.pool = pool
        self.slots = Slots(pool)
        self.running: dict[Any, tuple[SweepJob, tuple[str, ...], Any]] = {}
        self.returns: dict[int, JobReturn] = {}
        self.stopping = False
        # The signal handlers the sweep replaced with its own: its jobs get these back.
        self.handlers: dict[int, Any] = {}

    def run(self, jobs: list[SweepJob]) -> dict[int, JobReturn]:
        queue = deque(jobs)
        self.progress = self.launcher.progress  # the whole sweep's, over every launch
        self.progress.queued += len(jobs)
        with stopping_on_signals(self._stop) as self.handlers:
            while queue or self.running:
                while queue and not self.stopping:
                    devices = self.slots.take(queue[0].size)
                    if devices is None:
                        break
                    self._start(queue.popleft(), devices)
                if self.running:
                    for conn in multiprocessing.connection.wait(list(self.running)):
                        self._collect(conn)
                if self.stopping and queue:
                    say(never_started_line(job.idx for job in queue) or "")
                    queue.clear()
        return self.returns

    def _stop(self, signum: int, _frame: Any) -> None:
        """The sweep is stopped (Ctrl-C, SIGTERM, a SLURM time limit; SIGUSR1, runner's
        graceful stop): each running job gets the signal once (a job is a process group of
        its own) and ends as a run would; no queued job starts; the sweep table is written
        as the sweep ends."""
        if not self.stopping:
            say(f"{signal.Signals(signum).name}: stopping every running job; no other starts")
            SweepTable.stopped_by = SweepTable.stopped_by or signum
        self.stopping = self.launcher.stopped = True
        for _, _, process in self.running.values():
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def _start(self, job: SweepJob, devices: tuple[str, ...]) -> None:
        receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
        process = multiprocessing.get_context("fork").Process(
            target=job_process,
            args=(send, self.launcher, job, self.pool, devices, self.handlers, os.getpid()),
        )
        process.start()
        send.close()
        self.progress.started()
        overrides = shown(list(filter_overrides(job.overrides)))
        say(f"job {job.idx} started on {_kind(self.pool)} {','.join(devices)}: {overrides}")
        self.running[receive] = (job, devices, process)

    def _collect(self, conn: Any) -> None:
        job, devices, process = self.running.pop(conn)
        try:
            result = conn.recv()
        except EOFError:  # the job's process died without a word
            result = None
        process.join()
        self.slots.give_back(devices)
        if result is None:
            result = job_return(job, math.nan)  # its summary says how it ended
        self.returns[job.idx] = result
        problem, stopped = _failure(job, result), stopped_line(job.idx, job.dir)
        if problem is not None:
            say(f"job {job.idx} failed: {problem}")
            if self.launcher.fail_fast and not self.stopping:
                self._fail_fast()
        elif stopped is not None:  # where it stopped before its end (a signal, fail_fast)
            say(stopped)
        if self.stopping:  # no queued job starts any more
            self.progress.queued = 0
        value = result._return_value
        returned = not (isinstance(value, float) and math.isnan(value))
        self.progress.ended(job.idx, job.dir, returned)
        say(self.progress.line())

    def _fail_fast(self) -> None:
        self.stopping = self.launcher.stopped = True
        others = [j.idx for j, _, _ in self.running.values()]
        stopping = f" (stopping job(s) {', '.join(map(str, others))})" if others else ""
        say(f"hydra.launcher.fail_fast=true: the sweep stops{stopping}")
        for _, _, other in self.running.values():
            if other.pid is not None:
                os.kill(other.pid, signal.SIGTERM)


def _resume_problems(sweep_dir: Path, jobs: list[SweepJob]) -> list[str]:
    problems = [not_a_sweep_problem(sweep_dir)]
    problems += [other_sweep_problem(sweep_dir, j.dir, j.idx, list(j.overrides)) for j in jobs]
    return [p for p in problems if p]


def _resume(jobs: list[SweepJob], rerun_failed: bool, sweep_dir: Path) -> dict[int, JobReturn]:
    """Running the sweep's command again in its directory: the jobs kept as they are (their
    results for the sweeper); the interrupted ones (and failed, when asked) go on from their
    last checkpoint."""
    starts = {job.idx: earlier_start(job.dir, rerun_failed) for job in jobs}
    if all(start.action == NEW for start in starts.values()):
        return {}
    kept: dict[int, JobReturn] = {}
    for job in jobs:
        start = starts[job.idx]
        if start.action == KEEP:
            kept[job.idx] = job_return(job, start.value)
        elif start.action == RESUME:
            with open_dict(job.config):
                job.config.resume = "auto"
    say(resuming_line(sweep_dir, starts.values()) or "")
    return kept


def _failure(job: SweepJob, result: JobReturn) -> str | None:
    """Why the job failed (its summary's error), or None when it did not: it completed, a
    pruner ended it, or it was stopped (interrupted: stopped_line says so). Read from the
    summary whatever the job returned: a run that fails after an evaluation returns that
    evaluation's metric (the sweeper's), yet failed."""
    job_dir = job.dir
    ending = how_it_ended(job_dir)
    if not ending.failed:
        return None  # ended without the sweep's metric, or stopped
    return f"{ending.error_line()} ({job_dir})"


def _kind(pool: Any) -> str:
    return "GPU(s)" if pool.kind == "gpu" else "core(s)"
