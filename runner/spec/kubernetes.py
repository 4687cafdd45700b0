"""Where this pod sits in a Kubeflow training job, from the environment its operator sets.

`nodes=auto` in a pod reads what Kubeflow Trainer's TrainJob (torch runtime) and the
training operator's PyTorchJob set for torchrun: PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT; or, where only the plain forms are set (a PyTorchJob
without nprocPerNode: one process per pod), WORLD_SIZE pods, this one RANK, at
MASTER_ADDR:MASTER_PORT. runner then starts this pod's ranks itself, as on SLURM:
`nproc=auto` starts PET_NPROC_PER_NODE of them where the job gives a number (torchrun's
`auto`, `gpu` or `cpu` leave the choice to runner: the pod's GPUs, else its cores).
"""

from __future__ import annotations

from collections.abc import Mapping

from runner.spec.slurm import SlurmPlacement

DEFAULT_PORT = 29500  # torchrun's, which the operators use too
TORCHRUN_CHOICES = ("auto", "gpu", "cpu", "xpu")  # torchrun's words for "runner chooses"


def placement(environ: Mapping[str, str], master_port: int | None) -> SlurmPlacement | None:
    """This pod's place in its job, or None outside one. Raises ValueError naming the
    variable that is there but unreadable."""
    if "PET_NNODES" in environ:
        names = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
    elif {"WORLD_SIZE", "RANK", "MASTER_ADDR"} <= environ.keys():
        names = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
    else:
        return None
    count, rank, addr, port = names
    nodes = _number(environ, count, environ[count].rpartition(":")[2])  # elastic: "1:4"
    node_rank = _number(environ, rank, environ.get(rank, "0"))
    if not environ.get(addr):
        raise ValueError(f"{addr} is not set, though {count} is")
    if node_rank >= nodes:
        raise ValueError(f"{rank}={node_rank} is not below {count}={nodes}")
    if master_port is None:
        master_port = _number(environ, port, environ.get(port, str(DEFAULT_PORT)))
    per_node = environ.get("PET_NPROC_PER_NODE", "").strip()
    if per_node and not per_node.isdigit() and per_node not in TORCHRUN_CHOICES:
        raise ValueError(
            f"PET_NPROC_PER_NODE={per_node!r} is neither a whole number nor one of "
            f"{', '.join(TORCHRUN_CHOICES)}"
        )
    nproc = _number(environ, "PET_NPROC_PER_NODE", per_node) if per_node.isdigit() else None
    if nproc == 0:
        raise ValueError("PET_NPROC_PER_NODE=0: a node runs at least one process")
    return SlurmPlacement(nodes, node_rank, environ[addr], master_port, nproc)


def _number(environ: Mapping[str, str], name: str, text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{name}={environ.get(name)!r} is not a whole number")
    return int(text)
