"""Distributed helpers that also work outside a process group.

Each returns the single-process answer (rank 0 of a world of 1, no-op
collectives) when torch.distributed is not initialised, so the same code runs
in a rank, in a unit test and in a notebook. Ranks, sizes and node index come
from the environment the elastic agent sets (RANK, LOCAL_RANK, GROUP_RANK, ...).
"""

from __future__ import annotations

import os
from typing import Any


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def get_attempt() -> int:
    """This process's attempt at the run: 0 at first, one more after each restart (torch
    elastic's TORCHELASTIC_RESTART_COUNT; runner's Ray workers set it too)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def get_world_size() -> int:
    """Number of ranks in the job (1 when not distributed)."""
    if _initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def get_global_rank() -> int:
    """This process's rank among all ranks of the job (0 when not distributed)."""
    if _initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return _env_int("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its own node: its device index on a GPU machine."""
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    """Ranks on this node."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node among the job's nodes."""
    return _env_int("GROUP_RANK", 0)


def barrier() -> None:
    """Wait until every rank gets here (no-op when not distributed)."""
    if _initialized():
        import torch.distributed as dist

        dist.barrier()


def all_reduce(tensor: Any, op: str = "sum") -> Any:
    """Reduce `tensor` in place across ranks with `op` (sum, avg, max, min) and return it."""
    if not _initialized():
        return tensor
    import torch.distributed as dist

    if op == "avg":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(dist.get_world_size())
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op={op!r}: expected one of sum, avg, max, min")
    dist.all_reduce(tensor, op=ops[op])
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return `src`'s `obj` on every rank (any picklable object)."""
    if not _initialized():
        return obj
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _initialized():
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def backend_for(device: str) -> str:
    """The collective backend for a device type: nccl on CUDA, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def device_for(device: str, local_rank: int) -> str:
    """The torch device string a rank trains on: one GPU per local rank on CUDA."""
    return f"cuda:{local_rank}" if device == "cuda" else "cpu"
