"""The parent ends the tracker runs once the run's outcome is known (summary.json). MLflow:
the parent opens the run directory's run (or creates it, when rank 0 never reached the
server or died first), logs the metrics.jsonl records it lacks, then the status, steps, wall
time and failure message, and config.yaml, summary.json and model.pt as artifacts; a sweep's
parent run ends with the sweep. W&B runs are ended by rank 0 itself
(runner.train.loggers.wandb_tracker)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from runner.artifacts import RunDir, read_jsonl
from runner.mlflow_store import NAME, MlflowRun, end_run, mlflow_client
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
    if settings is None:
        return
    status = summary.get("status", "failed")
    tags = {"runner.status": status}
    error = (summary.get("error") or {}).get("message")
    if error:
        tags["runner.error"] = str(error)[:5000]
    files = [run_dir.config, run_dir.summary]
    if status == "completed" and settings.log_model:
        files.append(run_dir.model)
    try:
        from mlflow.entities import Metric

        run = MlflowRun(settings, to_dict(spec), run_dir.root)
        run.log(read_jsonl(run_dir.metrics))  # what rank 0 did not deliver
        now, steps = int(time.time() * 1000), int(summary.get("steps") or 0)
        numbers = {k: summary[k] for k in ("steps", "wall_time_s", "restarts") if k in summary}
        metrics = [Metric(f"summary/{k}", float(v), now, steps) for k, v in numbers.items()]
        if metrics:
            run.client.log_batch(run.run_id, metrics=metrics)
        end_run(run.client, run.run_id, status, tags, files)
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
        end_run(mlflow_client(noted["tracking_uri"]), noted["run_id"], status, tags, files)
    except Exception as exc:
        _warn(exc, "the sweep's outcome is in sweep.csv")


def _warn(exc: Exception, where: str) -> None:
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    log.warning("runner: warning: logger mlflow could not end its run (%s); %s", message, where)
