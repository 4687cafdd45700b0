"""The `runner` command: stages 1-4 and 9 of a run, in the parent process.

    compose (Hydra) -> resolve (RunSpec, every check) -> file (config.yaml, env.json)
    -> launch (agent process, ranks) -> outcome (summary.json, exit code)

The parent never imports torch: `--help`, `--cfg job` and config errors are instant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.cli.compose_errors import composition_problems, with_origins
from runner.cli.conf_files import conf_dir
from runner.cli.evaluate import eval_argv
from runner.cli.hydra_files import hydra_subdir, write_hydra_files
from runner.cli.k8s_manifest import manifest_argv, manifest_task
from runner.cli.outcome import report_outcome, shown
from runner.cli.prepare import prepare_argv, prepare_task
from runner.cli.requeue import continue_after_stop, first_run_dir
from runner.cli.rerun import rerun_argv
from runner.cli.resume_point import resume_problems
from runner.cli.supervise import run_agent
from runner.processes import add_code_dirs, exit_code_for_signal, keep_extensions_in_environment
from runner.rundir.files import RunDir, environment_info, holds_a_run, read_json, write_json
from runner.rundir.summary import (
    Status,
    archive_previous,
    read_summary,
    write_unfinished_summary,
)
from runner.rundir.tracker_runs import SWEEP_DIR_ENV
from runner.secrets import SECRETS_ENV, Secrets, hide_literal_secrets
from runner.spec import RunSpec, SpecError, save_spec, slurm
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


def _discard(run_dir: Path, hydra_files: frozenset[str] = frozenset({".hydra"})) -> None:
    """Remove the directory Hydra made for a run or sweep that never started (only Hydra's
    files in it)."""
    for node_dir in run_dir.glob("node*"):  # another node's Hydra files (hydra_files.hydra_subdir)
        if {p.name for p in node_dir.iterdir()} <= {".hydra"}:
            shutil.rmtree(node_dir, ignore_errors=True)
    leftovers = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if leftovers <= hydra_files:
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.parent.resolve() == (Path.cwd() / "runs").resolve():
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()  # the default runs/ itself, if this was its only run


def _discard_rejected(run_dir: RunDir) -> None:
    """A launch the agent rejected before any rank started: remove what it wrote, and the
    directory itself when it held nothing before (a resumed run keeps its directory)."""
    earlier = (run_dir.checkpoints, run_dir.metrics, run_dir.logs / "previous_summary.json")
    if any(p.exists() for p in earlier):
        return
    for path in (run_dir.config, run_dir.env, run_dir.summary):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.logs.rmdir()  # empty: no rank wrote a log
    _discard(run_dir.root)


def _this_start(hydra_cfg: Any) -> tuple[RunDir, bool]:
    """The run directory this start writes to, and whether SLURM requeued the job: a
    requeued job goes on with the run its first start began."""
    run_dir = RunDir(Path(hydra_cfg.runtime.output_dir))
    requeued = slurm.requeued(os.environ)
    if requeued:
        first = first_run_dir(run_dir.root)
        if first != run_dir.root:
            _discard(run_dir.root)  # holds only Hydra's files of this start
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
        _discard(run_dir.root)
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
        spec, secrets = resolve_cfg(cfg, run_dir.root, requeued)
    except SpecError as err:
        return _never_started(err.problems, cfg, run_dir, hydra_cfg, start_time)
    damaged = resume_problems(spec, run_dir.root)  # reads the checkpoint it resumes from
    if damaged:
        return _never_started(damaged, cfg, run_dir, hydra_cfg, start_time)

    if in_sweep:
        spec = _with_trial(spec, hydra_cfg)
        wrong_direction = sweeper_problem(hydra_cfg.sweeper, spec)
        if wrong_direction:  # every job would be scored the wrong way round: stop the sweep
            log.error("%s", problems_text([wrong_direction]))
            _discard(run_dir.root)
            _discard(Path(hydra_cfg.sweep.dir), frozenset({"multirun.yaml"}))
            sys.exit(INVALID_CONFIG)
    add_code_dirs([os.getcwd(), *spec.code_dir])
    sweep_dir = Path(hydra_cfg.sweep.dir) if in_sweep else None
    write_hydra_files(cfg, run_dir.root, spec.node_rank)  # accepted: Hydra's record of it
    _scrub_hydra_files(secrets, run_dir.root, sweep_dir, spec.node_rank)
    os.environ[SECRETS_ENV] = secrets.environment()  # for every process started from here
    if spec.node_rank > 0:
        return _run_other_node(spec, secrets, run_dir, start_time)
    _file_run(spec, secrets, run_dir, sweep_dir)
    end = run_agent(run_dir.root, start_time, secrets.environment())
    summary = _summary_after(end, spec, run_dir, start_time)
    rejected = (summary.get("error") or {}).get("problems")
    if rejected and end.code == INVALID_CONFIG:  # the agent's check of the components:
        log.error("%s", problems_text(with_origins(rejected, sys.argv[1:])))  # as above
        if not in_sweep:
            _discard_rejected(run_dir)
            sys.exit(INVALID_CONFIG)
        _update_sweep_table(hydra_cfg)
        return math.nan
    report_outcome(summary, run_dir)
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


def _with_trial(spec: RunSpec, hydra_cfg: Any) -> RunSpec:
    """A job of hydra/sweeper=runner is a trial of its study, a job of hydra/launcher=tune a
    Tune trial: rank 0 reports to it."""
    from runner.sweeps.study_sweep import job_trial

    trial = job_trial(hydra_cfg.sweeper, hydra_cfg.launcher, hydra_cfg.job.num)
    if trial is None:
        return spec
    return dataclasses.replace(spec, sweep=dataclasses.replace(spec.sweep, trial=trial))


def _file_run(spec: RunSpec, secrets: Secrets, run_dir: RunDir, sweep_dir: Path | None) -> None:
    """The run directory before the agent starts: config.yaml, env.json, logs/, an earlier
    launch's summary set aside; a sweep's job tells rank 0's trackers its sweep."""
    save_spec(spec, run_dir.root, secrets)
    env = {"run_id": uuid.uuid4().hex, **_environment(spec, secrets)}
    write_json(run_dir.env, {**env, "slurm_job": slurm.job_key(os.environ)})
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    archive_previous(run_dir)  # resuming in an earlier run's directory keeps its story
    if sweep_dir is not None:  # MLflow groups the sweep's jobs under one parent run
        os.environ[SWEEP_DIR_ENV] = str(Path(sweep_dir).absolute())
    else:
        os.environ.pop(SWEEP_DIR_ENV, None)


