"""Weights & Biases through wandb.init, in the run directory (wandb/). Rank 0 starts the run,
or resumes the one noted in tracker_runs.json, and ends it: the outcome goes into the run's
summary, config.yaml (and model.pt) into an artifact. A rank killed from outside leaves the
run to W&B, which marks it crashed."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from runner.rundir.files import RunDir
from runner.rundir.summary import Status
from runner.rundir.tracker_runs import SWEEP_DIR_ENV, note_tracker_run, read_tracker_run
from runner.spec.tracker_specs import WandbTrackerSpec


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        spec: WandbTrackerSpec,
        config: dict[str, Any],
        run_dir: RunDir,
        kept: list[dict[str, Any]],
    ):
        self.spec, self.config, self.run_dir = spec, config, run_dir
        self.kept = list(kept)
        self.run: Any = None
        self.noted: dict[str, Any] = {}

    def start(self) -> None:
        import wandb

        self.noted = read_tracker_run(self.run_dir.root, self.name) or {
            "id": uuid.uuid4().hex[:12],
            "last_step": -1,
        }
        sweep_dir = os.environ.get(SWEEP_DIR_ENV)
        self.run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            mode=self.spec.mode,
            dir=str(self.run_dir.root),
            id=self.noted["id"],
            resume="allow",
            name=f"{Path(sweep_dir).name}/{self.run_dir.root.name}" if sweep_dir else None,
            group=Path(sweep_dir).name if sweep_dir else None,  # a sweep's jobs, together
            tags=list(self.spec.tags),
            config=self.config,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._note()
        self.log(self.kept)  # what an earlier attempt wrote but may not have delivered

    def log(self, records: list[dict[str, Any]]) -> None:
        new = [r for r in records if r["step"] > self.noted["last_step"]]  # not in the run yet
        for record in new:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if new:
            self.noted["last_step"] = new[-1]["step"]
            self._note()

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        import wandb

        outcome = outcome or {}
        status = outcome.get("status", Status.FAILED)
        for key in ("status", "steps", "wall_time_s"):
            if key in outcome:
                self.run.summary[key] = outcome[key]
        if outcome.get("error"):
            self.run.summary["error"] = outcome["error"].get("message", "")
        files = [self.run_dir.config]
        if status == Status.COMPLETED and self.spec.log_model:
            files.append(self.run_dir.model)
        artifact = wandb.Artifact(f"run-{self.run.id}", type="model")
        for path in files:
            if path.is_file():
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if status in (Status.COMPLETED, Status.PRUNED) else 1)

    def _note(self) -> None:
        note_tracker_run(
            self.run_dir.root,
            self.name,
            {**self.noted, "project": self.spec.project, "mode": self.spec.mode},
        )
