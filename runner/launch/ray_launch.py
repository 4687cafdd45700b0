"""launcher=ray: the run's ranks as the workers of a Ray Train TorchTrainer.

The agent has checked the components, prepared the data and written the seed weights, as
for launcher=elastic; then, instead of torch elastic, it connects to a Ray cluster
(launcher.address, else RAY_ADDRESS, else a local cluster it starts and stops) and fits a
TorchTrainer: nodes x nproc workers (ScalingConfig), the run directory as its storage
(RunConfig), max_restarts restarts of the whole worker group (FailureConfig). Each worker
runs the rank's stages (runner.train.ray_worker); the watchdog reads the heartbeats of the
workers on this host. A rank's failure is reported from its error file, as elastic's are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from runner import heartbeat
from runner.launch import outcomes
from runner.launch.failures import root_cause
from runner.launch.watchdog import Watchdog
from runner.rundir.files import RunDir
from runner.rundir.summary import Status
from runner.spec import RunSpec

log = logging.getLogger("runner")
INVALID = 2
PASSED_ENV = (  # what the agent's ranks get from it, and Ray's workers need given
    "PYTHONPATH",
    "RUNNER_START_TIME",
    "RUNNER_SECRETS",
    "RUNNER_CACHE_DIR",
    heartbeat.ENV,
)


def run_on_ray(
    spec: RunSpec, node_dir: Any, run_dir: RunDir, beats: Any, write_outcome: Any
) -> int:
    """Fit the run on Ray; the exit code, with summary.json written on failure."""
    import ray

    launcher = spec.launcher
    address = getattr(launcher, "address", None) or os.environ.get("RAY_ADDRESS") or None
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env["RUNNER_NODE_DIR"] = str(node_dir)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    unreachable = _unreachable(address)
    if unreachable:  # ray.init would retry for minutes
        problem = f"launcher.address={address}: {unreachable}"
        error = {"rank": None, "exitcode": INVALID, "message": problem, "problems": [problem]}
        write_outcome(run_dir, Status.FAILED, error)
        return INVALID
    before = _descendants(os.getpid())  # the fork server: not Ray's
    try:
        if address is None:  # a local cluster, ours to stop: room for every worker
            cpus = max(os.cpu_count() or 1, spec.world_size)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": env})  # fmt: skip
        else:
            ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    except Exception as exc:
        problem = f"launcher.address={address}: cannot join a Ray cluster there ({exc})".strip()
        if address is None:
            problem = f"launcher=ray: cannot start a local Ray cluster ({exc})"
        error = {"rank": None, "exitcode": INVALID, "message": problem, "problems": [problem]}
        write_outcome(run_dir, Status.FAILED, error)
        return INVALID
    watchdog = None
    try:
        log.info(
            "runner: %d Ray worker(s) on %s (%s) -> %s",
            spec.world_size,
            address or "a local Ray cluster",
            spec.device,
            run_dir.root,
        )
        if spec.watchdog.timeout:
            watchdog = Watchdog(spec.watchdog, run_dir, spec.world_size, 1, path=beats)
            watchdog.start()
        try:
            _trainer(spec, run_dir, env).fit()
        except Exception as exc:
            if watchdog is not None:
                watchdog.stop()
            return _failed(spec, run_dir, exc, watchdog, write_outcome)
        if watchdog is not None:
            watchdog.stop()
        return outcomes.ranks_exited(0, run_dir, write_outcome)
    finally:
        ours = _descendants(os.getpid()) - before if address is None else set()
        ray.shutdown()  # a cluster runner started goes with it, every process of it
        _reap(ours)


def _unreachable(address: str | None, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a cluster's `host:port` (or `ray://host:port`); None when
    something does, or for `auto` and a local cluster."""
    if address is None or address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return "not HOST:PORT (the head node's GCS address, or ray://HOST:PORT, or auto)"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        reason = exc.strerror or exc
        return f"no Ray cluster answers there ({reason}); start one with `ray start --head`"


def _descendants(root: int) -> set[int]:
    """Every process below `root` (Linux's /proc): a local cluster's GCS, raylet, workers."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _reap(pids: set[int], timeout_s: float = 15.0) -> None:
    """Wait for `pids` to end (ray.shutdown asked them to), then kill what is left."""
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)}
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _trainer(spec: RunSpec, run_dir: RunDir, env: dict[str, str]) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from runner.train.ray_worker import train_worker

    cuda = spec.device == "cuda"
    resources = getattr(spec.launcher, "resources_per_worker", None) or None
    return TorchTrainer(
        train_worker,
        train_loop_config={"run_dir": str(run_dir.root), "env": env},
        torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=spec.world_size, use_gpu=cuda, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name="ray",
            storage_path=str(run_dir.root),
            failure_config=FailureConfig(max_failures=spec.max_restarts),
        ),
    )


def _failed(
    spec: RunSpec, run_dir: RunDir, exc: Exception, watchdog: Watchdog | None, write_outcome: Any
) -> int:
    """The root cause among the ranks' error files (the latest attempt's), the watchdog's
    hang first; else what Ray said."""
    from runner.train.ray_worker import ERROR_FILE

    failures = [
        outcomes.rank_failure(run_dir, rank, path, 1, path.stat().st_mtime)
        for rank in range(spec.world_size)
        if (path := run_dir.logs / ERROR_FILE.format(rank=rank)).is_file()
    ]
    hang = watchdog.hang if watchdog is not None else None
    if hang is not None:
        failures = [hang, *failures]
    if failures:
        cause = root_cause(failures)
        write_outcome(run_dir, Status.FAILED, cause.summary_error(others=len(failures) - 1))
    else:
        first = (str(exc).strip().splitlines() or [""])[0]
        message = f"Ray: {type(exc).__name__}: {first}"
        write_outcome(run_dir, Status.FAILED, {"rank": None, "exitcode": 1, "message": message})
    return 1
