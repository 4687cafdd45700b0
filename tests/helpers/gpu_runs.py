"""What the CUDA suite's tests share (tests/gpu): the one-GPU run's settings, the checks of a
trained run, model.pt on a CPU, and a small text corpus for the gpt."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.spec import load_spec

GPU = ["device=cuda", "nproc=1", "max_epochs=null", "max_steps=20", "log_interval=5"]


def check_trained(run) -> dict:
    """A completed NCCL run on the GPU whose loss went down: its summary."""
    assert run.returncode == 0, run.output
    assert "process group: nccl, device cuda:0" in run.rank_log(0)
    summary = run.summary()
    assert summary["status"] == "completed" and summary["device"] == "cuda"
    losses = [r["train/loss"] for r in run.metrics() if "train/loss" in r]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    return summary


def load_on_cpu(run) -> torch.nn.Module:
    """model.pt into the model its config builds, on a CPU, strictly."""
    spec = load_spec(run.run_dir)
    model = build_model(spec.model, build_datasets(spec.data).info)
    weights = torch.load(run.run_dir / "model.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(weights)
    assert all(t.device.type == "cpu" for t in weights.values())
    return model


def gpt_args(root: Path) -> list[str]:
    """runner's gpt on a small text corpus written into `root`."""
    root.mkdir(exist_ok=True)
    (root / "doc.txt").write_text("the runner trains a tiny gpt on the gpu. " * 400)
    return ["model=gpt", "data=text", f"data.root={root}", "loss=causal_lm",
            "metrics=language_model", "data.block_size=64", "progress_bar=false"]  # fmt: skip
