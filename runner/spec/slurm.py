"""Where this process sits in a SLURM allocation, from SLURM's environment (no scontrol call).

`nodes=auto` inside an allocation means: SLURM_NNODES machines, this one is
SLURM_NODEID, the rendezvous host is the first host of SLURM_JOB_NODELIST and,
unless master_port is given, the port follows from the job id so every node of
the job picks the same one (and two jobs sharing a first host rarely clash).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PORT_BASE, PORT_SPAN = 15000, 20000  # job-derived ports land in 15000..34999


@dataclass(frozen=True)
class SlurmPlacement:
    """Where this process sits in its job (SLURM's, or a Kubeflow job's)."""

    nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc: int | None = None  # the job's processes per node, where it says (nproc=auto)


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as host names: `node[01-03,07],gpu-b1` ->
    node01 node02 node03 node07 gpu-b1. Several bracket groups in one name multiply out,
    and zero padding is kept."""
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts += _expand_name(name)
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in hostlist.strip():
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
    parts.append(current)
    return [p for p in parts if p]


def _expand_name(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    prefix, suffix = name[: match.start()], name[match.end() :]
    expanded = []
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"cannot read range {item!r} in host name {name!r}")
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            expanded += _expand_name(f"{prefix}{number:0{width}d}{suffix}")
    return expanded


def job_port(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def placement(environ: Mapping[str, str], master_port: int | None) -> SlurmPlacement | None:
    """This node's place in the SLURM job, or None outside one. Raises ValueError when the
    variables are there but unreadable."""
    if "SLURM_JOB_ID" not in environ or "SLURM_JOB_NODELIST" not in environ:
        return None
    hosts = expand_hostlist(environ["SLURM_JOB_NODELIST"])
    nodes = int(environ.get("SLURM_NNODES", environ.get("SLURM_JOB_NUM_NODES", len(hosts))))
    node_rank = int(environ.get("SLURM_NODEID", "0"))
    if not hosts:
        raise ValueError("SLURM_JOB_NODELIST is empty")
    port = master_port if master_port is not None else job_port(environ["SLURM_JOB_ID"])
    return SlurmPlacement(nodes, node_rank, hosts[0], port)


def job_key(environ: Mapping[str, str]) -> str | None:
    """This SLURM job as `cluster:job id`, the same across its requeues; None outside SLURM."""
    job = environ.get("SLURM_JOB_ID")
    return f"{environ.get('SLURM_CLUSTER_NAME', '')}:{job}" if job else None


def requeued(environ: Mapping[str, str]) -> bool:
    """Whether SLURM started this job again: a requeue (preemption, `scontrol requeue`, or
    runner's own after a graceful stop). SLURM_RESTART_COUNT counts them."""
    count = environ.get("SLURM_RESTART_COUNT", "0") or "0"
    return count.isdigit() and int(count) > 0


def submitit_problems(launcher: Mapping[str, Any], nodes: Any, nproc: Any) -> list[str]:
    """A `hydra/launcher=submitit_slurm` sweep that cannot run the way runner runs on SLURM:
    each job's allocation runs one runner per node (tasks_per_node=1), which starts the
    node's `nproc` ranks, a GPU each, and the job's `nodes` are the allocation's."""
    problems = []
    tasks = launcher.get("tasks_per_node")
    if tasks not in (None, 1):
        problems.append(
            f"hydra.launcher.tasks_per_node={tasks}: runner runs one task per node, which "
            f"starts the node's ranks; set hydra.launcher.tasks_per_node=1 and nproc={tasks}"
        )
    gpus = launcher.get("gpus_per_node")
    if isinstance(gpus, int) and gpus > 0 and isinstance(nproc, int) and nproc > gpus:
        problems.append(
            f"nproc={nproc}: each node of a job has hydra.launcher.gpus_per_node={gpus} "
            f"GPU(s), one per rank; use nproc<={gpus}, or nproc=auto"
        )
    allocated = launcher.get("nodes")
    if isinstance(allocated, int) and allocated > 1 and nodes not in ("auto", allocated):
        problems.append(
            f"nodes={nodes}: each job gets hydra.launcher.nodes={allocated} nodes, a runner on "
            "each; use nodes=auto (the allocation's)"
        )
    return problems
