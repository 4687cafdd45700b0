"""Loss spikes, in the manner of LLM Foundry's KillLossSpike and of the rollback-and-skip
practice of large pretraining runs (PaLM restarted from a checkpoint before a spike and
skipped the batches around it).

Every step's loss (the whole global batch's, reduced with the log records about once a
second, so the same on every rank) is compared with the mean of the `window` steps before
it. A loss over `factor` times that mean is a spike; spikes do not join the mean.
`patience` spikes in a row set off the action:

- log: a warning in rank 0's log, naming the steps;
- stop: the run ends (LossSpikeError), naming the steps;
- rollback: every rank restores the newest checkpoint written before the first of those
  steps, and on the way forward again skips their batches (drawn, not trained on; the
  optimizer does not step). Without such a checkpoint the run stops as with `stop`.

The step log (runner.train.records.step_log) watches the losses it reduces and hands a spike that
asks for a rollback to the trainer, which restores the checkpoint: a value, not an
exception.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.spec.guard_specs import LossSpikeSpec

if TYPE_CHECKING:
    from runner.train.checkpoints.checkpointer import Resumed

Restore = Callable[[int], "tuple[Path, Resumed] | None"]

log = logging.getLogger(__name__)


class LossSpikeError(RuntimeError):
    """A loss spike ended the run (loss_spike.action=stop, or rollback with nothing to
    roll back to)."""


@dataclass
class Spike:
    steps: list[int]  # the steps whose loss spiked, in a row
    loss: float  # the highest of their losses
    mean: float  # the mean of the window before them

    def describe(self) -> str:
        first, last = self.steps[0], self.steps[-1]
        where = f"step {first}" if first == last else f"steps {first}-{last}"
        return (
            f"loss spike at {where}: loss {self.loss:.4g} is {self.loss / self.mean:.1f}x the "
            f"mean {self.mean:.4g} of the steps before"
        )


class SpikeWatch:
    def __init__(self, spec: LossSpikeSpec):
        self.spec = spec
        self.window: deque[tuple[int, float]] = deque(maxlen=spec.window)
        self.total = 0.0  # of the window's losses, kept as they come and go
        self.spiking: list[tuple[int, float]] = []

    @property
    def on(self) -> bool:
        return self.spec.action != "none"

    def observe(self, step: int, loss: float) -> Spike | None:
        """The next step's loss; a Spike once `patience` of them in a row are spikes."""
        if len(self.window) == self.spec.window:
            mean = self.total / len(self.window)
            if loss > self.spec.factor * mean:
                self.spiking.append((step, loss))
                if len(self.spiking) < self.spec.patience:
                    return None
                spike = Spike([s for s, _ in self.spiking], max(v for _, v in self.spiking), mean)
                self.spiking = []
                return spike
        self.spiking = []
        if len(self.window) == self.spec.window:
            self.total -= self.window[0][1]
        self.window.append((step, loss))
        self.total += loss
        return None

    def state(self) -> dict[str, Any]:
        """The losses the next steps are compared with (kept in each checkpoint, so that a
        restart sees the spikes the uninterrupted run sees): the window, its running total
        (as summed, so a restart rounds alike) and the spikes in a row so far."""
        return {
            "window": [list(entry) for entry in self.window],
            "total": self.total,
            "spiking": [list(entry) for entry in self.spiking],
        }

    def load(self, state: Mapping[str, Any]) -> None:
        self.window = deque(((int(s), float(v)) for s, v in state["window"]), self.spec.window)
        self.total = float(state["total"])
        self.spiking = [(int(s), float(v)) for s, v in state["spiking"]]

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: forget what came after it."""
        kept = [(s, v) for s, v in self.window if s <= step]
        self.window = deque(kept, maxlen=self.spec.window)
        self.total = sum(v for _, v in kept)
        self.spiking = []


class LossSpikes:
    """The watch, its action, and what rollbacks leave behind: the batches to skip."""

    def __init__(self, spec: LossSpikeSpec, resumed: Mapping[str, Any] | None = None):
        """`resumed`: the client state of the checkpoint this attempt starts from."""
        self.spec = spec
        self.watch = SpikeWatch(spec)
        # steps whose batches are not trained on, kept in each checkpoint
        self.skipped: set[int] = set((resumed or {}).get("skipped_batches", ()))
        self.rollbacks: list[dict[str, Any]] = []  # summary.json loss_spike_rollbacks
        watched = (resumed or {}).get("loss_spike_watch")
        if watched is not None and watched.get("window_size") == spec.window:
            self.watch.load(watched)  # an older checkpoint's (none kept): watched afresh

    def checkpoint_state(self) -> dict[str, Any]:
        watched = {**self.watch.state(), "window_size": self.spec.window}
        return {"skipped_batches": sorted(self.skipped), "loss_spike_watch": watched}

    @property
    def on(self) -> bool:
        return self.watch.on

    def check(self, reduced: list[tuple[int, float]]) -> Spike | None:
        """The first spike among these steps' losses (in step order), if any."""
        for step, loss in reduced if self.on else ():
            spike = self.watch.observe(step, loss)
            if spike is not None:
                return spike
        return None

    def roll_back(self, spike: Spike, restore_before: Restore) -> Resumed:
        """Every rank: the state of the newest checkpoint before the spike, from
        `restore_before` (the checkpointer's); its batches are skipped on the way forward
        again, the later losses forgotten. Without such a checkpoint the run stops."""
        found = restore_before(spike.steps[0])
        if found is None:
            raise LossSpikeError(
                f"{spike.describe()}; no checkpoint before step {spike.steps[0]} to roll "
                "back to (loss_spike.action=rollback): set checkpoint.interval"
            )
        checkpoint, back = found
        steps = spike.steps
        self.skipped.update(steps)
        self.watch.rewind(back.step)
        self.rollbacks.append({"steps": steps, "to_step": back.step})
        what = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
        log.warning(
            "rolled back to %s (step %d); skipping the batch of %s", checkpoint, back.step, what
        )
        return back
