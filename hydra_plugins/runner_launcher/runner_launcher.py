"""hydra/launcher=runner: run a sweep's jobs side by side on this node, each on its own
devices (a slot: runner.sweeps.slots) and in its own process tree.

Each job is a fork of the sweep's process, taken before the job composes, resolves or
starts anything (the sweep's process never imports torch, so no CUDA state or thread is
inherited); it sets its devices, runs the job as Hydra's own launcher would (its directory,
its `.hydra/`, its return value for the sweeper) and sends back the JobReturn. Jobs start
in order as slots free up. A failed job is reported as it ends; with `fail_fast=true` it
also ends the sweep: running jobs are stopped (SIGTERM: interrupted, with their summary)
and queued ones never start.
"""

# No `from __future__ import annotations`: Hydra runs this module without a sys.modules
# entry, where dataclasses cannot read annotations kept as strings.
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from runner.errors import describe
from runner.sweeps.launched import (
    LauncherTraits,
    SweepJob,
    compose_job,
    job_return,
    never_started_line,
    stopping_on_signals,
)


@dataclass
class RunnerLauncherConf:
    _target_: str = "hydra_plugins.runner_launcher.runner_launcher.RunnerLauncher"
    devices: Any = None  # GPU ids; null: every visible GPU, else the cores
    fail_fast: bool = False  # the first failed job stops the sweep
    rerun_failed: bool = False  # a resumed sweep runs its failed jobs again


ConfigStore.instance().store(
    group="hydra/launcher", name="runner", node=RunnerLauncherConf, provider="runner"
)


