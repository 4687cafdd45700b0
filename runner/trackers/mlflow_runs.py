"""MLflow, all of it: rank 0's tracker (`MlflowTracker`: it creates the run, or reopens the
one noted in tracker_runs.json on a restart or resume, logs every metrics record, and ends a
run that completed) and the parent's part (`finish_run`: when rank 0 did not end the run, it
logs what rank 0 could not deliver and ends the run with its outcome; `finish_sweep_run`: a
sweep's parent run). Underneath, a client with bounded retries and the run of a run
directory (`MlflowRun`).

Through MlflowClient, not the fluent API: its global active run stays free for the user's own
code. MLflow is imported inside the functions: only processes that log to it pay for it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from runner.rundir.files import RunDir, file_lock, read_jsonl
from runner.rundir.summary import Status
from runner.rundir.tracker_runs import (
    SWEEP_DIR_ENV,
    note_tracker_run,
    read_tracker_run,
    tracker_run_once,
)
from runner.secrets import ENV_REFERENCE, resolve_placeholder
from runner.spec.convert import flatten

NAME = "mlflow"
# A tracker that cannot reach its server costs the run a warning, not minutes of retries:
# MLflow's own defaults retry for about 4 minutes with a 120 s timeout per request. Values
# already in the environment win.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
STATUS = {
    Status.COMPLETED: "FINISHED",
    Status.FAILED: "FAILED",
    Status.INTERRUPTED: "KILLED",
    Status.PRUNED: "KILLED",  # stopped early by the sweep, as it meant to
}
PARAM_VALUE_LIMIT = 6000  # characters
SQLITE = "sqlite:///"


def mlflow_client(tracking_uri: str) -> Any:
    """A client of `tracking_uri`. A local SQLite store is opened under a lock beside it:
    opening one creates or migrates its tables, and two processes doing that at once (a
    sweep's parallel jobs on a new store) leave it half-migrated."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    database = _sqlite_file(tracking_uri)
    if database is None:
        return MlflowClient(tracking_uri)
    database.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(database.with_name(f".{database.name}.lock")):
        return MlflowClient(tracking_uri)  # opens the store: creates or migrates its tables


class MlflowRun:
    """The MLflow run of one run directory, and the last step of each metric it holds."""

    def __init__(self, settings: Any, config: dict[str, Any], run_dir: Path):
        """`settings` is the resolved logger.mlflow section; `config`, the run's config."""
        self.settings, self.run_dir = settings, run_dir
        self.uri: str = settings.tracking_uri
        # as config.yaml writes it: a placeholder stays one in tracker_runs.json too
        self.written_uri = (config.get("logger") or {}).get("mlflow", {}).get("tracking_uri")
        self.client = mlflow_client(self.uri)
        noted = read_tracker_run(run_dir, NAME)
        same = noted and noted.get("tracking_uri") in (self.uri, self.written_uri)
        if same:  # a restart, a resume, the parent
            self.run_id: str = noted["run_id"]
            self.experiment_id: str = noted["experiment_id"]
            self.logged = self._logged_steps()
            self.existed = True
        else:
            self._create(config)
            self.logged = {}
            self.existed = False

    def reopen(self) -> None:
        """Rank 0 restarts in a run that existed: running again, and no longer ended."""
        self.client.update_run(self.run_id, status="RUNNING")
        self._note()

    def end(self, summary: dict[str, Any]) -> None:
        """The run's outcome (summary.json's content): tags `runner.status` and
        `runner.error`, metrics summary/steps, summary/wall_time_s, summary/restarts,
        config.yaml, summary.json and (completed, log_model) model.pt as artifacts, and the
        final status."""
        from mlflow.entities import Metric

        status = summary.get("status", Status.FAILED)
        tags = {"runner.status": str(status)}
        error = (summary.get("error") or {}).get("message")
        if error:
            tags["runner.error"] = str(error)[:5000]
        now, steps = int(time.time() * 1000), int(summary.get("steps") or 0)
        numbers = {k: summary[k] for k in ("steps", "wall_time_s", "restarts") if k in summary}
        metrics = [Metric(f"summary/{k}", float(v), now, steps) for k, v in numbers.items()]
        files = [self.run_dir / "config.yaml", RunDir(self.run_dir).summary]
        if status == Status.COMPLETED and self.settings.log_model:
            files.append(self.run_dir / "model.pt")
        _end(self.client, self.run_id, status, tags, files, metrics)
        self._note(ended=status)

    def log(self, records: list[dict[str, Any]]) -> None:
        """Log the metrics of `records` at their steps, skipping steps the run holds."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for record in records:
            step = record["step"]
            for key, value in record.items():
                if key == "step" or not _is_number(value) or step <= self.logged.get(key, -1):
                    continue
                metrics.append(Metric(key, float(value), now, step))
                self.logged[key] = step
        if metrics:  # MLflow splits a batch by its own limits
            self.client.log_batch(self.run_id, metrics=metrics)

    def _note(self, **extra: str) -> None:
        noted = {"run_id": self.run_id, "experiment_id": self.experiment_id}
        uri = self.written_uri or self.uri
        note_tracker_run(self.run_dir, NAME, {**noted, "tracking_uri": uri, **extra})

    def _create(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        settings, run_dir = self.settings, self.run_dir
        experiment = self._experiment(settings.experiment_name)
        tags = {
            "mlflow.source.name": "runner",
            "mlflow.source.type": "LOCAL",
            "mlflow.user": _user(),
            "runner.run_dir": str(run_dir.absolute()),
            **settings.tags,
        }
        run_name = settings.run_name or run_dir.name
        sweep_dir = os.environ.get(SWEEP_DIR_ENV)
        if sweep_dir:  # a sweep: one parent run, a child per job
            sweep = Path(sweep_dir)
            parent = tracker_run_once(
                sweep, NAME, lambda: self._sweep_run(experiment, sweep, settings.tags)
            )
            tags["mlflow.parentRunId"] = parent["run_id"]
            run_name = settings.run_name or f"{sweep.name}/{run_dir.name}"
        run = self.client.create_run(experiment, run_name=run_name, tags=tags)
        self.run_id, self.experiment_id = run.info.run_id, experiment
        self._note()
        params = [Param(k, v) for k, v in as_params(config).items()]
        self.client.log_batch(self.run_id, params=params)

    def _sweep_run(self, experiment: str, sweep_dir: Path, tags: dict[str, str]) -> dict:
        tags = {
            "mlflow.source.name": "runner",
            "runner.sweep_dir": str(sweep_dir.absolute()),
            **tags,
        }
        run = self.client.create_run(experiment, run_name=sweep_dir.name, tags=tags)
        uri = self.written_uri or self.uri
        return {"run_id": run.info.run_id, "experiment_id": experiment, "tracking_uri": uri}

    def _experiment(self, name: str) -> str:
        """The experiment called `name`, created when it does not exist yet (beside a local
        SQLite store, its artifacts go to mlartifacts/ next to the database file; MLflow
        itself would use ./mlruns of whatever directory the process runs in)."""
        database = _sqlite_file(self.uri)
        artifacts = (database.parent / "mlartifacts").as_uri() if database else None
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # another job created it in between
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _logged_steps(self) -> dict[str, int]:
        """The last step of every metric the run holds (from an earlier attempt)."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {
            key: max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
            for key in keys
        }


