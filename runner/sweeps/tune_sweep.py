"""hydra/launcher=tune: a sweep's jobs as Ray Tune trials on a Ray cluster.

The sweep's process connects to the cluster (hydra.launcher.address, else RAY_ADDRESS, else
a local cluster it starts and stops) and fits one Tuner over the jobs of each launch: a
trial per job, asking for the job's resources (its ranks' GPUs where the cluster has GPUs,
else a CPU per rank, unless hydra.launcher.cpus_per_trial / gpus_per_trial say otherwise),
scheduled FIFO or by ASHA (hydra.launcher.scheduler=asha) on `sweep.metric` after every
evaluation (runner.sweeps.tune_trial). Each job runs on the node of its trial, in the sweep
directory, which every node must see (a shared file system).

Running the same command again with hydra.sweep.dir finishes the sweep as with
hydra/launcher=runner: completed and pruned jobs are kept (their evaluations replayed to the
scheduler), interrupted ones go on from their last checkpoint (resume=auto), failed ones
rerun when asked (hydra.launcher.rerun_failed). A signal (Ctrl-C, SIGTERM) stops every
running trial with a checkpoint; fail_fast stops the sweep at the first failed job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.sweeps import ray_cluster
from runner.sweeps.launched import (
    SweepJob,
    compose_job,
    job_return,
    never_started_line,
    stopping_on_signals,
)
from runner.sweeps.tables import refuse_sweep, say

EXPERIMENT_DIR = "tune"  # in the sweep directory: Tune's own files, a folder per launch
STOP_FILE = "STOP"  # in the launch's folder: the whole sweep stops (trials read it)
SCHEDULERS = ("asha",)
PASSED_ENV_PREFIXES = ("RUNNER_", "PYTHONPATH", "HF_", "WANDB_", "MLFLOW_")


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """Run one launch's jobs as trials; their JobReturns, in job order."""
    from hydra.core.utils import configure_log, setup_globals

    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    jobs = [compose_job(launcher, initial_job_idx + i, o) for i, o in enumerate(job_overrides)]
    if not jobs:
        return []
    from runner.sweeps.study_sweep import job_spec

    spec, problems = job_spec(jobs[0].config, sweep_dir)  # the first job, as it will resolve
    if spec is not None:
        problems = config_problems(launcher, spec, jobs, sweep_dir)
    if problems:
        refuse_sweep(problems, sweep_dir)
    import ray

    started = ray_cluster.connect(ray, launcher, say)
    try:
        problems = ray_cluster.resource_problems(
            ray_cluster.largest_node(ray), launcher, [job.nproc for job in jobs]
        )
        if problems:
            refuse_sweep(problems, sweep_dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        experiment = sweep_dir / EXPERIMENT_DIR / f"launch-{initial_job_idx}"
        return _Tune(launcher, spec, jobs, experiment).fit()
    finally:
        ray_cluster.disconnect(ray, started)


def config_problems(launcher: Any, spec: Any, jobs: list[SweepJob], sweep_dir: Path) -> list[str]:
    """What makes the sweep's trials pointless, before Ray starts."""
    from runner.sweeps.resume import not_a_sweep_problem, other_sweep_problem
    from runner.sweeps.slots import multi_node_problems

    problems = [p for p in [not_a_sweep_problem(sweep_dir)] if p]
    for job in jobs:
        problem = other_sweep_problem(sweep_dir, job.dir, job.idx, list(job.overrides))
        problems += [problem] if problem else []
    nodes = multi_node_problems([job.config.get("nodes", 1) for job in jobs])
    problems += [p.replace("hydra/launcher=runner runs each job on this node",
                           "hydra/launcher=tune runs each job on the node of its trial")
                 for p in nodes]  # fmt: skip
    if spec.launcher.name != "elastic":
        problems.append(
            f"launcher={spec.launcher.name}: hydra/launcher=tune runs each job's ranks on the node "
            "Ray Tune placed its trial (launcher=elastic); leave launcher out"
        )
    scheduler = launcher.scheduler
    if scheduler is not None and scheduler not in SCHEDULERS:
        problems.append(
            f"hydra.launcher.scheduler={scheduler}: not a scheduler; valid: null (first in, "
            f"first out), {', '.join(SCHEDULERS)}"
        )
    metric = spec.sweep.metric
    if scheduler is not None and not metric.startswith("val/"):
        valid = ", ".join(["val/loss", *(f"val/{name}" for name in spec.metrics)])
        problems.append(
            f"hydra.launcher.scheduler={scheduler}: a scheduler reads sweep.metric at each "
            f"evaluation, which reports val/ values only; sweep.metric={metric} is not one "
            f"(valid: {valid})"
        )
    return problems


class SweepStop:
    """The whole sweep stops (a signal, fail_fast): a file its trials read, and a flag."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.stopped = False

    def __call__(self, why: str, signum: int = signal.SIGTERM) -> None:
        """Stop: each running job gets `signum` (once; SIGUSR1 is runner's graceful stop)."""
        if not self.stopped:
            say(why)
            with contextlib.suppress(OSError):
                self.stop_file.write_text(f"{int(signum)}\n")
        self.stopped = True

    def on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        self(f"{name}: stopping every running trial; no other starts", signum)


class _Tune:
    def __init__(self, launcher: Any, spec: Any, jobs: list[SweepJob], experiment: Path):
        self.launcher = launcher
        self.spec = spec  # the first job's, resolved
        self.jobs = jobs
        self.experiment = experiment
        self.jobs_by_idx = {job.idx: job for job in jobs}
        self.metric = spec.sweep.metric
        self.direction = spec.sweep.direction

    def fit(self) -> list:
        import shutil

        from runner.sweeps.tune_trial import SweepLines

        shutil.rmtree(self.experiment, ignore_errors=True)  # an earlier start's: rebuilt
        self.experiment.mkdir(parents=True)
        plans = self._plans()
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # the sweep's own, below
        os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # a failed job has no value
        os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: runner's lines only
        stop = SweepStop(self.experiment / STOP_FILE)
        shown = {
            idx: (job.dir, _shown(self.jobs_by_idx[idx].overrides), job.kept)
            for idx, job in plans.items()
        }
        lines = SweepLines(shown, self.launcher.fail_fast, stop)
        tuner = self._tuner(plans, lines)
        kept = sum(job.kept for job in plans.values())
        replayed = f"; {kept} kept as they ended, replayed to the scheduler" if kept else ""
        say(f"{len(plans) - kept} job(s) as Ray Tune trials ({self._describe()}){replayed}")
        with stopping_on_signals(stop.on_signal):
            tuner.fit()
        self.launcher.stopped = stop.stopped
        never = never_started_line(lines.never_started - {i for i, j in plans.items() if j.kept})
        if never:
            say(never)
        return [self._returned(job) for job in self.jobs if _ran(job.dir)]

    def _tuner(self, plans: dict[int, Any], lines: Any) -> Any:
        """A Tuner with a trial per job, each asking for its job's resources."""
        import ray
        from ray import tune

        from runner.sweeps.tune_trial import JobTrainable

        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        asks = {
            job.idx: {
                "cpu": ray_cluster.trial_cpus(self.launcher, job.nproc, has_gpus),
                "gpu": ray_cluster.trial_gpus(self.launcher, job.nproc, has_gpus),
            }
            for job in self.jobs
        }
        trainable = tune.with_resources(
            tune.with_parameters(JobTrainable, jobs=plans), lambda config: asks[config["job"]]
        )
        return tune.Tuner(
            trainable,
            param_space={"job": tune.grid_search(sorted(plans))},
            tune_config=tune.TuneConfig(
                metric=self.metric,
                mode="max" if self.direction == "maximize" else "min",
                scheduler=self._scheduler(plans),
                max_concurrent_trials=self.launcher.max_concurrent_trials,
                reuse_actors=False,
            ),
            run_config=tune.RunConfig(
                name=self.experiment.name,
                storage_path=str(self.experiment.parent.resolve()),
                callbacks=[lines],
                failure_config=tune.FailureConfig(max_failures=0),
                verbose=0,
            ),
        )

    def _plans(self) -> dict[int, Any]:
        """Each job's part for its trial; an earlier start's jobs kept or going on."""
        from omegaconf import open_dict

        from runner.sweeps.resume import KEEP, RESUME, earlier_start, resuming_line
        from runner.sweeps.tune_trial import TrialBrief

        starts = {job.idx: earlier_start(job.dir, self.launcher.rerun_failed) for job in self.jobs}
        line = resuming_line(self.jobs[0].dir.parent, starts.values())
        if line:
            say(line)
        env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)}
        experiment = self.experiment.resolve()
        plans = {}
        for job in self.jobs:
            action = starts[job.idx].action
            if action == RESUME:
                with open_dict(job.config):
                    job.config.resume = "auto"
            pickled = b""
            if action != KEEP:
                context = (self.launcher.hydra_context, self.launcher.task_function, job.config)
                pickled = pickle.dumps(context)
            cpus = ray_cluster.trial_cpus(self.launcher, job.nproc, False)
            plans[job.idx] = TrialBrief(
                idx=job.idx,
                dir=str(job.dir.resolve()),
                metric=self.metric,
                kept=action == KEEP,
                threads=max(1, int(cpus) // job.nproc),
                cwd=os.getcwd(),
                stop_file=str(experiment / STOP_FILE),
                prune_file=str(experiment / f"prune-{job.idx}"),
                pickled=pickled,
                env=env,
            )
        return plans

    def _scheduler(self, plans: dict[int, Any]) -> Any:
        if self.launcher.scheduler != "asha":
            return None
        from runner.sweeps.tune_trial import PruningASHA

        return PruningASHA(
            {idx: job.prune_file for idx, job in plans.items()},
            time_attr="step",
            max_t=self._max_t(),
            grace_period=self._grace_period(),
            reduction_factor=self.launcher.reduction_factor,
        )

    def _max_t(self) -> int:
        """The steps of the longest job (max_steps), else a bound no run reaches."""
        steps = [job.config.get("max_steps") for job in self.jobs] + [self.spec.max_steps]
        steps = [s for s in steps if isinstance(s, int)]
        return self.launcher.max_t or (max(steps) if steps else 2**31)

    def _grace_period(self) -> int:
        """Steps before the scheduler may stop a trial: hydra.launcher.grace_period, else the
        first evaluation's step."""
        if self.launcher.grace_period is not None:
            return int(self.launcher.grace_period)
        interval = self.spec.eval_interval
        return interval if isinstance(interval, int) else 1

    def _describe(self) -> str:
        scheduler = self.launcher.scheduler
        if scheduler is None:
            return "first in, first out"
        return (
            f"{scheduler} on {self.metric}: grace period {self._grace_period()} steps, "
            f"reduction factor {self.launcher.reduction_factor}"
        )

    def _returned(self, job: SweepJob) -> Any:
        """The job's JobReturn for the sweeper: its final value of sweep.metric (NaN when it
        has none: its summary says how it ended)."""
        from runner.sweeps.resume import earlier_start

        return job_return(job, earlier_start(job.dir, rerun_failed=False).value)


def _shown(overrides: Sequence[str]) -> str:
    from hydra.core.utils import filter_overrides

    return " ".join(filter_overrides(overrides))


def _ran(job_dir: Path) -> bool:
    return (job_dir / ".hydra" / "overrides.yaml").is_file()
