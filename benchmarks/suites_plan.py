"""parallelism=auto's plan against measurement (benchmarks/results/plan.md).

1. How long `runner plan` takes to answer for a 12-layer gpt (the command, timed from
   outside; no training process starts).
2. Every valid candidate of one gpt's plan at 2 ranks on this machine, each trained for a
   few steps, interleaved over the repetitions: its measured step time (the median of
   `time/step_s` after the first step) and peak memory per rank (resident memory above the
   rank's base on a CPU), against the prediction. The pick's measured step time is compared
   with the fastest candidate's measured one.

The runs are kept in results/plan_runs.json; `python benchmarks/suites_plan.py` writes the
table again from them with the planner as it is now (after a change to its model, before
the runs are measured again).

gpu_plan (results/gpu_plan.md), on the GPUs of a lent machine: the same, for the 12-layer
gpt of the GPU bench (1024-token blocks, global batch 16, bf16) on every GPU, over the
candidates of each engine and checkpointing mode at grad_accum 1 and 2 (a GPU's minutes are
few): `runner plan`'s answer, each candidate's measured step time and CUDA max allocated
against the prediction, and the pick against the fastest measured.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, RESULTS, machine, thread_env, venv_tool

sys.path.insert(0, str(REPO))
from runner.cli.plan_trials import measured  # noqa: E402  (runner's own reading of a run)

# A gpt whose state and activations dominate a rank's memory, small enough to train each of
# its layouts for a few steps on 2 CPU cores; a batch of 4 over 2 ranks: grad_accum 1 or 2.
GPT = (
    "+recipe=gpt_text", "model.n_layer=4", "model.n_embd=384", "model.n_head=6",
    "data.block_size=256", "global_batch_size=4", "nproc=2", "data.min_length=null",
)  # fmt: skip
QUIET = ("progress_bar=false", "logger=none", "eval_batches=1", "checkpoint.interval=null")
TWELVE = ("+recipe=gpt_text", "model.n_layer=12", "model.n_embd=768", "model.n_head=12")
STEPS = 6
RUNS = RESULTS / "plan_runs.json"


def _plan(*overrides: str) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [venv_tool("runner"), "plan", *overrides, "--json"],
        capture_output=True, text=True, check=True, env=thread_env(2), cwd=REPO,
    ).stdout  # fmt: skip
    return json.loads(out[out.index("{") :]), time.perf_counter() - start


def _train(
    overrides: dict, root: Path, name: str, model: tuple[str, ...] = GPT, steps: int = STEPS
) -> dict[str, float]:
    run_dir = root / name
    keys = [f"{k}={v}" for k, v in overrides.items()]
    command = [venv_tool("runner"), *model, *QUIET, *keys, f"max_steps={steps}", "log_interval=1"]
    proc = subprocess.run(
        [*command, "max_epochs=null", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=thread_env(2), cwd=REPO,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"  {name} failed: {proc.stderr[-600:]}", file=sys.stderr, flush=True)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return measured(run_dir, summary) if summary.get("status") == "completed" else {}


# gpt_moe_text's model (4 layers, 128 wide, 8 experts, 2 per token) on the same batch at 2
# ranks: its candidates include the experts split between them (fsdp ep2)
MOE = ("+recipe=gpt_moe_text", "global_batch_size=8", "nproc=2", "data.min_length=null")
MOE_RUNS = RESULTS / "plan_moe_runs.json"


def plan_table(reps: int, _steps: int, _deadline: float | None = None) -> str:
    return _plan_table(reps, GPT, RUNS)


def plan_moe_table(reps: int, _steps: int, _deadline: float | None = None) -> str:
    return _plan_table(reps, MOE, MOE_RUNS)


def _plan_table(reps: int, model: tuple[str, ...], runs: Path) -> str:
    answers = [_plan(*TWELVE)[1] for _ in range(max(5, reps))]
    plan, _ = _plan(*model)
    valid = [r for r in plan["candidates"] if r["valid"]]
    results: dict[str, list[dict[str, float]]] = {r["name"]: [] for r in valid}
    with tempfile.TemporaryDirectory(prefix="plan-bench-") as root:
        for rep in range(reps):
            shift = rep % len(valid)
            for number, row in enumerate(valid[shift:] + valid[:shift]):
                got = _train(row["overrides"], Path(root), f"r{rep}-{number}", model)
                if got:
                    results[row["name"]].append(got)
                print(f"  rep {rep + 1}/{reps} {row['name']}: {got}", file=sys.stderr, flush=True)
    kept = {"machine": machine(), "reps": reps, "answers": answers, "results": results}
    runs.write_text(json.dumps(kept, indent=1) + "\n")
    return _table(plan, results, kept, model=model)


GPU_GPT = (
    "model=gpt", "data=text", "loss=causal_lm", "metrics=language_model",
    "data.block_size=1024", "model.n_layer=12", "model.n_embd=768", "model.n_head=12",
    "device=cuda", "precision=bf16", "global_batch_size=16",
)  # fmt: skip
GPU_STEPS = 12


def gpu_plan_table(reps: int, _steps: int, deadline: float | None = None) -> str:
    """The 12-layer gpt's plan on every GPU of this machine, against its candidates'
    measured runs (each engine and checkpointing mode at grad_accum 1 and 2, interleaved;
    none is started after `deadline`)."""
    from suites_gpu import cuda_devices, random_corpus

    gpus = cuda_devices()
    if not gpus:
        sys.exit("gpu_plan needs a CUDA device; none is visible")
    model = (*GPU_GPT, f"data.root={random_corpus(2_500_000)}", f"nproc={gpus}")
    timed = [_plan(*model) for _ in range(max(3, reps))]
    plan, answers = timed[-1][0], [seconds for _, seconds in timed]
    valid = [
        r for r in plan["candidates"]
        if r["valid"] and r["overrides"].get("grad_accum", 1) in (1, 2)
        and set(r["overrides"]) <= {"parallelism", "activation_checkpointing", "grad_accum"}
    ]  # fmt: skip
    valid.sort(key=lambda r: (r["name"] != plan["chosen"], r["predicted"]["step_s"]))
    results: dict[str, list[dict[str, float]]] = {r["name"]: [] for r in valid}
    with tempfile.TemporaryDirectory(prefix="gpu-plan-bench-") as root:
        for rep in range(reps):
            shift = rep % max(1, len(valid))
            for number, row in enumerate(valid[shift:] + valid[:shift]):
                if deadline is not None and time.monotonic() > deadline:
                    break
                got = _train(row["overrides"], Path(root), f"r{rep}-{number}", model, GPU_STEPS)
                if got:
                    results[row["name"]].append(got)
                print(f"  rep {rep + 1}/{reps} {row['name']}: {got}", file=sys.stderr, flush=True)
    kept = {"machine": machine(), "reps": reps, "answers": answers, "results": results}
    (RESULTS / "gpu_plan_runs.json").write_text(json.dumps(kept, indent=1) + "\n")
    return _table(
        plan,
        results,
        kept,
        described=(
            f"The candidates of the GPU bench's gpt ({' '.join(GPU_GPT)}, nproc={gpus}) at "
            f"grad_accum 1 and 2, up to {reps} interleaved repetitions of {GPU_STEPS} steps "
            "each (as many as the GPU check's budget allowed): measured step time (median of "
            "time/step_s after the first step) and peak memory (CUDA max_memory_allocated, the "
            "largest rank), medians, against the prediction."
        ),
    )


def table_from_runs(model: tuple[str, ...] = GPT, runs: Path = RUNS) -> str:
    """The table of the kept runs, against the planner's prediction now (and `runner plan`
    timed again: the planner is what changed)."""
    kept = json.loads(runs.read_text())
    kept["answers"] = [_plan(*TWELVE)[1] for _ in range(max(5, kept["reps"]))]
    runs.write_text(json.dumps(kept, indent=1) + "\n")
    plan, _ = _plan(*model)
    return _table(plan, kept["results"], kept, predicted_now=True, model=model)


def _table(
    plan: dict,
    results: dict,
    kept: dict,
    predicted_now: bool = False,
    described: str = "",
    model: tuple[str, ...] = GPT,
) -> str:
    answers, reps = kept["answers"], kept["reps"]
    valid = [r for r in plan["candidates"] if r["valid"] and r["name"] in results]
    median = {
        name: {k: statistics.median(r[k] for r in runs) for k in ("step_s", "peak_bytes")}
        for name, runs in results.items()
        if runs
    }
    fastest = min(median, key=lambda n: median[n]["step_s"], default="")
    chosen = plan["chosen"]
    lines = [
        "### parallelism=auto: the plan against measurement",
        "",
        f"Machine: {kept['machine']}. `runner plan` for a 12-layer gpt (768 wide): "
        f"{statistics.median(answers):.1f} s median ({min(answers):.1f}-{max(answers):.1f}) "
        f"over {len(answers)} runs, from outside.",
        "",
        described
        or f"Every valid candidate of a plan ({' '.join(model)}), {reps} interleaved "
        f"repetitions of {STEPS} steps each: measured step time (median of time/step_s after "
        "the first step) and peak memory (the largest rank's resident memory above its base), "
        "medians, against the prediction"
        + (
            " of the planner as it is now (the runs measured before; `python "
            "benchmarks/suites_plan.py` writes this table again from them)."
            + (
                " The CPU constants of runner.layouts.memory and .speed were fitted on these "
                "runs; tests/test_layout_plan.py checks the peak on resnet18 and other splits."
                if model == GPT
                else ""
            )
            if predicted_now
            else "."
        ),
        "",
        f"The pick, **{chosen}**: {_versus(median, chosen, fastest)}",
        "",
        "| candidate | predicted s/step | measured s/step | predicted peak MB | measured peak MB "
        "| peak error |",
        "|---|---|---|---|---|---|",
    ]
    errors = []
    for row in sorted(valid, key=lambda r: median.get(r["name"], {}).get("step_s", 1e9)):
        got = median.get(row["name"])
        predicted = row["predicted"]
        if got is None:
            lines.append(f"| {row['name']} | {predicted['step_s']:.3f} | not measured | | | |")
            continue
        error = predicted["peak_bytes"] / got["peak_bytes"] - 1
        errors.append(abs(error))
        mark = " (pick)" if row["name"] == chosen else ""
        lines.append(
            f"| {row['name']}{mark} | {predicted['step_s']:.3f} | {got['step_s']:.3f} | "
            f"{predicted['peak_bytes'] / 2**20:.0f} | {got['peak_bytes'] / 2**20:.0f} | "
            f"{error:+.1%} |"
        )
    lines += [
        "",
        f"Peak memory: the prediction within {max(errors):.0%} of the measurement for every "
        f"candidate measured, {statistics.median(errors):.0%} the median error."
        if errors
        else "Nothing was measured.",
    ]
    return "\n".join(lines) + "\n"


def _versus(median: dict, chosen: str, fastest: str) -> str:
    if chosen not in median:
        return "not measured (its runs failed, or the budget ran out first)."
    ratio = median[chosen]["step_s"] / median[fastest]["step_s"]
    return (
        f"measured {median[chosen]['step_s']:.3f} s/step, {ratio:.3f}x the fastest measured "
        f"candidate ({fastest}, {median[fastest]['step_s']:.3f} s/step)."
    )


if __name__ == "__main__":
    for name, model, runs in (("plan", GPT, RUNS), ("plan_moe", MOE, MOE_RUNS)):
        if runs.exists():
            table = table_from_runs(model, runs)
            (RESULTS / f"{name}.md").write_text(table)
            print(table)
