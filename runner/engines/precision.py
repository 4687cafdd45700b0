"""Autocast and loss scaling for each `precision` option."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from runner.spec.schema import Precision, PrecisionSpec

# The dtype each reduced precision computes in (autocast here, FSDP2's parameters in fsdp.py).
DTYPES = {
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.FLOAT8: torch.bfloat16,  # float8 only in the converted layers' matmuls
}


def autocast(spec: PrecisionSpec, device_type: str) -> Any:
    """The context a forward pass runs under (a no-op for fp32)."""
    if spec.name is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[spec.name])


def grad_scaler(spec: PrecisionSpec, device_type: str) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (on CUDA); None when no scaling is needed."""
    if spec.name is not Precision.FP16:
        return None
    return torch.amp.GradScaler(
        device_type, init_scale=spec.init_scale, growth_interval=spec.growth_interval
    )
