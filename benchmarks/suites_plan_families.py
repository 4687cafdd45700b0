"""The plan's predicted peak against measurement, model family by model family
(benchmarks/results/plan_families.md).

For each family (runner's gpt_text and gpt_moe_text recipes, resnet50 on synthetic images,
a Hugging Face Llama and a Hugging Face mixture of experts built from their configs), a few
of the layouts its plan weighs (ddp, zero2, fsdp, and the model's own splits: tensor,
pipeline, expert), each trained for a few steps at 2 ranks, interleaved over the
repetitions: the largest rank's peak memory (resident memory above its base on a CPU), the
median over the repetitions, against the planner's prediction for the same layout.

The runs are kept in results/plan_families_runs.json; `python
benchmarks/suites_plan_families.py` writes the table again from them with the planner as it
is now (after a change to its model, before the runs are measured again).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from harness import REPO, RESULTS, machine
from suites_plan import _plan, _train

sys.path.insert(0, str(REPO))
from runner.cli.layout_plan import peak_used  # noqa: E402  (runner's own reading of a run)

RUNS = RESULTS / "plan_families_runs.json"
STEPS = 4
LONG_STEPS = 100  # does a rank's memory keep growing after the steps a check measures?
STDLIB = "data.root=${runner_python_stdlib:}"


def _causal_lm(model: str, config: str, values: dict) -> tuple[str, ...]:
    """A transformers causal LM built from its config class, on Python's own sources."""
    return (
        "model=custom", f"model._target_=transformers.{model}",
        f"+model.config._target_=transformers.{config}",
        *[f"+model.config.{k}={v}" for k, v in values.items()],
        "data=text", STDLIB, "data.pattern=*.py", "data.block_size=128", "data.val_fraction=0.02",
        "loss=causal_lm", "metrics=language_model", "global_batch_size=16", "nproc=2",
    )  # fmt: skip


LLAMA = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
}  # fmt: skip
MIXTRAL = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip

# family: (its keys, the layouts measured: each the keys a candidate of its plan has)
FAMILIES: dict[str, tuple[tuple[str, ...], list[dict]]] = {
    "gpt_text": (
        ("+recipe=gpt_text",),
        [
            {"parallelism": "ddp"},
            {"parallelism": "zero2"},
            {"parallelism": "fsdp"},
            {"parallelism": "ddp", "activation_checkpointing": "selective"},
            {"parallelism": "fsdp", "parallelism.tensor": 2},
            {"parallelism": "fsdp", "parallelism.pipeline": 2, "grad_accum": 2},
        ],
    ),
    "gpt_moe_text": (
        ("+recipe=gpt_moe_text",),
        [
            {"parallelism": "ddp"},
            {"parallelism": "zero2"},
            {"parallelism": "fsdp"},
            {"parallelism": "fsdp", "parallelism.expert": 2},
        ],
    ),
    "resnet50": (
        (
            "model=resnet50",
            "data=synthetic",
            "data.image_size=64",
            "data.num_classes=100",
            "optimizer=sgd",
            "global_batch_size=16",
            "nproc=2",
        ),
        [{"parallelism": "ddp"}, {"parallelism": "zero2"}, {"parallelism": "fsdp"}],
    ),  # fmt: skip
    "hf_llama": (
        _causal_lm("LlamaForCausalLM", "LlamaConfig", LLAMA),
        [
            {"parallelism": "ddp"},
            {"parallelism": "zero2"},
            {"parallelism": "fsdp"},
            {"parallelism": "fsdp", "parallelism.tensor": 2},
            {"parallelism": "fsdp", "parallelism.pipeline": 2, "grad_accum": 2},
        ],
    ),
    "hf_mixtral": (
        _causal_lm("MixtralForCausalLM", "MixtralConfig", MIXTRAL),
        [
            {"parallelism": "ddp"},
            {"parallelism": "zero2"},
            {"parallelism": "fsdp"},
            {"parallelism": "fsdp", "parallelism.expert": 2},
        ],
    ),
}


