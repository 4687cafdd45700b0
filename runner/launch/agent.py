# ruff: noqa: E402  (a signal while this module imports ends it quietly: set first)
"""Stage 4: the launcher process. Runs torch's elastic agent, which fans out the ranks.

`python -m runner.launch.agent NODE_DIR` is started by the `runner` parent (which never
imports torch). It reads the resolved spec, on a multi-node run agrees with the
other nodes' agents (runner.launch.nodes), starts `nproc` ranks of
`python -m runner.train.worker RUN_DIR` through a static TCP rendezvous, restarts them
up to `max_restarts` times, and when the ranks fail or a signal arrives it
stops them all and writes summary.json with the root cause.
"""

from __future__ import annotations

import os
import signal


def _exit_quietly(signum: int, _frame: object) -> None:
    """SIGINT, SIGTERM or SIGHUP (relayed by the parent) while this process still imports:
    nothing has started, so it ends at once, with the signal's exit code, and without the
    traceback of whatever import it was in."""
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _exit_quietly)

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

from runner import hardware, heartbeat
from runner.errors import describe
from runner.launch import nodes, outcomes, rendezvous, torch_setup
from runner.launch.forked_ranks import ForkServer, forked_ranks, modules_for
from runner.launch.join import join_nodes
from runner.launch.restarts import Attempts
from runner.launch.stopping import GracefulStop, catch_early
from runner.launch.watchdog import Watchdog
from runner.processes import (
    RANK_PARENT_ENV,
    START_METHOD_ENV,
    add_code_dirs,
    can_fork_ranks,
    die_with_parent,
    exit_code_for_signal,
    quiet_library_noise,
)
from runner.rundir.checkpoints import CheckpointStore
from runner.rundir.files import RunDir
from runner.rundir.summary import Status
from runner.secrets import SECRETS_ENV
from runner.spec import RunSpec, load_spec, slurm

SHUTDOWN_TIMEOUT_S = 10
log = logging.getLogger("runner")


def _set_thread_env(spec: RunSpec) -> int:
    """Split this node's cores among its ranks, before any rank imports torch."""
    threads = hardware.threads_per_rank(spec.nproc)  # type: ignore[arg-type]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    return int(os.environ["OMP_NUM_THREADS"])


def launch(node_dir: Path, spec: RunSpec, server: ForkServer | None = None) -> int:
    """Run the elastic agent for this node; return the process exit code.

    `node_dir` holds this node's config.yaml: the run directory on node 0, its
    `node{i}/` subdirectory on the others. `server` forks the ranks when the spec's
    start_method is forkserver (runner.launch.forked_ranks); this call ends it.
    """
    if server is not None and spec.start_method != "forkserver":
        server.close()
        server = None
    if server is not None:
        server.preload(modules_for(spec))
    try:
        return _launch(node_dir, spec, server)
    finally:
        _ignore_signals()  # the outcome is written: a late signal must not cut the teardown
        if server is not None:
            server.close()


