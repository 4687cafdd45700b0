"""Memory suites (B3): state and peak memory per rank by parallelism, for resnet18 and a gpt;
activation checkpointing; the largest gpt that fits a fixed budget per rank."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from harness import (
    MB,
    RESNET,
    STATE,
    Config,
    machine,
    plain_resnet,
    run,
    runner_row,
    thread_env,
    venv_tool,
)


def memory_suite(steps: int) -> list[Config]:
    rows = [
        runner_row(f"runner parallelism={p}", (*RESNET, f"parallelism={p}"), steps)
        for p in ("ddp", "zero1", "zero2", "zero3", "fsdp")
    ]
    return [plain_resnet(1, steps), *rows]


# The gpt for the memory goal: every weight matrix over DeepSpeed's parameter-persistence
# threshold (1e5 elements), so zero3 partitions them at its defaults.
GPT_WIDE = [
    "+recipe=gpt_text",
    "model.n_embd=512",
    "model.n_head=8",
    "data.block_size=64",
    "global_batch_size=8",
    "eval_interval=null",
    "grad_clip_norm=null",
]


def memory_gpt_suite(steps: int) -> list[Config]:
    """Per-rank state by parallelism on the gpt, activation checkpointing off and on;
    the baseline is runner's ddp (the goal is a fraction of DDP's state)."""
    configs = [
        runner_row(f"runner gpt parallelism={p}", (*GPT_WIDE, f"parallelism={p}"), steps)
        for p in ("ddp", "zero1", "zero2", "zero3", "fsdp")
    ]
    configs += [
        runner_row(
            f"runner gpt parallelism={p} activation_checkpointing=full",
            (*GPT_WIDE, f"parallelism={p}", "activation_checkpointing=full"),
            steps,
        )
        for p in ("ddp", "zero3", "fsdp")
    ]
    return configs


# A sequence length where activations dominate: 1024 tokens, 8 sequences per rank.
GPT_LONG = [
    "+recipe=gpt_text",
    "data.block_size=1024",
    "global_batch_size=16",
    "eval_interval=null",
]


def activation_suite(steps: int) -> list[Config]:
    """Activation checkpointing on the gpt model: peak memory (RSS) against step time."""
    return [
        runner_row(
            f"runner gpt activation_checkpointing={m}",
            (*GPT_LONG, f"activation_checkpointing={m}"),
            steps,
        )
        for m in ("none", "full", "2")
    ]


BUDGET_MB = 256  # per rank: parameters + gradients + optimizer state
CAPACITY_LAYERS = (2, 4, 6, 8, 10, 12, 14)


def gpt_parameters(n_layer: int, width: int = 512, vocab: int = 256, block: int = 64) -> int:
    """The GPT_WIDE model's parameter count (runner/models/gpt.py, no biases, untied head)."""
    per_layer = 12 * width * width + 2 * width
    return n_layer * per_layer + 2 * vocab * width + block * width + width


def measure_state(*overrides: str) -> dict[str, float]:
    """A short 2-rank run (3 steps): the largest rank's state and peak RSS, in MB."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, "nproc=2", "max_steps=3", "log_interval=1"]
        command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
        run(command, thread_env(2), cwd=tmp)
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        "peak RSS MB/rank": max(summary["peak_rss_bytes"]) / MB,
    }


def capacity_table(_reps: int, _steps: int) -> str:
    """The deepest GPT_WIDE that trains at nproc=2 within BUDGET_MB of state per rank: each
    parallelism climbs CAPACITY_LAYERS until a run's measured state exceeds the budget."""
    lines = [
        f"### B3 capacity: the largest gpt (512 wide, 64-token blocks) that trains at nproc=2 "
        f"within {BUDGET_MB} MB of state (parameters + gradients + optimizer state) per rank, "
        "AdamW, fp32",
        "",
        f"Machine: {machine()}. One 3-step run per depth ({', '.join(map(str, CAPACITY_LAYERS))}"
        " layers), climbing until the measured state (summary.json state_bytes, largest rank) "
        "exceeds the budget.",
        "",
        "| parallelism | layers | parameters (M) | state MB/rank | peak RSS MB/rank | "
        "next depth's state MB/rank |",
        "|---|---|---|---|---|---|",
    ]
    for parallelism in ("ddp", "zero2", "zero3", "fsdp"):
        fits, over = None, None
        for n_layer in CAPACITY_LAYERS:
            result = measure_state(
                *GPT_WIDE, f"parallelism={parallelism}", f"model.n_layer={n_layer}"
            )
            print(f"  {parallelism} n_layer={n_layer}: {result}", file=sys.stderr, flush=True)
            if result[STATE] > BUDGET_MB:
                over = result
                break
            fits = (n_layer, result)
        if fits is None:
            lines.append(f"| {parallelism} | none | | | | {over[STATE]:.1f} |")
            continue
        n_layer, result = fits
        beyond = f"{over[STATE]:.1f}" if over else "(ladder ends)"
        lines.append(
            f"| {parallelism} | {n_layer} | {gpt_parameters(n_layer) / 1e6:.1f} | "
            f"{result[STATE]:.1f} | {result['peak RSS MB/rank']:.0f} | {beyond} |"
        )
    return "\n".join(lines) + "\n"
