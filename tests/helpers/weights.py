"""Comparing the weights two runs saved (model.pt): bit for bit, or their largest relative
difference."""

from __future__ import annotations

from pathlib import Path

import torch


def same_weights(a: Path, b: Path) -> bool:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def max_relative_difference(a: Path, b: Path) -> float:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return max(((x[k] - y[k]).norm() / y[k].norm()).item() for k in y)


def assert_exports_model_pt(checkpoint: Path, final: dict[str, torch.Tensor], to: Path) -> None:
    """`runner export CHECKPOINT --to TO` gives the tensors of model.pt (`final`), by name:
    the command's own code, in the test's process (no new interpreter importing torch; the
    command itself is tests/test_export.py's and tests/test_terminal.py's)."""
    from safetensors.torch import load_file

    from runner.export.command import main

    assert main([str(checkpoint), "--to", str(to)]) == 0
    exported = load_file(to / "model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], v) for k, v in final.items())
