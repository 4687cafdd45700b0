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

import logging
import os
import re
import signal
import socket
import sys
import threading
from typing import Any

from runner import hardware, heartbeat
from runner.launch import outcomes
from runner.launch.failures import root_cause
from runner.launch.stopping import GracefulStop
from runner.launch.watchdog import Watchdog
from runner.processes import LOCAL_RAY_CLUSTER, descendants, reap
from runner.rundir.files import RunDir
from runner.rundir.summary import Status
from runner.spec import RunSpec

log = logging.getLogger("runner")
INVALID = 2
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # read by Ray Train's controller
LOCAL_CLUSTER = LOCAL_RAY_CLUSTER  # a local cluster's workers at nice 0 (runner.processes)
STARTUP_TIMEOUT = "WorkerGroupStartupTimeoutError"  # what it raises when that runs out
PASSED_ENV = (  # what the agent's ranks get from it, and Ray's workers need given
    "PYTHONPATH",
    "RUNNER_START_TIME",
    "RUNNER_SECRETS",
    "RUNNER_CACHE_DIR",
    "RUNNER_STUDY_KEY",  # a sweep's study: rank 0 of a trial proves it (runner.sweeps)
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
    threads = _threads(spec, address)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    unreachable = _unreachable(address)
    if unreachable:  # ray.init would retry for minutes
        problem = f"launcher.address={address}: {unreachable}"
        error = {"rank": None, "exitcode": INVALID, "message": problem, "problems": [problem]}
        write_outcome(run_dir, Status.FAILED, error)
        return INVALID
    before = descendants(os.getpid())  # the fork server: not Ray's
    interrupts = _Interrupts()  # before ray.init: a cluster half started is ours to stop too
    try:
        problem = _connect(ray, spec, address, {**env, **_controller_env(launcher)})
        if problem is not None:
            error = {"rank": None, "exitcode": INVALID, "message": problem, "problems": [problem]}
            write_outcome(run_dir, Status.FAILED, error)
            return INVALID
        interrupts.install()  # again: ray.init put its own SIGTERM handler (sys.exit) in
        log.info(
            "runner: %d Ray worker(s) on %s (%s) -> %s",
            spec.world_size,
            address or "a local Ray cluster",
            spec.device,
            run_dir.root,
        )
        return _fit(spec, run_dir, env, beats, local=address is None, write_outcome=write_outcome)
    except _Interrupted as exc:
        return outcomes.signalled(exc.signum, run_dir, None, None, write_outcome)
    finally:
        interrupts.ignore()
        ours = descendants(os.getpid()) - before if address is None else set()
        ray.shutdown()  # a cluster runner started goes with it, every process of it
        reap(ours)


def _connect(ray: Any, spec: RunSpec, address: str | None, env: dict[str, str]) -> str | None:
    """Start a local cluster (room for every worker) or join `address`; what went wrong."""
    try:
        if address is None:
            cpus = max(os.cpu_count() or 1, spec.world_size)
            # address="local": a cluster of its own, never another local one found running
            ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                     log_to_driver=False, runtime_env={"env_vars": env},
                     _system_config=LOCAL_CLUSTER)  # fmt: skip
        else:
            ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    except Exception as exc:  # not _Interrupted: a BaseException, the caller's to handle
        if address is None:
            return f"launcher=ray: cannot start a local Ray cluster ({exc})"
        return f"launcher.address={address}: cannot join a Ray cluster there ({exc})".strip()
    return None


def _fit(
    spec: RunSpec,
    run_dir: RunDir,
    env: dict[str, str],
    beats: Any,
    local: bool,
    write_outcome: Any,
) -> int:
    """Fit the TorchTrainer, with the watchdog on this host's workers, and a graceful stop
    where every worker is on this host (a local cluster: it shares the heartbeat file)."""
    stop = GracefulStop(beats, spec.world_size) if local else None
    if stop is not None:
        stop.install()
    else:
        for sig in heartbeat.STOP_SIGNALS:
            signal.signal(sig, _no_graceful_stop)
    watchdog = None
    if spec.watchdog.timeout:
        watchdog = Watchdog(spec.watchdog, run_dir, spec.world_size, 1, path=beats)
        watchdog.start()
    try:
        _in_thread(_trainer(spec, run_dir, env).fit)
    except Exception as exc:
        return _failed(spec, run_dir, exc, watchdog, write_outcome)
    finally:
        if watchdog is not None:
            watchdog.stop()
    if stop is not None and stop.step is not None and heartbeat.stopped(beats, spec.world_size):
        return outcomes.stopped_as_asked(stop, run_dir, write_outcome)
    return outcomes.ranks_exited(0, run_dir, write_outcome)


