"""metrics.csv: one row per logged step, one column per metric seen so far."""

from __future__ import annotations

import csv
import io
from typing import Any

from runner.rundir.files import RunDir, write_atomic
from runner.spec.tracker_specs import CsvTrackerSpec


class CsvTracker:
    name = "csv"

    def __init__(self, spec: CsvTrackerSpec, run_dir: RunDir, kept: list[dict[str, Any]]):
        self.path = run_dir.root / spec.file
        self.rows = list(kept)  # a resumed run: metrics.jsonl's records up to its step
        self.columns: list[str] = []
        self.file: Any = None

    def start(self) -> None:
        for row in self.rows:
            self._add_columns(row)
        self._rewrite()

    def log(self, records: list[dict[str, Any]]) -> None:
        self.rows += records
        grew = [self._add_columns(r) for r in records]  # every record's new metrics
        if any(grew):  # the header grows: the file is rewritten
            self._rewrite()
        else:
            csv.DictWriter(self.file, self.columns).writerows(records)
            self.file.flush()

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        if self.file is not None:
            self.file.close()

    def _add_columns(self, record: dict[str, Any]) -> bool:
        new = [k for k in record if k not in self.columns]
        self.columns += new
        return bool(new)

    def _rewrite(self) -> None:
        if self.file is not None:
            self.file.close()
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        write_atomic(self.path, text.getvalue())
        self.file = open(self.path, "a", newline="")  # noqa: SIM115
