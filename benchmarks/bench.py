"""`make bench`: interleaved benchmarks of runner against a hand-written PyTorch script.

Each configuration runs `--reps` times; the order rotates every repetition so
slow drift of the machine hits every configuration alike. Reported: the median
and the min-max of seconds per optimizer step, and the ratio of medians against
the plain PyTorch baseline. Writes benchmarks/results/<suite>.md and prints it.
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
    measure: Callable[[], float]  # seconds per optimizer step of one run


def runner_step_time(*overrides: str, nproc: int, steps: int) -> float:
    """Seconds per step from a runner run's metrics (steps after WARMUP, evaluation excluded)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "runner.cli", *overrides, f"nproc={nproc}"]
        command += [f"max_steps={steps}", f"log_interval={WARMUP}", "progress_bar=false"]
        command += [f"hydra.run.dir={run_dir}"]
        subprocess.run(command, check=True, capture_output=True, cwd=tmp, env=thread_env(nproc))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["global_batch_size"]
    intervals = [
        batch / r["throughput/samples_per_sec"]
        for r in map(json.loads, lines)
        if r["step"] > WARMUP
    ]
    return statistics.fmean(intervals)


def plain_step_time(*args: str, nproc: int, steps: int) -> float:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(REPO / "benchmarks" / "plain_ddp.py"),
            f"--steps={steps}",
            f"--warmup={WARMUP}",
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=thread_env(nproc),
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["sec_per_step"]


def sync_suite(steps: int) -> list[Config]:
    common = ["model=resnet18", "data=synthetic", "grad_accum=4", "global_batch_size=64"]
    configs = [
        Config(
            "plain PyTorch DDP (no_sync)",
            lambda: plain_step_time(
                "--model=resnet18", "--grad-accum=4", "--global-batch-size=64", nproc=2, steps=steps
            ),
        ),
    ]
    for strategy in ("single_auto_sync", "multi_auto_sync", "forced_sync"):
        configs.append(
            Config(
                f"runner sync_strategy={strategy}",
                lambda s=strategy: runner_step_time(
                    *common, f"sync_strategy={s}", nproc=2, steps=steps
                ),
            )
        )
    return configs


SUITES = {
    "sync": (
        "Sync strategies: resnet18, synthetic 3x32x32, nproc=2, grad_accum=4, global batch 64",
        sync_suite,
    ),
}


def machine() -> str:
    return (
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {metadata.version('torch')}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )


def run_suite(name: str, reps: int, steps: int) -> str:
    title, build = SUITES[name]
    configs = build(steps)
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    for rep in range(reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for config in order:
            times[config.name].append(config.measure())
            print(
                f"  rep {rep + 1}/{reps} {config.name}: {times[config.name][-1]:.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    baseline = statistics.median(times[configs[0].name])
    lines = [
        f"### {title}",
        "",
        f"Machine: {machine()}. {reps} interleaved repetitions of {steps} steps; "
        f"the first {WARMUP} steps of each run are not timed.",
        "",
        "| configuration | median s/step | min-max | ratio vs plain |",
        "|---|---|---|---|",
    ]
    for config in configs:
        values = times[config.name]
        median = statistics.median(values)
        lines.append(
            f"| {config.name} | {median:.3f} | {min(values):.3f}-{max(values):.3f} | "
            f"{median / baseline:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--reps", type=int, default=3)
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
