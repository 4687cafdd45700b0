"""Memory suites (B3): state and peak memory per rank by parallelism, for resnet18 and a gpt;
activation checkpointing; the largest gpt that fits a fixed budget per rank."""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path

from harness import (
    MB,
    RESNET,
    STATE,
    STEP,
    Config,
    machine,
    plain_resnet,
    run,
    run_runner,
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


# Context parallelism's sequence: 2048 tokens, 2 sequences.
GPT_CONTEXT = ["+recipe=gpt_text", "data.block_size=2048", "global_batch_size=2", "grad_accum=1"]

# A sequence length where activations dominate: 1024 tokens, 8 sequences per rank.
GPT_LONG = [
    "+recipe=gpt_text",
    "data.block_size=1024",
    "global_batch_size=16",
    "eval_interval=null",
]


TP_LAYOUTS = (  # name, ranks sharing the state (N), overrides
    ("ddp, 2 ranks (the whole state on each)", 1, 2, ("parallelism=ddp",)),
    ("fsdp tensor=2, 2 ranks (TP2)", 2, 2, ("parallelism=fsdp", "parallelism.tensor=2")),
    ("fsdp, 4 ranks (FSDP4)", 4, 4, ("parallelism=fsdp",)),
    ("fsdp tensor=2, 4 ranks (FSDP2 x TP2)", 4, 4, ("parallelism=fsdp", "parallelism.tensor=2")),
)


def tensor_parallel_suite(steps: int) -> list[Config]:
    """Per-rank state of one gpt under tensor parallelism, FSDP and both; the baseline is
    ddp, whose ranks each hold the whole state (16 bytes a parameter: fp32 weights,
    gradients, AdamW's two moments)."""
    return [
        Config(f"runner gpt {name}", partial(run_runner, *GPT_WIDE, *extra, nproc=n, steps=steps))
        for name, _, n, extra in TP_LAYOUTS
    ]


def tensor_parallel_notes(medians: dict[str, dict[str, float]]) -> list[str]:
    """Each layout's state per rank against theory: the whole state (ddp's) over N."""
    whole = medians[f"runner gpt {TP_LAYOUTS[0][0]}"][STATE]
    lines = [
        "| layout | state MB/rank | theory 16Ψ/N, MB | measured / theory |",
        "|---|---|---|---|",
    ]
    for name, sharing, _, _ in TP_LAYOUTS:
        measured = medians[f"runner gpt {name}"][STATE]
        theory = whole / sharing
        lines.append(f"| {name} | {measured:.1f} | {theory:.1f} | {measured / theory:.3f} |")
    lines += [
        "",
        "Ψ: the gpt's parameters; 16Ψ: ddp's state per rank. Above 1: what stays whole on "
        "each rank of a tensor group (the norms' weights, which sequence parallelism "
        "replicates) and what FSDP pads to split evenly.",
    ]
    return lines


AC_MODES = ("none", "full", "2", "selective")


ACTIVATIONS = "peak activations MB/rank"


def activation_suite(steps: int) -> list[Config]:
    """Activation checkpointing on the gpt model: step time from a real 2-rank run, and a
    rank's peak activation memory counted tensor by tensor (activation_probe.py: the same
    model, the same microbatch, runner's own checkpointing)."""
    return [
        Config(
            f"runner gpt activation_checkpointing={m}",
            partial(activation_row, (*GPT_LONG, f"activation_checkpointing={m}"), steps),
        )
        for m in AC_MODES
    ]


def activation_row(overrides: tuple[str, ...], steps: int) -> dict[str, float]:
    timed = run_runner(*overrides, nproc=2, steps=steps)
    probe = [sys.executable, str(Path(__file__).parent / "activation_probe.py"), "--ranks=2"]
    counted = json.loads(run([*probe, *overrides], thread_env(2)).strip().splitlines()[-1])
    return {**timed, **counted}


def activation_notes(medians: dict[str, dict[str, float]]) -> list[str]:
    """Each mode's saving of peak activation memory and its extra step time, against none's,
    as shares of full checkpointing's; selective's goal: at least half the saving for at
    most half the extra time."""
    by_mode = {m: medians[f"runner gpt activation_checkpointing={m}"] for m in AC_MODES}
    step = next(k for k in by_mode["none"] if k.startswith("s/step"))
    saving = {m: by_mode["none"][ACTIVATIONS] - v[ACTIVATIONS] for m, v in by_mode.items()}
    extra = {m: v[step] - by_mode["none"][step] for m, v in by_mode.items()}
    lines = [
        "| mode | peak activations saved vs none, MB/rank | share of full's | extra s/step vs "
        "none | share of full's |",
        "|---|---|---|---|---|",
    ]
    for mode in AC_MODES[1:]:
        share_saved = saving[mode] / saving["full"] if saving["full"] else float("nan")
        share_extra = extra[mode] / extra["full"] if extra["full"] else float("nan")
        lines.append(
            f"| {mode} | {saving[mode]:.1f} | {share_saved:.2f} | {extra[mode]:.3f} "
            f"| {share_extra:.2f} |"
        )
    kept = saving["selective"] / saving["full"] if saving["full"] else float("nan")
    cost = extra["selective"] / extra["full"] if extra["full"] else float("nan")
    met = kept >= 0.5 and cost <= 0.5
    lines += [
        "",
        f"Selective keeps {kept:.2f} of full's saving at {cost:.2f} of its extra time (goal: "
        f"at least 0.50 of the saving at no more than 0.50 of the time): "
        f"{'met' if met else 'not met'}.",
        "",
        "Peak activations: the most bytes of tensors a step holds beyond the weights, their "
        "gradients and the optimizer state, counted tensor by tensor in one process (the "
        "same model, a rank's microbatch and runner's checkpointing: "
        "benchmarks/activation_probe.py); exact, unlike peak RSS, which adds the allocator's "
        "slack and the process's own memory. Step time: the 2-rank runs above.",
    ]
    return lines


# Per rank: peak resident memory (torch itself, about 450 MB, included). Large enough that
# a rank's fixed cost (torch, DeepSpeed, the allocator's heap) is not most of it: sharding
# over 2 ranks halves 16Ψ at best, so a small budget leaves nothing for the model to gain.
BUDGET_MB = 3072
CAPACITY_WIDTH = 1024
CAPACITY_LAYERS = (4, 8, 12, 16, 20, 24)
GPT_CAPACITY = [
    "+recipe=gpt_text",
    f"model.n_embd={CAPACITY_WIDTH}",
    "model.n_head=16",
    "data.block_size=64",
    "global_batch_size=4",
    "eval_interval=null",
    "eval_batches=1",
    "grad_clip_norm=null",
    "logger=[]",
]
LEAN_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # glibc: every block >= 1 MB its own map
# glibc's own heap, as a sharded CPU rank had it before runner set the threshold itself: the
# ceiling its dynamic threshold grows to (a set variable is left alone)
GLIBC_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
CAPACITY_RUNS = {  # the table's rows: parallelism, how its ranks build the model, environment
    "ddp": (("parallelism=ddp",), {}),
    "zero3, meta_init": (("parallelism=zero3",), {}),
    "zero3, whole model built first": (("parallelism=zero3", "parallelism.meta_init=false"), {}),
    "fsdp, meta_init": (("parallelism=fsdp",), {}),
    "fsdp, whole model built first": (("parallelism=fsdp", "parallelism.meta_init=false"), {}),
    "ddp, MALLOC_MMAP_THRESHOLD_=1MB": (("parallelism=ddp",), LEAN_MALLOC),
    "zero3, meta_init, MALLOC_MMAP_THRESHOLD_=32MB": (("parallelism=zero3",), GLIBC_HEAP),
    "fsdp, meta_init, MALLOC_MMAP_THRESHOLD_=32MB": (("parallelism=fsdp",), GLIBC_HEAP),
}


def gpt_parameters(
    n_layer: int, width: int = CAPACITY_WIDTH, vocab: int = 256, block: int = 64
) -> int:
    """The capacity gpt's parameter count (runner/models/gpt.py, no biases, untied head)."""
    per_layer = 12 * width * width + 2 * width
    return n_layer * per_layer + 2 * vocab * width + block * width + width


PEAK, BUILT = "peak RSS MB/rank", "build peak RSS MB/rank"
PEAK_0, PEAK_OTHERS = "peak RSS MB, rank 0", "peak RSS MB, ranks but 0"  # 0 writes model.pt


def measure_state(*overrides: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """A short 2-rank run (3 steps): the largest rank's state and peak RSS, in MB."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, "nproc=2", "max_steps=3", "log_interval=1"]
        command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
        run(command, {**thread_env(2), **(env or {})}, cwd=tmp)
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        PEAK: max(summary["peak_rss_bytes"]) / MB,
        PEAK_0: summary["peak_rss_bytes"][0] / MB,
        PEAK_OTHERS: max(summary["peak_rss_bytes"][1:]) / MB,
        BUILT: max(summary["build_peak_rss_bytes"]) / MB,
    }


def capacity_table(_reps: int, _steps: int, _deadline: float | None = None) -> str:
    """The deepest capacity gpt whose ranks stay within BUDGET_MB of peak resident memory
    at nproc=2, AdamW fp32: each row climbs CAPACITY_LAYERS until a run's largest rank
    goes over the budget (or fails). Each run also says its peak before the first step."""
    lines = [
        f"### Capacity: the largest gpt ({CAPACITY_WIDTH} wide, 64-token blocks, global batch "
        f"4) that trains at nproc=2 within {BUDGET_MB} MB of peak resident memory per rank, "
        "AdamW, fp32",
        "",
        f"Machine: {machine()}. One 3-step run per depth ({', '.join(map(str, CAPACITY_LAYERS))}"
        " layers), climbing until the largest rank's peak RSS (summary.json) exceeds the "
        "budget. 4Ψ: the whole model's fp32 parameters; state: what a rank holds of "
        "parameters, gradients and AdamW's two moments (summary.json state_bytes; ZeRO-3's "
        "16Ψ/N); built: the peak RSS before the first step (building, sharding, loading; "
        "summary.json build_peak_rss_bytes); trained: the peak RSS of the whole run, of rank "
        "0 (which also writes model.pt at the end, one gathered tensor at a time) and of the "
        "other rank. A rank that imported torch and joined its process group holds about "
        "450-600 MB before any model (DeepSpeed's ranks about 730 MB). 16Ψ: the whole model's "
        "training state (fp32 parameters, gradients, AdamW's two moments), which ddp holds on "
        "every rank. MALLOC_MMAP_THRESHOLD_=1MB: glibc maps every block of 1 MB or more on its "
        "own and returns it when freed, instead of keeping freed memory in its heap, paying "
        "for it in page faults on every step; runner sets it for sharded CPU ranks (zero3, "
        "fsdp) unless the variable is set. MALLOC_MMAP_THRESHOLD_=32MB: the ceiling of "
        "glibc's own threshold, which keeps the freed blocks in the heap (those ranks before "
        "runner set it).",
        "",
        "| ranks build | layers | parameters (M) | 4Ψ MB | 16Ψ MB | state MB/rank | "
        "built: peak RSS MB/rank "
        "| trained: peak RSS MB, rank 0 / rank 1 | rank 1's peak - state MB | "
        "next depth's peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, (overrides, env) in CAPACITY_RUNS.items():
        fits, over = None, None
        for n_layer in CAPACITY_LAYERS:
            try:
                depth = f"model.n_layer={n_layer}"
                result = measure_state(*GPT_CAPACITY, *overrides, depth, env=env)
            except SystemExit:  # the run failed (out of memory): the one before is the last
                over = {PEAK: float("nan")}
                break
            print(f"  {label} n_layer={n_layer}: {result}", file=sys.stderr, flush=True)
            if result[PEAK] > BUDGET_MB:
                over = result
                break
            fits = (n_layer, result)
        beyond = f"{over[PEAK]:.0f}" if over else "(ladder ends)"
        if fits is None:
            lines.append(f"| {label} | none | | | | | | | | {beyond} |")
            continue
        n_layer, result = fits
        params = gpt_parameters(n_layer)
        peak, others, state = result[PEAK_0], result[PEAK_OTHERS], result[STATE]
        lines.append(
            f"| {label} | {n_layer} | {params / 1e6:.1f} | {4 * params / MB:.0f} "
            f"| {16 * params / MB:.0f} | {state:.0f} "
            f"| {result[BUILT]:.0f} | {peak:.0f} / {others:.0f} | {others - state:.0f} "
            f"| {beyond} |"
        )
    return "\n".join(lines) + "\n"


# Pipeline parallelism at fixed work: one gpt, one global batch in 4 microbatches, on 1 rank
# (no pipeline) and on 2 ranks as 2 pipeline stages under each schedule.
GPT_PIPELINE = [*GPT_WIDE, "model.n_layer=4", "grad_accum=4", "parallelism=fsdp"]
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
PIPELINE_MICROBATCHES = 4


def pipeline_suite(steps: int) -> list[Config]:
    """Step time and state per rank against P at fixed work (the bubble): pipeline=1 on one
    rank, then pipeline=2 on two under each schedule."""
    alone = Config(
        "runner gpt pipeline=1, 1 rank",
        partial(run_runner, *GPT_PIPELINE, nproc=1, steps=steps),
    )
    return [alone] + [
        Config(
            f"runner gpt pipeline=2 {schedule}, 2 ranks",
            partial(
                run_runner,
                *GPT_PIPELINE,
                "parallelism.pipeline=2",
                f"parallelism.pipeline_schedule={schedule}",
                nproc=2,
                steps=steps,
            ),
        )
        for schedule in PIPELINE_SCHEDULES
    ]


def pipeline_notes(medians: dict[str, dict[str, float]]) -> list[str]:
    """Each schedule's step time against the ideal of P stages with its bubble."""
    alone = medians["runner gpt pipeline=1, 1 rank"][STEP]
    p, m = 2, PIPELINE_MICROBATCHES
    lines = [
        "| schedule | s/step ratio to 1 rank | ideal with its bubble | bubble share (theory) |",
        "|---|---|---|---|",
    ]
    for schedule in PIPELINE_SCHEDULES:
        virtual = 1 if schedule in ("gpipe", "1f1b") else 2
        bubble = (p - 1) / (virtual * m + p - 1)
        ideal = 1 / (p * (1 - bubble))
        ratio = medians[f"runner gpt pipeline=2 {schedule}, 2 ranks"][STEP] / alone
        lines.append(f"| {schedule} | {ratio:.3f} | {ideal:.3f} | {bubble:.3f} |")
    lines += [
        "",
        f"P={p} stages of the gpt, m={m} microbatches; the bubble is (P-1)/(v·m+P-1) of a step "
        "for v stages per rank, so the ideal ratio is 1/(P(1-bubble)). On this machine's CPU "
        "ranks the stages also share its cores and memory bandwidth: read the ratios between "
        "schedules, not as a GPU's.",
    ]
    return lines


CONTEXTS = (1, 2, 4)


def context_suite(steps: int) -> list[Config]:
    """Peak activation bytes per rank of one gpt step at a long sequence, the sequence split
    over C = 1, 2, 4 ranks (activation_probe.py --context: runner's own split)."""
    return [Config(f"runner gpt context={c}", partial(context_row, c)) for c in CONTEXTS]


def context_row(context: int) -> dict[str, float]:
    probe = [str(Path(__file__).parent / "activation_probe.py"), "--ranks=1"]
    if context > 1:
        launch = [venv_tool("torchrun"), f"--nproc-per-node={context}"]
        command = [*launch, *probe, f"--context={context}"]
    else:
        command = [sys.executable, *probe]
    counted = json.loads(
        run([*command, *GPT_CONTEXT], thread_env(context)).strip().splitlines()[-1]
    )
    return {ACTIVATIONS: counted[ACTIVATIONS]}


def context_notes(medians: dict[str, dict[str, float]]) -> list[str]:
    whole = medians["runner gpt context=1"][ACTIVATIONS]
    lines = ["| context | activations MB/rank | share of context=1's |", "|---|---|---|"]
    for c in CONTEXTS:
        measured = medians[f"runner gpt context={c}"][ACTIVATIONS]
        lines.append(f"| {c} | {measured:.1f} | {measured / whole:.3f} |")
    lines += [
        "",
        "Counted tensor by tensor during one training step of the same sequences (not RSS). "
        "Each rank keeps its positions' activations, plus every position's keys and values "
        "while a block's attention runs (the all-gather), and its positions' logits.",
    ]
    return lines
