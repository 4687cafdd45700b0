"""launcher=ray on a real local Ray cluster (the wheel's raylet and GCS): the ranks are Ray
Train workers, and what users rely on holds: the same weights as launcher=elastic, a killed
worker restarted by Ray and resumed bit for bit, a failing rank named, a bad address refused
before any worker starts, and no Ray process left behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.launch.ray_launch import LOCAL_CLUSTER
from tests.helpers.cli import FAST, HANG

# SLURM's and Ray's processes as they start them: no warm server (tests/helpers/warm.py)
COLD_START = True

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # make test-ray
pytest.importorskip("ray")

ARGS = [*FAST, "max_steps=8", "log_interval=2", "checkpoint.interval=2"]
LONGER = [*FAST, "max_epochs=null", "max_steps=4000", "log_interval=5", "checkpoint.interval=null"]


def ray_processes() -> dict[int, str]:
    """Live Ray processes (GCS, raylets, workers and actors) by pid."""
    import psutil

    found = {}
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # ended; reparented to an init that has not reaped it yet
        line = " ".join(process.info["cmdline"] or [process.info["name"] or ""])
        if any(name in line for name in ("raylet", "gcs_server", "ray::")):
            found[process.pid] = line[:120]
    return found


def worker_niceness() -> list[int]:
    """The niceness of each live Ray Train worker (a rank)."""
    import psutil

    return [
        process.info["nice"]
        for process in psutil.process_iter(["cmdline", "nice"])
        if "RayTrainWorker" in " ".join(process.info["cmdline"] or [])
    ]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_sigusr1_stops_a_run_on_a_local_cluster_with_a_checkpoint(tmp_path: Path) -> None:
    """Every worker stops after the same step with a checkpoint, as under elastic (a local
    cluster: the workers share the agent's heartbeat file), and the cluster is gone."""
    import signal

    import psutil

    from tests.helpers.cli import start_runner, wait_until

    run_dir = tmp_path / "stopped"
    before = ray_processes()  # another test's cluster, if any
    proc = start_runner(tmp_path, run_dir, *LONGER, "launcher=ray")
    wait_until(proc, (run_dir / "metrics.jsonl").exists, timeout=HANG)
    niceness = worker_niceness()
    runners = psutil.Process(proc.pid).nice()  # `make test` under nice: ranks inherit it
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=HANG)
    assert niceness == [runners] * 2, "the ranks run at the priority elastic ranks have"
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "2 Ray worker(s) on a local Ray cluster" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["stopped"]["after_step"]
    assert summary["status"] == "interrupted" and "Traceback" not in err
    assert summary["stopped"]["checkpoint"] == f"checkpoints/step_{step:08d}"
    for rank in (0, 1):
        assert (
            f"stopped after step {step} as asked"
            in (run_dir / "logs" / f"rank{rank}.log").read_text()
        )
    left = {pid: line for pid, line in ray_processes().items() if pid not in before}
    assert not left, f"the local cluster runner started must be gone: {left}"


