"""Evaluation on one rank: the validation loss and metrics over every rank's share, whatever
the data (a loader, or parts of a stream of unequal length) and however the step cuts its
batches (grad_accum=auto)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from runner import dist as rdist
from runner.components import instantiate
from runner.engines.loss_parallel import gathered, loss_of
from runner.engines.rank_model import ELSEWHERE
from runner.heartbeat import Heartbeat, Phase
from runner.rundir.files import EVAL_FILE, RunDir, write_json
from runner.spec import RunSpec
from runner.train.step.loss_pass import LossPass


def metrics_for(spec: RunSpec, info: dict[str, Any], device: str) -> dict[str, Any]:
    """The configured metrics; torchmetrics' are modules and keep their state on the
    model's device."""
    metrics = {name: instantiate(m.node, info) for name, m in spec.metrics.items()}
    return {
        name: m.to(device) if isinstance(m, torch.nn.Module) else m for name, m in metrics.items()
    }


def write_evaluation(run_dir: RunDir, spec: RunSpec, metrics: dict[str, float], world: int) -> None:
    """eval.json: what `runner eval` measured, of which weights, on how many ranks."""
    evaluation = {
        "weights": spec.init_from.path,
        "metrics": metrics,
        "world_size": world,
        "eval_samples": spec.eval_limit,
    }
    write_json(run_dir.root / EVAL_FILE, evaluation)


class Evaluator:
    def __init__(
        self, passes: LossPass, metrics: dict[str, Any], val_loader: Any, heart: Heartbeat
    ):
        self.passes, self.metrics, self.val_loader, self.heart = passes, metrics, val_loader, heart
        self.engine, self.device = passes.engine, passes.device

    @torch.no_grad()
    def evaluate(self, pieces: Callable[[Any, bool], Any], stand_in: Any) -> dict[str, float]:
        """`val/loss` and `val/<metric>` over the whole validation set (every rank's share).
        `pieces` cuts a batch as the training step cuts its own; `stand_in` (a training
        microbatch) runs on a rank whose part of a stream has no batch at all."""
        if self.val_loader is None:
            return {}
        module = self.engine.module
        module.eval()
        for metric in self.metrics.values():
            metric.reset()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, items
        for whole, whole_real in self._pairs(stand_in):
            for batch, real in pieces(whole, whole_real):
                self.heart.beat(Phase.EVAL)
                logits, targets = self.passes.forward(batch, module)
                if not real or logits is ELSEWHERE:  # a placeholder, or scored elsewhere
                    continue
                loss, count = loss_of(self.passes.loss_fn, logits, targets)
                totals[0] += loss.double()
                totals[1] += count
                if self.metrics:
                    logits = gathered(logits)  # split across a tensor group: gathered
                for metric in self.metrics.values():
                    metric.update(logits, targets)
        rdist.all_reduce(totals)
        self.engine.model.train()
        if not totals[1]:  # an empty validation stream
            return {}
        results = {"val/loss": (totals[0] / totals[1]).item()}
        for name, metric in self.metrics.items():
            results[f"val/{name}"] = float(metric.compute())
        return results

    def _pairs(self, stand_in: Any) -> Iterator[tuple[Any, bool]]:
        """(batch, real) pairs of this rank's validation share. Ranks' parts of an iterable
        set differ in length: they agree batch by batch to go on, and a rank whose part has
        ended runs its last batch again as a placeholder, so every rank runs as many forward
        passes (fsdp and zero3 gather weights inside them)."""
        if not callable(self.val_loader):
            yield from self.val_loader
            return
        batches, last = self.val_loader(), None
        more = torch.zeros(1, device=self.device)
        while True:
            batch = next(batches, None)
            more.fill_(batch is not None)
            if not rdist.all_reduce(more, "max").item():
                return
            if batch is not None:
                last = batch
                yield batch, True
            else:  # a part with no batch at all stands in with a training microbatch
                yield (stand_in if last is None else last), False
