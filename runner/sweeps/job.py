"""A sweep's job as its run sees it, under any launcher: what its directory holds from an
earlier start, and a signal that stops the sweep it belongs to."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.processes import NO_BAR_ENV, exit_code_for_signal
from runner.rundir.files import RunDir, read_json, write_json
from runner.spec.slurm import job_key
from runner.sweeps.resume import KEEP, RESUME, EarlierJob, EarlierStart, earlier_job
from runner.sweeps.tables import SweepTable

log = logging.getLogger("runner")


def earlier_start_of_job(cfg: DictConfig, job_dir: Path, hydra_cfg: Any) -> float | None:
    """A sweep's job whose directory holds an earlier start, under any launcher: another
    job's directory is left alone (NaN: not run); the same job is kept as it ended (its
    result) or goes on from its checkpoint (resume=auto; None: run it)."""
    overrides = list(hydra_cfg.overrides.task)
    earlier = as_first_node_found_it(job_dir, earlier_job(job_dir, overrides, cfg.get("resume")))
    if earlier.problem is not None:
        log.error("runner: job %s not run: %s", hydra_cfg.job.num, earlier.problem)
        return math.nan
    if earlier.start.action == KEEP:
        log.info("runner: job %s kept as it ended (%s)", hydra_cfg.job.num, earlier.start.status)
        return earlier.start.value
    if earlier.start.action == RESUME:
        with open_dict(cfg):
            cfg.resume = "auto"
    return None


def as_first_node_found_it(job_dir: Path, earlier: EarlierJob) -> EarlierJob:
    """A multi-node SLURM job (submitit's, a task per node) starts the same job on each node,
    and each looks at its directory; the first to look may write there before the others do,
    and a later node would take that for an earlier start and resume. So the first finding
    is recorded under the SLURM job's key, before anything else is written, and every node
    of the job goes on from it, whatever it finds there itself (node 0's files half written
    read as another job's). Outside SLURM a job runs on one node: nothing is recorded."""
    key = job_key(os.environ)
    if key is None:
        return earlier
    record = RunDir(job_dir).start_found
    found = read_json(record)  # read after the directory: the record is written before it
    if isinstance(found, dict) and found.get("job") == key and found.get("action") is not None:
        return EarlierJob(None, EarlierStart(str(found["action"]), found.get("status")))
    if earlier.problem is not None or earlier.start.action == KEEP:
        return earlier  # nothing of this start is written there
    write_json(record, {"job": key, "action": earlier.start.action, "status": earlier.start.status})
    return earlier


def quiet_beside_others(cfg: DictConfig, hydra_cfg: Any) -> None:
    """Jobs that joblib runs side by side share this terminal: their bars would share its
    line, so they draw none (hydra/launcher=runner decides for its own jobs)."""
    launcher = hydra_cfg.launcher
    if "joblib" in str(launcher.get("_target_", "")) and launcher.get("n_jobs", 1) != 1:
        os.environ[NO_BAR_ENV] = "1"  # the agent and the ranks inherit it


def one_job_at_a_time(hydra_cfg: Any) -> bool:
    """Hydra's own launcher, which runs the jobs one after another in this process."""
    return str(hydra_cfg.launcher.get("_target_", "")).endswith("BasicLauncher")


def stop_sweep(hydra_cfg: Any, signum: int) -> None:
    """A signal stopped this job of a sweep that runs its jobs one at a time here: the sweep
    stops with it, as hydra/launcher=runner's does (the next job would otherwise start, and
    each Ctrl-C stop just one job). Its table is written; the exit code is the signal's."""
    sweep_dir = Path(hydra_cfg.sweep.dir)
    name = signal.Signals(signum).name
    log.error("runner: %s: the sweep stops; the same command again goes on from here", name)
    SweepTable.stopped_by = signum
    SweepTable().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))
    sys.exit(exit_code_for_signal(signum))
