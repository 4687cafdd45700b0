"""The `runner` command: stages 1-4 and 9 of a run, in the parent process.

    compose (Hydra) -> resolve (RunSpec, every check) -> file (config.yaml, env.json)
    -> launch (agent process, ranks) -> outcome (summary.json, exit code)

The parent never imports torch: `--help`, `--cfg job` and config errors are instant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.cli.command_line import COMMAND_LINE_ENV, hydra_argv
from runner.cli.compose_errors import composition_problems, with_origins
from runner.cli.conf_files import conf_dir
from runner.cli.hydra_files import write_hydra_files
from runner.cli.layout_plan import (
    PLAN_FILE,
    apply_layout,
    chosen_row,
    make_plan,
    over_budget,
    plan_table,
    planned_before,
    wants_plan,
    write_plan,
)
from runner.cli.other_node import run_other_node
from runner.cli.outcome import report_outcome, shown
from runner.cli.plan_trials import TRIALS_DIR
from runner.cli.requeue import continue_after_stop, first_run_dir
from runner.cli.resume_point import resume_problems
from runner.cli.run_files import discard, discard_rejected, file_run, scrub_hydra_files
from runner.cli.supervise import run_agent
from runner.processes import add_code_dirs, exit_code_for_signal, keep_extensions_in_environment
from runner.rundir.files import RunDir, holds_a_run
from runner.rundir.summary import Status, read_summary, write_unfinished_summary
from runner.secrets import SECRETS_ENV, Secrets
from runner.spec import RunSpec, SpecError, slurm
from runner.spec.composed import problems_text, resolve_cfg
from runner.sweeps.job import (
    earlier_start_of_job,
    one_job_at_a_time,
    quiet_beside_others,
    stop_sweep,
)
from runner.sweeps.tables import SweepTable, sweeper_problem, write_sweep_table
from runner.trackers.finish import finish_trackers

log = logging.getLogger("runner")
INVALID_CONFIG = 2  # exit code of a configuration rejected before any rank started


def _this_start(hydra_cfg: Any) -> tuple[RunDir, bool]:
    """The run directory this start writes to, and whether SLURM requeued the job: a
    requeued job goes on with the run its first start began."""
    run_dir = RunDir(Path(hydra_cfg.runtime.output_dir))
    requeued = slurm.requeued(os.environ)
    if requeued:
        first = first_run_dir(run_dir.root)
        if first != run_dir.root:
            discard(run_dir.root)  # holds only Hydra's files of this start
            run_dir = RunDir(first)
            log.info("runner: SLURM job restarted; continuing the run in %s", shown(first))
    return run_dir, requeued


def _never_started(
    problems: list[str], cfg: DictConfig, run_dir: RunDir, hydra_cfg: Any, start_time: float
) -> float:
    """An invalid configuration: exit 2, or, in a sweep, a failed job whose directory says
    why it never started (the sweep goes on). A directory that holds a run already is left
    as it is."""
    log.error("%s", problems_text(problems))
    if hydra_cfg.mode != RunMode.MULTIRUN:
        discard(run_dir.root, frozenset({".hydra", TRIALS_DIR}))  # a plan's trials at most
        sys.exit(INVALID_CONFIG)
    if holds_a_run(run_dir.root):
        return math.nan
    write_hydra_files(cfg, run_dir.root)
    message = "invalid configuration: " + "; ".join(problems)
    error = {"rank": None, "exitcode": INVALID_CONFIG, "message": message}
    write_unfinished_summary(run_dir, Status.FAILED, 0, start_time, error)
    _update_sweep_table(hydra_cfg)
    return math.nan


def _run(cfg: DictConfig) -> float | None:
    start_time = time.time()
    hydra_cfg = HydraConfig.get()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir, requeued = _this_start(hydra_cfg)
    if in_sweep and not requeued:
        kept = earlier_start_of_job(cfg, run_dir.root, hydra_cfg)
        if kept is not None:
            return kept
        quiet_beside_others(cfg, hydra_cfg)
    try:
        plan = _plan_layout(cfg, run_dir.root, requeued) if wants_plan(cfg) else None
        if plan is not None and plan.get("trials"):
            start_time = time.time()  # the trials' time is theirs, not the run's
        spec, secrets = resolve_cfg(cfg, run_dir.root, requeued)
    except SpecError as err:
        from runner.cli.interrupts import interrupted

        if not interrupted():  # else a refusal that the interruption caused: it is that
            return _never_started(err.problems, cfg, run_dir, hydra_cfg, start_time)
        discard(run_dir.root, frozenset({".hydra", TRIALS_DIR}))
        raise KeyboardInterrupt from None
    except BaseException:  # interrupted while it planned: a directory with nothing of a run
        discard(run_dir.root, frozenset({".hydra", TRIALS_DIR}))  # (its trials at most) goes
        raise
    damaged = resume_problems(spec, run_dir.root)  # reads the checkpoint it resumes from
    if damaged:
        return _never_started(damaged, cfg, run_dir, hydra_cfg, start_time)

    if in_sweep:
        spec = _sweep_job(spec, hydra_cfg, run_dir)
    add_code_dirs([os.getcwd(), *spec.code_dir])
    sweep_dir = Path(hydra_cfg.sweep.dir) if in_sweep else None
    write_hydra_files(cfg, run_dir.root, spec.node_rank)  # accepted: Hydra's record of it
    scrub_hydra_files(secrets, run_dir.root, sweep_dir, spec.node_rank)
    os.environ[SECRETS_ENV] = secrets.environment()  # for every process started from here
    if spec.node_rank > 0:
        return run_other_node(spec, secrets, run_dir, start_time)
    file_run(spec, secrets, run_dir, sweep_dir)
    if plan is not None:
        write_plan(run_dir.root, plan)
    return _launch(spec, secrets, run_dir, hydra_cfg, start_time)


def _plan_layout(cfg: DictConfig, run_dir: Path, requeued: bool) -> dict[str, Any]:
    """parallelism=auto: plan the layout (runner.cli.layout_plan), say it, and give `cfg`
    the chosen layout's keys. A run that goes on in its directory (resume, a SLURM requeue)
    keeps the layout it was planned with (its plan.json), whatever a new plan would say."""
    kept = planned_before(run_dir) if cfg.resume is not None or requeued else None
    world = _world_given(cfg)
    if kept is not None and world not in (None, kept["world_size"]):
        log.info(
            "runner: parallelism=auto: the layout planned at the start was for %s rank(s); "
            "planning again for %s", kept["world_size"], world,
        )  # fmt: skip
        kept = None
    if kept is not None:
        log.info(
            "runner: parallelism=auto: going on with the layout planned at the start: %s",
            kept["chosen"],
        )
        apply_layout(cfg, chosen_row(kept)["overrides"], conf_dir())
        return kept
    plan = make_plan(cfg, conf_dir(), run_dir)
    log.info("%s", plan_table(plan))
    from runner.cli.plan_trials import check_pick, needs_check, run_trials

    if cfg.plan.trials:
        plan = run_trials(cfg, plan, run_dir, conf_dir())
        log.info("%s", plan_table(plan))
    elif needs_check(cfg, plan):
        plan = check_pick(cfg, plan, run_dir, conf_dir())
        if plan["trials"]:
            log.info("%s", plan_table(plan))
    apply_layout(cfg, chosen_row(plan)["overrides"], conf_dir())
    return plan


def _world_given(cfg: DictConfig) -> int | None:
    """nproc x nodes where both are numbers (not auto)."""
    try:
        return int(cfg.nproc) * int(cfg.nodes)
    except (TypeError, ValueError):
        return None


def _launch(
    spec: RunSpec, secrets: Secrets, run_dir: RunDir, hydra_cfg: Any, start_time: float
) -> float | None:
    """The agent's launch of the filed run, and its outcome: the run's exit code, or a
    sweep's job's value for the sweeper."""
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    end = run_agent(run_dir.root, start_time, secrets.environment())
    summary = _summary_after(end, spec, run_dir, start_time)
    rejected = (summary.get("error") or {}).get("problems")
    if rejected and end.code == INVALID_CONFIG:  # the agent's check of the components:
        log.error("%s", problems_text(with_origins(rejected, sys.argv[1:])))  # as resolve's
        if not in_sweep:
            discard_rejected(run_dir)
            sys.exit(INVALID_CONFIG)
        _update_sweep_table(hydra_cfg)
        return math.nan
    report_outcome(summary, run_dir)
    _said_over_budget(run_dir, summary)
    finish_trackers(spec, run_dir, summary)
    if end.asked and summary.get("stopped"):  # a graceful stop: SLURM's job comes back
        continue_after_stop(end.asked, end.asked_handler, 0, summary["stopped"]["after_step"])
    if not in_sweep:  # the exit code says how the run ended, whatever came after
        code = 0 if summary.get("status") == Status.COMPLETED else end.code
        return sys.exit(code) if code else None
    _update_sweep_table(hydra_cfg)
    if end.received and one_job_at_a_time(hydra_cfg):
        stop_sweep(hydra_cfg, end.received)
    # The job's value for sweepers such as Optuna (which maximise or minimise it); NaN marks
    # a job that failed, which Optuna records as a failed trial.
    return summary.get("final", {}).get(spec.sweep.metric, math.nan)


def _said_over_budget(run_dir: RunDir, summary: dict[str, Any]) -> None:
    """A run parallelism=auto planned that used more than its budget says so (its check
    measured its first steps only; a CPU rank's memory can grow after them)."""
    planned = planned_before(run_dir.root) if (run_dir.root / PLAN_FILE).is_file() else None
    said = over_budget(planned, summary) if planned else None
    if said:
        log.warning("%s", said)


def _sweep_job(spec: RunSpec, hydra_cfg: Any, run_dir: RunDir) -> RunSpec:
    """A sweep's job: its trial (`_with_trial`); a sweep whose sweeper would score every job
    the wrong way round stops here, its directories removed."""
    spec = _with_trial(spec, hydra_cfg)
    wrong_direction = sweeper_problem(hydra_cfg.sweeper, spec)
    if wrong_direction:  # every job would be scored the wrong way round: stop the sweep
        log.error("%s", problems_text([wrong_direction]))
        discard(run_dir.root)
        discard(Path(hydra_cfg.sweep.dir), frozenset({"multirun.yaml"}))
        sys.exit(INVALID_CONFIG)
    return spec


def _with_trial(spec: RunSpec, hydra_cfg: Any) -> RunSpec:
    """A job of hydra/sweeper=runner is a trial of its study, a job of hydra/launcher=tune a
    Tune trial: rank 0 reports to it."""
    from runner.sweeps.study_sweep import job_trial

    trial = job_trial(hydra_cfg.sweeper, hydra_cfg.launcher, hydra_cfg.job.num)
    if trial is None:
        return spec
    return dataclasses.replace(spec, sweep=dataclasses.replace(spec.sweep, trial=trial))


def _summary_after(end: Any, spec: RunSpec, run_dir: RunDir, start_time: float) -> dict:
    """summary.json once the agent has ended; written here if the agent died first."""
    summary = read_summary(run_dir)
    if summary is not None:
        return summary
    if end.received:  # stopped before the agent could say so (not started, or killed)
        name = signal.Signals(end.received).name
        steps = {} if end.reached is None else {"steps": end.reached}
        return write_unfinished_summary(
            run_dir, Status.INTERRUPTED, spec.world_size, start_time, None, signal=name, **steps
        )
    message = f"launcher exited with {end.code}"
    error = {"rank": None, "exitcode": end.code, "message": message}
    return write_unfinished_summary(run_dir, Status.FAILED, spec.world_size, start_time, error)


def _update_sweep_table(hydra_cfg: Any) -> None:
    try:
        write_sweep_table(Path(hydra_cfg.sweep.dir))
    except OSError as exc:  # the table is a convenience; never fail a finished job over it
        log.warning("runner: could not update the sweep table: %s", exc)


def main() -> None:
    """Console entry point: `runner [overrides]`, `runner rerun RUN_DIR [overrides]`,
    `runner eval SOURCE [overrides]` (runner.cli.evaluate), `runner prepare [overrides]`
    (runner.cli.prepare) or `runner k8s-manifest --image IMAGE [overrides]`
    (runner.cli.k8s_manifest)."""
    keep_extensions_in_environment()  # `python -m runner.cli.main`: the agent inherits it
    sys.argv, task = hydra_argv(sys.argv)
    os.environ[COMMAND_LINE_ENV] = json.dumps(sys.argv)  # for jobs that submitit starts
    app = hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")(task or _run)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # Optuna's storage: 7 lines at INFO
    user_wants_hydra_errors = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra prints composition errors itself and exits 1, unless HYDRA_FULL_ERROR asks it to
    # raise them; then they are ours to report like any other bad value.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except ValueError as exc:  # Hydra's own check of the command-line flags
        if not str(exc).startswith("Only one of"):
            raise
        print(f"runner: {exc} (to see a sweep job's config, leave out -m)", file=sys.stderr)
        sys.exit(2)
    except HydraException as exc:
        if user_wants_hydra_errors:
            raise
        from runner.cli.interrupts import interrupted

        if interrupted():  # Ctrl-C cut Hydra's code short, which raised its own error
            raise KeyboardInterrupt from None
        print(problems_text(composition_problems(exc, sys.argv[1:], conf_dir())), file=sys.stderr)
        if SweepTable.sweep_dir is not None:  # a sweep whose jobs could not be composed
            discard(SweepTable.sweep_dir, frozenset({"multirun.yaml"}))
        sys.exit(2)
    finally:
        if not user_wants_hydra_errors:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    if SweepTable.stopped_by is not None:  # a sweep stopped by a signal: as a run would
        sys.exit(exit_code_for_signal(SweepTable.stopped_by))
    if SweepTable.failed:  # a sweep ran every job; its exit code says whether all completed
        sys.exit(1)


if __name__ == "__main__":
    main()
