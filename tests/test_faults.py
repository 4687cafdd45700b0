"""A failing rank takes the run down fast and is named; signals stop every process of a run."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import FAST, MATRIX, RESTARTABLE, start_runner, wait_until
from tests.helpers.nodes import chaos_time

pytestmark = pytest.mark.slow
LONG = [*FAST, "max_epochs=null", "max_steps=100000", "log_interval=5"]


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names this run directory (agent and ranks)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(
                proc.info["cmdline"] or []
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("action", ["raise", "sigkill"])
def test_failing_rank_ends_the_run_and_is_named(cli, action: str) -> None:
    result = cli(*LONG, "chaos.kill_rank=1", "chaos.at_step=3", f"chaos.action={action}")
    ended = time.time()
    assert result.returncode == 1, result.output
    teardown = ended - chaos_time(result.run_dir, 1)
    assert teardown < 5.0, f"the run took {teardown:.1f}s to end after rank 1 failed"

    summary = result.summary()
    assert summary["status"] == "failed"
    error = summary["error"]
    assert error["rank"] == 1
    if action == "raise":
        assert error["exitcode"] == 1
        assert re.match(
            r"rank 1 on \S+ raised ChaosError: chaos: rank 1 raised at step 3", error["message"]
        )
        assert "ChaosError" in error["traceback"]
        assert error["message"] in result.stderr
        assert "traceback (last lines)" in result.stderr and "maybe_fail" in result.stderr
    else:
        assert error["exitcode"] == -9
        assert re.match(r"rank 1 on \S+ was killed by SIGKILL", error["message"])
        assert error["message"] in result.stderr
        assert "chaos: rank 1 fails (sigkill) at step 3" in result.stderr  # the tail of its log
    assert "logs/rank1.log" in result.stderr
    assert summary["steps"] < 3
    assert not run_processes(result.run_dir)


def listening_addresses(processes: list[psutil.Process]) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket these processes hold."""
    found = []
    for process in processes:
        for conn in process.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port))
    return found


# SIGINT takes the same relay as SIGTERM; make test types it as Ctrl-C (tests/test_terminal.py)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=MATRIX), signal.SIGTERM])
@pytest.mark.cold_start  # it reads the command's process tree: its agent a child
def test_signal_to_runner_stops_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    proc = start_runner(tmp_path, run_dir, *LONG)
    metrics = run_dir / "metrics.jsonl"
    wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 60)
    ranks = run_processes(run_dir)
    assert len(ranks) >= 3, "agent and two ranks should be running"
    # Nobody else gets in: the run's stores and the ranks' sockets listen on loopback only.
    runner = psutil.Process(proc.pid)
    listening = listening_addresses([runner, *runner.children(recursive=True)])
    assert listening, "the agent's store should be listening"
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening

    sent = time.time()
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=30)
    assert time.time() - sent < 10
    assert proc.returncode == 128 + sig
    assert "Traceback" not in stderr
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"left behind: {alive}"
    assert not run_processes(run_dir)

    summary = __import__("json").loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["steps"] >= 10


@pytest.mark.parametrize("log_interval", [2, 100])
def test_nan_loss_stops_the_run_and_is_never_saved(cli, log_interval: int) -> None:
    """chaos nan: rank 1's loss is NaN at step 3. Found without a per-step host sync, on the
    next log step's loss reduction (log_interval 2) or before the next checkpoint (log
    interval 100): the run fails naming step and rank, and step 2 stays the latest."""
    result = cli(
        *RESTARTABLE,
        f"log_interval={log_interval}",
        "chaos.kill_rank=1",
        "chaos.at_step=3",
        "chaos.action=nan",
    )
    assert result.returncode == 1
    summary = result.summary()
    assert summary["status"] == "failed"
    assert "non-finite loss (NaN or inf) at step 3 on rank(s) 1" in summary["error"]["message"]
    assert "NonFiniteError" in result.stderr
    checkpoints = result.run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert not (checkpoints / "step_00000004").exists()
    assert not (result.run_dir / "model.pt").exists()
    assert all(m["step"] < 3 for m in result.metrics())


@MATRIX  # make test's: tests/test_resume.py's fsdp hang, restarted (the words, the stacks)
def test_hung_rank_is_named_with_every_stack_and_the_run_ends(cli) -> None:
    """chaos hang: rank 1 stops for good at the start of step 3, and rank 0 waits for it in
    the gradient all-reduce. The watchdog ends the run within its timeout (+ a few seconds),
    names rank 1 as the one that stopped first, and every rank's stack is in its log."""
    timeout = 3
    result = cli(
        *LONG,
        "chaos.kill_rank=1",
        "chaos.at_step=3",
        "chaos.action=hang",
        f"watchdog.timeout={timeout}",
    )
    ended = time.time()
    assert result.returncode == 1, result.output
    hung_at = float(
        re.search(r"chaos: rank 1 hangs at step 3 at t=([\d.]+)", result.rank_log(1)).group(1)
    )
    assert ended - hung_at < timeout + 10, f"{ended - hung_at:.1f}s from the hang to the end"

    error = result.summary()["error"]
    assert result.summary()["status"] == "failed" and error["rank"] == 1
    assert error["message"].startswith("hung: rank 1 after step 2")
    assert "stopped first; also stuck: rank 0 in step 3" in error["message"]
    assert f"(watchdog.timeout={timeout})" in error["message"]
    assert error["message"] in result.stderr and "Traceback" not in result.stderr
    for rank, frame in ((1, "in maybe_fail"), (0, "in backward")):  # where each one waits
        stack = result.rank_log(rank).split("===== runner watchdog:")[1]
        assert "the Python stack of every thread follows" in stack and frame in stack, stack
    assert not run_processes(result.run_dir)


