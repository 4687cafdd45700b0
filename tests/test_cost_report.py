"""`make test-report` reads the suite's ledger (.test-cost/<target>.json) as
tests/helpers/cost.py writes it: modules summed over their classes, most expensive first, the
runs a module launched, and a short answer for a target or module it has no record of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import cost_report


def _scope(scope: str, wall: float, runs: int, commands: list[str]) -> dict:
    return {
        "scope": scope, "wall_s": wall, "cpu_s": 1.0, "children_cpu_s": 2.0 * runs,
        "tests": 2, "failed": 0, "runs": runs, "processes": runs, "commands": commands,
        "test_costs": [[f"test_{i}", wall / 2, 1.0 + i, 1] for i in range(2)],
    }  # fmt: skip


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    ledger = {
        "wall_s": 90.0, "workers": 3, "started": "2026-12-02 18:00:00", "load_at_start": 0.5,
        "exitstatus": 0,
        "scopes": [
            _scope("tests/test_a.py::TestOne", 10.0, 1, ["runner model=mlp"]),
            _scope("tests/test_a.py::TestTwo", 30.0, 2, ["runner model=gpt", "runner eval R"]),
            _scope("tests/test_b.py", 25.0, 0, []),
        ],
    }  # fmt: skip
    (tmp_path / "test.json").write_text(json.dumps(ledger))
    (tmp_path / "test-matrix.json").write_text("{cut short")  # one being written
    monkeypatch.setattr(cost_report, "LEDGER_DIR", tmp_path)
    return tmp_path


def test_modules_sum_their_classes_most_expensive_first(ledger_dir: Path) -> None:
    out = cost_report.report(["test"], top=10, scopes=False, runs_of="tests/test_a.py")
    rows = [line.split() for line in out.splitlines() if line.startswith("  tests/")]
    assert [r[0] for r in rows] == ["tests/test_a.py", "tests/test_b.py"]
    assert rows[0][1:] == ["40.0", "8.0", "6.0", "4", "3"]  # wall, CPU, ranks, tests, runs
    assert "test: 1.5 min wall, 3 worker(s), 6 tests, 3 runs" in out
    listed = out[out.index("the runs of tests/test_a.py") :]
    assert all(c in listed for c in ("runner model=mlp", "runner model=gpt", "runner eval R"))


def test_a_modules_tests_are_listed_most_cpu_first(ledger_dir: Path) -> None:
    out = cost_report.report(["test"], top=10, scopes=False, tests_of="tests/test_a.py")
    listed = out[out.index("the tests of tests/test_a.py") :].splitlines()[2:]
    rows = [line.split() for line in listed if line.strip()]
    assert [r[0] for r in rows[:4]] == ["2.0", "2.0", "1.0", "1.0"]  # both classes' tests
    assert {r[1] for r in rows[:2]} == {"15.0", "5.0"} and rows[0][3] == "test_1"  # wall s


def test_what_it_has_no_record_of_is_said(ledger_dir: Path) -> None:
    unknown = cost_report.report(["test-ray"], top=10, scopes=False)
    assert unknown.startswith("no record of test-ray under") and "(recorded: test)" in unknown
    none = cost_report.report(["test"], top=10, scopes=False, runs_of="tests/test_c.py")
    assert "no module recorded matches --runs tests/test_c.py" in none
