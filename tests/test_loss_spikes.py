"""Loss spikes: what counts as one (fast), and what each action does to a real run whose
rank 1 has its loss multiplied by 100 at one step (chaos.action=spike)."""

from __future__ import annotations

import pytest

from runner.spec.guard_specs import LossSpikeSpec
from runner.train.guards.loss_spikes import SpikeWatch
from tests.helpers.cli import FAST


def test_a_spike_is_factor_times_the_window_mean_for_patience_steps_in_a_row() -> None:
    watch = SpikeWatch(LossSpikeSpec(window=3, factor=2.0, patience=2, action="log"))
    assert [watch.observe(s, 1.0) for s in (1, 2, 3)] == [None] * 3  # the window fills
    assert watch.observe(4, 2.5) is None  # one spike: patience is 2
    assert watch.observe(5, 1.0) is None  # the run of spikes is broken
    assert watch.observe(6, 3.0) is None
    spike = watch.observe(7, 4.0)
    assert spike is not None and spike.steps == [6, 7] and spike.loss == 4.0
    assert spike.mean == 1.0  # spikes never join the mean
    assert "loss spike at steps 6-7: loss 4 is 4.0x the mean 1" in spike.describe()

    watch.rewind(2)  # a rollback to step 2: the steps after it are forgotten
    assert [s for s, _ in watch.window] == [2]  # (1 left the window when 5 came)
    assert watch.observe(3, 9.0) is None  # the window is not full again yet


def test_a_checkpoint_keeps_the_watch_so_a_restart_sees_the_same_spikes() -> None:
    """A restart from a checkpoint goes on from the losses it had watched (58e01cd watched
    afresh: an empty window, so the spike one step after the restart went unseen)."""
    import json

    from runner.train.guards.loss_spikes import LossSpikes

    spec = LossSpikeSpec(window=3, factor=2.0, patience=2, action="stop")
    running = LossSpikes(spec)
    assert running.check([(1, 1.0), (2, 1.1), (3, 0.9), (4, 2.5)]) is None  # one spike so far
    saved = json.loads(json.dumps(running.checkpoint_state()))  # as a checkpoint keeps it
    restarted = LossSpikes(spec, saved)
    for watch in (running, restarted):
        spike = watch.check([(5, 3.0)])
        assert spike is not None and spike.steps == [4, 5], spike
    other = LossSpikes(LossSpikeSpec(window=5, factor=2.0, patience=2, action="stop"), saved)
    assert other.check([(5, 3.0)]) is None  # another window: watched afresh


SPIKED = [
    *FAST,
    "max_epochs=null",
    "max_steps=24",
    "log_interval=2",
    "checkpoint.interval=4",
    "loss_spike.window=4",
    "loss_spike.patience=1",
    "chaos.kill_rank=1",
    "chaos.at_step=10",
    "chaos.action=spike",
]


@pytest.mark.slow
def test_rollback_restores_the_checkpoint_before_and_skips_the_batch(cli) -> None:
    result = cli(*SPIKED, "loss_spike.action=rollback")
    assert result.returncode == 0, result.output
    log = result.rank_log(0)
    assert "loss spike at step 10: loss" in log
    assert (
        "rolled back to" in log and "step_00000008 (step 8); skipping the batch of step 10" in log
    )
    summary = result.summary()
    assert summary["loss_spike_rollbacks"] == [{"steps": [10], "to_step": 8}]
    steps = [r["step"] for r in result.metrics()]
    assert steps == sorted(set(steps)) and 10 not in steps  # rewound, no step twice
    assert steps[-1] == 24 and summary["final"]["train/loss"] < 2.3  # trains on, unharmed


@pytest.mark.slow
def test_stop_ends_the_run_naming_the_step(cli) -> None:
    result = cli(*SPIKED, "loss_spike.action=stop")
    assert result.returncode == 1
    message = result.summary()["error"]["message"]
    assert "loss spike at step 10" in message and "loss_spike.action=stop" in message


@pytest.mark.slow
def test_log_warns_and_writes_every_record_once(cli) -> None:
    """The default action: a warning, and the run goes on. (Its records were written twice
    once: the spike's reduction wrote them, and so did the loop after it.)"""
    result = cli(*SPIKED, "loss_spike.action=log")
    assert result.returncode == 0, result.output
    assert "loss spike at step 10: loss" in result.rank_log(0)
    steps = [r["step"] for r in result.metrics()]
    assert steps == sorted(set(steps)) and 10 in steps and steps[-1] == 24
