"""A graceful stop (SIGUSR1/SIGUSR2 to runner, SLURM's --signal): every rank stops after
the same step with a checkpoint, and resume=auto ends bit for bit on the uninterrupted run.
Also the parts on their own: the agreement on heartbeat slots, and the SLURM requeue's
bookkeeping (the cluster itself is in tests/slurm)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from runner import heartbeat
from runner.cli.requeue import continue_after_stop, first_run_dir
from runner.heartbeat import Heartbeat, Phase
from runner.launch.stopping import GracefulStop
from tests.helpers.cli import FAST, HANG, MATRIX, start_runner, wait_until
from tests.helpers.nodes import finish, free_port, only_run, start_node
from tests.helpers.weights import same_weights


@pytest.mark.slow
@pytest.mark.parametrize("shm", [pytest.param("null", marks=MATRIX), "false"])  # false: the warm-up
def test_sigusr1_stops_every_rank_after_one_step_and_resume_ends_bit_for_bit(
    cli, tmp_path: Path, shm: str
) -> None:
    """4 ranks: with 3 or more, gloo's all-reduce (shm_allreduce=false) would round DDP's
    first step after a start differently without the warm-up pass (runner.engines.ddp), and
    the resumed run would not end bit for bit; the shared-memory all-reduce (the default
    here) sums in rank order and needs no warm-up."""
    args = [*FAST, "nproc=4", "max_epochs=null", "max_steps=150", "checkpoint.interval=25"]
    args.append(f"parallelism.shm_allreduce={shm}")
    run_dir = tmp_path / "stopped"
    proc = start_runner(tmp_path, run_dir, *args)
    wait_until(proc, (run_dir / "checkpoints" / "latest").exists)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    first = json.loads((run_dir / "summary.json").read_text())
    step = first["stopped"]["after_step"]
    assert first["status"] == "interrupted" and first["steps"] == step
    assert first["stopped"]["asked_by"] == "SIGUSR1"
    assert first["stopped"]["checkpoint"] == f"checkpoints/step_{step:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith(f"{step:08d}")
    for rank in range(4):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"stopped after step {step} as asked" in log
    assert f"stopped after step {step} (SIGUSR1)" in err

    resumed = cli(*args, "resume=auto", name="stopped")
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary()["resumed_from"] == step
    uninterrupted = cli(*args, name="uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.output
    assert same_weights(uninterrupted.run_dir, run_dir)


@pytest.mark.slow
def test_a_stop_asked_of_node_1_stops_both_nodes_after_the_same_step(tmp_path: Path) -> None:
    steps = ["max_epochs=null", "max_steps=4000", "checkpoint.interval=null", "log_interval=10"]
    cluster = [*FAST, *steps, "nodes=2", "nproc=1", "master_addr=127.0.0.1"]
    cluster.append(f"master_port={free_port()}")
    node0, node1 = start_node(tmp_path, 0, *cluster), start_node(tmp_path, 1, *cluster)
    deadline = time.monotonic() + HANG
    while not list(tmp_path.glob("runs/*/metrics.jsonl")):  # both nodes train
        assert time.monotonic() < deadline and node0.poll() is None, "no step was logged"
        time.sleep(0.2)
    node1.send_signal(signal.SIGUSR2)  # node 0 is not signalled: it learns from the store
    (code0, out0, _), (code1, out1, _) = finish(node0, node1, timeout=HANG)
    assert (code0, code1) == (140, 140), out0 + out1
    run = only_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    step = summary["stopped"]["after_step"]
    assert summary["status"] == "interrupted" and 0 < step < 4000
    assert summary["stopped"]["asked_by"].startswith("SIGUSR2 on node 1")
    assert json.loads((run / "node1" / "summary.json").read_text())["status"] == "interrupted"
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"stopped after step {step} as asked" in log


def test_the_agreed_step_is_one_no_rank_has_passed(tmp_path: Path) -> None:
    path = heartbeat.create(3)
    try:
        ranks = [Heartbeat(str(path), local_rank=r, rank=r, attempt=0) for r in range(3)]
        ranks[0].beat(Phase.STEP, 7)  # between steps: it may already be on its way into 8
        ranks[1].beat(Phase.BATCH, 8)  # inside step 8: it checks at its end
        ranks[2].beat(Phase.START, 0)  # starting up: bounded by the others
        heartbeat.request_stop(path)
        assert heartbeat.reachable_step(path, 3) == 8

        def agent() -> None:  # writes the step once the ranks paused
            time.sleep(0.2)
            heartbeat.set_stop_step(path, 8)

        threading.Thread(target=agent).start()
        started = time.monotonic()
        assert ranks[1].stop_after(8)  # paused until the step was agreed, then stops here
        assert time.monotonic() - started >= 0.15
        assert not ranks[0].stop_after(7)  # one more step to go for this one
        assert ranks[0].stop_after(8)
        assert not heartbeat.stopped(path, 3)
        ranks[0].beat(Phase.STOPPED, 8)
        assert heartbeat.stopped(path, 3)
    finally:
        path.unlink()


def test_a_second_signal_inside_the_first_s_handler_neither_blocks_nor_asks_twice(
    capfd,
) -> None:
    """SLURM's SIGUSR1 and the parent's relay of it reach the agent together: the second
    handler can run inside the first one, in the same thread. Before, it waited for the lock
    the first held, and the agent's main thread hung (found by the SLURM time-limit test)."""
    path = heartbeat.create(1)
    try:
        Heartbeat(str(path), local_rank=0, rank=0, attempt=0).beat(Phase.BATCH, 4)
        stop = GracefulStop(path, 1)
        previous = signal.signal(signal.SIGUSR1, stop._on_signal)
        try:
            with stop._lock:  # the first handler, interrupted while it holds the lock
                signal.raise_signal(signal.SIGUSR1)  # returns: no wait in a handler
            assert stop.asked_by is None
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)  # the same request again
        finally:
            signal.signal(signal.SIGUSR1, previous)
        deadline = time.monotonic() + 10
        while stop.step is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.asked_by == "SIGUSR1" and stop.step == 4
        assert capfd.readouterr().err.count("stopping every rank after the same step") == 1
    finally:
        path.unlink()


