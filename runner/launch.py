"""Stage 4: the launcher process. Runs torch's elastic agent, which fans out the ranks.

`python -m runner.launch RUN_DIR` is started by the `runner` parent (which never
imports torch). It reads the resolved spec, starts `nproc` ranks of
`python -m runner.worker RUN_DIR` through a static TCP rendezvous, restarts them
up to `max_restarts` times, and when the ranks fail or a signal arrives it
stops them all and writes summary.json with the root cause.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from runner import hardware, rendezvous
from runner.artifacts import RunDir, read_json, tail
from runner.failures import RankFailure, root_cause
from runner.procs import die_with_parent, exit_code_for_signal
from runner.spec import RunSpec, load_spec
from runner.summary import FAILED, INTERRUPTED, read_summary, write_unfinished_summary

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


def launch(run_dir: RunDir, spec: RunSpec) -> int:
    """Run the elastic agent for this node; return the process exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous.register()
    threads = _set_thread_env(spec)
    start_time = float(os.environ.get("RUNNER_START_TIME", time.time()))
    os.environ["RUNNER_AGENT_PID"] = str(os.getpid())
    port = spec.master_port or 0
    config = LaunchConfig(
        min_nodes=spec.nodes,
        max_nodes=spec.nodes,
        nproc_per_node=spec.nproc,  # type: ignore[arg-type]
        run_id="runner",
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{spec.master_addr}:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 900},
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
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "runner.worker", str(run_dir.root))
    except ChildFailedError as exc:
        failures = _rank_failures(run_dir, exc.failures)
        cause = root_cause(failures)
        error = cause.summary_error(others=len(failures) - 1)
        write_unfinished_summary(run_dir, FAILED, spec.world_size, start_time, error)
        return 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"runner: received {name}; all ranks stopped", file=sys.stderr, flush=True)
        write_unfinished_summary(run_dir, INTERRUPTED, spec.world_size, start_time)
        return exit_code_for_signal(exc.sigval)
    summary = read_summary(run_dir)
    if spec.node_rank == 0 and (summary is None or summary.get("status") != "completed"):
        print("runner: ranks exited cleanly but rank 0 wrote no summary", file=sys.stderr)
        write_unfinished_summary(run_dir, FAILED, spec.world_size, start_time)
        return 1
    return 0


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m runner.launch RUN_DIR")
    parent = os.environ.get("RUNNER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    run_dir = RunDir(Path(sys.argv[1]))
    code = launch(run_dir, load_spec(run_dir.root))
    # Every artifact is on disk and every rank is gone: skip the interpreter's teardown,
    # which spends about a second in torch's and multiprocessing's exit handlers.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
