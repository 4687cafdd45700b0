"""The step log: what each optimizer step leaves for the record, in one object the trainer
calls once a step with what the step gave (values; it never calls back into the trainer).

A logged step's record is made here: its local figures now (runner.train.records.step_figures:
samples/s, the data-wait share), its loss and the figures that need every rank later, when
the ranks reduce the records that wait (runner.train.records.pending_records: together, about once a
second, or at once before anything that must see them). A finished record goes to
metrics.jsonl and the trackers (runner.train.records.metrics_file), the progress line and the
callbacks' on_step_end, each once. The reduced losses are watched for spikes
(runner.train.guards.loss_spikes): the log warns of one, ends the run for `stop`, and hands a
spike that asks for a rollback back to the trainer as a value (`step` returns it), which
restores the checkpoint and goes on from there.

One clock (step_figures.TrainingClock): time that is not training (an evaluation, a
checkpoint) is paused out of it once, and both the records' figures and the reduction's
estimate of the seconds a record takes read it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from runner.callbacks import Run
from runner.errors import describe
from runner.processes import NO_BAR_ENV
from runner.rundir.files import RunDir
from runner.rundir.summary import Status
from runner.spec import RunSpec
from runner.train.callback_calls import Callbacks
from runner.train.guards.loss_spikes import LossSpikeError, LossSpikes, Spike
from runner.train.guards.nonfinite import NonFiniteGuard
from runner.train.records.metrics_file import MetricsLog
from runner.train.records.pending_records import Extra, PendingRecords
from runner.train.records.progress import Progress
from runner.train.records.step_figures import StepFigures
from runner.train.step.loss_items import ItemCheck

log = logging.getLogger("runner.train.trainer")


@dataclass
class Trained:
    """What one optimizer step trained on this rank: its loss sum (None: a batch skipped
    after a rollback), the items of the whole global batch it is divided by, on a logged
    step this rank's share of the gradient norm's square (None: not measured), and this
    rank's tokens."""

    loss_sum: torch.Tensor | None = None
    items: Any = 0
    norm_share: torch.Tensor | float | None = None
    tokens: int = 0
    extra: Extra | None = None  # more sums for the record, and its figures of their totals


@dataclass
class Step:
    """One optimizer step: after it `samples` in all, at learning rate `lr`, what it
    `trained`, and the seconds the loop waited for its batch."""

    step: int
    samples: int
    lr: float
    epoch: float
    trained: Trained
    waited: float


NOT_MEASURED = -1.0  # a gradient-norm share no rank measured: the reduced sum stays negative


