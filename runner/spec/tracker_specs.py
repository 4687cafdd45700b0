"""The `logger` section of the run spec: which trackers rank 0 feeds, and their settings."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal


@dataclass(frozen=True)
class TensorBoardTrackerSpec:
    flush_secs: float = field(default=10.0, metadata={"gt": 0.0})


@dataclass(frozen=True)
class CsvTrackerSpec:
    file: str = "metrics.csv"


@dataclass(frozen=True)
class MlflowTrackerSpec:
    tracking_uri: str | None = None  # null: sqlite:///<launch dir>/runs/mlflow.db (resolved)
    experiment_name: str = "runner"
    run_name: str | None = None  # null: the run directory's name (a sweep job: sweep/job)
    tags: dict[str, str] = field(default_factory=dict)
    log_model: bool = True  # model.pt as an artifact (config.yaml and summary.json always)


@dataclass(frozen=True)
class WandbTrackerSpec:
    project: str = "runner"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"
    tags: tuple[str, ...] = ()
    log_model: bool = True  # model.pt as a W&B artifact (config.yaml always)


@dataclass(frozen=True)
class TrackersSpec:
    """The trackers rank 0 feeds (`logger=[tensorboard,csv]`); a key is there when selected.
    metrics.jsonl is written whatever is selected."""

    tensorboard: TensorBoardTrackerSpec | None = None
    csv: CsvTrackerSpec | None = None
    mlflow: MlflowTrackerSpec | None = None
    wandb: WandbTrackerSpec | None = None

    @property
    def selected(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]
