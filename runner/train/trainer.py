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

import torch

from runner import dist as rdist
from runner.callbacks import Run
from runner.components import instantiate
from runner.errors import describe
from runner.heartbeat import Heartbeat, Phase
from runner.mesh import layout
from runner.models.initial_weights import seed_everything
from runner.rundir.checkpoints import CheckpointStore
from runner.rundir.files import EVAL_FILE, RunDir, write_json
from runner.rundir.summary import Status, record_attempt
from runner.spec import RunSpec
from runner.spec.config_file import written_config
from runner.train.build.heap import give_back_freed_memory
from runner.train.build.parallelize import parallelize
from runner.train.build.rank_data import build_rank_data, with_warmup_steps
from runner.train.build.sharded_init import build_for_rank
from runner.train.callback_calls import Callbacks
from runner.train.checkpoints.checkpointer import Checkpointer
from runner.train.checkpoints.final_artifacts import peak_rss_bytes, write_final
from runner.train.evaluation import Evaluator
from runner.train.guards import chaos
from runner.train.guards.loss_spikes import LossSpikeError, LossSpikes, Spike
from runner.train.guards.nonfinite import NonFiniteGuard
from runner.train.pruning import Pruning
from runner.train.records.notices import notices
from runner.train.records.step_figures import StepFigures, flops_per_token
from runner.train.records.step_log import Step, StepLog
from runner.train.step.loss_items import ItemCheck, global_items
from runner.train.step.loss_pass import LossPass
from runner.train.step.microbatching import accumulate, microbatch_steps
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
        # the ranks that read their own part of each batch (a tensor group reads one: runner.mesh)
        self.grid = layout(spec, self.world)
        self.data_rank = self.grid.data_rank(self.rank)

        self.written = written if written is not None else written_config(run_dir.root)
        flops = self._build()
        seed_everything(spec.seed + 1000 * self.data_rank)  # per-rank streams for augmentation

        self.guard = NonFiniteGuard(
            self.world, self.rank, device, spec.nonfinite, spec.nonfinite_max_skips
        )
        self.item_check = ItemCheck(self.loss_fn, spec.loss.target)  # the first step's
        self.first_step_at: float | None = None  # wall clock, for time-to-first-step
        self.attempt = rdist.get_attempt()
        run = Run(run_dir.root, self.rank, self.world, self.written, self.engine.module)
        self.callbacks = Callbacks(spec, run)  # the user's hooks (runner.callbacks)
        self._resume()
        self.stand_in: Any = None  # the latest training microbatch (Evaluator.evaluate)
        self.faults = chaos.Faults(spec.chaos, self.rank, self.engine.module)  # chaos.*
        self.pruning = Pruning(spec, self.is_main)  # a sweep's pruner, after evaluations
        self.sync_debug = SyncDebug(spec.sync_debug, device)  # sync_debug: quiet steps' waits
        self.passes = LossPass(
            spec, self.engine, self.loss_fn, device, self.channels_last, self.faults
        )
        self.heart.beat(Phase.START, self.step)  # where this attempt starts (a stop needs it)
        if self.is_main:  # this attempt in the run's history
            record_attempt(run_dir, self.attempt, self.resumed_from)
        figures = StepFigures(
            spec, device, self.samples, flops, self.world, self.grid.tensor_rank(self.rank) == 0
        )
        self.log = StepLog(  # records: metrics.jsonl, trackers, progress, on_step_end, spikes
            spec, run_dir, self.guard, self.spikes, self.callbacks, self.item_check, figures,
            (self.step, self.data.total_steps), terminal, self.written,
        )  # fmt: skip
        self.build_peak_rss = peak_rss_bytes()  # built, sharded, loaded: before any step
        self.ended: dict[str, Any] | None = None  # the summary, once written

    def _build(self) -> float | None:
        """The data, the model under its engine, the loss, the metrics and the evaluator.
        Seeded alike on every rank: identical initial weights (or, under meta_init, each
        rank's shards of them); the data is built first, as the seed weights were. Returns
        the model's FLOPs per token (token data only)."""
        spec, device = self.spec, self.device
        data, module, fill = build_for_rank(spec, device, self.run_dir.seed_weights)
        give_back_freed_memory()  # what building freed (zero.Init builds each module whole)
        token_data = {"vocab_size", "block_size"} <= data.info.keys()
        flops = flops_per_token(module) if token_data else None  # before sharding: all of it
        self.loss_fn = instantiate(spec.loss.node, data.info)
        metrics = {
            n: _on_device(instantiate(m.node, data.info), device) for n, m in spec.metrics.items()
        }
        cuda = torch.device(device).type == "cuda"
        self.data = build_rank_data(spec, data, self.data_rank, self.grid.data_world, cuda)
        with_warmup = with_warmup_steps(spec, self.data.steps_per_epoch)
        split_logits = getattr(self.loss_fn, "splits_classes", False)  # loss parallel
        parallel = parallelize(
            module, with_warmup, device, self.data.total_steps, fill, split_logits
        )
        self.engine, self.channels_last = parallel.engine, parallel.channels_last
        give_back_freed_memory()  # and what sharding freed, before the first step
        self.compile_clock = parallel.compile_clock
        self.evaluator = Evaluator(
            spec, self.engine, self.loss_fn, metrics, self.data.val_loader, device,
            self.channels_last, self.heart,
        )  # fmt: skip
        return flops

    def _resume(self) -> None:
        """Where this attempt starts: the newest checkpoint's state (a first start has none)."""
        spec = self.spec
        stream = self.data.train_loader if self.data.streaming else None
        self.checkpoints = Checkpointer(  # when and how checkpoints are written, resumed
            spec, self.run_dir, self.engine, self.heart, self.guard, stream, self.written,
            saved=self.callbacks.checkpoint_saved, say=notices(self.terminal),
        )  # fmt: skip
        client = self.checkpoints.resume()
        self.step, self.samples = client.get("step", 0), client.get("samples", 0)
        self.resumed_from: int | None = client.get("step")
        self.spikes = LossSpikes(spec.loss_spike, client.get("skipped_batches", ()))
        self.steps = microbatch_steps(  # grad_accum: fixed, or auto (cut finer on OOM)
            spec, self.device, self.engine, client.get("grad_accum", 1)
        )

    # ------------------------------------------------------------------ the loop

    def fit(self, start_time: float) -> dict[str, Any]:
        try:
            return self._fit(start_time)
        except BaseException as exc:
            if self.ended is not None:  # a signal after the run ended: its summary stands
                raise
            outcome = {
                "status": str(Status.FAILED if isinstance(exc, Exception) else Status.INTERRUPTED),
                "steps": self.log.records[-1]["step"] if self.log.records else self.step,
                "wall_time_s": round(time.time() - start_time, 3),
                "error": {"message": describe(exc)},
            }
            self.log.close(outcome, timeout=15.0)  # what is queued, briefly
            raise

    def _fit(self, start_time: float) -> dict[str, Any]:
        spec, step, samples = self.spec, self.step, self.samples
        self.engine.model.train()  # once, not every step: evaluate() switches it back
        self.callbacks.call("on_fit_start", step=step)
        if spec.eval_only:
            return self._evaluate_only(start_time)
        while step < self.data.total_steps:
            epoch, offset = divmod(step, self.data.steps_per_epoch)
            self.data.sampler.set_epoch(epoch, offset)
            microbatches = iter(self.data.train_loader)
            for step_in_epoch in range(offset, self.data.steps_per_epoch):
                step += 1
                last = step == self.data.total_steps
                evaluate = last or self._is_eval_step(step)
                logged = evaluate or step % spec.log_interval == 0
                saved = self.checkpoints.due(step, last)
                self.sync_debug.step(quiet=not (logged or saved))
                self.faults.step_started(step)
                n_global = self.data.sampler.global_count(step_in_epoch)
                lr = self.engine.lr
                waited = time.perf_counter()
                batch = [next(microbatches) for _ in range(self.data.sampler.grad_accum)]
                waited = time.perf_counter() - waited
                self.stand_in = batch[0][0]  # a placeholder for an evaluation that has none
                self.heart.beat(Phase.BATCH, step)
                result = self.train_step(batch, n_global, step, logged)
                self.heart.beat(Phase.STEP)
                self.checkpoints.poll()  # an asynchronous checkpoint sealed once written
                if self.first_step_at is None:
                    self.first_step_at = time.time()
                samples += n_global
                done = Step(step, samples, lr, self._epoch(step), *result, waited)
                evaluation = self._timed_evaluation(step) if evaluate else None
                spike = self.log.step(done, logged, evaluation)
                if spike is None and saved:
                    spike = self._save(step, samples)
                if spike is not None:  # back to the checkpoint before it, and on from there
                    step, samples = self._roll_back(spike)
                    break
                if last:
                    break
                if evaluation is not None and self.pruning.prunes(step, evaluation):
                    return self._prune(step, samples, saved, start_time, evaluation)
                if self.heart.stop_after(step):  # a graceful stop: every rank stops here
                    return self._stop(step, samples, saved, start_time)
        return self._finish(start_time)

    def _evaluate_only(self, start_time: float) -> dict[str, Any]:
        """eval_only (`runner eval`): the starting weights on the validation data, no step;
        rank 0 writes eval.json."""
        metrics = self._timed_evaluation(self.step)
        self.log.evaluated(self.step, self.samples, metrics)
        if self.is_main:
            write_json(
                self.run_dir.root / EVAL_FILE,
                {
                    "weights": self.spec.init_from.path,
                    "metrics": metrics,
                    "world_size": self.world,
                    "eval_samples": self.spec.eval_samples,
                },
            )
        return self._finish(start_time, weights=False)

    def _timed_evaluation(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self.evaluate()
        self.heart.beat(Phase.STEP)
        self.log.pause(time.perf_counter() - started)
        self.callbacks.call("on_eval_end", {"step": step, **metrics}, step=step)
        return metrics

    def _save(self, step: int, samples: int) -> Spike | None:
        """A checkpoint of `step`, once the records up to it are written (a restart from it
        keeps them); a spike among them asks for a rollback instead."""
        spike = self.log.flush()
        if spike is not None:
            return spike
        extra = {**self.steps.checkpoint_state(), "skipped_batches": sorted(self.spikes.skipped)}
        self.log.pause(self.checkpoints.save(step, samples, extra))
        return None

    def _stop(self, step: int, samples: int, saved: bool, start_time: float) -> dict[str, Any]:
        """Stop after `step` as asked (SIGUSR1/SIGUSR2 to runner; SLURM's --signal): with a
        checkpoint, so that resume=auto (or SLURM's requeue) goes on from here. The agent
        writes summary.json: it knows why the run stopped."""
        self.sync_debug.off()
        if not saved and self._save(step, samples) is not None:
            log.warning("a loss spike asks for a rollback: no checkpoint at the stop's step")
        self.checkpoints.finish()
        self.heart.beat(Phase.STOPPED, step)  # tells the agent how this rank ended
        log.info("stopped after step %d as asked; checkpoint saved", step)
        outcome = {
            "status": str(Status.INTERRUPTED),
            "steps": step,
            "wall_time_s": round(time.time() - start_time, 3),
        }
        self.log.close(outcome)
        return outcome

    def _prune(
        self, step: int, samples: int, saved: bool, start_time: float, evaluation: dict
    ) -> dict[str, Any]:
        """The sweep's pruner stopped this trial after its evaluation at `step`: a checkpoint
        (the trial's weights stay at hand), then summary.json with status `pruned`, and no
        model.pt (these are not a finished run's weights)."""
        if not saved:
            self._save(step, samples)
        self.checkpoints.finish()
        self.step = step  # where the run ends, for on_fit_end
        metric = self.spec.sweep.metric
        log.info("pruned after step %d by the sweep's pruner (%s %.4g)", step, metric,
                 evaluation[metric])  # fmt: skip
        latest = CheckpointStore(self.run_dir.checkpoints, keep=1).latest()
        pruned = {
            "after_step": step,
            "metric": metric,
            "value": evaluation[metric],
            "checkpoint": str(latest.relative_to(self.run_dir.root)) if latest else None,
        }
        return self._finish(start_time, weights=False, status=Status.PRUNED, pruned=pruned)

    def train_step(
        self, microbatches: list[tuple[Any, bool]], n_global: int, step: int, logged: bool = False
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | float, int]:
        """Forward and backward every microbatch of this rank, then step (or skip the step,
        when the guard says so: a non-finite loss or gradient norm under nonfinite=skip).
        Under grad_accum=auto the rank's batch is cut here, and cut finer when a pass runs
        out of memory on any rank (runner.train.step.microbatching).

        Returns this rank's loss sum (None: a batch skipped after a rollback), the items of
        the whole global batch, on a `logged` step this rank's share of the gradient norm's
        square (Engine.grad_norm_share; negative where not measured), and this rank's
        tokens."""
        if step in self.spikes.skipped:  # after a loss spike's rollback: not trained on
            self.engine.skip_step()
            return None, 0, -1.0, 0
        items = global_items(self.loss_fn, microbatches, n_global, self.device, self.grid.tensor)
        # the engines average over the data ranks; this makes it a mean over items
        weight = self.grid.data_world / items
        loss_sum, tokens = None, 0
        for done in accumulate(
            self.steps, self.engine, microbatches, step, self.passes.train,
            lambda loss: self.engine.backward(loss * weight), self.passes.warm_up,
        ):  # fmt: skip
            loss_sum = done.loss if loss_sum is None else loss_sum + done.loss
            if done.real:
                self.item_check.note(done.count, done.targets)
                tokens += done.targets.numel() if isinstance(done.targets, torch.Tensor) else 0
        self.item_check.step_done()
        grad_norm = self.engine.prepare_step(norm_wanted=self.guard.mode == "skip")
        measured = logged and self.spec.log_grad_norm  # DeepSpeed stepped in backward already
        share = self.engine.grad_norm_share() if measured else -1.0
        if self.guard.should_skip(loss_sum, grad_norm, step):
            self.engine.skip_step()
        else:
            self.engine.step()
            self.guard.after_step(self.engine.nonfinite_skips, step)
        if loss_sum is not None and self.grid.tensor > 1:  # a tensor group's ranks share it
            loss_sum = loss_sum / self.grid.tensor
        return loss_sum, items, share, tokens

    def evaluate(self) -> dict[str, float]:
        """val/loss and val/<metric> over every rank's share of the validation set."""
        return self.evaluator.evaluate(self.steps.eval_pieces, self.stand_in)

    # ------------------------------------------------------------------ helpers

    def _is_eval_step(self, step: int) -> bool:
        if self.spec.eval_interval is None:
            return step % self.data.steps_per_epoch == 0
        return step % self.spec.eval_interval == 0

    def _epoch(self, step: int) -> float:
        """The record's epoch: passes over a stream, or steps over the steps of an epoch."""
        if self.data.streaming:
            return self.data.train_loader.passes
        return round(step / self.data.steps_per_epoch, 4)

    def _roll_back(self, spike: Spike) -> tuple[int, int]:
        """Every rank: the state of the newest checkpoint before the spike (loss_spike.action
        =rollback); its batches are skipped on the way forward again. Returns the step and
        sample count to go on from. Without such a checkpoint the run stops."""
        found = self.checkpoints.restore_before(spike.steps[0])
        if found is None:
            raise LossSpikeError(
                f"{spike.describe()}; no checkpoint before step {spike.steps[0]} to roll "
                "back to (loss_spike.action=rollback): set checkpoint.interval"
            )
        checkpoint, client = found
        self.spikes.rolled_back(checkpoint, spike, client["step"])
        self.log.rewind(client["step"])
        return client["step"], client["samples"]

    def _finish(
        self, start_time: float, weights: bool = True, status: Status = Status.COMPLETED, **facts
    ) -> dict[str, Any]:
        self.sync_debug.off()
        self.checkpoints.finish()
        self.heart.beat(Phase.FINISH)
        self.guard.check_before_saving(self.engine.module, self.data.total_steps)
        summary = write_final(
            self.run_dir,
            self.spec,
            self.engine,
            self.log.records,
            self.build_peak_rss,
            weights=weights,
            status=status,
            start_time=start_time,
            restarts=self.attempt,
            resumed_from=self.resumed_from,
            first_step_at=self.first_step_at,
            compile_s=round(self.compile_clock.seconds, 3) if self.compile_clock else None,
            checkpoint_blocked_s=[round(s, 4) for s in self.checkpoints.blocked_s],
            checkpoint_written_s=[round(s, 4) for s in self.checkpoints.written_s] or None,
            loss_spike_rollbacks=self.spikes.rollbacks,
            **self.steps.summary(),
            **facts,
        )
        self.ended = summary  # written: whatever comes now, this is how the run ended
        self.log.close(summary)
        self.callbacks.call("on_fit_end", summary, step=self.step if not weights else None)
        return summary


def _on_device(metric: Any, device: str) -> Any:
    """torchmetrics metrics are modules and keep their state on the model's device."""
    return metric.to(device) if isinstance(metric, torch.nn.Module) else metric
