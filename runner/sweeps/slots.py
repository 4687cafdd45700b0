"""hydra/launcher=runner's slots: which devices each job of a sweep on one node gets.

The node's devices are a pool: `hydra.launcher.devices` where the user declares them (GPU
ids, recorded and handed down even on a machine without a GPU), else every visible GPU,
else the cores this process may run on. A job takes as many as it has ranks (`nproc`;
`nproc=auto`: the whole pool) and gives them back when it ends; jobs wait in order while
the pool is short. A job on GPUs sees only its own (CUDA_VISIBLE_DEVICES); a job on cores
runs on its own (CPU affinity), and its ranks split those cores as a run's ranks split a
node's.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runner import hardware

GPU, CPU = "gpu", "cpu"


@dataclass(frozen=True)
class DevicePool:
    kind: str  # GPU or CPU
    devices: tuple[str, ...]
    declared: bool  # hydra.launcher.devices named them

    def describe(self) -> str:
        what = "GPU(s)" if self.kind == GPU else "core(s)"
        where = "hydra.launcher.devices" if self.declared else "visible"
        return f"{len(self.devices)} {what} ({where}: {','.join(self.devices)})"


def device_pool(
    declared: Sequence[Any] | None, environ: dict[str, str] | None = None
) -> DevicePool:
    """The devices the sweep's jobs share."""
    environ = dict(os.environ) if environ is None else environ
    if declared is not None:
        return DevicePool(GPU, tuple(str(d).strip() for d in declared), True)
    gpus = visible_gpus(environ)
    if gpus:
        return DevicePool(GPU, gpus, False)
    return DevicePool(CPU, tuple(str(c) for c in sorted(_affinity())), False)


# A GPU as CUDA_VISIBLE_DEVICES names it: its index, or its UUID (nvidia-smi -L), a MIG
# instance's UUID included (`MIG-<uuid>`, or the older `MIG-GPU-<uuid>/<gi>/<ci>`).
_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_OLD_MIG = re.compile(r"^MIG-GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}/\d+/\d+$")


def declared_devices(value: Any) -> list[str] | None:
    """hydra.launcher.devices as a list of entries: a list as given, one index, or a
    comma-separated string ("0,1"); None where it is not set."""
    if value is None:
        return None
    if isinstance(value, str):
        return [d.strip() for d in value.split(",")]
    if isinstance(value, int) and not isinstance(value, bool):
        return [str(value)]
    try:
        return [str(d).strip() for d in value]
    except TypeError:
        return [str(value)]


def device_problems(declared: Sequence[str] | None) -> list[str]:
    """Every entry of hydra.launcher.devices that is not a GPU: an index (0, 1, ...) or a
    GPU or MIG UUID. Anything else (`abc`) would reach CUDA_VISIBLE_DEVICES, where CUDA
    sees no GPU at all and the job silently trains on the CPU."""
    if declared is None:
        return []
    bad = [d for d in declared if not (d.isdigit() or _GPU_UUID.match(d) or _OLD_MIG.match(d))]
    if not bad:
        return []
    return [
        f"hydra.launcher.devices={list(declared)}: {', '.join(repr(d) for d in bad)} is not a "
        "GPU; each entry is an index (0, 1, ...) or a GPU or MIG UUID (nvidia-smi -L), "
        "e.g. hydra.launcher.devices=[0,1]"
    ]


def visible_gpus(environ: dict[str, str]) -> tuple[str, ...]:
    """The GPUs a job may be given: CUDA_VISIBLE_DEVICES' entries where it is set, else the
    driver's indices (nvidia-smi). Never through torch: a sweep's process that asked CUDA
    would fork its jobs with the driver initialized, where CUDA fails in the child."""
    if shutil.which("nvidia-smi") is None:
        return ()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(d.strip() for d in visible.split(",") if d.strip())
    return tuple(hardware.query_gpus("index") or ())


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def slot_size(nproc: Any, pool: DevicePool) -> int:
    """How many of the pool's devices a job with this `nproc` takes (one, for a value the
    job's own checks will refuse: it ends there, reported like any rejected job)."""
    if nproc == "auto":
        return len(pool.devices)
    try:
        return max(1, int(nproc))
    except (TypeError, ValueError):
        return 1


def pool_problems(pool: DevicePool, sizes: Sequence[int]) -> list[str]:
    """What makes the sweep impossible before its first job: a device named twice, a job
    needing more devices than the pool has."""
    problems = []
    if not pool.devices:
        problems.append("hydra.launcher.devices=[]: name at least one device, or leave it out")
    twice = sorted(d for d, n in Counter(pool.devices).items() if n > 1)
    if twice:
        problems.append(
            f"hydra.launcher.devices={list(pool.devices)}: {', '.join(twice)} named twice; "
            "each device can be in one job's slot at a time"
        )
    largest = max(sizes, default=0)
    if pool.devices and largest > len(pool.devices):
        kind = "GPUs" if pool.kind == GPU else "cores"
        problems.append(
            f"nproc={largest}: a job takes a {kind[:-1]} per rank, and this node has "
            f"{pool.describe()}; use nproc<={len(pool.devices)}"
            + ("" if pool.declared else ", or name the devices: hydra.launcher.devices=[...]")
        )
    return problems


def multi_node_problems(nodes: Sequence[Any]) -> list[str]:
    """Jobs that span nodes: this launcher runs each job on this node."""
    many = sorted({n for n in nodes if isinstance(n, int) and n > 1})
    if not many:
        return []
    return [
        f"nodes={many[-1]}: hydra/launcher=runner runs each job on this node; a job across "
        "nodes needs a scheduler (hydra/launcher=submitit_slurm) or runner started on each node"
    ]


@dataclass
class Slots:
    """The pool's devices, free or taken by a running job."""

    pool: DevicePool
    free: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(self.pool.devices)

    def take(self, count: int) -> tuple[str, ...] | None:
        """`count` free devices (the lowest first), or None while fewer are free."""
        if count > len(self.free):
            return None
        taken, self.free = tuple(self.free[:count]), self.free[count:]
        return taken

    def give_back(self, devices: Sequence[str]) -> None:
        order = {d: i for i, d in enumerate(self.pool.devices)}
        self.free = sorted([*self.free, *devices], key=order.__getitem__)


def job_environment(pool: DevicePool, devices: Sequence[str]) -> dict[str, str]:
    """The variables a job's process gets for its devices (cores: set as its affinity)."""
    if pool.kind == GPU:
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}
    return {}


def pin_to_cores(pool: DevicePool, devices: Sequence[str]) -> None:
    """Run this process (a job) and what it starts on its slot's cores only. Declared GPUs on
    a host without one (the jobs train on the CPU) get the cores in proportion to their
    share of the pool: side by side, two jobs of one rank each on 2 cores ran 2 threads each."""
    if not hasattr(os, "sched_setaffinity"):
        return
    if pool.kind == CPU:
        os.sched_setaffinity(0, {int(d) for d in devices})
    elif not visible_gpus(dict(os.environ)):
        os.sched_setaffinity(0, cores_for(pool, devices, sorted(_affinity())))


def cores_for(pool: DevicePool, devices: Sequence[str], cores: Sequence[int]) -> set[int]:
    """The cores a slot of declared GPUs gets on a host without them: each device of the pool
    an equal run of the cores (at least one)."""
    share = max(1, len(cores) // len(pool.devices))
    taken: set[int] = set()
    for device in devices:
        i = pool.devices.index(device) * share % len(cores)
        taken.update(cores[i : i + share])
    return taken
