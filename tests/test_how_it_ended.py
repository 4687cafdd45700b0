"""The one reader of how a run or a sweep's job ended (runner.rundir.summary.how_it_ended):
what every sweep launcher, the sweeper, the progress line and the tables read."""

from __future__ import annotations

import json
from pathlib import Path

from runner.rundir.files import RunDir
from runner.rundir.summary import Status, how_it_ended


def test_a_summary_read_as_a_status_its_error_and_its_final_values(tmp_path: Path) -> None:
    ended = how_it_ended(tmp_path)  # nothing yet: running, or never started
    assert ended.status is None and ended.failed and ended.summary == {}
    assert ended.error_line() == "ended without a summary"

    summary = {"status": "failed", "error": {"message": "rank 1 raised\ntraceback"}}
    RunDir(tmp_path).summary.write_text(json.dumps(summary))
    ended = how_it_ended(RunDir(tmp_path))
    assert ended.status is Status.FAILED and ended.failed
    assert ended.error_line() == "rank 1 raised"

    summary = {"status": "pruned", "final": {"val/loss": 0.5}}
    RunDir(tmp_path).summary.write_text(json.dumps(summary))
    ended = how_it_ended(tmp_path)
    assert ended.status is Status.PRUNED and not ended.failed
    assert ended.final("val/loss") == 0.5 and ended.final("val/accuracy") is None

    RunDir(tmp_path).summary.write_text(json.dumps({"status": "exploded"}))
    assert how_it_ended(tmp_path).status is None  # not a status runner writes: not an ending
