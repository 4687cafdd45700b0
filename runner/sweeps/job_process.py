"""hydra/launcher=runner's job process: one job of a side-by-side sweep
(runner.sweeps.side_by_side), run as Hydra's own launcher runs it.

Each job is a fork of the sweep's process, taken before the job composes, resolves or
starts anything (the sweep's process never imports torch, so no CUDA state or thread is
inherited); it sets its devices, runs the job as Hydra's own launcher would (its directory,
its `.hydra/`, its return value for the sweeper) and sends back the JobReturn.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from typing import Any

from hydra.core.utils import JobStatus, run_job

from runner.errors import describe
from runner.processes import NO_BAR_ENV, die_with_parent
from runner.sweeps.launched import SweepJob
from runner.sweeps.slots import job_environment, pin_to_cores


def job_process(
    send: Any,
    launcher: Any,
    job: SweepJob,
    pool: Any,
    devices: Any,
    handlers: dict,
    sweep_pid: int,
) -> None:
    """The job's own process (the target of a forked multiprocessing.Process): its devices
    and the signal handlers a job of Hydra's own launcher would have, then the job as
    Hydra's launcher runs it (with the launcher's `hydra_context` and `task_function`); its
    JobReturn goes back through `send`, and the process ends without returning."""
    code = 0
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the sweep, which hands it on once
        # A sweep killed outright (SIGKILL, the OOM killer) still stops its jobs, interrupted,
        # with their summaries: running the command again goes on from their checkpoints.
        die_with_parent(signal.SIGTERM, sweep_pid)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.update(job_environment(pool, devices))
        if job.beside_others:  # the config stays as Hydra composed it
            os.environ[NO_BAR_ENV] = "1"
        pin_to_cores(pool, devices)
        result = run_job(
            hydra_context=launcher.hydra_context,
            task_function=launcher.task_function,
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        if result.status == JobStatus.FAILED:  # an exception: the sweep's to report, as text
            error = result._return_value
            result.status, result._return_value = JobStatus.COMPLETED, math.nan
            result.cfg = job.config
            print(f"runner: job {job.idx}: {describe(error)}", file=sys.stderr)
        send.send(result)
    except BaseException as exc:  # SystemExit included: nothing returns into the sweep
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
