"""The parent ends what rank 0 could not, once the run's outcome is known (summary.json).
MLflow: unless rank 0 ended the run (it completed), the parent opens it (or creates it, when
rank 0 never reached the server or died first), logs the metrics.jsonl records it lacks,
then the outcome (runner.mlflow_store.MlflowRun.end); a sweep's parent run ends with the
sweep. W&B runs are ended by rank 0 itself (runner.train.loggers.wandb_tracker). Trackers
rank 0 dropped are repeated on the console."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from runner.artifacts import RunDir, read_jsonl
from runner.mlflow_store import NAME, MlflowRun, end_sweep_run
from runner.spec.convert import to_dict
from runner.spec.schema import RunSpec
from runner.tracker_runs import read_tracker_run, tracker_failures

log = logging.getLogger("runner")


def finish_trackers(spec: RunSpec, run_dir: RunDir, summary: dict[str, Any]) -> None:
    for name, why in tracker_failures(run_dir.root).items():
        log.warning(
            "runner: warning: logger %s failed on rank 0 (%s); training went on without it, "
            "metrics.jsonl is complete",
            name,
            why,
        )
    settings = spec.logger.mlflow
    noted = read_tracker_run(run_dir.root, NAME) or {}
    if settings is None or noted.get("ended") == summary.get("status"):
        return  # not selected, or rank 0 ended it (it completed)
    try:
        run = MlflowRun(settings, to_dict(spec), run_dir.root)
        run.log(read_jsonl(run_dir.metrics))  # what rank 0 did not deliver
        run.end(summary)
    except Exception as exc:  # a tracker never fails a run, nor hides its outcome
        _warn(exc, "the run's outcome is in summary.json")


def finish_sweep_trackers(sweep_dir: Path, failed: list[str], files: list[Path]) -> None:
    noted = read_tracker_run(sweep_dir, NAME)
    if not noted:
        return
    status = "failed" if failed else "completed"
    tags = {"runner.status": status}
    if failed:
        tags["runner.failed_jobs"] = ", ".join(failed)
    try:
        end_sweep_run(noted, status, tags, files)
    except Exception as exc:
        _warn(exc, "the sweep's outcome is in sweep.csv")


def _warn(exc: Exception, where: str) -> None:
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    log.warning("runner: warning: logger mlflow could not end its run (%s); %s", message, where)