class RunnerLauncher(Launcher):
    # hydra/sweeper=runner: an interrupted trial goes on from its checkpoint; its jobs run
    # on this host, where the study hears their reports
    sweep_traits = LauncherTraits(goes_on_with_trials=True)

    def __init__(
        self, devices: Any = None, fail_fast: bool = False, rerun_failed: bool = False
    ) -> None:
        super().__init__()
        self.devices = devices  # checked as the sweep starts (job_slots.device_problems)
        self.fail_fast = bool(fail_fast)
        self.rerun_failed = bool(rerun_failed)
        self.stopped = False  # a signal or fail_fast stopped the sweep: no job starts any more
        self.progress = _progress()  # where the sweep stands, over every launch (a sweeper's)
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from runner.sweeps.slots import (
            declared_devices,
            device_pool,
            device_problems,
            multi_node_problems,
            pool_problems,
        )

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        declared = declared_devices(self.devices)
        problems = device_problems(declared)
        if problems:
            from runner.sweeps.tables import refuse_sweep

            refuse_sweep(problems, sweep_dir)
        pool = device_pool(declared)
        jobs = [self._job(initial_job_idx + i, o, pool) for i, o in enumerate(job_overrides)]
        problems = pool_problems(pool, [job.size for job in jobs])
        problems += multi_node_problems([job.config.get("nodes", 1) for job in jobs])
        problems += _resume_problems(sweep_dir, jobs)
        if problems:
            from runner.sweeps.tables import refuse_sweep

            refuse_sweep(problems, sweep_dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns = _resume(jobs, self.rerun_failed, sweep_dir)
        to_run = [job for job in jobs if job.idx not in returns]
        if len(to_run) > 1 and 2 * min(job.size for job in to_run) <= len(pool.devices):
            for job in to_run:  # side by side, their bars would share one terminal line
                job.beside_others = True
        _say(f"{len(to_run)} job(s) on {pool.describe()}, side by side")
        returns.update(_Sweep(self, pool).run(to_run))
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return [returns[idx] for idx in sorted(returns)]

    def _job(self, idx: int, overrides: Sequence[str], pool: Any) -> SweepJob:
        from runner.sweeps.slots import slot_size

        assert self.config is not None and self.hydra_context is not None
        job = compose_job(self, idx, overrides)
        job.size = slot_size(job.config.get("nproc", 1), pool)
        return job


class _Sweep:
    """The jobs of one launch: started as slots free up, collected as they end."""

    def __init__(self, launcher: RunnerLauncher, pool: Any):
        from runner.sweeps.slots import Slots

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
                    _say(never_started_line(job.idx for job in queue) or "")
                    queue.clear()
        return self.returns

    def _stop(self, signum: int, _frame: Any) -> None:
        """The sweep is stopped (Ctrl-C, SIGTERM, a SLURM time limit; SIGUSR1, runner's
        graceful stop): each running job gets the signal once (a job is a process group of
        its own) and ends as a run would; no queued job starts; the sweep table is written
        as the sweep ends."""
        if not self.stopping:
            _say(f"{signal.Signals(signum).name}: stopping every running job; no other starts")
            _stopped_by(signum)
        self.stopping = self.launcher.stopped = True
        for _, _, process in self.running.values():
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def _start(self, job: SweepJob, devices: tuple[str, ...]) -> None:
        receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
        process = multiprocessing.get_context("fork").Process(
            target=_job_process,
            args=(send, self.launcher, job, self.pool, devices, self.handlers, os.getpid()),
        )
        process.start()
        send.close()
        self.progress.started()
        from runner.sweeps.job_dirs import shown

        overrides = shown(list(filter_overrides(job.overrides)))
        _say(f"job {job.idx} started on {_kind(self.pool)} {','.join(devices)}: {overrides}")
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
        problem, stopped = _failure(job, result), _stopped(job)
        if problem is not None:
            _say(f"job {job.idx} failed: {problem}")
            if self.launcher.fail_fast and not self.stopping:
                self._fail_fast()
        elif stopped is not None:
            _say(stopped)
        if self.stopping:  # no queued job starts any more
            self.progress.queued = 0
        value = result._return_value
        returned = not (isinstance(value, float) and math.isnan(value))
        self.progress.ended(job.idx, job.dir, returned)
        _say(self.progress.line())

    def _fail_fast(self) -> None:
        self.stopping = self.launcher.stopped = True
        others = [j.idx for j, _, _ in self.running.values()]
        stopping = f" (stopping job(s) {', '.join(map(str, others))})" if others else ""
        _say(f"hydra.launcher.fail_fast=true: the sweep stops{stopping}")
        for _, _, other in self.running.values():
            if other.pid is not None:
                os.kill(other.pid, signal.SIGTERM)


def _job_process(
    send: Any,
    launcher: RunnerLauncher,
    job: SweepJob,
    pool: Any,
    devices: Any,
    handlers: dict,
    sweep_pid: int,
) -> None:
    """The job's own process: its devices and the signal handlers a job of Hydra's own
    launcher would have, then the job as Hydra's launcher runs it."""
    from runner.processes import NO_BAR_ENV, die_with_parent
    from runner.sweeps.slots import job_environment, pin_to_cores

    code = 0
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the sweep, which hands it on once
        # A sweep killed outright (SIGKILL, the OOM killer) still stops its jobs, interrupted,
        # with their summaries: running the command again goes on from their checkpoints.
        die_with_parent(signal.SIGTERM, sweep_pid)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.update(job_environment(pool, devices))
        if job.beside_others:  # the config stays as Hydra composed it
            os.environ[NO_BAR_ENV] = "1"
        pin_to_cores(pool, devices)
        result = run_job(
            hydra_context=launcher.hydra_context,
            task_function=launcher.task_function,
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        if result.status == JobStatus.FAILED:  # an exception: the sweep's to report, as text
            error = result._return_value
            result.status, result._return_value = JobStatus.COMPLETED, math.nan
            result.cfg = job.config
            print(f"runner: job {job.idx}: {describe(error)}", file=sys.stderr)
        send.send(result)
    except BaseException as exc:  # SystemExit included: nothing returns into the sweep
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _progress() -> Any:
    from runner.sweeps.progress import SweepProgress

    return SweepProgress(queued=0)


def _resume_problems(sweep_dir: Path, jobs: list[SweepJob]) -> list[str]:
    from runner.sweeps.resume import not_a_sweep_problem, other_sweep_problem

    problems = [not_a_sweep_problem(sweep_dir)]
    problems += [other_sweep_problem(sweep_dir, j.dir, j.idx, list(j.overrides)) for j in jobs]
    return [p for p in problems if p]


def _resume(jobs: list[SweepJob], rerun_failed: bool, sweep_dir: Path) -> dict[int, JobReturn]:
    """Running the sweep's command again in its directory: the jobs kept as they are (their
    results for the sweeper); the interrupted ones (and failed, when asked) go on from their
    last checkpoint."""
    from runner.sweeps.resume import KEEP, NEW, RESUME, earlier_start, resuming_line

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
    _say(resuming_line(sweep_dir, starts.values()) or "")
    return kept


def _failure(job: SweepJob, result: JobReturn) -> str | None:
    """Why the job failed (its summary's error), or None when it did not: it completed, a
    pruner ended it, or it was stopped (interrupted: _stopped says so)."""
    from runner.rundir.summary import how_it_ended

    value = result._return_value
    if not (isinstance(value, float) and math.isnan(value)):
        return None
    job_dir = job.dir
    ending = how_it_ended(job_dir)
    if not ending.failed:
        return None  # ended without the sweep's metric, or stopped
    return f"{ending.error_line()} ({job_dir})"


def _stopped(job: SweepJob) -> str | None:
    """Where a job stopped before its end (a signal, fail_fast), or None when it did not."""
    from runner.sweeps.progress import stopped_line

    return stopped_line(job.idx, job.dir)


def _stopped_by(signum: int) -> None:
    from runner.sweeps.tables import SweepTable

    SweepTable.stopped_by = SweepTable.stopped_by or signum


def _say(line: str) -> None:
    """The sweep's own lines, on stderr beside the jobs' `runner:` lines."""
    from runner.sweeps.tables import say

    say(line)


def _kind(pool: Any) -> str:
    return "GPU(s)" if pool.kind == "gpu" else "core(s)"
