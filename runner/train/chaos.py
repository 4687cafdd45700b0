"""Fault injection for tests and drills: `chaos.kill_rank` fails at `chaos.at_step`.

Fires on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), so a run
with max_restarts >= 1 shows the restart path end to end.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from runner.spec.schema import ChaosSpec


class ChaosError(RuntimeError):
    """The exception `chaos.action=raise` throws."""


def maybe_fail(chaos: ChaosSpec, rank: int, step: int) -> None:
    if chaos.kill_rank != rank or chaos.at_step != step:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    print(
        f"chaos: rank {rank} fails at step {step} ({chaos.action}) at t={time.time():.3f}",
        flush=True,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    if chaos.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ChaosError(f"chaos: rank {rank} raised at step {step}")