def _ignore_signals() -> None:
    """Once every rank is gone and summary.json says how the run ended, SIGINT, SIGTERM and
    SIGHUP change nothing (torch elastic's handler would raise in the teardown, a traceback
    after the run's last line); the parent still kills this process if it overstays."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _launch(node_dir: Path, spec: RunSpec, server: ForkServer | None) -> int:
    start_time = float(os.environ.get("RUNNER_START_TIME", time.time()))
    write_outcome = outcomes.outcome_writer(spec, node_dir, start_time)
    run_root = node_dir if spec.node_rank == 0 else node_dir.parent
    add_code_dirs(spec.code_dir)  # here, and for the ranks through PYTHONPATH
    from runner.launch.preflight import INVALID, component_problems  # imports torch
    from runner.models.initial_weights import meta_init_applies

    problems = component_problems(spec)
    if problems:  # the parent reports them like its own checks, and no rank starts
        message = "invalid configuration: " + "; ".join(problems)
        error = {"rank": None, "exitcode": INVALID, "message": message, "problems": problems}
        write_outcome(RunDir(run_root), Status.FAILED, error)
        return INVALID
    link = None
    if spec.nodes > 1:
        try:
            link, run_root = join_nodes(spec, node_dir, run_root)
        except nodes.NodeMismatch as exc:  # reported by the parent, from the summary
            error = {"rank": None, "exitcode": 2, "message": f"the nodes cannot start: {exc}"}
            write_outcome(RunDir(run_root), Status.FAILED, error)
            return 2
    run_dir = RunDir(run_root)
    if meta_init_applies(spec):
        try:
            _seed_weights(spec, run_dir)
        except Exception as exc:
            error = {"rank": None, "exitcode": 1, "message": f"initial weights: {describe(exc)}"}
            write_outcome(run_dir, Status.FAILED, error)
            return 1
    slots = spec.world_size if spec.launcher.name == "ray" else spec.nproc  # ranks on this host
    beats = heartbeat.create(slots)  # the ranks' heartbeats and the stop's control block
    os.environ[heartbeat.ENV] = str(beats)
    try:
        if spec.launcher.name == "ray":
            from runner.launch.ray_launch import run_on_ray

            return run_on_ray(spec, node_dir, run_dir, beats, write_outcome)
        return _run_ranks(spec, node_dir, run_dir, link, beats, write_outcome, server)
    finally:
        beats.unlink(missing_ok=True)


def _seed_weights(spec: RunSpec, run_dir: RunDir) -> None:
    """The seed weights a meta_init run's ranks fill their shards from: written once per
    run, and only where a rank will read them."""
    from runner.models.initial_weights import write_seed_weights

    path = run_dir.seed_weights
    if _keeps_seed_weights(spec, run_dir):
        log.info("runner: initial weights: %s, kept from its first start", path)
        return
    size = write_seed_weights(spec, path)
    if size is None:
        log.info("runner: initial weights: none written, init_from fills every tensor")
    else:
        log.info("runner: initial weights: %s (%.1f MB)", path, size / 2**20)


def _keeps_seed_weights(spec: RunSpec, run_dir: RunDir) -> bool:
    """A start that resumes the run from one of its own checkpoints (resume=auto, a requeued
    SLURM job) keeps the seed weights its first start wrote, rather than building the whole
    model again: the checkpoint overwrites them (the ranks read from them only what it does
    not hold, such as non-persistent buffers)."""
    resumes = spec.resume is not None or slurm.requeued(os.environ)
    own = CheckpointStore(run_dir.checkpoints, keep=1).latest() if resumes else None
    return own is not None and run_dir.seed_weights.is_file()


def _run_ranks(
    spec: RunSpec,
    node_dir: Path,
    run_dir: RunDir,
    link: nodes.NodeLink | None,
    beats: Path,
    write_outcome: outcomes.OutcomeWriter,
    server: ForkServer | None,
) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    rendezvous.register()
    threads = _set_thread_env(spec)
    os.environ[RANK_PARENT_ENV] = str(os.getpid())  # a forked rank's is the server
    os.environ["RUNNER_NODE_DIR"] = str(node_dir)  # ranks read this node's config.yaml
    watchdog = None
    if spec.watchdog.timeout:
        watchdog = Watchdog(spec.watchdog, run_dir, spec.nproc, spec.nodes, path=beats)
    attempts = Attempts(run_dir, spec.max_restarts, beats, spec.nproc, watchdog)  # restarts said
    config = _launch_config(spec, run_dir, attempts)
    log.info(
        "runner: %d rank(s) on this node (world size %d, %s, %d thread(s) per rank) -> %s",
        spec.nproc,
        spec.world_size,
        spec.device,
        threads,
        run_dir.root,
    )
    stop = GracefulStop(beats, spec.nproc, link)
    stop.install()
    if link is not None:
        link.watch(on_stop_asked=stop.ask)
    if watchdog is not None:
        watchdog.start()
    try:
        with forked_ranks(server, attempts.note):
            worker = ("-u", "-m", "runner.train.worker", str(run_dir.root))
            elastic_launch(config, sys.executable)(*worker)
    except ChildFailedError as exc:
        _settle(link, watchdog)
        return outcomes.ranks_failed(exc.failures, run_dir, link, watchdog, write_outcome)
    except SignalException as exc:
        _settle(link, watchdog)
        reached = heartbeat.finished_step(beats, spec.nproc)
        return outcomes.signalled(exc.sigval, run_dir, link, watchdog, write_outcome, reached)
    _settle(link, watchdog)
    if stop.step is not None and heartbeat.stopped(beats, spec.nproc):
        return outcomes.stopped_as_asked(stop, run_dir, write_outcome)
    return outcomes.ranks_exited(spec.node_rank, run_dir, write_outcome)


def _launch_config(spec: RunSpec, run_dir: RunDir, attempts: Attempts) -> Any:
    """torch elastic's launch: one static rendezvous (runner.launch.rendezvous), ranks
    spawned (or forked through runner.launch.forked_ranks), restarted up to max_restarts."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        **_shutdown_timeout(LaunchConfig),
        min_nodes=spec.nodes,
        max_nodes=spec.nodes,
        nproc_per_node=spec.nproc,  # type: ignore[arg-type]
        run_id="runner",
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{spec.master_addr}:{spec.master_port or 0}",
        rdzv_configs={"rank": spec.node_rank, "timeout": nodes.JOIN_TIMEOUT_S},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=torch_setup.logs_specs(run_dir, attempts.restarting),
    )


