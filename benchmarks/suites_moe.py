"""Mixture-of-experts suites: expert parallelism's step time and memory per rank at fixed
work (`moe`), and the gpt_moe_text recipe against the dense gpt_text it is sized after
(`moe_recipe`, a table of its own: one full run of each)."""

from __future__ import annotations

import json
import tempfile
import time
from functools import partial
from pathlib import Path

from harness import STEP, Config, machine, run, run_runner, thread_env, venv_tool

EXPERT_DEGREES = (1, 2, 4)
MOE_RANKS = 4
# gpt_text's data with a wider gpt_moe: 8 experts of 512 (4 x 256 / top_k 2) in 2 layers
GPT_MOE = [
    "+recipe=gpt_moe_text",
    "model.n_layer=2",
    "model.n_embd=256",
    "model.n_head=8",
    "data.block_size=64",
    "global_batch_size=16",
    "eval_interval=null",
    "grad_clip_norm=null",
    "parallelism=fsdp",
]


def moe_suite(steps: int) -> list[Config]:
    """The same run on 4 ranks with the experts split over groups of 1 (FSDP alone), 2 and 4."""
    return [
        Config(
            f"runner gpt_moe expert={e}, {MOE_RANKS} ranks",
            partial(run_runner, *GPT_MOE, f"parallelism.expert={e}", nproc=MOE_RANKS, steps=steps),
        )
        for e in EXPERT_DEGREES
    ]


def moe_notes(medians: dict[str, dict[str, float]]) -> list[str]:
    alone = medians[f"runner gpt_moe expert=1, {MOE_RANKS} ranks"]
    lines = ["| expert | s/step ratio to expert=1 | peak RSS MB/rank |", "|---|---|---|"]
    for e in EXPERT_DEGREES:
        row = medians[f"runner gpt_moe expert={e}, {MOE_RANKS} ranks"]
        lines.append(f"| {e} | {row[STEP] / alone[STEP]:.3f} | {row['peak RSS MB/rank']:.0f} |")
    lines += [
        "",
        "Fixed work: the same global batch on the same 4 ranks, the experts split over groups "
        "of E. Under FSDP alone (E=1) each rank gathers a layer's 8 experts whole for its "
        "passes; at E=2 and E=4 it gathers its group's share only (4 and 2 experts), and its "
        "tokens travel to their experts and back by all-to-all (two each way per layer). The "
        "state per rank is the same: FSDP shards every expert either way. Four ranks share "
        "this machine's 2 cores: read the ratios, not a GPU's times (where the grouped "
        "matrix product runs each rank's experts at once).",
    ]
    return lines


RECIPES = ("gpt_text", "gpt_moe_text")


def moe_recipe_table(reps: int, steps: int, deadline: float | None = None) -> str:
    """gpt_text and gpt_moe_text as shipped (150 steps, 2 ranks): validation perplexity and
    loss at the end, tokens/s; `reps` runs each, interleaved."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in RECIPES}
    for rep in range(reps):
        for name in RECIPES[rep % 2 :] + RECIPES[: rep % 2]:
            if deadline is not None and time.monotonic() > deadline:
                break
            runs[name].append(_recipe_run(name))
    lines = [
        "### gpt_moe_text against gpt_text",
        "",
        f"Machine: {machine()}.",
        "",
        "| recipe | runs | val/perplexity | val/loss | tokens/s (median) |",
        "|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        if not results:
            continue
        ppl = sorted(r["val/perplexity"] for r in results)
        loss = sorted(r["val/loss"] for r in results)
        speed = sorted(r["tokens/s"] for r in results)
        mid = len(results) // 2
        lines.append(
            f"| {name} | {len(results)} | {ppl[mid]:.3f} ({ppl[0]:.3f}-{ppl[-1]:.3f}) | "
            f"{loss[mid]:.4f} | {speed[mid]:.0f} |"
        )
    lines += [
        "",
        "Both as shipped: 150 steps of 32 sequences of 128 bytes of Python's standard "
        "library, the same seed, data and schedule; the same active parameters per token "
        "(gpt_moe_text: 8 experts of half the MLP's width, 2 per token; its experts hold 4x "
        "gpt_text's MLP parameters). Runs are deterministic, so repetitions differ only in "
        "time. On CPU the experts run one after another, so tokens/s is the loop's, not a "
        "GPU's grouped product.",
    ]
    return "\n".join(lines) + "\n"


def _recipe_run(recipe: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), f"+recipe={recipe}", "progress_bar=false"]
        run([*command, f"hydra.run.dir={run_dir}"], thread_env(2), cwd=tmp)
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
    speeds = [r["throughput/tokens_per_sec"] for r in records if "throughput/tokens_per_sec" in r]
    final = summary["final"]
    return {
        "val/perplexity": final["val/perplexity"],
        "val/loss": final["val/loss"],
        "tokens/s": sorted(speeds)[len(speeds) // 2],
    }
