"""summary.json: the one file that says how a run ended.

Rank 0 writes it when training completes. When a run fails or is interrupted,
the agent (or, if the agent itself died, the parent) writes it from what the
run left behind: the last metrics line and the root cause of the failure.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from runner.rundir.files import RunDir, read_json, read_jsonl, write_json


class Status(str, Enum):
    """How a run ended: summary.json's `status`. A str, so a member equals the text read back;
    the dicts runner writes or hands to trackers hold the text itself (str(status))."""

    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PRUNED = "pruned"  # stopped by a sweep's pruner after an evaluation, with a checkpoint

    def __str__(self) -> str:
        return self.value


log = logging.getLogger("runner")
HISTORY_KEYS = ("status", "steps", "wall_time_s", "restarts", "resumed_from")
ATTEMPTS = "attempts.jsonl"


def archive_previous(run_dir: RunDir) -> None:
    """Before a new launch in an existing run directory, set its summary aside as history."""
    previous = read_summary(run_dir)
    if previous is not None:
        write_json(run_dir.logs / "previous_summary.json", previous)
        run_dir.summary.unlink()
    elif run_dir.summary.exists():  # unreadable: kept aside as it is, named
        damaged = run_dir.logs / "previous_summary.damaged"
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        os.replace(run_dir.summary, damaged)
        log.warning(
            "runner: %s cannot be read (the earlier launch's story is lost from history); "
            "kept as %s, and this launch writes a new one",
            run_dir.summary,
            damaged,
        )
    (run_dir.logs / ATTEMPTS).unlink(missing_ok=True)


def record_attempt(run_dir: RunDir, attempt: int, resumed_from: int | None) -> None:
    """Note that an attempt of this launch started (rank 0, once per attempt)."""
    with open(run_dir.logs / ATTEMPTS, "a") as f:
        f.write(json.dumps({"attempt": attempt, "resumed_from": resumed_from}) + "\n")


def attempts(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every attempt of this launch: the elastic restarts and the step each resumed from."""
    return read_jsonl(run_dir.logs / ATTEMPTS)


def history(run_dir: RunDir) -> list[dict[str, Any]]:
    """How earlier launches in this run directory ended, oldest first."""
    previous = read_json(run_dir.logs / "previous_summary.json")
    if not previous:
        return []
    entry = {k: previous.get(k) for k in HISTORY_KEYS}
    if previous.get("error"):
        entry["error"] = previous["error"].get("message")
    return [*previous.get("history", []), entry]


def build_summary(
    status: str,
    world_size: int,
    start_time: float,
    metrics: list[dict[str, Any]],
    state_bytes: list[dict[str, int]] | None = None,
    error: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The summary dict; `final` holds the newest value of every metric logged.

    `state_bytes` has one entry per rank (params, grads, optimizer, total);
    `optimizer_state_bytes` repeats its optimizer part, per rank."""
    final: dict[str, Any] = {}
    for record in metrics:
        final.update(record)
    summary: dict[str, Any] = {
        "status": str(status),  # a plain string, also for the trackers that read it
        "world_size": world_size,
        "steps": final.get("step", 0),
        "samples": final.get("samples", 0),
        "wall_time_s": round(time.time() - start_time, 3),
        "final": final,
        "optimizer_state_bytes": [s["optimizer"] for s in state_bytes] if state_bytes else None,
        "state_bytes": state_bytes,
        "history": [],
    }
    summary.update(extra)
    if error is not None:
        summary["error"] = error
    return summary


def write_summary(run_dir: RunDir, summary: dict[str, Any]) -> None:
    write_json(run_dir.summary, summary)


def write_unfinished_summary(
    run_dir: RunDir,
    status: str,
    world_size: int,
    start_time: float,
    error: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Record a failed or interrupted run from what it left behind, and return it."""
    started = attempts(run_dir)
    summary = build_summary(
        status,
        world_size,
        start_time,
        read_jsonl(run_dir.metrics),
        error=error,
        history=history(run_dir),
        attempts=started,
        restarts=max(0, len(started) - 1),  # elastic restarts: attempts after the first
        **extra,
    )
    write_summary(run_dir, summary)
    return summary


def read_summary(run_dir: RunDir) -> dict[str, Any] | None:
    return read_json(run_dir.summary)


@dataclass(frozen=True)
class HowItEnded:
    """How a run, or a sweep's job, ended, read from its summary.json (`how_it_ended`)."""

    status: Status | None  # None: no summary yet (running, never started) or an unknown one
    summary: dict[str, Any]

    @property
    def failed(self) -> bool:
        """Ended in a failure, or without a summary that says otherwise."""
        return self.status in (None, Status.FAILED)

    def error_line(self, otherwise: str = "ended without a summary") -> str:
        """The first line of the failure's message."""
        message = (self.summary.get("error") or {}).get("message") or otherwise
        return message.splitlines()[0]

    def final(self, metric: str) -> Any:
        """The last value of `metric` the run recorded (None: none)."""
        return (self.summary.get("final") or {}).get(metric)


def how_it_ended(run_dir: RunDir | Path) -> HowItEnded:
    """The one reader of how a run ended: its status (a `Status`) and its summary."""
    summary = read_summary(run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)) or {}
    try:
        status = Status(summary.get("status"))
    except ValueError:
        status = None
    return HowItEnded(status, summary)
