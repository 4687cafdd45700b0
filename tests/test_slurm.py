"""nodes=auto inside a SLURM allocation: reading SLURM's environment."""

from __future__ import annotations

import pytest

from runner.spec import SpecError, resolve_spec
from runner.spec.slurm import expand_hostlist, job_port, placement, submitit_problems
from tests.helpers.config import compose_config


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node07", ["node07"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-a[8-10],gpu-b3", ["gpu-a8", "gpu-a9", "gpu-a10", "gpu-b3"]),
        ("n[098-101]-ib", ["n098-ib", "n099-ib", "n100-ib", "n101-ib"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a,b[1,3]", ["a", "b1", "b3"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node[a-c]"])
def test_unreadable_hostlist(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(bad)


JOB = {
    "SLURM_JOB_ID": "4242117",
    "SLURM_JOB_NODELIST": "gpu[013-014,020]",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS_PER_NODE": "1",
}


def test_placement_inside_a_job() -> None:
    place = placement(JOB, master_port=None)
    assert place is not None
    assert (place.nodes, place.node_rank, place.master_addr) == (3, 2, "gpu013")
    assert place.master_port == job_port("4242117") == 15000 + 4242117 % 20000
    assert placement(JOB, master_port=29500).master_port == 29500  # given port wins
    assert placement({"HOME": "/root"}, master_port=None) is None


def test_nodes_auto_resolves_from_slurm_or_to_one_node() -> None:
    spec = resolve_spec(
        compose_config(["nodes=auto", "device=cpu", "global_batch_size=60"]), environ=JOB
    )
    assert (spec.nodes, spec.node_rank, spec.master_addr) == (3, 2, "gpu013")
    assert spec.world_size == 3 * spec.nproc
    alone = resolve_spec(compose_config(["nodes=auto", "device=cpu"]), environ={})
    assert (alone.nodes, alone.master_port) == (1, None)
    with pytest.raises(SpecError, match="nodes=auto: cannot read the SLURM environment"):
        resolve_spec(
            compose_config(["nodes=auto", "device=cpu"]),
            environ={**JOB, "SLURM_JOB_NODELIST": "gpu[01-"},
        )


def test_a_submitit_sweep_maps_a_job_to_one_runner_per_node() -> None:
    """What docs/multi-node.md says a sweep of multi-GPU jobs on SLURM is: each job an
    allocation of hydra.launcher.nodes nodes, a runner on each (tasks_per_node=1) starting
    its nproc ranks, one per GPU of the node; anything else is named before any job."""
    good = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 2}
    assert submitit_problems(good, "auto", 2) == []
    assert submitit_problems({**good, "nodes": 2}, "auto", "auto") == []
    (tasks,) = submitit_problems({**good, "tasks_per_node": 2}, "auto", 1)
    assert tasks.startswith("hydra.launcher.tasks_per_node=2: runner runs one task per node")
    assert tasks.endswith("set hydra.launcher.tasks_per_node=1 and nproc=2")
    (ranks,) = submitit_problems(good, "auto", 4)
    assert ranks.startswith("nproc=4: each node of a job has hydra.launcher.gpus_per_node=2")
    (nodes,) = submitit_problems({**good, "nodes": 2}, 1, 2)
    assert nodes.startswith("nodes=1: each job gets hydra.launcher.nodes=2 nodes")
