"""DeepSpeed ZeRO stage 1 and 2, with runner's own optimizer and schedule as client objects.

DeepSpeed counts microbatches itself: every microbatch's backward is followed by
its `step()`, which only updates the weights at the accumulation boundary. Our
loss is already weighted by the microbatch's share of the global batch, so it
is not divided by grad_accum again (`scale_wrt_gas=False`).
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner import dist as rdist
from runner.engines.base import Engine
from runner.engines.optim import build_optimizer, build_scheduler, optimizer_state_bytes
from runner.spec import Precision, RunSpec
from runner.spec.deepspeed_config import merge_user_config

DEEPSPEED_TAG = "state"


def _import_deepspeed(name: str, device: str) -> Any:
    # DeepSpeed picks its accelerator at import; on a CPU run it must not guess CUDA.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError(
            f"parallelism={name} needs DeepSpeed, which cannot be imported: {exc}"
        ) from exc
    return deepspeed


class DeepSpeedEngine(Engine):
    def __init__(self, spec: RunSpec, module: nn.Module, device: str, total_steps: int):
        name = spec.parallelism.name
        deepspeed = _import_deepspeed(name, device)
        config, _ = merge_user_config(spec)  # conflicts were rejected by the parent
        optimizer = build_optimizer(spec.optimizer, module)
        scheduler = build_scheduler(spec.scheduler, optimizer, total_steps)
        try:
            self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=module,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=config,
                dist_init_required=False,
            )
        except Exception as exc:
            raise RuntimeError(
                f"parallelism={name}: DeepSpeed failed to initialise: {type(exc).__name__}: {exc}"
            ) from exc
        self.module = self.model.module
        self.full_precision = spec.precision.name is Precision.FP32

    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # DeepSpeed knows the boundary from its own count

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)
        self.model.step()  # a no-op for the weights except at the accumulation boundary

    def step(self) -> None:
        pass  # done by the last microbatch's backward()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def optimizer_state_bytes(self) -> int:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO wraps the client
        return optimizer_state_bytes(inner)

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        # DeepSpeed's own layout (directory/latest + directory/state/...), so its tools
        # such as zero_to_fp32.py work on a runner checkpoint directory.
        self.model.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state=client_state)

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        path, client_state = self.model.load_checkpoint(str(directory), tag=DEEPSPEED_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        return client_state

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every rank holds the full (16- or 32-bit) weights in ZeRO 1/2; fp32 masters are
        partitioned, so with bf16/fp16 the fp32 values are gathered (a collective)."""
        state = dict(self.module.state_dict())
        if not self.full_precision:
            from deepspeed.utils import safe_get_full_fp32_param

            for name, param in self.module.named_parameters():
                state[name] = safe_get_full_fp32_param(param)
        if rdist.get_global_rank() != 0:
            return None
        return {
            k: v.detach().float().cpu().clone() if v.is_floating_point() else v.cpu()
            for k, v in state.items()
        }
