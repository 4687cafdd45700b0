"""The run spec's guards: what watches a run while it trains, and what may end it early
(the watchdog, loss spikes, early stopping, fault injection); re-exported by
runner.spec.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.spec.bounds import bound as _bound


@dataclass(frozen=True)
class WatchdogSpec:
    """Seconds a rank may go without progress before the run counts as hung (null: no limit;
    `timeout: null` turns the watchdog off). `timeout` holds between optimizer steps; the
    others hold before the first step, while evaluating, and while writing a checkpoint or
    the final model."""

    timeout: float | None = _bound(600.0, gt=0.0)
    first_step_timeout: float | None = _bound(1800.0, gt=0.0)
    eval_timeout: float | None = _bound(1800.0, gt=0.0)
    checkpoint_timeout: float | None = _bound(1800.0, gt=0.0)


@dataclass(frozen=True)
class ChaosSpec:
    """Fault injection: `kill_rank` fails at step `at_step`, on the first attempt only
    (disk_full: its checkpoint writes fail with ENOSPC from that step on; nan: its loss
    becomes NaN at that step; hang: it stops there, forever)."""

    kill_rank: int | None = _bound(None, min=0)
    at_step: int | None = _bound(None, min=1)
    action: Literal[
        "sigkill", "raise", "hang", "disk_full", "nan", "oom", "sigkill_in_checkpoint", "spike"
    ] = "sigkill"
    oom_above: int = _bound(0, min=0)  # oom: raised from at_step on while microbatch > this


@dataclass(frozen=True)
class LossSpikeSpec:
    """A step's loss over `factor` x the mean of the `window` steps before it is a spike;
    `patience` spikes in a row set off `action`: log it, stop the run, or roll back to the
    last checkpoint before them and skip their batches."""

    window: int = _bound(100, min=2)
    factor: float = _bound(2.0, gt=1.0)
    patience: int = _bound(2, min=1)
    action: Literal["none", "log", "stop", "rollback"] = "log"


@dataclass(frozen=True)
class EarlyStopSpec:
    """The run ends once `metric` (an evaluation's val/NAME; auto: sweep.metric's) has not
    improved by more than `min_delta` for `patience` evaluations in a row (null: never).
    `mode`: min (lower is better), max, or auto (sweep.direction's way for that metric)."""

    metric: str = "auto"
    patience: int | None = _bound(None, min=1)
    min_delta: float = _bound(0.0, min=0.0)
    mode: Literal["auto", "min", "max"] = "auto"
