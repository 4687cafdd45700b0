"""The interface between the training loop and a parallelism (ddp, zero1, zero2, ...)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Engine(ABC):
    """Wraps a model and its optimizer for one parallelism.

    The loop calls, per optimizer step: for each microbatch i of n,
    `with engine.microbatch(i, n): loss = f(engine.model(x)); engine.backward(loss)`,
    then `engine.step()`.
    """

    model: nn.Module
    """What the forward pass calls (the wrapped model)."""
    module: nn.Module
    """The plain model underneath: for evaluation and for exporting weights."""

    @abstractmethod
    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        """Context for the forward and backward of microbatch `index` of `count`."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (already weighted by the microbatch's share of the step)."""

    @abstractmethod
    def step(self) -> None:
        """Finish gradient sync, clip, step optimizer and schedule, zero the gradients."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next step will use."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated model weights on rank 0 (None elsewhere). Every rank must call it."""

    @abstractmethod
    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Write the training state and `client_state` into `directory`. Every rank calls it."""

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Restore the training state from `directory`; return the client state saved with it."""
