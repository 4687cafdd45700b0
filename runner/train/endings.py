"""How a run ends before its last step, asked once after every step: should it end here,
and why? Each reason is a rule with one method, `after_step(step, evaluation)`, that
returns an `Ending` or None; the loop asks them in order and ends the run on the first
answer (runner.train.trainer). Every rank must give the same answer at the same step:
the graceful stop reads the step its agents agreed on, and the pruner's answer is
broadcast from rank 0.

- `GracefulStop`: SIGUSR1/SIGUSR2 to runner, SLURM's --signal (status `interrupted`; a
  checkpoint so that resume=auto goes on; the agent writes summary.json).
- `SweepPruning`: the sweep's pruner stopped this trial after an evaluation (status
  `pruned`, a checkpoint, no model.pt).
- `EarlyStopping`: `early_stop.metric` stopped improving for `early_stop.patience`
  evaluations (status `completed`, `stopped_early` in the summary, model.pt written).

The loop asks them before it writes the step's checkpoint, so a rule's state (early
stopping's best and count) is in it as of that step, and a restart or a resume from it
stops where the uninterrupted run stops.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from runner import dist as rdist
from runner.heartbeat import Heartbeat
from runner.rundir.summary import Status
from runner.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ending:
    """How the run ends and what the summary says of it."""

    status: Status
    reason: str = ""  # the rank's log line
    key: str | None = None  # the summary's key for `details` ("pruned", "stopped_early")
    details: dict[str, Any] = field(default_factory=dict)
    weights: bool = True  # model.pt: a finished run's weights
    checkpoint: bool = False  # a checkpoint of the last step (its path lands in `details`)
    by_agent: bool = False  # the agent writes summary.json: it knows why the run stopped


@dataclass(frozen=True)
class Outcome:
    """How the loop ended: why, after which step and samples, and whether a checkpoint of
    that step is written already."""

    ending: Ending
    step: int
    samples: int
    saved: bool = False


COMPLETED = Ending(Status.COMPLETED)
EVALUATED = Ending(Status.COMPLETED, weights=False)  # eval_only: no step, no model.pt


class EndingRule(Protocol):
    def after_step(self, step: int, evaluation: dict[str, float] | None) -> Ending | None: ...


@dataclass
class Endings:
    rules: list[EndingRule]

    def checkpoint_state(self) -> dict[str, Any]:
        """What the rules need to go on from a checkpoint (each checkpoint holds it)."""
        state: dict[str, Any] = {}
        for rule in self.rules:
            if hasattr(rule, "checkpoint_state"):
                state.update(rule.checkpoint_state())
        return state

    def load(self, state: dict[str, Any]) -> None:
        """The rules as of a checkpoint's client state (a rollback's; {}: as at step 0)."""
        for rule in self.rules:
            if hasattr(rule, "load"):
                rule.load(state)

    def after_step(self, step: int, evaluation: dict[str, float] | None) -> Ending | None:
        """The first rule's answer, in order (a run the pruner ends stops no other way)."""
        for rule in self.rules:
            ending = rule.after_step(step, evaluation)
            if ending is not None:
                return ending
        return None


def endings_of(spec: RunSpec, heart: Heartbeat, resumed: dict[str, Any] | None = None) -> Endings:
    """The rules, as of the checkpoint this attempt starts from (`resumed`: its client
    state)."""
    rules: list[EndingRule] = [SweepPruning(spec), EarlyStopping(spec), GracefulStop(heart)]
    endings = Endings(rules)
    endings.load(resumed or {})
    return endings


class GracefulStop:
    def __init__(self, heart: Heartbeat):
        self.heart = heart

    def after_step(self, step: int, evaluation: dict[str, float] | None) -> Ending | None:
        if not self.heart.stop_after(step):  # every rank stops after the same step
            return None
        return Ending(
            Status.INTERRUPTED,
            f"stopped after step {step} as asked; checkpoint saved",
            weights=False,
            checkpoint=True,
            by_agent=True,
        )


class SweepPruning:
    """A sweep's pruner seen from the training loop (`hydra/sweeper=runner` with a pruner):
    after each evaluation rank 0 reports `sweep.metric` to the sweep's study
    (runner.sweeps), and every rank learns from it whether the trial stops here."""

    def __init__(self, spec: RunSpec):
        self.trial = spec.sweep.trial
        self.metric = spec.sweep.metric
        self.is_main = rdist.get_global_rank() == 0

    def after_step(self, step: int, evaluation: dict[str, float] | None) -> Ending | None:
        if evaluation is None or not self._prunes(step, evaluation):
            return None
        value = evaluation[self.metric]
        return Ending(
            Status.PRUNED,
            f"pruned after step {step} by the sweep's pruner ({self.metric} {value:.4g})",
            key="pruned",
            details={"after_step": step, "metric": self.metric, "value": value},
            weights=False,  # these are not a finished run's weights
            checkpoint=True,  # the trial's weights stay at hand
        )

    def _prunes(self, step: int, evaluation: dict[str, float]) -> bool:
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


class EarlyStopping:
    """`early_stop`: the run ends once `metric` has not improved on its best by more than
    `min_delta` for `patience` evaluations in a row (`mode`: min, lower is better; max).
    A non-finite value never counts as an improvement. The best, its step and the count
    are in every checkpoint: a restart or a resume goes on counting where it left off
    (afresh where the checkpoint watched another metric or way, or none)."""

    KEY = "early_stop"  # the checkpoint's client state

    def __init__(self, spec: RunSpec):
        self.options = spec.early_stop
        self.best: float | None = None
        self.best_step: int | None = None
        self.stale = 0  # evaluations since the best

    def checkpoint_state(self) -> dict[str, Any]:
        if self.options.patience is None:
            return {}
        kept = {"best": self.best, "best_step": self.best_step, "stale": self.stale}
        return {self.KEY: {"metric": self.options.metric, "mode": self.options.mode, **kept}}

    def load(self, state: dict[str, Any]) -> None:
        kept = state.get(self.KEY) or {}
        same = (kept.get("metric"), kept.get("mode")) == (self.options.metric, self.options.mode)
        self.best, self.best_step, self.stale = None, None, 0
        if same:
            self.best, self.best_step, self.stale = kept["best"], kept["best_step"], kept["stale"]

    def after_step(self, step: int, evaluation: dict[str, float] | None) -> Ending | None:
        options = self.options
        if options.patience is None or evaluation is None or options.metric not in evaluation:
            return None
        value = evaluation[options.metric]
        if self._improves(value):
            self.best, self.best_step, self.stale = value, step, 0
            return None
        self.stale += 1
        if self.stale < options.patience:
            return None
        return Ending(
            Status.COMPLETED,
            f"stopped early after step {step}: {options.metric} has not improved on "
            f"{self.best} (step {self.best_step}) for {self.stale} evaluations",
            key="stopped_early",
            details={
                "after_step": step,
                "metric": options.metric,
                "value": value,
                "best": self.best,
                "best_step": self.best_step,
                "patience": options.patience,
            },
        )

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        gain = self.best - value if self.options.mode == "min" else value - self.best
        return gain > self.options.min_delta
