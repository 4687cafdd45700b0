"""The parent ends what rank 0 could not, once the run's outcome is known (summary.json):
MLflow's run (runner.trackers.mlflow_runs.finish_run) and a sweep's parent run. W&B runs are
ended by rank 0 itself (runner.trackers.wandb_tracker). Trackers rank 0 dropped are repeated
on the console."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from runner.errors import describe
from runner.rundir.files import RunDir
from runner.rundir.tracker_runs import tracker_failures
from runner.spec.config_file import written_config
from runner.spec.schema import RunSpec
from runner.trackers.mlflow_runs import finish_run, finish_sweep_run

log = logging.getLogger("runner")


def finish_trackers(spec: RunSpec, run_dir: RunDir, summary: dict[str, Any]) -> None:
    for name, why in tracker_failures(run_dir.root).items():
        log.warning(
            "runner: warning: logger %s failed on rank 0 (%s); training went on without it, "
            "metrics.jsonl is complete",
            name,
            why,
        )
    if spec.logger.mlflow is None:
        return
    try:
        finish_run(spec.logger.mlflow, written_config(run_dir.root), run_dir, summary)
    except Exception as exc:  # a tracker never fails a run, nor hides its outcome
        _warn(exc, "the run's outcome is in summary.json")


def finish_sweep_trackers(sweep_dir: Path, failed: list[str], files: list[Path]) -> None:
    try:
        finish_sweep_run(sweep_dir, failed, files)
    except Exception as exc:
        _warn(exc, "the sweep's outcome is in sweep.csv")


def _warn(exc: Exception, where: str) -> None:
    message = describe(exc)[:300]
    log.warning("runner: warning: logger mlflow could not end its run (%s); %s", message, where)
