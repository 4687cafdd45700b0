"""Trackers fed by rank 0: TensorBoard, CSV, MLflow and W&B, each through its own library,
each imported only when selected (`logger=[tensorboard,mlflow]`).

They run on a background thread (`Trackers`), so neither their I/O nor a slow server touches
the step path; metrics.jsonl is written by the loop itself, always, whatever is selected.
"""

from __future__ import annotations

from typing import Any

from runner.rundir.files import RunDir
from runner.rundir.tracker_runs import note_tracker_failure
from runner.spec.tracker_specs import TrackersSpec
from runner.trackers.background import Tracker, Trackers

__all__ = ["Tracker", "Trackers", "build_trackers"]


def build_trackers(
    spec: TrackersSpec,
    config: dict[str, Any],
    run_dir: RunDir,
    kept: list[dict[str, Any]],
    keep_until: int,
) -> Trackers:
    """The selected trackers for rank 0; `config` is the resolved run config (the trackers'
    parameters). A resumed run keeps metrics.jsonl's records up to step `keep_until` (`kept`)
    and trains the steps after it again."""
    from runner.trackers.csv_file import CsvTracker
    from runner.trackers.mlflow_runs import MlflowTracker
    from runner.trackers.tensorboard import TensorBoardTracker
    from runner.trackers.wandb_tracker import WandbTracker

    trackers: list[Tracker] = []
    if spec.tensorboard is not None:
        trackers.append(TensorBoardTracker(spec.tensorboard, run_dir, keep_until))
    if spec.csv is not None:
        trackers.append(CsvTracker(spec.csv, run_dir, kept))
    if spec.mlflow is not None:
        trackers.append(MlflowTracker(spec.mlflow, config, run_dir, kept))
    if spec.wandb is not None:
        trackers.append(WandbTracker(spec.wandb, config, run_dir, kept))
    return Trackers(
        trackers, on_failure=lambda name, why: note_tracker_failure(run_dir.root, name, why)
    )
