"""Stage 4: the launcher process. Runs torch's elastic agent, which fans out the ranks.

`python -m runner.launch.agent NODE_DIR` is started by the `runner` parent (which never
imports torch). It reads the resolved spec, on a multi-node run agrees with the
other nodes' agents (runner.launch.nodes), starts `nproc` ranks of
`python -m runner.train.worker RUN_DIR` through a static TCP rendezvous, restarts them
up to `max_restarts` times, and when the ranks fail or a signal arrives it
stops them all and writes summary.json with the root cause.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from runner import hardware, heartbeat
from runner.artifacts import RunDir, read_json, tail, write_json
from runner.checkpoint_store import CheckpointStore
from runner.launch import network, nodes, rendezvous
from runner.launch.failures import RankFailure, root_cause
from runner.launch.forkserver import ForkServer, forked_ranks, modules_for
from runner.launch.stopping import GracefulStop, catch_early
from runner.launch.watchdog import Watchdog
from runner.procs import (
    RANK_PARENT_ENV,
    START_METHOD_ENV,
    add_code_dirs,
    can_fork_ranks,
    die_with_parent,
    exit_code_for_signal,
)
from runner.spec import RunSpec, load_spec
from runner.summary import (
    COMPLETED,
    FAILED,
    INTERRUPTED,
    build_summary,
    read_summary,
    write_unfinished_summary,
)

SHUTDOWN_TIMEOUT_S = 10
log = logging.getLogger("runner")


def _logs_specs(run_dir: RunDir):
    """Ranks write their own logs/rank{R}.log; the agent only assigns error files."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RunLogsSpecs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(run_dir.logs))

        @property
        def root_log_dir(self) -> str:
            return str(run_dir.logs)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            attempt = int(next(iter(envs.values()))["TORCHELASTIC_RESTART_COUNT"]) if envs else 0
            error_files = {}
            for local_rank, env in envs.items():
                path = run_dir.error_file(int(env["RANK"]), attempt)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
                error_files[local_rank] = str(path)
                env["TORCHELASTIC_ERROR_FILE"] = str(path)  # where the rank records its exception
            consoles = dict.fromkeys(envs, "")  # "" = inherit the agent's stdout/stderr
            return LogsDest(stdouts=consoles, stderrs=dict(consoles), error_files=error_files)

    return RunLogsSpecs()


def _quiet_torch_elastic() -> None:
    """runner reports failures and signals itself; torch elastic's loggers set their own
    levels (LOGLEVEL, default WARNING) as they are created, so silence each one."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates the loggers)
    import torch.distributed.launcher.api  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _set_thread_env(spec: RunSpec) -> int:
    """Split this node's cores among its ranks, before any rank imports torch."""
    threads = hardware.threads_per_rank(spec.nproc)  # type: ignore[arg-type]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    return int(os.environ["OMP_NUM_THREADS"])


def _rank_failures(run_dir: RunDir, failures: dict) -> list[RankFailure]:
    result = []
    for rank, failure in failures.items():
        data = read_json(Path(failure.error_file)) if failure.error_file else None
        ours = (data or {}).get("runner", {})
        result.append(
            RankFailure(
                rank=int(rank),
                exitcode=int(failure.exitcode),
                time=float(ours.get("time", failure.timestamp)),
                host=ours.get("host") or socket.gethostname(),
                error_type=ours.get("type"),
                message=ours.get("message", ""),
                traceback=ours.get("traceback", ""),
                log=run_dir.rank_log(int(rank)),
                log_tail=tail(run_dir.rank_log(int(rank)), 15),
            )
        )
    return result


def _outcome_writer(spec: RunSpec, node_dir: Path, start_time: float):
    """Node 0 writes the run's summary.json; another node writes its own in its node directory
    (`node{i}/summary.json`), with `run_dir` telling where its ranks wrote."""

    def write(run_dir: RunDir, status: str, error: dict | None = None, **extra: Any) -> None:
        if spec.node_rank == 0:  # every rank is gone: no partial checkpoint outlives the run
            CheckpointStore(run_dir.checkpoints, keep=1).discard_unfinished()
            write_unfinished_summary(run_dir, status, spec.world_size, start_time, error, **extra)
            return
        summary = build_summary(status, spec.world_size, start_time, [], error=error, **extra)
        summary.update(
            node_rank=spec.node_rank, host=socket.gethostname(), run_dir=str(run_dir.root)
        )
        write_json(node_dir / "summary.json", summary)

    return write


