"""MLflow through MlflowClient (not the fluent API: its global active run stays free for the
user's own code). Rank 0 creates the run, or reopens the one noted in tracker_runs.json on a
restart or resume, logs every metrics record, and ends a run that completed. Any other
ending is the parent's to record (runner.cli.trackers): it knows how every rank ended."""

from __future__ import annotations

from typing import Any

from runner.artifacts import RunDir
from runner.mlflow_store import MlflowRun
from runner.spec.schema import MlflowLoggerSpec


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        spec: MlflowLoggerSpec,
        config: dict[str, Any],
        run_dir: RunDir,
        kept: list[dict[str, Any]],
    ):
        self.spec, self.config, self.run_dir = spec, config, run_dir
        self.kept = list(kept)  # a resumed run: metrics.jsonl's records up to its step
        self.run: MlflowRun | None = None

    def start(self) -> None:
        self.run = MlflowRun(self.spec, self.config, self.run_dir.root)
        if self.run.existed:  # a restart or a resume
            self.run.reopen()
        self.run.log(self.kept)  # what an earlier attempt wrote but may not have delivered

    def log(self, records: list[dict[str, Any]]) -> None:
        self.run.log(records)  # one request (or transaction) for all of them

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        if outcome is not None and outcome.get("status") == "completed":  # summary.json's
            self.run.end(outcome)
