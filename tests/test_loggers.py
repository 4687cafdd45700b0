"""The trackers rank 0 feeds, read back with each tool's own reader."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest

from runner.rundir.files import RunDir
from runner.spec.tracker_specs import CsvTrackerSpec, TensorBoardTrackerSpec, TrackersSpec
from runner.trackers import Trackers, build_trackers
from tests.helpers.trackers import scalars

BOTH = TrackersSpec(tensorboard=TensorBoardTrackerSpec(), csv=CsvTrackerSpec())


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def feed(run_dir: RunDir, records: list[dict], kept: list[dict], keep_until: int) -> Trackers:
    trackers = build_trackers(BOTH, {}, run_dir, kept, keep_until)
    for record in records:
        trackers.log(record)
    trackers.close()
    return trackers


def test_every_scalar_at_its_step_and_a_growing_csv_header(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    trackers = feed(
        run_dir,
        [
            {"step": 10, "epoch": 0.5, "train/loss": 2.25, "lr": 1e-3},
            {"step": 20, "train/loss": 1.5, "val/accuracy": 0.75, "note": "text"},
        ],
        kept=[],
        keep_until=0,
    )
    assert not trackers.failed
    found = scalars(run_dir.tensorboard)
    assert found["train/loss"] == [(10, 2.25), (20, 1.5)]
    assert found["val/accuracy"] == [(20, 0.75)]
    assert found["lr"][0][1] == pytest.approx(1e-3)
    assert "step" not in found and "note" not in found
    table = rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in table] == ["10", "20"]
    assert table[0]["val/accuracy"] == "" and table[1]["val/accuracy"] == "0.75"


def test_a_resumed_run_shows_no_step_twice(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    first = [{"step": s, "train/loss": float(s)} for s in (10, 20, 30)]
    feed(run_dir, first, kept=[], keep_until=0)
    # resumed from step 20: step 30 is trained again, with another loss
    feed(run_dir, [{"step": 30, "train/loss": 29.0}], kept=first[:2], keep_until=20)
    assert scalars(run_dir.tensorboard)["train/loss"] == [(10, 10.0), (20, 20.0), (30, 29.0)]
    assert [(r["step"], r["train/loss"]) for r in rows(tmp_path / "metrics.csv")] == [
        ("10", "10.0"),
        ("20", "20.0"),
        ("30", "29.0"),
    ]


class Broken:
    name = "broken"

    def start(self) -> None:
        pass

    def log(self, records: list[dict]) -> None:
        raise ConnectionError("tracking server unreachable")

    def close(self, outcome: dict | None = None) -> None:
        pass


class Counting(Broken):
    name = "counting"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, records: list[dict]) -> None:
        self.steps += [r["step"] for r in records]


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_others_go_on(caplog) -> None:
    counting = Counting()
    trackers = Trackers([Broken(), counting])
    for step in (1, 2, 3):
        trackers.log({"step": step})
    trackers.close()
    assert counting.steps == [1, 2, 3]
    assert trackers.failed == {"broken": "ConnectionError: tracking server unreachable"}
    err = caplog.text
    assert err.count("logger broken failed") == 1 and "metrics.jsonl is complete" in err


class SlowToOpen(Counting):
    """A tracker whose library takes a while to import and whose store a while to open."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__()
        self.opened = False

    def start(self) -> None:
        time.sleep(0.3)
        self.opened = True


def test_the_trackers_are_open_before_the_first_step() -> None:
    """Opening a tracker is one-time work: the loop waits for it before step 1, so none of it
    (an import holding the GIL) lands among the steps (58e01cd opened them at the first
    record, inside a benchmark's timed window)."""
    slow = SlowToOpen()
    trackers = Trackers([slow])
    assert not slow.opened  # on its own thread, while the rank builds
    trackers.wait_opened()
    assert slow.opened and slow.steps == []  # open, before any record came
    trackers.log({"step": 1})
    trackers.close()
    assert slow.steps == [1]
    Trackers([]).wait_opened()  # none: nothing to wait for
