"""The sweep of `hydra/sweeper=runner`: check the sweep, make its study (or rebuild it from
the sweep directory), go on with the trials an earlier start left unfinished, ask for the
rest, answer the jobs' reports (a pruner), and tell the study how each trial's job ended
(completed: its value; pruned; failed). Job N is trial N.

A trial whose job was interrupted (the sweep stopped or killed) stays unfinished in the
study: running the command again in the sweep directory goes on with it from its last
checkpoint (hydra/launcher=runner's resume).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.rundir.summary import Status, how_it_ended
from runner.spec import RunSpec
from runner.spec.schema import TrialSpec
from runner.sweeps.launched import traits_of
from runner.sweeps.search_space import search_space
from runner.sweeps.study import (
    PRUNERS,
    STUDY_FILE,
    StudyFileDamaged,
    make_pruner,
    read_study_file,
    rebuild_study,
    write_study_file,
)
from runner.sweeps.study_server import ADDRESS_ENV, StudyServer
from runner.sweeps.tables import say

RUNNER_SWEEPER = "hydra_plugins.runner_sweeper.runner_sweeper.RunnerSweeper"
TUNE_LAUNCHER = "hydra_plugins.runner_tune.tune_launcher.TuneLauncher"
CHECK_DIR = ".check"  # the run directory the checks name: never made


def job_trial(sweeper: Any, launcher: Any, job_num: int) -> TrialSpec | None:
    """The trial a sweep's job is: when the sweep's sweeper is runner's and its study answers
    reports (a pruner), or the job is a Ray Tune trial, the address the sweep's process (or the
    trial) gave its environment."""
    address = os.environ.get(ADDRESS_ENV)
    ours = (_target(sweeper) == RUNNER_SWEEPER) or (_target(launcher) == TUNE_LAUNCHER)
    if not ours or not address:
        return None
    return TrialSpec(address=address, number=int(job_num))


def job_spec(config: Any, sweep_dir: Path) -> tuple[RunSpec | None, list[str]]:
    """The run a sweep's composed job config (hydra's part included) resolves to, as the job
    would resolve it (no directory made); or the problems that stop it."""
    import copy

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.spec import SpecError
    from runner.spec.composed import resolve_cfg

    task = copy.deepcopy(config)
    with open_dict(task):
        del task["hydra"]
    earlier = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return resolve_cfg(task, sweep_dir / CHECK_DIR)[0], []
    except SpecError as err:
        return None, err.problems
    finally:
        HydraConfig.instance().cfg = earlier


def _target(node: Any) -> str | None:
    return node.get("_target_") if node is not None else None


def sweep_problems(
    spec: RunSpec, direction: str | None, pruner: dict | None, study_direction: str | None
) -> list[str]:
    """What makes a sweep of runs like `spec` pointless, before its first job."""
    problems = []
    metric = spec.sweep.metric
    if direction is not None and direction.lower() != spec.sweep.direction:
        problems.append(
            f"hydra.sweeper.direction={direction}: each job returns its final {metric} "
            f"(sweep.metric), which is to {spec.sweep.direction} (sweep.direction); leave "
            "hydra.sweeper.direction out (null follows sweep.direction), or set sweep.direction"
        )
    if pruner and not metric.startswith("val/"):
        valid = ", ".join(["val/loss", *(f"val/{name}" for name in spec.metrics)])
        problems.append(
            f"hydra/sweeper/pruner={pruner.get('name')}: a pruner reads sweep.metric at each "
            f"evaluation, which reports val/ values only; sweep.metric={metric} is not one "
            f"(valid: {valid})"
        )
    if pruner and pruner.get("name") not in PRUNERS:
        problems.append(
            f"hydra.sweeper.pruner.name={pruner.get('name')}: valid: {', '.join(PRUNERS)}"
        )
    wanted = (direction or spec.sweep.direction).lower()
    if study_direction is not None and study_direction != wanted:
        problems.append(
            f"hydra.sweep.dir: its study ({STUDY_FILE}) is to {study_direction} "
            f"{metric}, this sweep's to {wanted}; resume a sweep with its own command, or "
            "pick another hydra.sweep.dir"
        )
    return problems


@dataclass
class Ended:
    """How a trial's job ended, for the study."""

    state: str  # "complete", "pruned", "fail", or "unfinished" (interrupted: goes on later)
    value: float = math.nan


def job_ended(job_dir: Path | None, returned: Any) -> Ended:
    """From the job's summary.json (and the value it returned to the sweeper)."""
    status = how_it_ended(job_dir).status if job_dir else None
    if status == Status.PRUNED:
        return Ended("pruned")
    if status == Status.INTERRUPTED:
        return Ended("unfinished")
    value = returned if isinstance(returned, int | float) else math.nan
    if status == Status.COMPLETED and not math.isnan(value):
        return Ended("complete", float(value))
    return Ended("fail")


