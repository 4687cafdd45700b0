"""MLflow through MlflowClient (not the fluent API: its global active run stays free for the
user's own code). Rank 0 creates the run, or reopens the one noted in tracker_runs.json on a
restart or resume, and logs every metrics record; the parent then logs what did not arrive
and ends the run with the outcome of every rank (runner.cli.trackers)."""

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
        self.run.client.update_run(self.run.run_id, status="RUNNING")
        self.run.log(self.kept)  # what an earlier attempt wrote but may not have delivered

    def log(self, record: dict[str, Any]) -> None:
        self.run.log([record])

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        """The parent ends the run: it knows the outcome of every rank, not only this one's."""
