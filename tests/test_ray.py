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

from tests.conftest import FAST

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

ARGS = [*FAST, "max_steps=8", "log_interval=2", "checkpoint.interval=2"]


def ray_processes() -> list[str]:
    import psutil

    found = []
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # ended; reparented to an init that has not reaped it yet
        line = " ".join(process.info["cmdline"] or [process.info["name"] or ""])
        if any(name in line for name in ("raylet", "gcs_server", "ray::")):
            found.append(line[:120])
    return found


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_ray_workers_train_what_elastic_ranks_do_even_when_one_is_killed(cli) -> None:
    """Rank 1 SIGKILLed at step 5: Ray restarts the worker group, which resumes from the
    checkpoint of step 4; the weights are those of two elastic ranks that never stopped."""
    elastic = cli(*ARGS, name="elastic")
    assert elastic.returncode == 0, elastic.output
    killed = cli(
        *ARGS, "launcher=ray", "max_restarts=1", "chaos.kill_rank=1", "chaos.at_step=5",
        name="killed",
    )  # fmt: skip
    assert killed.returncode == 0, killed.output
    assert "2 Ray worker(s) on a local Ray cluster" in killed.output
    summary = killed.summary()
    assert summary["status"] == "completed" and (killed.run_dir / "logs" / "rank1.log").is_file()
    assert summary["restarts"] == 1 and summary["resumed_from"] == 4
    reference = weights(elastic.run_dir)
    assert all(torch.equal(reference[k], v) for k, v in weights(killed.run_dir).items())
    assert not ray_processes(), "the local cluster runner started must be gone"


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[Any, Any]]:
    """A Ray cluster of two simulated nodes (ray.cluster_utils: a raylet each), one worker
    slot on each, so that a 2-worker run spans both."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"slot": 1}}
    )
    node = cluster.add_node(num_cpus=1, resources={"slot": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster, node
    finally:
        cluster.shutdown()


ON_CLUSTER = ["launcher=ray", "launcher.resources_per_worker={slot:1}"]


def test_a_failing_worker_is_named_and_a_bad_address_refused(cli, two_nodes) -> None:
    cluster, _ = two_nodes
    failing = cli(
        *ARGS, *ON_CLUSTER, f"launcher.address={cluster.address}", "chaos.kill_rank=1",
        "chaos.at_step=3", "chaos.action=raise",
    )  # fmt: skip
    assert failing.returncode == 1, failing.output
    error = failing.summary()["error"]
    assert error["rank"] == 1 and "rank 1" in error["message"] and "raised" in error["message"]
    assert "rank 1" in failing.output

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

    from tests.conftest import child_env, runner_command

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
        assert process.wait(timeout=300) == 0, (tmp_path / "moved.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1
    # the last checkpoint before the node went: the first one, unless training ran on meanwhile
    assert summary["resumed_from"] in range(8, 200, 8)
    expected = weights(reference.run_dir)
    assert all(torch.equal(expected[k], v) for k, v in weights(run_dir).items())
