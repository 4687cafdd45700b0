"""The trackers' thread: the loop hands records over and goes on; a tracker that fails is
reported once and dropped, and training continues."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from runner.errors import describe

log = logging.getLogger(__name__)

_STOP = object()


class Tracker(Protocol):
    name: str

    def start(self) -> None:
        """Open the tracker (imports its library): on the thread, as soon as it starts."""

    def log(self, records: list[dict[str, Any]]) -> None:
        """metrics.jsonl records (`step` and the metric values), oldest first."""

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        """The run ended on this rank: `outcome` holds status, steps, wall_time_s and error
        (None when the rank stopped without one)."""


class Trackers:
    """The trackers' thread. It delivers what has been queued at most every `interval`
    seconds, in one call per tracker: a tracker's cost is mostly per call (a request, a
    database transaction), and rank 0's process, whose GIL the thread shares, trains."""

    def __init__(
        self,
        trackers: list[Tracker],
        on_failure: Callable[[str, str], None] | None = None,
        interval: float = 2.0,
    ):
        self.trackers = trackers
        self.interval = interval
        self.on_failure = on_failure  # (tracker, message): noted for the parent to repeat
        self.failed: dict[str, str] = {}
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] | None = None
        self._closing = threading.Event()
        self._opened = threading.Event()  # every tracker's start() has returned
        if trackers:
            self._thread = threading.Thread(target=self._work, name="runner-trackers", daemon=True)
            self._thread.start()

    def wait_opened(self, timeout: float = 120.0) -> None:
        """Until every tracker is open (its library imported, its store or run opened), so
        that none of that one-time work lands among the training steps. A tracker that takes
        longer than `timeout` goes on opening beside them, and says so."""
        if self._thread is not None and not self._opened.wait(timeout):
            log.warning(
                "runner: warning: the trackers took over %g s to open; training starts "
                "beside them (metrics.jsonl is written meanwhile)",
                timeout,
            )

    def log(self, record: dict[str, Any]) -> None:
        if self._thread is not None:
            self._queue.put(dict(record))

    def close(self, timeout: float = 60.0, outcome: dict[str, Any] | None = None) -> None:
        """Deliver what is queued and close every tracker (waits up to `timeout` seconds)."""
        if self._thread is not None:
            self._outcome = outcome
            self._queue.put(_STOP)
            self._closing.set()
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "runner: warning: the trackers did not finish within %g s; what they had "
                    "not delivered is in metrics.jsonl",
                    timeout,
                )
            self._thread = None

    def _work(self) -> None:
        # Open the trackers at once, while the rank builds, and before the first step (the
        # loop waits for it: wait_opened): importing their libraries and opening their stores
        # holds the GIL, which the training thread's steps would wait for.
        live = [t for t in self.trackers if self._call(t, "start")]
        self._opened.set()
        stopping = False
        while not stopping:
            batch = [self._queue.get()]  # wait for one, then take what else is there
            while not self._queue.empty():
                batch.append(self._queue.get())
            stopping = batch[-1] is _STOP
            records = [item for item in batch if item is not _STOP]
            if records:
                live = [t for t in live if self._call(t, "log", records)]
            if not stopping:
                self._closing.wait(self.interval)  # let records gather; close() cuts it short
        for tracker in live:
            self._call(tracker, "close", self._outcome)

    def _call(self, tracker: Tracker, method: str, *args: Any) -> bool:
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as exc:  # a tracker never takes the run down
            message = describe(exc)
            message = message if len(message) <= 300 else message[:297] + "..."
            self.failed[tracker.name] = message
            if self.on_failure is not None:
                with contextlib.suppress(OSError):  # the warning below is in the log anyway
                    self.on_failure(tracker.name, message)
            log.warning(
                "runner: warning: logger %s failed (%s); training goes on without it, "
                "metrics.jsonl is complete",
                tracker.name,
                message,
            )
            return False
