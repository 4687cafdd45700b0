"""A sweep's pruner seen from the training loop (`hydra/sweeper=runner` with a pruner): after
each evaluation rank 0 reports `sweep.metric` to the sweep's study (runner.sweeps), and
every rank learns from it whether the trial stops here."""

from __future__ import annotations

import logging

from runner import dist as rdist
from runner.spec import RunSpec

log = logging.getLogger(__name__)


class Pruning:
    def __init__(self, spec: RunSpec, is_main: bool):
        self.trial = spec.sweep.trial
        self.metric = spec.sweep.metric
        self.is_main = is_main

    def prunes(self, step: int, evaluation: dict[str, float]) -> bool:
        """Report this evaluation; whether the pruner stops the trial after `step` (the
        same answer on every rank). A report that fails costs a warning, not the run."""
        if self.trial is None or self.metric not in evaluation:
            return False
        stop = False
        if self.is_main:
            from runner.sweeps.study_server import report

            try:
                stop = report(self.trial.address, self.trial.number, step, evaluation[self.metric])
            except Exception as exc:  # the sweep's process gone or busy: the run goes on
                log.warning("the sweep's study took no report at step %d: %s", step, exc)
        return bool(rdist.broadcast_object(stop))
