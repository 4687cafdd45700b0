"""A job of hydra/launcher=tune in its own interpreter, on the node where Ray Tune placed its
trial: what Hydra's launchers run for a job (its directory, its `.hydra/`), from the sweep's
context, which the sweep's process pickled (`python -m runner.cli.tune_job JOB.pkl`)."""

from __future__ import annotations

import pickle
import signal
import sys

from runner.errors import describe


def main(path: str) -> int:
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from runner.cli import supervise

    # Ray's worker threads block SIGINT, and a child inherits the mask: unblocked here, the job
    # and its agent hear a Ctrl-C handed on by the sweep as a run does.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signal.valid_signals())
    supervise.catch_early_asks()  # a SLURM-style stop asked while the job composes: kept
    with open(path, "rb") as f:
        hydra_context, task_function, config = pickle.load(f)
    setup_globals()
    result = run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    if result.status == JobStatus.FAILED:  # an exception: its summary says why, if it got one
        error = result._return_value
        job = config.hydra.job.num
        print(f"runner: job {job}: {describe(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