def kept_study(sweep_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The study an earlier start kept in `sweep_dir`, and why it cannot go on: its file
    damaged, or gone while the sweep's jobs are there (trials would be drawn anew over them)."""
    from runner.sweeps.job_dirs import job_dirs

    try:
        kept = read_study_file(sweep_dir)
    except StudyFileDamaged as exc:
        return None, [f"hydra.sweep.dir={sweep_dir}: {exc}; restore it, or pick another "
                      "hydra.sweep.dir"]  # fmt: skip
    if kept is None and sweep_dir.is_dir() and job_dirs(sweep_dir):
        return None, [
            f"hydra.sweep.dir={sweep_dir} holds a study's jobs but no {STUDY_FILE}: its "
            "trials cannot go on; restore it, or pick another hydra.sweep.dir"
        ]
    return kept, []


class StudySweep:
    def __init__(self, sweeper: Any, sweep_dir: Path):
        self.sweeper = sweeper
        self.sweep_dir = sweep_dir
        self.launcher = sweeper.launcher
        self.lock = threading.Lock()  # the study: the sweep's thread and the report server's
        self.trials: dict[int, Any] = {}  # number -> Optuna's Trial, while its job runs
        self.study: Any = None

    def run(self, arguments: list[str]) -> None:
        logging.getLogger("alembic").setLevel(logging.WARNING)  # Optuna imports it: quiet
        import optuna

        from runner.sweeps.tables import refuse_sweep

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        distributions, fixed = search_space(arguments)
        for name in fixed:
            distributions.pop(name, None)
        fixed_overrides = _fixed_overrides(arguments)
        spec, problems = self._first_spec(fixed_overrides)
        kept, damaged = kept_study(self.sweep_dir)
        problems += damaged + self._launcher_problems(kept)
        if spec is not None:
            problems += sweep_problems(
                spec, self.sweeper.direction, self.sweeper.pruner, kept and kept["direction"]
            )
        if problems:
            refuse_sweep(problems, self.sweep_dir)
        assert spec is not None
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.study = optuna.create_study(
            sampler=self._sampler(distributions),
            pruner=make_pruner(self.sweeper.pruner),
            direction=(self.sweeper.direction or spec.sweep.direction).lower(),
        )
        waiting = rebuild_study(self.study, kept) if kept else []
        if kept:
            ended = len(kept["trials"]) - len(waiting)
            say(
                f"going on with the study in {self.sweep_dir}: {ended} trial(s) ended, "
                f"{len(waiting)} to go on from where they stopped"
            )
        server = StudyServer(self._report) if self.sweeper.pruner else None
        if server is not None:
            server.start()
        try:
            if not self._go_on(waiting, distributions, fixed_overrides):
                self._ask_the_rest(distributions, fixed_overrides)
        finally:
            if server is not None:
                server.close()
        self._write_results()

    def _launcher_problems(self, kept: dict[str, Any] | None) -> list[str]:
        """What the sweep's launcher cannot do that this sweep asks of it."""
        problems = []
        traits = traits_of(self.launcher)
        unfinished = [
            t for t in (kept or {}).get("trials", []) if t["state"] in ("RUNNING", "WAITING")
        ]
        if unfinished and not traits.goes_on_with_trials:
            problems.append(
                f"hydra.sweep.dir={self.sweep_dir}: {len(unfinished)} trial(s) of its study were "
                "interrupted; going on with them takes hydra/launcher=runner"
            )
        if self.sweeper.pruner and traits.reports_elsewhere:
            problems.append(
                f"hydra/sweeper/pruner={self.sweeper.pruner['name']}: "
                f"{traits.reports_elsewhere}, or drop the pruner"
            )
        return problems

    def _first_spec(self, overrides: list[str]) -> tuple[RunSpec | None, list[str]]:
        """The run the sweep's fixed overrides make (no searched value): what the checks
        read, as a job would resolve it."""
        loader = self.sweeper.hydra_context.config_loader  # as the launcher composes a job's
        config = loader.load_sweep_config(self.sweeper.config, list(overrides))
        return job_spec(config, self.sweep_dir)

    def _sampler(self, distributions: dict) -> Any:
        sampler = self.sweeper.sampler
        if isinstance(sampler, functools.partial):  # the grid sampler: told its grid
            return sampler({name: list(d.choices) for name, d in distributions.items()})
        return sampler

    def _go_on(self, waiting: list[int], distributions: dict, fixed_overrides: list[str]) -> bool:
        """The trials an earlier start left unfinished, under their own numbers: each job goes
        on from its last checkpoint (or is kept, when it ended after the study last heard);
        whether the sweep was stopped meanwhile."""
        for run in _consecutive(waiting, self.sweeper.n_jobs):
            trials = self._ask(len(run), distributions)
            assert [t.number for t in trials] == run, "the study lost its trials' numbers"
            if self._launch(trials, [self._overrides_of(t, fixed_overrides) for t in trials]):
                return True
        return False

    def _ask_the_rest(self, distributions: dict, fixed_overrides: list[str]) -> None:
        to_go = self.sweeper.n_trials - len(self.study.trials)
        while to_go > 0:
            trials = self._ask(min(to_go, self.sweeper.n_jobs), distributions)
            if self._launch(trials, [self._overrides_of(t, fixed_overrides) for t in trials]):
                return
            to_go -= len(trials)

    def _ask(self, count: int, distributions: dict) -> list[Any]:
        with self.lock:
            trials = [self.study.ask(distributions) for _ in range(count)]
            write_study_file(self.sweep_dir, self.study, self.sweeper.study_name)
        return trials

    def _overrides_of(self, trial: Any, fixed_overrides: list[str]) -> list[str]:
        """A trial's overrides as its job first ran them (its .hydra/overrides.yaml), else its
        sampled values, then the fixed ones."""
        from runner.sweeps.job_dirs import overrides_of

        job_dir = self.sweep_dir / str(trial.number)
        if (job_dir / ".hydra" / "overrides.yaml").is_file():
            return overrides_of(job_dir)
        return [*(f"{name}={value}" for name, value in trial.params.items()), *fixed_overrides]

    def _launch(self, trials: list[Any], overrides: list[list[str]]) -> bool:
        """Run the trials' jobs (job N = trial N) and tell the study how each ended; whether
        the sweep was stopped meanwhile."""
        import optuna

        self.trials.update({t.number: t for t in trials})
        returns = self.launcher.launch(overrides, initial_job_idx=trials[0].number)
        with self.lock:
            for trial, returned in zip(trials, returns, strict=True):
                del self.trials[trial.number]
                ended = job_ended(_job_dir(returned), _value(returned))
                if ended.state == "complete":
                    self.study.tell(trial.number, ended.value)
                elif ended.state == "pruned":
                    self.study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
                elif ended.state == "fail":
                    self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            write_study_file(self.sweep_dir, self.study, self.sweeper.study_name)
        return bool(getattr(self.launcher, "stopped", False))

    def _report(self, number: int, step: int, value: float) -> bool:
        """A job's rank 0 reported `value` at `step` (the report server's thread): whether the
        pruner stops the trial there."""
        with self.lock:
            trial = self.trials.get(number)
            if trial is None:
                return False  # not a running trial of this sweep
            trial.report(value, step)
            prune = bool(trial.should_prune())
            write_study_file(self.sweep_dir, self.study, self.sweeper.study_name)
        return prune

    def _write_results(self) -> None:
        """optimization_results.yaml, as Hydra's Optuna sweeper writes it, and the counts."""
        import optuna
        from omegaconf import OmegaConf

        states = [t.state for t in self.study.trials]
        results: dict[str, Any] = {"name": "optuna"}
        results["trials"] = {
            s.name.lower(): states.count(s) for s in optuna.trial.TrialState if states.count(s)
        }
        if optuna.trial.TrialState.COMPLETE in states:
            best = self.study.best_trial
            results.update(best_params=best.params, best_value=best.value, best_trial=best.number)
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")


def _fixed_overrides(arguments: list[str]) -> list[str]:
    """The overrides that sweep nothing, as the command gave them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(arguments)
    return [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line]


def _consecutive(numbers: list[int], size: int) -> list[list[int]]:
    """`numbers` (sorted) cut into runs of consecutive numbers of at most `size` each."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and runs[-1][-1] == number - 1 and len(runs[-1]) < size:
            runs[-1].append(number)
        else:
            runs.append([number])
    return runs


def _job_dir(returned: Any) -> Path | None:
    hydra_cfg = getattr(returned, "hydra_cfg", None)
    if hydra_cfg is not None:
        return Path(str(hydra_cfg.hydra.runtime.output_dir))
    working_dir = getattr(returned, "working_dir", None)
    return Path(working_dir) if working_dir else None


def _value(returned: Any) -> Any:
    try:
        return returned.return_value
    except Exception:  # a job's exception, which JobReturn raises again
        return math.nan