def _auto_under_budget(family: str, root: Path) -> dict:
    """parallelism=auto with a budget 10% under ddp's predicted peak (grad_accum 1), for
    LONG_STEPS steps: the pick (the check's trials included) and what its ranks measured by
    the end; and with 1 MB, that it stops before any rank (exit 2)."""
    import subprocess

    from harness import thread_env, venv_tool

    keys = FAMILIES[family][0]
    plan, _ = _plan(*keys)
    ddp = _predicted(plan, {"parallelism": "ddp"}) or {"peak_bytes": 0}
    budget = int(0.9 * ddp["peak_bytes"])
    run_dir = root / f"auto-{family}"
    command = [venv_tool("runner"), *keys, "parallelism=auto", f"plan.memory_per_rank={budget}B"]
    quiet = ["progress_bar=false", "logger=none", "eval_batches=1", "checkpoint.interval=null"]
    command += [*quiet, f"max_steps={LONG_STEPS}", "max_epochs=null", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, env=thread_env(2), cwd=REPO)
    got: dict = {"budget": budget, "exit": done.returncode}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        chosen = json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError):
        got["error"] = done.stderr.strip().splitlines()[-1:]
        return got
    got |= {"chosen": chosen["chosen"], "checked": chosen.get("trials", [])}
    got["peak_bytes"] = peak_used(summary)
    none = subprocess.run(
        [venv_tool("runner"), *keys, "parallelism=auto", "plan.memory_per_rank=1MB",
         f"hydra.run.dir={root / f'none-{family}'}"],
        capture_output=True, text=True, env=thread_env(2), cwd=REPO,
    )  # fmt: skip
    got["none_fits_exit"] = none.returncode
    got["none_fits_ranks"] = "rank(s) on this node" in none.stderr
    return got


