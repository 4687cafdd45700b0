"""The run's grid (runner.spec.mesh's Layout) as a torch DeviceMesh, on a rank: made once per
process, and the dimensions each parallelism works over cut from it."""

from __future__ import annotations

from typing import Any

from runner.spec.mesh import (
    CONTEXT,
    DIMENSIONS,
    EXPERT,
    PIPELINE,
    REPLICATE,
    SHARD,
    SHARD_CONTEXT,
    SHARD_EXPERT,
    TENSOR,
    Layout,
)

_MESHES: dict[tuple[str, Layout], Any] = {}


def device_mesh(grid: Layout, device_type: str) -> Any:
    """The run's DeviceMesh (made once per process): dimensions of size one left out, so
    that FSDP alone keeps its 1-D mesh (shard) and HSDP its 2-D one (replicate, shard).
    Under expert parallelism the shard dimension is two: (shard, expert), the expert
    groups innermost."""
    key = (device_type, grid)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        sizes = {d.name: getattr(grid, d.name) for d in DIMENSIONS}
        sizes[SHARD] //= grid.expert  # the expert groups are cut from the shard ranks
        dims = [(d.name, sizes[d.name]) for d in DIMENSIONS]
        kept = [(name, size) for name, size in dims if size > 1 or name == SHARD]
        _MESHES[key] = init_device_mesh(
            device_type,
            tuple(size for _, size in kept),
            mesh_dim_names=tuple(name for name, _ in kept),
        )
    return _MESHES[key]


def data_mesh(mesh: Any) -> Any:
    """The data dimensions of the run's mesh: what FSDP shards (and HSDP replicates) over;
    with context parallelism, shard and context as one dimension."""
    if CONTEXT in mesh.mesh_dim_names:
        flat = mesh[(SHARD, CONTEXT)]._flatten(SHARD_CONTEXT)
        return mesh[(REPLICATE, SHARD_CONTEXT)] if REPLICATE in mesh.mesh_dim_names else flat
    if EXPERT in mesh.mesh_dim_names:
        flat = mesh[(SHARD, EXPERT)]._flatten(SHARD_EXPERT)
        return mesh[(REPLICATE, SHARD_EXPERT)] if REPLICATE in mesh.mesh_dim_names else flat
    names = [n for n in mesh.mesh_dim_names if n in (REPLICATE, SHARD)]
    if tuple(names) == tuple(mesh.mesh_dim_names):
        return mesh
    return mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]


def tensor_mesh(mesh: Any) -> Any | None:
    """The tensor dimension of the run's mesh; None without tensor parallelism."""
    return mesh[TENSOR] if TENSOR in mesh.mesh_dim_names else None


def pipeline_mesh(mesh: Any) -> Any | None:
    """The pipeline dimension of the run's mesh; None without pipeline parallelism."""
    return mesh[PIPELINE] if PIPELINE in mesh.mesh_dim_names else None


def context_mesh(mesh: Any) -> Any | None:
    """The context dimension of the run's mesh; None without context parallelism."""
    return mesh[CONTEXT] if CONTEXT in mesh.mesh_dim_names else None


def expert_mesh(mesh: Any) -> Any | None:
    """The expert dimension of the run's mesh; None without expert parallelism."""
    return mesh[EXPERT] if EXPERT in mesh.mesh_dim_names else None


def expert_data_mesh(mesh: Any) -> Any:
    """What FSDP shards the experts over under expert parallelism: the data dimensions but
    the expert one (each expert group holds every expert once)."""
    names = tuple(n for n in mesh.mesh_dim_names if n in (REPLICATE, SHARD))
    return mesh[names] if len(names) > 1 else mesh[names[0]]
