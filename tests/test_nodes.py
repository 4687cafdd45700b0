"""Multi-node plumbing without a cluster: config agreement, interface choice, Hydra file
placement, failures sent between nodes, the SLURM launcher example."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner.cli.hydra_files import hydra_subdir
from runner.launch.failures import RankFailure
from runner.launch.network import interface_towards, local_address_towards
from runner.launch.nodes import config_differences
from tests.helpers.cli import child_env, runner_command


def test_config_differences_name_each_key_but_node_rank() -> None:
    mine = {"node_rank": 1, "lr": 0.5, "optimizer": {"name": "adamw", "betas": [0.9, 0.95]}}
    theirs = {"node_rank": 0, "lr": 0.1, "optimizer": {"name": "adamw", "betas": [0.9, 0.999]}}
    assert config_differences(mine, theirs) == [
        "lr: 0.5 here, 0.1 on node 0",
        "optimizer.betas: [0.9, 0.95] here, [0.9, 0.999] on node 0",
    ]
    assert config_differences({**mine, "node_rank": 3}, mine) == []
    assert config_differences({"extra": 1}, {}) == ["extra: 1 here, None on node 0"]


def test_ranks_talk_over_the_interface_that_reaches_master() -> None:
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("no-such-host.invalid") is None


def test_each_node_keeps_its_own_hydra_files() -> None:
    """Node i > 0 writes Hydra's record of the run (runner writes it once the run is
    accepted, from the resolved node_rank: SLURM's node id under nodes=auto) to node{i}/."""
    assert hydra_subdir(0) == ".hydra"
    assert [hydra_subdir(i) for i in (1, 2)] == ["node1/.hydra", "node2/.hydra"]


def test_a_failure_crosses_nodes_intact() -> None:
    failure = RankFailure(3, -9, 12.5, "gpu02", None, "", "", Path("runs/x/logs/rank3.log"), "t")
    assert RankFailure.from_dict(failure.as_dict()) == failure
    assert RankFailure.from_dict(failure.as_dict()).headline() == failure.headline()


# The docs' SLURM example (docs/multi-node.md), minus the cluster: it must compose as written.
SLURM_EXAMPLE = [
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.nodes=2",
    "hydra.launcher.tasks_per_node=1",
    "hydra.launcher.gpus_per_node=8",
    "hydra.launcher.cpus_per_task=64",
    "hydra.launcher.timeout_min=720",
    "hydra.launcher.partition=gpu",
    "+recipe=resnet50",
    "nodes=auto",
    "nproc=auto",
    "data.root=/datasets/imagenet",
]


@pytest.mark.slow
def test_slurm_example_composes(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "docs" / "multi-node.md").read_text()
    assert " \\\n  ".join(["runner -m " + SLURM_EXAMPLE[0], *SLURM_EXAMPLE[1:]]) in readme
    shown = subprocess.run(
        runner_command(*SLURM_EXAMPLE, "--cfg", "hydra"),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "SlurmLauncher" in shown.stdout
    assert "tasks_per_node: 1" in shown.stdout and "nodes: 2" in shown.stdout


def test_store_values_are_data_and_a_foreign_one_is_named() -> None:
    """What a node reads from the unauthenticated store is JSON or a port, never code; a
    value runner did not write fails with a message naming the key, not a traceback."""
    from runner.launch.nodes import StoreValueError, decode, stop_notice
    from runner.launch.rendezvous import parse_port

    assert decode("k", b'{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(StoreValueError, match="key 'runner/failed/node1' holds"):
        decode("runner/failed/node1", b"\x80\x04\x95pickle")
    with pytest.raises(StoreValueError, match="not a node's stop notice"):
        stop_notice("runner/failed/node1", [1, 2])
    assert parse_port("round1/port", b"40123") == 40123
    for bad in (b"-1", b"70000", b"os.system('x')"):
        with pytest.raises(RuntimeError, match="not a port: is another program"):
            parse_port("round1/port", bad)


def test_store_listens_on_one_address_only() -> None:
    import psutil

    from runner.launch.network import listening_socket

    fd, port = listening_socket("127.0.0.1", 0)
    try:
        mine = [
            c.laddr
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert [a.ip for a in mine] == ["127.0.0.1"]
    finally:
        import os

        os.close(fd)


def test_a_sigterm_while_a_node_joins_node_0_waits_until_its_files_moved() -> None:
    """SLURM's requeue sends SIGTERM to every task; one that came while node 1's runner
    moved its files next to node 0's left a run directory of that start behind (make
    test-slurm). runner.cli.other_node does the move with SIGTERM and SIGHUP held."""
    import os
    import signal

    from runner.processes import stops_held

    got: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda *_: got.append("after" if moved else "during"))
    moved = False
    try:
        with stops_held():
            os.kill(os.getpid(), signal.SIGTERM)
            moved = True
        assert got == ["after"]
    finally:
        signal.signal(signal.SIGTERM, before)
