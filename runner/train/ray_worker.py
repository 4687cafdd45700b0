"""One rank as a Ray Train worker (launcher=ray): the stages of runner.train.worker, in a
process Ray started, whose process group Ray Train set up.

Ray restarts the whole worker group after a failure (launcher=ray's max_restarts); each
rank counts its own starts in the run's logs/, so a restarted attempt resumes from the
latest checkpoint as torch elastic's does (TORCHELASTIC_RESTART_COUNT, which runner reads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runner import heartbeat
from runner.heartbeat import Heartbeat
from runner.rundir.files import RunDir
from runner.train.worker import _record_failure, _redirect_output, run


def train_worker(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: `config` holds the run directory and the
    environment the agent gives its ranks."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    os.environ.update(config["env"])
    if not Path(os.environ.get(heartbeat.ENV, "/nonexistent")).exists():
        os.environ.pop(heartbeat.ENV, None)  # another host than the agent's: no watchdog here
    run_dir = RunDir(Path(config["run_dir"]))
    attempt = next_attempt(run_dir, rank)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    error_file = run_dir.error_file(rank, attempt)  # where the driver looks, as elastic's agent
    error_file.parent.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    terminal = _redirect_output(run_dir.rank_log(rank), rank, attempt)
    try:
        # the agent's heartbeat file has a slot per rank of the run: Ray's LOCAL_RANK is per
        # Ray node, and several Ray nodes may share a host
        heart = Heartbeat(os.environ.get(heartbeat.ENV), rank, rank, attempt)
        run(run_dir, terminal, heart)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _record_failure(exc, rank)
        raise


def next_attempt(run_dir: RunDir, rank: int) -> int:
    """How many times this rank started before in this run (0 on the first start)."""
    counter = run_dir.starts(rank)
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    before = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(before + 1))
    return before
