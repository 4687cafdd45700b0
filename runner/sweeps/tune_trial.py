"""A job of hydra/launcher=tune as a Ray Tune trial (runner.sweeps.tune_sweep drives them).

The trial's actor runs on the node Tune placed it, with the resources the job asked for
(Ray sets CUDA_VISIBLE_DEVICES to its GPUs), and starts the job there in its own interpreter
(runner.cli.tune_job). The job's rank 0 reports `sweep.metric` after every evaluation to
the actor, as it reports to a study (runner.sweeps.study_server): each report is one result
of the trial, and rank 0 waits for Tune's word on it before it goes on. When ASHA would stop
the trial there, the sweep's scheduler (PruningASHA) marks it pruned and lets it go on to its
next step() instead, which answers "prune" and waits for the job to save its checkpoint and
end with status `pruned`: Tune gives a trial it stops itself seconds to end before it kills
the actor, and the job with it. When the whole sweep stops (a signal, fail_fast), its process
writes a stop file; each trial's job gets the sweep's signal (SIGTERM for fail_fast) and ends
as a run would, and a trial not started yet runs nothing.

A job kept from an earlier start of the sweep (completed or pruned, or failed and not asked
again) runs nothing: its evaluations are replayed from metrics.jsonl, so that the scheduler
knows them, and the trial ends as the job did.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune import Callback
from ray.tune.result import DONE
from ray.tune.schedulers import ASHAScheduler

from runner.rundir.files import read_jsonl
from runner.rundir.summary import Status, how_it_ended
from runner.sweeps.progress import stopped_line

ANSWER_TIMEOUT_S = 50.0  # under the job's own wait for an answer (study_server)
CLEANUP_WAIT_S = 8.0  # Tune kills a trial's actor 10 s after it asked it to stop


@dataclass(frozen=True)
class TrialBrief:
    """What a trial needs of its job, from the sweep's process."""

    idx: int
    dir: str
    metric: str
    kept: bool  # ended in an earlier start of the sweep: replayed, not run
    threads: int  # intra-op threads of each of its ranks
    cwd: str  # the sweep's working directory: the job's relative paths start there
    stop_file: str  # written by the sweep's process when the whole sweep stops
    prune_file: str  # written by the sweep's scheduler when it stops this trial
    pickled: bytes = b""  # (hydra context, task function, job config) for runner.cli.tune_job
    env: dict[str, str] = field(default_factory=dict)


class JobTrainable(tune.Trainable):
    def setup(self, config: dict[str, Any], jobs: dict[int, TrialBrief]) -> None:
        self.job = jobs[config["job"]]
        self.events: queue.Queue = queue.Queue()  # ("report", step, value, reply) | ("end",)
        self.reply: queue.Queue | None = None  # the report Tune has not answered yet
        self.process: subprocess.Popen | None = None
        self.server: Any = None
        self.pickle_path: str | None = None
        if self.job.kept:
            for record in read_jsonl(Path(self.job.dir) / "metrics.jsonl"):
                if self.job.metric in record and "step" in record:
                    self.events.put(("report", record["step"], record[self.job.metric], None))
            self.events.put(("end",))
            return
        if os.path.exists(self.job.stop_file):  # the sweep stopped before this trial began
            self.events.put(("end",))
            return
        self._start()

    def _start(self) -> None:
        from runner.sweeps.study_server import ADDRESS_ENV, KEY_ENV, StudyServer

        self.server = StudyServer(self._on_report)
        self.server.start()
        env = {**os.environ, **self.job.env, "OMP_NUM_THREADS": str(self.job.threads)}
        env[ADDRESS_ENV], env[KEY_ENV] = self.server.address, self.server.key.hex()
        fd, self.pickle_path = tempfile.mkstemp(prefix="runner-tune-job-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(self.job.pickled)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runner.cli.tune_job", self.pickle_path],
            cwd=self.job.cwd,
            env=env,
        )
        threading.Thread(target=self._await_end, daemon=True).start()

    def _await_end(self) -> None:
        """Until the job ends: the sweep's stop reaches it (SIGTERM, once)."""
        process = self.process
        assert process is not None
        while True:
            try:
                process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                signum = _stop_signal(self.job.stop_file)
                if signum is not None:
                    with contextlib.suppress(ProcessLookupError):
                        process.send_signal(signum)
                    process.wait()
                    break
        self.events.put(("end",))

    def _on_report(self, number: int, step: int, value: float) -> bool:
        """Rank 0's report (in the server's thread): a result for Tune; whether to prune."""
        reply: queue.Queue = queue.Queue()
        self.events.put(("report", step, value, reply))
        try:
            return bool(reply.get(timeout=ANSWER_TIMEOUT_S))
        except queue.Empty:  # Tune slow to decide: the job goes on
            return False

    def step(self) -> dict[str, Any]:
        if self.reply is not None and os.path.exists(self.job.prune_file):
            self._answer(True)  # the scheduler stopped it at its last result
            if self.process is not None:
                self.process.wait()  # a checkpoint, then summary.json with status pruned
            return {**self._final(), DONE: True}
        self._answer(False)  # Tune asks for the next result: the last one went on
        event = self.events.get()
        if event[0] == "report":
            _, step, value, self.reply = event
            return {self.job.metric: float(value), "step": int(step)}
        return {**self._final(), DONE: True}

    def _final(self) -> dict[str, Any]:
        """The job's end as a result: its final value of the metric where it has one."""
        ending = how_it_ended(Path(self.job.dir))
        value = ending.final(self.job.metric)
        result: dict[str, Any] = {"status": str(ending.status or Status.FAILED)}
        if isinstance(ending.summary.get("steps"), int):
            result["step"] = ending.summary["steps"]
        if isinstance(value, int | float) and not math.isnan(value):
            result[self.job.metric] = float(value)
        return result

    def _answer(self, prune: bool) -> None:
        if self.reply is not None:
            self.reply.put(prune)
            self.reply = None

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Nothing for Tune to keep: the job's own checkpoints are in its directory."""
        return None

    def load_checkpoint(self, checkpoint: Any) -> None:
        return None

    def cleanup(self) -> None:
        """Tune ends the trial: after its last result, as a rule. A job still running here
        (Tune ends the experiment early) is stopped as a signal stops a run."""
        self._answer(False)
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=CLEANUP_WAIT_S)
        if self.server is not None:
            self.server.close()
        if self.pickle_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.pickle_path)


