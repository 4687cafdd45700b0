"""Which rank's failure caused a run to fail (cli.outcome tells the user).

When one rank dies, its peers usually fail a moment later inside a collective
("Connection closed by peer"). Those are consequences, not causes: the root
cause is the earliest failure that is not such a communication error, or the
earliest failure of all if every one is.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HANG = "Hang"  # the error_type of ranks the watchdog stopped (runner.launch.watchdog)
_COMMS_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}
_COMMS_PATTERNS = re.compile(
    r"connection (closed|reset|refused)|broken pipe|gloo|nccl|socket timeout|"
    r"timed out.*(collective|store|rendezvous)|process group",
    re.IGNORECASE,
)


def is_comms_error(type_name: str, message: str) -> bool:
    """True when an exception looks like fallout from a peer going away."""
    return type_name in _COMMS_TYPES or bool(_COMMS_PATTERNS.search(message))


@dataclass(frozen=True)
class RankFailure:
    """One failed rank, as the elastic agent saw it."""

    rank: int
    exitcode: int
    time: float
    host: str = ""
    error_type: str | None = None
    message: str = ""
    traceback: str = ""
    log: Path | None = None
    log_tail: str = field(default="", compare=False)
    beats: int | None = None  # a hang: the heartbeats of the rank that stopped first
    explained: bool = False  # its message says it all (runner.errors.Explained): no traceback

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def is_consequence(self) -> bool:
        """Fallout: a communication error a dead peer causes, or the agent's own stop signal."""
        if self.error_type is not None:
            return is_comms_error(self.error_type, self.message)
        return self.exitcode in (-signal.SIGTERM, -signal.SIGINT)

    def as_dict(self) -> dict:
        """A JSON-ready copy (sent to the other nodes of a run)."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["log"] = str(self.log) if self.log else None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> RankFailure:
        log = data.get("log")
        return cls(**{**data, "log": Path(log) if log else None})

    def headline(self) -> str:
        where = f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        if self.error_type == HANG:
            return f"hung: {self.message}"
        if self.error_type:
            return f"{where} raised {self.error_type}: {self.message} (exitcode {self.exitcode})"
        if self.signal_name:
            return f"{where} was killed by {self.signal_name} (exitcode {self.exitcode})"
        return f"{where} exited with code {self.exitcode}"

    def summary_error(self, others: int = 0) -> dict:
        """The `error` entry of summary.json."""
        return {
            "rank": self.rank,
            "exitcode": self.exitcode,
            "message": self.headline(),
            "type": self.error_type,
            "signal": self.signal_name,
            "host": self.host,
            "traceback": self.traceback or None,
            "log_tail": None if self.traceback or self.explained else self.log_tail,
            "log": str(self.log) if self.log else None,
            "other_failed_ranks": others,
        }


def root_cause(failures: Iterable[RankFailure]) -> RankFailure:
    """The failure that most likely started it all (see module docstring). Among hangs that
    several nodes' watchdogs report, the rank that fell furthest behind: every rank beats
    in the same order, and beat counts do not depend on clocks agreeing to the millisecond."""
    ordered = sorted(failures, key=lambda f: (f.is_consequence, f.time, f.rank))
    if not ordered:
        raise ValueError("root_cause() needs at least one failure")
    if ordered[0].error_type == HANG:
        hangs = [f for f in ordered if f.error_type == HANG]
        return min(hangs, key=lambda f: (f.beats or 0, f.time, f.rank))
    return ordered[0]
