"""The root cause of a failed run is the first failure that is not fallout from it."""

from __future__ import annotations

from runner.cli.outcome import format_error
from runner.launch.failures import RankFailure, is_comms_error, root_cause


def test_comms_errors_are_recognised() -> None:
    assert is_comms_error(
        "RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    assert is_comms_error("DistBackendError", "whatever")
    assert not is_comms_error("ValueError", "shapes do not match")


def test_killed_rank_beats_peer_that_lost_its_connection() -> None:
    killed = RankFailure(rank=1, exitcode=-9, time=100.5)
    fallout = RankFailure(
        rank=0,
        exitcode=1,
        time=100.0,
        error_type="RuntimeError",
        message="Connection closed by peer",
    )
    assert root_cause([fallout, killed]) is killed
    assert "killed by SIGKILL" in killed.headline()


def test_earliest_real_error_wins_then_lowest_rank() -> None:
    a = RankFailure(rank=3, exitcode=1, time=5.0, error_type="ValueError", message="bad")
    b = RankFailure(rank=1, exitcode=1, time=6.0, error_type="KeyError", message="x")
    c = RankFailure(rank=0, exitcode=1, time=5.0, error_type="ValueError", message="bad")
    assert root_cause([a, b]) is a
    assert root_cause([a, c]) is c


def test_between_nodes_hangs_the_rank_furthest_behind_is_the_cause() -> None:
    """Each node's watchdog names its own stuck rank; clocks decide nothing at the ms level."""
    node0 = RankFailure(rank=1, exitcode=-9, time=10.000, error_type="Hang", message="a", beats=7)
    node1 = RankFailure(rank=3, exitcode=-9, time=10.002, error_type="Hang", message="b", beats=6)
    killed = RankFailure(rank=0, exitcode=-9, time=14.0)
    assert root_cause([node0, killed, node1]) is node1
    assert node1.headline() == "hung: b"
    assert RankFailure.from_dict(node1.as_dict()) == node1  # as sent between nodes


def test_report_shows_rank_traceback_and_log() -> None:
    failure = RankFailure(
        rank=1,
        exitcode=1,
        time=1.0,
        error_type="ChaosError",
        message="boom",
        traceback="Traceback (most recent call last):\n  File x\nChaosError: boom",
        log=None,
    )
    text = format_error(failure.summary_error(others=1))
    assert "rank 1 raised ChaosError: boom" in text
    assert "ChaosError: boom" in text.splitlines()[-2]
    assert "1 other rank(s)" in text


def test_rank_stopped_by_the_agent_is_not_the_cause() -> None:
    crashed = RankFailure(rank=1, exitcode=-6, time=10.0)
    stopped = RankFailure(rank=0, exitcode=-15, time=10.0)
    assert root_cause([stopped, crashed]) is crashed
    assert "SIGABRT" in crashed.headline()
