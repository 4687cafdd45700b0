"""runner.dist outside a process group, and the device/backend selection for CUDA and CPU."""

from __future__ import annotations

import torch

from runner import dist
from runner.hardware import threads_per_rank


def test_single_process_defaults(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert dist.get_world_size() == 1
    assert dist.get_global_rank() == 0
    assert dist.get_local_rank() == 0
    assert dist.get_local_world_size() == 1
    assert dist.get_node_rank() == 0
    dist.barrier()
    t = torch.ones(3)
    assert dist.all_reduce(t) is t and t.tolist() == [1.0, 1.0, 1.0]
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
    assert dist.all_gather_object(5) == [5]


def test_env_describes_position_before_init(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert (dist.get_global_rank(), dist.get_world_size()) == (5, 8)
    assert (dist.get_local_rank(), dist.get_local_world_size(), dist.get_node_rank()) == (1, 4, 1)


def test_backend_and_device_selection() -> None:
    assert dist.backend_for("cuda") == "nccl"
    assert dist.backend_for("cpu") == "gloo"
    assert dist.device_for("cuda", 3) == "cuda:3"
    assert dist.device_for("cpu", 3) == "cpu"


def test_threads_split_cores_between_local_ranks() -> None:
    assert threads_per_rank(2, cores=2) == 1
    assert threads_per_rank(1, cores=8) == 8
    assert threads_per_rank(4, cores=2) == 1
    assert threads_per_rank(3, cores=8) == 2
