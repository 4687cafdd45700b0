"""tracker_runs.json: which tracker run a run directory logs to (MLflow's run id, W&B's run
id), so restarts and resumed runs go on logging to the same one; at a sweep's root, the
sweep's own runs (MLflow's parent run). Read and updated under a lock: a sweep's jobs may
run in parallel."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runner.artifacts import TRACKER_RUNS, read_json, write_json

FAILED = "failed"  # tracker -> why rank 0 dropped it
SWEEP_DIR_ENV = "RUNNER_SWEEP_DIR"  # set by the parent for a sweep's job: the sweep's root


def read_tracker_run(directory: Path, tracker: str) -> dict[str, Any] | None:
    """What `tracker` noted in `directory` (None if nothing)."""
    return (read_json(directory / TRACKER_RUNS) or {}).get(tracker)


def note_tracker_run(directory: Path, tracker: str, value: dict[str, Any]) -> None:
    with _locked(directory):
        runs = read_json(directory / TRACKER_RUNS) or {}
        runs[tracker] = value
        write_json(directory / TRACKER_RUNS, runs)


def note_tracker_failure(directory: Path, tracker: str, message: str) -> None:
    """A tracker rank 0 dropped: the parent repeats it on the console at the end."""
    with _locked(directory):
        runs = read_json(directory / TRACKER_RUNS) or {}
        runs.setdefault(FAILED, {})[tracker] = message
        write_json(directory / TRACKER_RUNS, runs)


def tracker_failures(directory: Path) -> dict[str, str]:
    return (read_json(directory / TRACKER_RUNS) or {}).get(FAILED, {})


def tracker_run_once(
    directory: Path, tracker: str, create: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The run `tracker` noted in `directory`, created (and noted) by the first caller."""
    with _locked(directory):
        runs = read_json(directory / TRACKER_RUNS) or {}
        if tracker not in runs:
            runs[tracker] = create()
            write_json(directory / TRACKER_RUNS, runs)
        return runs[tracker]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{TRACKER_RUNS}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