def _stop_signal(stop_file: str) -> int | None:
    """The signal the sweep's stop hands its jobs, once it stops."""
    try:
        text = Path(stop_file).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else int(signal.SIGTERM)


class PruningASHA(ASHAScheduler):
    """ASHA, whose stop is a prune the trial carries out itself (see the module's text)."""

    def __init__(self, prune_files: dict[int, str], **kwargs: Any):
        super().__init__(**kwargs)
        self.prune_files = prune_files

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision != self.STOP or result.get(DONE):
            return decision
        Path(self.prune_files[trial.config["job"]]).write_text(f"{result.get('step')}\n")
        return self.CONTINUE


class SweepLines(Callback):
    """The sweep's lines as trials start and end, its progress line, and fail_fast."""

    def __init__(self, jobs: dict[int, Any], fail_fast: bool, stop: Any):
        from runner.sweeps.progress import SweepProgress

        self.jobs = jobs  # job number: (directory, overrides shown, kept from an earlier start)
        self.fail_fast = fail_fast
        self.stop = stop  # the sweep's stop: .stopped, .__call__(why)
        self.progress = SweepProgress(queued=len(jobs))
        self.never_started = set(jobs)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        from runner.sweeps.tables import say

        idx = trial.config["job"]
        if self.stop.stopped:  # it ends at once, running nothing
            return
        self.never_started.discard(idx)
        self.progress.started()
        if self.jobs[idx][2]:  # replayed, not run
            return
        resources = trial.placement_group_factory.required_resources
        asks = ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v)
        say(f"job {idx} started as Tune trial {trial.trial_id} ({asks}): {self.jobs[idx][1]}")

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial, str(trial.error_file or "the trial's actor died"))

    def _ended(self, trial: Any, error: str | None = None) -> None:
        from runner.sweeps.tables import say

        idx = trial.config["job"]
        if idx in self.never_started:
            return
        job_dir = Path(self.jobs[idx][0])
        self.progress.ended(idx, job_dir)
        if self.jobs[idx][2]:
            return
        ending = how_it_ended(job_dir)
        if error is not None or ending.failed:
            say(f"job {idx} failed: {ending.error_line(error or 'no summary')} ({job_dir})")
            if self.fail_fast and not self.stop.stopped:
                self.stop("hydra.launcher.fail_fast=true: the sweep stops")
        elif ending.status is Status.PRUNED:
            after = (ending.summary.get("pruned") or {}).get("after_step")
            say(f"job {idx} pruned by ASHA after step {after}")
        elif ending.status is Status.INTERRUPTED:
            say(stopped_line(idx, job_dir) or "")
        if self.stop.stopped:
            self.progress.queued = 0
        say(self.progress.line())
