"""hydra/launcher=runner's progress line: where the sweep stands, printed as each job ends.

runner: sweep: 5 done, 2 running, 1 queued, 1 failed, 2 pruned; best val/accuracy 0.9321 (job 3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from runner.rundir.summary import HowItEnded, Status, how_it_ended


def job_result(job_dir: Path, ending: HowItEnded) -> tuple[str | None, str | None, float]:
    """(sweep.metric, sweep.direction, the job's final value of it: what it returned to the
    sweeper), from the job's config.yaml and how it ended."""
    from runner.spec.config_file import ConfigDamaged, read_config

    try:
        config = read_config(job_dir / "config.yaml")
    except (OSError, ConfigDamaged):
        return None, None, math.nan
    sweep = config.get("sweep") or {}
    value = ending.final(sweep.get("metric"))
    value = float(value) if isinstance(value, int | float) else math.nan
    return sweep.get("metric"), sweep.get("direction"), value


@dataclass
class SweepProgress:
    queued: int
    running: int = 0
    done: int = 0
    failed: int = 0
    stopped: int = 0
    pruned: int = 0
    best: tuple[float, int, str] | None = None  # value, job, metric

    def started(self) -> None:
        self.queued -= 1
        self.running += 1

    def ended(self, job: int, job_dir: Path, returned: bool = False) -> None:
        """`returned`: the job's function returned (a Hydra app that is not runner's writes
        no summary.json: that is how it completed)."""
        self.running -= 1
        ending = how_it_ended(job_dir)
        if ending.status is Status.COMPLETED or (ending.status is None and returned):
            self.done += 1
        elif ending.status is Status.INTERRUPTED:
            self.stopped += 1
        elif ending.status is Status.PRUNED:
            self.pruned += 1
        else:
            self.failed += 1
        metric, direction, value = job_result(job_dir, ending)
        if ending.status is not Status.COMPLETED or metric is None or math.isnan(value):
            return
        sign = -1.0 if direction == "minimize" else 1.0
        if self.best is None or sign * value > sign * self.best[0]:
            self.best = (value, job, metric)

    def line(self) -> str:
        counts = f"{self.done} done, {self.running} running, {self.queued} queued"
        counts += f", {self.failed} failed" + (f", {self.stopped} stopped" if self.stopped else "")
        counts += f", {self.pruned} pruned" if self.pruned else ""
        if self.best is None:
            return f"sweep: {counts}"
        value, job, metric = self.best
        return f"sweep: {counts}; best {metric} {value:.4g} (job {job})"


def stopped_line(job: int, job_dir: Path) -> str | None:
    """What a sweep says of a job stopped before its end (a signal, fail_fast): where it
    stands, and that it goes on; None for a job that was not stopped."""
    ending = how_it_ended(job_dir)
    if ending.status is not Status.INTERRUPTED:
        return None
    summary = ending.summary
    checkpoint = (summary.get("stopped") or {}).get("checkpoint")
    where = f"after step {summary.get('steps')}" + (
        f", checkpoint {checkpoint}" if checkpoint else ""
    )
    again = "the same command again goes on from there"
    return f"job {job} stopped: interrupted {where} ({job_dir}); {again}"