class MlflowTracker:
    """Rank 0's tracker (runner.trackers): any ending but completion is the parent's to
    record (`finish_run`), since it knows how every rank ended."""

    name = NAME

    def __init__(
        self, settings: Any, config: dict[str, Any], run_dir: RunDir, kept: list[dict[str, Any]]
    ):
        self.settings, self.config, self.run_dir = settings, config, run_dir
        self.kept = list(kept)  # a resumed run: metrics.jsonl's records up to its step
        self.run: MlflowRun | None = None

    def start(self) -> None:
        self.run = MlflowRun(self.settings, self.config, self.run_dir.root)
        if self.run.existed:  # a restart or a resume
            self.run.reopen()
        self.run.log(self.kept)  # what an earlier attempt wrote but may not have delivered

    def log(self, records: list[dict[str, Any]]) -> None:
        self.run.log(records)  # one request (or transaction) for all of them

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        if outcome is not None and outcome.get("status") == Status.COMPLETED:  # summary.json's
            self.run.end(outcome)


def finish_run(settings: Any, config: dict[str, Any], run_dir: RunDir, summary: dict) -> None:
    """The parent, once the run's outcome (`summary`) is known: unless rank 0 ended the run (it
    completed), open it (or create it, when rank 0 never reached the server or died first),
    log the metrics.jsonl records it lacks, then the outcome."""
    noted = read_tracker_run(run_dir.root, NAME) or {}
    if noted.get("ended") == summary.get("status"):
        return
    run = MlflowRun(settings, config, run_dir.root)
    run.log(read_jsonl(run_dir.metrics))  # what rank 0 did not deliver
    run.end(summary)


def finish_sweep_run(sweep_dir: Path, failed: list[str], files: list[Path]) -> None:
    """A sweep's parent run, if one was created: tagged with the outcome (and the jobs that
    failed), `files` attached, ended."""
    noted = read_tracker_run(sweep_dir, NAME)
    if not noted:
        return
    status = Status.FAILED if failed else Status.COMPLETED
    tags = {"runner.status": str(status)}
    if failed:
        tags["runner.failed_jobs"] = ", ".join(failed)
    uri = noted["tracking_uri"]
    if ENV_REFERENCE in uri:  # noted as config.yaml writes it
        uri = resolve_placeholder("logger.mlflow.tracking_uri", uri)
    _end(mlflow_client(uri), noted["run_id"], status, tags, files, [])


def _end(
    client: Any,
    run_id: str,
    status: str,
    tags: dict[str, str],
    files: list[Path],
    metrics: list[Any],
) -> None:
    """Tag the run (and log `metrics`), attach the `files` that exist, set its final status."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
    for path in files:
        if path.is_file():
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, STATUS.get(status, "FAILED"))


def as_params(config: dict[str, Any]) -> dict[str, str]:
    """The config as MLflow parameters: dotted keys, values as text (lists as JSON)."""
    return {
        key: (value if isinstance(value, str) else json.dumps(value, default=str))[
            :PARAM_VALUE_LIMIT
        ]
        for key, value in flatten(config).items()
    }


def _sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a local SQLite store's URI; None for anything else."""
    if not tracking_uri.startswith(SQLITE):
        return None
    return Path(tracking_uri[len(SQLITE) :]).absolute()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        return "unknown"