def test_nan_under_skip_costs_one_step_alike_for_ddp_and_deepspeed(cli) -> None:
    """nonfinite=skip, chaos nan: rank 1's loss is NaN at step 3. ddp skips through the
    guard's per-step verdict, zero2 through DeepSpeed's own norm check; either way every rank
    drops step 3 (weights, optimizer state and schedule), logs train/skipped_steps, and the
    two end with the same weights."""
    from tests.helpers.weights import max_relative_difference

    runs = {
        parallelism: cli(
            *RESTARTABLE,
            f"parallelism={parallelism}",
            "nonfinite=skip",
            "chaos.kill_rank=1",
            "chaos.at_step=3",
            "chaos.action=nan",
            name=parallelism,
        )
        for parallelism in ("ddp", "zero2")
    }
    for result in runs.values():
        assert result.returncode == 0, result.output
        skipped = {m["step"]: m["train/skipped_steps"] for m in result.metrics()}
        assert skipped[2] == 0 and skipped[4] == skipped[12] == 1
        assert "nonfinite: step 3 skipped (non-finite" in result.rank_log(0)
    lrs = [[m["lr"] for m in r.metrics()] for r in runs.values()]
    assert lrs[0] == lrs[1]  # the schedule held still for the skipped step under both
    assert max_relative_difference(runs["ddp"].run_dir, runs["zero2"].run_dir) < 1e-5


@pytest.mark.cold_start  # it reads the command's process tree: its agent a child
def test_an_agent_killed_by_sigkill_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """The agent removes its heartbeat file when it ends; SIGKILL gives it no chance, so the
    `runner` that started it removes it (and the next agent on the machine would)."""
    from runner import heartbeat

    run_dir = tmp_path / "run"
    proc = start_runner(tmp_path, run_dir, *LONG)
    metrics = run_dir / "metrics.jsonl"
    wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 60)
    (agent,) = [
        p for p in psutil.Process(proc.pid).children() if "runner.launch.agent" in p.cmdline()
    ]
    owner = heartbeat._owner_prefix(agent.pid)
    where = Path(heartbeat._directory())
    assert list(where.glob(f"{owner}-*")), "the agent's heartbeat file should exist"
    ranks = run_processes(run_dir)
    agent.kill()
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    psutil.wait_procs(ranks, timeout=10)
    assert not list(where.glob(f"{owner}-*")), "the SIGKILLed agent's heartbeat file stayed"


def test_the_next_agent_removes_heartbeat_files_of_agents_that_are_gone() -> None:
    from runner import heartbeat

    child = psutil.Popen(["true"])
    child.wait()  # a pid that is gone
    where = Path(heartbeat._directory())
    stale = where / f"{heartbeat._owner_prefix(child.pid)}-abc"
    stale.write_bytes(b"\0" * 64)
    ours = heartbeat.create(1)  # this process is alive: its own file stays
    try:
        assert not stale.exists()
        assert ours.exists() and ours.name.startswith(heartbeat._owner_prefix(os.getpid()))
        assert heartbeat.sweep_stale() == []
    finally:
        ours.unlink()
        stale.unlink(missing_ok=True)


@pytest.mark.cold_start  # it reads the command's process tree: its agent a child
def test_sigterm_as_a_restarted_run_ends_changes_nothing(tmp_path: Path) -> None:
    """A rank killed and restarted, then SIGTERM over and over from the moment rank 0 wrote
    summary.json (`completed`): once to `runner`, which relays it, and to the agent until it
    exits, so every part of its teardown (closing its fork server, torch elastic's handler
    still installed) meets one. On
    58e01cd the agent raised SignalException with a traceback there, and runner printed
    `completed` and exited non-zero."""
    run_dir = tmp_path / "run"
    chaos = ["max_restarts=1", "chaos.kill_rank=1", "chaos.at_step=5"]
    proc = start_runner(tmp_path, run_dir, *RESTARTABLE, "nproc=2", *chaos)
    summary = run_dir / "summary.json"
    wait_until(proc, lambda: summary.exists() and '"completed"' in summary.read_text())
    agent = next(
        p for p in psutil.Process(proc.pid).children() if "runner.launch.agent" in p.cmdline()
    )
    proc.send_signal(signal.SIGTERM)  # once, as a user or a scheduler does: relayed
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):  # and the agent's every moment after that
            agent.send_signal(signal.SIGTERM)
        time.sleep(0.005)
    out, err = proc.communicate(timeout=30)
    assert "Traceback" not in out + err and "SignalException" not in out + err, out + err
    assert proc.returncode == 0, out + err
    assert err.count("runner: completed 12 steps after 1 restart on 2 rank(s)") == 1, err
    assert __import__("json").loads(summary.read_text())["status"] == "completed"
