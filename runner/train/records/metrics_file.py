"""metrics.jsonl: one JSON object per logged step, appended and flushed by rank 0, and
the same records handed to the selected trackers (runner.trackers)."""

from __future__ import annotations

import json
import logging
from typing import Any

from runner.rundir.files import RunDir, read_jsonl, write_atomic
from runner.spec.tracker_specs import TrackersSpec
from runner.trackers import Trackers, build_trackers

log = logging.getLogger("runner")


class MetricsLog:
    """Appends records to metrics.jsonl and hands them to the trackers.

    On (re)start it keeps only earlier records up to step `keep_until`, so a resumed run
    does not repeat the steps it trains again (nor do the trackers).
    """

    def __init__(
        self,
        run_dir: RunDir,
        enabled: bool,
        keep_until: int = 0,
        trackers: TrackersSpec | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._path = run_dir.metrics
        self.trackers = Trackers([])
        if enabled:
            damaged: list[int] = []
            kept = [r for r in read_jsonl(self._path, damaged) if r.get("step", 0) <= keep_until]
            if damaged:  # the records kept go on; those lines are gone
                shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
                log.warning(
                    "runner: %s: %d unreadable line(s) dropped (line %s); the records around "
                    "them are kept",
                    self._path,
                    len(damaged),
                    shown,
                )
            self._keep(kept)
            if trackers is not None:
                self.trackers = build_trackers(
                    trackers, config or {}, run_dir, self.records, keep_until
                )

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self.trackers.log(record)

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: metrics.jsonl keeps the records up to it (the trackers
        have the later ones already, and get the retrained steps again)."""
        if self._file is not None:
            self._file.close()
            self._keep([r for r in self.records if r["step"] <= step])

    def _keep(self, records: list[dict[str, Any]]) -> None:
        """metrics.jsonl holds `records` and nothing else, open for more."""
        self.records = records
        write_atomic(self._path, "".join(json.dumps(r) + "\n" for r in records))
        self._file = open(self._path, "a", buffering=1)  # noqa: SIM115

    def close(self, timeout: float = 60.0, outcome: dict[str, Any] | None = None) -> None:
        """Close metrics.jsonl, and the trackers once they have what was queued (waiting up
        to `timeout` seconds for them); `outcome` is how the run ended on this rank."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.trackers.close(timeout, outcome)
