"""early_stop: a run ends once its metric stops improving, as a completed run (model.pt
written, `stopped_early` in summary.json), by a rule the loop asks after every step
(runner.train.endings) like the pruner and the graceful stop."""

from __future__ import annotations

import dataclasses
import math

import pytest

from runner.rundir.summary import Status
from runner.spec.guard_specs import EarlyStopSpec
from runner.spec.schema import RunSpec
from runner.train.endings import EarlyStopping
from tests.helpers.cli import FAST
from tests.helpers.refusals import refused


def watch(**options: object) -> EarlyStopping:
    spec = dataclasses.replace(RunSpec(), early_stop=EarlyStopSpec(**options))  # type: ignore[arg-type]
    return EarlyStopping(spec)


def answers(rule: EarlyStopping, values: list[float], metric: str = "val/loss") -> list[int]:
    """The steps (2, 4, 6, ...) at which the rule ends the run, one evaluation each."""
    ended = []
    for i, value in enumerate(values):
        step = 2 * (i + 1)
        rule.after_step(step - 1, None)  # a step without an evaluation is never an answer
        if rule.after_step(step, {metric: value}) is not None:
            ended.append(step)
    return ended


def test_patience_counts_evaluations_without_an_improvement_over_min_delta() -> None:
    rule = watch(metric="val/loss", patience=2, min_delta=0.1, mode="min")
    # 1.0 best; 0.95 is no improvement (< min_delta); 0.85 is; 0.9 and nan are not
    assert answers(rule, [1.0, 0.95, 0.85, 0.9, math.nan]) == [10]
    assert rule.best == 0.85 and rule.best_step == 6


def test_the_ending_is_a_completed_run_that_says_why() -> None:
    rule = watch(metric="val/accuracy", patience=1, mode="max")
    assert rule.after_step(2, {"val/accuracy": 0.5}) is None
    ending = rule.after_step(4, {"val/accuracy": 0.5})
    assert ending is not None and ending.status is Status.COMPLETED and ending.weights
    assert ending.key == "stopped_early"
    assert ending.details == {
        "after_step": 4,
        "metric": "val/accuracy",
        "value": 0.5,
        "best": 0.5,
        "best_step": 2,
        "patience": 1,
    }


def test_off_without_patience_or_without_the_metric() -> None:
    assert answers(watch(metric="val/loss", mode="min"), [1.0] * 5) == []
    assert answers(watch(metric="val/acc", patience=1, mode="max"), [1.0] * 5) == []


@pytest.mark.slow
def test_a_run_on_a_plateau_stops_early_as_a_completed_run(cli) -> None:
    """lr=1e-12: the accuracy never moves, so the second evaluation after the first ends it."""
    run = cli(
        *FAST, "max_epochs=null", "max_steps=40", "eval_interval=2", "log_interval=2",
        "optimizer.lr=1e-12", "early_stop.patience=2", "nproc=2",
    )  # fmt: skip
    assert run.returncode == 0, run.output
    summary = run.summary()
    assert summary["status"] == "completed" and summary["steps"] == 6
    early = summary["stopped_early"]
    assert early["after_step"] == 6 and early["best_step"] == 2 and early["patience"] == 2
    assert early["metric"] == "val/accuracy"  # auto: sweep.metric's (the digits' accuracy)
    assert (run.run_dir / "model.pt").is_file()  # a finished run's weights
    assert run.metrics()[-1]["step"] == 6
    assert "completed 6 steps, stopped early (val/accuracy" in run.output


def test_an_early_stop_metric_the_run_never_evaluates_is_refused() -> None:
    found = refused(*FAST, "early_stop.patience=2", "early_stop.metric=train/loss")
    assert "early_stop.metric='train/loss': not a value this run evaluates" in found
    assert "valid: auto, val/loss, val/accuracy" in found


def test_the_count_is_in_the_checkpoint_and_goes_on_from_it() -> None:
    """After a restart from a checkpoint the rule ends the run where the one that never
    stopped ends it (58e01cd counted afresh: a restart stopped later, on other weights)."""
    import json

    from runner.heartbeat import Heartbeat
    from runner.train.endings import endings_of

    heart = Heartbeat(None, 0, 0, 0)  # no agent: never asked to stop
    spec = dataclasses.replace(
        RunSpec(), early_stop=EarlyStopSpec(metric="val/loss", patience=2, mode="min")
    )
    running = endings_of(spec, heart)
    assert running.after_step(2, {"val/loss": 1.0}) is None
    assert running.after_step(4, {"val/loss": 1.0}) is None  # one without a gain
    saved = json.loads(json.dumps(running.checkpoint_state()))  # as a checkpoint keeps it
    assert saved["early_stop"] == {
        "metric": "val/loss", "mode": "min", "best": 1.0, "best_step": 2, "stale": 1,
    }  # fmt: skip
    restarted = endings_of(spec, heart, saved)
    for rule in (running, restarted):
        ending = rule.after_step(6, {"val/loss": 1.0})
        assert ending is not None and ending.details["best_step"] == 2
    watching_another = dataclasses.replace(
        spec, early_stop=EarlyStopSpec(metric="val/accuracy", patience=2, mode="max")
    )
    afresh = endings_of(watching_another, heart, saved)
    assert afresh.after_step(6, {"val/accuracy": 0.5}) is None  # a new best, not a stop
