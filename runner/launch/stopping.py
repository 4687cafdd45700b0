"""A graceful stop: SIGUSR1 or SIGUSR2 to runner stops every rank after the same step, with a
checkpoint to go on from.

SLURM sends them before a job's time limit (`sbatch --signal=USR1@120`), on preemption when
the cluster says so, and `scancel --signal=USR1 JOB` sends one by hand; submitit uses
SIGUSR2. SIGINT and SIGTERM still stop at once (the latest checkpoint is the resume point).

Ranks check the control block of the heartbeat file at the end of every step (a load from
shared memory: runner.heartbeat.Heartbeat.stop_after). On a request this node's agent

1. marks the stop as asked there: each rank pauses at the end of the step it is in;
2. reads from the ranks' heartbeat slots the last step any of them can finish before it
   pauses (the step it is in, or the next one when it is between steps);
3. on a multi-node run, publishes that step in node 0's store and waits for every node's:
   the other agents learn of the request from their watcher and do the same;
4. writes the largest of those steps. Paused ranks go on to it, and every rank stops after
   it, saves a checkpoint there and exits.

No rank has passed the chosen step, so all of them stop after the same one, and the
collectives of the steps in between line up. Nothing costs a rank anything until a stop
is asked: no collective, no store access, no thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from runner import heartbeat
from runner.launch.nodes import NodeLink

_early: list[str] = []  # requests that came before the agent knew its run


def catch_early() -> None:
    """From the agent's first line: note a request that comes while it still imports torch
    (the default action of SIGUSR1/SIGUSR2 would end it)."""
    for sig in heartbeat.STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: _early.append(signal.Signals(signum).name))


class GracefulStop:
    """This agent's side of a graceful stop (see the module docstring)."""

    def __init__(self, heartbeat_path: Path, nproc: int, link: NodeLink | None = None):
        self.path, self.nproc, self.link = heartbeat_path, nproc, link
        self.asked_by: str | None = None  # `SIGUSR1`, or `SIGUSR2 on node 1 (host)`
        self.signal = signal.SIGUSR1  # the signal that asked (for the exit code)
        self.step: int | None = None  # the step every rank stops after, once agreed
        self._lock = threading.Lock()

    def install(self) -> None:
        """Take SIGUSR1/SIGUSR2 from here on, and act on one that came earlier."""
        for sig in heartbeat.STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if _early:
            self.ask(_early[0])

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.ask(signal.Signals(signum).name)

    def ask(self, by: str) -> None:
        """Stop after the step the ranks agree on (the first request counts; later ones are
        the same request: SLURM signals the parent, the agent and each rank).

        Safe in a signal handler that interrupts another call of itself (the parent's relay
        and SLURM's own SIGUSR1 arrive together): it never waits for the lock (a waiting
        handler would hold the main thread forever) and writes nothing itself; the request
        is made, and said, on the agreeing thread."""
        if not self._lock.acquire(blocking=False):
            return  # a request is being taken right now, in this thread or another
        try:
            if self.asked_by is not None:
                return
            self.asked_by = by
            name = by.split()[0]
            self.signal = getattr(signal.Signals, name, signal.SIGUSR1)
        finally:
            self._lock.release()
        threading.Thread(target=self._agree, name="runner-stop", daemon=True).start()

    def _agree(self) -> None:
        heartbeat.request_stop(self.path)
        print(f"runner: {self.asked_by}: stopping every rank after the same step, with a "
              "checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        reachable = max(1, heartbeat.reachable_step(self.path, self.nproc))
        try:
            step = self.link.agree_stop(reachable, self.asked_by or "") if self.link else reachable
        except Exception as exc:  # a node did not answer in time: stop now instead
            print(f"runner: the nodes did not agree on a step to stop after ({exc}); stopping "
                  "now, without a new checkpoint", file=sys.stderr, flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.step = step
        heartbeat.set_stop_step(self.path, step)