def _name(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def families_table(reps: int, _steps: int, deadline: float | None = None) -> str:
    """Each family's layouts trained, interleaved over `reps`; then parallelism=auto under a
    budget ddp does not fit, for each family."""
    import time

    jobs = [(family, layout) for family, (_, layouts) in FAMILIES.items() for layout in layouts]
    results: dict[str, dict[str, list]] = {f: {} for f in FAMILIES}
    with tempfile.TemporaryDirectory(prefix="plan-families-") as root:
        for rep in range(reps):
            shift = rep % len(jobs)
            for number, (family, layout) in enumerate(jobs[shift:] + jobs[:shift]):
                if deadline is not None and time.monotonic() > deadline:
                    break
                keys = FAMILIES[family][0]
                got = _train(layout, Path(root), f"r{rep}-{number}", keys, STEPS)
                if got:
                    results[family].setdefault(_name(layout), []).append(got)
                print(f"  rep {rep + 1}/{reps} {family} {_name(layout)}: {got}", file=sys.stderr)
        long = {}
        for family, (keys, _) in FAMILIES.items():
            if deadline is None or time.monotonic() < deadline:
                long[family] = _train({"parallelism": "ddp"}, Path(root), f"long-{family}", keys,
                                      LONG_STEPS)  # fmt: skip
        auto = {family: _auto_under_budget(family, Path(root)) for family in FAMILIES}
    kept = {"machine": machine(), "reps": reps, "results": results, "auto": auto, "long": long}
    RUNS.write_text(json.dumps(kept, indent=1) + "\n")
    return table_from_runs()


def _predicted(plan: dict, layout: dict) -> dict | None:
    """The plan's row for `layout` (checkpointing none and grad_accum 1 unless it says)."""
    want = {"activation_checkpointing": "none", "grad_accum": 1, **layout}
    for row in plan["candidates"]:
        if row["valid"] and {k: str(v) for k, v in row["overrides"].items()} == {
            k: str(v) for k, v in want.items()
        }:
            return row["predicted"]
    return None


def table_from_runs() -> str:
    kept = json.loads(RUNS.read_text())
    lines = [
        "### parallelism=auto: the predicted peak, model family by model family",
        "",
        f"Machine: {kept['machine']}. Each layout trained for {STEPS} steps at 2 ranks, "
        f"{kept['reps']} interleaved repetitions; measured: the largest rank's resident memory "
        "above its base (summary.json's peak_rss_bytes - base_rss_bytes), the median; "
        "predicted: `runner plan --json`'s `peak_bytes` for the same layout, by the planner "
        'as it is now. Written by `make bench BENCH_ARGS="--suite plan_families"` '
        "(benchmarks/suites_plan_families.py, which names each family's keys).",
        "",
        "| family | layout | predicted peak MB | measured peak MB | error |",
        "|---|---|---|---|---|",
    ]
    errors: dict[str, list[float]] = {}
    for family, (keys, layouts) in FAMILIES.items():
        plan, _ = _plan(*keys)
        for layout in layouts:
            runs = kept["results"].get(family, {}).get(_name(layout), [])
            predicted = _predicted(plan, layout)
            shown = _name(layout)
            if not runs or predicted is None:
                why = "not measured" if not runs else "not a candidate of the plan"
                lines.append(f"| {family} | {shown} | | | {why} |")
                continue
            measured = statistics.median(r["peak_bytes"] for r in runs)
            error = predicted["peak_bytes"] / measured - 1
            errors.setdefault(family, []).append(error)
            lines.append(
                f"| {family} | {shown} | {predicted['peak_bytes'] / 2**20:.0f} | "
                f"{measured / 2**20:.0f} | {error:+.1%} |"
            )
    lines += ["", "| family | layouts | largest error | median error |", "|---|---|---|---|"]
    for family, found in errors.items():
        worst = max(found, key=abs)
        middle = statistics.median(abs(e) for e in found)
        lines.append(f"| {family} | {len(found)} | {worst:+.1%} | {middle:.1%} |")
    lines += _long_lines(kept)
    return "\n".join(lines + _auto_lines(kept.get("auto") or {})) + "\n"


def _long_lines(kept: dict) -> list[str]:
    """ddp's peak after the bench's few steps against one run of LONG_STEPS: whether a
    rank's memory keeps growing after what a check of the first steps sees."""
    long = kept.get("long") or {}
    if not long:
        return []
    lines = [
        "",
        f"Whether a rank's memory keeps growing: parallelism=ddp after {STEPS} steps (the "
        f"median above) and after {LONG_STEPS} steps (one run).",
        "",
        f"| family | after {STEPS} steps MB | after {LONG_STEPS} steps MB | growth |",
        "|---|---|---|---|",
    ]
    for family, got in long.items():
        runs = kept["results"].get(family, {}).get("parallelism=ddp", [])
        if not got or not runs:
            lines.append(f"| {family} | | | not measured |")
            continue
        short = statistics.median(r["peak_bytes"] for r in runs)
        lines.append(
            f"| {family} | {short / 2**20:.0f} | {got['peak_bytes'] / 2**20:.0f} | "
            f"{got['peak_bytes'] / short - 1:+.1%} |"
        )
    return lines


def _auto_lines(auto: dict) -> list[str]:
    """The table of parallelism=auto under a budget ddp does not fit, as measured."""
    if not auto:
        return []
    lines = [
        "",
        f"parallelism=auto with plan.memory_per_rank 10% under ddp's predicted peak "
        f"(grad_accum 1, no checkpointing), {LONG_STEPS} steps: the pick, the layouts its check "
        "ran first, and the "
        "largest rank's measured peak against the budget; then with 1 MB (no layout fits): "
        "the exit code, and whether any rank started.",
        "",
        "| family | budget MB | pick | checked first | measured peak MB | within "
        "| 1 MB: exit, ranks |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, got in auto.items():
        if "peak_bytes" not in got:  # refused before any rank: what it said
            said = " ".join(line.strip(" -") for line in got.get("error") or [])
            lines.append(
                f"| {family} | {got['budget'] / 2**20:.0f} | exit {got['exit']}: {said} | | | | |"
            )
            continue
        within = "yes" if got["peak_bytes"] <= got["budget"] else "**no**"
        checked = ", ".join(got["checked"]) or "none"
        ranks = "started" if got["none_fits_ranks"] else "none"
        lines.append(
            f"| {family} | {got['budget'] / 2**20:.0f} | {got['chosen']} | {checked} | "
            f"{got['peak_bytes'] / 2**20:.0f} | {within} | {got['none_fits_exit']}, {ranks} |"
        )
    return lines


if __name__ == "__main__":
    table = table_from_runs()
    (RESULTS / "plan_families.md").write_text(table)
    print(table)