def _environment(spec: RunSpec, secrets: Secrets) -> dict[str, Any]:
    """env.json's facts, its command line (the `runner` command's, also in a launcher
    plugin's job process) without the secrets given on it."""
    env = environment_info(spec.code_dir)
    command_line = os.environ.get(COMMAND_LINE_ENV)
    env["argv"] = secrets.masked_argv(json.loads(command_line) if command_line else env["argv"])
    return env


def _scrub_hydra_files(
    secrets: Secrets, run_dir: Path, sweep_dir: Path | None, node_rank: int
) -> None:
    """Hydra's own record of the run (.hydra/, a sweep's multirun.yaml) without the secret
    values given literally."""
    if not secrets.values:
        return
    files = [*run_dir.joinpath(hydra_subdir(node_rank)).glob("*.yaml")]
    if sweep_dir is not None:
        files.append(sweep_dir / "multirun.yaml")
    for path in files:
        if path.is_file():
            text = path.read_text()
            if secrets.scrub(text) != text:
                path.write_text(secrets.scrub(text))


def _summary_after(end: Any, spec: RunSpec, run_dir: RunDir, start_time: float) -> dict:
    """summary.json once the agent has ended; written here if the agent died first."""
    summary = read_summary(run_dir)
    if summary is not None:
        return summary
    if end.received:  # stopped before the agent could say so (it had not started the ranks)
        name = signal.Signals(end.received).name
        return write_unfinished_summary(
            run_dir, Status.INTERRUPTED, spec.world_size, start_time, None, signal=name
        )
    message = f"launcher exited with {end.code}"
    error = {"rank": None, "exitcode": end.code, "message": message}
    return write_unfinished_summary(run_dir, Status.FAILED, spec.world_size, start_time, error)


def _run_other_node(
    spec: RunSpec, secrets: Secrets, run_dir: RunDir, start_time: float
) -> float | None:
    """Node i > 0 of a multi-node run. Its own files (config.yaml, env.json, summary.json,
    .hydra/) go to `node{i}/`; its ranks write into node 0's run directory when this node
    sees it (shared filesystem) and into this one otherwise. With a shared filesystem the
    `node{i}/` directory then moves next to node 0's files, and this node's own run
    directory, left empty, goes away: one run, one directory."""
    node_dir = run_dir.root / f"node{spec.node_rank}"
    node_dir.mkdir(parents=True, exist_ok=True)
    outcome = RunDir(node_dir).summary
    outcome.unlink(missing_ok=True)
    save_spec(spec, node_dir, secrets)
    write_json(node_dir / "env.json", _environment(spec, secrets))
    end = run_agent(node_dir, start_time, secrets.environment())
    code, received = end.code, end.received
    summary = read_json(outcome)
    if summary is None:  # the agent died before it could write one
        summary = {
            "status": str(Status.INTERRUPTED if received else Status.FAILED),
            "node_rank": spec.node_rank,
            "run_dir": str(run_dir.root),
            "error": {"rank": None, "exitcode": code, "message": f"launcher exited with {code}"},
        }
        write_json(outcome, summary)
    ranks_root = Path(summary.get("run_dir") or run_dir.root)
    if ranks_root.resolve() != run_dir.root.resolve():  # shared filesystem: join node 0's dir
        target = ranks_root / node_dir.name
        shutil.rmtree(target, ignore_errors=True)  # an earlier launch's, in a resumed run
        shutil.move(str(node_dir), str(target))
        node_dir = target
        _discard(run_dir.root)
    first = spec.node_rank * spec.nproc  # type: ignore[operator]
    log.info(
        "runner: node %d (ranks %d-%d): its files are in %s",
        spec.node_rank,
        first,
        first + spec.nproc - 1,  # type: ignore[operator]
        shown(node_dir),
    )
    run_summary = read_summary(RunDir(ranks_root))
    final_summary = (
        run_summary if summary.get("status") == Status.COMPLETED and run_summary else summary
    )
    report_outcome(final_summary, RunDir(ranks_root))
    if end.asked and summary.get("stopped"):
        after = summary["stopped"]["after_step"]
        continue_after_stop(end.asked, end.asked_handler, spec.node_rank, after)
    if code != 0 and HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)
    return final_summary.get("final", {}).get(spec.sweep.metric, math.nan)


