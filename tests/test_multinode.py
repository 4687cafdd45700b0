"""Multi-node runs: several `runner` processes, one per node, form one world.

On this machine "nodes" are runner processes started side by side (sharing the
filesystem), and, when the tests run as root, processes in two network
namespaces joined by a veth pair, so that master_addr is a real non-loopback
address, with node 1 also in its own mount namespace that hides node 0's files
(no shared filesystem).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from runner.spec import resolve_spec
from tests.helpers.cli import FAST, HANG, MATRIX
from tests.helpers.config import compose_config
from tests.helpers.equivalence import relative_error, train_plain
from tests.helpers.nodes import chaos_time, finish, free_port, only_run, start_node

pytestmark = pytest.mark.slow
TRAIN = [*FAST, "max_steps=20", "checkpoint.interval=null"]
RTOL = 1e-5


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def plain_reference() -> dict[str, torch.Tensor]:
    """What 4 ranks must train: plain single-process PyTorch on the same global batches (the
    equivalence tests hold every split of one node to the same yardstick)."""
    return train_plain(resolve_spec(compose_config([*TRAIN, "nproc=1", "device=cpu"])))


def test_two_nodes_train_the_same_model_as_one(tmp_path: Path, plain_reference) -> None:
    cluster = [*TRAIN, "nodes=2", "nproc=2", "master_addr=127.0.0.1", f"master_port={free_port()}"]
    node1 = start_node(tmp_path, 1, *cluster)  # either may start first
    time.sleep(0.5)
    node0 = start_node(tmp_path, 0, *cluster)
    (code0, out0, _), (code1, out1, _) = finish(node0, node1)
    assert code0 == 0 and code1 == 0, out0 + out1

    # One run directory, named by node 0: every rank's log, node 1's own files beside.
    run = only_run(tmp_path)
    assert relative_error(weights(run), plain_reference) < RTOL
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4
    for rank, node, local in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]:
        header = (run / "logs" / f"rank{rank}.log").read_text().splitlines()[0]
        assert f"rank {rank} attempt 0" in header and f"local rank {local} on node {node}" in header
    node_files = run / "node1"
    assert json.loads((node_files / "summary.json").read_text())["status"] == "completed"
    assert "node_rank: 1" in (node_files / "config.yaml").read_text()
    assert (node_files / ".hydra" / "overrides.yaml").is_file()
    assert "node_rank=0" in (run / ".hydra" / "overrides.yaml").read_text()
    env = json.loads((run / "env.json").read_text())
    assert [(n["node_rank"], n["shared"]) for n in env["nodes"]] == [(0, True), (1, True)]
    assert f"run directory: runs/{run.name}" in out1  # node 1 points at the one directory


# a hang is found by the watchdog of its node (tests/test_faults.py), then ends the others as
# a death does: make test kills, the matrix hangs
@pytest.mark.parametrize("fault", ["sigkill", pytest.param("hang", marks=MATRIX)])
def test_a_rank_dying_on_node_1_ends_node_0(tmp_path: Path, fault: str) -> None:
    """Also the shape of a SLURM job through hydra/launcher=submitit_slurm: one task per node,
    nodes=auto reading SLURM's variables, and the one output directory Hydra gives every task
    of the job. A hang on node 1 ends node 0 too: each node's watchdog writes its ranks'
    stacks, and both name the rank that stalled first."""
    cluster = [
        *FAST,
        "max_epochs=null",
        "max_steps=100000",
        "nodes=auto",
        "nproc=2",
        f"master_port={free_port()}",
        "chaos.kill_rank=3",
        "chaos.at_step=3",
        f"chaos.action={fault}",
        "watchdog.timeout=3",
        f"hydra.run.dir={tmp_path / 'runs' / 'job'}",
    ]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]"}
    node0, node1 = (
        start_node(tmp_path, None, *cluster, env={**slurm, "SLURM_NODEID": str(i)}) for i in (0, 1)
    )
    results = finish(node0, node1)
    run = only_run(tmp_path)
    assert (run / ".hydra").is_dir() and (run / "node1" / ".hydra").is_dir()
    killed, allowed = chaos_time(run, 3), 10.0 if fault == "sigkill" else 3 + 10.0
    for node, (code, output, ended) in enumerate(results):
        assert code == 1, output
        assert ended - killed < allowed, (
            f"node {node} ran {ended - killed:.1f}s after rank 3 {fault}"
        )
        if fault == "sigkill":
            assert f"rank 3 on {socket.gethostname()} was killed by SIGKILL" in output
        else:
            assert "hung: rank 3 after step 2" in output, "\n=====\n".join(r[1] for r in results)
    error = json.loads((run / "summary.json").read_text())["error"]
    assert error["rank"] == 3 and error["host"] == socket.gethostname()
    node1_error = json.loads((run / "node1" / "summary.json").read_text())["error"]
    assert node1_error["rank"] == 3
    if fault == "hang":
        for rank in range(4):
            assert "===== runner watchdog:" in (run / "logs" / f"rank{rank}.log").read_text()


def test_nodes_that_disagree_start_no_rank(tmp_path: Path) -> None:
    cluster = [*TRAIN, "nodes=2", "nproc=2", f"master_port={free_port()}"]
    node0 = start_node(tmp_path / "a", 0, *cluster)
    node1 = start_node(tmp_path / "b", 1, *cluster, "optimizer.lr=0.5")
    for code, output, _ in finish(node0, node1, timeout=HANG):
        assert code == 2, output
        assert "optimizer.lr: 0.5 here, 0.001 on node 0" in output
        assert "Traceback" not in output
    assert not list(tmp_path.glob("*/runs/*/logs/rank*.log"))


# --- two hosts: network namespaces -------------------------------------------------------


def _can_make_namespaces() -> str | None:
    """Why the namespace test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    probe = f"runner-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