def _in_thread(call: Any) -> Any:
    """call() in another thread, while this one waits in short steps: Python runs signal
    handlers in the main thread only, between its own steps, and a main thread blocked in
    ray.get would hold a graceful stop or an interrupt until the run's end (Ray Train also
    takes SIGINT for itself when fit() runs in the main thread)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="runner-ray-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


class _Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP while Ray runs the workers (the parent relays them)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """Turn SIGINT, SIGTERM and SIGHUP into _Interrupted in the main thread (in ray.init, or
    waiting for TorchTrainer.fit: _in_thread), so that the cluster is shut down and the
    run's end written; torch elastic's agent does the same for its ranks."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.install()

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._raise)

    def _raise(self, signum: int, _frame: Any) -> None:
        self.ignore()  # once: the shutdown that follows must not be cut short
        raise _Interrupted(signum)

    def ignore(self) -> None:
        """From here to the agent's exit (the cluster's shutdown, the summary)."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _no_graceful_stop(signum: int, _frame: Any) -> None:
    print(
        f"runner: {signal.Signals(signum).name}: a graceful stop needs every worker on "
        "runner's host (a local Ray cluster); this run goes on. SIGTERM stops it at once "
        "(the latest checkpoint is the resume point)",
        file=sys.stderr,
        flush=True,
    )


def _threads(spec: RunSpec, address: str | None) -> str | None:
    """Each worker's intra-op threads: the user's OMP_NUM_THREADS; on a local cluster this
    host's cores split among the workers, as launcher=elastic splits them among its ranks;
    else None: Ray sets OMP_NUM_THREADS to the CPUs each worker was given."""
    if "OMP_NUM_THREADS" in os.environ:
        return os.environ["OMP_NUM_THREADS"]
    if address is None:
        return str(hardware.threads_per_rank(spec.world_size))
    return None


def _controller_env(launcher: Any) -> dict[str, str]:
    """Ray Train's controller waits launcher.start_timeout for room for the worker group
    (then fails: FailureConfig's controller_failure_limit=0), or without end when null."""
    timeout = launcher.start_timeout
    return {} if timeout is None else {START_TIMEOUT_ENV: f"{timeout:g}"}


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


def _latest_attempt(run_dir: RunDir, world_size: int) -> int:
    """The last attempt any worker started (runner.train.ray_worker counts them)."""
    starts = [run_dir.starts(rank) for rank in range(world_size)]
    return max((int(path.read_text()) for path in starts if path.is_file()), default=1) - 1


def _train_worker(config: dict[str, Any]) -> None:
    """What Ray runs in each worker. The rank's module is imported there, never in this
    process: it ignores SIGUSR1/SIGUSR2 from its first line (as a rank must), which here
    would undo the graceful stop's handlers."""
    from runner.train.ray_worker import train_worker

    train_worker(config)


def _trainer(spec: RunSpec, run_dir: RunDir, env: dict[str, str]) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cuda = spec.device == "cuda"
    launcher: Any = spec.launcher  # launcher=ray's
    return TorchTrainer(
        _train_worker,
        train_loop_config={"run_dir": str(run_dir.root), "env": env},
        torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=spec.world_size,
            use_gpu=cuda,
            resources_per_worker=launcher.resources_per_worker or None,
        ),
        run_config=RunConfig(
            name="ray",
            storage_path=str(run_dir.root),
            failure_config=FailureConfig(
                max_failures=spec.max_restarts,
                controller_failure_limit=-1 if launcher.start_timeout is None else 0,
            ),
        ),
    )


def _gist(text: str) -> str:
    """Ray's first line, and the exception its traceback ends in, if any."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    error = re.compile(r"^[\w.]+(Error|Exception|Interrupt)\b")
    causes = [x for x in lines[1:] if error.match(x) and not x.startswith("ray.")]
    return " ".join([*lines[:1], *causes[-1:]])


def _no_room(spec: RunSpec) -> str:
    """The worker group found no room on the cluster within launcher.start_timeout."""
    import ray

    launcher: Any = spec.launcher
    each = launcher.resources_per_worker or {
        "CPU": 1,
        **({"GPU": 1} if spec.device == "cuda" else {}),
    }
    try:
        total = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
    except Exception:  # the cluster went meanwhile
        total = {}
    has = ", ".join(f"{k} {v:g}" for k, v in sorted(total.items()) if "memory" not in k)
    return (
        f"launcher=ray: no room on the Ray cluster for {spec.world_size} worker(s) of "
        f"{_resources(each)} each within launcher.start_timeout={launcher.start_timeout:g} s "
        f"(the cluster has {has or 'nothing'} in all); free or add resources, or "
        "launcher.start_timeout=null to wait for an autoscaler"
    )


def _resources(each: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in each.items()) + "}"


def _failed(
    spec: RunSpec, run_dir: RunDir, exc: Exception, watchdog: Watchdog | None, write_outcome: Any
) -> int:
    """The root cause among the ranks' error files (the latest attempt's), the watchdog's
    hang first; else what Ray said."""
    attempt = _latest_attempt(run_dir, spec.world_size)
    failures = [
        outcomes.rank_failure(run_dir, rank, path, 1, path.stat().st_mtime)
        for rank in range(spec.world_size)
        if (path := run_dir.error_file(rank, attempt)).is_file()
    ]
    hang = watchdog.hang if watchdog is not None else None
    if hang is not None:
        failures = [hang, *failures]
    if failures:
        cause = root_cause(failures)
        write_outcome(run_dir, Status.FAILED, cause.summary_error(others=len(failures) - 1))
        return 1
    if type(getattr(exc, "controller_failure", None)).__name__ == STARTUP_TIMEOUT:
        message = _no_room(spec)
    else:
        message = f"Ray: {type(exc).__name__}: {_gist(str(exc))}"
    write_outcome(run_dir, Status.FAILED, {"rank": None, "exitcode": 1, "message": message})
    return 1
