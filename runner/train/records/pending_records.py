"""Log records waiting for their loss: the ranks reduce several records' losses at once.

A record's train/loss is the loss of the whole global batch, a sum over every rank: one
all-reduce, and a host read of its result. A collective has a fixed cost however small
its tensor (about 1 ms over gloo on a 2-core machine, more than a small model's forward
pass), so reducing at every log step cost a 4 ms step about 5% at log_interval=10.

So each rank keeps the loss sums of its log steps on the device, and the ranks reduce the
records that are pending in one all-reduce (with the non-finite guard's notes) once there
are enough of them to fill about `FLUSH_S` seconds of training, or before anything that
must see them: an evaluation, a checkpoint, the last step. Slow steps, whose records take
longer than that, are reduced one at a time, at once. How many records to wait for is
decided from the reduced tensor itself (the ranks' mean training seconds a record covers,
the first step's warming up left out), so every rank reaches the same decision and meets
the collective at the same step. A record's values do not depend on when it is reduced.

The same all-reduce brings the record's other figures that need every rank (its tokens,
the gradient norm, peak memory: runner.train.records.step_figures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runner.train.guards.nonfinite import NonFiniteError, NonFiniteGuard
from runner.train.records.step_figures import StepFigures

FLUSH_S = 1.0  # seconds of training a reduction may wait for
MOST_PENDING = 100  # records in one reduction, at the most


Sums = tuple[float, "torch.Tensor | float"]  # a record's tokens and gradient-norm share
# a record's own sums to reduce (on the device) and what makes its figures of them
Extra = tuple[torch.Tensor, Callable[[list[float]], dict[str, Any]]]


class PendingRecords:
    def __init__(
        self,
        guard: NonFiniteGuard,
        world_size: int,
        rank: int,
        figures: StepFigures,
    ):
        self.guard, self.world, self.rank, self.figures = guard, world_size, rank, figures
        self.losses: list[tuple[int, torch.Tensor, Any]] = []  # (step, loss sum, items)
        self.records: list[tuple[dict[str, Any], float, Sums]] = []
        self.extras: list[Extra | None] = []  # each record's
        self.reduced: list[tuple[int, float]] = []  # the last reduction's (step, loss)
        self.wanted = 1  # the first record is reduced at once: the run shows it has started

    def add(
        self,
        record: dict[str, Any],
        loss_sum: torch.Tensor,
        items: Any,
        elapsed: float,
        sums: Sums,
        extra: Extra | None = None,
    ) -> None:
        """A log step's record, less its train/loss (this rank's loss sum, on the device,
        over the global batch's `items`) and the figures `sums` bring (over `elapsed`
        seconds of training); `extra`: more sums of its own (the same length on every
        rank), and what makes the record's figures of their totals."""
        self.add_loss(record["step"], loss_sum, items)
        self.records.append((record, elapsed, sums))
        self.extras.append(extra)

    def add_loss(self, step: int, loss_sum: torch.Tensor, items: Any) -> None:
        """A step's loss without a record (the loss-spike watch reads every step's)."""
        self.losses.append((step, loss_sum, items))

    @property
    def due(self) -> bool:
        """Whether enough records are pending to reduce them now (the same on every rank)."""
        return len(self.records) >= self.wanted

    def clear(self) -> None:
        """Forget what is pending (a rollback: those steps are trained again)."""
        self.losses.clear()
        self.records.clear()
        self.extras.clear()

    def reduce(self) -> tuple[list[dict[str, Any]], NonFiniteError | None]:
        """Every rank: the pending records with their loss, and the guard's error if a rank
        noted a non-finite value (then only the records of the steps before it). Every
        pending step's loss is in `reduced` afterwards."""
        self.reduced = []
        if not self.losses:
            return [], None
        steps, count = len(self.losses), len(self.records)
        # the training seconds the records cover: not the first step's compiling and warming
        # up, whose share made the second record look slow and reduced at once too
        elapsed = sum(seconds for _, seconds, _ in self.records)
        device = self.losses[0][1].device
        # On the device: each step's loss, each record's gradient-norm share; from the host,
        # in one copy: each record's tokens, the seconds, and this rank's peak memory in its
        # slot.
        losses = torch.stack([loss.reshape(()) for _, loss, _ in self.losses]).double()
        norms = [_scalar(norm, device) for _, _, (_, norm) in self.records]
        extras = [extra[0].to(device, torch.float64) for extra in self.extras if extra]
        on_device = torch.cat([losses, *([torch.stack(norms)] if norms else []), *extras])
        memory = [0.0] * self.world
        memory[self.rank] = self.figures.peak_memory_mb()
        tokens = [t for _, _, (t, _) in self.records]
        from_host = torch.tensor([*tokens, elapsed, *memory], dtype=torch.float64)
        values = torch.cat([on_device, from_host.to(device)])
        reduced, error = self.guard.reduce_with(values)
        host, extra_sums = _cut_extras(reduced.tolist(), steps + count, self.extras)
        peak_mb = max(host[-self.world :])
        loss_of = {}
        for (step, _, items), total in zip(self.losses, host, strict=False):
            if error is None or step < error.step:
                loss_of[step] = total / float(items)
                self.reduced.append((step, loss_of[step]))
        done = []
        for i, (record, seconds, _) in enumerate(self.records):
            if record["step"] not in loss_of:
                break
            record["train/loss"] = loss_of[record["step"]]
            sums = (host[steps + count + i], host[steps + i])  # its tokens, its norm share
            self.figures.complete(record, seconds, sums, peak_mb)
            if self.extras[i] is not None:
                record.update(self.extras[i][1](extra_sums[i]))
            done.append(record)
        if error is None and count:
            per_record = host[steps + 2 * count] / self.world / count
            self.wanted = max(1, min(MOST_PENDING, int(FLUSH_S / max(per_record, 1e-9))))
        self.clear()
        return done, error


def _cut_extras(
    host: list[float], at: int, extras: list[Extra | None]
) -> tuple[list[float], list[list[float]]]:
    """The reduced values as if the records' extras were not among them (they sit at `at`),
    and each record's extra sums (empty where it has none)."""
    cut, start = [], at
    for extra in extras:
        size = extra[0].numel() if extra else 0
        cut.append(host[start : start + size])
        start += size
    return host[:at] + host[start:], cut


def _scalar(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """`value` as a float64 scalar on `device` (a Python number is a constant there)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)
