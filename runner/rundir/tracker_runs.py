"""tracker_runs.json: which tracker run a run directory logs to (MLflow's run id, W&B's run
id), so restarts and resumed runs go on logging to the same one; at a sweep's root, the
sweep's own runs (MLflow's parent run). Read and updated under a lock: a sweep's jobs may
run in parallel."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.rundir.files import TRACKER_RUNS, file_lock, read_json, write_json

FAILED = "failed"  # tracker -> why rank 0 dropped it
SWEEP_DIR_ENV = "RUNNER_SWEEP_DIR"  # set by the parent for a sweep's job: the sweep's root
log = logging.getLogger("runner")


def read_tracker_run(directory: Path, tracker: str) -> dict[str, Any] | None:
    """What `tracker` noted in `directory` (None if nothing)."""
    return _read(directory).get(tracker)


def _read(directory: Path) -> dict[str, Any]:
    """tracker_runs.json's content; {} when there is none, or (said, with the file named)
    when it cannot be read: the trackers then start runs of their own."""
    path = directory / TRACKER_RUNS
    runs = read_json(path)
    if runs is None and path.exists():
        log.warning(
            "runner: %s cannot be read; the trackers log to new runs (the earlier ones stay "
            "where they are, unlinked)",
            path,
        )
    return runs if isinstance(runs, dict) else {}


def note_tracker_run(directory: Path, tracker: str, value: dict[str, Any]) -> None:
    _update(directory, lambda runs: runs.update({tracker: value}))


def note_tracker_failure(directory: Path, tracker: str, message: str) -> None:
    """A tracker rank 0 dropped: the parent repeats it on the console at the end."""
    _update(directory, lambda runs: runs.setdefault(FAILED, {}).update({tracker: message}))


def tracker_failures(directory: Path) -> dict[str, str]:
    return _read(directory).get(FAILED, {})


def tracker_run_once(
    directory: Path, tracker: str, create: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The run `tracker` noted in `directory`, created (and noted) by the first caller."""

    def add_if_missing(runs: dict[str, Any]) -> None:
        if tracker not in runs:
            runs[tracker] = create()

    return _update(directory, add_if_missing)[tracker]


def _update(directory: Path, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Apply `change` to tracker_runs.json in `directory`, under its lock; the new content."""
    with file_lock(directory / f".{TRACKER_RUNS}.lock"):
        runs = _read(directory)
        change(runs)
        write_json(directory / TRACKER_RUNS, runs)
        return runs
