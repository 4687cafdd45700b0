"""The CUDA-only suite (`make test-gpu`): every test here is marked `gpu` and skipped on a
machine without a CUDA device, so `make test` collects it anywhere."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" not in str(item.path).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.slow)  # runs and ranks: processes
        if not torch.cuda.is_available():
            item.add_marker(skip)
