"""A sweep's study answering its jobs: each job's rank 0 reports `sweep.metric` after every
evaluation to the sweep's process, which owns the study, and learns whether the trial's
pruner stops it there.

The sweep's process listens on a local TCP port (`RUNNER_STUDY`: host:port) with an
authentication key (`RUNNER_STUDY_KEY`, hex), both in its environment, which its jobs and
their ranks inherit; no report is read before the key is proven. Jobs on other hosts cannot
reach it: pruning takes jobs on the sweep's host (hydra/launcher=runner, joblib, basic).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

ADDRESS_ENV = "RUNNER_STUDY"
KEY_ENV = "RUNNER_STUDY_KEY"
REPORT_TIMEOUT_S = 60.0

log = logging.getLogger("runner")


class StudyServer:
    """Answers ("report", trial number, step, value) with whether to prune, calling
    `on_report` (under the sweep's lock) in a thread of the sweep's process."""

    def __init__(self, on_report: Callable[[int, int, float], bool]):
        from multiprocessing.connection import Listener

        self.on_report = on_report
        self.key = secrets.token_bytes(32)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.thread = threading.Thread(target=self._serve, name="study-server", daemon=True)
        self.closed = False

    @property
    def address(self) -> str:
        host, port = self.listener.address
        return f"{host}:{port}"

    def start(self) -> None:
        """Listen, and tell every process started from here where (the environment)."""
        os.environ[ADDRESS_ENV] = self.address
        os.environ[KEY_ENV] = self.key.hex()
        self.thread.start()

    def close(self) -> None:
        self.closed = True
        os.environ.pop(ADDRESS_ENV, None)
        os.environ.pop(KEY_ENV, None)
        self.listener.close()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()  # proves the key before anything is read
            except Exception:  # closed, or a caller without the key: go on listening
                if self.closed:
                    return
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            try:
                kind, number, step, value = conn.recv()
                if kind != "report":
                    raise ValueError(f"unknown request {kind!r}")
                conn.send(bool(self.on_report(int(number), int(step), float(value))))
            except Exception as exc:
                log.warning("runner: the study took no report: %s", exc)
                conn.send(False)


def report(address: str, number: int, step: int, value: float) -> bool:
    """A job's rank 0: report `value` at `step` for trial `number`; whether to prune."""
    from multiprocessing.connection import Client

    host, _, port = address.rpartition(":")
    key = bytes.fromhex(os.environ[KEY_ENV])
    with Client((host, int(port)), authkey=key) as conn:
        conn.send(("report", number, step, value))
        if not conn.poll(REPORT_TIMEOUT_S):
            raise TimeoutError(f"no answer from the sweep's study at {address}")
        return bool(conn.recv())