class StepLog:
    def __init__(
        self,
        spec: RunSpec,
        run_dir: RunDir,
        *,
        guard: NonFiniteGuard,
        spikes: LossSpikes,
        callbacks: Callbacks,
        item_check: ItemCheck,
        figures: StepFigures,
        steps: tuple[int, int],
        terminal: TextIO | None,
        written: dict[str, Any],
    ):
        """`steps`: (the step this start begins at, the run's last step); `written`: the
        config as config.yaml holds it (what trackers may see)."""
        self.spec, self.guard, self.spikes, self.callbacks = spec, guard, spikes, callbacks
        self.item_check, self.figures = item_check, figures
        run: Run = callbacks.run
        self.is_main = run.is_main
        self.pending = PendingRecords(guard, run.world_size, run.rank, figures)
        self.evaluations: dict[int, dict[str, float]] = {}  # a waiting record's evaluation
        first, last = steps
        self.metrics = MetricsLog(
            run_dir,
            enabled=self.is_main,
            keep_until=first,
            trackers=spec.logger,
            config=written if self.is_main else None,
        )
        show = self.is_main and spec.progress_bar and not os.environ.get(NO_BAR_ENV)
        # `runner eval` takes no step: its evaluation is a line, never a bar of steps
        self.progress = Progress(last, terminal, show, initial=first, bar=not spec.eval_only)

    def before_first_step(self) -> None:
        """The trackers open before the first step (one-time work, not a step's)."""
        self.metrics.trackers.wait_opened()

    @property
    def records(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records so far (rank 0; none elsewhere)."""
        return self.metrics.records

    def pause(self, seconds: float) -> None:
        """Leave `seconds` that were not training (evaluation, a checkpoint) out of the clock."""
        self.figures.clock.pause(seconds)

    def step(
        self, done: Step, logged: bool, evaluation: dict[str, float] | None = None
    ) -> Spike | None:
        """Every rank, once a step: note it; on a logged step make its record (with the
        `evaluation` that ran at this step, whose seconds were paused already), and write
        what is ready. Returns a spike that asks for a rollback, else None."""
        self.figures.waited(done.waited)
        trained = done.trained
        self.figures.add_tokens(trained.tokens)
        self.figures.step_done(done.samples, logged)
        self.progress.advance()
        if trained.loss_sum is None:  # a batch skipped after a rollback: no loss to record
            if evaluation is None:
                return None
            spike = self.flush()
            base = {"step": done.step, "samples": done.samples, "train/loss": None}
            self._write(base | {"lr": done.lr, "train/skipped_batch": True} | evaluation)
            return spike
        if not logged:
            if self.spikes.on:  # the watch reads every step's loss
                self.pending.add_loss(done.step, trained.loss_sum, trained.items)
            return None
        record, elapsed, tokens = self._record(done)
        share = NOT_MEASURED if trained.norm_share is None else trained.norm_share
        sums = (tokens, share)
        self.pending.add(record, trained.loss_sum, trained.items, elapsed, sums, trained.extra)
        if evaluation is not None:  # written now, with the evaluation's metrics
            self.evaluations[done.step] = evaluation
            return self.flush()
        return self.flush() if self.pending.due else None

    def flush(self) -> Spike | None:
        """Every rank: reduce what waits and write it (before a checkpoint, an evaluation,
        the end). Raises the non-finite guard's error after writing the records before it,
        and LossSpikeError for loss_spike.action=stop; returns a spike to roll back from."""
        self.item_check.verify()
        done, error = self.pending.reduce()
        spike = self.spikes.check(self.pending.reduced) if error is None else None
        for record in done:
            self._write(record | self.evaluations.pop(record["step"], {}))
        if error is not None:
            raise error
        if spike is None:
            return None
        log.warning("%s (loss_spike.action=%s)", spike.describe(), self.spikes.spec.action)
        if self.spikes.spec.action == "stop":
            raise LossSpikeError(f"{spike.describe()} (loss_spike.action=stop)")
        return spike if self.spikes.spec.action == "rollback" else None

    def evaluated(self, step: int, samples: int, metrics: dict[str, float]) -> None:
        """An evaluation that is no training step's (eval_only)."""
        self._write({"step": step, "samples": samples, **metrics})

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: what waits is trained again; metrics.jsonl keeps the
        records up to it."""
        self.pending.clear()
        self.evaluations.clear()
        self.metrics.rewind(step)

    def close(self, outcome: dict[str, Any], timeout: float = 60.0) -> None:
        self.progress.close()
        self.metrics.close(timeout=timeout, outcome=outcome)

    def close_failed(self, exc: BaseException, start_step: int, start_time: float) -> None:
        """A rank's run failed (or was interrupted, `exc` no Exception): its outcome after
        the last step recorded, with what is queued written briefly."""
        interrupted = not isinstance(exc, Exception)
        outcome = {
            "status": str(Status.INTERRUPTED if interrupted else Status.FAILED),
            "steps": self.records[-1]["step"] if self.records else start_step,
            "wall_time_s": round(time.time() - start_time, 3),
            "error": {"message": describe(exc)},
        }
        self.close(outcome, timeout=15.0)

    def _record(self, done: Step) -> tuple[dict[str, Any], float, float]:
        """A log step's record, the training seconds since the last and this rank's tokens
        over them; its train/loss and the figures that need every rank come with the
        reduction."""
        figures, elapsed, tokens = self.figures.take(done.samples)
        record = {
            "step": done.step,
            "epoch": done.epoch,
            "samples": done.samples,
            "train/loss": None,
            "lr": done.lr,
            **figures,
        }
        if self.spec.nonfinite == "skip":
            record["train/skipped_steps"] = self.guard.skipped
        return record, elapsed, tokens

    def _write(self, record: dict[str, Any]) -> None:
        if self.is_main:
            self.metrics.write(record)
            self.progress.logged(record)
            log.info(
                " ".join(
                    f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in record.items()
                )
            )
        self.callbacks.call("on_step_end", dict(record), step=record["step"])  # once written
