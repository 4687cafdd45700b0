"""On a step that logs nothing, runner's code never makes the host wait for the device.

A GPU is not needed to see it: tests.helpers.host_syncs counts, on every CPU rank, each
call of runner's own that would wait on a GPU (a read of a tensor on the host, a copy from
pageable memory to the device), with the step it happened in. A real 2-rank run of the gpt
(token-weighted loss, gradient clipping, the loss-spike watch) under ddp, ZeRO and fsdp logs
every 4th step; the steps between must have none. The log steps' reads (the loss of the
records) are seen, so the count cannot pass by seeing nothing. `make test-gpu` runs the
same runs on a GPU with `sync_debug=error`, where torch itself raises at any wait.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import MATRIX
from tests.helpers.equivalence import ENGINE_OPTIONS
from tests.helpers.host_syncs import recorded
from tests.helpers.language_model import lm_args

pytestmark = pytest.mark.slow

STEPS, LOG = 8, 4
COUNTED = "callbacks=[{_target_: tests.helpers.host_syncs.HostSyncCounter, ranks: all}]"


# runner's own code differs per engine: DDP's, DeepSpeed's (every ZeRO stage) and FSDP2's
@pytest.mark.parametrize("parallelism", ["ddp", pytest.param("zero2", marks=MATRIX), "fsdp"])
def test_no_host_sync_on_a_step_that_logs_nothing(cli, corpus: Path, parallelism: str) -> None:
    run = cli(
        *lm_args(corpus),
        f"parallelism={parallelism}",
        *ENGINE_OPTIONS.get(parallelism, []),
        f"max_steps={STEPS}",
        f"log_interval={LOG}",
        f"eval_interval={LOG}",
        "grad_clip_norm=1.0",
        COUNTED,
    )
    assert run.returncode == 0, run.output
    logged = set(range(LOG, STEPS + 1, LOG))
    for rank in (0, 1):
        seen = recorded(run.run_dir, rank)
        quiet = [s for s in seen if s["step"] is not None and s["step"] not in logged]
        assert not quiet, f"rank {rank} waits for the device on steps that log nothing: {quiet}"
        assert any(s["step"] in logged for s in seen), "the log steps' reads were not seen"


def test_sync_debug_arms_quiet_steps_after_ddps_bucket_rebuild():
    """sync_debug=error on a GPU: never on a start's first two steps (DDP rebuilds its
    buckets in the second's forward, one copy back to the host), nor on a step that logs;
    on every quiet step after them. Nothing on a CPU."""
    from runner.train.step.sync_debug import SyncDebug

    modes: list[str] = []
    debug = SyncDebug("error", "cuda", modes.append)
    for quiet in (True, True, True, False, True):
        debug.step(quiet)
    debug.off()
    assert modes == ["default", "default", "error", "default", "error", "default"]
    on_cpu: list[str] = []
    SyncDebug("error", "cpu", on_cpu.append).step(True)
    assert on_cpu == []
