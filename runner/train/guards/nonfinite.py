"""The non-finite guard: a loss or gradient that turns NaN or inf ends the run (`nonfinite:
stop`) or costs only that optimizer step (`skip`), and a non-finite state is never saved.

stop (the default) adds no host sync per step: each rank notes on its device the first step
its loss, then its gradient norm, was not finite. The ranks compare notes only where they
sync anyway: in the all-reduce of the logged steps' losses (runner.train.records.pending_records),
and before a checkpoint or model.pt is written (where the weights are checked too). Every
rank then raises the same error, naming the step, the ranks, and whether the loss or the
gradient norm went first.

skip must decide before the optimizer steps, on every rank alike: one small all-reduce of
the ranks' verdicts and one read of it on the host per step. A skipped step leaves the
weights, the optimizer state and the schedule as they were. `max_skips` consecutive skips
end the run as stop would.

DeepSpeed checks the gradient norm itself and skips a non-finite step (ZeRO keeps fp32 weights
in every precision, where it always checks); the guard counts those skips from the engine, at
no cost. Under fp16 the loss scale owns gradient overflow: skipping such steps and lowering
the scale is its job, so there only the loss and the weights are checked.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from runner import dist as rdist

log = logging.getLogger(__name__)

LOSS, GRAD, WEIGHTS = 0, 1, 2
_LATER = 2.0**52  # a step is noted as _LATER - step (exact in float64): see _note
_WHAT = {LOSS: "loss", GRAD: "gradient norm", WEIGHTS: "weights"}
HISTORY = 128  # steps kept on the device between folds into the notes (stop)


class NonFiniteError(FloatingPointError):
    """The loss, the gradients or the weights are NaN or inf, first at `step`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class NonFiniteGuard:
    def __init__(
        self,
        world_size: int,
        rank: int,
        device: str,
        mode: Literal["stop", "skip"] = "stop",
        max_skips: int = 5,
    ):
        self.rank, self.mode, self.max_skips = rank, mode, max_skips
        # Per rank: the first step its loss, its gradient norm, its weights were non-finite,
        # as _LATER - step (0: never). A rank writes only its own slots, so a sum over ranks
        # gathers them.
        self.first = torch.zeros(3, world_size, dtype=torch.float64, device=device)
        # stop: the last steps' loss, gradient norm and step number, written here on the
        # device (one small kernel each per step, the step a fill: no copy from the host)
        # and folded into `first` where the notes are read.
        self._history = torch.zeros(HISTORY, 3, dtype=torch.float64, device=device)
        self._slots = [list(row.unbind()) for row in self._history.unbind()]  # views, made once
        self._noted = 0  # slots in use
        self.skipped = 0  # steps skipped in all
        self.consecutive = 0
        self.engine_skips = 0  # the engine's own count (DeepSpeed), as last seen

    # ------------------------------------------------------------------ every step

    def should_skip(
        self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, step: int
    ) -> bool:
        """After backward, before the optimizer: note (stop) or decide (skip)."""
        if self.mode == "skip":
            if grad_norm is None:  # the engine or the loss scaler skips by itself
                return False
            verdicts = torch.zeros(
                2, self.first.shape[1], dtype=torch.float64, device=grad_norm.device
            )
            verdicts[LOSS, self.rank] = (~torch.isfinite(loss_sum)).double()
            verdicts[GRAD, self.rank] = (~torch.isfinite(grad_norm)).double()
            rdist.all_reduce(verdicts)
            bad = verdicts.cpu()  # the one host read per step that skip costs
            if not bool(bad.any()):
                self.consecutive = 0
                return False
            what = LOSS if bool(bad[LOSS].any()) else GRAD
            self._skip(what, [r for r, v in enumerate(bad[what].tolist()) if v > 0], step)
            return True
        self._note(loss_sum, grad_norm, step)
        return False

    def after_step(self, engine_skips: int, step: int) -> None:
        """After the engine stepped: count the steps it skipped by itself (a host int)."""
        if engine_skips == self.engine_skips:
            return
        self.engine_skips = engine_skips  # DeepSpeed's norm is global: every rank is here
        if self.mode == "stop":  # the loss may have gone first: compare notes (we stop anyway)
            self._fold()
            if self.first[GRAD, self.rank] == 0:
                self.first[GRAD, self.rank] = _LATER - step
            notes = self.first.clone()
            rdist.all_reduce(notes)
            self._raise_if_noted(notes.cpu())
        self._skip(GRAD, [], step)  # no ranks: DeepSpeed's global norm

    def _skip(self, what: int, ranks: list[int], step: int) -> None:
        self.skipped += 1
        self.consecutive += 1
        log.info("nonfinite: step %d skipped (%s)", step, self._describe(what, step, ranks))
        if self.consecutive > self.max_skips:
            raise self._error(
                what,
                step,
                ranks,
                f"{self.consecutive} steps in a row were skipped "
                f"(nonfinite_max_skips={self.max_skips}); ",
            )

    def _note(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, step: int) -> None:
        """On device, one copy per value: keep this step's loss and gradient norm until the
        next fold (_fold), where the first non-finite one becomes a note."""
        if self._noted == HISTORY:
            self._fold()
        loss_slot, grad_slot, step_slot = self._slots[self._noted]
        loss_slot.copy_(loss_sum)
        if grad_norm is not None:
            grad_slot.copy_(grad_norm)
        step_slot.fill_(step)
        self._noted += 1

    def _fold(self) -> None:
        """Note the first step of the history whose loss or gradient norm was not finite: a
        note holds _LATER - step, so the first step is the largest mark (0: never), kept by
        a running maximum. A few kernels, no host sync."""
        if not self._noted:
            return
        used = self._history[: self._noted]
        values, steps = used[:, :2], used[:, 2]
        marks = torch.where(torch.isfinite(values), 0.0, (_LATER - steps).unsqueeze(1))
        notes = self.first[:2, self.rank]  # a view: updated in place
        torch.maximum(notes, marks.amax(dim=0), out=notes)
        used.zero_()
        self._noted = 0

    # ------------------------------------------------------------------ where ranks sync

    def reduce_with(self, values: torch.Tensor) -> tuple[torch.Tensor, NonFiniteError | None]:
        """All-reduce `values` (float64, on the device) and every rank's notes in one
        collective: the sums on the host, and the error to raise if any rank noted a
        non-finite value (the caller may first use the sums of the steps before it)."""
        self._fold()
        packed = torch.cat([values.reshape(-1), self.first.reshape(-1)])
        rdist.all_reduce(packed)
        host = packed.cpu()
        notes = host[values.numel() :].reshape(self.first.shape)
        return host[: values.numel()], self._error_if_noted(notes)

    def check_before_saving(self, module: nn.Module, step: int) -> None:
        """Before a checkpoint or model.pt: the notes, and this rank's weights, all finite."""
        self._fold()
        if self.first[WEIGHTS, self.rank] == 0 and not _weights_finite(module):
            self.first[WEIGHTS, self.rank] = _LATER - step
        notes = self.first.clone()
        rdist.all_reduce(notes)
        self._raise_if_noted(notes.cpu())

    def _raise_if_noted(self, notes: torch.Tensor) -> None:
        error = self._error_if_noted(notes)
        if error is not None:
            raise error

    def _error_if_noted(self, notes: torch.Tensor) -> NonFiniteError | None:
        noted = [
            (int(_LATER - s), row, rank)
            for row in (LOSS, GRAD, WEIGHTS)
            for rank, s in enumerate(notes[row].tolist())
            if s > 0
        ]
        if not noted:
            return None
        step, row, _ = min(noted)  # the earliest step; at a tie, the loss before the rest
        return self._error(row, step, sorted(r for s, w, r in noted if (s, w) == (step, row)))

    def _describe(self, row: int, step: int, ranks: list[int]) -> str:
        if not ranks:  # the engine's own check (DeepSpeed), of the global norm
            return f"non-finite {_WHAT[row]} (NaN or inf) at step {step}, found by DeepSpeed"
        where = ", ".join(map(str, ranks))
        finite_loss = " (the loss was finite)" if row == GRAD else ""
        return (
            f"non-finite {_WHAT[row]} (NaN or inf) at step {step} on rank(s) {where}{finite_loss}"
        )

    def _error(self, row: int, step: int, ranks: list[int], why: str = "") -> NonFiniteError:
        return NonFiniteError(
            f"{self._describe(row, step, ranks)}; {why}the run stops and nothing from that state "
            "is saved (every checkpoint written before it is finite)",
            step,
        )


def _weights_finite(module: nn.Module) -> bool:
    """Whether this rank's weights are all finite: a verdict per tensor on its device, one
    read of them all per device (not a wait on the device per parameter)."""
    verdicts: dict[torch.device, list[torch.Tensor]] = {}
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP shards
        partition = getattr(param, "ds_tensor", None)  # ZeRO-3: p.data is empty when released
        for tensor in (local, partition):
            if tensor is not None and tensor.numel():
                finite = torch.isfinite(tensor.detach()).all()
                verdicts.setdefault(tensor.device, []).append(finite)
    return all(bool(torch.stack(found).all()) for found in verdicts.values())
