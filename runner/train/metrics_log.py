"""metrics.jsonl: one JSON object per logged step, appended and flushed by rank 0."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runner.artifacts import read_jsonl, write_atomic
from runner.train.tensorboard import EventWriter


class MetricsLog:
    """Appends records to metrics.jsonl (and TensorBoard's event file, if given a directory).

    On (re)start it keeps only earlier records up to step `keep_until`, so a resumed run
    does not repeat the steps it trains again.
    """

    def __init__(
        self, path: Path, enabled: bool, keep_until: int = 0, tensorboard: Path | None = None
    ):
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._events: EventWriter | None = None
        if enabled:
            self.records = [r for r in read_jsonl(path) if r.get("step", 0) <= keep_until]
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in self.records))
            self._file = open(path, "a", buffering=1)  # noqa: SIM115
            if tensorboard is not None:
                self._events = EventWriter(tensorboard, self.records)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._events is not None:
            self._events.add(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._events is not None:
            self._events.close()


class Throughput:
    """Samples per second between two log points, with evaluation time left out."""

    def __init__(self, samples: int = 0):
        self._t0 = time.perf_counter()
        self._samples0 = samples
        self._paused = 0.0

    def pause(self, seconds: float) -> None:
        self._paused += seconds

    def rate(self, samples: int) -> float:
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._t0 - self._paused)
        rate = (samples - self._samples0) / elapsed
        self._t0, self._samples0, self._paused = now, samples, 0.0
        return rate
