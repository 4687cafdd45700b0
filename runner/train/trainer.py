"""Stages 6-8 on one rank: build from the spec, train, evaluate, report.

One optimizer step trains on one global batch. Each rank runs its share as
`grad_accum` microbatches; the loss component sums over the items of a microbatch
(samples, or tokens), and every sum is divided by the items of the whole global batch,
so any split of the batch over ranks and microbatches gives the same gradient (see
runner.data.sampler and runner.train.losses).
"""

from __future__ import annotations

import logging
import time
from typing import Any, TextIO

from runner import dist as rdist
from runner.callbacks import Run
from runner.hardware import peak_rss_bytes
from runner.heartbeat import Heartbeat, Phase
from runner.models.initial_weights import seed_everything
from runner.rundir.files import RunDir
from runner.rundir.summary import record_attempt
from runner.spec import RunSpec
from runner.spec.config_file import written_config
from runner.spec.mesh import batch_split, layout
from runner.train.callback_calls import Callbacks
from runner.train.checkpoints.final_artifacts import write_final
from runner.train.endings import COMPLETED, EVALUATED, Ending, Outcome
from runner.train.evaluation import Evaluator, write_evaluation
from runner.train.guards import chaos
from runner.train.guards.loss_spikes import Spike
from runner.train.guards.nonfinite import NonFiniteGuard
from runner.train.parts import Built, build_rank, resume_rank
from runner.train.records.notices import notices
from runner.train.records.step_figures import StepFigures
from runner.train.records.step_log import Step, StepLog, Trained
from runner.train.records.step_times import StepTimes
from runner.train.records.traces import StepTraces
from runner.train.step.loss_items import ItemCheck
from runner.train.step.loss_pass import LossPass
from runner.train.step.microbatching import accumulate, is_out_of_memory
from runner.train.step.sync_debug import SyncDebug

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        spec: RunSpec,
        run_dir: RunDir,
        device: str,
        terminal: TextIO | None,
        heart: Heartbeat | None = None,
        written: dict[str, Any] | None = None,
    ):
        """`written`: the config as config.yaml writes it, what may be logged (no secret's
        value); by default read from the run directory."""
        self.spec, self.run_dir, self.device, self.terminal = spec, run_dir, device, terminal
        self.heart = heart or Heartbeat(None, 0, 0, 0)  # beats for the agent's hang watchdog
        self.rank, self.world = rdist.get_global_rank(), rdist.get_world_size()
        self.is_main = self.rank == 0
        self.grid = layout(spec, self.world)  # the run's dimensions: computed once, handed out
        self.split = batch_split(spec, self.grid, self.rank)  # grad_accum, the data ranks
        self.written = written if written is not None else written_config(run_dir.root)
        say = notices(terminal)
        built = build_rank(spec, run_dir, device, self.grid, self.split, say)
        self.data, self.engine, self.loss_fn = built.data, built.engine, built.loss_fn
        self.items, self.compile_clock = built.items, built.compile_clock
        seed_everything(spec.seed + 1000 * self.split.data_rank)  # augmentation's streams
        self.guard = NonFiniteGuard(
            self.world, self.rank, device, spec.nonfinite, spec.nonfinite_max_skips
        )
        self.item_check = ItemCheck(self.loss_fn, spec.loss.target)  # the first step's
        self.first_step_at: float | None = None  # wall clock, for time-to-first-step
        self.attempt = rdist.get_attempt()
        run = Run(run_dir.root, self.rank, self.world, self.written, self.engine.module)
        self.callbacks = Callbacks(spec, run)  # the user's hooks (runner.callbacks)
        restarted = resume_rank(
            spec, run_dir, built, split=self.split, device=device, heart=self.heart,
            guard=self.guard, callbacks=self.callbacks, written=self.written, say=say,
        )  # fmt: skip
        self.checkpointer, self.start = restarted.checkpointer, restarted.start
        self.spikes, self.endings = restarted.spikes, restarted.endings
        self.microbatching = restarted.microbatching
        self.stand_in: Any = None  # the latest training microbatch (Evaluator.evaluate)
        self.faults = chaos.Faults(spec.chaos, self.rank, self.engine.module)  # chaos.*
        self.sync_debug = SyncDebug(spec.sync_debug, device)  # sync_debug: quiet steps' waits
        traced = (spec.profile, run_dir.root, self.rank, device, self.data.total_steps)
        self.traces = StepTraces(*traced, say)  # profile.*
        self.passes, self.evaluator = self._passes(built)
        self.heart.beat(Phase.START, self.start.step)  # where this attempt starts (for a stop)
        if self.is_main:  # this attempt in the run's history
            record_attempt(run_dir, self.attempt, self.start.from_step)
        self.step_log, self.times = self._step_log(built.flops)
        self.rss = (built.base_rss, built.base_library_rss, peak_rss_bytes())  # before steps
        self.ended: dict[str, Any] | None = None  # the summary, once written

    def _passes(self, built: Built) -> tuple[LossPass, Evaluator]:
        """The microbatches' forward passes and losses, for training and evaluation."""
        passes = LossPass(
            self.spec, self.engine, self.loss_fn, device=self.device, faults=self.faults,
            split=self.split, channels_last=built.channels_last, pairing=built.rank_model.pairing,
            streaming=self.data.streaming, routing=built.routing,
        )  # fmt: skip
        return passes, Evaluator(passes, built.metrics, self.data.val_loader, self.heart)

    def _step_log(self, flops: float | None) -> tuple[StepLog, StepTimes]:
        """metrics.jsonl, trackers, progress, on_step_end and the spike watch; and the
        step's parts' clock (time/...)."""
        spec, start = self.spec, self.start
        counts = self.grid.counts_items(self.rank)
        figures = StepFigures(spec, self.device, start.samples, flops, self.world, counts)
        step_log = StepLog(
            spec, self.run_dir, guard=self.guard, spikes=self.spikes, callbacks=self.callbacks,
            item_check=self.item_check, figures=figures, terminal=self.terminal,
            steps=(start.step, self.data.total_steps), written=self.written,
        )  # fmt: skip
        return step_log, figures.times

    # ------------------------------------------------------------------ the loop

    def fit(self, start_time: float) -> dict[str, Any]:
        """Train (or, eval_only, evaluate) and write how the run ended; returns the summary."""
        try:
            return self._end(self._fit(), start_time)
        except BaseException as exc:
            self.traces.close()
            if is_out_of_memory(exc):
                self.traces.out_of_memory()
            if self.ended is not None:  # a signal after the run ended: its summary stands
                raise
            self.step_log.close_failed(exc, self.start.step, start_time)
            raise

    def _fit(self) -> Outcome:
        spec, step, samples = self.spec, self.start.step, self.start.samples
        self.engine.model.train()  # once, not every step: evaluate() switches it back
        self.step_log.before_first_step()  # the trackers opened: one-time work, done
        self.callbacks.call("on_fit_start", step=step)
        if spec.eval_only:
            return self._evaluate_only()
        while step < self.data.total_steps:
            epoch, offset = divmod(step, self.data.steps_per_epoch)
            self.data.sampler.set_epoch(epoch, offset)
            microbatches = self.passes.feed(iter(self.data.train_loader))
            for step_in_epoch in range(offset, self.data.steps_per_epoch):
                step += 1
                self.traces.before(step)  # profile.steps: traced from its batch on
                last = step == self.data.total_steps
                evaluate = last or self.data.evaluates_after(step, spec.eval_interval)
                logged = evaluate or step % spec.log_interval == 0
                saved = self.checkpointer.due(step, last)
                self.sync_debug.step(quiet=not (logged or saved))
                self.faults.step_started(step)
                n_global = self.data.sampler.global_count(step_in_epoch)
                lr = self.engine.lr
                waited = time.perf_counter()
                batch = [next(microbatches) for _ in range(self.split.accum)]
                waited = time.perf_counter() - waited
                self.stand_in = batch[0][0]  # a placeholder for an evaluation that has none
                self.heart.beat(Phase.BATCH, step)
                trained = self.train_step(batch, n_global, step, logged)
                self.heart.beat(Phase.STEP)
                self.checkpointer.poll()  # an asynchronous checkpoint sealed once written
                if self.first_step_at is None:
                    self.first_step_at = time.time()
                samples += n_global
                this_step = Step(step, samples, lr, self.data.epoch(step), trained, waited)
                evaluation = self._timed_evaluation(step) if evaluate else None
                spike = self.step_log.step(this_step, logged, evaluation)
                if spike is None and saved:
                    spike = self.step_log.flush()  # the records a checkpoint keeps
                if spike is not None:  # back to the checkpoint before it, and on from there
                    step, samples = self._roll_back(spike)
                    break
                ending = COMPLETED if last else self.endings.after_step(step, evaluation)
                if saved:  # after the rules: it holds their state as of this step
                    self.step_log.pause(self.checkpointer.save(step, samples))
                # its evaluation and checkpoint in the trace too; writing it is no step's
                self.step_log.pause(self.traces.after(step))
                if ending is not None:
                    return Outcome(ending, step, samples, saved)
        return Outcome(COMPLETED, step, samples)

    def _evaluate_only(self) -> Outcome:
        """eval_only (`runner eval`): the starting weights, no step; rank 0 writes eval.json."""
        step, samples = self.start.step, self.start.samples
        metrics = self._timed_evaluation(step)
        self.step_log.evaluated(step, samples, metrics)
        if self.is_main:
            write_evaluation(self.run_dir, self.spec, metrics, self.world)
        return Outcome(EVALUATED, step, samples)

    def _timed_evaluation(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self.evaluate()
        self.heart.beat(Phase.STEP)
        self.step_log.pause(time.perf_counter() - started)
        self.callbacks.call("on_eval_end", {"step": step, **metrics}, step=step)
        return metrics

    def train_step(
        self, microbatches: list[tuple[Any, bool]], n_global: int, step: int, logged: bool = False
    ) -> Trained:
        """Forward and backward every microbatch of this rank, then step (or skip the step,
        when the guard says so: a non-finite loss or gradient norm under nonfinite=skip).
        Under grad_accum=auto the rank's batch is cut here, and cut finer when a pass runs
        out of memory on any rank (runner.train.step.microbatching)."""
        if step in self.spikes.skipped:  # after a loss spike's rollback: not trained on
            self.engine.skip_step()
            return Trained()
        lap = self.times.start()  # time/...: where the step's time goes
        self.passes.routing.before_step(n_global, logged)
        items = self.items.of(microbatches, n_global)
        weight = self.grid.gradient_weight(items)  # the step's loss: a mean over its items
        loss_sum, tokens = None, 0
        for piece in accumulate(self.microbatching, self.passes, microbatches, step, weight):
            loss_sum = piece.loss if loss_sum is None else loss_sum + piece.loss
            if piece.real:
                self.item_check.note(piece.count, piece.targets)
                tokens += self.passes.tokens(piece.targets)
        self.item_check.step_done()
        lap = self.times.lap("forward_backward", lap)
        grad_norm = self.engine.prepare_step(norm_wanted=self.guard.mode == "skip")
        measured = logged and self.spec.log_grad_norm  # DeepSpeed stepped in backward already
        share = self.engine.grad_norm_share() if measured else None
        lap = self.times.lap("grad_sync", lap)
        if self.guard.should_skip(loss_sum, grad_norm, step):
            self.engine.skip_step()
        else:
            self.engine.step()
            self.guard.after_step(self.engine.nonfinite_skips, step)
        self.times.lap("optimizer", lap)
        loss_sum = None if loss_sum is None else self.grid.loss_share(loss_sum)
        return Trained(loss_sum, items, share, tokens, self.passes.routing.record())

    def evaluate(self) -> dict[str, float]:
        """val/loss and val/<metric> over every rank's share of the validation set."""
        return self.evaluator.evaluate(self.microbatching.eval_pieces, self.stand_in)

    def _roll_back(self, spike: Spike) -> tuple[int, int]:
        """Every rank: back to the newest checkpoint before the spike (loss_spike.action=
        rollback). Returns the step and sample count to go on from."""
        back = self.spikes.roll_back(spike, self.checkpointer.restore_before)
        self.endings.load(back.state)
        self.step_log.rewind(back.step)
        return back.step, back.samples

    def _end(self, outcome: Outcome, start_time: float) -> dict[str, Any]:
        """Every rank: write how the run ended (the one place that does). A graceful stop's
        summary is the agent's to write: it knows why the run stopped."""
        ending, step = outcome.ending, outcome.step
        self.sync_debug.off()
        self.traces.close()
        unsaved = ending.checkpoint and not outcome.saved
        if unsaved and self.step_log.flush() is not None:  # the records a checkpoint keeps
            log.warning("a loss spike asks for a rollback: no checkpoint at step %d", step)
        elif unsaved:
            self.step_log.pause(self.checkpointer.save(step, outcome.samples))
        self.checkpointer.finish()
        if ending.reason:
            log.info("%s", ending.reason)
        if ending.by_agent:
            self.heart.beat(Phase.STOPPED, step)  # tells the agent how this rank ended
            wall = round(time.time() - start_time, 3)
            stopped = {"status": str(ending.status), "steps": step, "wall_time_s": wall}
            self.step_log.close(stopped)
            return stopped
        self.heart.beat(Phase.FINISH)
        self.guard.check_before_saving(self.engine.module, self.data.total_steps)
        summary = write_final(
            self.run_dir, self.spec, self.engine, self.step_log.records,
            self.rss,
            weights=ending.weights, status=ending.status, start_time=start_time,
            **self._facts(ending),
        )  # fmt: skip
        self.ended = summary  # written: whatever comes now, this is how the run ended
        self.step_log.close(summary)
        self.callbacks.call("on_fit_end", summary, step=None if ending.weights else step)
        return summary

    def _facts(self, ending: Ending) -> dict[str, Any]:
        """What summary.json says of this attempt, besides the records and the weights."""
        return {
            "restarts": self.attempt,
            "resumed_from": self.start.from_step,
            "first_step_at": self.first_step_at,
            "compile_s": round(self.compile_clock.seconds, 3) if self.compile_clock else None,
            "loss_spike_rollbacks": self.spikes.rollbacks,
            **self.microbatching.summary(),
            **self.checkpointer.summary(ending.key, ending.details, ending.checkpoint),
        }