def _join_nodes(spec: RunSpec, node_dir: Path, run_root: Path) -> tuple[nodes.NodeLink, Path]:
    """Meet the other nodes (see launch.nodes); returns the link and where the ranks write."""
    assert spec.master_port is not None, "multi-node runs have a fixed master_port"
    if spec.node_rank > 0:
        log.info(
            "runner: node %d of %d: waiting for node 0 at %s:%d",
            spec.node_rank,
            spec.nodes,
            spec.master_addr,
            spec.master_port,
        )
    else:
        log.info(
            "runner: node 0 of %d: waiting for the other nodes on port %d",
            spec.nodes,
            spec.master_port,
        )
    try:
        link = nodes.NodeLink(spec.master_addr, spec.master_port, spec.node_rank, spec.nodes)
    except Exception as exc:  # cannot bind (node 0) or reach node 0 (the others)
        what = "listen on" if spec.node_rank == 0 else "reach node 0 at"
        raise nodes.NodeMismatch(
            f"node {spec.node_rank} cannot {what} {spec.master_addr}:{spec.master_port}: "
            + _first_line(exc)
        ) from None
    try:
        placement = link.agree(run_root, (node_dir / "config.yaml").read_text())
    except nodes.NodeMismatch:
        raise
    except Exception as exc:  # a node never came, or went away while the nodes met
        raise nodes.NodeMismatch(
            f"node {spec.node_rank}: the {spec.nodes} nodes did not all meet within "
            f"{nodes.JOIN_TIMEOUT_S} s on {spec.master_addr}:{spec.master_port}: "
            + _first_line(exc)
        ) from None
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # see runner.launch.network
        interface = network.interface_towards(spec.master_addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if spec.node_rank == 0:
        env_path = RunDir(run_root).env
        env = read_json(env_path) or {}
        env["hosts"] = list(dict.fromkeys(n["host"] for n in placement.nodes))
        env["nodes"] = placement.nodes
        write_json(env_path, env)
    elif not placement.shared:
        log.warning(
            "runner: node %d does not see node 0's run directory; its ranks write to %s "
            "(checkpoints and resume need a shared filesystem)",
            spec.node_rank,
            placement.run_root,
        )
    return link, placement.run_root


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def launch(node_dir: Path, spec: RunSpec, server: ForkServer | None = None) -> int:
    """Run the elastic agent for this node; return the process exit code.

    `node_dir` holds this node's config.yaml: the run directory on node 0, its
    `node{i}/` subdirectory on the others. `server` forks the ranks when the spec's
    start_method is forkserver (runner.launch.forkserver); this call ends it.
    """
    if server is not None and spec.start_method != "forkserver":
        server.close()
        server = None
    if server is not None:
        server.preload(modules_for(spec))
    try:
        return _launch(node_dir, spec, server)
    finally:
        if server is not None:
            server.close()


def _launch(node_dir: Path, spec: RunSpec, server: ForkServer | None) -> int:
    start_time = float(os.environ.get("RUNNER_START_TIME", time.time()))
    write_outcome = _outcome_writer(spec, node_dir, start_time)
    run_root = node_dir if spec.node_rank == 0 else node_dir.parent
    add_code_dirs(spec.code_dir)  # here, and for the ranks through PYTHONPATH
    from runner.launch.preflight import INVALID, component_problems  # imports torch

    problems = component_problems(spec)
    if problems:  # the parent reports them like its own checks, and no rank starts
        message = "invalid configuration: " + "; ".join(problems)
        error = {"rank": None, "exitcode": INVALID, "message": message, "problems": problems}
        write_outcome(RunDir(run_root), FAILED, error)
        return INVALID
    link = None
    if spec.nodes > 1:
        try:
            link, run_root = _join_nodes(spec, node_dir, run_root)
        except nodes.NodeMismatch as exc:  # reported by the parent, from the summary
            error = {"rank": None, "exitcode": 2, "message": f"the nodes cannot start: {exc}"}
            write_outcome(RunDir(run_root), FAILED, error)
            return 2
    run_dir = RunDir(run_root)
    beats = heartbeat.create(spec.nproc)  # the ranks' heartbeats and the stop's control block
    os.environ[heartbeat.ENV] = str(beats)
    try:
        return _run_ranks(spec, node_dir, run_dir, link, beats, write_outcome, server)
    finally:
        beats.unlink(missing_ok=True)


def _run_ranks(
    spec: RunSpec,
    node_dir: Path,
    run_dir: RunDir,
    link: nodes.NodeLink | None,
    beats: Path,
    write_outcome,
    server: ForkServer | None,
) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous.register()
    threads = _set_thread_env(spec)
    os.environ[RANK_PARENT_ENV] = str(os.getpid())  # a forked rank's is the server
    os.environ["RUNNER_NODE_DIR"] = str(node_dir)  # ranks read this node's config.yaml
    port = spec.master_port or 0
    config = LaunchConfig(
        min_nodes=spec.nodes,
        max_nodes=spec.nodes,
        nproc_per_node=spec.nproc,  # type: ignore[arg-type]
        run_id="runner",
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{spec.master_addr}:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": nodes.JOIN_TIMEOUT_S},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=_logs_specs(run_dir),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
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
    watchdog = (
        Watchdog(spec.watchdog, run_dir, spec.nproc, spec.nodes, path=beats)
        if spec.watchdog.timeout
        else None
    )
    if watchdog is not None:
        watchdog.start()
    try:
        with forked_ranks(server):
            worker = ("-u", "-m", "runner.train.worker", str(run_dir.root))
            elastic_launch(config, sys.executable)(*worker)
    except ChildFailedError as exc:
        _settle(link, watchdog)
        failures = _rank_failures(run_dir, exc.failures)
        hang = watchdog.caused({f.pid for f in exc.failures.values()}) if watchdog else None
        if hang is not None:  # the watchdog killed them: the hang is the cause, not SIGKILL
            failures = [hang, *(f for f in failures if f.rank != hang.rank)]
        cause = root_cause(failures)
        if link is not None:
            link.publish(cause)
            wait = nodes.COLLECT_S if cause.is_consequence or hang else 0.5  # the others' hangs
            failures += link.remote_failures(wait)
            cause = root_cause(failures)
        # summary.json before lingering: SLURM kills what is left KillWait seconds after a
        # scancel or requeue (30 s by default; 5 s on the test cluster)
        write_outcome(run_dir, FAILED, cause.summary_error(others=len(failures) - 1))
        if link is not None:
            link.linger()
        return 1
    except SignalException as exc:
        _settle(link, watchdog)
        notices = link.notices if link is not None else []
        if notices:  # another node's part ended first: end with its cause
            hang = watchdog.hang if watchdog is not None else None
            if hang is not None:  # ours hung too: the other nodes weigh both
                link.publish(hang)  # type: ignore[union-attr]
            code = _stopped_by_other_node(notices, run_dir, write_outcome, hang)
            link.linger()  # type: ignore[union-attr]
            return code
        name = signal.Signals(exc.sigval).name
        print(f"runner: received {name}; all ranks stopped", file=sys.stderr, flush=True)
        write_outcome(run_dir, INTERRUPTED)
        if link is not None:
            link.publish(None, signal_name=name)
            link.linger()
        return exit_code_for_signal(exc.sigval)
    _settle(link, watchdog)
    if stop.step is not None and heartbeat.stopped(beats, spec.nproc):
        return _stopped_as_asked(stop, run_dir, write_outcome)
    if spec.node_rank > 0:
        write_outcome(run_dir, COMPLETED)
        return 0
    summary = read_summary(run_dir)
    if summary is None or summary.get("status") != "completed":
        print("runner: ranks exited cleanly but rank 0 wrote no summary", file=sys.stderr)
        write_outcome(run_dir, FAILED)
        return 1
    return 0


def _settle(link: nodes.NodeLink | None, watchdog: Watchdog | None) -> None:
    """The ranks are gone: stop watching them and the other nodes, and let no late signal
    cut the summary short (the parent still kills us if we overstay)."""
    if watchdog is not None:
        watchdog.stop()
    if link is not None:
        link.stop_watching()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _stopped_as_asked(stop: GracefulStop, run_dir: RunDir, write_outcome) -> int:
    """Every rank stopped after the agreed step and saved a checkpoint there."""
    latest = CheckpointStore(run_dir.checkpoints, keep=1).latest()
    where = str(latest.relative_to(run_dir.root)) if latest is not None else None
    print(f"runner: stopped after step {stop.step} ({stop.asked_by}); checkpoint {where}",
          file=sys.stderr, flush=True)  # fmt: skip
    stopped = {"asked_by": stop.asked_by, "after_step": stop.step, "checkpoint": where}
    write_outcome(run_dir, INTERRUPTED, None, steps=stop.step, stopped=stopped)
    return exit_code_for_signal(stop.signal)


def _stopped_by_other_node(
    notices: list[nodes.StopNotice], run_dir: RunDir, write_outcome, hang: RankFailure | None
) -> int:
    failures = [n.failure for n in notices if n.failure is not None]
    if hang is not None:
        failures.append(hang)
    if failures:
        cause = root_cause(failures)
        print(f"runner: stopped because {cause.headline()}", file=sys.stderr, flush=True)
        write_outcome(run_dir, FAILED, cause.summary_error(others=len(failures) - 1))
        return 1
    notice = notices[0]
    print(f"runner: stopped because {notice.reason}", file=sys.stderr, flush=True)
    status = INTERRUPTED if notice.interrupted else FAILED
    write_outcome(run_dir, status, {"rank": None, "exitcode": 1, "message": notice.reason})
    return 1


def _import_torch() -> None:
    """Import torch without starting numpy's OpenBLAS thread pool (it sizes its pool when it
    loads, from the environment): the fork server is forked from this process next. Without
    the cyclic garbage collector while it imports."""
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    gc.disable()  # it would walk the growing heap over and over: a quarter of the import
    try:
        import torch  # noqa: F401
    finally:
        gc.enable()
        if blas is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = blas


def _quiet_cpp_warnings() -> None:
    """torch's C++ warnings (a TCPStore peer going away at the end of a multi-node run) are
    noise on the agent's console: unless TORCH_CPP_LOG_LEVEL says otherwise, show errors only
    (the level torch read from that variable when it loaded; c10's flag, set in place)."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    import ctypes

    import torch

    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    with contextlib.suppress(OSError, ValueError):
        ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_log_level").value = 2


def _fork_server_wanted(spec: RunSpec | None) -> bool:
    """Whether this run forks its ranks (start_method, runner.launch.forkserver). A prestarted
    agent (no spec yet) knows only what the parent saw on the command line."""
    if not can_fork_ranks():
        return False
    if spec is None:
        return os.environ.get(START_METHOD_ENV, "auto") != "spawn"
    return spec.start_method == "forkserver"


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(
            "usage: python -m runner.launch.agent NODE_DIR  (the run directory on node 0), or - to "
            "import torch first and then read 'NODE_DIR<TAB>START_TIME' from stdin"
        )
    catch_early()  # a graceful stop asked while torch imports (SLURM signals every process)
    parent = os.environ.get("RUNNER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    node_dir = Path(sys.argv[1])
    spec = None if sys.argv[1] == "-" else load_spec(node_dir)  # prestarted: not known yet
    _import_torch()
    # Now, with torch imported once for both and before this process has any thread: the
    # fork server imports the ranks' other modules while we wait for the run and start it.
    server = ForkServer.start() if _fork_server_wanted(spec) else None
    _quiet_cpp_warnings()  # after the fork: the ranks keep the user's setting
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _quiet_torch_elastic()
    if spec is None:  # prestarted by the parent: torch is imported, now the run
        line = sys.stdin.readline()
        if not line.strip():  # the parent needed no run after all
            os._exit(0)
        where, start_time = line.rstrip("\n").split("\t")
        node_dir = Path(where)
        os.environ["RUNNER_START_TIME"] = start_time
        spec = load_spec(node_dir)
    code = launch(node_dir, spec, server)
    # Every artifact is on disk and every rank is gone: skip the interpreter's teardown,
    # which spends about a second in torch's and multiprocessing's exit handlers.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
