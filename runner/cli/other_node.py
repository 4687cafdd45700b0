"""Node i > 0 of a multi-node run, in its parent process: its own files go to `node{i}/`,
its agent runs its ranks, and what it says of the run is node 0's summary where it sees it."""

from __future__ import annotations

import logging
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from runner.cli.outcome import report_outcome, shown
from runner.cli.requeue import continue_after_stop
from runner.cli.run_files import discard, environment
from runner.cli.supervise import run_agent
from runner.processes import stops_held
from runner.rundir.files import RunDir, read_json, write_json
from runner.rundir.summary import Status, read_summary
from runner.secrets import Secrets
from runner.spec import RunSpec, save_spec

log = logging.getLogger("runner")


def run_other_node(
    spec: RunSpec, secrets: Secrets, run_dir: RunDir, start_time: float
) -> float | None:
    """Node i > 0 of a multi-node run. Its own files (config.yaml, env.json, summary.json,
    .hydra/) go to `node{i}/`; its ranks write into node 0's run directory when this node
    sees it (shared filesystem) and into this one otherwise. With a shared filesystem the
    `node{i}/` directory then moves next to node 0's files, and this node's own run
    directory, left empty, goes away: one run, one directory."""
    node_dir = run_dir.root / f"node{spec.node_rank}"
    node_dir.mkdir(parents=True, exist_ok=True)
    outcome = RunDir(node_dir).summary
    outcome.unlink(missing_ok=True)
    save_spec(spec, node_dir, secrets)
    write_json(node_dir / "env.json", environment(spec, secrets))
    end = run_agent(node_dir, start_time, secrets.environment())
    with stops_held():  # a requeue's SIGTERM here left this start's directory behind
        summary = _node_summary(end, spec, run_dir, outcome)
        ranks_root = Path(summary.get("run_dir") or run_dir.root)
        node_dir = _join_first_node(node_dir, ranks_root, run_dir)
    first = spec.node_rank * spec.nproc  # type: ignore[operator]
    log.info(
        "runner: node %d (ranks %d-%d): its files are in %s",
        spec.node_rank,
        first,
        first + spec.nproc - 1,  # type: ignore[operator]
        shown(node_dir),
    )
    run_summary = read_summary(RunDir(ranks_root))
    final_summary = (
        run_summary if summary.get("status") == Status.COMPLETED and run_summary else summary
    )
    report_outcome(final_summary, RunDir(ranks_root))
    if end.asked and summary.get("stopped"):
        after = summary["stopped"]["after_step"]
        continue_after_stop(end.asked, end.asked_handler, spec.node_rank, after)
    if end.code != 0 and HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(end.code)
    return final_summary.get("final", {}).get(spec.sweep.metric, math.nan)


def _node_summary(end: Any, spec: RunSpec, run_dir: RunDir, outcome: Path) -> dict:
    """This node's summary.json once its agent has ended; written here if the agent died
    before it could write one."""
    code, received = end.code, end.received
    summary = read_json(outcome)
    if summary is None:  # the agent died before it could write one
        summary = {
            "status": str(Status.INTERRUPTED if received else Status.FAILED),
            "node_rank": spec.node_rank,
            "run_dir": str(run_dir.root),
            "error": {"rank": None, "exitcode": code, "message": f"launcher exited with {code}"},
        }
        write_json(outcome, summary)
    return summary


def _join_first_node(node_dir: Path, ranks_root: Path, run_dir: RunDir) -> Path:
    """Where this node's files end: next to node 0's where its ranks wrote into node 0's run
    directory (a shared filesystem: this node's own, left empty, goes away), else here."""
    if ranks_root.resolve() == run_dir.root.resolve():
        return node_dir
    target = ranks_root / node_dir.name
    shutil.rmtree(target, ignore_errors=True)  # an earlier launch's, in a resumed run
    shutil.move(str(node_dir), str(target))
    discard(run_dir.root)
    return target