def test_ray_workers_train_what_elastic_ranks_do_even_when_one_is_killed(cli, two_nodes) -> None:
    """Rank 1 SIGKILLed at step 5: Ray restarts the worker group, which resumes from the
    checkpoint of step 4; the weights are those of two elastic ranks that never stopped."""
    cluster, _ = two_nodes
    elastic = cli(*ARGS, name="elastic")
    assert elastic.returncode == 0, elastic.output
    killed = cli(
        *ARGS, *ON_CLUSTER, f"launcher.address={cluster.address}", "max_restarts=1",
        "chaos.kill_rank=1", "chaos.at_step=5", name="killed",
    )  # fmt: skip
    assert killed.returncode == 0, killed.output
    assert f"2 Ray worker(s) on {cluster.address}" in killed.output
    summary = killed.summary()
    assert summary["status"] == "completed" and (killed.run_dir / "logs" / "rank1.log").is_file()
    assert summary["restarts"] == 1 and summary["resumed_from"] == 4
    reference = weights(elastic.run_dir)
    assert all(torch.equal(reference[k], v) for k, v in weights(killed.run_dir).items())


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[Any, Any]]:
    """A Ray cluster of two simulated nodes (ray.cluster_utils: a raylet each), one worker
    slot on each, so that a 2-worker run spans both. Its workers run at nice 0, as those of
    a local cluster runner starts: at Ray's nice 15 the other tests' processes starve them
    (a run of 34 s took 395 s beside two busy loops)."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 2, "resources": {"slot": 1}, "_system_config": LOCAL_CLUSTER}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    node = cluster.add_node(num_cpus=1, resources={"slot": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster, node
    finally:
        cluster.shutdown()


ON_CLUSTER = ["launcher=ray", "launcher.resources_per_worker={slot:1}"]


def test_the_guards_hold_and_a_failing_worker_is_named(cli, two_nodes) -> None:
    """On two Ray nodes of one host (the agent's heartbeat file has a slot per rank, not
    per Ray node's LOCAL_RANK): the non-finite guard stops the run naming step and rank; the
    watchdog names a hung rank and ends the run (with max_restarts, Ray would restart it, as
    after any failure); a run the cluster has no room for fails after
    launcher.start_timeout, saying what it asked for and what the cluster has."""
    cluster, _ = two_nodes
    on_cluster = [*ARGS, *ON_CLUSTER, f"launcher.address={cluster.address}"]
    nan = cli(*on_cluster, "chaos.kill_rank=1", "chaos.at_step=3", "chaos.action=nan", name="nan")
    assert nan.returncode == 1, nan.output
    error = nan.summary()["error"]
    assert "non-finite loss (NaN or inf) at step 3 on rank(s) 1" in error["message"]
    assert error["rank"] in (0, 1) and "NonFiniteError" in nan.output

    hung = cli(
        *on_cluster, "chaos.kill_rank=1", "chaos.at_step=3", "chaos.action=hang",
        "watchdog.timeout=3", name="hung",
    )  # fmt: skip
    assert hung.returncode == 1, hung.output
    error = hung.summary()["error"]
    assert error["rank"] == 1 and error["message"].startswith("hung: rank 1 after step 2")
    assert "also stuck: rank 0 in step 3" in error["message"] and "Traceback" not in hung.stderr
    assert "the Python stack of every thread follows" in hung.rank_log(1)

    crowded = cli(
        *on_cluster, "nproc=3", "global_batch_size=48", "launcher.start_timeout=2", name="crowded"
    )
    assert crowded.returncode == 1, crowded.output
    message = crowded.summary()["error"]["message"]
    assert message.startswith("launcher=ray: no room on the Ray cluster for 3 worker(s) of")
    assert "{slot: 1} each within launcher.start_timeout=2 s" in message and "slot 2" in message
    assert message in crowded.stderr and "Traceback" not in crowded.stderr


def test_sigterm_ends_a_run_on_a_cluster_and_its_workers(tmp_path: Path, two_nodes) -> None:
    """On a cluster runner joined, SIGUSR1 cannot reach workers on other hosts: runner says
    so and goes on; SIGTERM ends the run at once, interrupted, and Ray ends its workers."""
    import signal

    from tests.helpers.cli import start_runner, wait_until

    cluster, _ = two_nodes
    run_dir = tmp_path / "terminated"
    args = [*LONGER, *ON_CLUSTER, f"launcher.address={cluster.address}"]
    proc = start_runner(tmp_path, run_dir, *args)
    wait_until(proc, (run_dir / "metrics.jsonl").exists, timeout=HANG)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGUSR1: a graceful stop needs every worker on runner's host" in err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert "Traceback" not in err and "SIGTERM received" not in err
    deadline = time.monotonic() + 30
    while any("RayTrainWorker" in line for line in ray_processes().values()):
        assert time.monotonic() < deadline, ray_processes()
        time.sleep(0.2)


def test_a_bad_address_is_refused_before_any_worker_starts(cli) -> None:
    bad = cli(*ARGS, "launcher=ray", "launcher.address=127.0.0.1:1", name="bad")
    assert bad.returncode == 2, bad.output
    assert "launcher.address=127.0.0.1:1: no Ray cluster answers there" in bad.stderr
    assert not bad.run_dir.exists()


def test_a_node_removed_mid_run_costs_a_restart_from_the_last_checkpoint(
    tmp_path: Path, cli, two_nodes
) -> None:
    """The node holding rank 1 goes (once the first checkpoint is there) and another joins:
    Ray restarts the worker group there, which resumes from the last checkpoint and ends with
    the weights of an uninterrupted run."""
    import subprocess

    from tests.helpers.cli import child_env, runner_command

    cluster, node = two_nodes
    longer = [*FAST, "max_steps=200", "max_epochs=null", "log_interval=10", "checkpoint.interval=8"]
    reference = cli(*longer, name="elastic")
    assert reference.returncode == 0, reference.output
    run_dir = tmp_path / "moved"
    command = runner_command(
        *longer, *ON_CLUSTER, f"launcher.address={cluster.address}", "max_restarts=1",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    with open(tmp_path / "moved.log", "w") as out:
        process = subprocess.Popen(command, cwd=tmp_path, env=child_env(), stdout=out, stderr=out)
        while not list((run_dir / "checkpoints").glob("step_*")) and process.poll() is None:
            time.sleep(0.1)
        cluster.remove_node(node)
        cluster.add_node(num_cpus=1, resources={"slot": 1})
        assert process.wait(timeout=HANG) == 0, (tmp_path / "moved.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1
    # the last checkpoint before the node went: the first one, unless training ran on meanwhile
    assert summary["resumed_from"] in range(8, 200, 8)
    expected = weights(reference.run_dir)
    assert all(torch.equal(expected[k], v) for k, v in weights(run_dir).items())
