"""`make bench`: interleaved benchmarks of runner against a hand-written PyTorch script.

Each configuration runs `--reps` times; the order rotates every repetition so
slow drift of the machine hits every configuration alike. Reported per metric:
the median and the min-max, and for seconds per step the ratio of medians
against the plain PyTorch baseline (the first configuration of a suite).
Writes benchmarks/results/<suite>.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
WARMUP = 5  # steps excluded from every timing
STEP = "s/step"
MB = 1024 * 1024


def thread_env(nproc: int) -> dict[str, str]:
    """Identical threading for runner and the baseline: cores split among local ranks.

    torchrun sets only OMP_NUM_THREADS; MKL would otherwise start threads of its own
    in every rank and oversubscribe the cores (measured here: 0.60 vs 0.49 s/step).
    """
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {**os.environ, **dict.fromkeys(names, threads)}


@dataclass
class Config:
    name: str
    measure: Callable[[], dict[str, float]]  # metrics of one run


def run_runner(*overrides: str, nproc: int, steps: int) -> dict[str, float]:
    """One runner run: seconds per step from its metrics (steps after WARMUP, evaluation
    excluded), and rank 0's optimizer state and peak RSS from its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "runner.cli", *overrides, f"nproc={nproc}"]
        command += [f"max_steps={steps}", f"log_interval={WARMUP}", "progress_bar=false"]
        command += [f"hydra.run.dir={run_dir}"]
        subprocess.run(command, check=True, capture_output=True, cwd=tmp, env=thread_env(nproc))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["global_batch_size"]
        summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in lines]
    intervals = [batch / r["throughput/samples_per_sec"] for r in records if r["step"] > WARMUP]
    return {
        STEP: statistics.fmean(intervals),
        "optimizer state MB/rank": max(summary["optimizer_state_bytes"]) / MB,
        "peak RSS MB/rank": max(summary["peak_rss_bytes"]) / MB,
    }


def run_plain(*args: str, nproc: int, steps: int) -> dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", str(REPO / "benchmarks" / "plain_ddp.py")]
    command += [f"--steps={steps}", f"--warmup={WARMUP}", *args]
    proc = subprocess.run(
        command, check=True, capture_output=True, text=True, env=thread_env(nproc)
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        STEP: result["sec_per_step"],
        "optimizer state MB/rank": result["optimizer_state_bytes"] / MB,
        "peak RSS MB/rank": result["peak_rss_bytes"] / MB,
    }


RESNET = ["model=resnet18", "data=synthetic", "global_batch_size=64"]


def plain_resnet(grad_accum: int, steps: int) -> Config:
    args = ("--model=resnet18", f"--grad-accum={grad_accum}", "--global-batch-size=64")
    label = "plain PyTorch DDP" + (" (no_sync)" if grad_accum > 1 else "")
    return Config(label, lambda: run_plain(*args, nproc=2, steps=steps))


def sync_suite(steps: int) -> list[Config]:
    configs = [plain_resnet(4, steps)]
    for strategy in ("single_auto_sync", "multi_auto_sync", "forced_sync"):
        overrides = (*RESNET, "grad_accum=4", f"sync_strategy={strategy}")
        configs.append(
            Config(
                f"runner sync_strategy={strategy}",
                lambda o=overrides: run_runner(*o, nproc=2, steps=steps),
            )
        )
    return configs


def parallelism_suite(steps: int) -> list[Config]:
    configs = [plain_resnet(1, steps)]
    for parallelism in ("ddp", "zero1", "zero2"):
        overrides = (*RESNET, f"parallelism={parallelism}")
        configs.append(
            Config(
                f"runner parallelism={parallelism}",
                lambda o=overrides: run_runner(*o, nproc=2, steps=steps),
            )
        )
    return configs


SUITES = {
    "sync": (
        "Sync strategies: resnet18, synthetic 3x32x32, nproc=2, grad_accum=4, global batch 64",
        sync_suite,
    ),
    "parallelism": (
        "Parallelism: resnet18, synthetic 3x32x32, nproc=2, global batch 64, AdamW, fp32",
        parallelism_suite,
    ),
}


def machine() -> str:
    return (
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {metadata.version('torch')}, deepspeed {metadata.version('deepspeed')}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )


def run_suite(name: str, reps: int, steps: int) -> str:
    title, build = SUITES[name]
    configs = build(steps)
    results: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    for rep in range(reps):
        shift = rep % len(configs)
        for config in configs[shift:] + configs[:shift]:
            results[config.name].append(config.measure())
            print(
                f"  rep {rep + 1}/{reps} {config.name}: {results[config.name][-1]}",
                file=sys.stderr,
                flush=True,
            )
    metrics = list(results[configs[0].name][0])
    baseline = statistics.median(r[STEP] for r in results[configs[0].name])
    header = ["configuration", f"median {STEP} (min-max)", "ratio vs plain", *metrics[1:]]
    lines = [
        f"### {title}",
        "",
        f"Machine: {machine()}. {reps} interleaved repetitions of {steps} steps; the first "
        f"{WARMUP} steps of each run are not timed. Memory columns: median of the largest rank.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for config in configs:
        values = {m: [r[m] for r in results[config.name]] for m in metrics}
        step = values[STEP]
        cells = [
            config.name,
            f"{statistics.median(step):.3f} ({min(step):.3f}-{max(step):.3f})",
            f"{statistics.median(step) / baseline:.3f}",
            *(f"{statistics.median(values[m]):.1f}" for m in metrics[1:]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in SUITES if args.suite == "all" else [args.suite]:
        print(f"benchmark suite {name} ...", file=sys.stderr, flush=True)
        table = run_suite(name, args.reps, args.steps)
        (RESULTS / f"{name}.md").write_text(table)
        print(table, flush=True)


if __name__ == "__main__":
    main()
