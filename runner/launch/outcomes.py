"""How this node's part of a run ended, said on the console and written to summary.json: a
rank's failure (its root cause, across nodes), a signal, a graceful stop, another node's
end, or the ranks' clean exit."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.launch import nodes
from runner.launch.failures import RankFailure, root_cause
from runner.launch.stopping import GracefulStop
from runner.launch.watchdog import Watchdog
from runner.processes import exit_code_for_signal
from runner.rundir.checkpoints import CheckpointStore
from runner.rundir.files import RunDir, read_json, tail, write_json
from runner.rundir.summary import Status, build_summary, read_summary, write_unfinished_summary
from runner.spec import RunSpec

log = logging.getLogger("runner")
OutcomeWriter = Callable[..., None]  # (run_dir, status, error=None, **extra)


def outcome_writer(spec: RunSpec, node_dir: Path, start_time: float) -> OutcomeWriter:
    """Node 0 writes the run's summary.json; another node writes its own in its node directory
    (`node{i}/summary.json`), with `run_dir` telling where its ranks wrote."""

    def write(run_dir: RunDir, status: str, error: dict | None = None, **extra: Any) -> None:
        if spec.node_rank == 0 and status == Status.INTERRUPTED and _ended_by_rank0(run_dir):
            return  # the signal came after rank 0 ended the run: its summary stands
        if spec.node_rank == 0:  # every rank is gone: no partial checkpoint outlives the run
            CheckpointStore(run_dir.checkpoints, keep=1).discard_unfinished()
            write_unfinished_summary(run_dir, status, spec.world_size, start_time, error, **extra)
            return
        summary = build_summary(status, spec.world_size, start_time, [], error=error, **extra)
        summary.update(
            node_rank=spec.node_rank, host=socket.gethostname(), run_dir=str(run_dir.root)
        )
        write_json(RunDir(node_dir).summary, summary)

    return write


def _ended_by_rank0(run_dir: RunDir) -> bool:
    """Whether this launch's rank 0 wrote the run's last summary (completed, or pruned by a
    sweep): an earlier launch's summary was set aside as this one started."""
    summary = read_summary(run_dir) or {}
    return summary.get("status") in (Status.COMPLETED, Status.PRUNED)


def _rank_failures(run_dir: RunDir, failures: dict) -> list[RankFailure]:
    return [
        rank_failure(
            run_dir, int(rank), failure.error_file, int(failure.exitcode), failure.timestamp
        )  # fmt: skip
        for rank, failure in failures.items()
    ]


def rank_failure(
    run_dir: RunDir, rank: int, error_file: str | Path | None, exitcode: int, when: float
) -> RankFailure:
    """A rank's failure, from the error file it wrote (runner.train.worker), if any."""
    data = read_json(Path(error_file)) if error_file else None
    ours = (data or {}).get("runner", {})
    return RankFailure(
        rank=rank,
        exitcode=exitcode,
        time=float(ours.get("time", when)),
        host=ours.get("host") or socket.gethostname(),
        error_type=ours.get("type"),
        message=ours.get("message", ""),
        traceback=ours.get("traceback", ""),
        log=run_dir.rank_log(rank),
        log_tail=tail(run_dir.rank_log(rank), 15),
        explained=bool(ours.get("explained")),
    )


def ranks_failed(
    failed: dict,
    run_dir: RunDir,
    link: nodes.NodeLink | None,
    watchdog: Watchdog | None,
    write_outcome: OutcomeWriter,
) -> int:
    """Ranks failed (torch elastic's ChildFailedError.failures): the root cause, weighed with
    the watchdog's hang and the other nodes' failures, goes to summary.json."""
    failures = _rank_failures(run_dir, failed)
    hang = watchdog.caused({f.pid for f in failed.values()}) if watchdog else None
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
    write_outcome(run_dir, Status.FAILED, cause.summary_error(others=len(failures) - 1))
    if link is not None:
        link.linger()
    return 1


def signalled(
    sigval: int,
    run_dir: RunDir,
    link: nodes.NodeLink | None,
    watchdog: Watchdog | None,
    write_outcome: OutcomeWriter,
    reached: int | None = None,
) -> int:
    """The agent was signalled (torch elastic's SignalException): by another node's end, whose
    cause becomes ours, or by the user or the scheduler. `reached`: the last step every rank
    here had finished (their heartbeats), the summary's `steps`."""
    notices = link.notices if link is not None else []
    if notices:  # another node's part ended first: end with its cause
        hang = watchdog.hang if watchdog is not None else None
        if hang is not None:  # ours hung too: the other nodes weigh both
            link.publish(hang)  # type: ignore[union-attr]
        code = _stopped_by_other_node(notices, run_dir, write_outcome, hang)
        link.linger()  # type: ignore[union-attr]
        return code
    name = signal.Signals(sigval).name
    if link is None and _ended_by_rank0(run_dir):  # the run had ended: its result stands
        log.info("runner: received %s as the run ended; it had ended already", name)
        return 0
    steps = {} if reached is None else {"steps": reached}
    write_outcome(run_dir, Status.INTERRUPTED, None, signal=name, **steps)  # the parent says where
    if link is not None:
        link.publish(None, signal_name=name)
        link.linger()
    return exit_code_for_signal(sigval)


def ranks_exited(node_rank: int, run_dir: RunDir, write_outcome: OutcomeWriter) -> int:
    """Every rank exited with 0: completed (or pruned by a sweep), if rank 0 said so in
    summary.json."""
    if node_rank > 0:
        write_outcome(run_dir, Status.COMPLETED)
        return 0
    summary = read_summary(run_dir)
    if summary is None or summary.get("status") not in (Status.COMPLETED, Status.PRUNED):
        log.error("runner: ranks exited cleanly but rank 0 wrote no summary")
        write_outcome(run_dir, Status.FAILED)
        return 1
    return 0


def stopped_as_asked(stop: GracefulStop, run_dir: RunDir, write_outcome: OutcomeWriter) -> int:
    """Every rank stopped after the agreed step and saved a checkpoint there."""
    latest = CheckpointStore(run_dir.checkpoints, keep=1).latest()
    where = str(latest.relative_to(run_dir.root)) if latest is not None else None
    log.error("runner: stopped after step %s (%s); checkpoint %s", stop.step, stop.asked_by, where)
    stopped = {"asked_by": stop.asked_by, "after_step": stop.step, "checkpoint": where}
    write_outcome(run_dir, Status.INTERRUPTED, None, steps=stop.step, stopped=stopped)
    return exit_code_for_signal(stop.signal)


def _stopped_by_other_node(
    notices: list[nodes.StopNotice],
    run_dir: RunDir,
    write_outcome: OutcomeWriter,
    hang: RankFailure | None,
) -> int:
    failures = [n.failure for n in notices if n.failure is not None]
    if hang is not None:
        failures.append(hang)
    if failures:
        cause = root_cause(failures)
        log.error("runner: stopped because %s", cause.headline())
        write_outcome(run_dir, Status.FAILED, cause.summary_error(others=len(failures) - 1))
        return 1
    notice = notices[0]
    log.error("runner: stopped because %s", notice.reason)
    status = Status.INTERRUPTED if notice.interrupted else Status.FAILED
    write_outcome(run_dir, status, {"rank": None, "exitcode": 1, "message": notice.reason})
    return 1
