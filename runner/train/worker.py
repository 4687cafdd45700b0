# ruff: noqa: E402  (SIGUSR1/SIGUSR2 are ignored before anything else is imported)
"""Stage 5: one rank. `python -m runner.train.worker RUN_DIR`, started by the elastic agent.

Reads the resolved spec from the run directory (never Hydra), sends its own
output to logs/rank{R}.log, joins the process group, trains, and on any
exception records the root cause where the agent will look for it.
"""

from __future__ import annotations

import signal
import threading

from runner.heartbeat import STACK_SIGNAL, STOP_SIGNALS, Heartbeat

# SLURM's --signal reaches every process of the job; a stop asked of the run comes through
# the agent (runner.launch.stopping), so that all ranks stop after the same step. First thing,
# as the default action of SIGUSR1/SIGUSR2 would end this process. (A Ray Train worker
# imports this module in the thread that runs the rank: Ray owns that process's signals.)
if threading.current_thread() is threading.main_thread():
    for _asked in STOP_SIGNALS:
        signal.signal(_asked, signal.SIG_IGN)

import faulthandler
import gc
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

from runner.dist import get_attempt
from runner.errors import Explained, describe, first_line
from runner.processes import FORKED_ENV, RANK_PARENT_ENV, die_with_parent, quiet_library_noise
from runner.rundir.files import RunDir, write_atomic

log = logging.getLogger("runner.train.worker")  # also when run as __main__


def _redirect_output(log_path: Path, rank: int, attempt: int) -> TextIO | None:
    """Send this process's stdout and stderr to its log (appending: every attempt is kept).

    Returns the original terminal stream for rank 0's progress display.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1) if rank == 0 else None
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    local, node = os.environ.get("LOCAL_RANK", "0"), os.environ.get("GROUP_RANK", "0")
    where = f"local rank {local} on node {node} ({socket.gethostname()})"
    if "MASTER_PORT" in os.environ:  # the rendezvous torch elastic gave this attempt
        where += f", rendezvous {os.environ.get('MASTER_ADDR', '?')}:{os.environ['MASTER_PORT']}"
    how = "forked by the fork server" if os.environ.get(FORKED_ENV) else "spawned"
    header = (
        f"===== rank {rank} attempt {attempt} pid {os.getpid()} {started}, {where}, {how} =====\n"
    )
    os.write(fd, header.encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _log_lines(rank)
    return terminal


def _log_lines(rank: int) -> None:
    """What runner's modules log on this rank (logger `runner` and below) goes to the log,
    each line stamped with the time and the rank."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("runner")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _record_failure(exc: BaseException, rank: int) -> None:
    """Write the error file the agent reads (torch elastic's format plus our details)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    explained = isinstance(exc, Explained)  # its message is the whole story: no traceback
    tb = "" if explained else traceback.format_exc()
    message = first_line(exc)
    data = {
        "message": {
            "message": describe(exc),
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(now))},
        },
        "runner": {
            "rank": rank,
            "time": now,
            "host": socket.gethostname(),
            "type": type(exc).__name__,
            "message": message,
            "traceback": tb,
            "explained": explained,
        },
    }
    write_atomic(Path(path), json.dumps(data))


def run(run_dir: RunDir, terminal: TextIO | None, heart: Heartbeat) -> None:
    import torch
    import torch.distributed as dist

    from runner import dist as rdist
    from runner.spec import load_spec
    from runner.spec.config_file import written_config
    from runner.train.build.heap import MMAP_THRESHOLD_ENV, large_block, map_large_blocks_alone
    from runner.train.trainer import Trainer

    node_dir = os.environ.get("RUNNER_NODE_DIR", run_dir.root)
    spec = load_spec(node_dir)  # this node's config
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = rdist.device_for(spec.device, rdist.get_local_rank())
    size = large_block(spec.parallelism.name, device, os.environ, spec.grid.expert > 1)
    if size and map_large_blocks_alone(size):  # before the model: its blocks come and go
        log.info(
            "heap: blocks of %s or more are mapped on their own and go back to the system "
            "when freed (as with %s=%d; set it to choose another)",
            f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB",
            MMAP_THRESHOLD_ENV,
            size,
        )
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    backend = rdist.backend_for(spec.device)
    ours = not dist.is_initialized()  # Ray Train (launcher=ray) sets up its workers' group
    if ours:
        dist.init_process_group(backend=backend)
    log.info("process group: %s, device %s", backend, device)
    if spec.parallelism.name.startswith("zero") and device == "cpu":  # before DeepSpeed needs it
        from runner.engines.deepspeed_ops import load_shared_memory_op
        from runner.train.records.notices import notices

        load_shared_memory_op(notices(terminal))
    start_time = float(os.environ.get("RUNNER_START_TIME", time.time()))
    trainer = Trainer(spec, run_dir, device, terminal, heart, written_config(node_dir))
    trainer.fit(start_time)
    # Release DDP, loaders and their threads while the process group still exists.
    del trainer
    gc.collect()
    dist.barrier()
    if ours:
        dist.destroy_process_group()


def main() -> None:
    run_dir = RunDir(Path(sys.argv[1]))
    rank = int(os.environ.get("RANK", "0"))
    attempt = get_attempt()
    terminal = _redirect_output(run_dir.rank_log(rank), rank, attempt)
    faulthandler.enable()  # a native crash still leaves a Python stack in the log
    quiet_library_noise()
    faulthandler.register(STACK_SIGNAL, all_threads=True)  # the watchdog asks where we are
    heart = Heartbeat.from_env()  # from here on, the agent's watchdog sees this rank
    parent = os.environ.get(RANK_PARENT_ENV)  # the agent, or its fork server
    die_with_parent(signal.SIGKILL, int(parent) if parent else None)
    try:
        run(run_dir, terminal, heart)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _record_failure(exc, rank)
        traceback.print_exc()
        _exit(130 if isinstance(exc, KeyboardInterrupt) else 1)
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: every artifact is already on disk, and tearing
    down torch's C++ state at exit can abort ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
