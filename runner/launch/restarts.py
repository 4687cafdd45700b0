"""An elastic restart, said on the terminal as it happens: which rank ended the attempt and
how (its exception, the signal that killed it, its exit code), the step it was at, and the
step every rank goes back to.

Torch elastic restarts the ranks by itself (max_restarts) and tells nobody. The agent notes
every rank process it starts (runner.launch.forked_ranks) and, when the ranks of the next
attempt are about to start (runner.launch.torch_setup's logs spec, which torch asks once per
attempt), reads how those of the one before ended: their exit codes (torch has reaped them),
the error files they wrote, their last heartbeats, and the run's latest checkpoint.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import heartbeat
from runner.launch.failures import RankFailure, root_cause
from runner.rundir.checkpoints import CheckpointStore, step_of
from runner.rundir.files import RunDir

log = logging.getLogger("runner")


@dataclass
class Attempts:
    """The rank processes of each attempt on this node, and what a restart says of them."""

    run_dir: RunDir
    max_restarts: int
    beats: Path | None = None  # this node's heartbeat file: each rank's last step
    slots: int = 0
    watchdog: Any = None  # runner.launch.watchdog.Watchdog: a hang it ended
    started: dict[int, dict[int, Any]] = field(default_factory=dict)  # attempt -> rank -> proc

    def note(self, env: dict[str, str], process: Any) -> None:
        """A rank process torch elastic just started (its environment says which)."""
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.started.setdefault(attempt, {})[int(env["RANK"])] = process

    def restarting(self, attempt: int) -> None:
        """The ranks of `attempt` (1, 2, ...) are about to start: say why and from where."""
        failures = self.failures(attempt - 1)
        line = restart_line(
            root_cause(failures) if failures else None,
            self._step_of(failures),
            attempt,
            self.max_restarts,
            CheckpointStore(self.run_dir.checkpoints, keep=1).latest(),
            self.run_dir.root,
        )
        if sys.stderr.isatty():  # rank 0's progress bar stopped mid-line: clear it
            sys.stderr.write("\r\x1b[K")
        log.warning("%s", line)

    def failures(self, attempt: int) -> list[RankFailure]:
        """The ranks of `attempt` that ended with an error, as the run's failure report
        reads them (runner.launch.outcomes)."""
        from runner.launch.outcomes import rank_failure

        ended = []
        for rank, process in sorted(self.started.get(attempt, {}).items()):
            code = process.poll()
            if code:
                error_file = self.run_dir.error_file(rank, attempt)
                failure = rank_failure(
                    self.run_dir, rank, error_file if error_file.is_file() else None, code, 0.0
                )
                ended.append(failure)
        if self.watchdog is None:
            return ended
        hang = self.watchdog.caused({p.pid for p in self.started.get(attempt, {}).values()})
        return ended if hang is None else [hang, *(f for f in ended if f.rank != hang.rank)]

    def _step_of(self, failures: list[RankFailure]) -> str | None:
        """Where the failed rank was, from its last heartbeat."""
        if not failures or self.beats is None or not self.beats.exists():
            return None
        rank = root_cause(failures).rank
        for beat in heartbeat.read(self.beats, self.slots):
            if beat.rank == rank and beat.pid:
                return heartbeat.describe(beat.phase, beat.step)
        return None


def restart_line(
    cause: RankFailure | None,
    where: str | None,
    attempt: int,
    max_restarts: int,
    latest: Path | None,
    root: Path,
) -> str:
    """`runner: rank 1 was killed by SIGKILL (exitcode -9), in step 42 (...); restart 1 of 2:
    every rank goes back to step 40 (checkpoints/step_00000040)`."""
    why = cause.headline() if cause is not None else "a rank on another node failed"
    if where:
        why += f", {where}"
    if latest is None:
        back = "step 0 (no checkpoint yet)"
    else:
        back = f"step {step_of(latest)} ({latest.relative_to(root)})"
    return f"runner: {why}; restart {attempt} of {max_restarts}: every rank goes back to {back}"