def _update_sweep_table(hydra_cfg: Any) -> None:
    try:
        write_sweep_table(Path(hydra_cfg.sweep.dir))
    except OSError as exc:  # the table is a convenience; never fail a finished job over it
        log.warning("runner: could not update the sweep table: %s", exc)


USER_CONFIG_ENV = "RUNNER_CONFIG_DIR"
COMMAND_LINE_ENV = "RUNNER_COMMAND_LINE"  # the `runner` command line, as env.json records it


def _user_config_argv(directory: str) -> list[str]:
    """RUNNER_CONFIG_DIR=DIR: the user's own recipes (DIR/recipe/NAME.yaml) and group options
    (DIR/model/NAME.yaml, ...) next to runner's, like `runner --config-dir DIR`."""
    if not Path(directory).is_dir():
        print(
            f"runner: {USER_CONFIG_ENV}={directory!r}: no such directory "
            "(it should hold GROUP/NAME.yaml files: recipe/, model/, data/, loss/, ...)",
            file=sys.stderr,
        )
        sys.exit(2)
    return [f"--config-dir={directory}"]


SHORTHANDS = {"init_from": "init_from.path"}  # `key=VALUE` for the main key of a group of keys


def expand_shorthands(args: list[str]) -> list[str]:
    """`init_from=PATH` is `init_from.path=PATH` (a whole `init_from={...}` stays as it is)."""
    expanded = []
    for arg in args:
        key, equals, value = arg.partition("=")
        if equals and key in SHORTHANDS and not value.startswith("{"):
            arg = f"{SHORTHANDS[key]}={value}"
        expanded.append(arg)
    return expanded


def main() -> None:
    """Console entry point: `runner [overrides]`, `runner rerun RUN_DIR [overrides]`,
    `runner eval SOURCE [overrides]` (runner.cli.evaluate), `runner prepare [overrides]`
    (runner.cli.prepare) or `runner k8s-manifest --image IMAGE [overrides]`
    (runner.cli.k8s_manifest)."""
    keep_extensions_in_environment()  # `python -m runner.cli.main`: the agent inherits it
    task = _run
    if sys.argv[1:2] == ["eval"]:
        sys.argv = [sys.argv[0], *eval_argv(sys.argv[2:], Path(conf_dir()))]
    if sys.argv[1:2] == ["rerun"]:
        sys.argv = [sys.argv[0], *rerun_argv(sys.argv[2:], Path(conf_dir()))]
    else:
        if sys.argv[1:2] == ["prepare"]:
            sys.argv, task = [sys.argv[0], *prepare_argv(sys.argv[2:])], prepare_task
        elif sys.argv[1:2] == ["k8s-manifest"]:
            sys.argv, task = [sys.argv[0], *manifest_argv(sys.argv[2:])], manifest_task
        if os.environ.get(USER_CONFIG_ENV) and not any(
            a.startswith(("--config-dir", "-cd")) for a in sys.argv[1:]
        ):
            user = _user_config_argv(os.environ[USER_CONFIG_ENV])
            sys.argv = [sys.argv[0], *user, *sys.argv[1:]]
    sys.argv = [sys.argv[0], *expand_shorthands(sys.argv[1:])]
    # before Hydra keeps the command line (and a launcher plugin pickles it)
    sys.argv = [sys.argv[0], *hide_literal_secrets(sys.argv[1:], os.environ)]
    os.environ[COMMAND_LINE_ENV] = json.dumps(sys.argv)  # for jobs that submitit starts
    app = hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")(task)
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
        print(problems_text(composition_problems(exc, sys.argv[1:], conf_dir())), file=sys.stderr)
        if SweepTable.sweep_dir is not None:  # a sweep whose jobs could not be composed
            _discard(SweepTable.sweep_dir, frozenset({"multirun.yaml"}))
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
