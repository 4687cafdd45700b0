"""The hang watchdog's judgement, on real heartbeat slots (ranks played by this process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.heartbeat import Heartbeat, Phase
from runner.launch.watchdog import Watchdog
from runner.rundir.files import RunDir
from runner.spec.guard_specs import WatchdogSpec

SPEC = WatchdogSpec(timeout=10, first_step_timeout=100, eval_timeout=50, checkpoint_timeout=None)


@pytest.fixture
def watchdog(tmp_path: Path):
    dog = Watchdog(SPEC, RunDir(tmp_path), nproc=2)
    yield dog
    dog.stop()
    assert not dog.path.exists()


def ranks(dog: Watchdog) -> list[Heartbeat]:
    return [Heartbeat(str(dog.path), local_rank=r, rank=4 + r, attempt=0) for r in range(2)]


def test_a_rank_over_its_phase_limit_is_a_hang_and_the_one_behind_is_named(watchdog) -> None:
    r0, r1 = ranks(watchdog)
    assert watchdog.check(0.0) is None  # both starting: first_step_timeout applies
    assert watchdog.check(99.0) is None
    for beat in (r0, r1):
        beat.beat(Phase.BATCH, 1)
        beat.beat(Phase.STEP)
    assert watchdog.check(100.0) is None
    r0.beat(Phase.BATCH, 2)  # rank 4 waits in step 2's collective for rank 5
    assert watchdog.check(101.0) is None
    assert watchdog.check(110.5) is not None  # 10.5 s since rank 5's last beat
    live = watchdog.check(111.0)
    failure = watchdog.report(live, 111.0)
    assert failure.rank == 5 and failure.error_type == "Hang"
    assert failure.headline().startswith("hung: rank 5 after step 1 (logging or loading")
    assert "also stuck: rank 4 in step 2" in failure.message
    assert "(watchdog.timeout=10)" in failure.message
    assert watchdog.caused({123}) is None  # it killed nobody yet


def test_progress_resets_the_clock_and_slow_phases_have_their_own_limit(watchdog) -> None:
    r0, r1 = ranks(watchdog)
    for t in range(0, 100, 5):  # steady steps: never a hang
        for beat in (r0, r1):
            beat.beat(Phase.BATCH, t)
            beat.beat(Phase.STEP)
        assert watchdog.check(float(t)) is None
    for beat in (r0, r1):
        beat.beat(Phase.EVAL)
    assert watchdog.check(200.0) is None
    assert watchdog.check(249.0) is None  # eval_timeout=50
    assert watchdog.check(251.0) is not None
    for beat in (r0, r1):
        beat.beat(Phase.SAVE)  # checkpoint_timeout=None: no limit while writing
    assert watchdog.check(300.0) is None
    assert watchdog.check(10_000.0) is None


def test_exited_ranks_are_not_watched(watchdog, tmp_path: Path) -> None:
    r0, _ = ranks(watchdog)
    watchdog.killed.add(os.getpid())  # this process plays both ranks: as if it was killed
    assert watchdog.check(0.0) is None and watchdog.check(1e6) is None


def test_another_agents_file_of_fewer_ranks_reads_as_its_own_ranks() -> None:
    """A reader that looks at every agent's file on the machine (several runs at once) asks
    for its own run's rank count: a file of fewer ranks gives its own, no error."""
    from runner import heartbeat

    path = heartbeat.create(1)
    try:
        Heartbeat(str(path), local_rank=0, rank=0, attempt=0).beat(Phase.BATCH, 3)
        beats = heartbeat.read(path, 2)
        assert [(b.pid, b.step) for b in beats] == [(os.getpid(), 3)]
        assert heartbeat.finished_step(path, 2) == 2
    finally:
        path.unlink()


def test_a_killed_agents_file_still_says_where_its_ranks_stood() -> None:
    """An agent killed (a second Ctrl-C) cannot say where the run stood; the `runner` that
    started it reads the file the agent left, by its pid, before removing it: the
    interrupted summary's steps (it had said 0, from metrics.jsonl before its first record)."""
    from runner import heartbeat

    path = heartbeat.create(2)  # as agent os.getpid()
    try:
        assert heartbeat.finished_step_of(os.getpid()) is None  # no rank started
        Heartbeat(str(path), local_rank=0, rank=0, attempt=0).beat(Phase.BATCH, 7)
        Heartbeat(str(path), local_rank=1, rank=1, attempt=0).beat(Phase.STEP, 6)
        assert heartbeat.finished_step_of(os.getpid()) == 6
    finally:
        path.unlink()
    assert heartbeat.finished_step_of(os.getpid()) is None  # none left