def _shutdown_timeout(launch_config: type) -> dict[str, Any]:
    """How long ranks get between SIGTERM and SIGKILL when the agent shuts them down, where
    this torch lets us say (LaunchConfig.shutdown_timeout, newer than 2.11, which waits 30 s)."""
    names = {f.name for f in dataclasses.fields(launch_config)}
    return {"shutdown_timeout": SHUTDOWN_TIMEOUT_S} if "shutdown_timeout" in names else {}


def _settle(link: nodes.NodeLink | None, watchdog: Watchdog | None) -> None:
    """The ranks are gone: stop watching them and the other nodes, and let no late signal
    cut the summary short (the parent still kills us if we overstay). Signals first: the
    link's watcher stops this agent with SIGTERM when another node's part ends, and it may
    do so while the watchdog is being stopped, after our own ranks failed."""
    _ignore_signals()
    if link is not None:
        link.stop_watching()
    if watchdog is not None:
        watchdog.stop()


def _fork_server_wanted(spec: RunSpec | None) -> bool:
    """Whether this run forks its ranks (start_method, runner.launch.forked_ranks). A prestarted
    agent (no spec yet) knows only what the parent saw on the command line."""
    if not can_fork_ranks():
        return False
    if spec is None:
        return os.environ.get(START_METHOD_ENV, "auto") != "spawn"
    return spec.start_method == "forkserver"


class _Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP before the ranks started (torch elastic takes them over as it
    starts them): this process ends without a traceback, with the signal's exit code."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # the signals _raise_interrupted raised for


def _raise_interrupted(signum: int, _frame: Any) -> None:
    _received.append(signum)
    raise _Interrupted(signum)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(
            "usage: python -m runner.launch.agent NODE_DIR  (the run directory on node 0), or - to "
            "import torch first and then read 'NODE_DIR<TAB>START_TIME' from stdin"
        )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (imported as a module too)
        signal.signal(sig, _exit_quietly)
    try:
        _main()
    except BaseException as exc:  # the parent writes the summary and says where it stopped
        signum = getattr(exc, "signum", None) or getattr(exc, "sigval", None)  # ours, torch's
        if signum is None and _received:  # what a signal set off (an import it cut short)
            signum = _received[0]
        if signum is None:
            raise
        _exit_now(exit_code_for_signal(signum))


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main() -> None:
    catch_early()  # a graceful stop asked while torch imports (SLURM signals every process)
    parent = os.environ.get("RUNNER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    node_dir = Path(sys.argv[1])
    spec = None if sys.argv[1] == "-" else load_spec(node_dir)  # prestarted: not known yet
    quiet_library_noise()  # before the imports that make it
    torch_setup.import_torch()
    # Now, with torch imported once for both and before this process has any thread: the
    # fork server imports the ranks' other modules while we wait for the run and start it.
    server = ForkServer.start() if _fork_server_wanted(spec) else None
    torch_setup.quiet_cpp_warnings()  # after the fork: the ranks keep the user's setting
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch_setup.quiet_torch_elastic()
    if spec is None:  # prestarted by the parent: torch is imported, now the run
        line = sys.stdin.readline()
        if not line.strip():  # the parent needed no run after all
            os._exit(0)
        where, start_time, secrets = line.rstrip("\n").split("\t", 2)
        node_dir = Path(where)
        os.environ["RUNNER_START_TIME"] = start_time
        os.environ[SECRETS_ENV] = secrets  # the ranks inherit it: never in a file
        spec = load_spec(node_dir)
    # From here a signal unwinds (the heartbeat file, the fork server are cleaned up). Not
    # before: raised inside an import (torch's, numpy's), it left a module half-imported,
    # whose next use recursed without end (a RecursionError's traceback on the terminal)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    code = launch(node_dir, spec, server)
    # Every artifact is on disk and every rank is gone: skip the interpreter's teardown,
    # which spends about a second in torch's and multiprocessing's exit handlers.
    _exit_now(code)


if __name__ == "__main__":
    main()
