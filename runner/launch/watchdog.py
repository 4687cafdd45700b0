"""The hang watchdog: the agent notices ranks that stopped making progress, shows where each
one waits, and stops them all.

A thread of the agent reads the ranks' heartbeats (runner.heartbeat) once a second. When a
rank's beat has not changed for longer than its phase allows (`watchdog.timeout` between
steps; longer before the first step, while evaluating and while writing checkpoints), it:

1. appends a marker to every local rank's log and sends it heartbeat.STACK_SIGNAL, on which
   faulthandler writes the Python stack of each of its threads there;
2. kills every local rank (SIGKILL: a rank stuck in a collective never returns to Python);
3. keeps the cause, so the agent reports `hung: ...` instead of a killed process. The elastic
   agent then restarts the ranks (max_restarts) or the run ends, on every node.

The rank named first is the one that fell behind: every rank beats in the same order, so the
fewest beats (then the oldest) points at the rank the others are waiting for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from runner import heartbeat
from runner.heartbeat import Beat, Phase
from runner.launch.failures import HANG, RankFailure
from runner.rundir.files import RunDir
from runner.spec.guard_specs import WatchdogSpec

STACK_DUMP_WAIT_S = 0.5  # faulthandler writes in the signal handler: this is plenty


@dataclass(frozen=True)
class Seen:
    """A rank's latest beat and when the watchdog first saw it (time.monotonic())."""

    beat: Beat
    since: float


class Watchdog:
    def __init__(
        self,
        spec: WatchdogSpec,
        run_dir: RunDir,
        nproc: int,
        nodes: int = 1,
        path: Path | None = None,
    ):
        """`path`: the agent's heartbeat file (else the watchdog makes and removes its own)."""
        self.spec = spec
        self.run_dir = run_dir
        self.nproc = nproc
        self._owns_file = path is None
        self.path = path or heartbeat.create(nproc)
        self.poll_s = min(1.0, (spec.timeout or 10.0) / 10)
        # Every rank of a hung run stalls within about a step of the others, so the other
        # nodes' watchdogs fire within a poll of this one: let them write their stacks before
        # this node's ranks die (and the ranks elsewhere fail on the broken connections).
        self.kill_delay_s = STACK_DUMP_WAIT_S + (2 * self.poll_s if nodes > 1 else 0.0)
        self.seen: dict[int, Seen] = {}
        self.killed: set[int] = set()
        self.hang: RankFailure | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="runner-watchdog", daemon=True)

    def start(self) -> None:
        """Watch (the agent has told the ranks where to beat: RUNNER_HEARTBEAT)."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._owns_file:
            self.path.unlink(missing_ok=True)

    def allowance(self, phase: int) -> tuple[str, float | None]:
        """The key that limits a rank in this phase, and its value."""
        key = {
            Phase.START: "first_step_timeout",
            Phase.EVAL: "eval_timeout",
            Phase.SAVE: "checkpoint_timeout",
            Phase.FINISH: "checkpoint_timeout",
            Phase.STOPPED: "checkpoint_timeout",
        }.get(phase, "timeout")  # type: ignore[call-overload]
        return key, getattr(self.spec, key)

    def caused(self, pids: set[int]) -> RankFailure | None:
        """The hang, when the watchdog killed any of these (failed) processes."""
        return self.hang if self.hang is not None and pids & self.killed else None

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            live = self.check(time.monotonic())
            if live is not None:
                self._fire(live)

    def check(self, now: float) -> list[Seen] | None:
        """Note who moved; return every live rank's state once one is over its allowance."""
        live = []
        for slot, beat in enumerate(heartbeat.read(self.path, self.nproc)):
            if beat.pid == 0 or beat.pid in self.killed or not _alive(beat.pid):
                self.seen.pop(slot, None)  # not started, or gone (the agent sees to that)
                continue
            seen = self.seen.get(slot)
            if seen is None or seen.beat != beat:
                seen = self.seen[slot] = Seen(beat, now)
            live.append(seen)
        if any(self._over(s, now) for s in live):
            return live
        return None

    def _over(self, seen: Seen, now: float) -> bool:
        limit = self.allowance(seen.beat.phase)[1]
        return limit is not None and now - seen.since > limit

    def _fire(self, live: list[Seen]) -> None:
        now = time.monotonic()
        self.hang = self.report(live, now)
        print(f"runner: {self.hang.headline()}", file=sys.stderr, flush=True)
        for seen in live:
            where = heartbeat.describe(seen.beat.phase, seen.beat.step)
            marker = (
                f"\n===== runner watchdog: no progress for {now - seen.since:.0f} s, {where}; "
                "the Python stack of every thread follows =====\n"
            )
            log = self.run_dir.rank_log(seen.beat.rank)
            with contextlib.suppress(OSError), open(log, "a") as f:
                f.write(marker)
            _signal(seen.beat.pid, heartbeat.STACK_SIGNAL)
        time.sleep(self.kill_delay_s)
        for seen in live:
            self.killed.add(seen.beat.pid)
            _signal(seen.beat.pid, signal.SIGKILL)

    def report(self, live: list[Seen], now: float) -> RankFailure:
        """The hang as a failure: the rank that stopped first, and every stuck rank (those
        without progress for at least half as long as the one over its limit)."""
        trigger = min((s for s in live if self._over(s, now)), key=lambda s: s.since)
        key, limit = self.allowance(trigger.beat.phase)
        stuck = [s for s in live if now - s.since >= (now - trigger.since) / 2]
        first = min(stuck, key=lambda s: (s.beat.beats, s.beat.at, s.beat.rank))

        def state(s: Seen) -> str:
            where = heartbeat.describe(s.beat.phase, s.beat.step)
            return f"rank {s.beat.rank} {where}, no progress for {now - s.since:.0f} s"

        others = [state(s) for s in sorted(stuck, key=lambda s: s.beat.rank) if s is not first]
        message = (
            f"{state(first)}, stopped first"
            + (f"; also stuck: {'; '.join(others)}" if others else "")
            + f" (watchdog.{key}={limit:g}); every rank's Python stack is in its log"
        )
        return RankFailure(
            rank=first.beat.rank,
            exitcode=-signal.SIGKILL,
            time=first.beat.at,  # across nodes, the earliest stalled rank is the root cause
            host=socket.gethostname(),
            error_type=HANG,
            message=message,
            log=self.run_dir.rank_log(first.beat.rank),
            beats=first.beat.beats,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid
        return False
    return True


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