@pytest.fixture
def two_hosts():
    """Namespaces h0 (10.231.7.1) and h1 (10.231.7.2) joined by a veth pair; removed after."""
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    names = [f"rn{tag}a", f"rn{tag}b"]
    links = [f"rv{tag}a", f"rv{tag}b"]
    addrs = ["10.231.7.1", "10.231.7.2"]

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs, strict=True):
            sh("ip", "link", "set", link, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            sh("ip", "-n", ns, "link", "set", link, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield list(zip(names, addrs, strict=True))
    finally:
        for ns in names:  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def test_two_hosts_without_a_shared_filesystem(tmp_path: Path, two_hosts, plain_reference):
    (ns0, addr0), (ns1, _) = two_hosts
    cluster = [*TRAIN, "nodes=2", "nproc=2", f"master_addr={addr0}", "master_port=29400"]
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    host0.mkdir()
    # Node 1 runs in its own mount namespace where node 0's directory is an empty tmpfs.
    hide_host0 = f'mount -t tmpfs none {host0} && exec "$@"'
    node1 = start_node(
        host1,
        1,
        *cluster,
        prefix=("ip", "netns", "exec", ns1, "unshare", "--mount", "--propagation", "private")
        + ("sh", "-c", hide_host0, "sh"),
    )
    node0 = start_node(host0, 0, *cluster, prefix=("ip", "netns", "exec", ns0))
    (code0, out0, _), (code1, out1, _) = finish(node0, node1)
    assert code0 == 0 and code1 == 0, out0 + out1

    run0, run1 = only_run(host0), only_run(host1)
    assert relative_error(weights(run0), plain_reference) < RTOL
    # Node 0 keeps the run: config, metrics, summary, model, ranks 0-1's logs.
    assert sorted(p.name for p in (run0 / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    env = json.loads((run0 / "env.json").read_text())
    assert [(n["node_rank"], n["shared"]) for n in env["nodes"]] == [(0, True), (1, False)]
    # Node 1 keeps its own ranks' logs and its node files, in its own run directory.
    assert sorted(p.name for p in (run1 / "logs").glob("rank*.log")) == ["rank2.log", "rank3.log"]
    node1_summary = json.loads((run1 / "node1" / "summary.json").read_text())
    assert node1_summary["status"] == "completed"
    assert not (run1 / "model.pt").exists() and not (run1 / "metrics.jsonl").exists()
    assert "does not see node 0's run directory" in out1
