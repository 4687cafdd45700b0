"""The non-finite guard: a loss or weights that turned NaN or inf end the run, and are never
saved.

No host sync per step: each rank notes on its device the first step its loss was not
finite. The ranks compare notes only where they sync anyway: on log steps, in the same
all-reduce as the loss, and before a checkpoint or model.pt is written (where the weights
are checked too). Every rank then raises the same error, naming the step and the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from runner import dist as rdist


class NonFiniteError(FloatingPointError):
    """The loss or the weights are NaN or inf."""


class NonFiniteGuard:
    def __init__(self, world_size: int, rank: int, device: str):
        self.rank = rank
        # Per rank: the first step its loss was non-finite, then the first its weights were
        # (0: never). A rank writes only its own slots, so a sum over ranks gathers them.
        self.first = torch.zeros(2, world_size, dtype=torch.float64, device=device)

    def note_loss(self, loss_sum: torch.Tensor, step: int) -> None:
        """After each step, on device: remember the step if this rank's loss is not finite."""
        slot = self.first[0, self.rank]
        bad = ~torch.isfinite(loss_sum) & (slot == 0)
        self.first[0, self.rank] = torch.where(bad, float(step), slot)

    def reduce_with(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """All-reduce the loss sum and every rank's notes in one collective; check the notes
        and return the global loss sum."""
        packed = torch.cat([loss_sum.double().reshape(1), self.first.reshape(-1)])
        rdist.all_reduce(packed)
        self._raise_if_noted(packed[1:].reshape(self.first.shape).cpu())
        return packed[0]

    def check_before_saving(self, module: nn.Module, step: int) -> None:
        """Before a checkpoint or model.pt: the notes, and this rank's weights, all finite."""
        if self.first[1, self.rank] == 0 and not _weights_finite(module):
            self.first[1, self.rank] = float(step)
        notes = self.first.clone()
        rdist.all_reduce(notes)
        self._raise_if_noted(notes.cpu())

    def _raise_if_noted(self, notes: torch.Tensor) -> None:
        for row, what in enumerate(("loss", "weights")):
            steps = {rank: int(s) for rank, s in enumerate(notes[row].tolist()) if s > 0}
            if steps:
                first = min(steps.values())
                ranks = sorted(r for r, s in steps.items() if s == first)
                raise NonFiniteError(
                    f"non-finite {what} (NaN or inf) at step {first} on rank(s) "
                    f"{', '.join(map(str, ranks))}; the run stops and nothing from that state "
                    "is saved (the latest checkpoint holds finite weights)"
                )


def _weights_finite(module: nn.Module) -> bool:
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP shards
        partition = getattr(param, "ds_tensor", None)  # ZeRO-3: p.data is empty when released
        for tensor in (local, partition):
            if tensor is not None and tensor.numel() and not torch.isfinite(tensor.detach()).all():
                return False
    return True
