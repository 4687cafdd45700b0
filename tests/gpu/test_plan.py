"""parallelism=auto's plan on a GPU: `runner plan` there, and each layout's predicted peak
against the run's CUDA max_memory_allocated (the largest rank), within 15%. With
RUNNER_GPU_REPORT set to a folder, each layout's two figures are appended to
plan_peaks.jsonl there, so the check says how far off it was, pass or fail."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.gpu_runs import check_trained, gpt_args

# A gpt whose weights, optimizer state and activations outweigh what else a rank allocates.
SHAPE = ["model.n_layer=6", "model.n_embd=512", "model.n_head=8", "data.block_size=512",
         "global_batch_size=8", "precision=bf16", "logger=none"]  # fmt: skip
LAYOUTS = [
    "ddp accum=1",
    "zero2 accum=1",
    "fsdp accum=1",
    "ddp ac=full accum=1",
    "ddp ac=selective accum=1",
    "fsdp accum=2",
    "fsdp ac=full accum=1",
]


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory) -> tuple[list[str], dict]:
    root = tmp_path_factory.mktemp("gpu_plan")
    args = [*gpt_args(root / "corpus"), *SHAPE, "device=cuda", "nproc=1"]
    listed = run_cli(root, "plan", *args, "--json", name="plan")
    assert listed.returncode == 0, listed.output
    return args, json.loads(listed.stdout[listed.stdout.index("{") :])


def test_runner_plan_on_a_gpu_plans_for_its_memory(gpu_plan) -> None:
    import torch

    _, plan = gpu_plan
    assert plan["device"]["kind"] == "cuda"
    assert plan["model"]["traced_on"] == "cuda"  # fake CUDA tensors: CUDA's autocast, kernels
    assert plan["device"]["memory"] == torch.cuda.get_device_properties(0).total_memory
    assert plan["chosen"], plan
    chosen = next(r for r in plan["candidates"] if r["name"] == plan["chosen"])
    assert chosen["fits"] and chosen["predicted"]["step_s"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_predicted_peak_is_within_15_percent_of_max_memory_allocated(
    tmp_path: Path, gpu_plan, layout: str
) -> None:
    args, plan = gpu_plan
    row = next(r for r in plan["candidates"] if r["name"] == layout)
    assert row["valid"], row
    keys = [f"{key}={value}" for key, value in row["overrides"].items()]
    run = run_cli(tmp_path, *args, *keys, "max_epochs=null", "max_steps=6", "log_interval=1")
    assert run.returncode == 0, run.output
    summary = run.summary()
    measured = max(summary["peak_device_bytes"])
    predicted = row["predicted"]["peak_bytes"]
    report = os.environ.get("RUNNER_GPU_REPORT")
    if report:
        line = {"layout": layout, "predicted": predicted, "measured": measured,
                "parts": row.get("parts", {}), "state_bytes": row["predicted"]["state_bytes"],
                "measured_state_bytes": summary.get("state_bytes"),
                "traced_on": plan["model"]["traced_on"]}  # fmt: skip
        with open(Path(report) / "plan_peaks.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")
    check_trained(run)
    assert predicted == pytest.approx(measured, rel=0.15), (layout, predicted, measured)