def test_without_a_request_a_rank_never_stops(tmp_path: Path) -> None:
    path = heartbeat.create(1)
    try:
        rank = Heartbeat(str(path), local_rank=0, rank=0, attempt=0)
        assert not any(rank.stop_after(step) for step in range(1, 100))
        assert not Heartbeat(None, 0, 0, 0).stop_after(5)  # no agent (a trainer in a test)
    finally:
        path.unlink()


def test_a_restarted_slurm_job_finds_the_run_its_first_start_began(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, other, fresh = runs / "2026-01-01_10-00-00", runs / "2026-01-01_11-00-00", runs / "z"
    for directory, job in ((first, "c:17"), (other, "c:18"), (fresh, None)):
        directory.mkdir(parents=True)
        (directory / "env.json").write_text(json.dumps({"slurm_job": job}))
    env = {"SLURM_JOB_ID": "17", "SLURM_CLUSTER_NAME": "c", "SLURM_RESTART_COUNT": "1"}
    assert first_run_dir(fresh, env) == first
    assert first_run_dir(other, {**env, "SLURM_JOB_ID": "18"}) == other  # a fixed run dir
    assert first_run_dir(fresh, {**env, "SLURM_JOB_ID": "99"}) == fresh  # never started
    assert first_run_dir(fresh, {}) == fresh  # not in SLURM


@pytest.mark.slow
def test_after_a_stop_the_signal_s_owner_decides_else_the_job_is_requeued(caplog) -> None:
    seen = []
    continue_after_stop(signal.SIGUSR2, lambda *a: seen.append(a), 0, 40, {})
    assert seen == [(signal.SIGUSR2, None)]  # submitit's handler: it requeues and exits
    continue_after_stop(signal.SIGUSR1, None, 0, 40, {})  # not in SLURM: nothing to requeue
    continue_after_stop(signal.SIGUSR1, None, 1, 40, {"SLURM_JOB_ID": "5"})  # node 1: node 0 does
    assert caplog.records == []
    continue_after_stop(signal.SIGUSR1, None, 0, 40, {"SLURM_JOB_ID": "5", "PATH": "/nowhere"})
    assert "could not requeue SLURM job 5" in caplog.text
    assert "resume=auto" in caplog.text
