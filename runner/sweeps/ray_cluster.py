"""The Ray cluster a sweep of hydra/launcher=tune runs on: joined (hydra.launcher.address,
else RAY_ADDRESS) or started locally, and what each trial asks of it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any


def resource_problems(largest: dict[str, float], launcher: Any, nprocs: list[int]) -> list[str]:
    """Jobs whose trial no node of the cluster can hold."""
    most = max(nprocs, default=1)
    gpus = int(largest.get("GPU", 0))
    problems = []
    wanted_gpus = trial_gpus(launcher, most, gpus > 0)
    if wanted_gpus > gpus:
        problems.append(
            f"nproc={most}: a trial asks for {wanted_gpus:g} GPU(s) and no node of the Ray "
            f"cluster has more than {gpus}; lower nproc (or hydra.launcher.gpus_per_trial)"
        )
    wanted_cpus = trial_cpus(launcher, most, gpus > 0)
    cpus = int(largest.get("CPU", 0))
    if wanted_cpus > cpus:
        problems.append(
            f"nproc={most}: a trial asks for {wanted_cpus:g} CPU(s) and no node of the Ray "
            f"cluster has more than {cpus}; lower nproc (or hydra.launcher.cpus_per_trial)"
        )
    return problems


def trial_gpus(launcher: Any, nproc: int, cluster_has_gpus: bool) -> float:
    """A trial's GPUs: hydra.launcher.gpus_per_trial, else one per rank on a GPU cluster."""
    if launcher.gpus_per_trial is not None:
        return float(launcher.gpus_per_trial)
    return float(nproc) if cluster_has_gpus else 0.0


def trial_cpus(launcher: Any, nproc: int, cluster_has_gpus: bool) -> float:
    """A trial's CPUs: hydra.launcher.cpus_per_trial, else one per rank."""
    if launcher.cpus_per_trial is not None:
        return float(launcher.cpus_per_trial)
    return float(nproc)


def connect(ray: Any, launcher: Any, say: Callable[[str], None]) -> bool:
    """Join the cluster, or start a local one; whether this process started it. A cluster
    that cannot be joined or started is said, and the sweep exits 2."""
    from runner.processes import LOCAL_RAY_CLUSTER

    address = launcher.address or os.environ.get("RAY_ADDRESS") or None
    for name in ("ray", "ray.tune", "ray.train"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        if address is None:
            # address="local": a cluster of its own, never another local one found running
            ray.init(address="local", num_gpus=launcher.gpus, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING,
                     _system_config=LOCAL_RAY_CLUSTER)  # fmt: skip
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:
        where = (
            "cannot start a local Ray cluster"
            if address is None
            else (f"hydra.launcher.address={address}: cannot join a Ray cluster there")
        )
        say(f"{where} ({exc})".strip())
        raise SystemExit(2) from None
    return address is None


def disconnect(ray: Any, started: bool) -> None:
    from runner.processes import descendants, reap

    ours = descendants(os.getpid()) if started else set()
    ray.shutdown()  # a cluster this process started goes with it
    reap(ours)


def largest_node(ray: Any) -> dict[str, float]:
    """The most CPUs and GPUs one alive node of the cluster has."""
    largest: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for kind in ("CPU", "GPU"):
                largest[kind] = max(largest.get(kind, 0.0), node["Resources"].get(kind, 0.0))
    return largest
